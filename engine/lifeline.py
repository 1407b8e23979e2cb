"""A helper process ends when the process that started it ends, however that one ends.

A node's engine process (``runtime.engine_process``) and an engine's tensor-parallel ranks
(``engine.ranks``) hold the GPU's memory. Their orderly ends (a stop command, their stdin's EOF)
need the parent to say so, and a process that is killed (SIGKILL, the OOM killer), or stuck in a
collective that never returns, says nothing: its helpers then lived on, holding the GPU. So each
helper asks the kernel to SIGKILL it when its parent dies (Linux ``PR_SET_PDEATHSIG``: no thread
of its own has to run, so it works while the helper's threads are blocked, and a SIGSTOPped
helper is killed too). A node killed outright takes its engine process with it, which takes its
ranks.

    parent: subprocess.Popen(cmd, env=lifeline.child_env())
    child, first thing in its main(): lifeline.die_with_parent()

NOTE: the kernel ties the signal to the parent's *thread* that forked the helper: spawn helpers
from a thread that lives as long as the parent process (every caller here spawns from its main
thread). Where ``prctl`` is missing (not Linux), a daemon thread polls ``getppid`` instead.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping

import splitserve.settings as settings

logger = logging.getLogger(__name__)

ORPHAN_EXIT_CODE = 71  # a helper whose parent was already gone when it started (EX_OSERR)
_PR_SET_PDEATHSIG = 1
POLL_S = 0.5  # the fallback thread's interval


KILL_WAIT_S = 10.0  # how long a helper sent SIGKILL is waited for before it is given up on


def reap(process: subprocess.Popen, timeout: float, name: str) -> bool:
    """Wait ``timeout`` seconds for the helper ``process`` to exit, SIGKILL it if it has not,
    then wait at most ``KILL_WAIT_S`` more: never a wait without an end (a process stuck in the
    kernel, e.g. in a GPU driver call, outlives SIGKILL until that call returns). False, with an
    error logged, if it is still there."""
    try:
        process.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        logger.warning("%s (pid %d) did not stop in %.1f s: killing it", name, process.pid, timeout)
    process.kill()
    try:
        process.wait(KILL_WAIT_S)
        return True
    except subprocess.TimeoutExpired:
        logger.error(
            "%s (pid %d) outlived SIGKILL for %.0f s; left to the kernel",
            name,
            process.pid,
            KILL_WAIT_S,
        )
        return False


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a helper that must end with this process."""
    base = settings.environment() if env is None else dict(env)
    return {**base, settings.PARENT_PID.name: str(os.getpid())}


def die_with_parent() -> bool:
    """In a helper started with ``child_env``: be SIGKILLed when the parent ends. Exits at once
    if the parent is already gone. Returns whether a lifeline is set (False: not started with
    ``child_env``, e.g. by hand)."""
    expected = settings.PARENT_PID.take()
    if not expected:
        return False
    parent = int(expected)
    if not _parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_poll_parent, args=(parent,), name="lifeline", daemon=True).start()
    # The parent may have died before the kernel was asked (then no signal ever comes).
    if os.getppid() != parent:
        logger.error("the process that started this one (pid %d) is gone: exiting", parent)
        os._exit(ORPHAN_EXIT_CODE)
    return True


def term_with_parent() -> None:
    """A ``preexec_fn`` for a helper that cannot call ``die_with_parent`` itself (a program not
    ours: redis-server, Mooncake's binaries): SIGTERM when the process that started it ends
    (Linux; elsewhere nothing)."""
    _parent_death_signal(signal.SIGTERM)


def _parent_death_signal(sig: int) -> bool:
    if sys.platform != "linux":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _poll_parent(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(POLL_S)
    os._exit(ORPHAN_EXIT_CODE)
