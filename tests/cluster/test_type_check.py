"""Type checkers follow the imports: pyright resolves every subpackage of the install.

The package-dir mapping (router/ -> splitserve.router, ...) is invisible to static tools through
the editable install's import hook; scripts/setup.sh links .venv/import-tree for them and
pyproject.toml's [tool.pyright] points at it. This runs the checker on a file importing each
installed subpackage and one module inside each.
"""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["packages"]


def _a_module(package: str) -> str | None:
    """The name of one module inside `package`'s folder, or None if it has only __init__.py."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    folder = ROOT / mapping.get(package, package.replace(".", "/"))
    names = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    return f"{package}.{names[0]}" if names else None


def test_pyright_resolves_every_subpackage(tmp_path: Path) -> None:
    assert (ROOT / ".venv" / "import-tree" / "splitserve").is_dir(), (
        "no .venv/import-tree: run scripts/setup.sh"
    )
    lines = []
    for package in _packages():
        lines.append(f"import {package}")
        module = _a_module(package)
        if module is not None:
            lines.append(f"import {module}")
    probe = tmp_path / "probe.py"
    probe.write_text("\n".join(lines) + "\n")

    run = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", "-p", str(ROOT), str(probe)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    report = json.loads(run.stdout)
    problems = [
        f"{d['range']['start']['line'] + 1}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]
    assert report["summary"]["filesAnalyzed"] >= 1
    assert not problems, "pyright does not resolve:\n" + "\n".join(problems)
    assert len(lines) > len(_packages())
