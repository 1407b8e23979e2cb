"""engine.protocol: every value type a command or an output carries comes back as itself, and
nothing else crosses (an unknown type, a bad frame length, an unknown error kind)."""

from __future__ import annotations

import msgpack
import pytest

from splitserve.engine.api import EngineFigures, EngineInfo, KVSides, KVSpec, Pinned, ResInfo
from splitserve.engine.core import FirstFacts, RequestDoesNotFit, StepOutput
from splitserve.engine.kv_port import Reserved
from splitserve.engine.protocol import (
    CODES,
    MAX_FRAME,
    OUTPUTS,
    TYPES,
    RemoteError,
    error_of,
    error_value,
    frame,
    frame_length,
    outputs_of,
    outputs_value,
    packb,
    unpackb,
)
from splitserve.kvstore.block_pool import BlockRemoved, BlockStored
from splitserve.models.sampling_params import SamplingParams
from splitserve.transfer.errors import Incomplete, TransferTimeout

SAMPLES = [
    Reserved([0, 2], True, [5, 6, 7]),
    ResInfo(3, "tcp", False, True, b"ticket", 1 << 20, 4),
    Pinned(9, [1, 2, 3]),
    EngineFigures(running=2, waiting=1, num_blocks=10, counters={"steps": 3.0}),
    EngineInfo(b"r" * 32, "id", "cpu", 8, 256, 4096, 320, 16, 32768, 100, 1000, 42),
    KVSides(rx_id="a#1", rx_paths=("tcp", "dist"), rx_endpoint=b"\x00e"),
    KVSpec("decode", "h:1", ("tcp", "grpc"), "127.0.0.1", rendezvous_key=b"k"),
    SamplingParams(temperature=0.5, top_k=4, max_tokens=7, stop_token_ids=(3, 4), seed=1),
    BlockStored([b"a" * 32, b"b" * 32]),
    BlockRemoved([b"c" * 32]),
    FirstFacts(3, [b"h" * 32], [4, 5]),
]


def test_the_samples_cover_every_type():
    assert {type(v) for v in SAMPLES} == set(TYPES.values())


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_every_type_comes_back_as_itself(value):
    back = unpackb(packb({"in": [value, (1, 2)]}))
    assert back == {"in": [value, [1, 2]]}
    assert type(back["in"][0]) is type(value)


def test_stored_and_removed_events_stay_apart():
    events = unpackb(packb([BlockStored([b"x" * 32]), BlockRemoved([b"x" * 32])]))
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]


def test_a_type_the_protocol_does_not_carry_is_refused():
    with pytest.raises(TypeError, match="cannot cross"):
        packb(object())
    bogus = msgpack.packb(msgpack.ExtType(max(CODES.values()) + 1, b"\x90"))
    with pytest.raises(ValueError, match="unknown value type"):
        unpackb(bogus)
    short = msgpack.packb(msgpack.ExtType(CODES[Pinned], packb([1])))
    with pytest.raises(ValueError, match="fields"):
        unpackb(short)


def test_a_step_travels_as_one_frame_with_its_facts():
    outs = [
        StepOutput("a", 5, None, None, FirstFacts(16, [b"h" * 32], [1, 2])),
        StepOutput("b", 7, -0.25, "length"),
    ]
    body = frame(outputs_value(outs))
    assert frame_length(body[:4]) == len(body) - 4
    kind, rows = unpackb(body[4:])
    assert kind == OUTPUTS
    assert outputs_of(rows) == outs


def test_a_frame_length_past_the_bound_is_refused():
    with pytest.raises(ValueError, match="max"):
        frame_length((MAX_FRAME + 1).to_bytes(4, "little"))


def test_errors_keep_their_kind_and_message():
    for exc in (ValueError("bad id"), Incomplete("2 of 3"), TransferTimeout("slow")):
        back = error_of(error_value(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
    fit = error_of(error_value(RequestDoesNotFit("r1", "too long")), "r1")
    assert isinstance(fit, RequestDoesNotFit) and fit.request_id == "r1"
    unknown = error_of(error_value(KeyError("k")))
    assert isinstance(unknown, RemoteError) and "KeyError" in str(unknown)
    assert isinstance(error_of("garbage"), RemoteError)


def test_a_subclass_travels_as_its_nearest_known_base():
    class FormatProblem(ValueError):
        pass

    back = error_of(error_value(FormatProblem("bad ticket")))
    assert type(back) is ValueError and "FormatProblem" in str(back) and "bad ticket" in str(back)
    gone = error_of(error_value(ConnectionRefusedError("refused")))
    assert isinstance(gone, RemoteError)  # no known base short of Exception: said as it is


def test_the_engine_stop_timeout_is_the_variables_or_twenty_seconds():
    from splitserve.engine.client import STOP_TIMEOUT_S, stop_timeout_s

    assert stop_timeout_s({}) == STOP_TIMEOUT_S == 20.0
    assert stop_timeout_s({"SPLITSERVE_ENGINE_STOP_TIMEOUT_S": "4.5"}) == 4.5
    for bad in ("soon", "0", "-1", "1e6"):
        with pytest.raises(ValueError, match="SPLITSERVE_ENGINE_STOP_TIMEOUT_S"):
            stop_timeout_s({"SPLITSERVE_ENGINE_STOP_TIMEOUT_S": bad})
