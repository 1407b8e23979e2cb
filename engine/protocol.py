"""The wire between a node's gRPC front and its engine process: length-prefixed msgpack frames
over two local sockets, a fixed set of commands and a fixed set of value types.

    commands  (front ⇄ engine)  [CALL, seq, name, args]  →  [REPLY, seq, True, value]
                                                             [REPLY, seq, False, [kind, message]]
    outputs   (engine → front)  [OUTPUTS, [[rid, token, logprob, reason, facts], ...]]  one per step
                                [FAILED, [rid, ...], kind, message]
    first frames: front → engine [START, VERSION, role, config]; engine → front [HELLO, VERSION,
    info] once the model is loaded (or [REPLY, 0, False, [kind, message]] when it could not be).

One outputs frame carries a whole step (not a message per token); the engine thread writes it
itself. Commands are the ``NodeEngine`` methods named in ``COMMANDS`` and nothing else; values
are msgpack's own types plus the dataclasses and named tuples in ``TYPES`` (as ext types), and
errors travel as one of ``ERRORS`` by name. ``VERSION`` changes whenever any of that changes:
both sides refuse a peer of another version at start. Frames are bounded (``MAX_FRAME``): a
length past it ends the connection.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import msgpack

from splitserve.engine.api import (
    EngineFigures,
    EngineInfo,
    KVSides,
    KVSpec,
    Pinned,
    ResInfo,
)
from splitserve.engine.core import FirstFacts, RequestDoesNotFit, StepOutput
from splitserve.engine.kv_port import Reserved
from splitserve.kvstore.block_pool import BlockRemoved, BlockStored
from splitserve.models.sampling_params import SamplingParams
from splitserve.transfer.errors import (
    ChannelClosed,
    Incomplete,
    NotConnected,
    PeerLost,
    StreamFailed,
    TransferError,
    TransferTimeout,
)

VERSION = 2  # 2: index events carry their tier
# Bounds a bad length; the largest frames are block bytes (reads and writes of ~4 MiB runs,
# adopts of at most engine.client.ADOPT_BYTES).
MAX_FRAME = 1 << 30
HEADER = struct.Struct("<I")

START, HELLO, CALL, REPLY, OUTPUTS, FAILED = range(6)

# The commands the front may send: NodeEngine's methods, nothing else.
COMMANDS = frozenset(
    {
        "add_request",
        "add_transferred",
        "abort",
        "end_request",
        "reserve",
        "register",
        "free",
        "holds",
        "count_cached",
        "adopt",
        "pin",
        "unpin",
        "read",
        "read_tier",
        "block_ids",
        "take_events",
        "cache_snapshot",
        "figures",
        "open_kv",
        "rx_reserve",
        "rx_write",
        "rx_receive",
        "rx_finish",
        "rx_cancel",
        "tx_connect",
        "tx_close",
        "tx_send",
        "tx_stream_open",
        "tx_stream_wait",
        "stop",
    }
)

# Value types beyond msgpack's, by ext code. Fields travel in declaration order; tuples come back
# as tuples where the type declares them.
TYPES: dict[int, type] = {
    1: Reserved,
    2: ResInfo,
    3: Pinned,
    4: EngineFigures,
    5: EngineInfo,
    6: KVSides,
    7: KVSpec,
    8: SamplingParams,
    9: BlockStored,
    10: BlockRemoved,
    11: FirstFacts,
}
CODES = {cls: code for code, cls in TYPES.items()}


class EngineGone(ConnectionError):
    """The engine process is gone (exited, killed, or its connection broke)."""


class RemoteError(RuntimeError):
    """An error of the engine process of a kind the front does not know by name."""


ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TimeoutError,
        RuntimeError,
        RequestDoesNotFit,
        TransferError,
        TransferTimeout,
        PeerLost,
        ChannelClosed,
        NotConnected,
        Incomplete,
        StreamFailed,
        EngineGone,
    )
}


def _fields(cls: type) -> tuple[str, ...]:
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)
    return cls._fields  # pyright: ignore[reportAttributeAccessIssue] (a NamedTuple)


_FIELDS = {cls: _fields(cls) for cls in TYPES.values()}
_TUPLE_FIELDS = {
    cls: frozenset(f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple"))
    if dataclasses.is_dataclass(cls)
    else frozenset()
    for cls in TYPES.values()
}


def _default(value: Any) -> Any:
    # (packed with strict_types: named tuples come here rather than go as plain arrays)
    code = CODES.get(type(value))
    if code is None and type(value) is tuple:
        return list(value)
    if code is None:
        raise TypeError(f"{type(value).__name__} cannot cross to the engine process")
    values = [getattr(value, name) for name in _FIELDS[type(value)]]
    return msgpack.ExtType(code, packb(values))


def _ext_hook(code: int, data: bytes) -> Any:
    cls = TYPES.get(code)
    if cls is None:
        raise ValueError(f"unknown value type {code} from the engine connection")
    values = unpackb(data)
    names = _FIELDS[cls]
    if not isinstance(values, list) or len(values) != len(names):
        raise ValueError(f"a {cls.__name__} of {len(values)} fields, expected {len(names)}")
    tuples = _TUPLE_FIELDS[cls]
    kwargs = {
        name: tuple(v) if name in tuples and isinstance(v, list) else v
        for name, v in zip(names, values, strict=True)
    }
    return cls(**kwargs)


def packb(value: Any) -> bytes:
    packed = msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)
    assert packed is not None  # (None only from a Packer without autoreset)
    return packed


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def frame(value: Any) -> bytes:
    """One frame: the length, then the packed value."""
    body = packb(value)
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """A frame's length from its header; ``ValueError`` past ``MAX_FRAME``."""
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes from the engine connection (max {MAX_FRAME})")
    return n


def error_value(exc: BaseException) -> list[str]:
    """An exception as it travels: [kind, message], the kind its nearest class in ``ERRORS``
    (a subclass, e.g. msgpack's ValueErrors, travels as its base, named in the message);
    RemoteError for one with none."""
    name = type(exc).__name__
    for cls in type(exc).__mro__:
        if ERRORS.get(cls.__name__) is cls:
            message = str(exc) if cls is type(exc) else f"{name}: {exc}"
            return [cls.__name__, message]
    return ["RemoteError", f"{name}: {exc}"]


def error_of(value: Any, request_id: str = "") -> BaseException:
    """The exception a [kind, message] stands for (RemoteError for a kind not known here)."""
    if not isinstance(value, list) or len(value) != 2:
        return RemoteError(f"a malformed error from the engine process: {value!r:.200}")
    kind, message = str(value[0]), str(value[1])
    cls = ERRORS.get(kind)
    if cls is RequestDoesNotFit:
        return RequestDoesNotFit(request_id, message)
    if cls is None:
        return RemoteError(message)
    return cls(message)


def outputs_value(outputs: list[StepOutput]) -> list:
    """A step's outputs as one OUTPUTS frame's value (facts as a FirstFacts ext value)."""
    return [OUTPUTS, [list(out) for out in outputs]]


def outputs_of(rows: Any) -> list[StepOutput]:
    if not isinstance(rows, list):
        raise ValueError("an OUTPUTS frame without a list of outputs")
    return [StepOutput(*row) for row in rows]
