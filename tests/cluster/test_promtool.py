"""Prometheus's own check of deploy/prometheus/prometheus.yml (the compose `monitoring` profile's
scrape config) where `promtool` is installed; without it, the config's structure is checked in
tests/unit/test_compose.py (every cluster service scraped at the components' metrics port)."""

import shutil
import subprocess
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "prometheus.yml"


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    done = subprocess.run(
        [promtool, "check", "config", str(CONFIG)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
