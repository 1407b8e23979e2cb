"""Nothing a node starts outlives it: its engine process and its tensor-parallel ranks end with
it however it ends (SIGKILL; a rank stopped as in a collective that never returns), and `up`'s
launcher leaves no process of a component's group behind (engine.lifeline, launcher).

On a CPU the ranks are gloo processes; tests/gpu/test_nothing_outlives_gpu.py checks that a GPU
node's memory is given back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from support.processes import cmdline, descendants, kill_all, start_node, still_alive

from splitserve.engine.client import STOP_TIMEOUT_S
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.models.tiny import write_random_checkpoint

GONE_WITHIN_S = 30.0  # a hang guard: the kernel's SIGKILL takes milliseconds


@contextlib.contextmanager
def _node_with_rank1_stopped(model, tmp_path, *flags: str, engine_process: str = "on"):
    """A prefill node at TP 2 (with an engine process, or the engine on a thread of the node),
    its rank 1 stopped (as in a collective that never returns); yields the node and the
    processes below it (killed at the end, whatever)."""
    tp2 = ("--tensor-parallel-size", "2", "--engine-process", engine_process)
    node = start_node("prefill", model, tmp_path, *tp2, *flags)
    helpers = descendants(node.popen.pid)
    try:
        expected = 2 if engine_process == "on" else 1  # (the engine process,) rank 1
        assert len(helpers) == expected, f"expected {expected} processes below, found {helpers}"
        (rank1,) = [p for p in helpers if "splitserve.engine.ranks" in cmdline(p)]
        os.kill(rank1, signal.SIGSTOP)
        yield node, helpers
    finally:
        node.stop()
        kill_all(helpers)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("outlive") / "m", seed=5)


def test_a_helper_dies_with_its_parent_even_while_stopped(tmp_path):
    """engine.lifeline alone: a parent SIGKILLed takes its stopped helper with it."""
    parent = textwrap.dedent(
        """
        import subprocess, sys, time
        from splitserve.engine import lifeline
        child = subprocess.Popen(
            [sys.executable, "-c",
             "from splitserve.engine import lifeline; import time; "
             "assert lifeline.die_with_parent(); print('ready', flush=True); time.sleep(600)"],
            env=lifeline.child_env(), stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "ready\\n"
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        helper = int(proc.stdout.readline())
        os.kill(helper, signal.SIGSTOP)  # stuck: it can run nothing of its own
        proc.kill()
        proc.wait(10)
        assert not still_alive([helper], GONE_WITHIN_S), "the stopped helper outlived its parent"
    finally:
        proc.kill()
        kill_all(descendants(proc.pid))


@pytest.mark.slow
def test_a_node_killed_with_a_rank_stuck_leaves_no_engine_process_and_no_rank(model, tmp_path):
    with _node_with_rank1_stopped(model, tmp_path) as (node, helpers):
        node.popen.kill()
        node.popen.wait(10)
        left = still_alive(helpers, GONE_WITHIN_S)
        assert not left, f"processes outlived their node: {left}"


@pytest.mark.slow
def test_up_stopped_with_a_rank_stuck_leaves_nothing_running(model, tmp_path):
    """The launcher's stop: the node whose rank is stuck ignores SIGTERM past the grace and is
    killed; its engine process and ranks go with it; every process `up` started is gone."""
    spec = ClusterSpec(
        model_path=str(model),
        num_prefill=1,
        num_decode=1,
        port=0,  # the router binds a free one (a port picked here could be taken first)
        node_args=("--kv-cache-mb", "64", "--engine-process", "on"),
        prefill_tp=2,
        decode_tp=1,
        log_file=str(tmp_path / "up.log"),
        stop_grace_s=3.0,
    )
    cluster = LocalCluster(spec)
    everything: list[int] = []
    try:
        cluster.start()
        pids = cluster.pids()
        prefill = pids["prefill-0"]
        everything = [p for pid in pids.values() for p in [pid, *descendants(pid)]]
        below = descendants(prefill)
        assert len(below) == 2, f"prefill-0: expected an engine process and rank 1, found {below}"
        (rank1,) = [p for p in below if "splitserve.engine.ranks" in cmdline(p)]
        os.kill(rank1, signal.SIGSTOP)
        cluster.stop()
        left = still_alive(everything, GONE_WITHIN_S)
        assert not left, f"left running after up stopped: {left}"
    finally:
        cluster.stop()
        kill_all(everything)


@pytest.mark.slow
def test_a_node_with_a_rank_stuck_obeys_sigterm_and_takes_its_helpers(model, tmp_path, monkeypatch):
    """SIGTERM to a node whose engine cannot stop (rank 1 stopped): it drains, gives its engine
    process its stop timeout in all (SPLITSERVE_ENGINE_STOP_TIMEOUT_S, 3 s here; 20 s by
    default), kills it, and exits; nothing it started is left."""
    monkeypatch.setenv("SPLITSERVE_ENGINE_STOP_TIMEOUT_S", "3")  # the node inherits it
    with _node_with_rank1_stopped(model, tmp_path, "--drain-timeout-s", "1") as (node, helpers):
        node.popen.terminate()
        # A hang guard: its drain (1 s), the engine's stop, start-up slack.
        node.popen.wait(1 + STOP_TIMEOUT_S + 30)
        assert "the engine process (pid" in node.log.read_text()
        assert "did not stop in" in node.log.read_text()
        left = still_alive(helpers, GONE_WITHIN_S)
        assert not left, f"processes outlived their node: {left}"


@pytest.mark.slow
def test_a_node_running_its_engine_itself_with_a_rank_stuck_obeys_sigterm(
    model, tmp_path, monkeypatch
):
    """The same with the engine on a thread of the node (``--engine-process off``, a CPU's
    default): its stop waits SPLITSERVE_ENGINE_STOP_TIMEOUT_S for the stuck step, then ends the
    ranks and exits; nothing is left."""
    monkeypatch.setenv("SPLITSERVE_ENGINE_STOP_TIMEOUT_S", "3")
    flags = ("--drain-timeout-s", "1")
    with _node_with_rank1_stopped(model, tmp_path, *flags, engine_process="off") as (node, helpers):
        node.popen.terminate()
        node.popen.wait(1 + STOP_TIMEOUT_S + 30)  # a hang guard
        assert "the engine did not stop within 3 s" in node.log.read_text()
        left = still_alive(helpers, GONE_WITHIN_S)
        assert not left, f"processes outlived their node: {left}"
