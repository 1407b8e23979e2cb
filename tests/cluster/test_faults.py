"""The fault suite: real processes on loopback (Redis, 2 prefill and 2 decode nodes, a router that
finds them in Redis) serve a stream of greedy requests while things go wrong — a decode node is
SIGKILLed and a new one started, a prefill node is frozen (SIGSTOP) and thawed, Redis is killed
and restarted on its port, and a third of the requests are cancelled at random moments (many in
their first 100 ms). Checked: 0 hung (every request ends within its timeout), 0 wrong (every
completed output equals the healthy run's), ≥ 99% complete apart from the requests the killed
node held, and every surviving node's KV blocks are back to their idle count.

Short version in CI (``SPLITSERVE_FAULT_REQUESTS``, default 160); the full one:
``SPLITSERVE_FAULT_REQUESTS=1000 .venv/bin/python -m pytest tests/cluster/test_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

import pytest
from support.processes import node_stats, start_node, start_redis, start_router_discovering

from splitserve.client import AsyncClient, Client, SplitserveError
from splitserve.models.tiny import write_random_checkpoint

NUM_REQUESTS = int(os.environ.get("SPLITSERVE_FAULT_REQUESTS", "160"))
CONCURRENCY = 12
TIMEOUT_S = 60.0
NODE_FLAGS = ("--transfer-deadline-s", "5")


def _prompts(n: int) -> list[list[int]]:
    """Prompts over a few shared prefixes (cache hits, peer fetches) and unique tails."""
    rng = random.Random(11)
    systems = [[rng.randrange(250) for _ in range(48)] for _ in range(4)]
    return [
        [*systems[i % 4], *(rng.randrange(250) for _ in range(rng.randrange(1, 40)))]
        for i in range(n)
    ]


class Faults:
    """The cluster, and the faults done to it."""

    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.model = write_random_checkpoint(
            tmp / "m", seed=13, with_tokenizer=True, num_hidden_layers=2
        )
        self.redis = start_redis(tmp)
        self.port = int(self.redis.address.rsplit(":", 1)[1])
        flags = (*NODE_FLAGS, "--redis-url", self.redis.address)
        self.prefill = [start_node("prefill", self.model, tmp, *flags) for _ in range(2)]
        self.decode = [start_node("decode", self.model, tmp, *flags) for _ in range(2)]
        self.router = start_router_discovering(self.model, tmp, self.redis.address)
        self.flags = flags
        self.dead = []

    def kill_decode_and_start_another(self) -> None:
        victim = self.decode.pop(0)
        victim.popen.kill()
        victim.popen.wait()
        self.dead.append(victim)
        self.decode.append(start_node("decode", self.model, self.tmp, *self.flags))

    def freeze_prefill(self, seconds: float) -> None:
        pid = self.prefill[0].popen.pid
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)

    def restart_redis(self, down_s: float) -> None:
        self.redis.popen.kill()
        self.redis.popen.wait()
        time.sleep(down_s)
        self.redis = start_redis(self.tmp, port=self.port)

    def stop(self) -> None:
        for proc in (self.router, *self.prefill, *self.decode, self.redis):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.popen.pid, signal.SIGCONT)
            proc.stop()


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    cluster = Faults(tmp_path_factory.mktemp("faults"))
    try:
        yield cluster
    finally:
        cluster.stop()


async def _run(target: str, prompts, cancel_some: bool, seed: int):
    """Each request's outcome: ("ok", tokens) / ("cancelled", None) / ("failed", code), with its
    duration."""
    rng = random.Random(seed)
    slots = asyncio.Semaphore(CONCURRENCY)
    async with AsyncClient(target) as client:

        async def one(i: int, prompt):
            async with slots:
                t0 = time.monotonic()
                task = asyncio.ensure_future(
                    client.generate(prompt_token_ids=prompt, max_tokens=6 + i % 5,
                                    temperature=0.0, ignore_eos=True, timeout=TIMEOUT_S)
                )  # fmt: skip
                if cancel_some and rng.random() < 1 / 3:
                    await asyncio.sleep(rng.uniform(0, 0.1) if rng.random() < 0.5 else 0.5)
                    task.cancel()
                try:
                    out = await task
                    return "ok", list(out.token_ids), time.monotonic() - t0
                except asyncio.CancelledError:
                    return "cancelled", None, time.monotonic() - t0
                except SplitserveError as exc:
                    return "failed", f"{exc.code.name}: {exc.message}", time.monotonic() - t0

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _idle(proc) -> bool:
    # A survivor that no longer answers fails here with its exit status and log, not a bare
    # UNAVAILABLE (a CI run once saw "connection refused" from one; not reproduced).
    if (rc := proc.popen.poll()) is not None:
        tail = "\n".join(proc.log.read_text(errors="replace").splitlines()[-30:])
        pytest.fail(f"node {proc.address} exited with status {rc}; its log ends:\n{tail}")
    stats = node_stats(proc)
    return stats.num_free_blocks == stats.num_blocks and stats.running == stats.waiting == 0


def test_faults_lose_no_blocks_and_give_no_wrong_answer(faults):
    prompts = _prompts(NUM_REQUESTS)
    distinct = {tuple(p) for p in prompts}
    # The healthy run: each distinct prompt's greedy output (checked against itself later).
    with Client(faults.router.address) as client:
        reference = {
            p: list(client.generate(prompt_token_ids=list(p), max_tokens=10, temperature=0.0,
                                    ignore_eos=True, timeout=TIMEOUT_S).token_ids)
            for p in distinct
        }  # fmt: skip

    async def chaos():
        await asyncio.sleep(1.0)
        await asyncio.to_thread(faults.kill_decode_and_start_another)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(faults.freeze_prefill, 3.0)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(faults.restart_redis, 2.0)

    async def both():
        results, _ = await asyncio.gather(
            _run(faults.router.address, prompts, cancel_some=True, seed=5), chaos()
        )
        return results

    t0 = time.monotonic()
    results = asyncio.run(both())
    wall = time.monotonic() - t0
    ok = [r for r in results if r[0] == "ok"]
    failed = [r for r in results if r[0] == "failed"]
    cancelled = [r for r in results if r[0] == "cancelled"]
    wrong = [
        (p, r[1]) for p, r in zip(prompts, results, strict=True)
        if r[0] == "ok" and r[1] != reference[tuple(p)][: len(r[1])]
    ]  # fmt: skip
    slowest = max(r[2] for r in results)
    print(
        f"fault suite: {len(results)} requests in {wall:.1f} s: {len(ok)} ok, "
        f"{len(cancelled)} cancelled, {len(failed)} failed "
        f"({sorted({r[1][:60] for r in failed})}), slowest {slowest:.1f} s"
    )
    assert not wrong, wrong[:3]
    assert slowest < TIMEOUT_S + 5, "a request hung"
    # Requests decoding on the killed node fail (their KV died with it; the client is told to
    # retry); of the others, at most 1% may fail.
    dead = [n.address for n in faults.dead]
    others = [r for r in failed if not any(a in r[1] for a in dead)]
    attempted = len(results) - len(cancelled)
    assert len(others) <= max(1, attempted // 100), others[:5]
    assert len(ok) >= attempted - len(failed)
    # After the faults, the cluster serves again, and every node's blocks come back.
    with Client(faults.router.address) as client:
        p = prompts[0]
        out = client.generate(prompt_token_ids=p, max_tokens=10, temperature=0.0,
                              ignore_eos=True, timeout=TIMEOUT_S)  # fmt: skip
        assert list(out.token_ids) == reference[tuple(p)]
    deadline = time.monotonic() + 20
    survivors = [*faults.prefill, *faults.decode]
    while not all(_idle(n) for n in survivors):
        assert time.monotonic() < deadline, [node_stats(n) for n in survivors]
        time.sleep(0.2)
