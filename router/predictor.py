"""What latency a request will see, predicted at its arrival: the admission queue's input.

Time to first token (Mooncake's early rejection, DistServe's goodput): a request that must queue
will wait until the pools let it go, then its own prefill, transfer and D's first step follow.

- **Wait**: the longer of the queue's pace (requests let go per second, whatever the bottleneck:
  decode slots, decode KV or prefill room) times its position, and the uncached prompt tokens
  queued ahead of it over the prefill pool's measured rate (``prefill_capacity``).
- **Own time**: the prefill nodes' backlog (prompt tokens of requests already let go) and its own
  uncached tokens at the measured rate, plus a learned base (transfer, D's first step: the recent
  median of what a request took from leaving the queue to its first token, less that prefill).
  The backlog is read, not learned: when the nodes hold more work than a target allows, requests
  are refused at once even with room in the pools by count.
- **Margin**: the 95th percentile of recent errors (actual less predicted TTFT; never below 0),
  so the prediction corrects itself when the pools change or the model of them is off. A request
  that waited in vain (refused when its target passed) counts with the wait it had, an error at
  least that large: errors of served requests alone would hide the ones the margin failed. Each
  client's own errors once it has MIN_SAMPLES recent ones (the cluster's before): the errors are
  mostly in the queue's wait, which the fair queue makes differ by client, and one margin for
  all, learned from a heavy client's long waits, refused a light client's requests that its own
  short waits would have let through.

Time per output token (Mooncake's decode horizon): the router's requests on a decode node include
those still in prefill there, so ``in_flight`` is the batch a new request will meet when its
prefill ends. Per node, recent requests' TPOT against that batch size give a least-squares line;
a node has room for a request only while the line at ``in_flight + 1`` stays within its TPOT SLO.

Every figure comes from a recent window (the TTFT ones the last 10 s, the TPOT lines the last
minute) and is forgotten when it is old: with no recent samples nothing is predicted. Admission
caps the margin at half a request's target and lets a request go now and then whatever the
prediction (``router.admission``): a router refusing on stale figures would never learn that the
pools recovered.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")

WINDOW = 256  # samples each estimate is drawn from
MAX_AGE_S = 60.0  # samples older than this are forgotten
# The TTFT estimates forget sooner: what a burst taught must not outlive it (a router that
# refuses on stale figures lets few requests go, and so learns little that is new).
TTFT_AGE_S = 10.0
MIN_SAMPLES = 16  # fewer: no estimate
MARGIN_QUANTILE = 0.95  # a request admitted past it is refused late (slo_expired) or misses
MAX_CLIENT_MARGINS = 1024  # clients whose own errors are kept (the least recently seen dropped)
RATE_WINDOW_S = 10.0  # a node's prefill rate: tokens over busy seconds in this window
TPOT_MIN_SPREAD = 2  # batch sizes seen must span this much before a TPOT line is drawn


def quantile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class Samples(Generic[T]):
    """Recent values, at most WINDOW of them, none older than ``max_age_s``."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, max_age_s: float = MAX_AGE_S
    ) -> None:
        self._clock = clock
        self._max_age_s = max_age_s
        self._items: deque[tuple[float, T]] = deque(maxlen=WINDOW)

    def add(self, value: T) -> None:
        self._items.append((self._clock(), value))

    def values(self) -> list[T]:
        since = self._clock() - self._max_age_s
        # NOTE: tuple() of a deque is one C-level copy: the metrics thread reads this too.
        return [v for t, v in tuple(self._items) if t >= since]


class RunningQuantile:
    """A quantile of the last WINDOW values, recomputed every 8th value (read per request: no
    sort on the read); 0 until MIN_SAMPLES were added."""

    __slots__ = ("_q", "_values", "value")

    def __init__(self, q: float) -> None:
        self._q = q
        self._values: deque[float] = deque(maxlen=WINDOW)
        self.value = 0.0

    def add(self, value: float) -> None:
        values = self._values
        values.append(value)
        if len(values) >= MIN_SAMPLES and len(values) % 8 == 0:
            ordered = sorted(values)
            self.value = ordered[int(self._q * (len(ordered) - 1))]


def recent_quantile(samples: Samples[float], q: float) -> float | None:
    values = samples.values()
    return quantile(values, q) if len(values) >= MIN_SAMPLES else None


class BusyRate:
    """Tokens a node computes per second of being busy (at least one request of ours on it),
    over the last RATE_WINDOW_S: a node's prefill capacity, measured without knowing its size."""

    __slots__ = ("_busy_s", "_clock", "_history", "_since", "_tokens", "busy")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.busy = 0  # requests of ours on the node
        self._since = 0.0  # when it became busy
        self._busy_s = 0.0  # busy seconds before ``_since``
        self._tokens = 0  # tokens computed, in all
        self._history: deque[tuple[float, float, int]] = deque()  # (when, busy s, tokens)

    def start(self) -> None:
        if not self.busy:
            self._since = self._clock()
        self.busy += 1

    def end(self, tokens: int) -> None:
        """A request ended on the node; ``tokens`` it computed (0: it failed)."""
        now = self._clock()
        self._tokens += tokens
        self.busy -= 1
        if not self.busy:
            self._busy_s += now - self._since
        if tokens:
            busy_s = self._busy_s + (now - self._since if self.busy else 0.0)
            self._history.append((now, busy_s, self._tokens))
            while self._history and self._history[0][0] < now - RATE_WINDOW_S:
                self._history.popleft()

    def rate(self) -> float | None:
        """Tokens per busy second over the window (None: fewer than MIN_SAMPLES prefills in it,
        or none for RATE_WINDOW_S)."""
        history = tuple(self._history)
        if len(history) < MIN_SAMPLES or history[-1][0] < self._clock() - RATE_WINDOW_S:
            return None
        (_, busy0, tokens0), (_, busy1, tokens1) = history[0], history[-1]
        if busy1 <= busy0:
            return None
        return (tokens1 - tokens0) / (busy1 - busy0)


