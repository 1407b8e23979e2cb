"""Conversions between protobuf messages and the core's plain dataclasses (protobuf stops at the
servicers)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.models.sampling_params import SamplingParams
from splitserve.v1 import common_pb2

# A decode node's whole capacity in the shares of RelayLease and RelayGrant (nodes.proto): parts
# per million (decode_node.leases grants them, router.relay asks for them).
LEASE_WHOLE = 1_000_000


@dataclass(frozen=True, slots=True)
class Usage:
    """A request's usage, reported with its last message: the router makes it, the client SDK
    hands it back (``splitserve.Usage``); one type for both, the proto's ``Usage`` on the wire."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from a cache instead of being computed
    completion_tokens: int
    time_to_first_token_s: float


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        time_to_first_token_s=usage.time_to_first_token_s,
    )


def usage_from_proto(msg: common_pb2.Usage) -> Usage:
    return Usage(
        msg.prompt_tokens, msg.cached_tokens, msg.completion_tokens, msg.time_to_first_token_s
    )


_OPTIONAL = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """``ValueError`` naming the field when a value is out of range."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    return SamplingParams(
        **kwargs,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=msg.logprobs,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        logprobs=params.logprobs,
    )
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg
