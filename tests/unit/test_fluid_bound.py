"""``narwhal.testing.fluid_bound``: the fluid bound's arithmetic, against closed forms and
against every subset of a small workload."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.fleetsim.simulator import DesConfig, RequestSpec, run_des
from narwhal.fleetsim.workloads import synthetic_fleet
from narwhal.simengine.timing import CALIBRATION
from narwhal.testing.fluid_bound import FluidFleet, Window, decode_batch, prefill_seconds
from narwhal.testing.traces import trace_dir


def test_meeting_every_request_is_the_closed_form() -> None:
    fleet = FluidFleet((1.0,) * 4, (2.0,) * 4)
    # Fluid: 8 engines, 3 engine-seconds a request: 8/3 req/s, a third of them prefilling.
    rate, prefill = fleet.fractional(8)
    assert rate == pytest.approx(8 / 3, rel=2e-3) and prefill == pytest.approx(8 / 3, rel=2e-3)
    # Whole engines: 3P/5D carries min(3 / 1, 5 / 2) = 2.5, the best split.
    assert fleet.at_split(3, 5) == pytest.approx(2.5, rel=1e-4)
    assert fleet.at_split(2, 6) == pytest.approx(2.0, rel=1e-4)
    assert fleet.static(8) == (pytest.approx(2.5, rel=1e-4), 3)


def test_a_target_below_one_misses_the_costliest_requests() -> None:
    # 19 cheap requests and one that costs as much as all of them: meeting 95% of 20 (19),
    # the bound drops the costly one and carries twice the rate.
    prefill = (1.0,) * 19 + (19.0,)
    decode = (0.0,) * 20
    every, most = FluidFleet(prefill, decode), FluidFleet(prefill, decode, 0.95)
    assert most.kept == 19 and every.kept == 20
    assert every.fractional(4)[0] == pytest.approx(4 * 20 / 38, rel=1e-3)
    assert most.fractional(4)[0] == pytest.approx(4 * 20 / 19, rel=1e-3)
    assert most.at_split(3, 1) == pytest.approx(3 * 20 / 19, rel=1e-4)


def test_kept_rounds_up() -> None:
    assert FluidFleet((1.0,) * 10, (1.0,) * 10, 0.95).kept == 10  # 9.5 requests: 10
    assert FluidFleet((1.0,) * 100, (1.0,) * 100, 0.95).kept == 95


def test_a_split_s_bound_is_the_min_max_over_every_subset_it_may_keep() -> None:
    """Brute force over every kept subset of small random workloads: the bound is at least the
    best integer choice (requests taken as divisible only raise it) and, where an integer
    choice is optimal for the relaxation too, equal to it within the search's precision."""
    rng = random.Random(7)
    for _ in range(30):
        n = rng.randint(4, 9)
        prefill = tuple(rng.uniform(0.05, 2.0) for _ in range(n))
        decode = tuple(rng.uniform(0.05, 2.0) for _ in range(n))
        share = rng.choice((0.6, 0.75, 0.9, 1.0))
        fleet = FluidFleet(prefill, decode, share)
        for p_engines, d_engines in ((1, 1), (2, 3), (3, 1)):
            best = max(
                n / max(sum(prefill[i] for i in keep) / p_engines,
                        sum(decode[i] for i in keep) / d_engines)
                for keep in itertools.combinations(range(n), fleet.kept)
            )  # fmt: skip
            bound = fleet.at_split(p_engines, d_engines)
            assert bound >= best * (1 - 1e-4)
            # The relaxation's optimum keeps at most two requests in part (two constraints):
            # never above the best integer choice by more than their share.
            assert bound <= best * (1 + 2 / fleet.kept) * (1 + 1e-4)


def test_beyond_64_engines_the_walk_finds_the_best_split() -> None:
    # Beyond 64 engines ``static`` walks out from the fractional optimum instead of trying
    # every split: on a workload whose rate rises then falls with the prefill share, it finds
    # what trying every split finds.
    rng = random.Random(3)
    prefill = tuple(rng.uniform(0.1, 1.0) for _ in range(200))
    decode = tuple(rng.uniform(0.1, 3.0) for _ in range(200))
    fleet = FluidFleet(prefill, decode, 0.95)
    engines = 80
    every = max((fleet.at_split(n, engines - n), n) for n in range(1, engines))
    rate, n = fleet.static(engines)
    assert rate == pytest.approx(every[0]) and n == every[1]
    assert rate <= fleet.fractional(engines)[0] * (1 + 1e-4)


