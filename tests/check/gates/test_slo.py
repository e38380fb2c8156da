"""The slo gate: budgets against a synthetic profile store, and plans judged by the simulator."""

from __future__ import annotations

from narwhal.check.gates.slo import slo_gate
from narwhal.check.plan import BenchmarkPlan
from tests.check.support import KIMI, fleet_doc, loaded, make_store, plan_doc, point


def test_slo_fails_unreachable_budgets_and_bad_plans() -> None:
    doc = fleet_doc(4, ttft_s=1.5, tpot_s=0.25, first_token_timeout_s=1.0)
    lf = loaded(doc)
    store, _ = make_store({f"e{i}": KIMI for i in range(4)})
    out = slo_gate(lf.contract, lf.sha256, store, None, None, 0.1)
    text = "\n".join(out.failures)
    # 8192-token prefill 0.92 s + 1.0 s deadline > 1.5 s; 0.24 s/token leaves 3% of 0.25 s.
    assert "e0: profiled prefill of 8192 tokens (0.920 s) + first-token deadline 1 s" in text
    assert "e2: batch-1 decode 0.2426 s/token" in text and "needs 10% headroom" in text
    assert out.evidence["prompt_basis"].startswith("the longest prompt")

    # The qualification run's plan on its fleet: 8.5 s deadline, 5.3 s median handoff.
    good = loaded(fleet_doc(4, first_token_timeout_s=8.5))
    plan = BenchmarkPlan.model_validate(
        plan_doc(good.sha256, [point("0.5rps", 0.5), point("1rps", 1.0), point("9rps", 9.0)])
    )
    out = slo_gate(good.contract, good.sha256, store, plan, 5.3, 0.1)
    assert len(out.failures) == 1, out.failures
    assert out.failures[0].startswith("plan point '9rps' (9 req/s): predicted attainment")
    assert "simulated" in out.failures[0] and "rejected" in out.failures[0]
    evidence = out.evidence["plan"]
    assert evidence["method"].startswith("virtual-time simulator (narwhal.fleetsim)")
    assert "Erlang-C" in evidence["cross_check"]
    points = evidence["points"]
    for name in ("0.5rps", "1rps"):
        assert points[name]["predicted_attainment"] >= 0.95, points[name]
        assert points[name]["analytic"]["predicted_attainment"] > 0.95
        assert len(points[name]["simulated"]["attainment_per_replay"]) == 5
        assert points[name]["simulated"]["offered"] == 5 * 200
    assert points["9rps"]["analytic"]["predicted_attainment"] == 0.0
    other = slo_gate(good.contract, "f" * 64, store, plan, 5.3, 0.1)
    assert any("the plan was written for fleet sha256" in f for f in other.failures)


def test_simulated_plan_counts_the_first_token_deadline() -> None:
    # The analytic model cannot see the deadline; the simulator does: with the packaged 2.5 s
    # deadline, 5.3 s handoffs miss it and nothing meets the SLO.
    store, _ = make_store({f"e{i}": KIMI for i in range(4)})
    packaged = loaded(fleet_doc(4, first_token_timeout_s=2.5))
    plan = BenchmarkPlan.model_validate(plan_doc(packaged.sha256, [point("0.5rps", 0.5)]))
    out = slo_gate(packaged.contract, packaged.sha256, store, plan, 5.3, 0.1)
    row = out.evidence["plan"]["points"]["0.5rps"]
    assert row["simulated"]["deadline_missed"] > 0 and row["predicted_attainment"] < 0.5
    assert row["analytic"]["predicted_attainment"] > 0.95
    assert out.failures and "past the deadline" in out.failures[0]
