"""The baseline routing policies (``narwhal.routing.baselines``): each role's engine chosen on
its own by round robin, power of two choices, least outstanding legs or vllm-router's
cache_aware, every request admitted; and the simulator running them."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.fleetsim.agreement import des_attainment
from narwhal.fleetsim.cli import main as fleetsim_main
from narwhal.fleetsim.simulator import DesConfig, RequestSpec, run_des
from narwhal.fleetsim.workloads import poisson_requests, synthetic_fleet
from narwhal.routing.baselines import (
    BASELINES,
    CacheAwareParams,
    CacheAwareScheduler,
    LeastOutstandingScheduler,
    PowerOfTwoScheduler,
    RoundRobinScheduler,
)
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.scheduler import NoPair, Pair, RequestShape
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing.goodput import crossing_of


def fleet_state(prefill: int = 2, decode: int = 3, **kwargs: Any) -> FleetState:
    n = prefill + decode
    doc = local_fleet_document(
        list(range(9000, 9000 + n)),
        list(range(9100, 9100 + n)),
        initial_roles=["prefill"] * prefill + ["decode"] * decode,
        **kwargs,
    )
    return FleetState(parse_fleet(doc, "test").contract, VirtualClock(100.0))


def pairs(
    scheduler: Any, state: FleetState, n: int, shape: RequestShape | None = None
) -> list[tuple[str, str]]:
    out = []
    for _ in range(n):
        pick = scheduler.pick(state, shape)
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


def test_power_of_two_blind_is_vllm_routers_uniform_choice() -> None:
    """vllm-router 0.1.17's power_of_two in P/D mode compares loads that never move: the first
    drawn, whatever the engines carry."""
    state = fleet_state(2, 2)
    e = state.engines
    e["e0"].in_flight_prefill = 9
    e["e2"].in_flight_decode = 9
    blind = BASELINES["vllm_power_of_two"](random.Random(3))
    assert isinstance(blind, PowerOfTwoScheduler) and blind.blind
    chosen = pairs(blind, state, 40)
    assert {p for p, _ in chosen} == {"e0", "e1"} and {d for _, d in chosen} == {"e2", "e3"}
    # Counting, the loaded engines are never taken.
    assert set(pairs(PowerOfTwoScheduler(random.Random(3)), state, 20)) == {("e1", "e3")}


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


# --- cache_aware (vllm-router) -------------------------------------------------------------


def ask(prompt_tokens: int, *prefix: int) -> RequestShape:
    return RequestShape(prompt_tokens=prompt_tokens, prefix=prefix)


def cache_aware(**params: Any) -> CacheAwareScheduler:
    """vllm-router's defaults (threshold 0.3, imbalance when max - min > 64 and max > 1.5 x
    min), on 100-token blocks so that the sums by hand stay short."""
    return CacheAwareScheduler(CacheAwareParams(block_tokens=100, **params))


def test_cache_aware_takes_the_least_loaded_engine_while_the_load_is_imbalanced() -> None:
    state = fleet_state(3, 1)  # prefill e0 e1 e2, decode e3
    e = state.engines
    s = cache_aware()
    doc = ask(300, 1, 2, 3)
    assert pairs(s, state, 1, doc) == [("e0", "e3")]  # nothing held, no load: the first
    # 67 - 3 = 64 is not above 64: balanced, so to e0, which holds the whole prompt.
    e["e0"].in_flight_prefill, e["e1"].in_flight_prefill, e["e2"].in_flight_prefill = 67, 5, 3
    assert pairs(s, state, 1, doc) == [("e0", "e3")]
    # 70 - 3 > 64 and 70 > 1.5 x 3: the least loaded, and the prompt is inserted for it.
    e["e0"].in_flight_prefill = 70
    assert pairs(s, state, 1, doc) == [("e2", "e3")]
    assert s.trees["prefill"].size == {"e0": 300, "e2": 300}
    # 200 - 134 > 64 but 200 <= 1.5 x 134: balanced; of the two holders, the first to insert.
    e["e0"].in_flight_prefill, e["e1"].in_flight_prefill, e["e2"].in_flight_prefill = 200, 134, 134
    assert pairs(s, state, 1, doc) == [("e0", "e3")]
    # The loads compared are all the role's engines', an unhealthy one's too (as the router
    # lists its workers): 66 - 0 > 64, so the least loaded of the healthy ones.
    e["e0"].in_flight_prefill, e["e1"].in_flight_prefill, e["e2"].in_flight_prefill = 66, 0, 60
    e["e1"].healthy = False
    assert pairs(s, state, 1, doc) == [("e2", "e3")]


def test_cache_aware_sends_a_match_above_the_threshold_to_the_engine_holding_it() -> None:
    state = fleet_state(2, 2)  # prefill e0 e1, decode e2 e3
    e = state.engines
    s = cache_aware()
    assert pairs(s, state, 1, ask(400, 1, 2, 3, 4)) == [("e0", "e2")]
    e["e0"].in_flight_prefill, e["e2"].in_flight_decode = 1, 1  # least load says e1, e3
    # Two of four blocks held: 200 / 400 = 0.5 > 0.3, on each role's tree.
    assert pairs(s, state, 1, ask(400, 1, 2, 8, 9)) == [("e0", "e2")]
    # A match ends at the first block that differs: 100 / 400 = 0.25.
    assert pairs(s, state, 1, ask(400, 1, 5, 2, 3)) == [("e1", "e3")]
    # At the threshold is not above it: 300 / 1,000 = 0.3.
    assert pairs(s, state, 1, ask(1000, 1, 2, 3)) == [("e1", "e3")]


def test_cache_aware_below_the_threshold_takes_the_least_loaded_engine() -> None:
    """What vllm-router does (src/policies/cache_aware.rs), whatever the trees' sizes."""
    state = fleet_state(3, 1)
    state.engines["e1"].in_flight_prefill, state.engines["e2"].in_flight_prefill = 2, 1
    s = cache_aware()
    chosen = [pairs(s, state, 1, ask(500, 10 * i, 10 * i + 1))[0][0] for i in range(1, 4)]
    assert chosen == ["e0", "e0", "e0"]
    assert s.trees["prefill"].size == {"e0": 1500}


