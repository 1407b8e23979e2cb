"""Conversions between protobuf messages and the core's plain dataclasses (protobuf stops at the
servicers)."""

from __future__ import annotations

from splitserve.models.sampling_params import SamplingParams
from splitserve.v1 import common_pb2

# A decode node's whole capacity in the shares of RelayLease and RelayGrant (nodes.proto): parts
# per million (decode_node.leases grants them, router.relay asks for them).
LEASE_WHOLE = 1_000_000

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
