"""Start splitserve components as separate processes for tests (real gRPC over loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.v1 import nodes_pb2, nodes_pb2_grpc


class Proc:
    def __init__(self, popen: subprocess.Popen, address: str, log: Path) -> None:
        self.popen, self.address, self.log = popen, address, log
        # The ports it bound for ``--metrics-port 0`` and ``--http-port 0`` (start_cli)
        self.metrics_port: int | None = None
        self.http_port: int | None = None

    def stop(self, timeout: float = 20.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def node_stats(proc: Proc, timeout: float = 10.0):
    """The node's NodeStatsService.GetStats answer."""
    with grpc.insecure_channel(proc.address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=timeout)


def wait_healthy(address: str, timeout: float = 120.0, credentials=None) -> None:
    deadline = time.monotonic() + timeout
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout} s")
            time.sleep(0.2)


def start_cli(
    name: str,
    args: list[str],
    tmp: Path,
    prefix: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    credentials=None,
    port: int = 0,
) -> Proc:
    """``python -m splitserve.cli ARGS --port 0 --port-file F``; returns once it is SERVING.
    ``prefix``: a command it runs under (e.g. ``ip netns exec NS``); ``host``: where it is
    reached (it must listen there); ``credentials``: to ask its health over TLS; ``port``: a
    fixed one (0: any free one). With ``--metrics-port 0`` or ``--http-port 0`` in ``args`` it
    is given a file to write the port it binds to, read into ``metrics_port``/``http_port`` (a
    port picked here and passed on could be taken by another process before it binds)."""
    port_file = tmp / f"{name}-{time.monotonic_ns()}.port"
    log = port_file.with_suffix(".log")
    bound = {}  # attribute -> the file the process writes its port to
    for flag, attribute in (("--metrics-port", "metrics_port"), ("--http-port", "http_port")):
        given = f"{flag}-file" in args  # (the caller reads its own file)
        if flag in args and args[args.index(flag) + 1] == "0" and not given:
            bound[attribute] = port_file.with_suffix(f".{attribute}")
            args = [*args, f"{flag}-file", str(bound[attribute])]
    cmd = [
        *prefix,
        sys.executable,
        "-P",  # (no working directory on sys.path: splitserve.launcher says why)
        "-m",
        "splitserve.cli",
        *args,
        "--port",
        str(port),
        "--port-file",
        str(port_file),
    ]
    popen = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    proc = Proc(popen, f"{host}:{port_file.read_text().strip()}", log)
    wait_healthy(proc.address, credentials=credentials)
    for attribute, path in bound.items():
        while not path.exists():  # a router serves /metrics just after it serves gRPC
            if popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} wrote no {path.name}:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        setattr(proc, attribute, int(path.read_text()))
    return proc


def start_node(role: str, model: Path, tmp: Path, *flags: str) -> Proc:
    """``splitserve prefill|decode`` on a free port, with a 64 MB KV cache."""
    return start_cli(role, [role, "--model", str(model), "--kv-cache-mb", "64", *flags], tmp)


def start_router(
    model: Path, tmp: Path, prefill: list[str], decode: list[str], *flags: str
) -> Proc:
    """``splitserve router`` over the given node addresses."""
    return start_cli(
        "router",
        [
            "router",
            "--model",
            str(model),
            "--prefill",
            ",".join(prefill),
            "--decode",
            ",".join(decode),
            *flags,
        ],
        tmp,
    )


def start_router_discovering(model: Path, tmp: Path, redis_url: str, *flags: str) -> Proc:
    """``splitserve router`` that finds its nodes in the Redis registry (no static lists)."""
    args = ["router", "--model", str(model), "--redis-url", redis_url, *flags]
    return start_cli("router", args, tmp)