def test_cache_aware_documented_low_match_rule_takes_the_smallest_tree() -> None:
    """What vllm-router's docs say (and SGLang's router did): the most room, load aside."""
    state = fleet_state(3, 1)
    state.engines["e1"].in_flight_prefill = 10  # balanced still (10 - 0 <= 64)
    s = cache_aware(low_match="smallest_tree")
    prompts = [(500, (10, 11, 12, 13, 14)), (100, (20,)), (200, (30, 31)), (100, (40,))]
    chosen = [pairs(s, state, 1, ask(n, *blocks))[0][0] for n, blocks in prompts]
    # Trees before each: none; e0 500; e0 500, e1 100; e0 500, e1 100, e2 200.
    assert chosen == ["e0", "e1", "e2", "e1"]
    assert s.trees["prefill"].size == {"e0": 500, "e1": 200, "e2": 200}


def test_cache_aware_evicts_least_recently_used_blocks_at_each_interval() -> None:
    state = fleet_state(2, 1)  # prefill e0 e1, decode e2
    clock, e = state.clock, state.engines
    assert isinstance(clock, VirtualClock)  # at 100 s
    s = cache_aware(max_tree_tokens=250, eviction_interval_s=120.0, cache_threshold=0.7)
    doc = ask(300, 1, 2, 3)
    pairs(s, state, 1, doc)  # e0; the first pick starts the intervals: evictions at 220, 340
    clock.set(150.0)
    pairs(s, state, 1, ask(100, 7))  # e0 (least loaded, the first on the tie): 400 tokens
    clock.set(219.0)
    e["e0"].in_flight_prefill = 1
    assert pairs(s, state, 1, doc) == [("e0", "e2")]  # all held: 1.0 > 0.7
    assert s.trees["prefill"].size == {"e0": 400}  # over 250, but not evicted before 220
    # At 220 e0 evicts, least recently used first: the block of (7), then (1, 2, 3)'s last.
    clock.set(220.0)
    assert pairs(s, state, 1, ask(100, 8)) == [("e1", "e2")]
    assert s.trees["prefill"].size == {"e0": 200, "e1": 100}
    # (1, 2) is left: 200 / 300 is no longer above 0.7, so the least loaded engine.
    assert pairs(s, state, 1, doc) == [("e1", "e2")]
    assert s.trees["prefill"].size == {"e0": 200, "e1": 400}
    clock.set(339.0)
    pairs(s, state, 1, ask(100, 9))  # e1
    assert s.trees["prefill"].size == {"e0": 200, "e1": 500}
    clock.set(340.0)
    pairs(s, state, 1, ask(100, 6))  # e1, once it evicted (8) and (1, 2, 3)'s last two
    assert s.trees["prefill"].size == {"e0": 200, "e1": 300}
    assert s.trees["decode"].size == {"e2": 300}  # the decode tree on its own


