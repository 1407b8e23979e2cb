"""Block hashing: chaining, identity seeding, salts, validation (the same bytes in another
interpreter: tests/cluster/test_hash_matches_node.py)."""

import hashlib
import random

import msgpack
import pytest

from splitserve.kvstore.hashing import (
    ModelIdentity,
    encode_token_ids,
    extend_block_hashes,
    hash_block_tokens,
    hash_request_tokens,
)

BS = 16


def _tokens(n, vocab=128_256):
    return [random.randrange(vocab) for _ in range(n)]


def test_chain_matches_reference_step_and_spec():
    """The fast path equals chaining hash_block_tokens, which equals the documented formula."""
    root = ModelIdentity("llama", dtype="bfloat16").root_hash
    tokens = _tokens(5 * BS + 7)
    fast = hash_request_tokens(tokens, BS, root, cache_salt="tenant-a")
    parent, slow = root, []
    for i in range(5):
        block = tokens[i * BS : (i + 1) * BS]
        extra = ("tenant-a",) if i == 0 else None
        by_spec = hashlib.blake2b(
            msgpack.packb([parent, b"".join(t.to_bytes(4, "little") for t in block), extra]),
            digest_size=32,
        ).digest()
        parent = hash_block_tokens(parent, block, extra)
        assert parent == by_spec
        slow.append(parent)
    assert fast == slow
    assert all(len(h) == 32 for h in fast)


def test_only_full_blocks_are_hashed():
    root = ModelIdentity("m").root_hash
    assert hash_request_tokens(_tokens(BS - 1), BS, root) == []
    assert len(hash_request_tokens(_tokens(BS), BS, root)) == 1
    assert len(hash_request_tokens(_tokens(3 * BS + BS - 1), BS, root)) == 3


def test_prefix_property_and_divergence():
    root = ModelIdentity("m").root_hash
    a = _tokens(4 * BS)
    b = a[: 2 * BS] + [(t + 1) % 1000 for t in a[2 * BS :]]
    ha, hb = hash_request_tokens(a, BS, root), hash_request_tokens(b, BS, root)
    assert ha[:2] == hb[:2]
    # Chained: once blocks differ, every later hash differs too, even for equal later tokens.
    assert all(x != y for x, y in zip(ha[2:], hb[2:], strict=True))
    c = a[: 3 * BS] + b[3 * BS :]
    hc = hash_request_tokens(c, BS, root)
    assert hc[:3] == ha[:3] and hc[3] != hb[3]


def test_incremental_extension_equals_full_hash():
    root = ModelIdentity("m").root_hash
    tokens = _tokens(10 * BS + 3)
    hashes = []
    for end in [*sorted(random.sample(range(1, len(tokens) + 1), 6)), len(tokens)]:
        extend_block_hashes(hashes, tokens[:end], BS, root, cache_salt="s")
    assert hashes == hash_request_tokens(tokens, BS, root, cache_salt="s")


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", "other-model"),
        ("revision", "v2"),
        ("dtype", "float16"),
        ("block_size", 32),
        ("kv_layout", "layer-major/v1"),
    ],
)
def test_root_seeded_by_every_identity_field(field, value):
    base = ModelIdentity("llama", revision="v1", dtype="bfloat16", block_size=16)
    other = ModelIdentity(**{**_fields(base), field: value})
    assert base.root_hash != other.root_hash
    tokens = _tokens(2 * 32)
    assert (
        hash_request_tokens(tokens, 16, base.root_hash)[0]
        != hash_request_tokens(tokens, 16, other.root_hash)[0]
    )


def _fields(identity):
    return {f: getattr(identity, f) for f in identity.__dataclass_fields__}


def test_cache_salt_separates_tenants():
    root = ModelIdentity("m").root_hash
    tokens = _tokens(3 * BS)
    plain = hash_request_tokens(tokens, BS, root)
    a = hash_request_tokens(tokens, BS, root, cache_salt="a")
    b = hash_request_tokens(tokens, BS, root, cache_salt="b")
    assert len({plain[0], a[0], b[0]}) == 3
    assert not set(a) & set(b) and not set(a) & set(plain)


@pytest.mark.parametrize("bad", [[1, 2, -3, 4], [1, 2.0, 3], ["7"], [2**32], [None]], ids=repr)
def test_bad_token_ids_raise(bad):
    root = ModelIdentity("m").root_hash
    tokens = _tokens(BS) + bad
    with pytest.raises(ValueError, match="token ids"):
        hash_request_tokens(tokens, BS, root)
    with pytest.raises(ValueError, match="token ids"):
        encode_token_ids(bad)


def test_bad_identity_raises():
    with pytest.raises(ValueError, match="name"):
        ModelIdentity("")
    with pytest.raises(ValueError, match="block_size"):
        ModelIdentity("m", block_size=0)
