"""Engine roles in a running router: the role controller's loop, flips forced by an operator,
pinning, and each flip's record (state, metrics, journal, the timeline /admin/state shows).

A router alone decides and applies its flips itself. With a coordinator (several replicas
sharing etcd) every change is written to etcd first and applied by every replica, this one
included, when the roles document comes back: the leader's controller decides flips, an
operator's flip or pin lands through any replica, and a replica that cannot reach etcd keeps
the roles it last saw."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Any

import orjson

from narwhal.contract import FleetContract
from narwhal.coordination import Coordinator, EtcdUnavailable, SharedRoles
from narwhal.journal import Journal
from narwhal.metrics import RouterMetrics
from narwhal.routing.fleet_state import EngineState, FleetState, Role
from narwhal.routing.roles import (
    DemandSnapshot,
    DemandTracker,
    FleetDemand,
    Pressures,
    RoleController,
)
from narwhal.serve.errors import Conflict, CoordinationUnavailable, InvalidRequest, NotFound

__all__ = ["RoleService"]

log = logging.getLogger("narwhal.serve")


def _flip_id(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What tells one flip from another flip numbered alike (in another timeline)."""
    return (entry.get("t"), entry.get("engine"), entry.get("to_role"), entry.get("decided_by"))


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
        self.replica_id: str | None = None
        self.coordinator: Coordinator | None = None
        self._synced = False  # a shared roles document has been applied

    def _flip_metrics(self, engine_id: str, from_role: Role, to_role: Role) -> None:
        m = self.metrics
        m.flips.labels(from_role, to_role).inc()
        m.engine_role.labels(engine_id, from_role).set(0)
        m.engine_role.labels(engine_id, to_role).set(1)
        m.role_generation.set(self.state.role_generation)

    def apply_flip(
        self,
        engine_id: str,
        to_role: Role,
        reason: str,
        pressures: dict[str, Any] | None,
        forced: bool,
    ) -> dict[str, Any]:
        """Move an engine to another role: state, metrics, journal, timeline, in that order."""
        from_role = self.state.engines[engine_id].role
        entry = self._entry(engine_id, from_role, to_role, reason, pressures, forced)
        self.state.set_role(engine_id, to_role)
        if self.controller is not None:
            self.controller.applied()
        self._flip_metrics(engine_id, from_role, to_role)
        self.history.append(entry)
        self.journal.role_flip(**entry)
        log.info("role flip: %s %s -> %s (%s)", engine_id, from_role, to_role, reason)
        return entry

    def _flippable(self, engine_id: object, to_role: object) -> EngineState | None:
        """The engine an operator's flip moves, None when it has that role already. Raises
        NotFound, InvalidRequest or Conflict (it would leave a pool below its minimum)."""
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
        return engine

    async def force_flip(
        self, engine_id: object, to_role: object, expected_generation: int | None = None
    ) -> dict[str, Any] | None:
        """An operator's flip: the flip's record, or None when the engine has that role
        already. With ``expected_generation``, only if the roles are still at that generation
        (409 otherwise). Raises NotFound, InvalidRequest, Conflict, or CoordinationUnavailable
        (a replica that cannot reach etcd changes no role)."""
        coordinator = self.coordinator
        if coordinator is not None and (not coordinator.up or coordinator.view is None):
            raise CoordinationUnavailable(coordinator.last_error or "not connected yet")
        generation = self.state.role_generation
        if expected_generation is not None and expected_generation != generation:
            raise Conflict(
                f"the roles are at generation {generation}, not {expected_generation}: read "
                "/admin/state and decide again"
            )
        engine = self._flippable(engine_id, to_role)
        if engine is None:
            return None
        role: Role = "prefill" if to_role == "prefill" else "decode"
        if coordinator is None:
            return self.apply_flip(engine.id, role, "forced by operator", None, forced=True)
        entry = self._entry(engine.id, engine.role, role, "forced by operator", None, True)
        view = coordinator.view
        assert view is not None
        document = view.with_flip(entry, coordinator.replica_id, time.time())
        try:
            landed = await coordinator.propose(document, as_leader=False)
        except EtcdUnavailable as exc:
            raise CoordinationUnavailable(str(exc)) from None
        if not landed:
            raise Conflict(
                "the roles changed while this flip was written (another replica's flip or "
                "pin landed first): read /admin/state and decide again"
            )
        return document.history[-1]

    async def set_pinned(self, pinned: bool) -> None:
        coordinator = self.coordinator
        if coordinator is None:
            self._pin(pinned)
            return
        # A pin is idempotent: retry a lost race against a flip on the roles it lost to.
        for _ in range(5):
            view = coordinator.view
            if not coordinator.up or view is None:
                raise CoordinationUnavailable(coordinator.last_error or "not connected yet")
            if view.pinned == pinned:
                return
            try:
                landed = await coordinator.propose(
                    view.with_pinned(pinned, coordinator.replica_id, time.time()), as_leader=False
                )
            except EtcdUnavailable as exc:
                raise CoordinationUnavailable(str(exc)) from None
            if landed:
                return
            await asyncio.sleep(0.05)  # the watch brings the roles that won
        raise Conflict("the roles kept changing while the pin was written: try again")

    def _pin(self, pinned: bool) -> None:
        # Unchanged: nothing to journal (a coordinated replica's first sync journals it).
        if pinned == self.pinned and (self._synced or self.coordinator is None):
            return
        if pinned != self.pinned:
            log.info("roles %s", "pinned: no flip until unpinned" if pinned else "unpinned")
        self.pinned = pinned
        if self.controller is not None:
            self.controller.pinned = pinned
        self.journal.record("role.pin", pinned=pinned, role_generation=self.state.role_generation)

    # --- shared roles (several replicas) ---------------------------------------------------

    def _entry(
        self,
        engine_id: str,
        from_role: Role,
        to_role: Role,
        reason: str,
        pressures: dict[str, Any] | None,
        forced: bool,
    ) -> dict[str, Any]:
        return {
            "t": time.time(),
            "engine": engine_id,
            "from_role": from_role,
            "to_role": to_role,
            "reason": reason,
            "pressures": pressures,
            "role_generation": self.state.role_generation + 1,
            "forced": forced,
        }

    def shared_now(self) -> SharedRoles:
        """This replica's roles as a shared document (what etcd starts from when it has none)."""
        return SharedRoles(
            generation=self.state.role_generation,
            roles={e.id: e.role for e in self.state.engines.values()},
            pinned=self.pinned,
            history=tuple(self.history)[-100:],
            written_by=self.replica_id or "",
            written_at=time.time(),
        )

    def apply_shared(self, document: SharedRoles) -> None:
        """Make this replica's roles the shared document's: each engine whose role differs
        flips (and drains) as a local flip would; the flips this replica has not applied yet
        are journaled and counted, so every replica's journal holds every flip once. The first
        document a replica sees is adopted whole (one ``role.sync`` record), not replayed; so
        is one that does not follow on from this replica's generation (etcd restored from a
        backup, or wiped and re-created by a replica that knew less, and maybe flipped on
        since: a lower generation, or another flip at this one's): its history is not this
        one's future, and replaying it journaled flips nobody made, at every reconnect."""
        state = self.state
        known = state.role_generation
        # Each generation's entry, the last written winning: a history written from a replica
        # that had replayed another's holds stale entries before the real one (and past the
        # document's own generation, which no flip of it made).
        latest: dict[int, dict[str, Any]] = {}
        for entry in document.history:
            generation = entry.get("role_generation", 0)
            if generation <= document.generation:
                latest[generation] = entry
        # Not this replica's timeline: at a lower generation, or at the same number by other
        # flips (restored and flipped on since, past where this replica was).
        mine = next((e for e in reversed(self.history) if e.get("role_generation") == known), None)
        theirs = latest.get(known)
        diverged = mine is not None and theirs is not None and _flip_id(mine) != _flip_id(theirs)
        regressed = self._synced and (document.generation < known or diverged)
        resync = not self._synced or regressed
        # The flips this document adds: numbered past what this replica knows.
        fresh = {} if resync else {g: e for g, e in latest.items() if g > known}
        explained = {fresh[g].get("engine"): fresh[g].get("to_role") for g in sorted(fresh)}
        changed: dict[str, Role] = {}
        for engine_id, role in document.roles.items():
            engine = state.engines.get(engine_id)
            if engine is None or engine.role == role:
                continue
            if not engine.can(role):
                log.error("shared roles give %s the role %s it is not permitted", engine_id, role)
                continue
            from_role = engine.role
            state.set_role(engine_id, role)
            changed[engine_id] = role
            if resync or explained.get(engine_id) != role:  # a sync, not a flip counted
                self.metrics.engine_role.labels(engine_id, from_role).set(0)
                self.metrics.engine_role.labels(engine_id, role).set(1)
            else:
                self._flip_metrics(engine_id, from_role, role)
        state.role_generation = document.generation
        self.metrics.role_generation.set(document.generation)
        if changed and self.controller is not None:
            self.controller.applied()  # a new leader keeps the cooldown of the last flip
        for generation in sorted(fresh):
            entry = fresh[generation]
            self.history.append(entry)
            self.journal.role_flip(**entry)
            log.info(
                "role flip: %s %s -> %s (%s; decided by %s)",
                entry.get("engine"),
                entry.get("from_role"),
                entry.get("to_role"),
                entry.get("reason"),
                entry.get("decided_by"),
            )
        # A change no flip of the document explains (a history cut short, or a document
        # written at this replica's generation with other roles) is journaled as a sync.
        unexplained = {e: r for e, r in changed.items() if explained.get(e) != r}
        if resync or unexplained:
            self._synced = True
            if regressed:
                log.warning(
                    "the shared roles do not follow on from generation %d (etcd restored or "
                    "wiped): taken as they are at generation %d: %s",
                    known,
                    document.generation,
                    ", ".join(f"{e} {r}" for e, r in sorted(document.roles.items())),
                )
            elif changed:
                # Engines this replica started in other roles (the fleet file's, or etcd's of
                # before an outage): the fleet's roles win, as the one role.sync record says.
                log.info(
                    "roles taken from etcd at generation %d: %s",
                    document.generation,
                    ", ".join(f"{e} {r}" for e, r in sorted(document.roles.items())),
                )
            if resync:
                self.history.clear()
                self.history.extend(latest[g] for g in sorted(latest))
            extra = {"regressed_from": known} if regressed else {}
            self.journal.record(
                "role.sync",
                role_generation=document.generation,
                roles=document.roles,
                pinned=document.pinned,
                **extra,
            )
        if document.pinned != self.pinned:
            self._pin(document.pinned)

    def sync_coordination_metrics(self) -> None:
        m = self.metrics
        coordinator = self.coordinator
        if coordinator is None:
            m.coordination_up.set(1)
            m.role_leader.set(1)
            m.coordination_replicas.set(1)
            return
        m.coordination_up.set(1 if coordinator.up else 0)
        m.role_leader.set(1 if coordinator.is_leader else 0)
        m.coordination_watch_lag.set(coordinator.watch_lag_s)
        m.coordination_replicas.set(1 + len(coordinator.peers) if coordinator.up else 1)

    def coordination_state(self) -> dict[str, Any] | None:
        """What ``/admin/state`` shows of the replicas' coordination (None: alone)."""
        coordinator = self.coordinator
        if coordinator is None:
            return None
        return {
            "replica": coordinator.replica_id,
            "up": coordinator.up,
            "leader": coordinator.leader_id,
            "is_leader": coordinator.is_leader,
            "peers": sorted(coordinator.peers),
            "watch_lag_s": round(coordinator.watch_lag_s, 4),
            "last_error": coordinator.last_error,
        }

    def _others_demand(self) -> list[DemandSnapshot]:
        assert self.coordinator is not None
        out = []
        for replica, raw in list(self.coordinator.peers.items()):
            try:
                out.append(DemandSnapshot(**orjson.loads(raw)))
            except (orjson.JSONDecodeError, TypeError) as exc:
                log.warning("replica %s published demand this one cannot read: %s", replica, exc)
        return out

    async def tick_shared(self) -> None:
        """One round of a coordinated replica's role loop: settle drains, publish this
        replica's demand and, on the leader only, decide a flip on the fleet's demand and write
        it (fenced by the leader lease: a deposed leader's write fails in etcd)."""
        coordinator = self.coordinator
        assert coordinator is not None
        self._settle()
        self.sync_coordination_metrics()
        controller = self.controller
        if not coordinator.up:
            return
        # Published with or without a controller: it is how the replicas see one another
        # (peers, narwhal_coordination_replicas), whether or not any flips roles.
        queued = controller.queued_prefill_s(self.state) if controller is not None else 0.0
        snapshot = self.demand.snapshot(queued)
        try:
            await coordinator.publish(orjson.dumps(dataclasses.asdict(snapshot)))
        except EtcdUnavailable:
            return
        view = coordinator.view
        if controller is None or not coordinator.is_leader or view is None:
            return
        decision = controller.tick(self.state, FleetDemand(self.demand, self._others_demand()))
        if decision is None:
            return
        entry = self._entry(
            decision.engine,
            decision.from_role,
            decision.to_role,
            decision.reason,
            decision.pressures.as_dict(),
            False,
        )
        document = view.with_flip(entry, coordinator.replica_id, time.time())
        try:
            await coordinator.propose(document, as_leader=True)
        except EtcdUnavailable:
            return

    def pressures(self) -> Pressures | None:
        if self.controller is None:
            return None
        return self.controller.pressures(self.state, self.demand)

    def tick(self) -> None:
        """One round of the role loop: settle drains, and flip if the controller says so."""
        self._settle()
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

    def _settle(self) -> None:
        """What every round of the role loop starts with: drains settled, the demand window
        trimmed. Every request is recorded in the window, but only reading it drops what has
        aged out: without a controller that reads it (no profile store, role control off,
        pinned) it would grow by one entry per request for as long as we run."""
        for engine in self.state.engines.values():
            engine.settle_drain()
        self.demand.rate()

    async def run(self, interval_s: float) -> None:
        while True:
            await self.state.clock.sleep(interval_s)
            if self.coordinator is None:
                self.tick()
            else:
                await self.tick_shared()
