"""EngineClient ⇄ serve_commands over the engine process's own transport (socket pairs, both
sides in this process, an engine stand-in): nothing waits for ever — a stop fails what is left
unanswered, an unknown command is answered, a dead engine fails calls and streams and is
reported once — and adopts travel in bounded commands."""

from __future__ import annotations

import asyncio
import socket

import pytest

from splitserve.engine import client as client_module
from splitserve.engine.api import EngineInfo
from splitserve.engine.client import EngineClient
from splitserve.engine.protocol import HELLO, VERSION, EngineGone, frame
from splitserve.engine.server import read_frame, serve_commands

INFO = EngineInfo(b"r" * 32, "id", "cpu", 1, 1, 16, 16, 16, 1, 1, 1, 0)


class StandIn:
    """Answers ``holds`` at once, never answers ``free``, adopts what fits its room."""

    def __init__(self, room: int = 1 << 30) -> None:
        self.adopt_calls: list[int] = []
        self.room = room

    async def holds(self, request_id: str) -> bool:
        return request_id == "held"

    async def free(self, request_id: str) -> None:
        await asyncio.Event().wait()  # behind a step that never ends

    async def adopt(self, hashes: list, datas: list) -> int:
        self.adopt_calls.append(len(hashes))
        if sum(map(len, datas)) > self.room:
            return 0
        self.room -= sum(map(len, datas))
        return len(hashes)

    async def stop(self) -> None:
        return None


async def connected(engine: StandIn, on_gone=None):
    cmd_front, cmd_engine = socket.socketpair()
    out_front, out_engine = socket.socketpair()

    async def engine_side() -> str:
        reader, writer = await asyncio.open_unix_connection(sock=cmd_engine)
        await read_frame(reader)  # START
        writer.write(frame([HELLO, VERSION, INFO]))
        return await serve_commands(engine, reader, writer)  # pyright: ignore[reportArgumentType]

    serving = asyncio.create_task(engine_side())
    r, w = await asyncio.open_unix_connection(sock=cmd_front)
    out = await asyncio.open_unix_connection(sock=out_front)
    client = EngineClient((r, w), out, on_gone=on_gone)
    assert await client.connect("decode", {}) == INFO
    return client, serving, out_engine


def test_a_stop_fails_what_is_left_unanswered_and_later_calls():
    async def main():
        client, serving, out_engine = await connected(StandIn())
        assert await client.holds("held") is True
        freeing = asyncio.create_task(client.free("r1"))  # to the end: waits through cancels
        await asyncio.sleep(0.05)
        await asyncio.wait_for(client.stop(), 10)
        with pytest.raises(EngineGone):
            await asyncio.wait_for(freeing, 5)
        with pytest.raises(EngineGone):
            await client.holds("r2")
        why = await serving
        assert why in ("stopped by the node", "the node's front closed the connection")
        out_engine.close()

    asyncio.run(main())


def test_an_unknown_command_is_answered_not_left_waiting():
    async def main():
        client, serving, out_engine = await connected(StandIn())
        with pytest.raises(ValueError, match="no command"):
            await asyncio.wait_for(client._send("format_disk", []), 5)
        await client.stop()
        await serving
        out_engine.close()

    asyncio.run(main())


def test_adopts_travel_in_bounded_commands_and_stop_at_a_short_one(monkeypatch):
    monkeypatch.setattr(client_module, "ADOPT_BYTES", 250)

    async def main():
        engine = StandIn(room=500)
        client, serving, out_engine = await connected(engine)
        hashes = [bytes([i]) * 32 for i in range(10)]
        datas = [bytes(100)] * 10
        adopted = await client.adopt(hashes, datas)
        await client.stop()
        await serving
        out_engine.close()
        return adopted, engine.adopt_calls

    adopted, calls = asyncio.run(main())
    assert calls == [2, 2, 2]  # 200 bytes a command; the third found no room
    assert adopted == 4


def test_a_dead_engine_fails_calls_and_streams_and_is_reported_once():
    async def main():
        reports: list[str] = []
        client, serving, out_engine = await connected(StandIn(), on_gone=reports.append)
        queue = client.subscribe("r1")
        freeing = asyncio.create_task(client.free("r1"))
        await asyncio.sleep(0.05)
        out_engine.close()  # the engine process died: its sockets close
        failed = await asyncio.wait_for(queue.get(), 5)
        assert isinstance(failed, EngineGone)
        with pytest.raises(EngineGone):
            await asyncio.wait_for(freeing, 5)
        with pytest.raises(EngineGone):
            await client.holds("r2")
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await client.stop()
        return reports

    reports = asyncio.run(main())
    assert len(reports) == 1 and "closed" in reports[0]
