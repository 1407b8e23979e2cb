"""A request cancelled or timed out in the middle of its (chunked) prefill stops being scheduled
on the prefill node within one engine step, and its blocks are freed.

- In process, deterministically: a Prefill handler cancelled while its abort has to queue behind
  other engine work (here a job holding the engine thread, and the next step already submitted
  behind it) is not computed by that next step: aborts are applied at the top of every step,
  before scheduling. Repeated cancellations of the handler change nothing.
- With real processes (router, prefill node with a small token budget so that a long prompt
  takes many short steps, decode node): a client that cancels its Generate call, and one whose
  deadline expires, during the prefill; the prefill node runs at most about one more step for it
  and every node's free blocks return to their idle count.
"""

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from support.processes import node_stats, start_node, start_router

from splitserve.engine.api import KVSpec
from splitserve.engine.core import LLMEngine
from splitserve.engine.local import LocalEngine
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.tiny import ensure_tiny_model, write_random_checkpoint
from splitserve.prefill_node.service import PrefillService
from splitserve.v1 import common_pb2, nodes_pb2, router_pb2, router_pb2_grpc

BUDGET = 32  # in process: prompt tokens per engine step (a long prompt takes many chunks)
# The prefill node's budget: a 4000-token prompt takes ~32 steps of ~10-30 ms on CPU; steps much
# shorter than a cancellation's way from the client through the router would blur the count.
NODE_BUDGET = 128
PROMPT_LEN = 4000


# ---------------------------------------------------------------------------- in process


class _Context:
    """What PrefillService uses of a grpc.aio servicer context."""

    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise RuntimeError(f"{code.name}: {details}")


def _prefill_request(rid: str, prompt: list[int], max_tokens: int) -> nodes_pb2.PrefillRequest:
    return nodes_pb2.PrefillRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        decode_address="127.0.0.1:1",  # never reached: the calls end before shipping
    )


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_a_cancelled_prefill_is_not_scheduled_by_a_step_queued_before_its_abort(tmp_path):
    config, model = load_model(write_random_checkpoint(tmp_path / "m", seed=3))
    rc = RunnerConfig(kv_cache_bytes=128 * 16 * config.kv_bytes_per_token(torch.float32))
    core = LLMEngine(
        ModelRunner(config, model, rc),
        ModelIdentity("m"),
        max_num_batched_tokens=BUDGET,
        prefill_only=True,
    )
    idle = core.pool.num_free_blocks
    prompt = [random.Random(0).randrange(256) for _ in range(900)]  # 29 steps of 32 tokens

    async def main():
        engine = LocalEngine(core)
        engine.start()
        spec = KVSpec(role="prefill", address="127.0.0.1:1", paths=("grpc",), host="127.0.0.1")
        await engine.open_kv(spec)
        service = PrefillService(engine, core.identity, deadline_s=5.0)
        loop_engine = engine.loop_engine  # the engine thread (engine.loop.AsyncEngine)
        try:
            handler = asyncio.ensure_future(
                service.Prefill(_prefill_request("long", prompt, 4), _Context())
            )
            await _until(lambda: "long" in core.requests)
            req = core.requests["long"]
            await _until(lambda: req.num_computed_tokens >= 4 * BUDGET)

            # Other engine work ahead: a job holding the engine thread; the engine thread
            # steps again as soon as it is done, before the abort job queued behind it.
            holding, gate = threading.Event(), threading.Event()

            def hold() -> None:
                holding.set()
                gate.wait(30)

            held = loop_engine.submit(hold)
            await asyncio.to_thread(holding.wait, 10)
            computed = req.num_computed_tokens
            assert computed < len(prompt)

            for _ in range(3):  # cancelled, then again while its abort waits
                handler.cancel()
                await asyncio.sleep(0.02)
            assert not handler.done()  # its abort is queued, not abandoned
            gate.set()
            await held
            with pytest.raises(asyncio.CancelledError):
                await handler

            # The step that was queued before the abort did not compute the request.
            assert req.num_computed_tokens == computed, (computed, req.num_computed_tokens)
            assert "long" not in core.requests and not core.has_unfinished()
            assert core.pool.num_free_blocks == idle
            await engine.abort("long")  # again: nothing left to free, nothing breaks
            assert core.pool.num_free_blocks == idle

            # The engine goes on serving (a prompt that ends at its first token: no shipping).
            done = await service.Prefill(_prefill_request("next", prompt[:40], 1), _Context())
            assert done.finish_reason == "length"
            assert core.pool.num_free_blocks == idle

            # The engine thread's time is accounted: the steps run, and the job that held the
            # thread for at least the three 20 ms cancels above.
            counters = service.all_counters()
            assert counters["steps"] == loop_engine.steps > 4
            assert 0 < counters["step_seconds"] == loop_engine.step_seconds
            assert counters["engine_job_seconds"] >= 0.06
        finally:
            await service.close()
            await engine.stop()

    asyncio.run(main())