class PrefillLoad(NamedTuple):
    """The prefill pool as a request leaving the queue meets it."""

    capacity: float | None  # prompt tokens per second it computes when busy (None: not known)
    backlog: int  # prompt tokens it has to compute for requests already let go

    def seconds(self, own_tokens: int) -> float:
        """Until a request's own ``own_tokens`` are computed, behind the backlog (0: unknown)."""
        return (self.backlog + own_tokens) / self.capacity if self.capacity else 0.0


class TTFTPrediction(NamedTuple):
    wait_s: float  # in the router's queue
    own_s: float  # from leaving the queue to the first token
    margin_s: float  # the recent errors' MARGIN_QUANTILE

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.own_s + self.margin_s


class TTFTPredictor:
    """Learns the pools' time to first token from the requests it sees (see the module doc)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # leaving the queue → first token, less its prefill; actual less predicted TTFT
        self._base: Samples[float] = Samples(clock, TTFT_AGE_S)
        self._errors: Samples[float] = Samples(clock, TTFT_AGE_S)
        self._client_errors: OrderedDict[str, Samples[float]] = OrderedDict()  # each client's

    def base_s(self) -> float:
        base = recent_quantile(self._base, 0.5)
        return max(base, 0.0) if base is not None else 0.0

    def margin_s(self, client: str | None = None) -> float:
        """``client``'s margin once it has enough recent errors of its own, else everyone's."""
        own = self._client_errors.get(client) if client is not None else None
        margin = recent_quantile(own, MARGIN_QUANTILE) if own is not None else None
        if margin is None:
            margin = recent_quantile(self._errors, MARGIN_QUANTILE)
        return max(margin, 0.0) if margin is not None else 0.0

    def predict(
        self,
        position: int,
        pace: float,
        tokens_ahead: int,
        own_tokens: int,
        load: PrefillLoad,
        client: str | None = None,
    ) -> TTFTPrediction:
        """``position``: requests in the queue up to and including this one (0: it goes now);
        ``pace``: requests the queue lets go per second (0: unknown); ``tokens_ahead``: uncached
        prompt tokens queued ahead; ``own_tokens``: its own; ``load``: the prefill pool's;
        ``client``: whose request it is (its margin)."""
        wait = position / pace if pace > 0 and position else 0.0
        if load.capacity:
            wait = max(wait, tokens_ahead / load.capacity)
        own = self.base_s() + load.seconds(own_tokens)
        return TTFTPrediction(wait, own, self.margin_s(client))

    def _error(self, error: float, client: str | None) -> None:
        self._errors.add(error)
        if client is None:
            return
        samples = self._client_errors.pop(client, None) or Samples(self._clock, TTFT_AGE_S)
        samples.add(error)
        self._client_errors[client] = samples  # the most recently seen last
        if len(self._client_errors) > MAX_CLIENT_MARGINS:
            self._client_errors.popitem(last=False)

    def observe(
        self,
        prediction: TTFTPrediction,
        queued_s: float,
        first_token_s: float,
        own_tokens: int,
        load: PrefillLoad,
        client: str | None = None,
    ) -> float:
        """A request (of ``client``) had its first token ``first_token_s`` after its arrival,
        ``queued_s`` of it in the queue, ``load`` the prefill pool's when it left the queue:
        learn from it; returns the error (actual less predicted, no margin)."""
        self._base.add(first_token_s - queued_s - load.seconds(own_tokens))
        error = first_token_s - (prediction.wait_s + prediction.own_s)
        self._error(error, client)
        return error

    def expired(
        self, prediction: TTFTPrediction, queued_s: float, client: str | None = None
    ) -> None:
        """A request waited ``queued_s`` and was given up (its target passed): its wait alone
        was that much longer than predicted (its TTFT would have been later still)."""
        self._error(queued_s - prediction.wait_s, client)


class TPOTLine:
    """One decode node's time per output token against the router's requests on it: a
    least-squares line through recent (batch, TPOT) samples."""

    __slots__ = ("_samples",)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._samples: Samples[tuple[float, float]] = Samples(clock)  # (batch, TPOT)

    def add(self, batch: float, tpot_s: float) -> None:
        self._samples.add((batch, tpot_s))

    def predict(self, batch: int) -> float | None:
        """The TPOT a request would see among ``batch`` (None: too few or too alike samples)."""
        pairs = self._samples.values()
        if len(pairs) < MIN_SAMPLES:
            return None
        xs = [x for x, _ in pairs]
        if max(xs) - min(xs) < TPOT_MIN_SPREAD:
            return None
        n = len(pairs)
        mx, my = sum(xs) / n, sum(y for _, y in pairs) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in pairs) / sxx
        slope = max(slope, 0.0)  # a bigger batch is never faster per token
        return my + slope * (batch - mx)
