"""`LocalCluster.stop()` always ends, and ends every process it started.

A CI run of `splitserve up` once hung for good on SIGTERM: its handler raised KeyboardInterrupt
while a `subprocess.Popen.poll` held that Popen's internal lock, so the lock was never released;
`stop()` then waited on it ("decode-0 ignored SIGTERM; killing it") with no end. `up` no longer
raises from its handlers while serving, and `stop()` reaps with `os.waitpid` itself. Here the
lock is taken by hand, as the interrupted poll left it (``_waitpid_lock`` is CPython's name).
While starting, too, `up`'s handlers only call `LocalCluster.interrupt()`: `start()` gives up at
its next check and what it started is stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
from support.processes import descendants, kill_all, still_alive

from splitserve.launcher import ClusterSpec, LocalCluster, StartInterrupted, _Process
from splitserve.models.tiny import write_random_checkpoint

GONE_WITHIN_S = 60.0  # a hang guard, not a bet on speed

IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(120)"
)


def _stop_in_thread(cluster: LocalCluster, within_s: float) -> None:
    """Runs stop() on a thread; fails if it has not ended in ``within_s`` (a hang never ends:
    the limit only has to be far past the 2 s grace, not a bet on this machine's speed)."""
    done = threading.Event()

    def stop() -> None:
        cluster.stop()
        done.set()

    threading.Thread(target=stop, daemon=True).start()
    assert done.wait(within_s), f"stop() still running after {within_s} s"


def _cluster_of(*procs: tuple[str, subprocess.Popen]) -> LocalCluster:
    cluster = LocalCluster(ClusterSpec(model_path="m", stop_grace_s=2.0))
    cluster._procs += [_Process(name, popen) for name, popen in procs]
    return cluster


def test_stop_ends_a_process_whose_popen_lock_an_interrupted_poll_left_held():
    popen = subprocess.Popen(["sleep", "120"], start_new_session=True)
    # and one that needs SIGKILL too, its lock likewise held
    stuck = subprocess.Popen(
        [sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert stuck.stdout is not None and stuck.stdout.readline() == b"ready\n"
        assert popen._waitpid_lock.acquire(False) and stuck._waitpid_lock.acquire(False)
        assert popen.poll() is None  # Popen itself now learns nothing of the process
        cluster = _cluster_of(("decode-0", popen), ("decode-1", stuck))
        _stop_in_thread(cluster, within_s=60)
        assert popen.returncode == -signal.SIGTERM  # ended by stop's SIGTERM, reaped by stop
        assert stuck.returncode == -signal.SIGKILL  # past the 2 s grace: killed, and reaped
    finally:
        for p in (popen, stuck):
            if p.returncode is None:
                p.kill()
        if stuck.stdout is not None:
            stuck.stdout.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("stop") / "m", seed=3)


def test_start_interrupted_gives_up_and_stop_leaves_nothing(model, tmp_path):
    """interrupt() while start() waits for its nodes (they are still importing torch): start()
    raises StartInterrupted, and stop() ends every process it had started."""
    spec = ClusterSpec(
        model_path=str(model), num_prefill=1, num_decode=1, port=0, prefix_index=False,
        log_file=str(tmp_path / "up.log"),
    )  # fmt: skip
    cluster = LocalCluster(spec)
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            cluster.start()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    started: list[int] = []
    try:
        while not cluster.pids() and thread.is_alive():  # the first node is spawned
            thread.join(0.05)
        started = list(cluster.pids().values())
        cluster.interrupt()
        thread.join(GONE_WITHIN_S)
        assert not thread.is_alive(), "start() did not give up"
        assert len(outcome) == 1 and isinstance(outcome[0], StartInterrupted), outcome
        below = [p for pid in started for p in descendants(pid)]
        _stop_in_thread(cluster, within_s=GONE_WITHIN_S)
        left = still_alive([*started, *below], GONE_WITHIN_S)
        assert not left, f"processes outlived stop(): {left}"
    finally:
        kill_all(started)


def test_up_interrupted_while_starting_exits_and_leaves_nothing(model, tmp_path):
    """Ctrl-C to `splitserve up` before its cluster is ready: it says so, exits 0, and nothing it
    started is left."""
    up = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "up", "--model", str(model), "--port", "0",
         "--num-prefill", "1", "--num-decode", "1",
         "--log-file", str(tmp_path / "up.log")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    below: list[int] = []
    try:
        while not (below := descendants(up.pid)) and up.poll() is None:
            threading.Event().wait(0.05)
        up.send_signal(signal.SIGINT)
        out, err = up.communicate(timeout=GONE_WITHIN_S)
        assert up.returncode == 0, err
        assert "ready:" not in out  # it was still starting
        assert "interrupted while waiting for" in err, err
        left = still_alive(below, GONE_WITHIN_S)
        assert not left, f"processes outlived up: {left}"
    finally:
        if up.poll() is None:
            up.kill()
        kill_all(below)
