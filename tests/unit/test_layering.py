"""The package's structure: one namespace, imports that flow one way, a torch-free router.

Layers, lowest first (a module may import from its own part and from parts of lower layers only):

    kernels, kvstore, v1 (stubs)  ←  models  ←  transfer  ←  runtime
        ←  prefill_node, decode_node, router  ←  the public face (cli, client, launcher)

Every import counts, those inside functions too: a lazy import still runs back up.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
LAYERS = [
    {"kernels", "kvstore", "v1"},
    {"models"},
    {"transfer"},
    {"runtime"},
    {"prefill_node", "decode_node", "router"},
    {"face"},  # splitserve/ itself: cli, client, launcher (may import one another)
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
SUBPACKAGES = {name.split(".")[1] for name in PACKAGE_DIRS if "." in name}


def _part(module: str) -> str | None:
    """The part a ``splitserve.*`` module belongs to: its subpackage (``splitserve.router.x`` →
    ``router``), or ``face`` for the public face's own modules (``splitserve.cli``)."""
    names = module.split(".")
    if names[0] != "splitserve" or len(names) < 2:
        return None
    return names[1] if names[1] in SUBPACKAGES else "face"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, the names of ``from X import a``
    included as ``X.a`` (``from splitserve import kernels`` imports ``splitserve.kernels``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _modules() -> list[tuple[str, Path]]:
    """(part, file) of every module of the distribution, from pyproject's package-dir map."""
    out = []
    for package, folder in PACKAGE_DIRS.items():
        pattern = "**/*.py" if package == "splitserve" else "*.py"
        for path in sorted((ROOT / folder).glob(pattern)):
            out.append(
                (_part(f"{package}.{path.stem}") if package != "splitserve" else "face", path)
            )
    return out


def test_every_part_has_a_layer():
    parts = {part for part, _ in _modules()}
    assert parts <= set(RANK), f"give these a layer in LAYERS: {sorted(parts - set(RANK))}"
    assert {"router", "kvstore", "models", "runtime", "v1"} <= parts


def test_imports_flow_one_way():
    upward = []
    for part, path in _modules():
        for line, module in _imports(path):
            target = _part(module)
            if target is None or target == part or target not in RANK:
                continue
            if RANK[target] >= RANK[part]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({part}) imports {module}")
    assert not upward, "imports that run back up or sideways:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    # The rule above must be able to fail: a kvstore module importing a node is caught.
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from splitserve.prefill_node.service import PrefillService\n")
    (line, module), *_ = _imports(bad)
    assert line == 2 and RANK[_part(module)] > RANK["kvstore"]


def test_package_root_imports_nothing():
    # Every `import splitserve.x` runs splitserve/__init__.py first: it must stay light.
    assert not [m for _, m in _imports(ROOT / "splitserve" / "__init__.py")]


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
    # From tmp_path, not the checkout: the freshly generated modules are the ones imported.
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert out.stdout.split() == [
        "splitserve.v1",
        "DecodeNodeService",
        "NodeStatsService",
        "PrefillNodeService",
    ]
