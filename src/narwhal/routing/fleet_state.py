"""The router's live picture of its fleet: roles, health, in-flight legs and scraped load.

Pure data with small methods; the I/O edges (health prober, scraper, request handlers) write
into it and the scheduler reads it. Two load signals are kept apart on purpose: what the router
itself has in flight, and what the engine reports. A router that lets its own count overwrite
the engine's (or the reverse) routes on a number that lies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from narwhal.clock import Clock
from narwhal.contract import FleetContract
from narwhal.routing.breaker import BreakerState, CircuitBreaker

__all__ = ["EngineState", "FleetState", "Role", "ScrapedLoad"]

Role = Literal["prefill", "decode"]

# How far back a decode engine's local prefills are remembered (longer than any horizon the
# scheduler asks about: a request's output at the TPOT budget).
LOCAL_HISTORY_S = 600.0


@dataclass
class ScrapedLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    at: float | None = None  # clock time of the last successful scrape


class PrefillWork(dict[str, tuple[float, float]]):
    """An engine's prefill legs in flight: request id -> (predicted seconds, dispatched at).

    A dict that keeps its total and its oldest leg until it next changes: the scheduler asks
    ``queued_prefill_s`` of every prefill candidate for every request, and legs come and go
    far less often than that. Computed as before, in the same order (``sum`` over the values;
    the first of the oldest on a tie, as ``min(key=dispatch time)`` finds it), so the same
    floats."""

    __slots__ = ("_summary",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._summary: tuple[float, float, float] | None = None

    def summary(self) -> tuple[float, float, float]:
        """(total predicted seconds, the oldest leg's predicted seconds, its dispatch time);
        not for an empty dict."""
        summary = self._summary
        if summary is None:
            total = sum(predicted for predicted, _ in self.values())
            head, since = next(iter(self.values()))
            for predicted, at in self.values():
                if at < since:
                    head, since = predicted, at
            summary = self._summary = (total, head, since)
        return summary

    def ahead(self, now: float) -> float:
        """Predicted prefill seconds still ahead of a new prompt (see
        ``EngineState.queued_prefill_s``): the total less what the oldest leg can have done
        since its dispatch, at most its own predicted time."""
        if not self:
            return 0.0
        total, head, since = self.summary()
        waited = now - since
        if waited < 0.0:
            waited = 0.0
        # (min() and max() written out: the scheduler asks this of every candidate)
        return total - (head if head < waited else waited)

    # Every way to change a dict forgets the summary.
    def __setitem__(self, key: str, value: tuple[float, float]) -> None:
        self._summary = None
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._summary = None
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self._summary = None
        return super().pop(*args)

    def popitem(self) -> tuple[str, tuple[float, float]]:
        self._summary = None
        return super().popitem()

    def clear(self) -> None:
        self._summary = None
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._summary = None
        super().update(*args, **kwargs)

    def setdefault(self, *args: Any) -> Any:
        self._summary = None
        return super().setdefault(*args)

    def __ior__(self, other: Any) -> PrefillWork:  # type: ignore[override,misc]
        self._summary = None
        return super().__ior__(other)


@dataclass
class EngineState:
    id: str
    url: str
    roles: tuple[Role, ...]
    role: Role
    breaker: CircuitBreaker
    healthy: bool | None = None  # None until the first probe
    probe_timeouts: int = 0  # consecutive /health probes that timed out
    in_flight_prefill: int = 0
    in_flight_decode: int = 0
    # Requests admitted with this engine as their decode engine, still in their prefill leg:
    # they will join its batch, so predictions count them now.
    pending_decode: int = 0
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)
    draining_from: Role | None = None
    role_since: float = 0.0
    # Prefill legs in flight here: request id -> (predicted seconds, dispatched at).
    prefill_work: PrefillWork = field(default_factory=PrefillWork)
    # Local prefills sent to this (decode) engine: (dispatched at, predicted seconds), oldest
    # first, the last LOCAL_HISTORY_S seconds: each one stalled its decode batch that long.
    local_prefills: deque[tuple[float, float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if type(self.prefill_work) is not PrefillWork:
            self.prefill_work = PrefillWork(self.prefill_work)

    def note_local_prefill(self, now: float, predicted_s: float) -> None:
        self.local_prefills.append((now, predicted_s))
        while self.local_prefills and self.local_prefills[0][0] < now - LOCAL_HISTORY_S:
            self.local_prefills.popleft()

    def recent_local_prefill_s(self, since: float) -> float:
        """Predicted seconds of local prefill dispatched here at or after ``since``."""
        total = 0.0
        for at, seconds in reversed(self.local_prefills):
            if at < since:
                break
            total += seconds
        return total

    def queued_prefill_s(self, now: float) -> float:
        """Predicted prefill work still ahead of a new prompt on this engine.

        The engine prefills first come, first served: only the oldest leg in flight can have
        made progress, and at most its own predicted time. Counting the time since its
        dispatch against the whole queue (as if every leg had run since the oldest was sent)
        wiped out queues whose oldest leg had itself waited behind legs since finished, and
        the online correction then read the wait as a slow engine.
        """
        return self.prefill_work.ahead(now)

    def can(self, role: Role) -> bool:
        return role in self.roles

    def accepts(self, role: Role) -> bool:
        """May new legs of ``role`` go here? Its role, and, for an engine that just left the
        prefill role, only once its queued prefills have finished (drain)."""
        if role != self.role:
            return False
        return not (self.draining_from == "prefill" and self.in_flight_prefill > 0)

    def settle_drain(self) -> bool:
        """Clear the drain mark once the old role's legs are done; True if it was cleared."""
        if self.draining_from is None:
            return False
        left = self.in_flight_prefill if self.draining_from == "prefill" else self.in_flight_decode
        if left == 0:
            self.draining_from = None
            return True
        return False

    def available(self) -> bool:
        """Healthy (or not yet probed) and its breaker lets a request through."""
        return self.healthy is not False and self.breaker.allows_request()

    def takes(self, role: Role) -> bool:
        """``accepts(role) and available()``, in one call (the scheduler asks it of every
        engine it considers, for every request)."""
        if role != self.role or (self.draining_from == "prefill" and self.in_flight_prefill > 0):
            return False
        if self.healthy is False:
            return False
        breaker = self.breaker
        return breaker.state is BreakerState.CLOSED or breaker.allows_request()


class FleetState:
    def __init__(
        self,
        fleet: FleetContract,
        clock: Clock,
        *,
        breaker_failures: int = 3,
        breaker_open_s: float = 5.0,
        scrape_stale_s: float = 5.0,
    ) -> None:
        self.fleet = fleet
        self.clock = clock
        self.scrape_stale_s = scrape_stale_s
        self.role_generation = 0
        now = clock.now()
        self.engines: dict[str, EngineState] = {
            spec.id: EngineState(
                id=spec.id,
                url=spec.url,
                roles=tuple(spec.roles),
                role=spec.initial_role,
                breaker=CircuitBreaker(clock, breaker_failures, breaker_open_s),
                role_since=now,
            )
            for spec in fleet.engines
        }
        # Kept per role so that schedulers sampling large fleets never scan all of it.
        self._by_role: dict[str, list[EngineState]] = {"prefill": [], "decode": []}
        for engine in self.engines.values():
            self._by_role[engine.role].append(engine)

    def in_role(self, role: Role) -> list[EngineState]:
        """Engines serving ``role`` now (a copy, in fleet order)."""
        return list(self._by_role[role])

    def is_permitted(self, prefill_id: str, decode_id: str) -> bool:
        return self.fleet.is_permitted(prefill_id, decode_id)

    def decode_batch(self, engine: EngineState) -> int:
        """Sequences decoding on ``engine``: the larger of our count and the engine's report."""
        own = engine.in_flight_decode
        if self.scraped_fresh(engine):
            own = max(own, int(engine.scraped.running))
        return own + engine.pending_decode

    def scraped_fresh(self, engine: EngineState) -> bool:
        at = engine.scraped.at
        return at is not None and self.clock.now() - at <= self.scrape_stale_s

    def ready(self) -> tuple[bool, str]:
        """P/D-aware readiness: a healthy prefill engine, a healthy decode engine, a pair."""
        prefill = [e for e in self.in_role("prefill") if e.healthy and e.breaker.allows_request()]
        decode = [e for e in self.in_role("decode") if e.healthy and e.breaker.allows_request()]
        if not prefill:
            return False, "no healthy engine in the prefill role"
        if not decode:
            return False, "no healthy engine in the decode role"
        for p in prefill:
            for d in decode:
                if self.is_permitted(p.id, d.id):
                    return True, f"{len(prefill)} prefill, {len(decode)} decode engines healthy"
        return False, "no permitted KV transfer pair between healthy prefill and decode engines"

    def set_role(self, engine_id: str, role: Role) -> None:
        engine = self.engines[engine_id]
        if role == engine.role:
            return
        if not engine.can(role):
            raise ValueError(f"engine {engine_id} is not permitted the {role} role")
        engine.draining_from = engine.role
        self._by_role[engine.role].remove(engine)
        order = list(self.engines)
        self._by_role[role].append(engine)
        self._by_role[role].sort(key=lambda e: order.index(e.id))
        engine.role = role
        engine.role_since = self.clock.now()
        self.role_generation += 1