def test_a_rate_that_fits_again_above_the_bisection_s_is_found() -> None:
    class Islands(FluidFleet):
        # Fits up to 4 and again from 4.3 to 4.45 (the shape a window's drain can give).
        def _fits(self, rate: float, prefill_engines: float, decode_engines: float) -> bool:
            return rate <= 4.0 or 4.3 <= rate <= 4.45

    bound = Islands((1.0,), (1.0,)).at_split(1, 1)
    assert bound == pytest.approx(4.45, rel=1e-4)


def test_no_schedule_in_the_simulator_passes_it() -> None:
    """The simulator's own schedules against the bound, on the workload a review found to
    beat an earlier version (decode charged at a batch rounded down): 1 prefill and 1 decode
    engine, 3,000 evenly spaced requests of 100 prompt and 200 output tokens. Offered 0.3% above
    the bound meeting every request, round robin does not meet them all; offered 0.3% above the
    bound at 95%, it does not meet 95%."""
    fleet, timings = synthetic_fleet(1, 1, {"ttft_s": 10.0, "tpot_s": 0.3})
    window = Window([(float(i), 100, 0, 200) for i in range(3000)])
    for share in (1.0, 0.95):
        bound = FluidFleet.of([window], CALIBRATION.prefill, CALIBRATION.decode, 10.0, 0.3, share)[
            0
        ].at_split(1, 1)
        rate = bound * 1.003
        config = DesConfig(fleet, timings, scheduler="round_robin", flipping=False)
        result = run_des(config, [RequestSpec(i / rate, 100, 200) for i in range(3000)])
        assert result.attainment < share, (share, bound, result.attainment)


def test_prefill_charges_only_the_uncached_tokens_and_a_full_step_s_share_of_its_cost() -> None:
    model = CALIBRATION.prefill
    n = model.max_tokens
    # Full chunks pay the step's fixed cost whole: two steps.
    assert prefill_seconds(model, 2 * n) == pytest.approx(
        model.chunk_seconds(0, n) + model.chunk_seconds(n, n)
    )
    assert prefill_seconds(model, 2 * n, n) == pytest.approx(model.chunk_seconds(n, n))
    # A short tail shares its step with others: its tokens' share of the fixed cost only
    # (the simulator charges it once per step, whatever the step packs).
    tail = prefill_seconds(model, 100, 99)
    assert tail == pytest.approx(model.chunk_seconds(99, 1) - model.a + model.a / n)
    assert tail < model.chunk_seconds(99, 1)


def test_decode_is_charged_at_the_batch_whose_step_is_the_budget() -> None:
    model = CALIBRATION.decode
    batch = decode_batch(model, 1000, 0.3)
    assert model.seconds_per_token(batch, 1000) == pytest.approx(0.3)
    assert 39 < batch < 40  # not rounded down: batches of 39 and 40 in turn average to it
    # At the shortest prompt's context (no batch's mean is below it), not the mean.
    window = Window([(0.0, 1000, 0, 300), (1.0, 30_000, 0, 300)])
    fleet, charged = FluidFleet.of([window], CALIBRATION.prefill, model, 10.0, 0.3)
    assert charged == pytest.approx(batch)
    # Tokens after the first at the budget's pace; the first at the least a token costs.
    assert list(fleet.decode_s) == [pytest.approx(299 * 0.3 / batch + model.slope)] * 2


def test_a_window_s_drain_counts() -> None:
    """A window of 100 full-chunk prompts (0.92 s of prefill each) with one-token answers,
    arriving evenly over 100 / r seconds (a gap g = 100 / 99 / r): 4 prefill engines work
    from the first arrival to the last, then for the TTFT budget on what is still due, all
    four while four or more prompts are, so 10 s less the last three's stagger (6 g engine-
    seconds): 100 x 0.92 = 4 x 100 / r + 40 - 6 g. The steady state (no drain) carries
    100 / 23 (4 / 0.92)."""
    n, p = 100, CALIBRATION.prefill.chunk_seconds(0, 8192)
    window = Window([(float(t), 8192, 0, 1) for t in range(n)])
    fleet, _ = FluidFleet.of([window], CALIBRATION.prefill, CALIBRATION.decode, 10.0, 0.3)
    drained = (4 * n - 6 * n / (n - 1)) / (n * p - 40)
    assert fleet.at_split(4, 4) == pytest.approx(drained, rel=1e-4)
    steady = FluidFleet(fleet.prefill_s, fleet.decode_s)
    assert steady.at_split(4, 4) == pytest.approx(n / (n * p / 4), rel=1e-4)
    # Two such windows: each drains, the time of both counts.
    fleet, _ = FluidFleet.of([window, window], CALIBRATION.prefill, CALIBRATION.decode, 10.0, 0.3)
    assert fleet.at_split(4, 4) == pytest.approx(drained, rel=1e-4)


