"""Every environment variable is declared once (splitserve.settings) and read only through that
declaration; `splitserve env` lists them, and docs/deploy.md holds its table."""

from __future__ import annotations

import ast
import os
import re
import tomllib
from pathlib import Path

import pytest

import splitserve.settings as settings
from splitserve import cli

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
REGISTRY_DIR = ROOT / PACKAGE_DIRS["splitserve.settings"]
ENV_FUNCTIONS = {"getenv", "getenvb", "putenv", "unsetenv", "environ", "environb"}


def _package_files() -> list[Path]:
    files = set()
    for folder in PACKAGE_DIRS.values():
        files |= set((ROOT / folder).glob("**/*.py"))
    return sorted(f for f in files if REGISTRY_DIR not in f.parents and "_pb2" not in f.name)


def _direct_reads(path: Path) -> list[str]:
    """Each place the file touches the process environment itself: ``os.environ``,
    ``os.getenv``... and ``from os import environ``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ENV_FUNCTIONS
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            found.append(f"{path.name}:{node.lineno} os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [
                f"{path.name}:{node.lineno} from os import {a.name}"
                for a in node.names
                if a.name in ENV_FUNCTIONS
            ]
    return found


def test_no_module_reads_the_environment_but_the_registry():
    files = _package_files()
    assert any(f.name == "decode_attention.py" for f in files)  # every part, kernels included
    reads = [r for path in files for r in _direct_reads(path)]
    assert not reads, (
        "read these through a declaration in settings/ (splitserve env lists it):\n"
        + "\n".join(reads)
    )


def test_the_check_sees_a_direct_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\nfrom os import getenv\n"
        "def f():\n    return os.environ.get('X') or getenv('Y') or os.getenv('Z')\n"
    )
    assert sorted(_direct_reads(bad)) == [
        "bad.py:2 from os import getenv",
        "bad.py:4 os.environ",
        "bad.py:4 os.getenv",
    ]
    assert _direct_reads(REGISTRY_DIR / "__init__.py")  # the registry itself reads it


def test_every_splitserve_variable_named_in_the_code_is_declared():
    # A name typed in a message or passed to option_value must be a declaration or an option's,
    # or one of the compose files' (the planner sets those for `docker compose`).
    compose = {
        m for f in ROOT.glob("compose*.yaml") for m in re.findall(r"\$\{(\w+)", f.read_text())
    }
    assert "SPLITSERVE_NUM_DECODE" in compose
    declared = set(settings.REGISTRY) | set(cli.option_variables()) | compose
    named = set()
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named |= set(re.findall(r"\bSPLITSERVE_[A-Z0-9_]*[A-Z0-9]\b", node.value))
    named -= {"SPLITSERVE_"}  # the options' prefix (runtime/options.py)
    assert "SPLITSERVE_HOST" in named and "SPLITSERVE_PORT_FILE" in named  # the health command's
    assert not named - declared, f"not declared: {sorted(named - declared)}"


def test_a_setting_parses_and_names_itself_in_an_error():
    s = settings.ENGINE_STOP_TIMEOUT_S
    assert s.get({}) == 20.0
    assert s.get({s.name: " "}) == 20.0  # empty counts as unset
    assert s.get({s.name: "2.5"}) == 2.5
    for bad in ("0", "-1", "nan", "3601", "soon"):
        with pytest.raises(ValueError, match=rf"{s.name}='{bad}': expected seconds in \(0, 3600\]"):
            s.get({s.name: bad})
    assert settings.ROUTER_TORCH.get({settings.ROUTER_TORCH.name: "yes"}) is True
    assert settings.ROUTER_TORCH.get({settings.ROUTER_TORCH.name: "off"}) is False
    with pytest.raises(ValueError, match="SPLITSERVE_ROUTER_TORCH='2'"):
        settings.ROUTER_TORCH.get({settings.ROUTER_TORCH.name: "2"})
    assert settings.DECODE_ATTENTION_CONFIG.get(
        {"SPLITSERVE_DECODE_ATTENTION_CONFIG": "64,4,3"}
    ) == (
        64,
        4,
        3,
    )


def test_a_library_variable_given_by_the_user_wins():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert settings.TORCH_NCCL_ASYNC_ERROR_HANDLING.set_default("2", env) == "3"
    env = {}
    assert settings.TORCH_NCCL_ASYNC_ERROR_HANDLING.set_default("2", env) == "2"
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def test_a_handshake_is_taken_once(monkeypatch):
    monkeypatch.setenv(settings.PARENT_PID.name, "123")
    assert settings.environment()[settings.PARENT_PID.name] == "123"
    assert settings.PARENT_PID.take() == "123"
    assert settings.PARENT_PID.name not in os.environ  # not passed on to grandchildren
    assert settings.PARENT_PID.take() == ""


def test_env_lists_every_variable(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line and line[0].isupper()}
    assert listed == set(settings.REGISTRY) | set(cli.option_variables())
    assert "SPLITSERVE_REDIS_URL  --redis-url, router/prefill/decode" in out
    assert len(settings.REGISTRY) >= 20 and len(cli.option_variables()) >= 60


def test_deploy_doc_holds_the_listing():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    begin, end = "<!-- splitserve env --markdown -->\n", "<!-- end of splitserve env --markdown -->"
    assert begin in doc and end in doc
    table = doc.split(begin, 1)[1].split(end, 1)[0]
    assert table == cli.env_listing(markdown=True), (
        "docs/deploy.md's table is out of date: paste the output of `splitserve env --markdown`"
    )
    for name in settings.REGISTRY:
        assert f"`{name}`" in table


def test_a_serving_command_refuses_a_bad_setting_before_it_starts(monkeypatch, capsys):
    monkeypatch.setenv("SPLITSERVE_ENGINE_STOP_TIMEOUT_S", "soon")
    monkeypatch.setenv("SPLITSERVE_DECODE_FP8_V", "int4")
    assert cli.main(["decode", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert (
        "SPLITSERVE_ENGINE_STOP_TIMEOUT_S='soon'" in err and "SPLITSERVE_DECODE_FP8_V='int4'" in err
    )
    assert cli.main(["up", "--model", "tiny"]) == 2
    monkeypatch.delenv("SPLITSERVE_ENGINE_STOP_TIMEOUT_S")
    monkeypatch.delenv("SPLITSERVE_DECODE_FP8_V")
    monkeypatch.setenv("SPLITSERVE_ROUTER_TORCH", "maybe")
    assert cli.main(["router", "--model", "tiny"]) == 2
    assert "SPLITSERVE_ROUTER_TORCH='maybe'" in capsys.readouterr().err
    assert settings.problems(*settings.NODE_SETTINGS) == []  # the router's variable is not theirs


def test_every_knob_is_checked_by_the_command_that_reads_it():
    checked = set(settings.NODE_SETTINGS) | set(settings.ROUTER_SETTINGS)
    knobs = {s for s in settings.REGISTRY.values() if s.kind == "tuning"}
    assert knobs == checked, sorted(s.name for s in knobs ^ checked)
