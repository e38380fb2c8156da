"""Scheduler v0: filter -> score -> pick over (prefill, decode) pairs.

Filters drop pairs that cannot serve (role, health and breaker, permission, KV room, engines
the request already failed on). The scorer ranks what is left by outstanding work: the larger
of the router's own in-flight count and what the engine last reported, so neither signal can
hide the other. The picker takes the lowest score, breaking ties in rotation so equal engines
share load. Later schedulers replace the scorer and keep the shape.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from narwhal.routing.fleet_state import EngineState, FleetState

__all__ = ["NoPair", "Pair", "SchedulerV0"]

KV_FULL = 0.98


@dataclass(frozen=True)
class Pair:
    prefill: str
    decode: str
    score: float


@dataclass(frozen=True)
class NoPair:
    reason: str


PairFilter = Callable[[FleetState, EngineState, EngineState], bool]


def _available(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return p.available() and d.available()


def _roles(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return p.role == "prefill" and d.role == "decode" and p.id != d.id


def _permitted(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return state.is_permitted(p.id, d.id)


def _kv_room(state: FleetState, p: EngineState, d: EngineState) -> bool:
    for engine in (p, d):
        if state.scraped_fresh(engine) and engine.scraped.kv_cache_usage >= KV_FULL:
            return False
    return True


FILTERS: tuple[tuple[str, PairFilter], ...] = (
    ("role", _roles),
    ("permitted pair", _permitted),
    ("healthy", _available),
    ("KV room", _kv_room),
)


def prefill_load(state: FleetState, engine: EngineState) -> float:
    own = engine.in_flight_prefill
    if state.scraped_fresh(engine):
        return max(own, engine.scraped.running + engine.scraped.waiting)
    return own


def decode_load(state: FleetState, engine: EngineState) -> float:
    own = engine.in_flight_decode
    if state.scraped_fresh(engine):
        return max(own, engine.scraped.running + engine.scraped.waiting)
    return own


class SchedulerV0:
    def __init__(self) -> None:
        self._turn = 0

    def pick(
        self,
        state: FleetState,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Pair | NoPair:
        prefills = [e for e in state.engines.values() if e.id not in exclude_prefill]
        decodes = [e for e in state.engines.values() if e.id not in exclude_decode]
        candidates = [(p, d) for p in prefills for d in decodes]
        for name, keep in FILTERS:
            remaining = [(p, d) for p, d in candidates if keep(state, p, d)]
            if not remaining:
                return NoPair(f"no (prefill, decode) pair passes the {name} filter")
            candidates = remaining
        scored = [
            (prefill_load(state, p) + decode_load(state, d), p.id, d.id) for p, d in candidates
        ]
        best = min(s for s, _, _ in scored)
        ties = sorted((p, d) for s, p, d in scored if s == best)
        self._turn += 1
        p_id, d_id = ties[self._turn % len(ties)]
        return Pair(p_id, d_id, best)
