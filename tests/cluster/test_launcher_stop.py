"""`LocalCluster.stop()` always ends, and ends every process it started.

A CI run of `splitserve up` once hung for good on SIGTERM: its handler raised KeyboardInterrupt
while a `subprocess.Popen.poll` held that Popen's internal lock, so the lock was never released;
`stop()` then waited on it ("decode-0 ignored SIGTERM; killing it") with no end. `up` no longer
raises from its handlers while serving, and `stop()` reaps with `os.waitpid` itself. Here the
lock is taken by hand, as the interrupted poll left it (``_waitpid_lock`` is CPython's name)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from splitserve.launcher import ClusterSpec, LocalCluster, _Process

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
