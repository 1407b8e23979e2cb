"""Where an engine step's time goes: the phases of every step, timed on the thread that steps.

``StepProfile(engine)`` wraps the engine's scheduler, runner and sampler; call its ``step()``
instead of ``engine.step()``. Each step becomes a row: its wall time; the CPU time of schedule,
input preparation, the forward's launch, sampling and the rest (bookkeeping, stop checks, and the
wait for the GPU's results); on CUDA the GPU time from the forward's start to sampling's end
(CUDA events, so launch gaps inside a forward count as busy); whether it computed prompt tokens;
how many requests it ran; and when it started (so the gaps between steps show when the engine
had nothing to run). ``table()`` sums the rows up by kind, ``dump(path)`` writes both.

Used by ``benchmarks/engine.py`` (in process) and by a node whose ``SPLITSERVE_STEP_PROFILE``
names a file (``runtime.node``): the same figures with the node's event loop beside the engine
thread, so the two can be compared. Timing costs a few microseconds and two CUDA events a step.
"""

from __future__ import annotations

import json
import time

import torch

PHASES = ("schedule", "prepare", "launch", "sample", "other")


class StepProfile:
    """Wraps one engine's scheduler, runner and sampler to time every step's phases."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.cuda = engine.runner.device.type == "cuda"
        self.rows: list[dict] = []
        self._t0 = time.perf_counter()  # rows' "start": seconds from here (gaps are idle time)
        self._cur: dict = {}
        self._events: list[tuple] = []
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "prepare", "prepare")
        self._wrap(engine.runner, "execute", "execute", start_event=True)
        self._wrap(engine.sampler, "launch", "sample", end_event=True)

    def _wrap(self, obj, name: str, phase: str, start_event=False, end_event=False) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if start_event and self.cuda:
                self._cur["ev0"] = torch.cuda.Event(enable_timing=True)
                self._cur["ev0"].record()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._cur[phase] = self._cur.get(phase, 0.0) + time.perf_counter() - t0
                if end_event and self.cuda and "ev0" in self._cur:
                    ev1 = torch.cuda.Event(enable_timing=True)
                    ev1.record()
                    self._events.append((len(self.rows), self._cur.pop("ev0"), ev1))

        setattr(obj, name, timed)

    def step(self, on_launch=None):
        """``engine.step(on_launch)``, timed; a step that scheduled nothing is not recorded."""
        engine = self.engine
        prefill = any(
            r.num_computed_tokens < len(r.prompt_token_ids)
            for r in (*engine.scheduler.running, *engine.scheduler.waiting)
        )
        self._cur = {}
        t0 = time.perf_counter()
        outputs = engine.step(on_launch)
        wall = time.perf_counter() - t0
        if not engine.last_num_scheduled:
            self._cur.pop("ev0", None)
            return outputs
        cur = self._cur
        row = {
            "start": t0 - self._t0,
            "wall": wall,
            "prefill": prefill,
            "seqs": engine.last_num_scheduled,
            "gpu": 0.0,
        }
        row["schedule"] = cur.get("schedule", 0.0)
        row["prepare"] = cur.get("prepare", 0.0)
        row["launch"] = cur.get("execute", 0.0) - row["prepare"]
        row["sample"] = cur.get("sample", 0.0)
        row["other"] = wall - sum(row[p] for p in PHASES[:-1])
        self.rows.append(row)
        return outputs

    def _gpu_times(self) -> None:
        if self.cuda and self._events:
            torch.cuda.synchronize()
            for i, ev0, ev1 in self._events:
                self.rows[i]["gpu"] += ev0.elapsed_time(ev1) / 1e3
            self._events.clear()

    def table(self) -> list[dict]:
        """Per kind of step (prefill: computed prompt tokens, chunks mixed with decodes;
        decode), in ms per step: wall, GPU, GPU idle (wall - GPU, what overlapping the CPU's work
        with the GPU could win back) and each phase; and the kind's total seconds."""
        self._gpu_times()
        out = []
        for kind in ("prefill", "decode"):
            rows = [r for r in self.rows if r["prefill"] == (kind == "prefill")]
            if not rows:
                continue
            n = len(rows)
            line = {"steps": kind, "count": n, "seqs": sum(r["seqs"] for r in rows) / n}
            for key in ("wall", "gpu"):
                line[f"{key}_ms"] = 1e3 * sum(r[key] for r in rows) / n
            line["gpu_idle_ms"] = line["wall_ms"] - line["gpu_ms"] if self.cuda else None
            for p in PHASES:
                line[f"{p}_ms"] = 1e3 * sum(r[p] for r in rows) / n
            line["total_s"] = sum(r["wall"] for r in rows)
            out.append(line)
        return out

    def dump(self, path: str) -> None:
        """The table and every row, as JSON (GPU times filled in first)."""
        table = self.table()
        with open(path, "w") as f:
            json.dump({"table": table, "rows": self.rows}, f)
