"""Serving processes keep start-up objects out of the collector's scans (runtime.server): after
``settle_garbage_collector`` what exists is frozen and young collections are rarer. Run in a
child process, so this test process's collector is left as it is."""

import subprocess
import sys

CHILD = """
import gc
from splitserve.runtime.server import GC_GEN0_THRESHOLD, settle_garbage_collector
assert gc.get_freeze_count() == 0
keep = [[i] for i in range(1000)]  # objects made at start-up
settle_garbage_collector()
assert gc.get_freeze_count() >= len(keep), gc.get_freeze_count()
assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD > 700, gc.get_threshold()
cycle = []
cycle.append(cycle)  # garbage made while serving is still collected
del cycle
assert gc.collect() >= 1
print("ok")
"""


def test_start_up_objects_are_frozen_and_later_garbage_still_collected():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
