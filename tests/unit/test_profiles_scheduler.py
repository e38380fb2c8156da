"""Latency models, the predictor's online correction, and scheduler v1, on a virtual clock."""

from __future__ import annotations

import math

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import Budgets, parse_fleet
from narwhal.profiles.models import (
    DecodeLatencyModel,
    PrefillLatencyModel,
    fit_decode,
    fit_prefill,
    nonnegative_least_squares,
)
from narwhal.profiles.store import EngineModels
from narwhal.routing.fleet_state import JOIN_RATE_S, DecodeJoins, FleetState
from narwhal.routing.predictor import LatencyPredictor, RatioEwma
from narwhal.routing.prompt_length import PromptLengthEstimator
from narwhal.routing.scheduler import NoPair, Pair, RequestShape, SchedulerV1
from narwhal.simengine.fleet import local_fleet_document

# --- models -------------------------------------------------------------------------------


def test_prefill_fit_recovers_parameters_and_quality() -> None:
    lens = [256, 1024, 4096, 8192] * 3
    secs = [0.02 + 1e-4 * n + 1.2e-9 * n * n for n in lens]
    m = fit_prefill(lens, secs)
    assert m.a == pytest.approx(0.02, rel=1e-6)
    assert m.b == pytest.approx(1e-4, rel=1e-6)
    assert m.c == pytest.approx(1.2e-9, rel=1e-6)
    assert m.quality is not None and m.quality.r2 > 0.999999 and m.quality.samples == 12


def test_prefill_fit_is_non_decreasing_even_on_noisy_data() -> None:
    # A fit without constraints would bend down here (negative quadratic term).
    lens = [100, 2000, 4000, 8000]
    secs = [0.05, 0.40, 0.60, 0.61]
    m = fit_prefill(lens, secs)
    assert min(m.a, m.b, m.c) >= 0
    values = [m.seconds(n) for n in range(0, 16000, 500)]
    assert values == sorted(values)


def test_nnls_matches_unconstrained_when_feasible() -> None:
    import numpy as np

    x = np.array([[1, 0], [1, 1], [1, 2]], dtype=float)
    assert nonnegative_least_squares(x, np.array([1.0, 2.0, 3.0])) == pytest.approx([1, 1])
    # The best unconstrained slope is negative: clamp it to 0 and refit the intercept.
    assert nonnegative_least_squares(x, np.array([3.0, 2.0, 1.0])) == pytest.approx([2, 0])


def test_decode_fit_recovers_parameters() -> None:
    batches = [1, 2, 4] * 3
    contexts = [512] * 3 + [4096] * 3 + [8192] * 3
    secs = [0.24 + 0.0015 * b + 1.3e-7 * c for b, c in zip(batches, contexts, strict=True)]
    m = fit_decode(batches, contexts, secs)
    assert (m.intercept, m.slope, m.ctx_coef) == pytest.approx((0.24, 0.0015, 1.3e-7), rel=1e-6)


def test_predictions_flag_and_clamp_far_extrapolation() -> None:
    m = PrefillLatencyModel(0.0, 1e-4, 0.0, 256, 8192, max_extrapolation=2.0)
    inside = m.predict(4096)
    assert not inside.extrapolated and inside.seconds == pytest.approx(0.4096)
    near = m.predict(12000)
    assert near.extrapolated and not near.clamped and near.seconds == pytest.approx(1.2)
    far = m.predict(100000)
    assert far.extrapolated and far.clamped and far.seconds == pytest.approx(100000 * 1e-4)
    curved = PrefillLatencyModel(0.0, 0.0, 1e-8, 256, 1000, max_extrapolation=2.0)
    # Beyond 2000 tokens the quadratic is replaced by its tangent at 2000: 0.04 + 4e-5 * 1000.
    assert curved.predict(3000).seconds == pytest.approx(0.04 + 4e-5 * 1000)
    assert curved.predict(3000).seconds < curved.seconds(3000)
    d = DecodeLatencyModel(0.1, 0.01, 0.0, 4, 8192)
    assert d.predict(2, 1000).extrapolated is False
    assert d.predict(6, 1000).extrapolated is True
    assert d.predict(100, 1000).clamped is True
    assert d.predict(100, 1000).seconds == pytest.approx(0.1 + 0.01 * 100)


def test_fit_needs_enough_samples() -> None:
    with pytest.raises(ValueError):
        fit_prefill([256, 256], [0.1, 0.1])
    with pytest.raises(ValueError):
        fit_decode([], [], [])