# ---------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cancel-fast")
    model = ensure_tiny_model()
    procs = []
    try:
        with ThreadPoolExecutor(2) as pool:  # the nodes load side by side
            started = [
                pool.submit(
                    start_node, "prefill", model, tmp, "--max-num-batched-tokens", str(NODE_BUDGET)
                ),
                pool.submit(start_node, "decode", model, tmp),
            ]
            procs += [f.result() for f in started]
        prefill, decode = procs
        procs.append(start_router(model, tmp, [prefill.address], [decode.address]))
        yield procs[2], prefill, decode
    finally:
        for proc in reversed(procs):
            proc.stop()


class _Sampler:
    """The prefill node's (time, steps, prompt tokens waiting, running + waiting) every few ms,
    in a thread."""

    def __init__(self, node) -> None:
        self.node, self.samples = node, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = node_stats(self.node)
            self.samples.append(
                (
                    time.monotonic(),
                    s.counters["steps"],
                    s.prefill_tokens_waiting,
                    s.running + s.waiting,
                )
            )
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def last(self):
        while not self.samples:
            time.sleep(0.005)
        return self.samples[-1]

    def wait(self, predicate, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while not predicate(sample := self.last()):
            assert time.monotonic() < deadline, f"timed out; last sample {sample}"
            time.sleep(0.005)
        return sample


def _generate_request(prompt: list[int]) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )


def _free(nodes) -> list[int]:
    return [node_stats(n).num_free_blocks for n in nodes]


def _check_stopped(sampler: _Sampler, ended_at: float, nodes, idle: list[int]) -> None:
    """After the client's call ended at ``ended_at`` (in the middle of the prefill), the prefill
    node ran at most about one more step, stays stopped, and every pool is back to idle."""
    before = [s for s in sampler.samples if s[0] <= ended_at]
    assert before and before[-1][2] > 0, f"not in the middle of the prefill: {before[-1:]}"
    at_end = before[-1]
    stopped = sampler.wait(lambda s: s[3] == 0, timeout=5)
    # NOTE: one step was in flight when the cancellation arrived; one more allows for a step
    # begun while it travelled from the client through the router.
    assert stopped[1] - at_end[1] <= 2, (at_end, stopped)
    time.sleep(0.2)
    assert sampler.last()[1] == stopped[1]  # no chunk of it computed later
    deadline = time.monotonic() + 5
    while (free := _free(nodes)) != idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert free == idle


def test_cancel_and_deadline_during_prefill_stop_it_within_a_step(cluster):
    router, prefill, decode = cluster
    nodes = [prefill, decode]
    idle = _free(nodes)
    rng = random.Random(1)
    with grpc.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        with _Sampler(prefill) as sampler:
            # The client cancels its call a few chunks into the prompt's prefill.
            prompt = [rng.randrange(256) for _ in range(PROMPT_LEN)]
            started = time.monotonic()
            call = stub.Generate(_generate_request(prompt), timeout=60)
            sampler.wait(lambda s: 0 < s[2] <= len(prompt) - 4 * NODE_BUDGET)
            call.cancel()
            ended_at = time.monotonic()
            four_chunks = ended_at - started
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.CANCELLED
            _check_stopped(sampler, ended_at, nodes, idle)

            # The client's deadline expires during the prefill (a new prompt: not cached), about
            # eight chunks in (later chunks take longer: the context grows).
            prompt = [rng.randrange(256) for _ in range(PROMPT_LEN)]
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(_generate_request(prompt), timeout=max(2 * four_chunks, 0.2)))
            ended_at = time.monotonic()
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            _check_stopped(sampler, ended_at, nodes, idle)
