"""Chained, content-addressed block hashes.

``h_i = BLAKE2b-256(msgpack([h_{i-1}, token ids of block i, extra keys of block i]))``

with the parent as 32 raw bytes, the token ids as one ``bin`` of little-endian uint32 (fixed width,
so the bytes are the same on every platform) and the extra keys as a msgpack array or nil.
BLAKE2b is cryptographic (nobody can craft a prompt that collides with another's prefix) and,
through CPython's built-in implementation, about twice as fast per block as OpenSSL's SHA-256.

Only full blocks have a hash. The chain starts at a root derived from the model's identity, so two
models (or one model with another dtype, block size or KV layout) never share a block, and a
request's ``cache_salt`` enters the first block's extra keys, so two tenants never share a chain.

Everything here is plain Python (msgpack + hashlib): the router imports it without torch, and the
same bytes come out on every process and host. Python's ``hash()`` is never used: it is salted per
process.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

import msgpack

# 32 raw bytes of BLAKE2b-256. Bytes (not hex) keep dict lookups and wire messages small.
BlockHash = NewType("BlockHash", bytes)

HASH_SCHEME = "splitserve-block-hash/v1-blake2b256"
"""Bumped whenever the hash input format changes, so old indexes can never match new hashes."""

_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_blake2b = hashlib.blake2b
_DIGEST = 32


DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block, unless configured otherwise (the same on the router and every node)."""

KV_LAYOUT = "block-major/v1"

# The dtype names a checkpoint or an option may give (models.config accepts the same), each
# mapped to the one name that enters the identity.
_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def canonical_dtype(dtype: object) -> str:
    """``float32``, ``float16`` or ``bfloat16`` for any accepted spelling (``fp16``,
    ``torch.bfloat16``, a ``torch.dtype``, ...); ``ValueError`` for anything else."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16") from None


QUANTIZATIONS = ("fp8",)
"""What ``--quantization`` takes (models.quantization runs it)."""

# quantization_config["quant_method"] of checkpoints published in FP8 that the loader reads.
_FP8_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")


def canonical_quantization(name: object) -> str:
    """``fp8`` for any accepted spelling; ``""`` for none; ``ValueError`` for anything else."""
    text = str(name or "").strip().lower()
    if text in ("", "none"):
        return ""
    if text not in QUANTIZATIONS:
        raise ValueError(
            f"unsupported quantization {name!r}; use one of {', '.join(QUANTIZATIONS)}"
        )
    return text


KV_CACHE_DTYPES = ("auto", "fp8")
"""What ``--kv-cache-dtype`` takes: the model's dtype, or e4m3 with per-layer scales."""


def canonical_kv_cache_dtype(name: object) -> str:
    """``""`` for the model's dtype (None, ``auto``), ``fp8`` for e4m3; ``ValueError`` else."""
    text = str(name or "auto").strip().lower()
    if text not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unsupported KV cache dtype {name!r}; use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return "" if text == "auto" else text


def checkpoint_quantization(config: dict) -> str:
    """The quantization a checkpoint's ``config.json`` (as a dict) is stored in: ``""`` (none)
    or ``fp8``; ``ValueError`` naming the method for one this engine does not read (GPTQ, AWQ,
    bitsandbytes, an integer compressed-tensors scheme ...). Torch-free."""
    qc = config.get("quantization_config")
    if not qc:
        return ""
    if not isinstance(qc, dict):
        raise ValueError("config.json: quantization_config is not an object")
    method = qc.get("quant_method")
    if method not in _FP8_METHODS:
        raise ValueError(
            f"checkpoint quantized with {method!r}: splitserve reads FP8 checkpoints "
            f"(quant_method {', '.join(_FP8_METHODS)}) and 16/32-bit ones (which --quantization "
            "fp8 quantizes at load)"
        )
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        for name, group in groups.items():
            weights = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(weights, dict):
                raise ValueError(f"compressed-tensors group {name!r} describes no weights")
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ValueError(
                    f"compressed-tensors group {name!r} stores {weights.get('num_bits')}-bit "
                    f"{weights.get('type')} weights: splitserve reads 8-bit float (FP8) ones"
                )
            if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
                raise ValueError(
                    f"compressed-tensors format {qc.get('format')!r}: splitserve reads "
                    "float-quantized (FP8) checkpoints"
                )
    return "fp8"


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What makes KV bytes of one model incompatible with another's.

    Every process that computes hashes for a cluster (router, prefill and decode nodes, and
    ``splitserve hash``) builds it with :meth:`for_checkpoint`; :attr:`root_hash` is what they
    compare at start-up.
    """

    name: str
    revision: str = "main"
    dtype: str = "float32"
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_layout: str = KV_LAYOUT
    quantization: str = ""  # "" or "fp8": the weights' quantization (it changes the KV computed)
    kv_cache_dtype: str = ""  # "" (the dtype's) or "fp8": the KV bytes' format

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ModelIdentity.name must be a non-empty model name or path")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @classmethod
    def for_checkpoint(
        cls,
        path: str | Path,
        dtype: object = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_layout: str = KV_LAYOUT,
        quantization: object = None,
        kv_cache_dtype: str | None = None,
    ) -> ModelIdentity:
        """The identity of a checkpoint folder served in ``dtype`` with ``block_size``: its name
        and a digest of its ``config.json`` (so the router and every node agree without sharing
        a path). ``dtype`` None is the checkpoint's own, by the model loader's rule: its
        ``config.json``'s ``dtype`` (or legacy ``torch_dtype``), else float32. ``quantization``
        None is the checkpoint's own (its ``quantization_config``); ``fp8`` also names a 16-bit
        checkpoint quantized at load. ``kv_cache_dtype``: ``fp8`` for an FP8 KV cache (None or
        ``auto``: the dtype's). Torch-free."""
        path = Path(path)
        try:
            raw = (path / "config.json").read_bytes()
            config = json.loads(raw)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a model folder: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}/config.json is not a JSON object")
        if dtype is None:
            dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        stored = checkpoint_quantization(config)
        wanted = canonical_quantization(quantization) if quantization else stored
        if stored and wanted != stored:
            raise ValueError(f"{path} is quantized as {stored}, not {wanted or 'none'}")
        return cls(
            path.name or str(path),
            hashlib.sha256(raw).hexdigest()[:16],
            canonical_dtype(dtype),
            block_size,
            kv_layout,
            wanted,
            canonical_kv_cache_dtype(kv_cache_dtype),
        )

    @property
    def root_hash(self) -> BlockHash:
        """The parent hash of every request's first block."""
        return BlockHash(
            _blake2b(
                _packb(
                    [
                        HASH_SCHEME,
                        self.name,
                        self.revision,
                        self.dtype,
                        self.block_size,
                        self.kv_layout,
                        # Only when set: the roots of unquantized models stay what they were.
                        *([self.quantization] if self.quantization else []),
                        *([f"kv:{self.kv_cache_dtype}"] if self.kv_cache_dtype else []),
                    ]
                ),
                digest_size=_DIGEST,
            ).digest()
        )


