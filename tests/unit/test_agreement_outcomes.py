"""The live side of the simulator's agreement check: each request's outcome as the router's
journal records it (``narwhal.fleetsim.agreement.router_outcomes``), and the comparison's
account of failures."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.contract.models import Budgets
from narwhal.fleetsim.agreement import Agreement, LiveOutcome, compare, router_outcomes
from narwhal.fleetsim.simulator import DesResult


def _end(i: int, **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "type": "request.end",
        "id": f"r{i}",
        "client_request_id": f"run-{i}",
        "outcome": "ok",
        "status": 200,
        "completion_tokens": 5,
        "t_first_token": 0.5,
        "t_last_token": 0.9,
    }
    record.update(fields)
    return record


def _simulated(ttft: list[float], rejected: int = 0) -> DesResult:
    """A simulator result whose answered requests all met their budgets (TPOT 0.1 s)."""
    return DesResult(
        offered=len(ttft) + rejected,
        completed=len(ttft),
        rejected=rejected,
        met_slo=len(ttft),
        deadline_missed=0,
        duration_s=1.0,
        flips=[],
        ttft=ttft,
        tpot=[0.1] * len(ttft),
        utilisation={},
        wall_s=0.0,
    )


def test_outcomes_are_the_routers_timestamps_in_request_order() -> None:
    records = [
        _end(2, t_first_token=1.25, t_last_token=1.25, completion_tokens=1),
        _end(0),
        _end(1, outcome="error", status=503, t_first_token=None, t_last_token=None),
        _end(7, client_request_id="other-3"),  # another run's request: not ours
    ]
    out = router_outcomes(records, 4, "run")
    assert out[0] == LiveOutcome(200, 0.5, pytest.approx(0.1))
    assert out[1] == LiveOutcome(503)
    assert out[2] == LiveOutcome(200, 1.25, None)  # one token: no TPOT
    assert out[3] == LiveOutcome(0)  # never reached the journal


def test_an_ok_record_without_a_first_token_is_a_failure() -> None:
    assert router_outcomes([_end(0, t_first_token=None)], 1, "run") == [LiveOutcome(0)]


def test_compare_names_the_failures_on_both_sides() -> None:
    live = [LiveOutcome(200, 0.5, 0.1), LiveOutcome(503), LiveOutcome(0), LiveOutcome(503)]
    des = _simulated([0.5, 0.6, 0.7], rejected=1)
    agreement = compare(live, des, Budgets(ttft_s=1.0, tpot_s=0.2, attainment=0.9))
    assert agreement.live_failed == 3
    assert agreement.live_attainment == 0.25
    assert agreement.failures() == (
        "live failed 3 (1 x no answer, 2 x 503), simulator rejected 1,"
        " first-token deadline missed 0"
    )


def test_a_request_never_answered_has_an_infinite_ttft_in_the_percentiles() -> None:
    """TTFT percentiles run over the offered requests: rejecting the ones that would have
    waited longest must not shorten a side's tail."""
    budgets = Budgets(ttft_s=10.0, tpot_s=1.0, attainment=0.9)
    answered = [LiveOutcome(200, float(t), 0.1) for t in range(1, 9)]
    live = [*answered, LiveOutcome(429), LiveOutcome(429)]
    des = _simulated([float(t) for t in range(1, 11)])
    agreement = compare(live, des, budgets)
    assert agreement.live_ttft == (5.5, float("inf"))  # 2 of 10 never answered: p90 is one
    assert agreement.des_ttft == (5.5, pytest.approx(9.1))
    rows = {name: diff for name, _, _, diff in agreement.rows()}
    assert rows["ttft_p90_s"] == float("inf") and not agreement.within(0.1)
    assert rows["ttft_p50_s"] == 0.0
    # Both sides as late as can be: they agree.
    assert Agreement.rel(float("inf"), float("inf")) == 0.0