def test_the_drain_is_bounded_by_what_the_requests_allow() -> None:
    # All but the last at one instant, the last later (at 100 / r). After the last arrival
    # only what its own TTFT budget allows may still run: its prefill, on one engine, not the
    # budget's 10 s of the engine (the others were due long before).
    p = CALIBRATION.prefill.chunk_seconds(0, 8192)
    window = Window([(0.0, 8192, 0, 1)] * 99 + [(1.0, 8192, 0, 1)])
    fleet, _ = FluidFleet.of([window], CALIBRATION.prefill, CALIBRATION.decode, 10.0, 0.3)
    rate = fleet.at_split(1, 1)
    assert math.isfinite(rate)
    # Ten such prompts fit one engine's TTFT budget after they all arrive: any rate does.
    few = Window([(0.0, 8192, 0, 1)] * 9 + [(1.0, 8192, 0, 1)])
    fleet, _ = FluidFleet.of([few], CALIBRATION.prefill, CALIBRATION.decode, 10.0, 0.3)
    assert fleet.at_split(1, 1) == math.inf
    assert rate == pytest.approx(100 / (99 * p), rel=1e-4)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (((), ()), "one cost each per request"),
        (((1.0,), (1.0, 2.0)), "one cost each per request"),
        (((1.0,), (1.0,), 0.0), "met_share: a share above 0 and at most 1, got 0.0"),
        (((1.0,), (1.0,), 1.5), "met_share: a share above 0 and at most 1, got 1.5"),
    ],
)
def test_workloads_it_cannot_bound_are_named(args: tuple, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        FluidFleet(*args)
    with pytest.raises(ValueError, match="a split needs engines of each role"):
        FluidFleet((1.0,), (1.0,)).at_split(0, 2)
    with pytest.raises(ValueError, match="windows: at least one, none empty"):
        FluidFleet.of([Window([])], CALIBRATION.prefill, CALIBRATION.decode, 10.0, 0.3)
    with pytest.raises(ValueError, match="arrivals must span some time"):
        instant = Window([(0.0, 10, 0, 1)] * 3)
        FluidFleet.of([instant], CALIBRATION.prefill, CALIBRATION.decode, 10.0, 0.3)


BENCH = Path(__file__).resolve().parents[2] / "bench"
AZURE = trace_dir("azure-llm-2023", BENCH.parent)


def bound_lines(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(BENCH / "policies_des.py"), "--bound-only", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_policies_des_prints_the_bound_of_the_fixed_shape() -> None:
    # 8,192-token prompts, 128-token answers: every request alike; the half split is the best
    # of whole engines.
    out = bound_lines("--sizes", "8", "--workloads", "fixed")
    assert (
        "fluid_bound_fixed_8: 4.751 req/s at 4P/4D (95% met, the costliest missed; 4.503 meeting"
        " every request), 4.751 at the best split of whole engines (4P/4D)"
    ) in out, out
    assert "goodput_rps" not in out  # nothing simulated


@pytest.mark.slow
@pytest.mark.skipif(not AZURE.exists(), reason="the Azure traces are not present")
def test_policies_des_prints_the_bounds_docs_routing_quotes() -> None:
    out = bound_lines("--sizes", "8", "--workloads", "code,conv")
    for line in (
        "fluid_bound_code_8: 26.817 req/s at 4P/4D (95% met, the costliest missed; 20.992",
        "fluid_bound_conv_8: 3.636 req/s at 4P/4D (95% met, the costliest missed; 2.993",
    ):
        assert line in out, out


def test_policies_des_bounds_the_best_of_the_splits_it_runs() -> None:
    # With several splits each system runs at its best, so the bound beside them is the best
    # of those splits, named as such; the fixed shape's best whole split is the half.
    out = bound_lines("--sizes", "8", "--workloads", "fixed", "--splits", "0.25,0.5")
    assert (
        "fluid_bound_fixed_8: 4.751 req/s at 4P/4D, the best of the splits run, (95% met, the"
        " costliest missed; 4.503 meeting every request)"
    ) in out, out
