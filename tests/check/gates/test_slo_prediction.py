"""The slo gate's analytic load model: Erlang C, the Poisson tail, allocations."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.check.gates.slo_prediction import (
    Allocation,
    LoadPoint,
    allocations,
    erlang_c,
    poisson_cdf,
    predict_point,
)
from narwhal.profiles.store import engine_models
from tests.check.support import KIMI, fleet_doc, loaded, make_store


def test_erlang_c_and_poisson_tail() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert poisson_cdf(0, 2.0) == pytest.approx(0.1353352832)
    assert poisson_cdf(100, 2.0) == pytest.approx(1.0)
    assert poisson_cdf(-1, 2.0) == 0.0


def test_qualification_run_plan_is_predicted_reachable_and_overload_is_not() -> None:
    models = engine_models(make_store({f"e{i}": KIMI for i in range(4)})[0])
    alloc = Allocation(("e0", "e1"), ("e2", "e3"))

    def at(rate: float) -> Any:
        return predict_point(alloc, models, LoadPoint(rate, 8192, 128, 10.0, 0.3, 180.0), 5.3)

    for rate in (0.5, 1.0):
        pred = at(rate)
        assert pred.attainment > 0.95, pred
        assert 0.24 < (pred.tpot_s or 0) < 0.3
    overload = at(3.0)  # 3 x 0.92 s of prefill per second on two engines
    assert overload.attainment == 0.0 and "unstable" in overload.limits[0]


def test_allocations_respect_roles_and_minimums() -> None:
    doc = fleet_doc(3, roles=[["prefill"], ["prefill", "decode"], ["decode"]])
    fleet = loaded(doc).contract
    splits = allocations(fleet)
    assert splits[0] == Allocation(("e0",), ("e1", "e2"))
    assert Allocation(("e0", "e1"), ("e2",)) in splits and len(splits) == 2
