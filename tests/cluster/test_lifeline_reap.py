"""`lifeline.reap`: a helper process (a node's engine process, a tensor-parallel rank) is waited
for, killed, and then waited for only so long: a process stuck in the kernel (a GPU driver call)
outlives SIGKILL, and a stop that waited for it without an end would hang the node's stop."""

from __future__ import annotations

import logging
import subprocess
import sys

from splitserve.engine import lifeline

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_helper_that_exits_is_reaped_without_a_kill():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert lifeline.reap(proc, 30.0, "helper")
    assert proc.returncode == 0


def test_a_helper_that_does_not_stop_is_killed():
    proc = subprocess.Popen(SLEEPER)
    assert lifeline.reap(proc, 0.1, "helper")
    assert proc.returncode == -9


def test_a_helper_that_outlives_its_kill_is_given_up_on(monkeypatch, caplog):
    """The kill made to do nothing stands in for a process in uninterruptible sleep (which a test
    cannot make): reap returns, says so, and the process is left to the kernel."""
    monkeypatch.setattr(lifeline, "KILL_WAIT_S", 0.2)
    proc = subprocess.Popen(SLEEPER)
    real_kill = proc.kill
    monkeypatch.setattr(proc, "kill", lambda: None)
    try:
        with caplog.at_level(logging.ERROR, logger=lifeline.__name__):
            assert not lifeline.reap(proc, 0.1, "helper")
        assert proc.poll() is None  # still there: given up on, not waited for
        assert "outlived SIGKILL" in caplog.text
    finally:
        real_kill()
        proc.wait()
