"""A node's engine in a process of its own: the node (its gRPC front) spawns it, and it holds the
GPU — the scheduler, the model, the KV cache and the KV transfer sides that read and write it —
while the front holds the servicers, parsing, streaming and the transfer control RPCs.

    front (node process)                          engine process
    EngineClient ── commands socket ──────────▶  serve_commands(LocalEngine)
                 ◀── outputs socket (a frame per step, written by the engine thread)

They talk ``engine.protocol`` over two socket pairs made before the spawn (no address, no port:
nothing else can connect). Either side's end ends the other: the engine process stops when the
front's connection closes (the node exited or was killed); the node exits with a clear message
when the engine process goes (``on_gone``), and the router sees it go (its calls fail, its health
check stops answering) and retries elsewhere.

    python -m splitserve.runtime.engine_process CMD_FD OUT_FD     (spawned by the node, not by hand)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import splitserve.settings as settings
from splitserve.runtime.config import NodeConfig

logger = logging.getLogger(__name__)

GONE_EXIT_CODE = 70  # the node's exit status when its engine process went (EX_SOFTWARE)
GONE_GRACE_S = 0.5  # the node's calls get their error out before it exits


async def spawn_engine(config: NodeConfig, role: str) -> Any:
    """Start the engine process for this node, wait until its model is loaded, and return its
    ``EngineClient``. ``RuntimeError`` with the engine process's reason if it could not start."""
    from splitserve.engine.client import EngineClient, reap

    cmd_front, cmd_engine = socket.socketpair()
    out_front, out_engine = socket.socketpair()
    fds = (cmd_engine.fileno(), out_engine.fileno())
    from splitserve.engine import lifeline
    from splitserve.runtime import gpus

    locks = gpus.held_locks()
    proc = subprocess.Popen(
        # (-P: no working directory on sys.path, whose folders could shadow packages: launcher)
        [sys.executable, "-P", "-m", "splitserve.runtime.engine_process", *map(str, fds)],
        # The node's GPU locks go with it: held while either process lives (a node restarted
        # by its supervisor cannot claim a GPU an engine process still holds memory on); it
        # hands them on to its tensor-parallel ranks (engine.ranks) in turn.
        pass_fds=(*fds, *locks),
        # It ends with this process however this one ends (engine.lifeline): killed outright,
        # this node's front leaves no engine process holding the GPU.
        env=lifeline.child_env(
            settings.environment(**{settings.GPU_LOCK_FDS.name: ",".join(map(str, locks))})
        ),
    )
    cmd_engine.close()
    out_engine.close()
    loop = asyncio.get_running_loop()

    def gone(why: str) -> None:
        code = proc.poll()
        status = "still running" if code is None else f"exit status {code}"
        logger.critical(
            "the engine process (pid %d, %s) is gone: %s; this %s node exits",
            proc.pid,
            status,
            why,
            role,
        )
        loop.call_later(GONE_GRACE_S, os._exit, GONE_EXIT_CODE)

    reader, writer = await asyncio.open_unix_connection(sock=cmd_front)
    # (the outputs' writer is kept: a StreamWriter that is collected closes its socket)
    outputs, outputs_writer = await asyncio.open_unix_connection(sock=out_front)
    client = EngineClient((reader, writer), (outputs, outputs_writer), on_gone=gone)
    try:
        await client.connect(role, dataclasses.asdict(config))
    except BaseException:
        writer.close()
        await asyncio.to_thread(reap, proc, 10.0)
        raise
    client.process = proc
    logger.info("%s node: engine process %d ready", role, proc.pid)
    return client


async def _serve(cmd_fd: int, out_fd: int) -> int:
    from splitserve.engine.protocol import HELLO, REPLY, START, VERSION, error_value, frame
    from splitserve.engine.server import OutputWriter, read_frame, serve_commands
    from splitserve.runtime.node import local_engine

    cmd = socket.socket(fileno=cmd_fd)
    reader, writer = await asyncio.open_unix_connection(sock=cmd)
    try:
        start = await read_frame(reader)
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        return 1  # the node went before it said what to run
    try:
        if not (isinstance(start, list) and len(start) == 4 and start[0] == START):
            raise ValueError(f"expected START, got {start!r:.200}")
        if start[1] != VERSION:
            raise ValueError(f"the node speaks protocol version {start[1]}, this engine {VERSION}")
        role, fields = str(start[2]), start[3]
        config = NodeConfig(**fields)
        out = OutputWriter(socket.socket(fileno=out_fd))
        engine = local_engine(config, role, deliver=out.deliver, fail=out.fail, bounded_stop=False)
    except Exception as exc:
        logger.exception("engine process: cannot start")
        writer.write(frame([REPLY, 0, False, error_value(exc)]))
        await writer.drain()
        return 1
    writer.write(frame([HELLO, VERSION, engine.info]))
    why = await serve_commands(engine, reader, writer)
    out.close()
    logger.info("engine process %d ends: %s", os.getpid(), why)
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )
    # Ctrl-C in a terminal reaches the whole process group: the node drains and then stops this
    # process itself; a SIGTERM sent here alone still ends it (and the node with it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from splitserve.engine import lifeline
    from splitserve.runtime import gpus

    lifeline.die_with_parent()  # SIGKILLed when the node's process ends, however it ends
    gpus.inherit_locks(settings.GPU_LOCK_FDS.take())
    if len(argv) != 2:
        print("usage: python -m splitserve.runtime.engine_process CMD_FD OUT_FD", file=sys.stderr)
        return 2
    return asyncio.run(_serve(int(argv[0]), int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
