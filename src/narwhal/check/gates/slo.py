"""The slo gate: the budgets are reachable by the profiled engines, and each point of a
benchmark plan is predicted (``slo_prediction``) to meet its attainment target."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from narwhal.check.gates.common import GateOutcome, outcome, planned_prompt_tokens, rounded
from narwhal.check.gates.slo_prediction import (
    DES_METHOD,
    DES_REPLAYS,
    METHOD,
    LoadPoint,
    allocations,
    best_prediction,
    simulate_point,
)
from narwhal.check.plan import BenchmarkPlan
from narwhal.contract import FleetContract
from narwhal.profiles.store import ProfileStore, engine_models

__all__ = ["slo_gate"]


def slo_gate(
    fleet: FleetContract,
    fleet_sha256: str,
    store: ProfileStore,
    plan: BenchmarkPlan | None,
    handoff_p50_s: float | None,
    tpot_headroom: float,
) -> GateOutcome:
    """The budgets are reachable by the profiled engines: the first-token deadline plus the
    profiled prefill (at the planned prompt length) fits the TTFT budget on every prefill-capable
    engine; the batch-1 decode time leaves ``tpot_headroom`` of the TPOT budget on every
    decode-capable engine; with a plan, each point's attainment as the virtual-time simulator
    replays it (``slo_prediction.simulate_point``) meets its target."""
    failures: list[str] = []
    notes: list[str] = []
    models = engine_models(store)
    budgets, deadline = fleet.budgets, fleet.engine.first_token_timeout_s
    length, length_basis = planned_prompt_tokens(store, plan)
    assert length is not None  # a store is given
    output = plan.workload.output_tokens if plan is not None else store.plan.decode_tokens
    context = length + output / 2
    missing = [e.id for e in fleet.engines if e.id not in models]
    for e in missing:
        failures.append(f"{e}: has no profile in the store: its latency is unknown")
    ttft_rows: dict[str, Any] = {}
    for spec in fleet.prefill_capable():
        if spec.id not in models:
            continue
        pred = models[spec.id].prefill.predict(length)
        left = budgets.ttft_s - deadline - pred.seconds
        ttft_rows[spec.id] = {
            "prefill_s": rounded(pred.seconds),
            "extrapolated": pred.extrapolated,
            "ttft_left_s": rounded(left),
        }
        if pred.extrapolated:
            notes.append(f"{spec.id}: prefill at {length} tokens is extrapolated from the profile")
        if left < 0:
            failures.append(
                f"{spec.id}: profiled prefill of {length} tokens ({pred.seconds:.3f} s) + "
                f"first-token deadline {deadline:g} s = {pred.seconds + deadline:.3f} s exceeds "
                f"the TTFT budget {budgets.ttft_s:g} s"
            )
    tpot_rows: dict[str, Any] = {}
    allowed = budgets.tpot_s * (1 - tpot_headroom)
    for spec in fleet.decode_capable():
        if spec.id not in models:
            continue
        pred = models[spec.id].decode.predict(1, context)
        tpot_rows[spec.id] = {
            "batch1_s_per_token": rounded(pred.seconds),
            "extrapolated": pred.extrapolated,
            "headroom": rounded(1 - pred.seconds / budgets.tpot_s, 4),
        }
        if pred.extrapolated:
            notes.append(
                f"{spec.id}: decode at {context:g} tokens of context is extrapolated from the "
                "profile (profile longer decode inputs to cover it)"
            )
        if pred.seconds > allowed:
            failures.append(
                f"{spec.id}: batch-1 decode {pred.seconds:.4f} s/token at {context:g} tokens of "
                f"context leaves {1 - pred.seconds / budgets.tpot_s:.0%} of the TPOT budget "
                f"{budgets.tpot_s:g} s (needs {tpot_headroom:.0%} headroom)"
            )
    evidence: dict[str, Any] = {
        "prompt_tokens": length,
        "prompt_basis": length_basis,
        "output_tokens": output,
        "budgets": {"ttft_s": budgets.ttft_s, "tpot_s": budgets.tpot_s},
        "first_token_timeout_s": deadline,
        "tpot_headroom": tpot_headroom,
        "ttft": ttft_rows,
        "tpot": tpot_rows,
    }
    if plan is not None:
        evidence["plan"] = _plan_evidence(
            fleet, fleet_sha256, plan, models, handoff_p50_s, failures, missing
        )
    summary = (
        f"deadline + profiled prefill at {length} tokens fits {budgets.ttft_s:g} s; batch-1 "
        f"decode leaves >= {tpot_headroom:.0%} of {budgets.tpot_s:g} s"
    )
    if plan is not None:
        summary += f"; {len(plan.points)} plan points predicted to meet their targets"
    return outcome(summary, failures, notes, evidence)


def _plan_evidence(
    fleet: FleetContract,
    fleet_sha256: str,
    plan: BenchmarkPlan,
    models: Mapping[str, Any],
    handoff_p50_s: float | None,
    failures: list[str],
    missing: list[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "method": METHOD,
        "handoff_basis": (
            f"kv_transfer gate's median first-token latency {handoff_p50_s:.4f} s"
            if handoff_p50_s is not None
            else "no kv_transfer measurement: one batch-1 decode step + 20 ms transfer"
        ),
        "points": {},
    }
    if plan.fleet.sha256 != fleet_sha256:
        failures.append(
            f"the plan was written for fleet sha256 {plan.fleet.sha256[:12]} "
            f"({plan.fleet.path}), not this fleet ({fleet_sha256[:12]})"
        )
    if missing:
        return out
    # The simulator judges every point; the analytic model is reported beside it.
    out["method"] = DES_METHOD
    out["cross_check"] = METHOD
    candidates = allocations(fleet)
    seed = plan.seed if plan.seed is not None else 0
    for index, point in enumerate(plan.points):
        load = LoadPoint(
            rate=point.rate,
            input_tokens=plan.workload.input_tokens,
            output_tokens=plan.workload.output_tokens,
            ttft_s=point.ttft_s,
            tpot_s=point.tpot_s,
            timeout_s=point.timeout_s,
        )
        initial, best = best_prediction(models, candidates, load, handoff_p50_s)
        simulated = simulate_point(fleet, models, load, point.requests, seed + index, handoff_p50_s)
        row: dict[str, Any] = {
            "rate": point.rate,
            "requests": point.requests,
            "target": point.attainment,
            "analytic": best.document(),
            "analytic_initial_allocation": initial.document(),
        }
        predicted = simulated.attainment
        row["simulated"] = {
            **simulated.summary,
            "attainment_per_replay": list(simulated.per_seed),
            "first_seed": seed + index * DES_REPLAYS,
            "transfer_s": rounded(simulated.transfer_s),
            "timed_out": simulated.timed_out,
        }
        sim = simulated.summary
        why = (
            f"simulated {sim['met_slo']}/{sim['offered']} within budgets over "
            f"{DES_REPLAYS} replays, {sim['rejected']} rejected, {sim['deadline_missed']} "
            f"past the deadline, TTFT p95 {sim['ttft_p95_s']} s, TPOT p95 "
            f"{sim['tpot_p95_s']} s"
        )
        row["predicted_attainment"] = rounded(predicted, 4)
        out["points"][point.name] = row
        if predicted < point.attainment:
            failures.append(
                f"plan point {point.name!r} ({point.rate:g} req/s): predicted attainment "
                f"{predicted:.3f} is below the target {point.attainment:g} ({why})"
            )
    if fleet.roles.enabled:
        out["analytic_allocation"] = "best split the role controller may reach"
    return out
