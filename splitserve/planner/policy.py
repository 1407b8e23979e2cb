"""The scaling policy: one pure function, ``decide``, from a snapshot of the router's figures, the
current node counts, bounds, SLO and the policy's own small state to the wanted counts.

Which pool is short is read from where the router's queue is blocked (docs/deploy.md,
"Overload"): a request leaves the queue only once a prefill node *and* a decode node with room
for its KV can take it, so

- **decode is short** when its sequence slots or its KV blocks are used past ``out_util``
  (``splitserve_router_pool_in_flight{role="decode"} / _pool_slots``,
  ``_decode_kv_blocks{state="charged"} / {state="total"}``), or TPOT is over the SLO while the
  pool is loaded past ``in_util`` (a slow model on an idle pool is not helped by more nodes);
- **prefill is short** when requests wait in the queue while the decode pool has room (so
  prefill is what holds them), or when the prompt tokens the prefill nodes already hold would
  take them longer than ``backlog_share`` of the TTFT SLO at their measured rate (with more
  requests there than nodes).

Hysteresis: a pool grows only after it has been short for ``out_after_s``, and not again until
the nodes it asked for are routable (or ``settle_s`` passed); it shrinks by one node only after
its signal, projected onto one node fewer, has stayed under ``in_util`` for ``cooldown_s`` *and*
``cooldown_s`` has passed since that pool's last change. Scale-out thresholds sit above the
scale-in ones, so a pool at a steady load stays where it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from splitserve.runtime.slo import Slo

ROLES = ("prefill", "decode")


class Counts(NamedTuple):
    prefill: int
    decode: int


@dataclass(frozen=True, slots=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError("give 0 <= --min-prefill <= --max-prefill")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError("give 1 <= --min-decode <= --max-decode")

    def clamp(self, role: str, n: int) -> int:
        lo, hi = (
            (self.min_prefill, self.max_prefill)
            if role == "prefill"
            else (self.min_decode, self.max_decode)
        )
        return min(max(n, lo), hi)


AIM = Slo(ttft_s=2.0, tpot_s=0.1)  # the planner's aim where --slo leaves a bound unset


def aim(text: str | None) -> Slo:
    """The planner's aim: ``--slo`` (the router's syntax, runtime.slo), AIM's bound for any it
    leaves out."""
    return (Slo.parse(text) or AIM).within(AIM)


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """One pool as the router sees it (its usable nodes only)."""

    nodes: int = 0  # splitserve_router_nodes{role}
    in_flight: int = 0  # splitserve_router_pool_in_flight{role}
    slots: int = 0  # decode: splitserve_router_pool_slots (max_num_seqs summed; 0: unknown)
    prompt_tokens: int = 0  # prefill: splitserve_router_pool_prompt_tokens


@dataclass(frozen=True, slots=True)
class Figures:
    """One scrape of the router's /metrics (planner.scrape), at ``at`` seconds (monotonic)."""

    at: float
    queue_length: int = 0
    queue_prompt_tokens: int = 0
    oldest_wait_s: float = 0.0
    wait_p99_s: float = 0.0
    prefill: PoolFigures = field(default_factory=PoolFigures)
    decode: PoolFigures = field(default_factory=PoolFigures)
    kv_blocks_total: int = 0
    kv_blocks_charged: int = 0
    prefill_tokens_per_s: float = 0.0
    # 90th percentiles over the requests since the previous scrape (None: none finished one).
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    out_util: float = 0.85  # decode load (slots or KV) at or above which decode is short
    in_util: float = 0.5  # load, projected onto one node fewer, under which a pool may shrink
    target_util: float = 0.7  # the load a grown decode pool is sized for
    wait_share: float = 0.25  # queue wait, as a share of the TTFT SLO, that counts as short
    backlog_share: float = 0.5  # prefill backlog time, as a share of the TTFT SLO
    out_after_s: float = 2.0  # short for this long before a pool grows
    cooldown_s: float = 60.0  # low for this long, and this long since its last change, to shrink
    settle_s: float = 120.0  # after growing, wait for the new nodes at most this long
    max_step: int = 2  # nodes one decision may add to a pool


