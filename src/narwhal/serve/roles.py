"""Engine roles in a running router: the role controller's loop, flips forced by an operator,
pinning, and each flip's record (state, metrics, journal, the timeline /admin/state shows)."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from narwhal.contract import FleetContract
from narwhal.journal import Journal
from narwhal.metrics import RouterMetrics
from narwhal.routing.fleet_state import FleetState, Role
from narwhal.routing.roles import DemandTracker, Pressures, RoleController
from narwhal.serve.errors import Conflict, InvalidRequest, NotFound

__all__ = ["RoleService"]

log = logging.getLogger("narwhal.serve")


class RoleService:
    def __init__(
        self,
        fleet: FleetContract,
        state: FleetState,
        metrics: RouterMetrics,
        journal: Journal,
        demand: DemandTracker,
        controller: RoleController | None,
    ) -> None:
        self.fleet = fleet
        self.state = state
        self.metrics = metrics
        self.journal = journal
        self.demand = demand
        self.controller = controller
        self.pinned = False
        self.history: deque[dict[str, Any]] = deque(maxlen=1000)

    def apply_flip(
        self,
        engine_id: str,
        to_role: Role,
        reason: str,
        pressures: dict[str, Any] | None,
        forced: bool,
    ) -> dict[str, Any]:
        """Move an engine to another role: state, metrics, journal, timeline, in that order."""
        engine = self.state.engines[engine_id]
        from_role = engine.role
        self.state.set_role(engine_id, to_role)
        if self.controller is not None:
            self.controller.applied()
        m = self.metrics
        m.flips.labels(from_role, to_role).inc()
        m.engine_role.labels(engine_id, from_role).set(0)
        m.engine_role.labels(engine_id, to_role).set(1)
        m.role_generation.set(self.state.role_generation)
        entry = {
            "t": time.time(),
            "engine": engine_id,
            "from_role": from_role,
            "to_role": to_role,
            "reason": reason,
            "pressures": pressures,
            "role_generation": self.state.role_generation,
            "forced": forced,
        }
        self.history.append(entry)
        self.journal.role_flip(**entry)
        log.info("role flip: %s %s -> %s (%s)", engine_id, from_role, to_role, reason)
        return entry

    def force_flip(self, engine_id: object, to_role: object) -> dict[str, Any] | None:
        """An operator's flip: the flip's record, or None when the engine has that role
        already. Raises NotFound, InvalidRequest or Conflict (it would leave a pool below its
        minimum)."""
        engine = self.state.engines.get(engine_id) if isinstance(engine_id, str) else None
        if engine is None:
            raise NotFound(f"no engine {engine_id!r}", "engine")
        if to_role not in ("prefill", "decode") or not engine.can(to_role):
            raise InvalidRequest(f"engine {engine.id} is not permitted the role {to_role!r}", "to")
        if engine.role == to_role:
            return None
        limits = self.fleet.roles
        minimum = limits.min_prefill if engine.role == "prefill" else limits.min_decode
        if len(self.state.in_role(engine.role)) - 1 < minimum:
            raise Conflict(
                f"flipping {engine.id} would leave fewer than {minimum} {engine.role} engines"
            )
        return self.apply_flip(engine.id, to_role, "forced by operator", None, forced=True)

    def set_pinned(self, pinned: bool) -> None:
        self.pinned = pinned
        if self.controller is not None:
            self.controller.pinned = pinned
        self.journal.record("role.pin", pinned=pinned, role_generation=self.state.role_generation)

    def pressures(self) -> Pressures | None:
        if self.controller is None:
            return None
        return self.controller.pressures(self.state, self.demand)

    def tick(self) -> None:
        """One round of the role loop: settle drains, and flip if the controller says so."""
        for engine in self.state.engines.values():
            engine.settle_drain()
        # Every request is recorded in the demand window, but only reading it drops what has
        # aged out: without a controller that reads it (no profile store, role control off,
        # pinned) it would grow by one entry per request for as long as we run.
        self.demand.rate()
        if self.controller is None:
            return
        decision = self.controller.tick(self.state, self.demand)
        if decision is not None:
            self.apply_flip(
                decision.engine,
                decision.to_role,
                decision.reason,
                decision.pressures.as_dict(),
                forced=False,
            )

    async def run(self, interval_s: float) -> None:
        while True:
            await self.state.clock.sleep(interval_s)
            self.tick()
