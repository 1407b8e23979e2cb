"""The package as a fresh interpreter, pip and protoc see it: the router's and the SDK's modules
load without torch, the wheel installs only the `splitserve` package, stubs generated with
`-I proto` import as `splitserve.v1`, and the committed stubs are what scripts/gen_proto.sh makes
(the import structure itself is checked in tests/unit/test_layering.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    [
        "splitserve.router.server",
        "splitserve.client",
        "splitserve.kvstore",
        "splitserve.runtime.server",
        "splitserve.models.sampling_params",
    ],
)
def test_torch_free_modules(module):
    # A fresh interpreter: the router process (and the SDK) must start without torch.
    code = (
        f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", f"{module} loads torch"


@pytest.mark.slow
def test_wheel_installs_only_the_splitserve_package(tmp_path):
    # From a copy: building in the checkout would leave build/ there, whose stale modules a later
    # wheel would pick up.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".gpu-*")
    shutil.copytree(ROOT, src, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("splitserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"splitserve"}, sorted(top)
    (info,) = dist_info
    if f"{info}/top_level.txt" in names:
        assert zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").split() == [b"splitserve"]
    for module in ("router/server.py", "v1/nodes_pb2_grpc.py", "runtime/node.py", "cli"):
        assert any(name.startswith(f"splitserve/{module}") for name in names), module


def test_protoc_with_proto_as_include_root_makes_importable_stubs(tmp_path):
    # What a user of any language does: -I proto, then import the generated package.
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", *protos],
        check=True,
        cwd=ROOT,
    )  # fmt: skip
    code = (
        "import splitserve.v1.router_pb2_grpc as g, splitserve.v1.nodes_pb2 as n; "
        "assert g.__file__.startswith(sys.argv[1]), g.__file__; "
        "print(n.DESCRIPTOR.package, ' '.join(sorted(n.DESCRIPTOR.services_by_name)))"
    )
    # From tmp_path, not the checkout: the freshly generated modules are the ones imported (the
    # working directory on sys.path, as a user's script has it: scripts/test.sh turns that off).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
    )
    assert out.stdout.split() == [
        "splitserve.v1",
        "DecodeNodeService",
        "NodeStatsService",
        "PrefillNodeService",
    ]


def test_generated_stubs_are_up_to_date(tmp_path):
    subprocess.run(
        ["bash", str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    stubs = "splitserve/v1/*_pb2*.py*"
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.glob(stubs))
    committed = sorted(p.relative_to(ROOT / "proto") for p in (ROOT / "proto").glob(stubs))
    assert generated == committed and len(generated) == 9
    stale = [
        str(p)
        for p in generated
        if (tmp_path / p).read_bytes() != (ROOT / "proto" / p).read_bytes()
    ]
    assert not stale, f"regenerate with scripts/gen_proto.sh: {stale}"
