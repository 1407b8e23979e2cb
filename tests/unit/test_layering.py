"""The package's structure: one namespace, imports that flow one way (that the router's modules
load without torch, and what the wheel holds: tests/cluster/test_packaging.py).

Layers, lowest first (a module may import from its own part and from parts of lower layers only):

    settings  ←  kernels, kvstore, v1 (stubs)  ←  models  ←  transfer  ←  engine  ←  runtime
        ←  prefill_node, decode_node, router  ←  the public face (cli, client, launcher)

Every import counts, those inside functions too: a lazy import still runs back up.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
LAYERS = [
    {"settings"},  # every environment variable, read by kernels up to the face
    {"kernels", "kvstore", "v1"},
    {"models"},
    {"transfer"},
    {"engine"},
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
    """(part, file) of every module of the distribution, from pyproject's package-dir map: each
    part's folder and its sub-packages (``transfer/tcp/``...)."""
    out = []
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).glob("**/*.py")):
            out.append(
                (_part(f"{package}.{path.stem}") if package != "splitserve" else "face", path)
            )
    return out


def test_every_part_has_a_layer():
    parts = {part for part, _ in _modules()}
    assert parts <= set(RANK), f"give these a layer in LAYERS: {sorted(parts - set(RANK))}"
    assert {"router", "kvstore", "models", "runtime", "v1"} <= parts


def test_sub_packages_are_checked_too():
    # A module in a part's sub-package is read, under that part's layer.
    read = {str(path.relative_to(ROOT)): part for part, path in _modules()}
    assert read.get("transfer/tcp/sender.py") == "transfer"
    assert read.get("transfer/dist/group.py") == "transfer"
    assert read.get("splitserve/bench/runner.py") == "face"


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


def test_no_test_helpers_are_installed():
    # Builders of test data live in tests/support/, not in the package every node installs.
    helpers = [str(path.relative_to(ROOT)) for _, path in _modules() if path.stem == "testing"]
    assert not helpers, f"test helpers inside the package: {helpers} (tests/support/ holds them)"


def test_package_root_imports_nothing():
    # Every `import splitserve.x` runs splitserve/__init__.py first: it must stay light.
    assert not [m for _, m in _imports(ROOT / "splitserve" / "__init__.py")]


# gRPC stays at the edges: the servicers, the clients of other nodes, and the plumbing they share
# (server, credentials, TLS, health). Inside, requests and failures are plain types
# (runtime/failure.Failure, mapped to status codes in runtime/status.py only); the core parts never
# see the transport at all. A module that stops importing grpc leaves this list.
CORE = {"settings", "kernels", "kvstore", "models", "transfer", "engine"}
GRPC_EDGE = {
    # the router: its public servicer, and its calls to the nodes
    "router/service.py", "router/registry.py", "router/pool.py",
    "router/prefill_stage.py", "router/decode_stage.py", "router/relay.py",
    # the nodes: their servicers and their calls to peers
    "prefill_node/service.py", "prefill_node/channels.py", "prefill_node/shipper.py",
    "prefill_node/peer_fetch.py", "prefill_node/peer_layer.py",
    "decode_node/service.py",
    # what every server and channel shares
    "runtime/server.py", "runtime/node.py", "runtime/auth.py", "runtime/guard.py",
    "runtime/status.py",
    "runtime/health.py", "runtime/reflection.py", "runtime/tls.py",
    # the public face: the SDK and what starts and checks a cluster
    "splitserve/client.py", "splitserve/types.py", "splitserve/credentials.py",
    "splitserve/launcher.py",
}  # fmt: skip


def _grpc_importers() -> dict[str, str]:
    """{file: part} of every module (generated stubs aside) that imports grpc."""
    out = {}
    for part, path in _modules():
        if part == "v1":
            continue
        if any(m == "grpc" or m.startswith(("grpc.", "grpc_")) for _, m in _imports(path)):
            out[str(path.relative_to(ROOT))] = part
    return out


def test_grpc_only_at_the_edges():
    importers = _grpc_importers()
    in_core = sorted(f for f, part in importers.items() if part in CORE)
    assert not in_core, f"the core imports grpc: {in_core}"
    outside = sorted(set(importers) - GRPC_EDGE)
    assert not outside, (
        f"these import grpc but serve no RPC and call none: {outside} (use the domain's types, "
        "runtime/failure.Failure for a failure; or, for a new servicer or client, add it to "
        "GRPC_EDGE)"
    )
    gone = sorted(GRPC_EDGE - set(importers))
    assert not gone, f"no longer import grpc: take them off GRPC_EDGE: {gone}"


def test_the_grpc_check_sees_an_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from grpc import StatusCode\n    import grpc.aio\n")
    assert [m for _, m in _imports(bad) if m.split(".")[0] == "grpc"] == [
        "grpc",
        "grpc.StatusCode",
        "grpc.aio",
    ]


def test_the_routers_request_path_sees_no_protobuf():
    """Past its servicers and its clients of the nodes, the router handles plain values
    (router/request.GenerateInput, SamplingParams, Failure): no module there imports the
    generated messages, the HTTP front's parser included."""
    seen = sorted(
        str(path.relative_to(ROOT))
        for part, path in _modules()
        if part == "router" and any(m.startswith("splitserve.v1") for _, m in _imports(path))
    )
    outside = [f for f in seen if f not in GRPC_EDGE and f != "router/server.py"]
    assert not outside, f"these router modules import protobuf messages: {outside}"
    assert "router/service.py" in seen  # (the check sees the servicer's import)
