"""Latency targets a request carries: its service-level objective (SLO).

One syntax everywhere (the router's ``--slo``, the ``x-splitserve-slo`` HTTP header, ``splitserve
bench --slo``): ``ttft=SECONDS[,tpot=SECONDS]``, each value in seconds or with ``ms``
(``ttft=500ms``). Torch-free: the router, the SDK and the benchmark client parse it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

SLO_SYNTAX = "ttft=SECONDS[,tpot=SECONDS] (e.g. ttft=2,tpot=100ms)"


def parse_bounds(text: str | None, keys: Iterable[str]) -> dict[str, float]:
    """``ttft=2,tpot=50ms`` → {"ttft": 2.0, "tpot": 0.05}; ``ValueError`` naming the bad part.
    Only ``keys`` are allowed; each bound is a positive, finite number of seconds."""
    allowed = tuple(keys)
    bounds: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if not sep or key not in allowed:
            raise ValueError(f"bad SLO {part!r}: give KEY=SECONDS with KEY one of {allowed}")
        scale = 1e-3 if value.endswith("ms") else 1.0
        try:
            seconds = float(value.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"bad SLO {part!r}: {value!r} is not a number of seconds") from None
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"bad SLO {part!r}: a bound is a positive number of seconds")
        bounds[key] = seconds
    return bounds


class Slo(NamedTuple):
    """Time to first token and time per output token a request must meet (None: unbounded)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Slo | None:
        """``--slo``'s value; None for an empty one (no default SLO)."""
        bounds = parse_bounds(text, ("ttft", "tpot"))
        if not bounds:
            return None
        return cls(bounds.get("ttft"), bounds.get("tpot"))

    @classmethod
    def checked(cls, ttft_s: float | None, tpot_s: float | None) -> Slo | None:
        """An SLO from numbers a client sent (None/0: that bound unset); ``ValueError`` when one
        is negative or not finite."""
        for name, value in (("ttft", ttft_s), ("tpot", tpot_s)):
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"slo.{name} is {value}: give a positive number of seconds")
        ttft, tpot = ttft_s or None, tpot_s or None
        return cls(ttft, tpot) if ttft or tpot else None

    def within(self, limit: Slo | None) -> Slo:
        """This SLO where it is set, else ``limit``'s (a request's own bounds over the
        router's default)."""
        if limit is None:
            return self
        return Slo(
            self.ttft_s if self.ttft_s is not None else limit.ttft_s,
            self.tpot_s if self.tpot_s is not None else limit.tpot_s,
        )

    def capped(self, seconds_left: float) -> Slo:
        """The TTFT bound no later than the client's deadline (``seconds_left`` from now)."""
        if self.ttft_s is None or self.ttft_s > seconds_left:
            return self._replace(ttft_s=seconds_left)
        return self

    def both(self) -> tuple[float, float]:
        """(ttft_s, tpot_s) of an SLO that bounds both (the planner's and a layout's aim);
        ``ValueError`` when one is unset."""
        if self.ttft_s is None or self.tpot_s is None:
            raise ValueError(f"SLO {self}: give both bounds, ttft=SECONDS,tpot=SECONDS")
        return self.ttft_s, self.tpot_s

    def __str__(self) -> str:
        parts = [f"{k}={v:g}" for k, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s)) if v]
        return ",".join(parts) or "none"
