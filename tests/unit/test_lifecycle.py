"""The routing lifecycle on a virtual clock: what each step counts on the engines, what it
releases, the queue, retries, cancellation, and what it reports to its observer."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.profiles.models import DecodeLatencyModel, PrefillLatencyModel
from narwhal.profiles.store import EngineModels
from narwhal.routing.admission import Admit, Queue, Reject
from narwhal.routing.breaker import BreakerState
from narwhal.routing.fleet_state import EngineState, FleetState, Role
from narwhal.routing.lifecycle import Lifecycle, LifecycleObserver, Ticket
from narwhal.routing.predictor import LatencyPredictor, RatioEwma
from narwhal.routing.roles import DemandTracker
from narwhal.routing.scheduler import NoPair, Pair, SchedulerV0, SchedulerV1
from narwhal.simengine.fleet import local_fleet_document


class RecordingObserver(LifecycleObserver):
    def __init__(self) -> None:
        self.in_flight_by: Counter[tuple[str, str]] = Counter()
        self.depths: list[int] = []
        self.failed: list[tuple[str, str]] = []
        self.breakers: dict[str, BreakerState] = {}
        self.corrections: list[tuple[str, str]] = []
        self.freed = 0

    def in_flight(self, engine: str, role: Role, delta: int) -> None:
        self.in_flight_by[(engine, role)] += delta

    def queue_depth(self, depth: int) -> None:
        self.depths.append(depth)

    def leg_failed(self, engine: str, leg: Literal["prefill", "decode"]) -> None:
        self.failed.append((engine, leg))

    def breaker(self, engine: str, state: BreakerState) -> None:
        self.breakers[engine] = state

    def correction(self, engine: str, phase: str, ratio: float, drifted: bool) -> None:
        self.corrections.append((engine, phase))

    def capacity_freed(self) -> None:
        self.freed += 1


def build(
    *,
    n_prefill: int = 2,
    n_decode: int = 2,
    routing: dict[str, object] | None = None,
    scheduler: str = "v1",
    ttft_s: float = 2.0,
) -> tuple[Lifecycle, VirtualClock, RecordingObserver]:
    n = n_prefill + n_decode
    doc = local_fleet_document(
        list(range(9000, 9000 + n)),
        list(range(9100, 9100 + n)),
        initial_roles=["prefill"] * n_prefill + ["decode"] * n_decode,
        ttft_s=ttft_s,
        tpot_s=0.1,
        first_token_timeout_s=0.9 * ttft_s,
        routing=routing or {},
    )
    fleet = parse_fleet(doc, "fleet.json").contract
    models = {
        e.id: EngineModels(
            PrefillLatencyModel(0.01, 1e-4, 0.0, 64, 8192),
            DecodeLatencyModel(0.02, 0.001, 0.0, 64, 16384),
            None,
        )
        for e in fleet.engines
    }
    clock = VirtualClock(10.0)
    state = FleetState(fleet, clock)
    predictor = LatencyPredictor(models)
    observer = RecordingObserver()
    lifecycle = Lifecycle(
        state,
        SchedulerV1(predictor, fleet.budgets) if scheduler == "v1" else SchedulerV0(),
        predictor=predictor if scheduler == "v1" else None,
        demand=DemandTracker(clock),
        observer=observer,
    )
    return lifecycle, clock, observer


def counts(lifecycle: Lifecycle) -> dict[str, tuple[int, int, int, int]]:
    """Per engine: in-flight prefill, in-flight decode, pending decode, queued prefill work."""
    return {
        e.id: (e.in_flight_prefill, e.in_flight_decode, e.pending_decode, len(e.prefill_work))
        for e in lifecycle.state.engines.values()
    }


IDLE = {"e0": (0, 0, 0, 0), "e1": (0, 0, 0, 0), "e2": (0, 0, 0, 0), "e3": (0, 0, 0, 0)}


def admitted(lifecycle: Lifecycle, ticket: Ticket) -> Pair:
    verdict = lifecycle.admit(ticket)
    assert isinstance(verdict, Admit), verdict
    return verdict.pair


def test_a_pd_request_is_counted_on_its_engines_leg_by_leg_and_released() -> None:
    lifecycle, clock, observer = build()
    ticket = lifecycle.arrive("r", max_tokens=11, prompt_tokens=1000)
    pair = admitted(lifecycle, ticket)
    p, d = pair.prefill, pair.decode
    assert ticket.phase == "prefill"
    # The prefill leg runs on p; d counts the request as joining its batch.
    assert counts(lifecycle)[p] == (1, 0, 0, 1) and counts(lifecycle)[d] == (0, 0, 1, 0)
    assert lifecycle.state.decode_batch(lifecycle.state.engines[d]) == 1
    clock.advance(0.2)
    lifecycle.prefill_done(ticket, "ok", prompt_tokens=1000)
    assert ticket.phase == "decode"
    assert counts(lifecycle)[p] == (0, 0, 0, 0) and counts(lifecycle)[d] == (0, 1, 0, 0)
    assert ("e0" if p == "e0" else p, "prefill") in observer.corrections
    clock.advance(0.05)
    lifecycle.first_token(ticket)
    assert ticket.phase == "streaming" and ticket.batch_at_start == 1
    clock.advance(0.25)
    lifecycle.finished(ticket, completion_tokens=11, complete=True)
    assert ticket.phase == "done"
    assert counts(lifecycle) == IDLE
    assert (d, "decode") in observer.corrections
    assert all(v == 0 for v in observer.in_flight_by.values())
    assert observer.freed == 2  # the prefill leg's end and the decode leg's
    assert lifecycle.demand is not None and lifecycle.demand.rate() > 0


def test_a_decoding_leg_is_counted_until_its_predicted_end_and_forgotten_when_it_ends() -> None:
    lifecycle, clock, _ = build()
    ticket = lifecycle.arrive("r", max_tokens=11, prompt_tokens=1000)
    pair = admitted(lifecycle, ticket)
    d = lifecycle.state.engines[pair.decode]
    assert d.decode_ends == []  # in its prefill leg: not yet
    lifecycle.prefill_done(ticket, "ok", prompt_tokens=1000)
    clock.advance(0.05)
    lifecycle.first_token(ticket)
    # Its other ten tokens at the TPOT budget's pace (0.1 s), slower than its batch's (itself
    # alone): the batch may grow to the budget before it ends (see Lifecycle._foresee_end).
    assert lifecycle.predictor is not None
    assert lifecycle.predictor.decode(d.id, 1, 1000 + 11 / 2).seconds < 0.1
    tpot = 0.1
    assert d.decode_ends == [pytest.approx(clock.now() + 10 * tpot)]
    assert d.decode_batch_at(clock.now(), clock.now() + 10.1 * tpot) == 0  # gone by then
    assert d.decode_batch_at(clock.now(), clock.now() + 9.9 * tpot) == 1
    lifecycle.finished(ticket, completion_tokens=11, complete=True)
    assert d.decode_ends == [] and ticket.decode_end is None
    # A leg cancelled while it streams is forgotten too.
    other = lifecycle.arrive("s", max_tokens=50, prompt_tokens=100)
    second = admitted(lifecycle, other)
    lifecycle.prefill_done(other, "ok", prompt_tokens=100)
    lifecycle.first_token(other)
    assert len(lifecycle.state.engines[second.decode].decode_ends) == 1
    lifecycle.cancel(other)
    assert all(e.decode_ends == [] for e in lifecycle.state.engines.values())


def test_a_decoding_leg_over_the_budget_is_foreseen_at_its_batchs_pace() -> None:
    # Not at the TPOT predicted at its pick, which assumed the batch would shrink as foreseen:
    # ends foreseen that early let later picks assume the same, and under overload the batch
    # grew past the budget (tests/reliability/test_overload.py).
    lifecycle, clock, _ = build(n_decode=1)
    predictor = lifecycle.predictor
    assert predictor is not None
    first = lifecycle.arrive("a", max_tokens=101, prompt_tokens=1000)
    admitted(lifecycle, first)
    lifecycle.prefill_done(first, "ok", prompt_tokens=1000)
    lifecycle.first_token(first)
    second = lifecycle.arrive("b", max_tokens=101, prompt_tokens=1000)
    pair = admitted(lifecycle, second)
    d = lifecycle.state.engines[pair.decode]
    # The engine turns out five times slower than its profile: over the budget (0.1 s).
    predictor.ratios[(d.id, "decode")] = RatioEwma(0.2, observed=5.0, predicted=1.0, samples=9)
    lifecycle.prefill_done(second, "ok", prompt_tokens=1000)
    lifecycle.first_token(second)
    assert second.batch_at_start == 2
    pace = predictor.decode(d.id, 2, 1000 + 101 / 2).seconds
    assert pace > 0.1 and pace > predictor.decode(d.id, 1, 1000 + 101 / 2).seconds
    assert second.decode_end == pytest.approx(clock.now() + 100 * pace)


def test_the_prefill_correction_compares_its_leg_with_the_queue_it_waited_behind() -> None:
    lifecycle, clock, _ = build(n_prefill=1)
    first = lifecycle.arrive("a", max_tokens=2, prompt_tokens=4000)
    second = lifecycle.arrive("b", max_tokens=2, prompt_tokens=4000)
    admitted(lifecycle, first)
    admitted(lifecycle, second)
    assert first.prefill_predicted_s == pytest.approx(0.41)
    # The second waits behind the first: its prediction is both prefills.
    assert second.prefill_predicted_s == pytest.approx(0.82)
    clock.advance(0.41)
    lifecycle.prefill_done(first, "ok")
    clock.advance(0.41)
    lifecycle.prefill_done(second, "ok")
    predictor = lifecycle.predictor
    assert predictor is not None
    assert predictor.ratio("e0", "prefill") == pytest.approx(1.0)


def test_a_failed_prefill_counts_against_its_engine_and_the_retry_goes_elsewhere() -> None:
    lifecycle, _, observer = build()
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    first = admitted(lifecycle, ticket)
    lifecycle.prefill_done(ticket, "failed")
    assert ticket.phase == "new" and ticket.failed_prefill == {first.prefill}
    assert observer.failed == [(first.prefill, "prefill")]
    assert lifecycle.state.engines[first.prefill].breaker.consecutive_failures == 1
    assert counts(lifecycle) == IDLE
    retry = lifecycle.retry(ticket)
    assert isinstance(retry, Pair) and retry.prefill != first.prefill
    assert ticket.phase == "prefill"
    lifecycle.cancel(ticket)
    assert counts(lifecycle) == IDLE


def test_a_refused_leg_ends_the_request_and_clears_its_engine() -> None:
    lifecycle, _, observer = build()
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    pair = admitted(lifecycle, ticket)
    engine = lifecycle.state.engines[pair.prefill]
    engine.breaker.record_failure()
    lifecycle.prefill_done(ticket, "refused")
    assert ticket.phase == "done" and engine.breaker.consecutive_failures == 0
    assert observer.failed == [] and counts(lifecycle) == IDLE
    with pytest.raises(ValueError):
        lifecycle.retry(ticket)


def test_a_refusal_closes_no_open_breaker_and_a_refused_probe_frees_the_probe() -> None:
    """A refusal (a 4xx) shows the engine's front end answers, not that it computes: a leg sent
    before the breaker opened, refused after, left the breaker open; a bad request that was the
    half-open probe leaves it half-open with the probe free for the next leg. Before, both
    closed the breaker (prefill and decode alike) with no leg run."""
    lifecycle, clock, observer = build(n_prefill=1, n_decode=1)
    p, d = lifecycle.state.engines["e0"], lifecycle.state.engines["e1"]
    # Decode: the leg is in flight when the breaker opens; its refusal does not close it.
    early = lifecycle.arrive("early", max_tokens=4, prompt_tokens=100)
    admitted(lifecycle, early)
    lifecycle.prefill_done(early, "ok")
    for _ in range(d.breaker.failure_threshold):
        d.breaker.record_failure()
    assert d.breaker.state is BreakerState.OPEN
    lifecycle.decode_failed(early, "refused")
    assert early.phase == "done" and d.breaker.state is BreakerState.OPEN
    assert observer.failed == [] and counts(lifecycle)["e1"] == (0, 0, 0, 0)
    # After the cool-off a bad request takes the probe and is refused: still half-open, and the
    # next request probes.
    clock.advance(d.breaker.open_seconds)
    bad = lifecycle.arrive("bad", max_tokens=4, prompt_tokens=100)
    assert admitted(lifecycle, bad).decode == "e1"
    lifecycle.prefill_done(bad, "ok")
    assert d.breaker.probe_in_flight
    lifecycle.decode_failed(bad, "refused")
    assert d.breaker.state is BreakerState.HALF_OPEN and d.breaker.allows_request()
    good = lifecycle.arrive("good", max_tokens=4, prompt_tokens=100)
    assert admitted(lifecycle, good).decode == "e1"
    lifecycle.prefill_done(good, "ok")
    lifecycle.first_token(good)
    assert d.breaker.state is BreakerState.CLOSED
    lifecycle.finished(good, completion_tokens=4, complete=True)
    # Prefill: the same.
    late = lifecycle.arrive("late", max_tokens=4, prompt_tokens=100)
    admitted(lifecycle, late)
    for _ in range(p.breaker.failure_threshold):
        p.breaker.record_failure()
    lifecycle.prefill_done(late, "refused")
    assert late.phase == "done" and p.breaker.state is BreakerState.OPEN
    clock.advance(p.breaker.open_seconds)
    probe = lifecycle.arrive("probe", max_tokens=4, prompt_tokens=100)
    assert admitted(lifecycle, probe).prefill == "e0"
    assert p.breaker.state is BreakerState.HALF_OPEN and p.breaker.probe_in_flight
    lifecycle.prefill_done(probe, "refused")
    assert p.breaker.state is BreakerState.HALF_OPEN and p.breaker.allows_request()
    assert counts(lifecycle) == {"e0": (0, 0, 0, 0), "e1": (0, 0, 0, 0)}


def test_a_slow_legs_refusal_closes_no_breaker_its_hedge_opened() -> None:
    """The hedge counts a failure on the slow leg's engine; the slow leg answering first
    clears it, but a refusal (a 4xx: nothing ran) clears it only on a breaker still closed: it
    closed a breaker the hedge had just opened (a review of 0065e4f)."""
    lifecycle, _, _ = build(n_prefill=2, n_decode=1)
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    slow = lifecycle.state.engines[admitted(lifecycle, ticket).prefill]
    for _ in range(slow.breaker.failure_threshold - 1):
        slow.breaker.record_failure()
    hedge = lifecycle.hedge_prefill(ticket, budget_left_s=10.0)
    assert isinstance(hedge, Pair) and hedge.prefill != slow.id
    assert slow.breaker.state is BreakerState.OPEN
    lifecycle.prefill_done(ticket, "refused", hedge_ended="cancelled")
    assert ticket.phase == "done" and slow.breaker.state is BreakerState.OPEN


@pytest.mark.parametrize("outcome", ["failed", "deadline"])
def test_a_decode_leg_that_fails_before_its_first_token_is_retried_elsewhere(
    outcome: Literal["failed", "deadline"],
) -> None:
    lifecycle, _, observer = build()
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    pair = admitted(lifecycle, ticket)
    lifecycle.prefill_done(ticket, "ok")
    lifecycle.decode_failed(ticket, outcome)
    assert ticket.failed_decode == {pair.decode} and observer.failed == [(pair.decode, "decode")]
    assert counts(lifecycle) == IDLE
    retry = lifecycle.retry(ticket)
    assert isinstance(retry, Pair) and retry.decode != pair.decode


@pytest.mark.parametrize("n_prefill", [1, 2])
def test_a_decode_retry_prefills_on_another_engine_when_there_is_one(n_prefill: int) -> None:
    """The failed decode leg may have failed reading its prefill engine's KV: the retry avoids
    that prefill engine too when another can serve, without counting it failed."""
    lifecycle, _, observer = build(n_prefill=n_prefill, n_decode=2)
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=3000)
    pair = admitted(lifecycle, ticket)
    assert not pair.local
    lifecycle.prefill_done(ticket, "ok")
    lifecycle.decode_failed(ticket, "failed")
    retry = lifecycle.retry(ticket)
    assert isinstance(retry, Pair) and retry.decode != pair.decode and not retry.local
    assert (retry.prefill != pair.prefill) == (n_prefill == 2)
    assert ticket.failed_prefill == frozenset() and observer.failed == [(pair.decode, "decode")]
    prefill = lifecycle.state.engines[pair.prefill]
    assert prefill.breaker.consecutive_failures == 0


def test_a_decode_retry_with_no_other_decode_engine_takes_another_prefill_engine() -> None:
    """The only decode engine's leg failed before its first token, perhaps reading the KV of a
    prefill engine that died once it answered: the retry goes to the same decode engine with
    another prefill engine rather than fail the request."""
    lifecycle, _, observer = build(n_prefill=2, n_decode=1)
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=3000)
    pair = admitted(lifecycle, ticket)
    lifecycle.prefill_done(ticket, "ok")
    lifecycle.decode_failed(ticket, "failed")
    retry = lifecycle.retry(ticket)
    assert isinstance(retry, Pair) and not retry.local
    assert (retry.prefill, retry.decode) == ("e1" if pair.prefill == "e0" else "e0", pair.decode)
    # Failed again there: it was the decode engine after all, and no other pair is left.
    lifecycle.prefill_done(ticket, "ok")
    lifecycle.decode_failed(ticket, "failed")
    assert isinstance(lifecycle.retry(ticket), NoPair) and ticket.phase == "done"
    assert observer.failed == [(pair.decode, "decode")] * 2


class _OverBudgetElsewhere:
    """Decode engines e2 (it fits) and e3 (over budget); prefill e0 and e1."""

    def pick(self, state, shape, exclude_prefill=(), exclude_decode=()):  # type: ignore[no-untyped-def]
        prefill = [p for p in ("e0", "e1") if p not in exclude_prefill]
        if not prefill:
            return NoPair("no prefill engine")
        if "e2" not in exclude_decode:
            return Pair(prefill[0], "e2", 0.0)
        if "e3" not in exclude_decode:
            return NoPair("over budget", over_budget=Pair(prefill[0], "e3", -0.1))
        return NoPair("no decode engine")


def test_a_decode_retry_takes_another_decode_engine_over_budget_before_the_failed_one() -> None:
    """The same decode engine is retried only when no other can serve at all: another one
    over the budgets is still another engine (under overload, pairs are over budget)."""
    lifecycle, _, _ = build(n_prefill=2, n_decode=2)
    lifecycle.scheduler = _OverBudgetElsewhere()  # type: ignore[assignment]
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=3000)
    pair = admitted(lifecycle, ticket)
    assert pair.decode == "e2"
    lifecycle.prefill_done(ticket, "ok")
    lifecycle.decode_failed(ticket, "failed")
    retry = lifecycle.retry(ticket)
    assert isinstance(retry, Pair) and retry.decode == "e3"


def test_no_pair_left_after_failures_ends_the_ticket() -> None:
    lifecycle, _, _ = build(n_prefill=1, n_decode=1)
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    admitted(lifecycle, ticket)
    lifecycle.prefill_done(ticket, "failed")
    assert isinstance(lifecycle.retry(ticket), NoPair) and ticket.phase == "done"


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode", "streaming"])
def test_cancel_releases_whatever_the_ticket_holds(phase: str) -> None:
    lifecycle, clock, observer = build(n_prefill=1, routing={"admission": "queue"}, ttft_s=0.1)
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    prefill = lifecycle.state.engines["e0"]
    if phase == "queued":
        # 5 s of prefill ahead: nothing meets a 0.1 s TTFT budget.
        prefill.in_flight_prefill = 1
        prefill.prefill_work["earlier"] = (5.0, clock.now())
        assert isinstance(lifecycle.admit(ticket), Queue) and lifecycle.queued == 1
        prefill.in_flight_prefill = 0
        del prefill.prefill_work["earlier"]
    else:
        pair = admitted(lifecycle, ticket)
        # A half-open breaker's probe: cancelling it must let the next request probe.
        engine = lifecycle.state.engines[pair.prefill if phase == "prefill" else pair.decode]
        engine.breaker.state = BreakerState.HALF_OPEN
        engine.breaker.probe_in_flight = True
        if phase == "prefill":
            # This ticket is the probe: only the probe's departure frees it.
            ticket.prefill_probe = (engine.id, engine.breaker.half_opened)
        else:
            lifecycle.prefill_done(ticket, "ok")
            engine.breaker.state = BreakerState.HALF_OPEN
            engine.breaker.probe_in_flight = True
            # This ticket is the probe: only the probe's departure frees it.
            ticket.decode_probe = True
            ticket.probe_cycle = engine.breaker.half_opened
        if phase == "streaming":
            lifecycle.first_token(ticket)
            engine.breaker.state = BreakerState.HALF_OPEN
            engine.breaker.probe_in_flight = True
    lifecycle.cancel(ticket)
    lifecycle.cancel(ticket)  # idempotent
    assert ticket.phase == "done" and lifecycle.queued == 0
    assert set(counts(lifecycle).values()) == {(0, 0, 0, 0)}
    assert all(v == 0 for v in observer.in_flight_by.values())
    assert all(e.breaker.allows_request() for e in lifecycle.state.engines.values())


def test_the_queue_is_decided_oldest_first_and_times_out() -> None:
    lifecycle, clock, observer = build(
        n_prefill=1, routing={"admission": "queue", "queue_timeout_s": 1.0}, ttft_s=0.5
    )
    prefill = lifecycle.state.engines["e0"]
    prefill.in_flight_prefill = 1
    prefill.prefill_work["earlier"] = (5.0, clock.now())
    tickets = [lifecycle.arrive(f"r{i}", max_tokens=4, prompt_tokens=100) for i in range(3)]
    for t in tickets:
        assert isinstance(lifecycle.admit(t), Queue)
    assert lifecycle.queued == 3 and observer.depths == [1, 2, 3]
    clock.advance(0.5)
    assert lifecycle.drain() == []  # still no room, and not yet timed out
    # The earlier prefill ends: room for one (each admission is counted before the next).
    prefill.in_flight_prefill = 0
    del prefill.prefill_work["earlier"]
    left = lifecycle.drain()
    assert next(t.id for t, v in left if isinstance(v, Admit)) == "r0"
    assert tickets[0].waited_s == pytest.approx(0.5)
    clock.advance(0.6)
    rest = lifecycle.drain()
    assert {t.id for t, v in rest if isinstance(v, Reject) and v.reason == "queue_timeout"} == {
        t.id for t in tickets if t.phase == "done" and t.pair is None
    }
    assert lifecycle.queued == 0 and observer.depths[-1] == 0


def test_queue_full_rejects_at_once() -> None:
    lifecycle, clock, _ = build(n_prefill=1, routing={"admission": "queue", "queue_max": 1})
    prefill = lifecycle.state.engines["e0"]
    prefill.in_flight_prefill = 1
    prefill.prefill_work["earlier"] = (50.0, clock.now())
    assert isinstance(lifecycle.admit(lifecycle.arrive("a", max_tokens=4, prompt_tokens=10)), Queue)
    verdict = lifecycle.admit(lifecycle.arrive("b", max_tokens=4, prompt_tokens=10))
    assert isinstance(verdict, Reject) and verdict.reason == "queue_full"


def test_a_local_leg_holds_its_decode_engine_as_prefill_work_until_its_first_token() -> None:
    lifecycle, clock, _ = build(
        n_prefill=1, routing={"local_prefill": {"enabled": True, "max_prompt_tokens": 4096}}
    )
    # A long prefill queue on the only prefill engine: the decode engine prefills itself.
    prefill = lifecycle.state.engines["e0"]
    prefill.in_flight_prefill = 1
    prefill.prefill_work["earlier"] = (1.5, clock.now())
    ticket = lifecycle.arrive("r", max_tokens=8, prompt_tokens=200)
    pair = admitted(lifecycle, ticket)
    assert pair.local and ticket.phase == "decode"
    d = lifecycle.state.engines[pair.decode]
    assert d.in_flight_decode == 1 and ticket.id in d.prefill_work
    assert d.recent_local_prefill_s(clock.now()) == pytest.approx(pair.predicted_prefill_s)
    clock.advance(0.05)
    lifecycle.first_token(ticket)
    assert ticket.id not in d.prefill_work and d.in_flight_decode == 1
    lifecycle.finished(ticket, completion_tokens=8, complete=True)
    assert d.in_flight_decode == 0


def test_text_prompts_are_estimated_until_a_prefill_leg_counts_them() -> None:
    lifecycle, _, _ = build(scheduler="v0")
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_bytes=4000)
    assert lifecycle.shape(ticket).prompt_tokens == 1000  # 4 bytes a token, cold
    admitted(lifecycle, ticket)
    lifecycle.prefill_done(ticket, "ok", prompt_tokens=500)
    assert ticket.prompt_tokens == 500
    assert (
        lifecycle.shape(lifecycle.arrive("s", max_tokens=4, prompt_bytes=4000)).prompt_tokens == 500
    )


def test_max_tokens_is_planned_as_the_engines_cut_it_to_what_the_prompt_leaves() -> None:
    lifecycle, _, _ = build(scheduler="v0")
    context = lifecycle.state.fleet.model.max_model_len
    near = lifecycle.arrive("r", max_tokens=context, prompt_tokens=context - 10)
    assert lifecycle.shape(near).max_tokens == 10
    # A text prompt's by the least it can be (16 bytes a token), not its estimate (4 bytes).
    text = lifecycle.arrive("t", max_tokens=context, prompt_bytes=16 * (context - 100))
    assert lifecycle.shape(text).max_tokens == 100
    assert lifecycle.shape(text).prompt_tokens == 4 * (context - 100)
    short = lifecycle.arrive("s", max_tokens=50, prompt_tokens=100)
    assert lifecycle.shape(short).max_tokens == 50


def test_an_idle_pair_takes_an_over_budget_request_a_busy_one_does_not() -> None:
    lifecycle, _, _ = build(n_prefill=1, n_decode=1, ttft_s=0.001)  # no pair meets this
    first = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    verdict = lifecycle.admit(first)
    assert isinstance(verdict, Admit) and verdict.idle and first.idle_admitted
    verdict = lifecycle.admit(lifecycle.arrive("s", max_tokens=4, prompt_tokens=100))
    assert isinstance(verdict, Reject) and verdict.reason == "over_budget"


def test_steps_out_of_order_are_refused() -> None:
    lifecycle, _, _ = build()
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    with pytest.raises(ValueError):
        lifecycle.prefill_done(ticket, "ok")
    admitted(lifecycle, ticket)
    with pytest.raises(ValueError):
        lifecycle.admit(ticket)
    with pytest.raises(ValueError):
        lifecycle.first_token(ticket)


def test_a_stream_that_breaks_is_continued_on_a_pair_avoiding_its_engine() -> None:
    lifecycle, clock, observer = build()
    ticket = lifecycle.arrive("r", max_tokens=40, prompt_tokens=100)
    pair = admitted(lifecycle, ticket)
    lifecycle.prefill_done(ticket, "ok")
    lifecycle.first_token(ticket)
    clock.advance(0.1)
    lifecycle.decode_broke(ticket)
    assert ticket.phase == "done" and observer.failed == [(pair.decode, "decode")]
    assert lifecycle.state.engines[pair.decode].breaker.consecutive_failures == 1
    assert counts(lifecycle) == IDLE
    follow, pick = lifecycle.migrate(ticket, "r-m1", prompt_tokens=120, max_tokens=20)
    assert isinstance(pick, Pair) and pick.decode != pair.decode
    assert follow.phase == "prefill" and follow.arrival == ticket.arrival
    assert follow.prompt_tokens == 120 and follow.max_tokens == 20
    lifecycle.cancel(follow)
    assert counts(lifecycle) == IDLE
    with pytest.raises(ValueError):
        lifecycle.decode_broke(ticket)  # it is over already


def test_an_engine_that_breaks_every_stream_after_its_first_token_has_its_breaker_opened() -> None:
    """Each leg's first token recorded a success, which reset the failures its break had just
    counted: an engine failing every stream mid-answer kept its breaker closed for good. A
    leg's verdict is its end; a half-open breaker's probe still closes it at its first token;
    a stream begun before the breaker opened does not close it when it ends."""
    lifecycle, clock, _ = build(n_decode=1)
    d = lifecycle.state.engines["e2"]
    old = lifecycle.arrive("old", max_tokens=40, prompt_tokens=100)
    admitted(lifecycle, old)
    lifecycle.prefill_done(old, "ok")
    lifecycle.first_token(old)
    for i in range(3):
        ticket = lifecycle.arrive(f"r{i}", max_tokens=40, prompt_tokens=100)
        assert admitted(lifecycle, ticket).decode == "e2"
        lifecycle.prefill_done(ticket, "ok")
        lifecycle.first_token(ticket)
        assert d.breaker.consecutive_failures == i and d.breaker.state is BreakerState.CLOSED
        clock.advance(0.1)
        lifecycle.decode_broke(ticket)
    assert d.breaker.state is BreakerState.OPEN
    lifecycle.finished(old, completion_tokens=40, complete=True)
    assert d.breaker.state is BreakerState.OPEN  # no close without the cool-off and a probe
    # After the cool-off one request probes; its first token closes the breaker.
    clock.advance(d.breaker.open_seconds)
    probe = lifecycle.arrive("probe", max_tokens=40, prompt_tokens=100)
    assert admitted(lifecycle, probe).decode == "e2"
    assert d.breaker.state is BreakerState.HALF_OPEN
    lifecycle.prefill_done(probe, "ok")
    lifecycle.first_token(probe)
    assert d.breaker.state is BreakerState.CLOSED
    # A whole answer resets what breaks counted.
    broken = lifecycle.arrive("broken", max_tokens=40, prompt_tokens=100)
    admitted(lifecycle, broken)
    lifecycle.prefill_done(broken, "ok")
    lifecycle.first_token(broken)
    lifecycle.decode_broke(broken)
    assert d.breaker.consecutive_failures == 1
    lifecycle.finished(probe, completion_tokens=40, complete=True)
    assert d.breaker.consecutive_failures == 0


def test_only_a_whole_answer_resets_the_breaker_and_a_failed_probe_reopens_it() -> None:
    """n > 1: when one choice breaks, the router cuts its siblings, which ended as successes
    on the same engine and wiped out the failure (a review's repro: five such requests, the
    breaker closed with no failure). A stream cut short (``answered=False``: a sibling broke,
    the client left, a drain) says nothing of the engine. And a half-open probe that closed
    the breaker at its first token and then breaks opens it again at once."""
    lifecycle, clock, _ = build(n_decode=1)
    d = lifecycle.state.engines["e2"]
    for i in range(3):
        choices = [lifecycle.arrive(f"r{i}-{j}", max_tokens=40, prompt_tokens=100) for j in (0, 1)]
        for ticket in choices:
            admitted(lifecycle, ticket)
            lifecycle.prefill_done(ticket, "ok")
            lifecycle.first_token(ticket)
        lifecycle.decode_broke(choices[0])
        lifecycle.finished(choices[1], completion_tokens=3, answered=False)
    assert d.breaker.state is BreakerState.OPEN
    clock.advance(d.breaker.open_seconds)
    probe = lifecycle.arrive("probe", max_tokens=40, prompt_tokens=100)
    admitted(lifecycle, probe)
    lifecycle.prefill_done(probe, "ok")
    lifecycle.first_token(probe)
    assert d.breaker.state is BreakerState.CLOSED
    lifecycle.decode_broke(probe)
    assert d.breaker.state is BreakerState.OPEN


def test_a_probes_late_break_after_other_successes_counts_as_one_failure() -> None:
    """The probe's quick reopening holds only until other evidence comes: a probe stream that
    breaks after whole answers were served there counts as one failure, and a stream begun
    before the breaker opened does not close it by its first token in the half-open state."""
    lifecycle, clock, _ = build(n_decode=1, ttft_s=60.0)
    d = lifecycle.state.engines["e2"]
    early = lifecycle.arrive("early", max_tokens=40, prompt_tokens=100)
    admitted(lifecycle, early)
    lifecycle.prefill_done(early, "ok")  # decode leg begun while the breaker is closed
    for _ in range(d.breaker.failure_threshold):
        d.breaker.record_failure()
    clock.advance(d.breaker.open_seconds)
    assert d.breaker.allows_request() and d.breaker.state is BreakerState.HALF_OPEN
    lifecycle.first_token(early)
    assert d.breaker.state is BreakerState.HALF_OPEN  # not the probe: no verdict
    lifecycle.finished(early, completion_tokens=40, complete=True)
    probe = lifecycle.arrive("probe", max_tokens=40, prompt_tokens=100)
    admitted(lifecycle, probe)
    lifecycle.prefill_done(probe, "ok")
    lifecycle.first_token(probe)
    assert d.breaker.state is BreakerState.CLOSED
    other = lifecycle.arrive("other", max_tokens=40, prompt_tokens=100)
    admitted(lifecycle, other)
    lifecycle.prefill_done(other, "ok")
    lifecycle.first_token(other)
    lifecycle.finished(other, completion_tokens=40, complete=True)  # a whole answer since
    lifecycle.decode_broke(probe)
    assert d.breaker.state is BreakerState.CLOSED and d.breaker.consecutive_failures == 1


def test_a_slow_prefill_is_hedged_on_another_prefill_engine() -> None:
    lifecycle, _, observer = build()
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    first = admitted(lifecycle, ticket)
    hedge = lifecycle.hedge_prefill(ticket, budget_left_s=1.5)
    assert isinstance(hedge, Pair) and hedge.prefill != first.prefill and not hedge.local
    # The slow leg counts as failed on its engine's breaker at once; it is reported as a
    # failed leg once the race shows it was one; the hedge's is the one counted now.
    slow = lifecycle.state.engines[first.prefill]
    assert slow.breaker.consecutive_failures == 1 and observer.failed == []
    assert ticket.phase == "prefill" and ticket.pair == hedge
    assert counts(lifecycle)[first.prefill] == (0, 0, 0, 0)
    assert counts(lifecycle)[hedge.prefill][0] == 1
    lifecycle.cancel(ticket)
    assert counts(lifecycle) == IDLE
    # The hedge answers first: the slow leg lost to it, a failed leg.
    ticket = lifecycle.arrive("r2", max_tokens=4, prompt_tokens=100)
    first = admitted(lifecycle, ticket)
    hedge = lifecycle.hedge_prefill(ticket, budget_left_s=1.5)
    assert isinstance(hedge, Pair)
    lifecycle.prefill_done(ticket, "ok", prompt_tokens=100)
    assert observer.failed == [(first.prefill, "prefill")]
    lifecycle.cancel(ticket)
    # The slow leg answers first: its engine was slow, not hung; its breaker's count cleared
    # (a burst hedging several legs of a healthy engine opened its breaker), nothing reported.
    ticket = lifecycle.arrive("r3", max_tokens=4, prompt_tokens=100)
    first = admitted(lifecycle, ticket)
    hedge = lifecycle.hedge_prefill(ticket, budget_left_s=1.5)
    assert isinstance(hedge, Pair)
    slow = lifecycle.state.engines[first.prefill]
    assert slow.breaker.consecutive_failures >= 1
    lifecycle.prefill_done(ticket, "ok", prompt_tokens=100, hedge_ended="cancelled")
    assert slow.breaker.consecutive_failures == 0
    assert len(observer.failed) == 1  # r2's slow leg only
    lifecycle.cancel(ticket)
    assert counts(lifecycle) == IDLE


def test_no_hedge_without_another_prefill_engine_or_budget_left() -> None:
    lifecycle, _, observer = build(n_prefill=1)
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    first = admitted(lifecycle, ticket)
    assert isinstance(lifecycle.hedge_prefill(ticket, budget_left_s=1.5), NoPair)
    assert ticket.pair == first and ticket.phase == "prefill" and observer.failed == []
    lifecycle, _, observer = build()
    ticket = lifecycle.arrive("r", max_tokens=4, prompt_tokens=100)
    first = admitted(lifecycle, ticket)
    assert isinstance(lifecycle.hedge_prefill(ticket, budget_left_s=0.0), NoPair)
    assert ticket.pair == first and observer.failed == []


def test_a_half_open_decode_engine_takes_one_probe_from_its_pick_not_from_its_decode_leg() -> None:
    """The decode leg starts after the prefill, so a half-open decode engine was marked probed
    only then: every request picked during the probe's prefill picked it too (a QA pass: 4 of
    12 requests sent to a half-open engine, each paying the first-token deadline). The probe is
    the request's from its pick; a prefill that fails gives it back, the decode leg keeps it."""
    lifecycle, clock, _ = build(n_decode=2)
    d = lifecycle.state.engines["e2"]
    d.breaker.state = BreakerState.OPEN
    d.breaker.opened_at = clock.now()
    clock.advance(d.breaker.open_seconds)
    assert d.breaker.allows_request() and d.breaker.state is BreakerState.HALF_OPEN
    picked = []
    for i in range(4):
        ticket = lifecycle.arrive(f"r{i}", max_tokens=40, prompt_tokens=100)
        picked.append((ticket, admitted(lifecycle, ticket).decode))
    assert [engine for _, engine in picked].count("e2") == 1, picked
    probe = next(t for t, engine in picked if engine == "e2")
    # Its prefill fails: the probe is free for the next request, and its retry may take it.
    lifecycle.prefill_done(probe, "failed")
    assert not d.breaker.probe_in_flight
    retry = lifecycle.retry(probe)
    assert isinstance(retry, Pair)
    second = lifecycle.arrive("late", max_tokens=40, prompt_tokens=100)
    decodes = [retry.decode, admitted(lifecycle, second).decode]
    assert decodes.count("e2") == 1, decodes
    holder = probe if retry.decode == "e2" else second
    lifecycle.prefill_done(holder, "ok")
    assert d.breaker.probe_in_flight and holder.decode_probe
    lifecycle.first_token(holder)
    assert d.breaker.state is BreakerState.CLOSED


