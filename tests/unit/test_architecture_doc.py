"""docs/architecture.md cites only what exists: every file path in backticks is in the tree, every
code name (``KVShipper``, ``LLMEngine.add_request``, ``kernels.ops.reshape_and_cache``,
``PrefillNodeService.Prefill``) is defined in the package or its .proto files.

What counts as what, for a span between backticks outside code blocks:

- a path: it has a ``/`` or ends in a file suffix (``router/front.py``, ``tests/gpu/``,
  ``compose.yaml``); with a folder, it must exist from the repository root, without one, a file
  of that name must exist somewhere in the tree;
- a name: a dotted identifier. Each part after the first must be defined inside the one before it
  (a module's or class's ``def``/``class``/assignment/field/import, a message's field, a service's
  rpc); the first part must be a module, a definition, an imported name or a .proto name anywhere
  in the package (a one-letter first part is a placeholder: ``D.Generate`` is node D's rpc). A
  single lowercase or upper-case word (``free``, ``tiny``, ``INVALID_ARGUMENT``) may also be any
  identifier or string the package uses;
- an option (``--direct-prefill-tokens``): a config field or a string of the package must name it;
  a call (``allocate_slots(request_id, ...)``) is checked as its name;
- anything else (commands, metric names, URLs, placeholders with ``<...>``) is not checked.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]
SUFFIXES = (".py", ".md", ".sh", ".proto", ".yaml", ".yml", ".toml", ".json", ".conf", ".js")
RPC = re.compile(
    r"rpc\s+(\w+)\s*\(\s*(?:stream\s+)?(\w+)\s*\)\s*returns\s*\(\s*(?:stream\s+)?(\w+)"
)
FIELD = re.compile(r"(?:(?:repeated\s+|optional\s+)?[\w.]+\s+)?(\w+)\s*=\s*\d+")
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
# Names of things outside the tree the doc speaks of: files a checkpoint has, the Python builtins.
OUTSIDE = {"config.json", "None", "oneof"}


def cited(text: str) -> list[str]:
    """The inline code spans of a Markdown text, fenced blocks left out."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def is_path(span: str) -> bool:
    if span.startswith(".") and "/" not in span:  # a suffix (`.proto`), not a file
        return False
    return bool(re.fullmatch(r"[\w./\-\[\]]+", span)) and (
        "/" in span or span.endswith(SUFFIXES) or span == "Dockerfile"
    )


SKIPPED_DIRS = {".git", ".venv", "node_modules", "build", "dist", "__pycache__"}


@functools.cache
def tracked_files() -> list[str]:
    """The tree's files (relative paths), without the environment, builds and caches."""
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith((".gpu", "."))]
        found += [str((Path(folder) / n).relative_to(ROOT)) for n in names]
    return found


def path_exists(span: str, files: list[str]) -> bool:
    if span in OUTSIDE or span.startswith(("~", "/")):
        return True
    if "/" not in span.rstrip("/"):
        return any(Path(f).name == span for f in files) or (ROOT / span).exists()
    return (ROOT / span).exists()


