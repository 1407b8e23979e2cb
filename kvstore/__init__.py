"""KV-cache bookkeeping: block hashing, BlockPool, per-request KV cache manager.

Plain Python only (no torch): the router imports the hashing part, and nodes drive the pool from
their schedulers. The KV tensors themselves live in ``kernels``' KV pool, indexed by block id.
"""

from splitserve.kvstore.block import FreeKVCacheBlockQueue, KVCacheBlock
from splitserve.kvstore.block_pool import (
    Adoption,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from splitserve.kvstore.hashing import (
    BlockHash,
    ModelIdentity,
    encode_token_ids,
    extend_block_hashes,
    hash_block_tokens,
    hash_request_tokens,
)
from splitserve.kvstore.kv_cache_manager import ComputedBlocks, KVCacheManager, PrefixCacheStats

__all__ = [
    "Adoption",
    "BlockHash",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ComputedBlocks",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "ModelIdentity",
    "PrefixCacheStats",
    "encode_token_ids",
    "extend_block_hashes",
    "hash_block_tokens",
    "hash_request_tokens",
]
