"""The role controller: which engines prefill and which decode, as the traffic mix shifts.

On each tick it compares prefill pressure with decode pressure and decides at most one flip.
Both are utilisations of what the pool can take within its budget, so that 1.0 means "full"
on either side and a pool's pressure falls towards 0 as its load goes:

- **prefill pressure**: the prefill pool's utilisation (predicted prefill seconds arriving per
  second, measured from requests that *arrived* - started, or rejected by admission - per
  prefill engine) and its predicted queue wait against the TTFT budget, whichever is larger;
- **decode pressure**: how much of the decode pool's batch headroom is in use. With the decode
  model ``TPOT(batch) = floor + slope * batch``, where ``floor`` is the model's value at batch 0
  at the traffic's mean context (its intercept plus its context term, with the engine's online
  correction: what no batch size saves), pressure = ``(TPOT(batch) - floor) / (budget - floor)``
  at the pool's batch per engine (the larger of the sequences decoding now and what arrivals
  imply by Little's law). For a linear model that is batch / B*, B* being the largest batch that
  meets the budget. Dividing the TPOT itself by the budget instead would count the floor as
  load: on a model whose intercept is 80% of the budget an idle decode pool would sit at 0.8 and
  could never give an engine back to prefill. A floor at or above the budget makes the pool's
  pressure infinite (no batch meets the budget).

It flips only when the receiving pool needs the engine (its pressure is above ``need``) and the
giving pool would still meet its budget with one engine fewer (its pressure recomputed for N-1
engines stays below ``spare``): a plan that would oscillate between N and N-1 fails that test.
Minimum engines per role, a minimum dwell per engine and a cooldown after every flip come from
the fleet; an engine never takes a role it is not permitted. Pure: a clock is injected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from narwhal.clock import Clock
from narwhal.contract import Budgets, RoleControl
from narwhal.profiles.models import DecodeLatencyModel
from narwhal.routing.fleet_state import EngineState, FleetState, Role
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.scheduler import NoPair, Pair, RequestShape

__all__ = [
    "Demand",
    "DemandSnapshot",
    "DemandTracker",
    "FleetDemand",
    "FlipDecision",
    "Pressures",
    "RoleController",
]


class Demand(Protocol):
    """What the controller reads of demand: one router's (``DemandTracker``) or a coordinated
    fleet's, summed over its replicas (``FleetDemand``)."""

    def rate(self) -> float: ...
    def prefill_work_rate(self) -> float: ...
    def mean_output_tokens(self) -> float: ...
    def mean_context(self) -> float: ...
    def others_queued_prefill_s(self) -> float: ...


@dataclass(frozen=True)
class DemandSnapshot:
    """One replica's demand window as it publishes it for the leader: sums, so that windows of
    several replicas add up (and means are weighted by requests)."""

    span_s: float
    requests: int
    prefill_s: float  # predicted prefill seconds of those requests
    output_tokens: float  # their max_tokens, summed
    context_tokens: float  # their prompt plus half their output, summed
    queued_prefill_s: float  # prefill work this replica has queued on the prefill pool now
    rejected: int = 0


