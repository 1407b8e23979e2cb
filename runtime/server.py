"""What every gRPC process of splitserve does the same way: health and reflection services, the
bound port written to a file for launchers, graceful stop on SIGTERM/SIGINT. Torch-free (the
router runs it); a node's life on top of it is ``runtime.node``."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.runtime.guard import MalformedRequests
from splitserve.runtime.reflection import enable_reflection
from splitserve.runtime.tls import TlsFiles

logger = logging.getLogger(__name__)

# Shipped KV blocks travel in messages of a few MB; allow generous headroom.
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer that was down is tried again within 2 s of coming back (gRPC's default backoff
    # grows to 120 s: a restarted node went unused for ~23 s).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# NOTE: no SO_REUSEPORT unless asked (``reuse_port``: routers sharing one address): a second
# process must fail to bind a taken port, not share it silently.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


def write_port_file(path: str, port: int) -> None:
    """Write a bound port for a launcher, atomically: a poller never reads half a number."""
    tmp = Path(f"{path}.tmp")  # its own: a component writes several port files
    tmp.write_text(str(port))
    tmp.replace(path)


class Server:
    def __init__(
        self,
        host: str,
        port: int,
        service_names: Sequence[str],
        interceptors: Sequence = (),
        max_request_bytes: int | None = None,
        tls: TlsFiles | None = None,
        reuse_port: bool = False,
    ) -> None:
        """``max_request_bytes``: the largest message it accepts (default MAX_MESSAGE_BYTES,
        for KV blocks between nodes; a public port takes far less); ``reuse_port``: share the
        port with other processes that ask the same (SO_REUSEPORT)."""
        options = list(SERVER_OPTIONS)
        if reuse_port:
            options = [(k, v) for k, v in options if k != "grpc.so_reuseport"]
            options.append(("grpc.so_reuseport", 1))
        if max_request_bytes is not None:
            key = "grpc.max_receive_message_length"
            options = [(k, v) for k, v in options if k != key] + [(key, max_request_bytes)]
        # Outermost first: a caller without the token is refused before its bytes are parsed.
        chain = [*interceptors, MalformedRequests()]
        self.server = grpc.aio.server(options=options, interceptors=chain)
        # NOTE: typeshed's grpcio-health-checking stubs lack ``aio`` (and the stub's methods).
        self.health = health.aio.HealthServicer()  # pyright: ignore[reportAttributeAccessIssue]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # Reflection v1 and v1alpha (runtime.reflection adds both to the names listed).
        enable_reflection((*service_names, health.SERVICE_NAME), self.server)
        self.service_names = tuple(service_names)
        if tls is None:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        else:
            self.port = self.server.add_secure_port(f"{host}:{port}", tls.server_credentials())
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def start(self, port_file: str | None = None) -> None:
        """Start serving, mark SERVING, then write the bound port to ``port_file`` (atomically:
        a launcher polling it never reads half a number)."""
        settle_garbage_collector()
        await self.server.start()
        await self.set_serving(True)
        if port_file:
            write_port_file(port_file, self.port)
        logger.info("serving %s on %s", ", ".join(self.service_names), self.address)

    async def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING first (so health checks steer traffic away), then a graceful stop."""
        await self.set_serving(False)
        await self.server.stop(grace_s)

    async def run(
        self,
        port_file: str | None = None,
        on_stop: Callable[[], Awaitable[None]] | None = None,
        grace_s: float = 5.0,
        drain: Callable[[], Coroutine[object, object, None]] | None = None,
    ) -> None:
        """Start, serve until SIGTERM/SIGINT, drain, stop, then ``on_stop``.

        On the first signal health turns NOT_SERVING and ``drain`` runs (it stops taking work and
        waits for in-flight requests); a second signal cuts the drain short.
        """
        await self.start(port_file)
        signals = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        await signals.get()
        await self.set_serving(False)
        if drain is not None:
            logger.info("draining %s", self.address)
            draining = asyncio.create_task(drain())
            again = asyncio.create_task(signals.get())
            await asyncio.wait((draining, again), return_when=asyncio.FIRST_COMPLETED)
            if not draining.done():
                logger.warning("second signal: not waiting for in-flight requests")
                draining.cancel()
            again.cancel()
            await asyncio.gather(draining, again, return_exceptions=True)
        logger.info("stopping %s", self.address)
        await self.stop(grace_s)
        if on_stop is not None:
            await on_stop()


# Young-generation threshold while serving (CPython's default is 700): a node streaming hundreds
# of requests allocates many short-lived containers, and fewer, larger young collections cost
# less than many small ones.
GC_GEN0_THRESHOLD = 10_000


def settle_garbage_collector() -> None:
    """Keep what start-up made (modules, the tokenizer, the model's Python objects: hundreds of
    thousands of containers that live as long as the process) out of the collector's scans,
    and collect the young generation less often. NOTE: measured on a router relaying 256
    streams, full collections over those objects stopped every stream for 352-519 ms about once
    a second (docs/benchmarks-history.md, "The in-process engine, its step profile, and the
    colocated layout, one H200 (2026-12-01)")."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
