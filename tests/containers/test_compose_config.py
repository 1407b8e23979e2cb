"""The compose files as Docker Compose (where installed) and podman-compose read them: `config` of
compose.yaml and compose.cpu.yaml, with the cluster token and API key secrets they mount by
default, and with compose.open.yaml, which turns both off (the structural checks without either
tool are in tests/unit/test_compose.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _docker_compose() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        proc = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [docker, "compose"] if proc.returncode == 0 else None


def test_docker_compose_accepts_the_file():
    compose = _docker_compose()
    if compose is None:
        pytest.skip(
            "no `docker compose` (the Compose v2 plugin) on PATH; the structural checks of "
            "compose.yaml in tests/unit/test_compose.py run without it"
        )
    proc = subprocess.run(
        [*compose, "-f", str(ROOT / "compose.yaml"), "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_podman_compose_reads_both_files(name):
    # podman-compose is a test dependency: both files must be valid for it as well as for docker.
    proc = subprocess.run(
        [sys.executable, "-m", "podman_compose", "-f", str(ROOT / name), "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    assert set(services) == {"redis", "router", "prefill", "decode"}
    if name == "compose.cpu.yaml":
        assert all(s["network_mode"] == "host" for s in services.values())
        assert len({s["hostname"] for s in services.values()}) == 4


def test_podman_compose_reads_the_monitoring_profile():
    compose = [sys.executable, "-m", "podman_compose", "--profile", "monitoring"]
    proc = subprocess.run(
        [*compose, "-f", str(ROOT / "compose.yaml"), "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    services = set(yaml.safe_load(proc.stdout)["services"])
    assert services == {"redis", "router", "prefill", "decode", "prometheus", "grafana", "jaeger"}


def _podman_config(tmp_path, *files: str, env: dict | None = None) -> dict:
    token, keys = tmp_path / "token", tmp_path / "keys"
    token.write_text("t" * 43)
    keys.write_text("k" * 43 + "\n")
    paths = {"SPLITSERVE_TOKEN_PATH": str(token), "SPLITSERVE_API_KEYS_PATH": str(keys)}
    cmd = [sys.executable, "-m", "podman_compose"]
    for name in files:
        cmd += ["-f", str(ROOT / name)]
    proc = subprocess.run(
        [*cmd, "config"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, **paths, **(env or {})},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_every_component_gets_the_token_and_the_router_the_api_keys_by_default(tmp_path, name):
    config = _podman_config(tmp_path, name)
    for service_name in ("router", "prefill", "decode"):
        service = config["services"][service_name]
        env = service["environment"]
        assert env["SPLITSERVE_AUTH_TOKEN_FILE"] == "/run/secrets/cluster_token", service_name
        assert "cluster_token" in str(service["secrets"])
    router = config["services"]["router"]
    assert router["environment"]["SPLITSERVE_API_KEY_FILE"] == "/run/secrets/api_keys"
    assert "api_keys" in str(router["secrets"])
    assert "redis" in config["services"] and "secrets" not in config["services"]["redis"]


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_the_open_override_turns_both_off(tmp_path, name):
    config = _podman_config(tmp_path, name, "compose.open.yaml")
    for service_name in ("router", "prefill", "decode"):
        env = config["services"][service_name]["environment"]
        assert env["SPLITSERVE_AUTH_TOKEN_FILE"] == "", service_name
        assert env["SPLITSERVE_HOST"]  # merged with the base file's, not replaced
    assert config["services"]["router"]["environment"]["SPLITSERVE_API_KEY_FILE"] == ""
    assert config["secrets"]["cluster_token"]["file"] == "/dev/null"
