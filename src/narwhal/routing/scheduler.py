"""Schedulers: filter -> score -> pick over (prefill, decode) pairs.

Filters drop engines and pairs that cannot serve (role, health and breaker, permission, KV room,
engines the request already failed on). Scorers rank what is left; the picker takes the best.

``SchedulerV0`` scores by outstanding work: the larger of the router's own in-flight count and
what the engine last reported, so neither signal can hide the other, with ties taken in
rotation. ``SchedulerV1`` scores by predicted TTFT and TPOT from the profiled latency models and
leaves admission (what to do when no pair meets the budgets) to its caller.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from narwhal.contract import Budgets
from narwhal.routing.fleet_state import EngineState, FleetState
from narwhal.routing.predictor import LatencyPredictor

__all__ = ["NoPair", "Pair", "RequestShape", "SchedulerV0", "SchedulerV1"]

KV_FULL = 0.98


@dataclass(frozen=True)
class RequestShape:
    """What the scheduler knows of a request."""

    prompt_tokens: int = 1
    max_tokens: int = 16
    elapsed_s: float = 0.0  # already spent (queueing, earlier attempts) against the TTFT budget


@dataclass(frozen=True)
class Pair:
    prefill: str
    decode: str
    score: float
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    predicted_prefill_s: float | None = None


@dataclass(frozen=True)
class NoPair:
    reason: str
    # Set when pairs exist but none is predicted to meet the budgets: admission's business.
    over_budget: Pair | None = None


PairFilter = Callable[[FleetState, EngineState, EngineState], bool]


def _available(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return p.available() and d.available()


def _roles(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return p.accepts("prefill") and d.accepts("decode") and p.id != d.id


def _permitted(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return state.is_permitted(p.id, d.id)


def _has_room(state: FleetState, engine: EngineState) -> bool:
    return not (state.scraped_fresh(engine) and engine.scraped.kv_cache_usage >= KV_FULL)


def _kv_room(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return _has_room(state, p) and _has_room(state, d)


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
    """Least outstanding work."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(
        self,
        state: FleetState,
        shape: RequestShape | None = None,
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


class SchedulerV1:
    """Profile-based: predicted TTFT and TPOT per pair, the most slack against both budgets.

    Predicted TTFT = queued prefill work on the prefill engine + prefill(n) + KV transfer to
    the decode engine + its first step at batch + 1; predicted TPOT = the decode model at that
    engine's batch + 1 and the request's mean context. Slack is the smaller of the two budgets'
    remaining fractions; ties go to the less loaded pair. TTFT depends on the prefill engine only
    through its predicted time, so for each decode engine the best permitted prefill engine is
    the first one in order of predicted time: O(P log P + D), not O(P x D), for open fleets.
    """

    def __init__(self, predictor: LatencyPredictor, budgets: Budgets) -> None:
        self.predictor = predictor
        self.budgets = budgets

    def pick(
        self,
        state: FleetState,
        shape: RequestShape | None = None,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Pair | NoPair:
        shape = shape or RequestShape()
        now = state.clock.now()
        prefills = [
            e
            for e in state.in_role("prefill")
            if e.id not in exclude_prefill
            and e.accepts("prefill")
            and e.available()
            and _has_room(state, e)
        ]
        decodes = [
            e
            for e in state.in_role("decode")
            if e.id not in exclude_decode
            and e.accepts("decode")
            and e.available()
            and _has_room(state, e)
        ]
        if not prefills:
            return NoPair("no available engine in the prefill role")
        if not decodes:
            return NoPair("no available engine in the decode role")
        predictor = self.predictor
        prefill_s = {p.id: predictor.prefill(p.id, shape.prompt_tokens).seconds for p in prefills}
        ready_at = {p.id: p.queued_prefill_s(now) + prefill_s[p.id] for p in prefills}
        ordered = sorted(prefills, key=lambda p: (ready_at[p.id], p.id))
        context = shape.prompt_tokens + shape.max_tokens / 2
        ttft_budget = self.budgets.ttft_s - shape.elapsed_s
        best_key: tuple[float, float] | None = None
        best: Pair | None = None
        for d in decodes:
            p = next((p for p in ordered if p.id != d.id and state.is_permitted(p.id, d.id)), None)
            if p is None:
                continue
            batch = state.decode_batch(d) + 1
            tpot = predictor.decode(d.id, batch, context).seconds
            ttft = ready_at[p.id] + predictor.transfer_s(d.id) + tpot
            slack = min(
                (ttft_budget - ttft) / self.budgets.ttft_s,
                (self.budgets.tpot_s - tpot) / self.budgets.tpot_s,
            )
            key = (round(slack, 9), -(prefill_load(state, p) + decode_load(state, d)))
            if best_key is None or key > best_key:
                best_key = key
                best = Pair(p.id, d.id, slack, ttft, tpot, prefill_s[p.id])
        if best is None:
            return NoPair("no permitted KV transfer pair between available engines")
        if best.score < 0:
            return NoPair(
                f"no pair is predicted to meet the budgets (best {best.prefill}->{best.decode}:"
                f" TTFT {best.predicted_ttft_s:.3f} s, TPOT {best.predicted_tpot_s:.4f} s)",
                over_budget=best,
            )
        return best
