"""The planner's loop: every interval, scrape the router, decide, act, log why, export it."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.planner.actuators import Actuator
from splitserve.planner.policy import (
    ROLES,
    Bounds,
    Decision,
    PolicyConfig,
    PolicyState,
    decide,
)
from splitserve.planner.scrape import ERRORS, Scraper
from splitserve.runtime.slo import Slo

logger = logging.getLogger(__name__)


class Planner:
    def __init__(
        self,
        scraper: Scraper,
        actuator: Actuator,
        bounds: Bounds,
        slo: Slo,
        config: PolicyConfig | None = None,
        interval_s: float = 5.0,
        record: str | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.scraper, self.actuator = scraper, actuator
        self.bounds, self.slo = bounds, slo
        self.config = config or PolicyConfig()
        self.interval_s = interval_s
        self.state = PolicyState()
        self.record = Path(record) if record else None
        self.registry = registry or CollectorRegistry()
        self.wanted = Gauge(
            "splitserve_planner_wanted_nodes",
            "Nodes the planner wants in each pool",
            ("role",),
            registry=self.registry,
        )
        self.decisions = Counter(
            "splitserve_planner_decisions",
            "Scaling decisions the planner acted on, by pool and direction (up, down)",
            ("role", "direction"),
            registry=self.registry,
        )
        for role in ROLES:
            for direction in ("up", "down"):
                self.decisions.labels(role, direction)
        self._reasons: dict[str, str] = {}

    def step(self) -> Decision | None:
        """One round; None when the router could not be read, or answered a page that is not its
        metrics (nothing changes then)."""
        try:
            figures = self.scraper.read()
        except ERRORS as exc:
            logger.warning("planner: cannot read %s (%s): holding", self.scraper.url, exc)
            return None
        current = self.actuator.current()
        decision = decide(figures, current, self.bounds, self.slo, self.state, self.config)
        self.state = decision.state
        for role in ROLES:
            have, want = getattr(current, role), getattr(decision.wanted, role)
            self.wanted.labels(role).set(want)
            reason = decision.reasons[role]
            kind = reason.split(" ")[0]
            if want != have:
                logger.info("planner: %s %d -> %d: %s", role, have, want, reason)
            elif kind != self._reasons.get(role):
                logger.info("planner: %s %d: %s", role, have, reason)
            else:
                logger.debug("planner: %s %d: %s", role, have, reason)
            self._reasons[role] = kind
            if want != have:
                self.decisions.labels(role, "up" if want > have else "down").inc()
                try:
                    self.actuator.scale(role, want)
                except Exception:  # a failed action must not end the planner
                    logger.exception("planner: %s could not scale %s", self.actuator.name, role)
        if self.record is not None:
            row = {"figures": asdict(figures), "current": current._asdict()}
            row |= {"wanted": decision.wanted._asdict(), "reasons": decision.reasons}
            with self.record.open("a") as out:
                out.write(json.dumps(row) + "\n")
        return decision

    def run(self, stop: threading.Event) -> None:
        """Until ``stop`` is set."""
        logger.info(
            "planner: %s actuator, prefill %d..%d, decode %d..%d, SLO TTFT %.2f s TPOT %.3f s",
            self.actuator.name,
            self.bounds.min_prefill,
            self.bounds.max_prefill,
            self.bounds.min_decode,
            self.bounds.max_decode,
            *self.slo.both(),
        )
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.step()
            except Exception:
                logger.exception("planner: round failed; trying again")
            stop.wait(max(self.interval_s - (time.monotonic() - started), 0.0))
