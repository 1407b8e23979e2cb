"""The ranks of a tensor-parallel engine: rank 0 is the engine's own process (the scheduler, the
sampler, the KV cache manager, the transfer sides); ranks 1..N-1 are processes this module
starts, each loading its shards of the model (models/parallel.py) and following rank 0's
forwards (``ModelRunner.follow``).

    rank 0 (engine)                 rank r (python -m splitserve.engine.ranks SPEC r)
    start_ranks(spec) ──spawns──▶   load_model(tp=rank r) → ModelRunner → follow()
    ModelRunner(tp=rank 0) ◀──────▶ the group (gloo on CPU, NCCL on GPUs) on a loopback store

One rank gone means the node cannot compute: rank 0 logs which rank went and how, and its
process exits (``LOST_EXIT_CODE``); a node whose engine process it is exits in turn, and the
router retries elsewhere. A rank whose rank 0 is gone exits too (its stdin, a pipe from rank 0,
closes; and the kernel SIGKILLs it when rank 0's process ends, even while it is stopped or stuck:
engine.lifeline), so nothing is left holding a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine import lifeline
from splitserve.models.parallel import TPGroup

logger = logging.getLogger(__name__)

LostHandler = Callable[[int, int], None]  # (rank, its exit status); rank 0: the group failed
LOST_EXIT_CODE = 70  # rank 0's exit status when another rank went (EX_SOFTWARE)
GROUP_TIMEOUT_S = 1800.0  # a collective may wait this long (the others' model load, at start)
WATCH_S = 0.2


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank needs to build its part of the engine (JSON on a rank's command line)."""

    model_path: str
    dtype: str | None
    load_format: str
    devices: list[str]  # rank r computes on devices[r]
    runner: dict[str, Any] = field(default_factory=dict)  # RunnerConfig's fields
    store_port: int = 0
    quantization: str | None = None

    @property
    def size(self) -> int:
        return len(self.devices)

    def backend(self) -> str:
        return "nccl" if self.devices[0].startswith("cuda") else "gloo"


def rank_devices(device: str, size: int) -> list[str]:
    """The device of each of ``size`` ranks: every rank on the CPU, or consecutive GPUs from
    ``device``'s (``cuda`` → cuda:0..N-1, ``cuda:K`` → cuda:K..K+N-1)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if device == "cpu":
        return ["cpu"] * size
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device {device!r}: give cpu, cuda or cuda:N")
    first = int(index or 0)
    return [f"cuda:{first + r}" for r in range(size)]


class Ranks:
    """Rank 0's handle on the other ranks' processes: watches them, and stops them."""

    def __init__(self, procs: list[subprocess.Popen], on_lost: LostHandler | None = None) -> None:
        self.procs = procs
        self.store: Any = None  # the group's rendezvous store (lives as long as the group)
        self._stopping = threading.Event()
        self._on_lost = on_lost or _exit_lost
        self._lost = threading.Lock()  # taken once: the rank that went is reported once
        self._watcher = threading.Thread(target=self._watch, name="tp-ranks", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    self._lose(rank, code)
                    return

    def _lose(self, rank: int, code: int) -> None:
        if self._lost.acquire(blocking=False):
            self._stopping.set()
            self._on_lost(rank, code)

    def group_failed(self, error: BaseException) -> None:
        """An operation of the group failed: a rank went (or its connection did). Name the rank
        if it is seen to go within a moment, then do what a lost rank does."""
        if self._stopping.is_set():
            return
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    self._lose(rank, code)
                    return
            time.sleep(0.05)
        logger.error("tensor-parallel group failed with every rank still running: %s", error)
        self._lose(0, 0)

    def stop(self, timeout: float = 30.0) -> None:
        """Wait for the ranks to leave (after ``ModelRunner.close``), then kill any left.
        Idempotent."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()  # a rank blocked on a collective exits on this EOF
            lifeline.reap(proc, max(deadline - time.monotonic(), 0.1), "tensor-parallel rank")


def _exit_lost(rank: int, code: int) -> None:
    """The default ``on_lost``: rank 0 (0: the group failed, no rank seen to go) is logged and
    this process exits."""
    if rank:
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        logger.error(
            "tensor-parallel rank %d went (%s): this engine cannot compute without it; exiting",
            rank,
            how,
        )
    else:
        logger.error("tensor-parallel group failed: this engine cannot compute; exiting")
    logging.shutdown()
    os._exit(LOST_EXIT_CODE)