# --- predictor ----------------------------------------------------------------------------


def models(intercept: float = 0.04, slope: float = 0.002) -> EngineModels:
    return EngineModels(
        prefill=PrefillLatencyModel(0.01, 1e-4, 0.0, 128, 8192),
        decode=DecodeLatencyModel(intercept, slope, 0.0, 8, 8192),
        generation="g",
    )


def test_online_correction_converges_and_flags_drift() -> None:
    p = LatencyPredictor({"e0": models()}, alpha=0.5, drift_band=(0.67, 1.5))
    base = p.prefill("e0", 1000).seconds
    assert base == pytest.approx(0.11)
    for _ in range(8):
        predicted = p.prefill("e0", 1000).seconds
        p.observe("e0", "prefill", predicted, 2 * base)  # the engine runs twice as slow
    assert p.ratio("e0", "prefill") == pytest.approx(2.0, rel=0.01)
    assert p.prefill("e0", 1000).seconds == pytest.approx(2 * base, rel=0.01)
    assert p.drifted("e0", "prefill") and not p.drifted("e0", "decode")


def test_the_learnt_line_separates_a_fixed_wait_from_a_scale() -> None:
    """Legs that each wait 0.3 s for a step boundary and then run at 0.9x the model: one ratio
    reads a short leg as 4x slow and a long one as 0.93x; the line is exact for both."""
    ewma = RatioEwma(0.2)
    for predicted in [0.1, 2.0, 0.5, 8.0, 1.0, 4.0] * 4:
        ewma.update(0.3 + 0.9 * predicted, predicted)
    offset, scale = ewma.line
    assert offset == pytest.approx(0.3, rel=1e-6) and scale == pytest.approx(0.9, rel=1e-6)
    # The ratio itself (drift, metrics) is unchanged: observed over predicted.
    assert ewma.value == pytest.approx(ewma.observed / ewma.predicted)


def test_the_line_falls_back_to_the_ratio_without_spread_or_with_a_negative_offset() -> None:
    same = RatioEwma(0.2)
    for _ in range(10):
        same.update(1.5, 1.0)  # every leg alike: a slope cannot be told from an offset
    assert same.line == (0.0, pytest.approx(1.5))
    few = RatioEwma(0.2)
    for predicted in (0.1, 8.0, 1.0):
        few.update(2 * predicted, predicted)
    assert few.line == (0.0, pytest.approx(2.0))  # too few samples
    negative = RatioEwma(0.2)
    for predicted in [0.5, 2.0, 4.0, 8.0] * 3:
        negative.update(max(0.01, 1.2 * predicted - 0.4), predicted)
    assert negative.line[0] == 0.0 and negative.line[1] == pytest.approx(negative.value)


def test_correction_ignores_absurd_samples() -> None:
    p = LatencyPredictor({"e0": models()}, alpha=1.0, ratio_bounds=(0.25, 8.0))
    p.observe("e0", "decode", 0.05, 500.0)
    assert p.ratio("e0", "decode") == 8.0


def test_handoff_is_learnt_per_decode_engine() -> None:
    p = LatencyPredictor({"e0": models()}, alpha=1.0, default_transfer_s=0.02)
    assert p.transfer_s("e1") == 0.02
    p.observe_handoff("e1", first_token_s=0.30, first_step_s=0.05)
    assert p.transfer_s("e1") == pytest.approx(0.25)


def test_prompt_length_estimate_learns_bytes_per_token() -> None:
    est = PromptLengthEstimator(bytes_per_token=4.0, alpha=0.5)
    assert est.estimate(400) == 100
    for _ in range(10):
        est.observe(600, 100)  # this model's tokenizer: 6 bytes per token
    assert est.estimate(600) == pytest.approx(100, abs=2)


# --- scheduler v1 -------------------------------------------------------------------------


def fleet_state(clock: VirtualClock, n: int = 4) -> FleetState:
    doc = local_fleet_document(
        list(range(9000, 9000 + n)),
        list(range(9100, 9100 + n)),
        ttft_s=2.0,
        tpot_s=0.1,
        first_token_timeout_s=1.0,
    )
    state = FleetState(parse_fleet(doc, "t").contract, clock)
    for e in state.engines.values():
        e.healthy = True
    return state


