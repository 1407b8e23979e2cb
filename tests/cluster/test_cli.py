"""The `splitserve` console script, run as a user would."""

import random
import shutil
import subprocess
import sys
from pathlib import Path

from splitserve.kvstore import ModelIdentity, hash_request_tokens

EXE = shutil.which("splitserve", path=str(Path(sys.executable).parent))


def _run(*args):
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=60)


def test_hash_prints_the_hashes_of_the_checkpoints_identity(tmp_path):
    from splitserve.models.tiny import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "m", num_hidden_layers=1)
    tokens = [random.randrange(1000) for _ in range(2 * 32 + 5)]
    args = ("--block-size", "32", "--salt", "t", ",".join(map(str, tokens)))
    proc = _run("hash", "--model", str(path), *args)
    assert proc.returncode == 0, proc.stderr
    identity = ModelIdentity.for_checkpoint(path, block_size=32)  # as a node serving it builds it
    expected = hash_request_tokens(tokens, 32, identity.root_hash, "t")
    printed = [line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("block")]
    assert printed == [h.hex() for h in expected]
    assert proc.stdout.startswith(f"root {identity.root_hash.hex()}")
    assert "5 tokens in the partial tail block" in proc.stdout


def test_hash_rejects_a_folder_without_a_checkpoint(tmp_path):
    proc = _run("hash", "--model", str(tmp_path), "1,2,3")
    assert proc.returncode == 2 and "not a model folder" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_hash_rejects_negative_token_ids_with_a_clear_message():
    proc = _run("hash", "--model", "tiny", "1,2,-3")
    assert proc.returncode == 2
    assert "non-negative" in proc.stderr or "[0, 2**32)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_kv_demo_runs_and_reports_prefix_hits():
    proc = _run("kv-demo", "--model", "tiny", "--requests", "200", "--num-blocks", "512")
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("200 lookups")
    hit, queried = summary.split(",")[1].split()[0].split("/")
    assert 0 < int(hit) < int(queried)


def test_generate_runs_a_checkpoint_and_rejects_bad_options(tmp_path):
    from splitserve.models.tiny import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "m", with_tokenizer=True)
    proc = _run("generate", "--model-path", str(path), "--max-tokens", "5", "hi", "there")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("'hi' -> ") and "(5 tokens, length" in lines[0]
    assert lines[-1].startswith("10 tokens in")
    bad = _run("generate", "--model-path", str(path), "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr


def test_a_node_refuses_a_device_that_does_not_exist_before_loading_anything():
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device, named in ((f"cuda:{count + 3}", f"cuda:{count + 3}"), ("tpu", "cpu, cuda")):
        proc = _run("decode", "--device", device)
        assert proc.returncode == 2, proc.stderr
        assert named in proc.stderr and "error: --device" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_console_script_reports_a_bad_variable_without_a_traceback(tmp_path):
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [EXE, "router", "--redis-url", "redis://127.0.0.1:1"],
        env={**env, "SPLITSERVE_PORT": "http"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "SPLITSERVE_PORT='http': invalid int value" in proc.stderr
    assert "Traceback" not in proc.stderr
