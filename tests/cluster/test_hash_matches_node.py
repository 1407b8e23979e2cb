"""`splitserve hash --model DIR` prints the block hashes a node serving DIR publishes: the CLI,
the router and the nodes build one model identity (checkpoint, its own dtype, block size); and
two interpreters with different hash seeds compute byte-identical block hashes."""

import asyncio
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.processes import start_node, start_redis, start_router

from splitserve.client import Client
from splitserve.kvstore import ModelIdentity
from splitserve.kvstore.hashing import hash_request_tokens
from splitserve.kvstore.redis_index import PrefixIndex
from splitserve.models.tiny import write_random_checkpoint

EXE = shutil.which("splitserve", path=str(Path(sys.executable).parent))
TOKENS = [(7 * i + 3) % 250 for i in range(3 * 16 + 5)]  # 3 full blocks and a partial one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # bfloat16: a checkpoint whose own dtype is not the float32 a name-only identity assumed.
    return write_random_checkpoint(
        tmp_path_factory.mktemp("hash") / "m",
        seed=3,
        dtype="bfloat16",
        with_tokenizer=True,
        num_hidden_layers=1,
    )


def cli_hash(model_dir: Path, *flags: str) -> tuple[bytes, list[str]]:
    """The root hash and the block hashes `splitserve hash` prints for TOKENS."""
    tokens = ",".join(map(str, TOKENS))
    proc = subprocess.run(
        [EXE, "hash", "--model", str(model_dir), *flags, tokens],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("root ")
    blocks = [line.split()[-1] for line in lines if line.startswith("block")]
    return bytes.fromhex(lines[0].split()[1]), blocks


def blocks_held(redis_url: str, root_hash: bytes, node: str, hashes: list[str]) -> int:
    """How many leading blocks of ``hashes`` ``node`` has published to the index."""

    async def run():
        index = PrefixIndex(redis_url, root_hash)
        try:
            found = await index.longest_prefixes([node], [bytes.fromhex(h) for h in hashes])
            return found[node]
        finally:
            await index.close()

    return asyncio.run(run())


def test_hash_prints_what_a_node_serving_the_checkpoint_publishes(model_dir, tmp_path):
    root, hashes = cli_hash(model_dir)
    assert len(hashes) == 3
    assert root == ModelIdentity.for_checkpoint(model_dir).root_hash
    assert cli_hash(model_dir, "--dtype", "bf16") == (root, hashes)  # the same dtype, spelt so
    assert cli_hash(model_dir, "--dtype", "float32")[1] != hashes  # not the checkpoint's dtype
    redis = start_redis(tmp_path)
    procs = [redis]
    try:
        flags = ("--redis-url", redis.address)
        prefill = start_node("prefill", model_dir, tmp_path, *flags)
        decode = start_node("decode", model_dir, tmp_path, *flags)
        procs += [prefill, decode]
        router = start_router(model_dir, tmp_path, [prefill.address], [decode.address], *flags)
        procs.append(router)
        with Client(router.address) as client:
            reply = client.generate(prompt_token_ids=TOKENS, max_tokens=2, ignore_eos=True)
            assert len(reply.token_ids) == 2
        deadline = time.monotonic() + 20
        for node in (prefill.address, decode.address):
            while blocks_held(redis.address, root, node, hashes) < len(hashes):
                assert time.monotonic() < deadline, f"{node} never published these hashes"
                time.sleep(0.2)
    finally:
        for proc in reversed(procs):
            proc.stop()


REPO = Path(__file__).resolve().parents[2]


BS = 16


def _tokens(n, vocab=128_256):
    return [random.randrange(vocab) for _ in range(n)]


_CHILD = """
import sys
from splitserve.kvstore.hashing import ModelIdentity, hash_request_tokens
tokens = [int(t) for t in sys.argv[1].split(",")]
root = ModelIdentity("org/model", revision="abc", dtype="bfloat16").root_hash
hashes = hash_request_tokens(tokens, 16, root, cache_salt="tenant")
sys.stdout.write(root.hex() + "\\n" + "\\n".join(h.hex() for h in hashes))
"""


def test_hashes_identical_across_processes():
    """Two interpreters with different PYTHONHASHSEEDs produce byte-identical hashes."""
    tokens = _tokens(7 * BS + 5)
    outputs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, ",".join(map(str, tokens))],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    lines = outputs[0].splitlines()
    assert len(lines) == 1 + 7
    # And the same bytes as this process computes.
    root = ModelIdentity("org/model", revision="abc", dtype="bfloat16").root_hash
    here = hash_request_tokens(tokens, 16, root, cache_salt="tenant")
    assert lines == [root.hex()] + [h.hex() for h in here]