def scheduler(**per_engine: EngineModels) -> SchedulerV1:
    engines = {f"e{i}": models() for i in range(4)}
    engines.update(per_engine)
    return SchedulerV1(
        LatencyPredictor(engines, default_transfer_s=0.02),
        Budgets(ttft_s=2.0, tpot_s=0.1, attainment=0.95),
    )


def test_hand_computed_pair_choice() -> None:
    clock = VirtualClock(50.0)
    state = fleet_state(clock)
    sched = scheduler(e3=models(intercept=0.08))  # e3 decodes slower
    # e0 has 0.5 s of prefill queued since t=50; e1 has nothing.
    state.engines["e0"].prefill_work["r1"] = (0.5, 50.0)
    shape = RequestShape(prompt_tokens=1000, max_tokens=100)
    pick = sched.pick(state, shape)
    assert isinstance(pick, Pair)
    assert (pick.prefill, pick.decode) == ("e1", "e2")
    # prefill 0.01 + 0.1 = 0.11; TPOT at batch 1 = 0.042; TTFT = 0.11 + 0.02 + 0.042.
    assert pick.predicted_prefill_s == pytest.approx(0.11)
    assert pick.predicted_tpot_s == pytest.approx(0.042)
    assert pick.predicted_ttft_s == pytest.approx(0.172)
    # slack = min((2 - 0.172)/2, (0.1 - 0.042)/0.1) = min(0.914, 0.58)
    assert pick.score == pytest.approx(0.58)
    clock.advance(0.4)  # e0's queue drains with time
    assert state.engines["e0"].queued_prefill_s(clock.now()) == pytest.approx(0.1)


def test_batch_growth_moves_work_to_the_slower_engine_only_when_it_pays() -> None:
    clock = VirtualClock(0.0)
    state = fleet_state(clock)
    sched = scheduler(e3=models(intercept=0.06))
    shape = RequestShape(prompt_tokens=500, max_tokens=50)
    assert sched.pick(state, shape).decode == "e2"  # type: ignore[union-attr]
    # e2 at batch 11 predicts 0.04 + 0.002*12 = 0.064 > e3's 0.062 at batch 1.
    state.engines["e2"].in_flight_decode = 11
    assert sched.pick(state, shape).decode == "e3"  # type: ignore[union-attr]


def test_sequences_predicted_to_end_before_the_request_joins_leave_room() -> None:
    """Forty short answers decoding on each decode engine put TPOT over budget now (0.04 +
    0.002 x 41 = 0.122), but a 7,000-token prompt behind a 1 s prefill queue joins in about
    1.75 s, when thirty of them are predicted to be done: it is admitted, at batch 11. One
    past its predicted end still decodes and stays counted."""
    clock = VirtualClock(0.0)
    state = fleet_state(clock)
    sched = scheduler()
    for engine in ("e0", "e1"):
        state.engines[engine].prefill_work["q"] = (1.0, 0.0)
    shape = RequestShape(prompt_tokens=7000, max_tokens=10)
    for engine in ("e2", "e3"):
        d = state.engines[engine]
        d.in_flight_decode = 40
        for i in range(40):
            d.foresee_decode_end(0.5 + (i % 4) * 0.4 if i < 30 else 60.0)
    pick = sched.pick(state, shape)
    assert isinstance(pick, Pair)
    # prefill 1.0 queued + 0.71; handoff 0.02; first step at batch 10 + 1
    assert pick.predicted_tpot_s == pytest.approx(0.04 + 0.002 * 11)
    assert state.engines["e2"].decode_batch_at(0.0, 0.6) == 40 - 8
    clock.advance(2.0)  # all thirty overdue: still decoding, so still counted
    assert state.engines["e2"].decode_batch_at(2.0, 5.0) == 40
    over = sched.pick(state, shape)
    assert isinstance(over, NoPair) and over.over_budget is not None
    # The pick dropped the overdue ends from the search (they stay counted): forgetting one
    # of them when its sequence ends is a no-op, the others' still work.
    d = state.engines["e2"]
    assert d.decode_ends == [60.0] * 10 and d.decode_batch_at(2.0, 5.0) == 40
    d.forget_decode_end(0.5)
    d.forget_decode_end(60.0)
    assert d.decode_ends == [60.0] * 9


