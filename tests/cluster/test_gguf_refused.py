"""GGUF files splitserve cannot serve are refused with a message that names what is wrong, before
anything is written, by the conversion and by the `splitserve` console script (the conversion of
the default model's file is checked in tests/unit/test_gguf.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from splitserve.models import gguf as splitserve_gguf

EXE = shutil.which("splitserve", path=str(Path(sys.executable).parent))


def _write_gguf(path: Path, arch: str = "llama", qtype: str = "F32") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    qt = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((4, 256 // block * nbytes), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "qtype", "message"),
    [
        ("gpt2", "F32", "unsupported GGUF architecture 'gpt2'"),
        ("llama", "IQ2_XS", "quantized as IQ2_XS, which splitserve does not convert"),
    ],
)
def test_files_it_cannot_serve_are_refused_with_the_reason(tmp_path, arch, qtype, message):
    file = _write_gguf(tmp_path / f"{arch}-{qtype}.gguf", arch, qtype)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=message):
        splitserve_gguf.ensure_converted(file, cache)
    left = [p.name for p in cache.rglob("*") if p.name != ".lock" and p.is_file()]
    assert not left, f"a refused conversion left files behind: {left}"
    proc = subprocess.run(
        [EXE, "hash", "--model", str(file), "1,2,3"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