def _half_open(lifecycle: Lifecycle, clock: VirtualClock, engine_id: str) -> EngineState:
    d = lifecycle.state.engines[engine_id]
    d.breaker.state = BreakerState.OPEN
    d.breaker.opened_at = clock.now()
    clock.advance(d.breaker.open_seconds)
    assert d.breaker.allows_request() and d.breaker.state is BreakerState.HALF_OPEN
    return d


def test_a_probe_given_back_late_does_not_free_a_later_cool_offs_probe() -> None:
    """From a review: a probe taken in one cool-off, given back after the breaker opened and
    went half-open again, freed the next cool-off's probe, and two were let through."""
    lifecycle, clock, _ = build(n_decode=1)
    d = _half_open(lifecycle, clock, "e2")
    a = lifecycle.arrive("a", max_tokens=40, prompt_tokens=100)
    assert admitted(lifecycle, a).decode == "e2" and a.decode_probe
    d.breaker.record_failure()  # another leg's failure: open again, then half-open again
    clock.advance(d.breaker.open_seconds)
    b = lifecycle.arrive("b", max_tokens=40, prompt_tokens=100)
    assert admitted(lifecycle, b).decode == "e2" and b.decode_probe
    lifecycle.prefill_done(a, "failed")
    assert d.breaker.probe_in_flight  # still b's
    c = lifecycle.arrive("c", max_tokens=40, prompt_tokens=100)
    verdict = lifecycle.admit(c)
    assert not (isinstance(verdict, Admit) and c.decode_probe), verdict