@dataclass
class DemandTracker:
    """What arrived in the last ``window_s``: requests started, not completed (a controller
    that waits for completions sees demand only after the damage is done), and requests that
    admission control rejected (they are demand the fleet failed to serve: leaving them out
    would make an overloaded pool look lighter the more it rejects).

    Rates divide by the span the tracker has actually covered: the window, or, while the
    tracker is younger than its window, the time since it started (never less than
    ``min_span_s``, so that the first request or two does not read as a flood). Dividing a
    few seconds of history by the whole window would understate demand right after a start.
    Each record drops what has left the window, so memory stays bounded by the window's
    arrivals even when nobody reads the rates.
    """

    clock: Clock
    window_s: float = 30.0
    min_span_s: float = 1.0
    started_at: float | None = None  # the clock when created, unless given
    rejected: int = 0  # requests recorded as rejected, ever (for reports)
    _starts: deque[tuple[float, float, int, int]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.started_at is None:
            self.started_at = self.clock.now()

    def record_start(self, predicted_prefill_s: float, prompt_tokens: int, max_tokens: int) -> None:
        self._trim()
        self._starts.append((self.clock.now(), predicted_prefill_s, prompt_tokens, max_tokens))

    def record_rejected(self, shape: RequestShape, pick: Pair | NoPair) -> None:
        """A request admission turned away: demand all the same. Its predicted prefill is the
        best pair's (the over-budget pair admission refused), 0 when there was none."""
        pair = pick.over_budget if isinstance(pick, NoPair) else pick
        predicted = pair.predicted_prefill_s if pair is not None else None
        self.rejected += 1
        self.record_start(predicted or 0.0, shape.prompt_tokens, shape.max_tokens)

    def _trim(self) -> None:
        horizon = self.clock.now() - self.window_s
        while self._starts and self._starts[0][0] < horizon:
            self._starts.popleft()

    def span_s(self) -> float:
        """The seconds of history the rates cover."""
        assert self.started_at is not None
        covered = self.clock.now() - self.started_at
        return min(self.window_s, max(covered, self.min_span_s))

    def count(self) -> int:
        """Requests in the window."""
        self._trim()
        return len(self._starts)

    def rate(self) -> float:
        return self.count() / self.span_s()

    def prefill_work_rate(self) -> float:
        """Predicted prefill seconds arriving per second."""
        self._trim()
        return sum(s[1] for s in self._starts) / self.span_s()

    def mean_output_tokens(self) -> float:
        self._trim()
        return sum(s[3] for s in self._starts) / len(self._starts) if self._starts else 0.0

    def mean_context(self) -> float:
        self._trim()
        if not self._starts:
            return 0.0
        return self._context_tokens() / len(self._starts)

    def _context_tokens(self) -> float:
        """The window's context, summed: each request's prompt plus half its output (its
        mean context over its decode)."""
        return sum(s[2] + s[3] / 2 for s in self._starts)

    def others_queued_prefill_s(self) -> float:
        return 0.0  # one router: the queue is the fleet state's own

    def snapshot(self, queued_prefill_s: float) -> DemandSnapshot:
        self._trim()
        starts = self._starts
        return DemandSnapshot(
            span_s=self.span_s(),
            requests=len(starts),
            prefill_s=sum(s[1] for s in starts),
            output_tokens=sum(s[3] for s in starts),
            context_tokens=self._context_tokens(),
            queued_prefill_s=queued_prefill_s,
            rejected=self.rejected,
        )


@dataclass(frozen=True)
class FleetDemand:
    """Demand over a coordinated fleet: this replica's tracker plus the other replicas' last
    published windows (their lease drops a dead replica's)."""

    local: DemandTracker
    others: Sequence[DemandSnapshot]

    def rate(self) -> float:
        return self.local.rate() + sum(o.requests / o.span_s for o in self.others)

    def prefill_work_rate(self) -> float:
        return self.local.prefill_work_rate() + sum(o.prefill_s / o.span_s for o in self.others)

    def _mean(self, own: float, others: float) -> float:
        """The mean over every replica's requests, from this one's mean and the others' sums."""
        mine = self.local.count()
        count = mine + sum(o.requests for o in self.others)
        return (own * mine + others) / count if count else 0.0

    def mean_output_tokens(self) -> float:
        own = self.local.mean_output_tokens()
        return self._mean(own, sum(o.output_tokens for o in self.others))

    def mean_context(self) -> float:
        own = self.local.mean_context()
        return self._mean(own, sum(o.context_tokens for o in self.others))

    def others_queued_prefill_s(self) -> float:
        return sum(o.queued_prefill_s for o in self.others)


@dataclass(frozen=True)
class Pressures:
    prefill: float
    decode: float
    prefill_if_fewer: float | None  # with one prefill engine fewer (None: cannot lose one)
    decode_if_fewer: float | None
    n_prefill: int
    n_decode: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "prefill": round(self.prefill, 4),
            "decode": round(self.decode, 4),
            "prefill_if_fewer": None
            if self.prefill_if_fewer is None
            else round(self.prefill_if_fewer, 4),
            "decode_if_fewer": None
            if self.decode_if_fewer is None
            else round(self.decode_if_fewer, 4),
            "n_prefill": self.n_prefill,
            "n_decode": self.n_decode,
        }


@dataclass(frozen=True)
class FlipDecision:
    engine: str
    from_role: Role
    to_role: Role
    reason: str
    pressures: Pressures


@dataclass(frozen=True)
class _DecodeLoad:
    sequences: float  # in flight on the pool: decoding now, or by Little's law if more
    context: float  # the traffic's mean context, tokens
    # Per decode model: (model, the smallest and the largest correction among its engines)
    ratios: list[tuple[DecodeLatencyModel, float, float]]


