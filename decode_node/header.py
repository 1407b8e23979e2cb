"""Checks of a ``TransferHeader`` before anything is reserved for it.

A sender's header is a claim: the model, the block layout, the prompt and the block hashes must
all be what this node would compute itself, or the transfer is refused before a block is touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.kvstore.hashing import MAX_SALT_CHARS
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime.failure import Failure
from splitserve.runtime.protocol import sampling_from_proto

if TYPE_CHECKING:
    from splitserve.engine.api import EngineInfo
    from splitserve.v1 import nodes_pb2


class Refused(Exception):
    """A call (or one request of a relay stream) this node refuses; ``code`` is why (the
    servicer answers with its gRPC status, ``runtime.status.to_grpc``), the message says what to
    change."""

    def __init__(self, code: Failure, message: str) -> None:
        super().__init__(message)
        self.code = code


class TransferRefused(Refused):
    """A transfer this node refuses (or gives up on)."""


def check_header(
    header: nodes_pb2.TransferHeader,
    info: EngineInfo,
    identity: ModelIdentity,
    in_use: Callable[[str], bool],
) -> tuple[SamplingParams, list[int]]:
    """The request's sampling parameters and prompt, or ``TransferRefused``. ``info``: the
    engine's (block size in bytes, prompt and vocabulary checks); ``in_use(rid)``: the id is
    taken here."""
    bad = Failure.INVALID
    if not header.request_id:
        raise TransferRefused(bad, "request_id is empty")
    if in_use(header.request_id):
        raise TransferRefused(
            Failure.ALREADY_EXISTS,
            f"request {header.request_id!r} is already on this node",
        )
    if header.model_root_hash != identity.root_hash:
        raise TransferRefused(
            bad,
            f"model identity mismatch: this decode node serves "
            f"{identity}; the sender computed a different root hash",
        )
    if not (math.isfinite(header.deadline_s) and header.deadline_s >= 0):
        raise TransferRefused(
            bad, f"deadline_s must be a finite number >= 0, got {header.deadline_s}"
        )
    if len(header.cache_salt) > MAX_SALT_CHARS:
        raise TransferRefused(bad, f"cache_salt is over {MAX_SALT_CHARS} characters")
    block_nbytes = info.block_nbytes
    if header.block_nbytes != block_nbytes:
        raise TransferRefused(bad, f"block_nbytes {header.block_nbytes} != {block_nbytes}")
    try:
        params = sampling_from_proto(header.sampling)
        prompt = info.check_prompt(header.prompt_token_ids)
    except ValueError as exc:
        raise TransferRefused(bad, str(exc)) from None
    vocab = info.vocab_size
    if header.first_token_id >= vocab:
        raise TransferRefused(bad, f"first_token_id {header.first_token_id} >= vocab {vocab}")
    # The hashes must be the chain of these very tokens, or a later prompt would read this
    # sender's blocks under hashes they do not belong to.
    expected = hash_request_tokens(
        prompt, identity.block_size, identity.root_hash, header.cache_salt or None
    )
    if list(header.block_hashes) != expected:
        raise TransferRefused(bad, "block_hashes do not match the prompt's chained hashes")
    return params, prompt
