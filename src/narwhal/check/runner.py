"""Running the gates in order: collect evidence, judge it, time it, assemble the report.

The clock is injected (durations) and so is the wall clock (``created_at``), so a test can run
the whole sequence against recorded evidence with fixed times.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from narwhal import __version__
from narwhal.check.collect import Collector
from narwhal.check.gates.common import GateOutcome, planned_prompt_tokens
from narwhal.check.gates.contract import contract_gate
from narwhal.check.gates.generation import generation_gate
from narwhal.check.gates.health import health_gate
from narwhal.check.gates.kv_transfer import kv_prompt_tokens, kv_transfer_gate
from narwhal.check.gates.model import model_gate
from narwhal.check.gates.pace import pace_gate, pace_probe_plan
from narwhal.check.gates.slo import slo_gate
from narwhal.check.gates.tokenization import tokenization_gate
from narwhal.check.plan import BenchmarkPlan
from narwhal.check.settings import TOKENIZATION_PROMPTS, CheckSettings
from narwhal.clock import Clock
from narwhal.contract import (
    GATE_NAMES,
    REPORT_SCHEMA,
    CheckReport,
    EngineIdentity,
    FileRef,
    FleetRef,
    GateName,
    GateReport,
    LoadedFleet,
    SkipInfo,
    SkipKind,
)
from narwhal.profiles.store import ProfileStore, engine_models

__all__ = ["CheckInputs", "run_check"]

Progress = Callable[[str], None]
# Gates that judge the profile store; without one they have no input.
NEEDS_STORE = frozenset({"pace", "slo"})
# Gates that talk to engines; a failed health gate makes them meaningless.
LIVE = frozenset(GATE_NAMES) - {"health", "slo"}


@dataclass(frozen=True)
class CheckInputs:
    fleet: LoadedFleet
    store: ProfileStore | None = None
    store_ref: FileRef | None = None
    plan: BenchmarkPlan | None = None
    plan_ref: FileRef | None = None


@dataclass
class _Run:
    inputs: CheckInputs
    settings: CheckSettings
    collector: Collector
    progress: Progress
    kv_p50_s: float | None = None


async def _health(run: _Run) -> GateOutcome:
    results = await run.collector.health()
    return health_gate(run.inputs.fleet.contract, results, run.settings.health_timeout_s)


async def _contract(run: _Run) -> GateOutcome:
    c = run.collector
    return contract_gate(run.inputs.fleet.contract, c.attestations, c.attestation_errors)


async def _generation(run: _Run) -> GateOutcome:
    prompt = await run.collector.generation_prompt()
    n = run.settings.generation_tokens
    if prompt is None:
        return GateOutcome(
            "fail",
            "no prompt",
            ["no engine tokenized the generation prompt: cannot build a common prompt"],
        )
    return generation_gate(await run.collector.generation(prompt), prompt, n)


async def _model(run: _Run) -> GateOutcome:
    return model_gate(run.inputs.fleet.contract, await run.collector.models())


async def _pace(run: _Run) -> GateOutcome:
    store = run.inputs.store
    assert store is not None
    fleet = run.inputs.fleet.contract
    live = {e.id: run.collector.generation_of(e) for e in fleet.engines}
    results = await run.collector.pace(pace_probe_plan(store), live)
    return pace_gate(store, results, run.settings.pace_tolerance)


async def _tokenization(run: _Run) -> GateOutcome:
    results = await run.collector.tokenize(TOKENIZATION_PROMPTS)
    return tokenization_gate(TOKENIZATION_PROMPTS, results, run.settings.token_tolerance)


def kv_window_s(settings: CheckSettings, loaded: LoadedFleet) -> float:
    if settings.kv_window_s is not None:
        return settings.kv_window_s
    fleet = loaded.contract
    # Wider than the deadline, so a handoff the deadline rejects is still measured.
    return max(fleet.budgets.ttft_s, 2 * fleet.engine.first_token_timeout_s)


async def _kv_transfer(run: _Run) -> GateOutcome:
    inputs, settings = run.inputs, run.settings
    fleet = inputs.fleet.contract
    tokens, basis = kv_prompt_tokens(settings, inputs.store, inputs.plan, fleet.model.max_model_len)
    window = kv_window_s(settings, inputs.fleet)
    watch = run.collector.watch_kv_events()
    try:
        await watch.start()
        pairs = await run.collector.kv_pairs(fleet.permitted_pairs(), tokens, window, run.progress)
    finally:
        events = await watch.stop()
    profiled: tuple[float, str] | None = None
    if inputs.store is not None:
        length, why = planned_prompt_tokens(inputs.store, inputs.plan)
        models = engine_models(inputs.store)
        times = {
            e.id: models[e.id].prefill.predict(length).seconds
            for e in fleet.prefill_capable()
            if e.id in models and length is not None
        }
        if times:
            slowest = max(times, key=lambda k: times[k])
            profiled = (
                times[slowest],
                f"profiled prefill at {length} tokens ({why}) on the slowest prefill-capable "
                f"engine, {slowest}",
            )
    outcome = kv_transfer_gate(
        fleet, pairs, tokens, basis, window, settings.kv_margin, profiled, events
    )
    firsts = [p.first_token_s for pr in pairs for p in pr.probes if p.first_token_s is not None]
    if firsts:
        firsts.sort()
        run.kv_p50_s = firsts[len(firsts) // 2]
    return outcome


async def _slo(run: _Run) -> GateOutcome:
    inputs = run.inputs
    assert inputs.store is not None
    return slo_gate(
        inputs.fleet.contract,
        inputs.fleet.sha256,
        inputs.store,
        inputs.plan,
        run.kv_p50_s,
        run.settings.tpot_headroom,
    )


_GATES = {
    "health": _health,
    "contract": _contract,
    "generation": _generation,
    "model": _model,
    "pace": _pace,
    "tokenization": _tokenization,
    "kv_transfer": _kv_transfer,
    "slo": _slo,
}


def _skip(name: GateName, kind: SkipKind, reason: str, at: float) -> GateReport:
    return GateReport(
        name=name,
        verdict="skip",
        summary=reason,
        skip=SkipInfo(kind=kind, reason=reason),
        started_s=at,
        duration_s=0.0,
    )


async def run_check(
    inputs: CheckInputs,
    settings: CheckSettings,
    requested: Sequence[str],
    clock: Clock,
    wall: Callable[[], dt.datetime],
    progress: Progress = lambda _line: None,
    collector: Collector | None = None,
) -> CheckReport:
    """Run the ``requested`` gates in order and return the report. ``collector`` replaces the
    live one (tests hand in recorded evidence); it is closed at the end either way."""
    fleet = inputs.fleet.contract
    created = wall()
    start = clock.now()
    if collector is None:
        collector = Collector(fleet, settings, clock, inputs.fleet.engine_api_key)
    run = _Run(inputs, settings, collector, progress)
    gates: list[GateReport] = []
    try:
        # The generations the whole report speaks for, read before any gate runs.
        await collector.fetch_attestations()
        engines = {
            e.id: EngineIdentity(url=e.url, generation=collector.generation_of(e))
            for e in fleet.engines
        }
        health_failed: str | None = None
        for name in GATE_NAMES:
            at = max(0.0, clock.now() - start)
            if name not in requested:
                gates.append(_skip(name, "not_requested", "not in --gates", at))
                continue
            if name in NEEDS_STORE and inputs.store is None:
                gates.append(
                    _skip(name, "no_input", "no profile store (--profiles or profile_store)", at)
                )
                continue
            if name in LIVE and health_failed is not None:
                gates.append(_skip(name, "blocked", f"health failed: {health_failed}", at))
                continue
            progress(f"gate {name} ...")
            try:
                outcome = await _GATES[name](run)
            except Exception as exc:  # a gate that cannot run fails; the others still run
                outcome = GateOutcome(
                    "fail",
                    "could not run",
                    [f"the gate could not run: {type(exc).__name__}: {exc}"],
                )
            took = max(0.0, clock.now() - start - at)
            gates.append(
                GateReport(
                    name=name,
                    verdict=outcome.verdict,
                    summary=outcome.summary,
                    failures=outcome.failures,
                    notes=outcome.notes,
                    started_s=round(at, 6),
                    duration_s=round(took, 6),
                    evidence=outcome.evidence,
                )
            )
            progress(f"gate {name}: {outcome.verdict} ({took:.2f} s)")
            if name == "health" and outcome.verdict == "fail":
                health_failed = outcome.failures[0]
    finally:
        await collector.aclose()
    failed = any(g.verdict == "fail" for g in gates)
    settings_doc: dict[str, Any] = settings.document()
    settings_doc["kv_window_s"] = kv_window_s(settings, inputs.fleet)
    settings_doc["gates_requested"] = [g for g in GATE_NAMES if g in requested]
    return CheckReport.model_validate(
        {
            "schema": REPORT_SCHEMA,
            "created_at": created.isoformat(timespec="seconds"),
            "narwhal_version": __version__,
            "fleet": FleetRef(
                path=str(inputs.fleet.path), sha256=inputs.fleet.sha256, name=fleet.name
            ),
            "profile_store": inputs.store_ref,
            "plan": inputs.plan_ref,
            "engines": engines,
            "settings": settings_doc,
            "gates": gates,
            "verdict": "fail" if failed else "pass",
            "complete": all(g in requested for g in GATE_NAMES),
            "duration_s": round(max(0.0, clock.now() - start), 6),
        }
    )
