"""Can one router core relay the output of 8 GPUs? The router against scripted decode nodes.

    taskset -c 1 .venv/bin/python benchmarks/router_relay.py                # the default sweep
    taskset -c 1 .venv/bin/python benchmarks/router_relay.py --points 8:512 --profile /tmp/relay

The real router (``python -m splitserve.cli router --decode ...``, no prefill node: the direct
route, every request a generate command on its node's ``Relay`` stream) runs pinned to one core
(``taskset -c 0``: its gRPC threads too). Behind it, ``--points K:C`` puts K *scripted* decode
nodes (gRPC servers in this process, on ``--load-core``): each serves ``Relay``, ``GetStats``
(role decode, the router's model identity, ``--max-num-seqs`` slots, ample KV blocks) and
grpc.health.v1, and every ``--step-ms`` it "decodes" one token for each of its requests and
sends them in one message per step for all the requests of the stream (tokens that queued up
while this process was busy go out together, as ``decode_node.relay_stream`` does). In front, C
streams (``RouterService.Generate`` over 4 channels, token-id prompts of ``--prompt-len``,
``--output-len`` tokens each, ignore_eos; the first request of each stream has a random length so
that streams end spread out) in a closed loop: a stream that ends is replaced at once. So the
nodes offer about C / step_s tokens/s (C = 512 at 15 ms: 34,000 tok/s).

Per point, over ``--duration`` seconds after ``--warmup``: *offered* tok/s (tokens the scripted
nodes produced), *relayed* tok/s (tokens the client received), the router process's CPU seconds
per second (user + system, every thread, /proc/PID/stat) and router CPU microseconds per relayed
token, the share of the router's CPU in its main thread (the asyncio event loop; the rest is
gRPC's C-core threads), this load process's CPU per second (its own core must stay below 1.0, or
the load is the limit, not the router), tokens per message at the client, and the streams'
*stretch* (a stream's wall time over output_len x step: 1.0 when the router keeps pace), and
the busy time of the two cores not spent by these processes (others' load on a shared machine:
rows with it are not clean). The router is the limit where its CPU nears 1.0 and relayed falls
below offered (stretch > 1).

``--tokens-per-step N`` (with ``--step-ms`` N times longer: the same token rate) has each step
make N tokens per stream, sent in one message: how much of the router's cost is per message.
``--profile DIR``: the router runs under cProfile (main thread: the event loop) for the last point
and the top functions by own time are printed (cProfile slows the router; its CPU figures are
not comparable with the unprofiled rows).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from splitserve.cli_tools import model_path
from splitserve.kvstore import ModelIdentity
from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc, router_pb2, router_pb2_grpc

CLIENT_CHANNELS = 4


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` so far, every thread (Linux /proc); of its
    thread ``tid`` only when given."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_busy(core: int) -> float:
    """CPU seconds core ``core`` spent busy so far, whoever ran (Linux /proc/stat; steal too)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            t = [int(x) for x in line.split()[1:]]
            return (sum(t[:8]) - t[3] - t[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    raise ValueError(f"no cpu{core} in /proc/stat")


# ------------------------------------------------------------------ scripted decode nodes


class RelayRequest:
    __slots__ = ("left", "offset", "pending")

    def __init__(self, n: int, offset: int) -> None:
        self.left = n  # tokens still to send
        self.offset = offset
        self.pending = 0  # decoded, not sent yet


class ScriptedRelay:
    """One router's Relay stream: its requests, and a wake-up per step."""

    def __init__(self) -> None:
        self.requests: dict[str, RelayRequest] = {}
        self.wake = asyncio.Event()


class ScriptedDecodeNode(nodes_pb2_grpc.DecodeNodeServiceServicer):
    """A decode node whose 'engine' makes one token per request every ``step_s``, a Relay
    stream's in one message per step for all its requests (as ``decode_node.relay_stream``
    does)."""

    def __init__(
        self,
        identity: ModelIdentity,
        step_s: float,
        max_num_seqs: int,
        per_step: int = 1,
    ) -> None:
        self.relays: set[ScriptedRelay] = set()
        self.identity = identity
        self.step_s = step_s
        self.per_step = per_step  # tokens a step makes per stream (1: plain decoding)
        self.max_num_seqs = max_num_seqs
        self.tokens_sent = 0
        self.vocab = [random.randrange(300, 40000) for _ in range(4096)]

    async def run_steps(self) -> None:
        """The engine loop: one decode step every step_s (a late step is not made up for)."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at = max(next_at + self.step_s, loop.time())
            await asyncio.sleep(next_at - loop.time())
            per_step = self.per_step
            for relay in self.relays:
                for r in relay.requests.values():
                    r.pending += per_step
                relay.wake.set()

    @property
    def running(self) -> int:
        return sum(len(r.requests) for r in self.relays)

    async def Relay(self, request_iterator, context):
        await context.send_initial_metadata(())
        relay = ScriptedRelay()

        async def read() -> None:
            async for command in request_iterator:
                if command.WhichOneof("kind") == "generate":
                    g = command.generate
                    n = g.sampling.max_tokens if g.sampling.HasField("max_tokens") else 16
                    offset = random.randrange(len(self.vocab) - n) if n < len(self.vocab) else 0
                    relay.requests[g.request_id] = RelayRequest(n, offset)
                elif command.WhichOneof("kind") == "cancel":
                    relay.requests.pop(command.cancel, None)

        reader = asyncio.create_task(read())
        self.relays.add(relay)
        try:
            while not reader.done():
                await relay.wake.wait()
                relay.wake.clear()
                batch = nodes_pb2.RelayBatch()
                for rid, r in list(relay.requests.items()):
                    if not r.pending:
                        continue
                    k = min(r.pending, r.left)
                    r.pending = 0
                    sent = r.offset
                    r.offset += k
                    r.left -= k
                    self.tokens_sent += k
                    batch.outputs.add(
                        request_id=rid,
                        token_ids=self.vocab[sent : sent + k],
                        finish_reason="" if r.left else "length",
                    )
                    if not r.left:
                        del relay.requests[rid]
                if batch.outputs:
                    yield batch
        finally:
            self.relays.discard(relay)
            reader.cancel()

    async def Release(self, request, context):
        return nodes_pb2.ReleaseResponse(released=False)


class ScriptedStats(nodes_pb2_grpc.NodeStatsServiceServicer):
    def __init__(self, node: ScriptedDecodeNode) -> None:
        self.node = node

    async def GetStats(self, request, context):
        n = self.node
        return nodes_pb2.GetStatsResponse(
            role="decode",
            num_blocks=50_000_000,
            num_free_blocks=50_000_000,
            running=n.running,
            model_root_hash=n.identity.root_hash,
            model_identity=str(n.identity),
            max_num_seqs=n.max_num_seqs,
            max_num_batched_tokens=8192,
        )


async def start_node(identity: ModelIdentity, step_s: float, max_num_seqs: int, per_step: int):
    node = ScriptedDecodeNode(identity, step_s, max_num_seqs, per_step)
    server = grpc.aio.server()
    nodes_pb2_grpc.add_DecodeNodeServiceServicer_to_server(node, server)
    nodes_pb2_grpc.add_NodeStatsServiceServicer_to_server(ScriptedStats(node), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ticker = asyncio.create_task(node.run_steps())
    return node, server, ticker, f"127.0.0.1:{port}"


# ------------------------------------------------------------------ the router


def start_router(addresses: list[str], core: int, workdir: Path, profile: Path | None, model: str):
    port_file = workdir / f"router-{time.monotonic_ns()}.port"
    python = [sys.executable]
    if profile is not None:
        python += ["-m", "cProfile", "-o", str(profile)]
    cmd = [
        "taskset", "-c", str(core), *python, "-m", "splitserve.cli", "router",
        "--model", model,
        "--decode", ",".join(addresses), "--port", "0", "--port-file", str(port_file),
        "--max-requests-per-client", "1000000", "--max-queue", "1000000",
        "--decode-overcommit", "1.0", "--request-timeout-s", "3600",
    ]  # fmt: skip
    log = (workdir / "router.log").open("a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"router did not start; see {workdir / 'router.log'}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


# ------------------------------------------------------------------ the load


@dataclass
class Load:
    tokens: int = 0
    messages: int = 0
    errors: int = 0
    stretches: list[float] = field(default_factory=list)
    measuring: bool = False


async def one_stream(
    stub, load: Load, i: int, first_len: int, args, prompt: list[int], step_s: float
) -> None:
    n = first_len
    while True:
        req = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0),
        )
        start = time.monotonic()
        got = 0
        try:
            async for msg in stub.Generate(req, metadata=(("x-splitserve-client", f"c{i % 64}"),)):
                got += len(msg.token_ids)
                if load.measuring:
                    load.tokens += len(msg.token_ids)
                    load.messages += 1
        except grpc.aio.AioRpcError as exc:
            load.errors += 1
            if load.errors <= 5:
                print(f"  stream error: {exc.code().name} {exc.details()}", flush=True)
            await asyncio.sleep(0.1)
        if load.measuring and got == n == args.output_len:
            ideal = n * step_s / args.tokens_per_step
            load.stretches.append((time.monotonic() - start) / ideal)
        n = args.output_len


async def run_point(nodes, k: int, c: int, args, workdir: Path, profile: Path | None) -> dict:
    used = nodes[:k]
    proc, target = start_router(
        [a for _, a in used], args.router_core, workdir, profile, args.model
    )
    step_s = args.step_ms / 1000
    load = Load()
    channels = [
        grpc.aio.insecure_channel(target, options=[("splitserve.relay_channel", j)])
        for j in range(CLIENT_CHANNELS)
    ]
    stubs = [router_pb2_grpc.RouterServiceStub(ch) for ch in channels]
    prompt = [random.randrange(300, 40000) for _ in range(args.prompt_len)]
    tasks = [
        asyncio.create_task(
            one_stream(
                stubs[i % CLIENT_CHANNELS], load, i,
                random.randint(1, args.output_len), args, prompt, step_s,
            )
        )
        for i in range(c)
    ]  # fmt: skip
    try:
        await asyncio.sleep(args.warmup)
        me = os.getpid()
        sent0 = sum(n.tokens_sent for n, _ in used)
        r0, m0, t0 = cpu_seconds(proc.pid), cpu_seconds(me), time.monotonic()
        loop0 = cpu_seconds(proc.pid, proc.pid)  # the main thread: the router's event loop
        c0 = [core_busy(args.router_core), core_busy(args.load_core)]
        load.measuring = True
        await asyncio.sleep(args.duration)
        load.measuring = False
        r1, m1, t1 = cpu_seconds(proc.pid), cpu_seconds(me), time.monotonic()
        loop1 = cpu_seconds(proc.pid, proc.pid)
        c1 = [core_busy(args.router_core), core_busy(args.load_core)]
        sent1 = sum(n.tokens_sent for n, _ in used)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close()
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 60)
    wall = t1 - t0
    stretch = sorted(load.stretches)
    row = {
        "nodes": k,
        "streams": c,
        "target_tok_s": c * args.tokens_per_step / step_s,
        "offered_tok_s": (sent1 - sent0) / wall,
        "relayed_tok_s": load.tokens / wall,
        "router_cpu": (r1 - r0) / wall,
        "router_us_per_tok": 1e6 * (r1 - r0) / max(load.tokens, 1),
        "router_loop_share": (loop1 - loop0) / max(r1 - r0, 1e-9),
        "load_cpu": (m1 - m0) / wall,
        # Other processes on the two cores (a shared machine): busy time not ours.
        "other_cpu_router_core": max(0.0, (c1[0] - c0[0]) - (r1 - r0)) / wall,
        "other_cpu_load_core": max(0.0, (c1[1] - c0[1]) - (m1 - m0)) / wall,
        "tok_per_msg": load.tokens / max(load.messages, 1),
        "stretch_p50": stretch[len(stretch) // 2] if stretch else float("nan"),
        "errors": load.errors,
    }
    return row


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--points",
        nargs="+",
        default=["1:16", "1:32", "2:48", "2:64", "4:96", "4:128", "8:256", "8:512"],
        help="K:C per point: K scripted decode nodes, C concurrent streams (spread over them)",
    )
    ap.add_argument("--step-ms", type=float, default=15.0, help="a scripted node's decode step")
    ap.add_argument(
        "--tokens-per-step",
        type=int,
        default=1,
        help="tokens a scripted step makes per stream, sent in one message (>1: how much of the "
        "router's cost is per message rather than per token)",
    )
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=4096, help="each scripted node's slots")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--router-core", type=int, default=0)
    ap.add_argument("--load-core", type=int, default=1, help="scripted nodes and client")
    ap.add_argument("--profile", type=Path, help="cProfile the router at the last point, here")
    ap.add_argument("--model", default=None, help="the router's model (default: the embedded one)")
    return ap.parse_args()


async def amain(args: argparse.Namespace) -> list[dict]:
    os.sched_setaffinity(0, {args.load_core})
    args.model = str(model_path(args.model))
    identity = ModelIdentity.for_checkpoint(args.model, None, DEFAULT_BLOCK_SIZE)
    points = [tuple(int(x) for x in p.split(":")) for p in args.points]
    step_s = args.step_ms / 1000
    nodes = []
    for _ in range(max(k for k, _ in points)):
        node, server, ticker, address = await start_node(
            identity, step_s, args.max_num_seqs, args.tokens_per_step
        )
        nodes.append(((node, server, ticker), address))
    workdir = Path(tempfile.mkdtemp(prefix="router-relay-"))
    print(f"router logs in {workdir}", flush=True)
    rows = []
    for i, (k, c) in enumerate(points):
        profile = None
        if args.profile is not None and i == len(points) - 1:
            args.profile.mkdir(parents=True, exist_ok=True)
            profile = args.profile / f"router-{k}x{c}.prof"
        row = await run_point([(n[0], a) for n, a in nodes], k, c, args, workdir, profile)
        row["profiled"] = profile is not None
        print(row, flush=True)
        rows.append(row)
        if profile is not None:
            print_profile(profile)
    for (_node, server, ticker), _ in nodes:
        ticker.cancel()
        await server.stop(0)
    return rows


def print_profile(path: Path) -> None:
    import pstats

    for _ in range(100):
        if path.exists():
            break
        time.sleep(0.1)
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def main() -> None:
    args = parse_args()
    rows = asyncio.run(amain(args))
    print(
        f"\nstep {args.step_ms:g} ms, {args.tokens_per_step} token(s) a step, output "
        f"{args.output_len} tokens (closed loop), prompt {args.prompt_len} token ids, "
        "a Relay stream per node; "
        f"router on core {args.router_core}, scripted nodes and "
        f"client on core {args.load_core}"
    )
    print(
        "| nodes | streams | target tok/s | offered tok/s | relayed tok/s | router CPU (cores) "
        "| router us / token | router loop thread share | load CPU (cores) | tokens / msg "
        "| stretch p50 | errors | others' CPU on router / load core |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mark = " (cProfile)" if r["profiled"] else ""
        print(
            f"| {r['nodes']} | {r['streams']}{mark} | {r['target_tok_s']:,.0f} | "
            f"{r['offered_tok_s']:,.0f} | {r['relayed_tok_s']:,.0f} | {r['router_cpu']:.2f} | "
            f"{r['router_us_per_tok']:.0f} | {r['router_loop_share']:.0%} | "
            f"{r['load_cpu']:.2f} | {r['tok_per_msg']:.2f} | "
            f"{r['stretch_p50']:.2f} | {r['errors']} | "
            f"{r['other_cpu_router_core']:.2f} / {r['other_cpu_load_core']:.2f} |"
        )


if __name__ == "__main__":
    main()
