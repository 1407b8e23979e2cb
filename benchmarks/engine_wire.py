"""What the wire between a node's front and its engine process costs (CPU, no model):

    python benchmarks/engine_wire.py [--outputs 256] [--steps 2000]

Two measurements over the engine process's own transport (``engine.protocol`` frames on a Unix
socket pair, the engine side a thread writing with ``OutputWriter`` as the engine thread does):

* a step's outputs: N ``StepOutput``s (one request in 16 with ``FirstFacts``) packed, written,
  read and unpacked by the front's asyncio reader into ``StepOutput``s — microseconds per step
  frame on each side, against a decode step of ~14 ms on an H200 (docs/benchmarks.md, "The wire
  between a node and its engine process: engine_wire.py");
* a command's round trip: ``holds`` (a trivial command) through ``EngineClient`` and
  ``serve_commands`` on a ``LocalEngine``-shaped stand-in that answers at once — microseconds
  per call, one at a time and 64 in flight.

A shared-memory ring would save the socket's copy and wake-up; these figures say whether there is
anything to save.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time

from splitserve.engine.client import EngineClient
from splitserve.engine.core import FirstFacts, StepOutput
from splitserve.engine.protocol import HELLO, VERSION, frame, outputs_of, outputs_value
from splitserve.engine.server import OutputWriter, read_frame, serve_commands


def step_outputs(n: int, step: int) -> list[StepOutput]:
    return [
        StepOutput(
            f"req-{i:05d}-{'x' * 24}",
            1000 + (i * 7 + step) % 30000,
            None,
            "length" if i % 128 == 0 and step % 8 == 0 else None,
            FirstFacts(i * 16) if i % 16 == 0 else None,
        )
        for i in range(n)
    ]


async def outputs_rate(n: int, steps: int) -> dict:
    front, engine = socket.socketpair()
    writer = OutputWriter(engine)
    batches = [step_outputs(n, s) for s in range(8)]
    pack_s = 0.0

    def produce() -> None:
        nonlocal pack_s
        for s in range(steps):
            t0 = time.perf_counter()
            data = frame(outputs_value(batches[s % 8]))
            pack_s += time.perf_counter() - t0
            writer._send(data)
        writer.close()

    reader, keep = await asyncio.open_unix_connection(sock=front)
    thread = threading.Thread(target=produce)
    t0 = time.perf_counter()
    thread.start()
    got = 0
    unpack_s = 0.0
    while True:
        try:
            message = await read_frame(reader)
        except asyncio.IncompleteReadError:
            break
        t1 = time.perf_counter()
        outs = outputs_of(message[1])
        unpack_s += time.perf_counter() - t1
        got += len(outs)
    wall = time.perf_counter() - t0
    thread.join()
    keep.close()
    assert got == n * steps, (got, n * steps)
    return {
        "frames_per_s": steps / wall,
        "engine_us_per_frame": 1e6 * pack_s / steps,
        "front_us_per_frame": 1e6 * unpack_s / steps,  # unpack + StepOutput rebuild (not read)
        "bytes_per_frame": len(frame(outputs_value(batches[0]))),
    }


class Answering:
    """Stands in for a LocalEngine: answers every command at once."""

    async def holds(self, request_id: str) -> bool:
        return False

    async def stop(self) -> None:
        return None


async def command_rate(calls: int) -> dict:
    from splitserve.engine.api import EngineInfo

    cmd_front, cmd_engine = socket.socketpair()
    out_front, out_engine = socket.socketpair()
    info = EngineInfo(b"r" * 32, "id", "cpu", 1, 1, 16, 16, 16, 1, 1, 1, 0)

    async def engine_side() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=cmd_engine)
        await read_frame(reader)  # START
        writer.write(frame([HELLO, VERSION, info]))
        await serve_commands(Answering(), reader, writer)  # pyright: ignore[reportArgumentType]

    serving = asyncio.create_task(engine_side())
    r, w = await asyncio.open_unix_connection(sock=cmd_front)
    out_r, out_w = await asyncio.open_unix_connection(sock=out_front)
    client = EngineClient((r, w), (out_r, out_w))
    await client.connect("decode", {})
    t0 = time.perf_counter()
    for i in range(calls):
        await client.holds(f"r{i}")
    serial = (time.perf_counter() - t0) / calls
    t0 = time.perf_counter()
    for _ in range(calls // 64):
        await asyncio.gather(*(client.holds(f"r{i}") for i in range(64)))
    batched = (time.perf_counter() - t0) / (calls // 64 * 64)
    await client.stop()
    await serving
    out_engine.close()
    return {"us_per_call_serial": 1e6 * serial, "us_per_call_64_in_flight": 1e6 * batched}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outputs", type=int, default=256, help="outputs per step frame")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    a = asyncio.run(outputs_rate(args.outputs, args.steps))
    b = asyncio.run(command_rate(args.calls))
    print("\n| figure | value |\n|---|---|")
    print(f"| step frames/s ({args.outputs} outputs each) | {a['frames_per_s']:,.0f} |")
    print(f"| bytes per step frame | {a['bytes_per_frame']:,} |")
    print(f"| engine side: pack a step frame (us) | {a['engine_us_per_frame']:.0f} |")
    print(f"| front side: unpack into StepOutputs (us) | {a['front_us_per_frame']:.0f} |")
    print(f"| command round trip, one at a time (us) | {b['us_per_call_serial']:.0f} |")
    print(
        f"| command round trip, 64 in flight (us per call) | {b['us_per_call_64_in_flight']:.0f} |"
    )


if __name__ == "__main__":
    main()
