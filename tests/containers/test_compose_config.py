"""The compose files as Docker Compose (where installed) and podman-compose read them: `config` of
compose.yaml, compose.cpu.yaml and the auth override (the structural checks without either tool
are in tests/unit/test_compose.py)."""

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


def test_the_auth_override_gives_every_component_the_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 43)
    proc = subprocess.run(
        [sys.executable, "-m", "podman_compose", "-f", str(ROOT / "compose.yaml"),
         "-f", str(ROOT / "compose.auth.yaml"), "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "SPLITSERVE_TOKEN_PATH": str(token)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    for name in ("router", "prefill", "decode"):
        service = config["services"][name]
        env = service["environment"]
        assert env["SPLITSERVE_AUTH_TOKEN_FILE"] == "/run/secrets/cluster_token", name
        assert env["SPLITSERVE_MODEL"] == "/models"  # merged with compose.yaml's, not replaced
        assert "cluster_token" in str(service["secrets"])
    assert "redis" in config["services"] and "secrets" not in config["services"]["redis"]
