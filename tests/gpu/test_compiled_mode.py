"""CPU-runnable checks of tests/gpu/conftest.py: tests/gpu see compiled Triton kernels even
though the suite defaults to the interpreter, and CPU interpreter tests in the same session keep
theirs. Not gpu-marked: nothing here launches a kernel."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from splitserve.kernels import cache_write, decode_attention, elementwise, prefill_attention

IMPORTED_AT_COLLECTION = (cache_write, decode_attention, elementwise, prefill_attention)
REPO = pathlib.Path(__file__).resolve().parents[2]


def kernels_of(module) -> list:
    return [v for v in vars(module).values() if isinstance(v, JITFunction | InterpretedFunction)]


def test_collected_modules_hold_compiled_kernels():
    for module in IMPORTED_AT_COLLECTION:
        found = kernels_of(module)
        assert found, f"no Triton kernel found in {module.__name__}"
        interpreted = [k.__name__ for k in found if not isinstance(k, JITFunction)]
        assert not interpreted, f"{module.__name__}: interpreted {interpreted}"


def test_running_tests_see_the_compiled_modules(triton_kernel_modules):
    assert os.environ.get("TRITON_INTERPRET") == "0"
    assert not triton.knobs.runtime.interpret
    import splitserve.kernels as package

    for module in IMPORTED_AT_COLLECTION:
        assert sys.modules[module.__name__] is module
        assert getattr(package, module.__name__.rsplit(".", 1)[1]) is module
    assert sorted(m.__name__ for m in IMPORTED_AT_COLLECTION) == sorted(triton_kernel_modules)


def test_every_triton_module_is_swapped(triton_kernel_modules):
    sources = (REPO / "kernels").glob("*.py")
    defining = {f"splitserve.kernels.{p.stem}" for p in sources if "@triton.jit" in p.read_text()}
    assert defining == set(triton_kernel_modules)


@pytest.mark.slow
@pytest.mark.parametrize("gpu_first", [False, True], ids=["cpu-then-gpu", "gpu-then-cpu"])
def test_one_session_keeps_the_interpreter_for_cpu_tests(gpu_first):
    """A session with CPU interpreter tests and tests/gpu: both pass in either order (the CPU
    ones launch interpreted kernels on CPU tensors, which compiled ones cannot run)."""
    cpu = "tests/test_kernels_elementwise.py::test_silu_and_mul"
    gpu = "tests/gpu/test_compiled_mode.py"
    paths = [gpu, cpu] if gpu_first else [cpu, gpu]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the suite default
    pytest_args = ["-q", "-p", "no:cacheprovider", "-rs", "-k", "not one_session", *paths]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "skipped" not in out.stdout, out.stdout[-3000:]
