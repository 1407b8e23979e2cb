"""`splitserve up --autoscale` of the embedded tiny model, from 1 prefill + 1 decode node, under a
step load (low, high, none): decode is the short pool (2 sequence slots a node), so it grows
within 30 s of the step and the router's `splitserve_router_nodes{role="decode"}` follows;
prefill, never short, is never scaled; after the load ends decode drains back to 1 node; no
request fails; Ctrl-C stops everything."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from support.processes import Traffic

from splitserve.planner.scrape import fetch, parse

COOLDOWN_S = 6


def _scrape(url: str) -> dict[str, float]:
    return parse(fetch(url, 5))[0]


def _wait_for(what, timeout: float, every: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := what():
            return value
        time.sleep(every)
    return None


@pytest.mark.timeout(300)
def test_up_autoscale_grows_the_short_pool_and_drains_it_back(tmp_path):
    log = (tmp_path / "up.log").open("w")
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--model", "tiny", "--port", "0"]
    argv += ["--api-key-file", "none"]  # open APIs: the keys are test_cluster_up's
    argv += ["--max-num-seqs", "2", "--autoscale", "--max-prefill", "2", "--max-decode", "2"]
    argv += ["--interval", "1", "--scale-out-after", "1", "--cooldown", str(COOLDOWN_S)]
    argv += ["--planner-metrics-port", "0", "--record", str(tmp_path / "trace.jsonl")]
    # The load must lose no request to the scale-out and the drain (a router refusing for its
    # loop's lag, router_busy, would be the machine's speed: tests/conftest.py turns it off).
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    load = None
    try:
        assert up.stdout is not None
        lines = []
        while not (line := up.stdout.readline()).startswith("ready:"):
            assert line, f"up exited; see {tmp_path / 'up.log'}"
            lines.append(line.split())
        urls = {w[0]: w[-1] for w in lines if "metrics" in w}
        target = next(w[1] for w in lines if w[0] == "router")  # the port its router bound
        router, planner = urls["router"], urls["planner"]

        def nodes(role: str) -> float:
            return _scrape(router).get(f'splitserve_router_nodes{{role="{role}"}}', 0.0)

        def wanted(role: str) -> float:
            return _scrape(planner).get(f'splitserve_planner_wanted_nodes{{role="{role}"}}', 0.0)

        assert _wait_for(lambda: nodes("decode") == 1 and nodes("prefill") == 1, 30)
        # low: one client, decode load 0.5
        low = Traffic(target, 1, prompt_len=24, max_tokens=16, timeout=120)
        time.sleep(4)
        low.stop()
        assert wanted("decode") == 1 and not low.failures and low.ok
        # high: 8 clients for 2 slots
        load = Traffic(target, 8, prompt_len=24, max_tokens=32, timeout=120)
        step = time.monotonic()
        assert _wait_for(lambda: wanted("decode") == 2, 30), "decode did not grow within 30 s"
        grew_after = time.monotonic() - step
        # a node's start competes with the load for the two cores of a CI machine: allow it time
        assert _wait_for(lambda: nodes("decode") == 2, 90 - grew_after), "router missed it"
        time.sleep(3)  # the new node serves
        load.stop()
        ended = time.monotonic()
        assert _wait_for(lambda: nodes("decode") == 1 and wanted("decode") == 1, COOLDOWN_S + 40)
        drained_after = time.monotonic() - ended
        figures = _scrape(planner)
        assert figures['splitserve_planner_decisions_total{direction="up",role="decode"}'] >= 1
        assert figures['splitserve_planner_decisions_total{direction="down",role="decode"}'] >= 1
        assert figures['splitserve_planner_decisions_total{direction="up",role="prefill"}'] == 0
        assert nodes("prefill") == 1
        assert not load.failures, load.failures[:3]
        assert load.ok > 0
        print(f"decode grew {grew_after:.1f} s after the step, drained {drained_after:.1f} s after")
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        planner_log = [x for x in (tmp_path / "up.log").read_text().splitlines() if "planner:" in x]
        assert any("decode 1 -> 2: scale out" in x for x in planner_log)
        assert any("decode 2 -> 1: scale in" in x for x in planner_log)
    finally:
        if load is not None:
            load.stop()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