@dataclass
class RoleController:
    predictor: LatencyPredictor
    budgets: Budgets
    limits: RoleControl
    clock: Clock
    need: float = 0.85  # the receiving pool's pressure above which it needs an engine
    spare: float = 0.6  # the giving pool's pressure with one engine fewer must stay below this
    pinned: bool = False
    last_flip_at: float | None = None

    # --- pressure -------------------------------------------------------------------------

    def _prefill_pressure(self, work_rate: float, queued_s: float, n: int) -> float:
        """``work_rate``: predicted prefill seconds arriving per second; ``queued_s``: the
        prefill work queued on the pool now; ``n``: the pool's engines."""
        if n <= 0:
            return float("inf")
        # The queue that exists now spreads over the engines that would remain.
        return max(work_rate / n, (queued_s / n) / (0.5 * self.budgets.ttft_s))

    def _decode_load(self, state: FleetState, demand: Demand) -> _DecodeLoad | None:
        """What decode pressure is computed from, read once per tick (None: no decode engine
        has a profile)."""
        engines = state.in_role("decode")
        predictor = self.predictor
        ref = next((e.id for e in engines if predictor.has(e.id)), None)
        if ref is None:
            return None
        context = demand.mean_context() or 1.0
        # Little's law: arrivals x tokens each x seconds per token = sequences in flight.
        spt = predictor.decode(ref, 1, context).seconds
        expected = demand.rate() * demand.mean_output_tokens() * spt
        # Per decode model (a fleet's engines mostly share one): the smallest and the largest
        # correction among its engines. Pressure is monotonic in the correction, so the worst
        # engine is one of those two; reading every engine once per tick, not once per pool
        # size asked about, is what a tick over a thousand engines costs.
        models = predictor.models
        ratios = predictor.ratios  # as predictor.ratio(), inline
        spread: dict[int, tuple[DecodeLatencyModel, float, float]] = {}
        for e in engines:
            engine_models = models.get(e.id)
            if engine_models is None:
                continue
            model = engine_models.decode
            ewma = ratios.get((e.id, "decode"))
            ratio = ewma.value if ewma is not None else 1.0
            known = spread.get(id(model))
            if known is None:
                spread[id(model)] = (model, ratio, ratio)
            elif ratio < known[1]:
                spread[id(model)] = (model, ratio, known[2])
            elif ratio > known[2]:
                spread[id(model)] = (model, known[1], ratio)
        decoding = sum(map(state.decode_batch, engines))
        return _DecodeLoad(max(decoding, expected), context, list(spread.values()))

    def _decode_pressure(self, load: _DecodeLoad | None, n: int) -> float:
        if n <= 0:
            return float("inf")
        if load is None:
            return 0.0
        budget = self.budgets.tpot_s
        context = load.context
        at_batch = max(1, round(load.sequences / n))
        worst = 0.0
        for model, low, high in load.ratios:
            raw_floor = model.seconds_per_token(0, context)
            raw_tpot = model.predict(at_batch, context).seconds
            for ratio in (low, high):
                floor = raw_floor * ratio
                if floor >= budget:
                    return float("inf")  # not even a lone sequence meets the budget here
                pressure = (raw_tpot * ratio - floor) / (budget - floor)
                if pressure > worst:
                    worst = pressure
        return max(0.0, worst)

    def queued_prefill_s(self, state: FleetState) -> float:
        """Prefill work this router has queued on the prefill pool now (corrected online)."""
        now = self.clock.now()
        ratio = self.predictor.ratio
        return sum(
            e.queued_prefill_s(now, ratio(e.id, "prefill")) for e in state.in_role("prefill")
        )

    def pressures(self, state: FleetState, demand: Demand) -> Pressures:
        n_p, n_d = len(state.in_role("prefill")), len(state.in_role("decode"))
        work_rate = demand.prefill_work_rate()
        queued_s = self.queued_prefill_s(state) + demand.others_queued_prefill_s()
        load = self._decode_load(state, demand)
        return Pressures(
            prefill=self._prefill_pressure(work_rate, queued_s, n_p),
            decode=self._decode_pressure(load, n_d),
            prefill_if_fewer=self._prefill_pressure(work_rate, queued_s, n_p - 1)
            if n_p > 1
            else None,
            decode_if_fewer=self._decode_pressure(load, n_d - 1) if n_d > 1 else None,
            n_prefill=n_p,
            n_decode=n_d,
        )

    # --- the decision ---------------------------------------------------------------------

    def tick(self, state: FleetState, demand: Demand) -> FlipDecision | None:
        if self.pinned or not self.limits.enabled:
            return None
        now = self.clock.now()
        if self.last_flip_at is not None and now - self.last_flip_at < self.limits.cooldown_s:
            return None
        p = self.pressures(state, demand)
        wants: list[tuple[float, Role, Role]] = []
        if (
            p.decode > self.need
            and p.prefill_if_fewer is not None
            and p.prefill_if_fewer < self.spare
            and p.n_prefill - 1 >= self.limits.min_prefill
        ):
            wants.append((p.decode, "prefill", "decode"))
        if (
            p.prefill > self.need
            and p.decode_if_fewer is not None
            and p.decode_if_fewer < self.spare
            and p.n_decode - 1 >= self.limits.min_decode
        ):
            wants.append((p.prefill, "decode", "prefill"))
        if not wants:
            return None
        _, giver, taker = max(wants)  # the pool in greater need first
        engine = self._candidate(state, giver, taker, now)
        if engine is None:
            return None
        reason = (
            f"{taker} pressure {getattr(p, taker):.2f} > {self.need}; {giver} pool with "
            f"{getattr(p, 'n_' + giver) - 1} engines at "
            f"{getattr(p, giver + '_if_fewer'):.2f} < {self.spare}"
        )
        return FlipDecision(engine.id, giver, taker, reason, p)

    def _candidate(
        self, state: FleetState, giver: Role, taker: Role, now: float
    ) -> EngineState | None:
        eligible = [
            e
            for e in state.in_role(giver)
            if e.can(taker)
            and now - e.role_since >= self.limits.dwell_s
            and e.draining_from is None
        ]
        if not eligible:
            return None
        # The least loaded engine drains soonest.
        return min(eligible, key=lambda e: (e.in_flight_prefill + e.in_flight_decode, e.id))

    def applied(self, decision: FlipDecision | None = None) -> None:
        """Record that a flip happened now (the cooldown starts)."""
        self.last_flip_at = self.clock.now()
