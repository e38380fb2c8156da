"""The role controller with a virtual clock: when it flips, when it must not, and drains."""

from __future__ import annotations

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import Budgets, RoleControl, RoutingPolicy, parse_fleet
from narwhal.profiles.models import DecodeLatencyModel, PrefillLatencyModel
from narwhal.profiles.store import EngineModels
from narwhal.routing.admission import Admit, Queue, Reject, Unavailable, admit
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.lifecycle import Lifecycle
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.roles import DemandTracker, RoleController
from narwhal.routing.scheduler import NoPair, Pair, RequestShape, SchedulerV1
from narwhal.simengine.fleet import local_fleet_document

BUDGETS = Budgets(ttft_s=2.0, tpot_s=0.1, attainment=0.95)


def setup(
    n: int = 4,
    roles: list[list[str]] | None = None,
    initial: list[str] | None = None,
    decode_intercept: float = 0.04,
    **limits: float,
) -> tuple[VirtualClock, FleetState, RoleController, DemandTracker]:
    clock = VirtualClock(1000.0)
    doc = local_fleet_document(
        list(range(9000, 9000 + n)),
        list(range(9100, 9100 + n)),
        roles=roles,
        initial_roles=initial,
        ttft_s=2.0,
        tpot_s=0.1,
        first_token_timeout_s=1.0,
    )
    state = FleetState(parse_fleet(doc, "t").contract, clock)
    for e in state.engines.values():
        e.healthy = True
        e.role_since = 0.0  # long settled
    models = {
        e: EngineModels(
            PrefillLatencyModel(0.01, 1e-4, 0.0, 128, 8192),
            DecodeLatencyModel(decode_intercept, 0.002, 0.0, 8, 8192),
            "g",
        )
        for e in state.engines
    }
    control = RoleControl(
        **{"min_prefill": 1, "min_decode": 1, "cooldown_s": 60, "dwell_s": 120, **limits}
    )
    controller = RoleController(LatencyPredictor(models), BUDGETS, control, clock)
    return clock, state, controller, settled_tracker(clock)


def settled_tracker(clock: VirtualClock, window_s: float = 10.0) -> DemandTracker:
    """A tracker that has run longer than its window: its rates divide by the window."""
    return DemandTracker(clock, window_s=window_s, started_at=clock.now() - window_s)


def prefill_heavy(demand: DemandTracker, per_s: int = 20) -> None:
    # Long prompts, short answers: 0.31 s of prefill each.
    for _ in range(per_s * 10):
        demand.record_start(0.31, 3000, 4)


def decode_heavy(state: FleetState, demand: DemandTracker, batch: int) -> None:
    for _ in range(20):
        demand.record_start(0.02, 100, 200)
    for e in state.in_role("decode"):
        e.in_flight_decode = batch


def test_no_flip_when_both_pools_are_comfortable() -> None:
    _, state, controller, demand = setup()
    for _ in range(20):
        demand.record_start(0.05, 400, 20)
    assert controller.tick(state, demand) is None


def test_flip_toward_decode_when_decode_needs_it_and_prefill_can_spare() -> None:
    _, state, controller, demand = setup()
    decode_heavy(state, demand, batch=30)  # TPOT 0.04 + 0.002*30 = 0.10 -> pressure 1.0
    decision = controller.tick(state, demand)
    assert decision is not None
    assert (decision.from_role, decision.to_role) == ("prefill", "decode")
    assert decision.engine in ("e0", "e1")
    assert decision.pressures.decode > 0.85
    assert decision.pressures.prefill_if_fewer is not None
    assert decision.pressures.prefill_if_fewer < 0.6


def test_no_flip_when_the_giver_would_miss_its_budget_with_one_fewer() -> None:
    _, state, controller, demand = setup()
    decode_heavy(state, demand, batch=30)
    prefill_heavy(demand, per_s=2)  # 0.62 s of prefill per second: 0.31 per engine, 0.62 on one
    assert controller.tick(state, demand) is None


def test_flip_toward_prefill_under_prefill_pressure() -> None:
    _, state, controller, demand = setup()
    prefill_heavy(demand, per_s=6)  # 1.86 s/s over 2 engines: 0.93 each
    decision = controller.tick(state, demand)
    assert decision is not None and (decision.from_role, decision.to_role) == ("decode", "prefill")


def test_minimums_and_permissions_hold() -> None:
    _, state, controller, demand = setup(n=3, initial=["prefill", "decode", "decode"])
    decode_heavy(state, demand, batch=30)
    # The only prefill engine cannot leave: min_prefill is 1.
    assert controller.tick(state, demand) is None
    _, state, controller, demand = setup(
        roles=[["prefill"], ["prefill"], ["prefill", "decode"], ["decode"]]
    )
    decode_heavy(state, demand, batch=30)
    assert controller.tick(state, demand) is None  # no prefill engine may decode