def test_a_leg_that_is_not_the_probe_leaving_does_not_free_it() -> None:
    lifecycle, clock, _ = build(n_decode=1)
    s = lifecycle.arrive("s", max_tokens=40, prompt_tokens=100)
    admitted(lifecycle, s)
    lifecycle.prefill_done(s, "ok")
    lifecycle.first_token(s)  # streaming on e2 while its breaker was closed
    d = _half_open(lifecycle, clock, "e2")
    a = lifecycle.arrive("a", max_tokens=40, prompt_tokens=100)
    assert admitted(lifecycle, a).decode == "e2" and a.decode_probe
    lifecycle.cancel(s)  # its client leaves: s was never the probe
    assert d.breaker.probe_in_flight
    b = lifecycle.arrive("b", max_tokens=40, prompt_tokens=100)
    verdict = lifecycle.admit(b)
    assert not (isinstance(verdict, Admit) and b.decode_probe), verdict


def test_a_hedge_may_keep_the_half_open_decode_engine_its_ticket_probes() -> None:
    lifecycle, clock, _ = build(n_decode=1)
    _half_open(lifecycle, clock, "e2")
    ticket = lifecycle.arrive("t", max_tokens=4, prompt_tokens=100)
    admitted(lifecycle, ticket)
    assert ticket.decode_probe
    hedge = lifecycle.hedge_prefill(ticket, budget_left_s=1.5)
    assert isinstance(hedge, Pair) and hedge.decode == "e2", hedge
    assert ticket.decode_probe