def test_over_budget_at_its_join_a_request_is_judged_on_the_batch_it_shares_over_its_life() -> None:
    """Thirty short answers on their way to each decode engine (in their prefill legs, each
    foreseen to decode from 0.5 s to 1.0 s) and five long ones decoding: 35 others at its join
    put TPOT over budget (0.04 + 0.002 x 36 = 0.112), but over the request's own life of 99
    tokens (about 10 s) the short ones share a twentieth of it. Were they long, it is over."""
    clock = VirtualClock(0.0)
    state = fleet_state(clock)
    sched = scheduler()
    shape = RequestShape(prompt_tokens=500, max_tokens=100)

    def load(end: float) -> None:
        for engine in ("e2", "e3"):
            d = state.engines[engine]
            d.in_flight_decode = 5
            d.decode_ends = [100.0] * 5
            d.pending_decode = 30
            d.pending_spans = {f"r{i}": (0.5, end) for i in range(30)}

    load(end=1.0)
    pick = sched.pick(state, shape)
    assert isinstance(pick, Pair)
    # Joins at 0.05 + 0.02 + 0.112 = 0.18 s; 30 x 0.5 s of its 9.8-11 s life: under one more.
    assert pick.predicted_tpot_s is not None
    assert 0.04 + 0.002 * 6 < pick.predicted_tpot_s < 0.04 + 0.002 * 8
    load(end=100.0)
    over = sched.pick(state, shape)
    assert isinstance(over, NoPair) and over.over_budget is not None
    # They join 0.3 s after it does: shared for 97% of its life, still over the budget.
    assert over.over_budget.predicted_tpot_s is not None
    assert 0.1 < over.over_budget.predicted_tpot_s < 0.04 + 0.002 * 36


def test_a_decode_engines_join_rate_is_what_it_sustains() -> None:
    joins = DecodeJoins()
    assert joins.rate(0.0) == 0.0
    for i in range(10):  # ten in the first ten seconds: about one a second, not 10/120
        joins.note(float(i))
    assert joins.rate(10.0) == pytest.approx(1.0, rel=0.1)
    for i in range(10, 1200):  # two a second for twenty minutes
        joins.note(10.0 + (i - 10) / 2)
    now = 10.0 + 1190 / 2
    assert joins.rate(now) == pytest.approx(2.0, rel=0.05)
    assert joins.rate(now + JOIN_RATE_S) == pytest.approx(2.0 / math.e, rel=0.05)  # decays


def test_the_less_loaded_decode_engine_counts_requests_still_in_their_prefill_leg() -> None:
    clock = VirtualClock(0.0)
    state = fleet_state(clock)
    sched = scheduler()
    state.engines["e2"].in_flight_decode = 1
    state.engines["e3"].pending_decode = 3  # three on their way to e3's batch
    pick = sched.pick(state, RequestShape(prompt_tokens=500, max_tokens=50))
    assert isinstance(pick, Pair) and pick.decode == "e2"


def test_the_prefill_choice_stays_within_the_window_of_the_soonest() -> None:
    """Of the prefill engines ready within 5% of the TTFT budget (0.1 s here) of the soonest,
    the less loaded: e1 (0.08 s behind e0, fewer legs), never e2 (0.16 s behind e0, though
    within 0.1 s of e1, and the least loaded): the window is the soonest's."""
    clock = VirtualClock(0.0)
    doc = local_fleet_document(
        list(range(9000, 9006)),
        list(range(9100, 9106)),
        initial_roles=["prefill"] * 3 + ["decode"] * 3,
        ttft_s=2.0,
        tpot_s=0.1,
        first_token_timeout_s=1.0,
    )
    state = FleetState(parse_fleet(doc, "t").contract, clock)
    for e in state.engines.values():
        e.healthy = True
    sched = SchedulerV1(
        LatencyPredictor({f"e{i}": models() for i in range(6)}, default_transfer_s=0.02),
        Budgets(ttft_s=2.0, tpot_s=0.1, attainment=0.95),
    )
    for engine, queued, legs in (("e0", 0.0, 3), ("e1", 0.08, 2), ("e2", 0.16, 1)):
        e = state.engines[engine]
        e.in_flight_prefill = legs
        if queued:
            e.prefill_work["q"] = (queued, 0.0)
    pick = sched.pick(state, RequestShape(prompt_tokens=1000, max_tokens=10))
    assert isinstance(pick, Pair) and pick.prefill == "e1"


def test_over_budget_is_reported_for_admission() -> None:
    clock = VirtualClock(0.0)
    state = fleet_state(clock)
    sched = scheduler()
    state.engines["e2"].in_flight_decode = 40  # TPOT 0.04 + 0.002*41 = 0.122 > 0.1
    state.engines["e3"].in_flight_decode = 40
    pick = sched.pick(state, RequestShape(prompt_tokens=100, max_tokens=10))
    assert isinstance(pick, NoPair) and pick.over_budget is not None
    assert "predicted to meet the budgets" in pick.reason
    assert pick.over_budget.predicted_tpot_s == pytest.approx(0.122)