@dataclass(frozen=True, slots=True)
class RoleState:
    short_since: float | None = None
    low_since: float | None = None
    changed_at: float | None = None  # last time this pool's wanted count changed
    asked: int | None = None  # the count it asked for then


@dataclass(frozen=True, slots=True)
class PolicyState:
    prefill: RoleState = field(default_factory=RoleState)
    decode: RoleState = field(default_factory=RoleState)
    # Prompt tokens per second one prefill node computed at most (learned; 0: not seen yet).
    prefill_node_rate: float = 0.0


class Decision(NamedTuple):
    wanted: Counts
    reasons: dict[str, str]  # role -> why it is wanted at that count
    state: PolicyState


class _Signal(NamedTuple):
    short: bool
    low: bool  # low even with one node fewer
    severity: float  # how short: > 1 means a step of more than one node may be needed
    why: str


def decode_load(f: Figures) -> float:
    """The decode pool's load: the larger of its slot use and its KV use (0 when unknown)."""
    seq = f.decode.in_flight / f.decode.slots if f.decode.slots else 0.0
    kv = f.kv_blocks_charged / f.kv_blocks_total if f.kv_blocks_total else 0.0
    return max(seq, kv)


def _decode_signal(f: Figures, slo: Slo, cfg: PolicyConfig) -> _Signal:
    load, n = decode_load(f), f.decode.nodes
    _, tpot_s = slo.both()
    slow = f.tpot_s is not None and f.tpot_s > tpot_s
    if load >= cfg.out_util:
        return _Signal(True, False, load / cfg.target_util, f"decode load {load:.2f}")
    if slow and load >= cfg.in_util:
        return _Signal(True, False, 1.0, f"TPOT {f.tpot_s:.3f} s > SLO, load {load:.2f}")
    projected = load * n / (n - 1) if n > 1 else math.inf
    calm = f.tpot_s is None or f.tpot_s < 0.8 * tpot_s
    low = projected < cfg.in_util and f.queue_length == 0 and calm
    return _Signal(False, low, 0.0, f"decode load {load:.2f} ({projected:.2f} with one fewer)")


def _prefill_signal(f: Figures, slo: Slo, cfg: PolicyConfig, node_rate: float) -> _Signal:
    ttft_s, _ = slo.both()
    n = f.prefill.nodes
    decode_room = decode_load(f) < cfg.out_util
    wait = max(f.oldest_wait_s, 0.0)
    rate = f.prefill_tokens_per_s
    backlog_s = f.prefill.prompt_tokens / rate if rate > 0 else 0.0
    if f.queue_length and decode_room and wait >= cfg.wait_share * ttft_s:
        why = f"queue waits {wait:.2f} s ({f.queue_length} requests) while decode has room"
        return _Signal(True, False, wait / (cfg.wait_share * ttft_s), why)
    # NOTE: more requests than nodes: one client's long prompts, one at a time, keep a node
    # busy (a backlog) that more nodes would not shorten.
    crowded = f.prefill.in_flight > n
    if decode_room and crowded and backlog_s >= cfg.backlog_share * ttft_s:
        why = f"prefill backlog {backlog_s:.2f} s at {rate:.0f} tokens/s"
        return _Signal(True, False, backlog_s / (cfg.backlog_share * ttft_s), why)
    if node_rate > 0 and n > 1:
        projected = rate / ((n - 1) * node_rate)
    else:
        projected = 0.0 if rate == 0 else math.inf
    calm = f.ttft_s is None or f.ttft_s < 0.8 * ttft_s
    quiet = f.queue_length == 0 and f.oldest_wait_s == 0
    low = quiet and calm and projected < cfg.in_util and n > 0
    return _Signal(False, low, 0.0, f"prefill {rate:.0f} tokens/s, queue {f.queue_length}")


