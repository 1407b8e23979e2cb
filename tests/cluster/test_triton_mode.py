"""The suite's Triton mode (tests/conftest.py): compiled wherever CUDA is present, so tests/gpu run
the real kernels whether started alone or with the whole suite; the interpreter elsewhere; an
explicit TRITON_INTERPRET wins. Checked in fresh interpreters with CUDA's presence stubbed."""

import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _mode(cuda: bool, env_value: str | None) -> str:
    code = (
        "import os, runpy, sys, torch\n"
        f"torch.cuda.is_available = lambda: {cuda}\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        f"if {env_value!r} is not None: os.environ['TRITON_INTERPRET'] = {env_value!r}\n"
        "runpy.run_path(sys.argv[1])\n"
        "print(os.environ['TRITON_INTERPRET'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(CONFTEST)], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("cuda", "given", "mode"),
    [(True, None, "0"), (False, None, "1"), (True, "1", "1"), (False, "0", "0")],
)
def test_triton_mode(cuda, given, mode):
    assert _mode(cuda, given) == mode