def test_dwell_and_cooldown_prevent_oscillation_at_a_boundary() -> None:
    """A load that sits at the boundary, tipping one way then the other from one tick to the
    next (bursty arrivals): without dwell and cooldown the controller follows every tip."""

    def run(dwell: float, cooldown: float) -> int:
        clock, state, controller, _ = setup(dwell_s=dwell, cooldown_s=cooldown)
        flips = 0
        for tick in range(60):  # one tick a second for a minute
            clock.advance(1.0)
            demand = settled_tracker(clock)
            decode_tip = tick % 2 == 0
            for e in state.in_role("decode"):
                e.in_flight_decode = 30 if decode_tip else 2
            per_s = 0.5 if decode_tip else 5.5
            for _ in range(int(per_s * 10)):
                demand.record_start(0.31, 3000, 4)
            decision = controller.tick(state, demand)
            if decision is not None:
                state.set_role(decision.engine, decision.to_role)
                state.engines[decision.engine].draining_from = None
                controller.applied(decision)
                flips += 1
        return flips

    assert run(dwell=0.0, cooldown=0.0) >= 10  # it would oscillate
    assert run(dwell=120.0, cooldown=60.0) <= 1


def test_pinned_controller_never_flips() -> None:
    _, state, controller, demand = setup()
    decode_heavy(state, demand, batch=30)
    controller.pinned = True
    assert controller.tick(state, demand) is None


def test_drain_an_engine_leaving_prefill_finishes_its_prefills_first() -> None:
    _, state, _, _ = setup()
    e1 = state.engines["e1"]
    e1.in_flight_prefill = 2
    state.set_role("e1", "decode")
    assert e1.role == "decode" and e1.draining_from == "prefill"
    assert not e1.accepts("decode")  # queued prefills first
    assert not e1.settle_drain()
    e1.in_flight_prefill = 0
    assert e1.accepts("decode") and e1.settle_drain() and e1.draining_from is None
    # Leaving decode: its streams keep going (the router never cuts them), new work is prefill.
    e2 = state.engines["e2"]
    e2.in_flight_decode = 5
    state.set_role("e2", "prefill")
    assert e2.accepts("prefill") and not e2.accepts("decode")
    assert not e2.settle_drain()
    e2.in_flight_decode = 0
    assert e2.settle_drain()


def test_scheduler_skips_an_engine_still_draining_prefills() -> None:
    _, state, controller, _ = setup()
    sched = SchedulerV1(controller.predictor, BUDGETS)
    e1 = state.engines["e1"]
    e1.in_flight_prefill = 1
    state.set_role("e1", "decode")
    picks = {sched.pick(state, exclude_decode={"e2"}) for _ in range(3)}
    assert all(isinstance(p, Pair) and p.decode == "e3" for p in picks)


def test_admission_verdicts() -> None:
    pair = Pair("e0", "e2", 0.5)
    over = NoPair("too slow", over_budget=Pair("e0", "e2", -0.1))
    reject = RoutingPolicy(admission="reject")
    queue = RoutingPolicy(admission="queue", queue_max=2, queue_timeout_s=5.0)
    assert admit(pair, reject, 0) == Admit(pair)
    assert isinstance(admit(NoPair("no engines"), queue, 0), Unavailable)
    assert admit(over, reject, 0) == Reject("over_budget", "too slow")
    assert isinstance(admit(over, queue, 1), Queue)
    assert admit(over, queue, 2).reason == "queue_full"  # type: ignore[union-attr]
    assert isinstance(admit(over, queue, 2, waited_s=1.0, in_queue=True), Queue)
    timed_out = admit(over, queue, 2, waited_s=5.0, in_queue=True)
    assert timed_out.reason == "queue_timeout"  # type: ignore[union-attr]
    # The wait is said: a predicted TTFT counts from now, not from the request's arrival.
    assert timed_out.message == (  # type: ignore[union-attr]
        "no capacity within the admission queue's 5 s (waited 5 s; the TTFT below counts from "
        "now, after the wait): too slow"
    )


# --- decode pressure above the model's floor -----------------------------------------------


def test_decode_pressure_counts_the_batch_not_the_floor() -> None:
    """A decode model whose intercept alone is 80% of the TPOT budget (as on the simulator's
    calibration: 0.24 s of 0.3 s): an idle decode pool must read as idle and give an engine to
    a prefill pool that needs it. Pressure is the share of the batch headroom in use."""
    _, state, controller, demand = setup(decode_intercept=0.08)
    prefill_heavy(demand, per_s=6)  # 1.86 s/s over 2 engines: 0.93 each
    p = controller.pressures(state, demand)
    assert p.decode < 0.2
    assert p.decode_if_fewer is not None and p.decode_if_fewer < 0.6
    decision = controller.tick(state, demand)
    assert decision is not None and (decision.from_role, decision.to_role) == ("decode", "prefill")
    # At a batch of 5 per engine, TPOT = 0.08 + 0.01 = 0.09: half of the 0.02 s of headroom.
    for e in state.in_role("decode"):
        e.in_flight_decode = 5
    assert controller.pressures(state, demand).decode == pytest.approx(0.5)


