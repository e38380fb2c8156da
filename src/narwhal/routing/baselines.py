"""The routing policies Narwhal's scheduler is measured against, as the P/D routers operators
would otherwise deploy (vllm-router, SGLang's router) run them, for the virtual-time simulator.

Each picks the prefill engine and the decode engine on its own, by the same policy, from the
engines that take that role now (healthy, breaker closed, not draining); nothing is predicted
and every request is admitted: these routers have no admission control. Load is what such a
router counts itself: the legs it has in flight on an engine (a decode engine also counts the
requests it was chosen for that are still in their prefill leg, as those routers count a
request on both workers from the moment they pick the pair).

- ``RoundRobinScheduler`` (``--policy round_robin``): each role's engines in fleet order, in
  turn.
- ``PowerOfTwoScheduler`` (``--policy power_of_two``): two distinct engines drawn at random,
  the less loaded (the first drawn on a tie).
- ``LeastOutstandingScheduler`` (least outstanding requests): the least loaded engine, the
  first in fleet order on a tie.

A decode engine must be a permitted KV transfer peer of the chosen prefill engine (all are in a
fleet whose ``kv_transfer_pairs`` is ``all``); the policy chooses among those. Pure: no clock,
no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

from narwhal.routing.fleet_state import EngineState, FleetState, Role
from narwhal.routing.scheduler import NoPair, Pair, RequestShape

__all__ = [
    "BASELINES",
    "LeastOutstandingScheduler",
    "PowerOfTwoScheduler",
    "RoundRobinScheduler",
]


def outstanding(engine: EngineState, role: Role) -> int:
    """The legs a load-counting router has on ``engine`` in ``role``."""
    if role == "prefill":
        return engine.in_flight_prefill
    return engine.in_flight_decode + engine.pending_decode


class _PerRolePolicy:
    """A pair from one engine choice per role; subclasses say how one role's engine is chosen
    from its (non-empty) list of candidates."""

    def choose(self, role: Role, engines: list[EngineState]) -> EngineState:
        raise NotImplementedError

    def pick(
        self,
        state: FleetState,
        shape: RequestShape | None = None,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Pair | NoPair:
        prefills = [
            e
            for e in state.in_role("prefill")
            if e.id not in exclude_prefill and e.takes("prefill")
        ]
        if not prefills:
            return NoPair("no available engine in the prefill role")
        decodes = [
            e for e in state.in_role("decode") if e.id not in exclude_decode and e.takes("decode")
        ]
        if not decodes:
            return NoPair("no available engine in the decode role")
        p = self.choose("prefill", prefills)
        peers = [d for d in decodes if d.id != p.id and state.is_permitted(p.id, d.id)]
        if not peers:
            return NoPair(f"no available decode engine is a permitted KV transfer peer of {p.id}")
        d = self.choose("decode", peers)
        return Pair(p.id, d.id, 0.0)


class RoundRobinScheduler(_PerRolePolicy):
    def __init__(self) -> None:
        self._turn: dict[Role, int] = {"prefill": 0, "decode": 0}

    def choose(self, role: Role, engines: list[EngineState]) -> EngineState:
        turn = self._turn[role]
        self._turn[role] = turn + 1
        return engines[turn % len(engines)]


class PowerOfTwoScheduler(_PerRolePolicy):
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(0)

    def choose(self, role: Role, engines: list[EngineState]) -> EngineState:
        if len(engines) == 1:
            return engines[0]
        a, b = self.rng.sample(engines, 2)
        return b if outstanding(b, role) < outstanding(a, role) else a


class LeastOutstandingScheduler(_PerRolePolicy):
    def choose(self, role: Role, engines: list[EngineState]) -> EngineState:
        return min(engines, key=lambda e: outstanding(e, role))


# Name (as the simulator's ``DesConfig.scheduler`` and ``narwhal-fleetsim --scheduler`` take
# it) -> a new scheduler, given the run's random generator.
BASELINES: dict[str, Callable[[random.Random], _PerRolePolicy]] = {
    "round_robin": lambda rng: RoundRobinScheduler(),
    "power_of_two": PowerOfTwoScheduler,
    "least_outstanding": lambda rng: LeastOutstandingScheduler(),
}