def test_elapsed_time_counts_against_ttft() -> None:
    clock = VirtualClock(0.0)
    state = fleet_state(clock)
    sched = scheduler()
    fresh = sched.pick(state, RequestShape(prompt_tokens=8000, max_tokens=10))
    assert isinstance(fresh, Pair)
    late = sched.pick(state, RequestShape(prompt_tokens=8000, max_tokens=10, elapsed_s=1.9))
    assert isinstance(late, NoPair) and late.over_budget is not None


def test_v1_respects_roles_health_exclusions_and_permissions() -> None:
    clock = VirtualClock(0.0)
    state = fleet_state(clock)
    sched = scheduler()
    state.engines["e2"].healthy = False
    assert sched.pick(state).decode == "e3"  # type: ignore[union-attr]
    assert sched.pick(state, exclude_decode={"e3"}) == NoPair(
        "no available engine in the decode role"
    )
    state.engines["e2"].healthy = True
    pick = sched.pick(state, exclude_prefill={"e0"})
    assert isinstance(pick, Pair) and pick.prefill == "e1"


# --- local prefill ------------------------------------------------------------------------


def local_state(clock: VirtualClock, enabled: bool = True, max_prompt_tokens: int = 500):
    doc = local_fleet_document(
        list(range(9000, 9004)),
        list(range(9100, 9104)),
        ttft_s=2.0,
        tpot_s=0.1,
        first_token_timeout_s=1.0,
        routing={"local_prefill": {"enabled": enabled, "max_prompt_tokens": max_prompt_tokens}},
    )
    state = FleetState(parse_fleet(doc, "t").contract, clock)
    for e in state.engines.values():
        e.healthy = True
    return state


def test_local_prefill_hand_computed_on_an_idle_fleet() -> None:
    clock = VirtualClock(0.0)
    state = local_state(clock)
    sched = scheduler()
    shape = RequestShape(prompt_tokens=200, max_tokens=11)
    pick = sched.pick(state, shape)
    # Handoff: prefill 0.01 + 0.02 = 0.03, + transfer 0.02 + first step at batch 1 (0.042)
    # = 0.092. Local on an idle decode engine: no step in progress, and the first token comes
    # with the prefill itself: 0.03.
    assert isinstance(pick, Pair) and pick.local
    assert (pick.prefill, pick.decode) == ("e2", "e2")
    assert pick.predicted_prefill_s == pytest.approx(0.03)
    assert pick.predicted_ttft_s == pytest.approx(0.03)
    assert pick.predicted_tpot_s == pytest.approx(0.042)  # an empty batch: nobody stalls
    assert pick.score == pytest.approx(0.58)  # min((2 - 0.03) / 2, (0.1 - 0.042) / 0.1)


def test_local_prefill_only_when_enabled_short_and_allowed() -> None:
    clock = VirtualClock(0.0)
    long = RequestShape(prompt_tokens=501, max_tokens=11)
    short = RequestShape(prompt_tokens=200, max_tokens=11)
    on = local_state(clock)
    pick = scheduler().pick(on, long)
    assert isinstance(pick, Pair) and not pick.local and pick.prefill in ("e0", "e1")
    off = local_state(clock, enabled=False)
    pick = scheduler().pick(off, short)
    assert isinstance(pick, Pair) and not pick.local
    no_ids = RequestShape(prompt_tokens=200, max_tokens=11, local_ok=False)
    pick = scheduler().pick(on, no_ids)
    assert isinstance(pick, Pair) and not pick.local