def test_a_floor_over_the_budget_is_infinite_decode_pressure() -> None:
    _, state, controller, demand = setup(decode_intercept=0.12)  # no batch meets 0.1 s
    assert controller.pressures(state, demand).decode == float("inf")


# --- the demand tracker ----------------------------------------------------------------------


def test_demand_right_after_start_divides_by_the_time_covered() -> None:
    clock = VirtualClock(500.0)
    demand = DemandTracker(clock, window_s=30.0)
    for _ in range(20):  # 5 requests a second for 4 s
        clock.advance(0.2)
        demand.record_start(0.1, 1000, 10)
    assert demand.rate() == pytest.approx(5.0)
    assert demand.prefill_work_rate() == pytest.approx(0.5)
    # Once the tracker is older than its window, the window is the span.
    clock.advance(40.0)
    for _ in range(30):
        clock.advance(1.0)
        demand.record_start(0.1, 1000, 10)
    assert demand.rate() == pytest.approx(1.0, rel=0.05)
    # The floor: a request in the tracker's first instant is not a flood.
    fresh = DemandTracker(clock, window_s=30.0)
    fresh.record_start(0.1, 1000, 10)
    assert fresh.rate() == pytest.approx(1.0 / fresh.min_span_s)


def test_rejected_requests_count_as_demand() -> None:
    clock, state, controller, _ = setup()
    demand = settled_tracker(clock)
    over = NoPair("too slow", over_budget=Pair("e0", "e2", -0.1, predicted_prefill_s=0.31))
    for _ in range(10):
        demand.record_start(0.31, 3000, 4)
    for _ in range(50):
        demand.record_rejected(RequestShape(3000, 4), over)
    assert demand.rejected == 50
    assert demand.rate() == pytest.approx(6.0)  # 60 arrivals in 10 s, 50 of them rejected
    assert demand.prefill_work_rate() == pytest.approx(1.86)
    # The prefill pool that rejects them reads as needing an engine (0.93 per engine).
    decision = controller.tick(state, demand)
    assert decision is not None and decision.to_role == "prefill"
    # No pair at all: the request still arrived; its prefill is unknown.
    demand.record_rejected(RequestShape(3000, 4), NoPair("no engines"))
    assert demand.rate() == pytest.approx(6.1)


def test_the_tracker_trims_itself_without_reads() -> None:
    clock = VirtualClock(0.0)
    demand = DemandTracker(clock, window_s=10.0)
    for _ in range(10_000):  # ten a second for 1,000 s; nobody reads
        clock.advance(0.1)
        demand.record_start(0.1, 100, 10)
    assert len(demand._starts) <= 101


def test_the_routers_admission_records_what_it_rejects() -> None:
    """The lifecycle's admission step (the router's and the simulator's): a 429 is demand
    too."""
    clock = VirtualClock(100.0)
    doc = local_fleet_document(
        [1, 2],
        [3, 4],
        initial_roles=["prefill", "decode"],
        ttft_s=1.0,
        tpot_s=0.1,
        first_token_timeout_s=0.9,
    )
    fleet = parse_fleet(doc, "fleet.json").contract
    models = {
        e.id: EngineModels(
            PrefillLatencyModel(0.01, 5e-5, 0.0, 64, 8192),
            DecodeLatencyModel(0.02, 0.001, 0.0, 64, 16384),
            None,
        )
        for e in fleet.engines
    }
    predictor = LatencyPredictor(models)
    state = FleetState(fleet, clock)
    demand = settled_tracker(clock)
    lifecycle = Lifecycle(
        state, SchedulerV1(predictor, fleet.budgets), predictor=predictor, demand=demand
    )
    # 5 s of prefill queued on the only prefill engine: nothing meets a 1 s TTFT budget.
    state.engines["e0"].in_flight_prefill = 1
    state.engines["e0"].prefill_work["earlier"] = (5.0, clock.now())
    ticket = lifecycle.arrive("r", max_tokens=8, prompt_tokens=3)
    verdict = lifecycle.admit(ticket)
    assert isinstance(verdict, Reject) and verdict.reason == "over_budget"
    assert ticket.phase == "done"
    assert demand.rejected == 1 and demand.rate() == pytest.approx(0.1)
    assert demand.prefill_work_rate() > 0