def start_redis(tmp: Path, port: int | None = None) -> Proc:
    """A private redis-server on loopback (no persistence), on ``port`` or a free one
    (``splitserve.launcher.start_redis_server``: a free port taken before Redis binds it is
    given up for another, and only this Redis's answers count)."""
    from splitserve.launcher import start_redis_server

    log = tmp / f"redis-{time.monotonic_ns()}.log"
    popen, bound = start_redis_server("127.0.0.1", log, time.monotonic() + 20, port or 0)
    return Proc(popen, f"redis://127.0.0.1:{bound}", log)


def greedy_burst(address: str, prompts, max_tokens: int, timeout: float | None = None) -> list:
    """Every prompt (token ids) at once through the router at ``address``, greedy and
    ``ignore_eos``: per prompt its output token ids, or the ``SplitserveError`` it ended with."""
    from splitserve.client import AsyncClient, SplitserveError

    async def run():
        async with AsyncClient(address) as client:

            async def one(prompt):
                try:
                    out = await client.generate(prompt_token_ids=prompt, max_tokens=max_tokens,
                                                temperature=0.0, ignore_eos=True,
                                                timeout=timeout)  # fmt: skip
                    return list(out.token_ids)
                except SplitserveError as exc:
                    return exc

            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


class Traffic:
    """``concurrency`` clients of the router at ``address`` sending greedy, ``ignore_eos``
    requests back to back until ``stop()``: ``ok`` counts answers of exactly ``max_tokens``
    tokens, ``failures`` the errors and short answers. Each client draws its prompts of
    ``prompt_len`` token ids (< 250) from its own seeded generator: unique prompts, so no node's
    cache attracts them and a new node gets its share. ``api_key``: for a router with keys."""

    def __init__(
        self,
        address: str,
        concurrency: int = 3,
        prompt_len: int = 40,
        max_tokens: int = 12,
        timeout: float = 60.0,
        api_key: str | None = None,
    ) -> None:
        self.ok, self.failures = 0, []
        self._timeout = timeout
        self._api_key = api_key  # a router with API keys
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(address, i, prompt_len, max_tokens))
            for i in range(concurrency)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, address: str, seed: int, prompt_len: int, max_tokens: int) -> None:
        from splitserve.client import Client, SplitserveError

        rng = random.Random(seed)
        with Client(address, api_key=self._api_key) as client:
            while not self._stop.is_set():
                prompt = [rng.randrange(250) for _ in range(prompt_len)]
                try:
                    r = client.generate(prompt_token_ids=prompt, max_tokens=max_tokens,
                                        temperature=0.0, ignore_eos=True,
                                        timeout=self._timeout)  # fmt: skip
                    assert len(r.token_ids) == max_tokens
                    with self._lock:
                        self.ok += 1
                except (SplitserveError, AssertionError) as exc:
                    with self._lock:
                        self.failures.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self._timeout + 30)


def scrape_metrics(port: int) -> dict[str, float]:
    """The samples of a component's /metrics page on loopback, ``name{labels}`` → value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def settled(nodes, idle: list[int], timeout: float) -> list[tuple[int, int, int]]:
    """Each node's (free blocks, running, pending transfers), polled until it is (idle, 0, 0)
    everywhere or ``timeout`` passed."""
    want = [(free, 0, 0) for free in idle]
    deadline = time.monotonic() + timeout
    while True:
        now = [(s.num_free_blocks, s.running, s.pending_transfers) for s in map(node_stats, nodes)]
        if now == want or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def assert_settled(nodes, idle: list[int], timeout: float = 10) -> None:
    after = settled(nodes, idle, timeout)
    report = [(n.address, now) for n, now in zip(nodes, after, strict=True)]
    assert after == [(free, 0, 0) for free in idle], (idle, report)


def idle_free_blocks(nodes) -> list[int]:
    return [
        free for free, _, _ in settled(nodes, [node_stats(n).num_free_blocks for n in nodes], 5)
    ]


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (its children, theirs, ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return [p for p in out if alive(p)]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def children(pid: int) -> list[int]:
    """``pid``'s direct children, from /proc."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return out


def still_alive(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still running once they are all gone or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that still exists (a test's cleanup)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