def test_cache_aware_evicts_unique_content_exactly_down_to_the_limit() -> None:
    state = fleet_state(1, 1)
    clock = state.clock
    assert isinstance(clock, VirtualClock)
    s = cache_aware(max_tree_tokens=250)
    pairs(s, state, 2, ask(400))  # 800 tokens that no one can match (one entry)
    clock.advance(120.0)
    pairs(s, state, 1, ask(100, 1))
    assert s.trees["prefill"].size == {"e0": 250 + 100}  # evicted in part, then the block


def test_cache_aware_a_prompt_without_a_prefix_matches_nothing_but_grows_the_tree() -> None:
    state = fleet_state(2, 1)
    e = state.engines
    s = cache_aware(cache_threshold=0.0)  # any token held would be a match
    assert pairs(s, state, 1, ask(1000)) == [("e0", "e2")]
    e["e0"].in_flight_prefill = 1
    assert pairs(s, state, 1, ask(1000)) == [("e1", "e2")]  # the same length, nothing shared
    e["e1"].in_flight_prefill = 2
    assert pairs(s, state, 1, ask(500)) == [("e0", "e2")]
    assert s.trees["prefill"].size == {"e0": 1500, "e1": 1000}
    assert s.trees["decode"].size == {"e2": 2500}
    assert not s.trees["prefill"].holders  # nothing that anyone could match


def test_cache_aware_in_pd_chooses_each_role_on_its_own_tree_and_load() -> None:
    """As vllm-router's P/D router: one policy instance per role, each given the same request;
    a decode engine's load counts its requests from the pick, still in their prefill leg, to
    their last token (vllm-router 0.1.17, measured)."""
    state = fleet_state(2, 2)  # prefill e0 e1, decode e2 e3
    e = state.engines
    s = cache_aware()
    doc = ask(200, 1, 2)
    assert pairs(s, state, 1, doc) == [("e0", "e2")]
    assert s.trees["prefill"].size == {"e0": 200} and s.trees["decode"].size == {"e2": 200}
    # Prefill imbalanced (70 - 0 > 64): the least loaded there; decode balanced: the match.
    e["e0"].in_flight_prefill = 70
    assert pairs(s, state, 1, doc) == [("e1", "e2")]
    e["e0"].in_flight_prefill = 0
    # e3's 100 requests in their prefill leg count: 100 - 1 > 64, imbalanced, so e2 (the
    # least loaded) although a novel prompt.
    e["e3"].pending_decode, e["e2"].in_flight_decode = 100, 1
    assert pairs(s, state, 1, ask(200, 5, 6)) == [("e0", "e2")]
    # Counted from the end of the prefill leg only (what older sources suggest): 1 against 0,
    # the least loaded of a novel prompt is e3.
    legs = cache_aware(decode_load="decode_legs")
    assert pairs(legs, state, 1, ask(200, 5, 6)) == [("e0", "e3")]
    # Decode legs counted either way: 100 - 0 > 64, so e3 despite e2's match.
    e["e3"].pending_decode, e["e2"].in_flight_decode = 0, 100
    assert pairs(s, state, 1, doc) == [("e0", "e3")]
    # No decode load counted at all: balanced, the match.
    blind = cache_aware(decode_load="none")
    assert pairs(blind, state, 2, doc) == [("e0", "e2"), ("e0", "e2")]


