"""The baseline routing policies (``narwhal.routing.baselines``): each role's engine chosen on
its own by round robin, power of two choices or least outstanding legs, every request admitted;
and the simulator running them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.fleetsim.simulator import DesConfig, run_des
from narwhal.fleetsim.workloads import poisson_requests, synthetic_fleet
from narwhal.routing.baselines import (
    BASELINES,
    LeastOutstandingScheduler,
    PowerOfTwoScheduler,
    RoundRobinScheduler,
)
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.scheduler import NoPair, Pair
from narwhal.simengine.fleet import local_fleet_document


def fleet_state(prefill: int = 2, decode: int = 3, **kwargs: Any) -> FleetState:
    n = prefill + decode
    doc = local_fleet_document(
        list(range(9000, 9000 + n)),
        list(range(9100, 9100 + n)),
        initial_roles=["prefill"] * prefill + ["decode"] * decode,
        **kwargs,
    )
    return FleetState(parse_fleet(doc, "test").contract, VirtualClock(100.0))


def pairs(scheduler: Any, state: FleetState, n: int) -> list[tuple[str, str]]:
    out = []
    for _ in range(n):
        pick = scheduler.pick(state)
        assert isinstance(pick, Pair)
        out.append((pick.prefill, pick.decode))
    return out


def test_round_robin_takes_each_roles_engines_in_turn() -> None:
    state = fleet_state(2, 3)
    assert pairs(RoundRobinScheduler(), state, 6) == [
        ("e0", "e2"),
        ("e1", "e3"),
        ("e0", "e4"),
        ("e1", "e2"),
        ("e0", "e3"),
        ("e1", "e4"),
    ]


def test_least_outstanding_counts_the_routers_own_legs_decode_ones_from_the_pick() -> None:
    state = fleet_state(2, 3)
    e = state.engines
    e["e0"].in_flight_prefill = 2
    e["e1"].in_flight_prefill = 1
    e["e2"].in_flight_decode = 1
    e["e3"].pending_decode = 1  # chosen, still in its prefill leg: counted
    e["e4"].in_flight_decode = 1
    # Engines' own reports are not what these routers count.
    e["e1"].scraped.running, e["e1"].scraped.at = 50, 100.0
    assert pairs(LeastOutstandingScheduler(), state, 1) == [("e1", "e2")]
    e["e2"].in_flight_decode = 3
    assert pairs(LeastOutstandingScheduler(), state, 1) == [("e1", "e3")]  # first on a tie


def test_power_of_two_takes_the_less_loaded_of_two_random_engines() -> None:
    state = fleet_state(2, 2)
    state.engines["e0"].in_flight_prefill = 5
    state.engines["e3"].in_flight_decode = 5
    # Two engines per role: both are drawn every time, the less loaded one wins.
    assert set(pairs(PowerOfTwoScheduler(random.Random(3)), state, 20)) == {("e1", "e2")}
    # Of many equal engines, the draws spread the requests.
    state = fleet_state(2, 6)
    decodes = [d for _, d in pairs(PowerOfTwoScheduler(random.Random(3)), state, 60)]
    assert set(decodes) == {"e2", "e3", "e4", "e5", "e6", "e7"}


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_unavailable_and_excluded_engines_are_skipped(name: str) -> None:
    state = fleet_state(2, 2)
    state.engines["e0"].healthy = False
    scheduler = BASELINES[name](random.Random(0))
    assert {p for p, _ in pairs(scheduler, state, 4)} == {"e1"}
    pick = scheduler.pick(state, exclude_decode={"e2", "e3"})
    assert isinstance(pick, NoPair) and "decode role" in pick.reason
    assert pick.over_budget is None  # not admission's business: nothing can serve it
    state.engines["e1"].healthy = False
    assert isinstance(scheduler.pick(state), NoPair)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_decode_engines_are_permitted_peers_of_the_prefill_engine(name: str) -> None:
    state = fleet_state(
        2,
        2,
        kv_transfer_pairs=[{"prefill": "e0", "decode": "e3"}, {"prefill": "e1", "decode": "e2"}],
    )
    assert set(pairs(BASELINES[name](random.Random(0)), state, 12)) <= {("e0", "e3"), ("e1", "e2")}


def test_the_simulator_runs_the_baselines_and_they_admit_every_request() -> None:
    """Past the fleet's capacity v1 rejects what it predicts will miss; the baselines, like the
    routers they stand for, send everything on."""
    fleet, timings = synthetic_fleet(2, 2, {"ttft_s": 10.0, "tpot_s": 0.3})
    specs = poisson_requests(rate=6.0, count=150, prompt_tokens=4096, output_tokens=32, seed=1)
    v1 = run_des(DesConfig(fleet, timings, scheduler="v1", flipping=False), specs)
    assert v1.rejected > 0
    for name in BASELINES:
        result = run_des(DesConfig(fleet, timings, scheduler=name, flipping=False), specs)
        assert result.rejected == 0 and result.completed == len(specs), name
        assert result.attainment < v1.attainment, name
        busy = sorted(result.utilisation.values())
        assert busy[0] > 0, f"{name} left an engine idle"


def test_an_unknown_scheduler_is_named() -> None:
    fleet, timings = synthetic_fleet(1, 1, {"ttft_s": 10.0, "tpot_s": 0.3})
    with pytest.raises(ValueError, match=r"unknown scheduler 'cache'.*round_robin"):
        run_des(DesConfig(fleet, timings, scheduler="cache"), [])