def _bin_header(length: int) -> bytes:
    """msgpack's header for a ``bin`` field of ``length`` bytes."""
    return _packb(bytes(length))[:-length]


_TOKEN_BYTES = 4
_BIG_ENDIAN = sys.byteorder == "big"
_ARRAY3 = b"\x93"  # msgpack: an array of 3 elements
_PREFIX = _ARRAY3 + _bin_header(32)  # up to the parent hash's bytes
_NIL = b"\xc0"
assert array("I").itemsize == _TOKEN_BYTES


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, the form in which they enter block hashes.

    Raises ``ValueError`` for anything that is not an int in ``[0, 2**32)`` (a negative id, a float,
    a string), so that two token lists hash alike iff they are equal.
    """
    try:
        arr = array("I", token_ids)
    except OverflowError:
        ids = list(token_ids)
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise ValueError(
            f"token ids must be in [0, 2**32), found {bad} at position {ids.index(bad)}"
        ) from None
    except TypeError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def hash_block_tokens(
    parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """Hash one full block given its parent's hash (the reference form of one chain step)."""
    data = _packb([parent_hash, encode_token_ids(token_ids), extra_keys])
    return BlockHash(_blake2b(data, digest_size=_DIGEST).digest())


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root_hash: bytes,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Append to ``block_hashes`` the hashes of the full blocks of ``token_ids`` it lacks.

    ``block_hashes`` must already hold the hashes of the first ``len(block_hashes)`` blocks of the
    same token list (that is how a growing request is hashed incrementally). Returns the list.
    Equal to chaining :func:`hash_block_tokens`, only faster: the msgpack encoding of
    ``[parent, tokens, extra]`` is assembled from precomputed headers instead of packed per block.
    Every token id not yet hashed is validated, also those of a partial tail block.
    """
    start = len(block_hashes)
    num_full = len(token_ids) // block_size
    # Tokens of blocks already hashed are neither re-encoded nor re-validated.
    buf = encode_token_ids(token_ids[start * block_size :] if start else token_ids)
    nbytes = block_size * _TOKEN_BYTES
    head = _bin_header(nbytes)
    parent = block_hashes[-1] if block_hashes else root_hash
    join, append = b"".join, block_hashes.append
    for i in range(start, num_full):
        # NOTE: the salt is an extra key of block 0 only; the chain carries it to every later
        # block, so repeating it would only cost bytes.
        extra = _packb((cache_salt,)) if i == 0 and cache_salt is not None else _NIL
        off = (i - start) * nbytes
        parent = _blake2b(
            join((_PREFIX, parent, head, buf[off : off + nbytes], extra)), digest_size=_DIGEST
        ).digest()
        # NOTE: the digest is a BlockHash; BlockHash(...) would cost a call per block here.
        append(parent)  # pyright: ignore[reportArgumentType]
    return block_hashes


MAX_SALT_CHARS = 256  # a cache salt (tenant name) longer than this is refused everywhere


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    root_hash: bytes,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """The chained hashes of the full blocks of ``token_ids`` (a partial tail block has none)."""
    return extend_block_hashes([], token_ids, block_size, root_hash, cache_salt)