def test_local_prefill_weighs_the_step_in_progress_the_queues_and_the_stall() -> None:
    clock = VirtualClock(10.0)
    state = local_state(clock)
    sched = scheduler()
    shape = RequestShape(prompt_tokens=200, max_tokens=11)  # 10 tokens after the first
    for d in ("e2", "e3"):
        state.engines[d].in_flight_decode = 4  # TPOT at batch 5: 0.04 + 0.002 * 5 = 0.05
    # Local: half a step 0.025 + prefill 0.03 + step 0.05 = 0.105; handoff 0.03 + 0.02 + 0.05
    # = 0.1 is faster: no local prefill.
    pick = sched.pick(state, shape)
    assert isinstance(pick, Pair) and not pick.local
    assert pick.predicted_ttft_s == pytest.approx(0.1)
    # Queued prefills on both prefill engines make the handoff slower (1.1 s): local wins, and
    # its TPOT carries its own stall of the batch spread over 10 tokens: 0.05 + 0.03 / 10.
    for p in ("e0", "e1"):
        state.engines[p].prefill_work["q"] = (1.0, 10.0)
    pick = sched.pick(state, shape)
    assert isinstance(pick, Pair) and pick.local and pick.decode == "e2"
    assert pick.predicted_ttft_s == pytest.approx(0.105)
    assert pick.predicted_tpot_s == pytest.approx(0.053)
    assert pick.score == pytest.approx(0.47)
    # A local prefill still queued on e2 delays the next one there by its 0.2 s.
    state.engines["e2"].prefill_work["l1"] = (0.2, 10.0)
    pick = sched.pick(state, shape, exclude_decode={"e3"})
    assert isinstance(pick, Pair) and pick.local and pick.decode == "e2"
    assert pick.predicted_ttft_s == pytest.approx(0.305)
    del state.engines["e2"].prefill_work["l1"]
    # Local prefills sent in the last 10 tokens x 0.05 s = 0.5 s stall the batch again, and any
    # sequence there: 0.49 s of them over 10 tokens puts a handoff's TPOT at 0.099, and with
    # this one's 0.03 a local pick's at 0.102 > 0.1: handoff after all.
    for d in ("e2", "e3"):
        state.engines[d].note_local_prefill(10.0, 0.49)
    pick = sched.pick(state, shape)
    assert isinstance(pick, Pair) and not pick.local
    assert pick.predicted_ttft_s == pytest.approx(1.1)  # the stall is no part of the first step
    assert pick.predicted_tpot_s == pytest.approx(0.099)
    # 0.6 s later those stalls are behind the horizon, but the prefill queues are 0.6 s shorter
    # too: a handoff (TTFT 0.5 s, slack min(0.75, 0.5) = 0.5) now leaves more slack than a local
    # prefill that would stall the batch (0.47), so local loses although faster (0.105 s).
    clock.advance(0.6)
    pick = sched.pick(state, shape)
    assert isinstance(pick, Pair) and not pick.local
    assert pick.score == pytest.approx(0.5) and pick.predicted_ttft_s == pytest.approx(0.5)
    # On an idle engine a local prefill stalls nobody: the same slack as a handoff, and faster.
    state.engines["e3"].in_flight_decode = 0
    pick = sched.pick(state, shape)
    assert isinstance(pick, Pair) and pick.local and pick.decode == "e3"


def test_local_prefill_serves_short_prompts_without_a_prefill_engine() -> None:
    clock = VirtualClock(0.0)
    state = local_state(clock)
    sched = scheduler()
    for p in ("e0", "e1"):
        state.engines[p].healthy = False
    pick = sched.pick(state, RequestShape(prompt_tokens=100, max_tokens=11))
    assert isinstance(pick, Pair) and pick.local
    assert sched.pick(state, RequestShape(prompt_tokens=800, max_tokens=11)) == NoPair(
        "no available engine in the prefill role"
    )


def test_local_prefill_only_within_the_first_token_deadline() -> None:
    clock = VirtualClock(10.0)
    state = local_state(clock)  # first-token deadline 1.0 s
    sched = scheduler()
    shape = RequestShape(prompt_tokens=200, max_tokens=11)
    state.engines["e2"].in_flight_decode = 4
    for p in ("e0", "e1"):
        state.engines[p].prefill_work["q"] = (1.0, 10.0)  # handoff TTFT 1.1 s
    # Local on e2 behind 0.95 s of local prefill: 0.95 + 0.025 + 0.03 + 0.05 = 1.055 s, faster
    # than the handoff and within the TTFT budget, but past the deadline that bounds its leg.
    state.engines["e2"].prefill_work["l1"] = (0.95, 10.0)
    pick = sched.pick(state, shape, exclude_decode={"e3"})
    assert isinstance(pick, Pair) and not pick.local
    assert pick.predicted_ttft_s == pytest.approx(1.1)
    state.engines["e2"].prefill_work["l1"] = (0.85, 10.0)  # 0.955 s: within it
    pick = sched.pick(state, shape, exclude_decode={"e3"})
    assert isinstance(pick, Pair) and pick.local
    assert pick.predicted_ttft_s == pytest.approx(0.955)