@pytest.mark.parametrize("ends", ["refused", "cancelled"])
def test_a_prefill_leg_that_is_not_the_probe_leaving_does_not_free_it(ends: str) -> None:
    """From a review: a prefill leg sent before its engine's breaker opened, refused (a 4xx)
    or cancelled after it went half-open, freed the probe another request held, and a second
    leg was let through to an engine that may fail everything it runs. Decode legs had this
    already (``decode_probe``)."""
    lifecycle, clock, _ = build(n_prefill=1, n_decode=1)
    early = lifecycle.arrive("early", max_tokens=4, prompt_tokens=100)
    assert admitted(lifecycle, early).prefill == "e0"
    p = _half_open(lifecycle, clock, "e0")
    probe = lifecycle.arrive("probe", max_tokens=4, prompt_tokens=100)
    assert admitted(lifecycle, probe).prefill == "e0" and p.breaker.probe_in_flight
    if ends == "refused":
        lifecycle.prefill_done(early, "refused")
    else:
        lifecycle.cancel(early)
    assert p.breaker.state is BreakerState.HALF_OPEN and p.breaker.probe_in_flight
    assert not p.breaker.allows_request()  # still the probe's
    # The probe's own refusal frees it for the next leg.
    lifecycle.prefill_done(probe, "refused")
    assert p.breaker.allows_request()


def test_a_continuation_is_rescued_once() -> None:
    """From a review: ``migrate``'s own rescue and the router's after the continuation's legs
    failed were each "once", so a continuation could be rescued twice. Once a ticket."""
    lifecycle, _, _ = build(n_prefill=2, n_decode=1)
    ticket = lifecycle.arrive("r-m1", max_tokens=4, prompt_tokens=100)
    pick = lifecycle.rescue(ticket)
    assert pick is not None and pick.local and ticket.rescued
    lifecycle.decode_failed(ticket, "failed")  # the rescue's local leg failed
    assert lifecycle.rescue(ticket) is None