def _step(
    role: str,
    sig: _Signal,
    current: int,
    routable: int,
    bounds: Bounds,
    cfg: PolicyConfig,
    st: RoleState,
    now: float,
) -> tuple[int, str, RoleState]:
    """The wanted count of one pool and its new state."""
    short_since = (st.short_since if st.short_since is not None else now) if sig.short else None
    low_since = (st.low_since if st.low_since is not None else now) if sig.low else None
    st = replace(st, short_since=short_since, low_since=low_since)
    clamped = bounds.clamp(role, current)
    if clamped != current:
        return clamped, f"{current} is outside the bounds", _changed(st, clamped, now)
    joining = st.asked is not None and routable < st.asked
    settling = joining and st.changed_at is not None and now - st.changed_at < cfg.settle_s
    if sig.short and short_since is not None:
        if clamped >= bounds.clamp(role, 10**9):
            return current, f"short ({sig.why}) but at --max-{role}", st
        if settling:
            return current, f"short ({sig.why}); waiting for {st.asked} to be routable", st
        if now - short_since < cfg.out_after_s:
            return current, f"short ({sig.why}) for {now - short_since:.1f} s", st
        step = min(max(1, math.ceil(current * sig.severity) - current), cfg.max_step)
        wanted = bounds.clamp(role, current + step)
        return wanted, f"scale out: {sig.why}", _changed(st, wanted, now)
    if sig.low and low_since is not None and current > bounds.clamp(role, 0):
        low_for = now - low_since
        since_change = now - st.changed_at if st.changed_at is not None else math.inf
        if low_for >= cfg.cooldown_s and since_change >= cfg.cooldown_s and not joining:
            wanted = current - 1
            return wanted, f"scale in: {sig.why} for {low_for:.0f} s", _changed(st, wanted, now)
        return current, f"low ({sig.why}) for {low_for:.0f} s of {cfg.cooldown_s:.0f}", st
    return current, f"steady ({sig.why})", st


def _changed(st: RoleState, wanted: int, now: float) -> RoleState:
    # NOTE: a change restarts both clocks: the pool must be short (or low) anew, measured on
    # the new count, before it moves again.
    return RoleState(short_since=None, low_since=None, changed_at=now, asked=wanted)


def decide(
    figures: Figures,
    current: Counts,
    bounds: Bounds,
    slo: Slo,
    state: PolicyState | None = None,
    config: PolicyConfig | None = None,
) -> Decision:
    """The wanted prefill and decode counts for ``figures``, with the reason for each.

    ``current`` is what the actuator runs or is starting now; ``figures.<pool>.nodes`` is what
    the router can route to. Pure: the same arguments give the same decision; keep the returned
    ``state`` for the next call."""
    state = state or PolicyState()
    cfg = config or PolicyConfig()
    now = figures.at
    node_rate = state.prefill_node_rate
    if figures.prefill.nodes and figures.prefill_tokens_per_s > 0:
        node_rate = max(node_rate, figures.prefill_tokens_per_s / figures.prefill.nodes)
    signals = {
        "prefill": _prefill_signal(figures, slo, cfg, node_rate),
        "decode": _decode_signal(figures, slo, cfg),
    }
    wanted: dict[str, int] = {}
    reasons: dict[str, str] = {}
    roles: dict[str, RoleState] = {}
    for role in ROLES:
        routable = getattr(figures, role).nodes
        wanted[role], reasons[role], roles[role] = _step(
            role,
            signals[role],
            getattr(current, role),
            routable,
            bounds,
            cfg,
            getattr(state, role),
            now,
        )
    new_state = PolicyState(roles["prefill"], roles["decode"], node_rate)
    return Decision(Counts(wanted["prefill"], wanted["decode"]), reasons, new_state)
