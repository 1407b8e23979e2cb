"""The router process loads no torch (``keep_torch_out``): a `splitserve router` process maps no
torch library, and the tokenizer it loads without torch gives the same tokens, chat renderings
and text as one loaded beside torch (the tiny model's and the embedded model's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.processes import start_router

from splitserve.models.tiny import write_random_checkpoint
from splitserve.router.request import ModelInfo, chat_token_ids

TEXTS = ["Hello world", "  two  spaces\tand a tab", "accents: é ü ß, 中文, emoji 🙂", ""]
CHAT = [("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4"), ("user", "and 3?")]

# What a router process computes with torch blocked (argv[1]: the checkpoint folder), as JSON.
PROBE = """
import json, sys
from splitserve.router.request import keep_torch_out
assert keep_torch_out()
from splitserve.router.request import ModelInfo, chat_token_ids
texts, chat = json.loads(sys.argv[2]), json.loads(sys.argv[3])
model = ModelInfo.load(sys.argv[1])
tok = model.tokenizer
messages = [(r, c) for r, c in chat]
ids = [tok(t).input_ids for t in texts]
print(json.dumps({
    "torch": "torch" in sys.modules and sys.modules["torch"] is not None,
    "ids": ids,
    "plain": [tok(t, add_special_tokens=False).input_ids for t in texts],
    "chat": list(chat_token_ids(messages, model)),
    "decoded": [tok.decode(i, skip_special_tokens=True) for i in ids],
}))
"""


def _with_torch(path: Path) -> dict:
    model = ModelInfo.load(path)
    tok = model.tokenizer
    messages = [(r, c) for r, c in CHAT]
    ids = [tok(t).input_ids for t in TEXTS]
    return {
        "torch": False,
        "ids": ids,
        "plain": [tok(t, add_special_tokens=False).input_ids for t in TEXTS],
        "chat": list(chat_token_ids(messages, model)),
        "decoded": [tok.decode(i, skip_special_tokens=True) for i in ids],
    }


def _checkpoints(tmp_path: Path) -> list[Path]:
    tiny = write_random_checkpoint(tmp_path / "tiny", seed=3, with_tokenizer=True)
    out = [tiny]
    try:
        from splitserve.models.embedded import resolve_model_path

        out.append(Path(resolve_model_path(None)))
    except ValueError:  # the embedded model's package is not installed: the tiny one alone
        pass
    return out


def test_a_tokenizer_loaded_without_torch_gives_the_same_tokens(tmp_path):
    import torch  # noqa: F401  # this process has torch: the reference

    for path in _checkpoints(tmp_path):
        out = subprocess.run(
            [sys.executable, "-P", "-c", PROBE, str(path), json.dumps(TEXTS), json.dumps(CHAT)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        blocked = json.loads(out.stdout)
        assert not blocked["torch"]
        assert blocked == _with_torch(path), path


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_a_router_process_maps_no_torch_library(tmp_path):
    model = write_random_checkpoint(tmp_path / "m", seed=3, with_tokenizer=True)
    router = start_router(model, tmp_path, [], ["127.0.0.1:9"])  # a node it never reaches
    try:
        maps = Path(f"/proc/{router.popen.pid}/maps").read_text()
        assert "tokenizers" in maps  # the tokenizer is loaded before the router listens
        assert "libtorch" not in maps
    finally:
        router.stop()
