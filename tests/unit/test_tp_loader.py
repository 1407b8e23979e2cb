"""Each tensor-parallel rank loads its shards of a real checkpoint (models/parallel.py's layout):
put back together, the ranks' parameters are the whole model's, whatever the split — KV heads
divided or replicated, a vocabulary the size does not divide (zero-padded), biases of
row-parallel layers whole on every rank. No ranks run here (tests/cluster/test_tensor_parallel.py
runs them); a stand-in backend only lets a group of several ranks be described."""

import pytest
import torch

from splitserve.models.loader import load_model
from splitserve.models.parallel import TPGroup
from splitserve.models.tiny import write_random_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp")
    return write_random_checkpoint(
        path,
        "LlamaForCausalLM",
        seed=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=321,
        attention_bias=True,
        mlp_bias=True,
        max_shard_size="100KB",
    )


def _ranks(path, n):
    return [load_model(path, tp=TPGroup(r, n, backend=object()))[1] for r in range(n)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_ranks_shards_make_the_whole_model(checkpoint, n):
    _, whole = load_model(checkpoint)
    ranks = _ranks(checkpoint, n)
    p = {k: v for k, v in whole.named_parameters()}
    parts = [dict(m.named_parameters()) for m in ranks]
    hd, q, kv = 16, 8 * 16, 2 * 16
    for layer in range(2):
        pre = f"layers.{layer}."
        full_qkv = p[pre + "self_attn.qkv_proj.weight"]
        qs, ks = [], []
        for r, part in enumerate(parts):
            mine = part[pre + "self_attn.qkv_proj.weight"]
            nq = 8 // n * hd
            nkv = (mine.shape[0] - nq) // 2
            qs.append(mine[:nq])
            ks.append(mine[nq : nq + nkv])
            head = ranks[r].shards.kv_heads.start  # replicated past 2 KV heads
            assert torch.equal(mine[nq : nq + nkv], full_qkv[q + head * hd : q + head * hd + nkv])
            v = full_qkv[q + kv + head * hd : q + kv + head * hd + nkv]
            assert torch.equal(mine[nq + nkv :], v)
            bias = part[pre + "self_attn.o_proj.bias"]
            assert torch.equal(bias, p[pre + "self_attn.o_proj.bias"])  # added once, after
        assert torch.equal(torch.cat(qs), full_qkv[:q])
        for name, dim in (("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)):
            got = torch.cat([part[pre + name] for part in parts], dim=dim)
            assert torch.equal(got, p[pre + name]), name
        inter = 256 // n
        gate = torch.cat([part[pre + "mlp.gate_up_proj.weight"][:inter] for part in parts])
        up = torch.cat([part[pre + "mlp.gate_up_proj.weight"][inter:] for part in parts])
        assert torch.equal(torch.cat([gate, up]), p[pre + "mlp.gate_up_proj.weight"])
    for name in ("embed_tokens.weight", "lm_head.weight"):
        rows = torch.cat([part[name] for part in parts])
        assert rows.shape[0] == -(-321 // n) * n
        assert torch.equal(rows[:321], p[name])
        assert not rows[321:].any()  # the padding of the last shard


def test_a_size_that_cannot_split_the_model_is_refused(checkpoint):
    with pytest.raises(ValueError, match="does not divide the 8 attention heads"):
        load_model(checkpoint, tp=TPGroup(0, 3, backend=object()))
    with pytest.raises(ValueError, match="does not divide the 8 attention heads"):
        load_model(checkpoint, tp=TPGroup(0, 16, backend=object()))