def test_cache_aware_drops_the_tree_of_a_matched_engine_gone_unhealthy() -> None:
    state = fleet_state(3, 1)  # prefill e0 e1 e2, decode e3
    e = state.engines
    s = cache_aware()
    doc = ask(200, 1, 2)
    assert pairs(s, state, 1, doc) == [("e0", "e3")]
    # Excluded (say it failed this request) but healthy: the first other engine, tree kept.
    pick = s.pick(state, doc, exclude_prefill={"e0"})
    assert isinstance(pick, Pair) and pick.prefill == "e1"
    assert s.trees["prefill"].size == {"e0": 200}  # nothing inserted on the fallback
    # Unhealthy: its tree goes; the first healthy engine, not the least loaded.
    e["e0"].healthy = False
    e["e1"].in_flight_prefill = 1
    assert pairs(s, state, 1, doc) == [("e1", "e3")]
    assert s.trees["prefill"].size == {}
    assert pairs(s, state, 1, doc) == [("e2", "e3")]  # nothing to match now: least load


@pytest.mark.parametrize(
    "params",
    [{"cache_threshold": 1.5}, {"balance_abs_threshold": -1}, {"block_tokens": 0}],
    ids=["threshold", "abs", "block"],
)
def test_cache_aware_params_are_checked(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        CacheAwareParams(**params)


def test_the_simulator_runs_cache_aware_and_it_follows_shared_prefixes() -> None:
    fleet, timings = synthetic_fleet(2, 2, {"ttft_s": 10.0, "tpot_s": 0.3})
    base = poisson_requests(rate=2.0, count=60, prompt_tokens=2048, output_tokens=16, seed=2)
    # Every prompt opens with the same two 512-token blocks: half of it, a match of 0.5.
    specs = [
        RequestSpec(r.arrival, r.prompt_tokens, r.output_tokens, prefix=(7, 8, 100 + i, 200 + i))
        for i, r in enumerate(base)
    ]
    result = run_des(DesConfig(fleet, timings, scheduler="cache_aware", flipping=False), specs)
    assert result.rejected == 0 and result.completed == len(specs)
    # Never 64 legs apart: every request goes where the shared blocks are (e0, then e2).
    busy = result.utilisation
    assert busy["e0"] > 0 and busy["e2"] > 0 and busy["e1"] == 0 and busy["e3"] == 0


def test_narwhal_fleetsim_takes_cache_aware(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engines", "1:1", "--requests", "5", "--prompt-tokens", "512"]
    argv += ["--output-tokens", "4", "--scheduler", "cache_aware", "--no-flipping"]
    assert fleetsim_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 5


# --- goodput from a few rates, as the baselines' live check measures it ----------------------


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([(4.0, 1.0), (5.0, 0.97), (6.0, 0.72)], (5.08, "bracketed")),
        ([(6.0, 0.72), (4.0, 0.95), (5.0, 0.90)], (4.0, "bracketed")),  # at the target: passes
        ([(4.0, 1.0), (5.0, 0.96)], (5.0, "above")),
        ([(4.0, 0.9), (5.0, 0.8)], (4.0, "below")),
    ],
    ids=["between", "unsorted-at-target", "all-pass", "all-miss"],
)
def test_crossing_interpolates_where_attainment_first_falls_below_the_target(
    points: list[tuple[float, float]], expected: tuple[float, str]
) -> None:
    value, how = crossing_of(points, 0.95)
    assert (round(value, 2), how) == expected


def test_des_attainment_leaves_out_the_first_token_deadline() -> None:
    """vllm-router has no first-token deadline: a request whose decode leg started late but
    whose TTFT and TPOT are within budget has met them, though the simulator counts it
    ``tpot_late`` (narwhal-serve would have aborted that leg)."""
    fleet, timings = synthetic_fleet(
        1, 1, {"ttft_s": 10.0, "tpot_s": 0.3}, first_token_timeout_s=0.1
    )
    specs = [RequestSpec(0.0, 8192, 4), RequestSpec(0.0, 8192, 4)]
    result = run_des(DesConfig(fleet, timings, scheduler="round_robin", flipping=False), specs)
    assert result.deadline_missed >= 1 and result.attainment < 1.0
    assert des_attainment(result, specs, fleet.budgets) == 1.0
    with pytest.raises(ValueError, match="at least 2 tokens"):
        des_attainment(result, [RequestSpec(0.0, 10, 1)], fleet.budgets)
