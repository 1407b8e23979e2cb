"""`kubectl kustomize` renders deploy/kubernetes exactly as tests/support/kustomize.py does (the
renderer tests/unit/test_kubernetes_manifests.py checks the manifests with)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.kustomize import render

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _key(d: dict) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("layout", ["base", "overlays/cpu", "overlays/gpu", "overlays/gpu-tp"])
def test_the_renderer_agrees_with_kubectl_kustomize(layout):
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / layout)], capture_output=True, text=True, check=True
    ).stdout
    theirs = {_key(d): d for d in yaml.safe_load_all(out) if d}
    assert theirs == {_key(d): d for d in render(ROOT / layout)}