class Index:
    """What the package defines: ``members[scope]`` holds the names defined in a scope (a module
    by every dotted name it is known by, a class, a message, a service); ``anywhere`` the
    definitions of every scope; ``words`` every identifier and identifier-like string used."""

    def __init__(self) -> None:
        self.members: dict[str, set[str]] = defaultdict(set)
        self.anywhere: set[str] = set()
        self.words: set[str] = set()
        self.rpc_messages: dict[str, tuple[str, str]] = {}  # rpc -> (request, response)

    def define(self, scopes: list[str], name: str) -> None:
        for scope in scopes:
            self.members[scope].add(name)
        self.anywhere.add(name)

    def add_module(self, dotted: str, path: Path) -> None:
        """``dotted`` (``splitserve.router.front``) and its shorter forms (``router.front``,
        ``front``) all name the module."""
        parts = dotted.split(".")
        scopes = [".".join(parts[i:]) for i in range(len(parts))]
        self.anywhere.update(scopes)
        for i in range(len(parts) - 1):  # a package holds its modules
            self.define([".".join(parts[j : i + 1]) for j in range(i + 1)], parts[i + 1])
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            self._top(scopes, node)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                self.words.add(node.id)
            elif isinstance(node, ast.Attribute):
                self.words.add(node.attr)
            elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
                self.words.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                self.words.update(re.findall(r"[A-Za-z_][\w-]*", node.value))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.define([], node.name)
            elif isinstance(node, ast.ImportFrom):  # names the package uses from elsewhere
                self.anywhere.update(alias.asname or alias.name for alias in node.names)

    def _top(self, scopes: list[str], node: ast.stmt) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            self.define(scopes, node.name)
        elif isinstance(node, ast.ClassDef):
            self.define(scopes, node.name)
            for scope in scopes:
                self._class(f"{scope}.{node.name}", node)
            self._class(node.name, node)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                self.define(scopes, (alias.asname or alias.name).split(".")[0])
        else:
            for name in _assigned(node):
                self.define(scopes, name)
            for child in ast.iter_child_nodes(node):  # if/try at module level
                if isinstance(child, ast.stmt):
                    self._top(scopes, child)

    def _class(self, scope: str, node: ast.ClassDef) -> None:
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.define([scope], item.name)
            for name in _assigned(item):
                self.define([scope], name)
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                for sub in ast.walk(item):  # self.x = ... in methods
                    for target in _targets(sub):
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id == "self"
                        ):
                            self.define([scope], target.attr)

    def add_proto(self, path: Path) -> None:
        scope = None
        for line in path.read_text().splitlines():
            line = line.split("//")[0].strip()
            if m := re.match(r"(message|service|enum)\s+(\w+)", line):
                scope = m.group(2)
                self.define(["splitserve.v1", "v1"], scope)
            elif m := RPC.match(line):
                self.define([scope or ""], m.group(1))
                self.rpc_messages[m.group(1)] = (m.group(2), m.group(3))
            elif m := FIELD.match(line):  # a field, or an enum's value
                self.define([scope or ""], m.group(1))

    def has(self, dotted: str) -> bool:
        parts = dotted.split(".")
        if len(parts) == 1:
            plain = dotted.islower() or dotted.isupper()  # `free`, `INVALID_ARGUMENT`
            return dotted in self.anywhere or (plain and dotted in self.words)
        head, *rest = parts
        if len(head) == 1:  # a placeholder: `P.Prefill(...)` is prefill node P's rpc
            return self.has(".".join(rest))
        if head not in self.anywhere:
            return False
        for i in range(1, len(parts)):  # the longest known scope, then its members in turn
            scope = ".".join(parts[:i])
            if scope in self.members and self._inside(scope, parts[i:]):
                return True
        # An rpc's request or response field: ``GetStats.transfer_endpoint``.
        if head in self.rpc_messages and len(rest) == 1:
            return any(rest[0] in self.members[m] for m in self.rpc_messages[head])
        return False

    def _inside(self, scope: str, names: list[str]) -> bool:
        for name in names:
            if name not in self.members.get(scope, ()):
                return False
            scope = f"{scope}.{name}"
        return True


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def _assigned(node: ast.AST) -> list[str]:
    names = []
    for target in _targets(node):
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                names.append(sub.id)
    return names


@functools.cache
def package_index() -> Index:
    index = Index()
    for package, folder in PACKAGE_DIRS.items():
        pattern = "**/*.py" if package == "splitserve" else "*.py"
        for path in sorted((ROOT / folder).glob(pattern)):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            relative = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in relative.parts if p != "__init__"]
            index.add_module(".".join([package, *parts]), path)
    for proto in sorted((ROOT / "proto").rglob("*.proto")):
        index.add_proto(proto)
    return index


def stale_citations(text: str, index: Index, files: list[str]) -> list[str]:
    stale = []
    for span in dict.fromkeys(cited(text)):
        span = re.sub(r"\(.*\)$", "", span)  # a call: `allocate_slots(request_id, ...)`
        if re.fullmatch(r"--[a-z][a-z0-9-]*", span):  # an option: a config field or a literal
            if span[2:].replace("-", "_") not in index.words and span[2:] not in index.words:
                stale.append(f"no such option: `{span}`")
        elif is_path(span):
            if not path_exists(span, files):
                stale.append(f"no such file: `{span}`")
        elif NAME.fullmatch(span) and span not in OUTSIDE and not index.has(span):
            stale.append(f"not defined in the package: `{span}`")
    return stale


def test_every_file_and_name_the_architecture_doc_cites_exists():
    stale = stale_citations(DOC.read_text(), package_index(), tracked_files())
    assert not stale, "docs/architecture.md cites what is not there:\n" + "\n".join(stale)


def test_the_check_sees_a_missing_file_and_a_missing_name():
    index, files = package_index(), tracked_files()
    text = (
        "`router/front.py` has `RequestFront.run`; `KVShipper.ship`, "
        "`kernels.ops.reshape_and_cache` and `PrefillNodeService.Prefill` exist.\n"
        "```\n`router/gone.py` in a code block\n```\n"
    )
    assert stale_citations(text, index, files) == []
    stale = stale_citations(
        "`router/gone.py`, `gone.py`, `RequestFront.gone`, `NoSuchClass`, `kernels.ops.gone`, "
        "`--no-such-option`, `P.Gone(decode_address=D)`",
        index,
        files,
    )
    assert len(stale) == 7, stale