def start_ranks(
    spec: RankSpec, pass_fds: tuple[int, ...] = (), on_lost: LostHandler | None = None
) -> tuple[TPGroup, Ranks]:
    """Start ranks 1..N-1 and join the group as rank 0 (blocks until every rank has connected:
    gloo; NCCL connects at the first collective). ``pass_fds``: descriptors the ranks inherit
    (the node's GPU locks). ``on_lost(rank, status)``: what to do when a rank goes (default:
    log and exit this process)."""
    from splitserve.transfer import loopback_store, make_group

    store, port = loopback_store(GROUP_TIMEOUT_S)
    spec = dataclasses.replace(spec, store_port=port)
    text = json.dumps(dataclasses.asdict(spec))
    procs = [
        subprocess.Popen(
            # (-P: no working directory on sys.path: splitserve.launcher says why)
            [sys.executable, "-P", "-m", "splitserve.engine.ranks", text, str(rank)],
            stdin=subprocess.PIPE,
            pass_fds=pass_fds,
            env=lifeline.child_env(),  # SIGKILLed when this process ends, however it ends
        )
        for rank in range(1, spec.size)
    ]
    ranks = Ranks(procs, on_lost)
    try:
        backend = make_group(store, 0, spec.size, spec.backend(), GROUP_TIMEOUT_S, host="127.0.0.1")
    except BaseException:
        ranks.stop(timeout=1.0)
        raise
    ranks.store = store  # the store lives as long as the group
    logger.info("tensor parallel: %d ranks on %s", spec.size, ",".join(spec.devices))
    return TPGroup(0, spec.size, backend), ranks


def _exit_with_parent() -> None:
    """Rank 0's end closes this process's stdin: then this rank has nothing left to do."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        os._exit(0)


def run_rank(spec: RankSpec, rank: int) -> None:
    """Rank ``rank``'s life: join the group, load its shards, build its runner alike rank 0's
    (the KV budget, warm-up and graphs run in step), then follow rank 0 until it stops."""
    import torch
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    from splitserve.models.loader import load_model
    from splitserve.models.runner import ModelRunner, RunnerConfig
    from splitserve.transfer import ShardAgent, make_group

    device = torch.device(spec.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    from datetime import timedelta

    store = TCPStore(
        "127.0.0.1",
        spec.store_port,
        is_master=False,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    backend = make_group(store, rank, spec.size, spec.backend(), GROUP_TIMEOUT_S, "127.0.0.1")
    tp = TPGroup(rank, spec.size, backend)
    config, model = load_model(
        spec.model_path,
        dtype=spec.dtype,
        device=device,
        load_format=spec.load_format,
        tp=tp,
        quantization=spec.quantization,
    )
    runner_config = dict(spec.runner)
    if "graph_batch_sizes" in runner_config:
        runner_config["graph_batch_sizes"] = tuple(runner_config["graph_batch_sizes"])
    runner = ModelRunner(config, model, RunnerConfig(**runner_config))
    # This rank's part of its node's KV transfers with peers (rank 0's dist sides send it the
    # messages: transfer.shards), on threads of its own.
    agent = ShardAgent(runner.kv_pool, rank, spec.size, config.num_kv_heads)
    try:
        runner.follow(agent.handle)
    finally:
        agent.close()
    # Stopped: stay until rank 0 closes stdin (``Ranks.stop``, after its own last collective),
    # so no rank leaves while another may still be reading from it.
    threading.Event().wait()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m splitserve.engine.ranks SPEC_JSON RANK", file=sys.stderr)
        return 2

    # First: a rank whose rank 0 ends any way (killed, or stuck while this one is stopped) is
    # SIGKILLed by the kernel; the stdin watch below is the orderly end.
    lifeline.die_with_parent()
    spec, rank = RankSpec(**json.loads(argv[1])), int(argv[2])
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s"
    )
    # Ctrl-C reaches the whole process group: a rank leaves when rank 0 lets it (stdin), not on
    # the signal meant for its node (which drains first).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="parent", daemon=True).start()
    code = 0
    try:
        run_rank(spec, rank)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        code = 1
    # NOTE: not a normal interpreter exit: the thread watching stdin holds its reader's lock,
    # which the interpreter's shutdown would wait on.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
