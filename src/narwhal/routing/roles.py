"""The role controller: which engines prefill and which decode, as the traffic mix shifts.

On each tick it compares prefill pressure with decode pressure and decides at most one flip:

- **prefill pressure**: the prefill pool's utilisation (predicted prefill seconds arriving per
  second, measured from requests *started*, per prefill engine) and its predicted queue wait
  against the TTFT budget;
- **decode pressure**: the predicted TPOT at the decode pool's batch (the larger of the
  sequences decoding now and what arrivals imply by Little's law) against the TPOT budget.

It flips only when the receiving pool needs the engine (its pressure is above ``need``) and the
giving pool would still meet its budget with one engine fewer (its pressure recomputed for N-1
engines stays below ``spare``): a plan that would oscillate between N and N-1 fails that test.
Minimum engines per role, a minimum dwell per engine and a cooldown after every flip come from
the fleet; an engine never takes a role it is not permitted. Pure: a clock is injected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from narwhal.clock import Clock
from narwhal.contract import Budgets, RoleControl
from narwhal.routing.fleet_state import EngineState, FleetState, Role
from narwhal.routing.predictor import LatencyPredictor

__all__ = ["DemandTracker", "FlipDecision", "Pressures", "RoleController"]


@dataclass
class DemandTracker:
    """What arrived in the last ``window_s``: requests started, not completed (a controller
    that waits for completions sees demand only after the damage is done)."""

    clock: Clock
    window_s: float = 30.0
    _starts: deque[tuple[float, float, int, int]] = field(default_factory=deque)

    def record_start(self, predicted_prefill_s: float, prompt_tokens: int, max_tokens: int) -> None:
        self._starts.append((self.clock.now(), predicted_prefill_s, prompt_tokens, max_tokens))

    def _trim(self) -> None:
        horizon = self.clock.now() - self.window_s
        while self._starts and self._starts[0][0] < horizon:
            self._starts.popleft()

    def rate(self) -> float:
        self._trim()
        return len(self._starts) / self.window_s

    def prefill_work_rate(self) -> float:
        """Predicted prefill seconds arriving per second."""
        self._trim()
        return sum(s[1] for s in self._starts) / self.window_s

    def mean_output_tokens(self) -> float:
        self._trim()
        return sum(s[3] for s in self._starts) / len(self._starts) if self._starts else 0.0

    def mean_context(self) -> float:
        self._trim()
        if not self._starts:
            return 0.0
        return sum(s[2] + s[3] / 2 for s in self._starts) / len(self._starts)


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

    def _prefill_pressure(self, state: FleetState, demand: DemandTracker, n: int) -> float:
        if n <= 0:
            return float("inf")
        now = self.clock.now()
        utilisation = demand.prefill_work_rate() / n
        engines = state.in_role("prefill")
        waits = [e.queued_prefill_s(now) for e in engines]
        # The queue that exists now spreads over the engines that would remain.
        wait = (sum(waits) / n) if waits else 0.0
        return max(utilisation, wait / (0.5 * self.budgets.ttft_s))

    def _decode_pressure(self, state: FleetState, demand: DemandTracker, n: int) -> float:
        if n <= 0:
            return float("inf")
        engines = state.in_role("decode")
        decoding = sum(state.decode_batch(e) for e in engines)
        context = demand.mean_context() or 1.0
        # Little's law: arrivals x tokens each x seconds per token = sequences in flight.
        ref = next((e.id for e in engines if self.predictor.has(e.id)), None)
        if ref is None:
            return 0.0
        spt = self.predictor.decode(ref, 1, context).seconds
        expected = demand.rate() * demand.mean_output_tokens() * spt
        batch = max(decoding, expected) / n
        worst = max(
            (
                self.predictor.decode(e.id, max(1, round(batch)), context).seconds
                for e in engines
                if self.predictor.has(e.id)
            ),
            default=spt,
        )
        return worst / self.budgets.tpot_s

    def pressures(self, state: FleetState, demand: DemandTracker) -> Pressures:
        n_p, n_d = len(state.in_role("prefill")), len(state.in_role("decode"))
        return Pressures(
            prefill=self._prefill_pressure(state, demand, n_p),
            decode=self._decode_pressure(state, demand, n_d),
            prefill_if_fewer=self._prefill_pressure(state, demand, n_p - 1) if n_p > 1 else None,
            decode_if_fewer=self._decode_pressure(state, demand, n_d - 1) if n_d > 1 else None,
            n_prefill=n_p,
            n_decode=n_d,
        )

    # --- the decision ---------------------------------------------------------------------

    def tick(self, state: FleetState, demand: DemandTracker) -> FlipDecision | None:
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
