"""The goodput arithmetic the live and virtual benchmarks share (narwhal.testing.goodput)."""

from __future__ import annotations

import random

import pytest

from narwhal.testing.goodput import (
    RatePoint,
    bootstrap_draws,
    crossing,
    interval,
    paired_ratio,
    search_crossing,
    verdict,
)


def test_crossing_interpolates_between_the_rates_either_side_of_the_target() -> None:
    points = [RatePoint(1.0, (10,), (10,)), RatePoint(2.0, (9,), (10,))]
    # 1.0 attains 1.0, 2.0 attains 0.9: 0.95 is crossed halfway.
    assert crossing(points, 0.95) == pytest.approx(1.5)
    # A resample that counts only the second block of each point.
    two = [RatePoint(1.0, (5, 5), (5, 5)), RatePoint(2.0, (5, 4), (5, 5))]
    assert crossing(two, 0.95, [2, 0]) == 2.0  # every rate met: at least the highest
    assert crossing(two, 0.95, [0, 2]) == pytest.approx(1.25)


def test_search_crossing_brackets_then_bisects_to_the_precision() -> None:
    true_goodput = 3.7

    def measure(rate: float) -> RatePoint:
        met = 100 if rate <= true_goodput else 80
        return RatePoint(rate, (met,), (100,))

    found, points = search_crossing(measure, 1.0, 0.02, 0.95)
    below = max(p.rate for p in points if p.rate <= true_goodput)
    above = min(p.rate for p in points if p.rate > true_goodput)
    assert above / below <= 1.02 * 1.25  # bisected, then the support points around it
    assert below <= found <= above
    assert found == pytest.approx(true_goodput, rel=0.03)


def test_a_coarse_search_reads_its_goodput_over_the_support_rates_as_resamples_do() -> None:
    """At a coarse precision the bracket is wider than the support's 10%: a support rate inside
    it that misses moves the crossing. The goodput was read before them, the resamples after,
    so with one block (the only resample is the data) a goodput lay outside its interval."""

    def measure(rate: float) -> RatePoint:
        met = 100 if rate <= 1.2 else (90 if rate <= 1.4 else 50)
        return RatePoint(rate, (met,), (100,))

    found, points = search_crossing(measure, 1.0, 0.5, 0.95)
    assert found == crossing(points, 0.95) == crossing(points, 0.95, [1])
    assert found <= 1.3


def test_paired_ratio_takes_the_best_other_on_each_resample() -> None:
    goodputs = {"mine": 3.0, "a": 2.0, "b": 1.5}
    # On resample 1, b beats a: the paired ratio divides by b there.
    resampled = {"mine": [3.0, 3.0, 2.0], "a": [2.0, 1.0, 2.0], "b": [1.5, 2.0, 1.0]}
    r = paired_ratio(goodputs, resampled, "mine", ["a", "b"])
    assert r is not None
    assert r.best == "a" and r.best_goodput == 2.0 and r.ratio == pytest.approx(1.5)
    assert (r.low, r.high) == interval([1.5, 1.5, 1.0])
    assert r.verdict == verdict(r.low, r.high) == "within the uncertainty"
    # Unmeasured systems are left out; nothing to compare with gives None.
    assert paired_ratio(goodputs, resampled, "mine", ["a", "zzz"]) is not None
    assert paired_ratio(goodputs, resampled, "mine", ["zzz"]) is None
    assert paired_ratio(goodputs, resampled, "zzz", ["a"]) is None


def test_paired_ratio_calls_a_gain_only_when_its_interval_excludes_one() -> None:
    rng = random.Random(0)
    draws = bootstrap_draws(20, 200, rng)
    mine = [RatePoint(r, tuple([10] * 20 if r <= 2 else [8] * 20), tuple([10] * 20))
            for r in (1.0, 2.0, 3.0)]  # fmt: skip
    other = [RatePoint(r, tuple([10] * 20 if r <= 1 else [8] * 20), tuple([10] * 20))
             for r in (1.0, 2.0, 3.0)]  # fmt: skip
    resampled = {
        "mine": [crossing(mine, 0.95, w) for w in draws],
        "other": [crossing(other, 0.95, w) for w in draws],
    }
    goodputs = {"mine": crossing(mine, 0.95), "other": crossing(other, 0.95)}
    r = paired_ratio(goodputs, resampled, "mine", ["other"])
    assert r is not None and r.verdict == "gain" and r.low > 1
