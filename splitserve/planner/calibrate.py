"""Measure the rates the layout search needs (``layout.EngineRates``) on this machine's engine:
``splitserve calibrate --model M --device cuda --out rates.json``.

One engine at TP 1 on one device (the node's own loading and runner: ``runtime.node``), random
prompts, prefix caching unused (no prompt repeats):

- **prefill**: ``prefill_requests`` prompts of ``prompt_tokens`` tokens added at once and run
  until each has its first token; prompt tokens / the time of those steps;
- **decode**: for each batch size ``B``, ``B`` prompts of the same length prefilled, then
  ``steps`` decode steps of all ``B`` timed; the step time's least-squares line over the batch
  sizes gives ``step_base_s`` and ``step_per_seq_s``. A batch whose KV does not fit the pool is
  skipped (and said).

The file is ``EngineRates``' fields as JSON, with what was measured on what (``measured``); add
``tp_speedup`` pairs (``[[2, 1.44]]``: TP 2 runs 1.44x TP 1, from benchmarks/engine.py) to let
the search consider tensor-parallel pools.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitserve.planner.layout import EngineRates

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Measurement:
    rates: EngineRates
    prefill_tokens: int  # what the prefill rate was measured over
    decode_steps: dict[int, float]  # batch -> seconds a step
    device: str
    model: str

    def to_json(self) -> str:
        fields = dataclasses.asdict(self.rates)
        fields["measured"] = {
            "model": self.model,
            "device": self.device,
            "prefill_tokens": self.prefill_tokens,
            "decode_step_s": {str(b): s for b, s in sorted(self.decode_steps.items())},
            "date": time.strftime("%Y-%m-%d"),
        }
        return json.dumps(fields, indent=2) + "\n"


def load_rates(path: str | Path) -> EngineRates:
    """``EngineRates`` from a file ``calibrate`` wrote (or one written by hand); ``ValueError``
    naming the file for anything missing or malformed."""
    try:
        fields: dict[str, Any] = json.loads(Path(path).read_text())
        fields.pop("measured", None)
        if "tp_speedup" in fields:
            fields["tp_speedup"] = tuple((int(n), float(x)) for n, x in fields["tp_speedup"])
        return EngineRates(**fields)
    except (OSError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a rates file ({exc})") from None


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` (``b`` >= 0; one point: a flat line)."""
    if not points:
        raise ValueError("no points to fit")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    b = max(sum((x - mx) * (y - my) for x, y in points) / sxx, 0.0)
    return my - b * mx, b


def calibrate(
    config: Any,  # runtime.config.NodeConfig
    prompt_tokens: int = 1024,
    batches: Sequence[int] = (1, 32, 128, 256),
    steps: int = 8,
    prefill_requests: int = 16,
) -> Measurement:
    """Measure ``config``'s engine (see the module's docstring)."""
    from splitserve.models.sampling_params import SamplingParams
    from splitserve.runtime.node import build_engine

    if prompt_tokens < 1 or steps < 1 or prefill_requests < 1 or not batches:
        raise ValueError("give prompt_tokens, steps and prefill_requests >= 1 and a batch size")
    core, _ = build_engine(config, prefill_only=False)
    try:
        rng = random.Random(0)
        vocab = min(core.runner.config.vocab_size, 30_000)
        ids = iter(range(10**9))

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randrange(1, vocab) for _ in range(prompt_tokens)] for _ in range(n)]

        def drain() -> None:
            while core.has_unfinished():
                core.step()

        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for p in prompts(2):  # warm-up: first launches, caches, graphs
            core.add_request(f"cal-{next(ids)}", p, first)
        drain()

        for p in prompts(prefill_requests):
            core.add_request(f"cal-{next(ids)}", p, first)
        started = time.perf_counter()
        drain()
        prefill_s = time.perf_counter() - started
        prefill_tokens = prefill_requests * prompt_tokens

        usable = core.pool.num_blocks - 1
        per_request = -(-(prompt_tokens + steps + 2) // core.block_size)
        decode: dict[int, float] = {}
        for batch in sorted(set(batches)):
            if batch > core.max_num_seqs or batch * per_request > usable:
                logger.warning(
                    "calibrate: batch %d skipped (%d sequences at most, KV for %d requests of "
                    "%d tokens)",
                    batch,
                    core.max_num_seqs,
                    usable // per_request,
                    prompt_tokens,
                )
                continue
            params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
            rids = [f"cal-{next(ids)}" for _ in range(batch)]
            for rid, p in zip(rids, prompts(batch), strict=True):
                core.add_request(rid, p, params)
            while core.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                      for r in core.running):  # fmt: skip
                core.step()  # the prefills (and their first tokens)
            started = time.perf_counter()
            for _ in range(steps):
                core.step()
            decode[batch] = (time.perf_counter() - started) / steps
            drain()
        if not decode:
            raise ValueError(
                "no batch size fit the KV cache: give a larger cache or shorter prompts"
            )
        base, per_seq = fit_line(list(decode.items()))
        rates = EngineRates(
            prefill_tokens_per_s=prefill_tokens / prefill_s,
            step_base_s=max(base, 1e-6),
            step_per_seq_s=per_seq,
            max_num_seqs=core.max_num_seqs,
        )
        return Measurement(
            rates, prefill_tokens, decode, str(core.runner.device), config.model_path
        )
    finally:
        core.runner.close()
