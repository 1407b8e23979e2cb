"""When requests arrive: a Poisson process or a burstier (or smoother) gamma process.

As vLLM's ``bench serve``: the gaps between arrivals are gamma-distributed with shape
``burstiness`` and mean ``1 / rate``. ``burstiness`` 1 is a Poisson process (exponential gaps);
below 1 the arrivals come in bursts, above 1 they are more evenly spaced (the gaps' coefficient
of variation is ``1 / sqrt(burstiness)``). An infinite rate sends everything at once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

__all__ = ["arrival_times", "intervals"]


def intervals(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless gaps (seconds) between consecutive arrivals."""
    if not rate > 0:
        raise ValueError("the request rate must be positive (inf: all at once)")
    if not burstiness > 0:
        raise ValueError("burstiness must be positive (1: Poisson)")
    rng = random.Random(seed)
    if math.isinf(rate):
        while True:
            yield 0.0
    theta = 1.0 / (rate * burstiness)  # scale: mean = shape * scale = 1 / rate
    while True:
        yield rng.gammavariate(burstiness, theta)


def arrival_times(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless arrival times (seconds from the start); the first request arrives at 0."""
    t = 0.0
    yield t
    for gap in intervals(rate, burstiness, seed):
        t += gap
        yield t
