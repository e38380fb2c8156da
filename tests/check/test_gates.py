"""narwhal-check's pure parts: every gate against recorded evidence, the analytic SLO model,
the report format and the test narwhal-serve applies to it, the runner's sequencing (with a
fake collector and a virtual clock) and the CLI's input errors."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

from narwhal.check import cli
from narwhal.check.evidence import (
    Call,
    EngineHealth,
    GenerationResult,
    HandoffProbe,
    ModelsResult,
    PaceResult,
    PairResult,
    TokenizeResult,
)
from narwhal.check.gates import (
    contract_gate,
    generation_gate,
    health_gate,
    kv_prompt_tokens,
    kv_transfer_gate,
    model_gate,
    pace_gate,
    recommend_deadline,
    slo_gate,
    tokenization_gate,
)
from narwhal.check.plan import BenchmarkPlan
from narwhal.check.runner import CheckInputs, run_check
from narwhal.check.settings import TOKENIZATION_PROMPTS, CheckSettings
from narwhal.check.slo import (
    Allocation,
    LoadPoint,
    allocations,
    erlang_c,
    poisson_cdf,
    predict_point,
)
from narwhal.check.table import render_table
from narwhal.clock import VirtualClock
from narwhal.contract import (
    GATE_NAMES,
    CheckReport,
    ContractError,
    load_report,
    qualification_problem,
)
from narwhal.profiles.store import engine_models
from narwhal.simengine.vocab import Vocabulary
from tests.check.support import KIMI, check, fleet_doc, loaded, make_store, plan_doc, point

# --- kv_transfer: the deadline recommendation ------------------------------------------------


def test_recommendation_reproduces_the_qualification_run() -> None:
    # Observed 0.348-5.274 s, 8,192-token prefill 0.92 s, 10 s TTFT: the run chose 8.5 s,
    # "leaving about 0.6 s of the 10 s TTFT budget after the measured prefill".
    advice = recommend_deadline(5.274, ttft_s=10.0, prefill_s=0.92, margin=0.6)
    assert advice.value_s == 8.5
    assert advice.headroom_s == pytest.approx(0.58)
    assert advice.lower_s == pytest.approx(5.274 * 1.6)
    assert advice.upper_s == pytest.approx(9.08)
    # The packaged deadline is below the observed maximum: the gate would have failed.
    assert 2.5 < 5.274


def test_recommendation_when_the_margin_does_not_fit_or_nothing_does() -> None:
    tight = recommend_deadline(8.0, ttft_s=10.0, prefill_s=0.92, margin=0.6)
    assert tight.value_s is not None and 8.0 < tight.value_s < 9.08
    assert "margin does not fit" in tight.how
    impossible = recommend_deadline(9.5, ttft_s=10.0, prefill_s=0.92, margin=0.6)
    assert impossible.value_s is None and impossible.how.startswith("impossible")
    fine_steps = recommend_deadline(0.03, ttft_s=10.0, prefill_s=0.1, margin=0.6)
    assert fine_steps.value_s == 0.5


def _pair(p: str, d: str, firsts: list[float], kv: float | None = None, **kw: Any) -> PairResult:
    probes = [HandoffProbe(prefill_s=0.1, first_token_s=f, tokens=2) for f in firsts]
    return PairResult(p, d, probes, float(len(firsts)) if kv is None else kv, 1e6, 0.0, **kw)


def test_kv_transfer_names_the_slow_pair_and_recommends() -> None:
    fleet = loaded(fleet_doc(3)).contract
    pairs = [
        _pair("e0", "e1", [0.35, 0.4, 0.5]),
        _pair("e0", "e2", [3.1, 5.274, 4.0]),
        _pair("e1", "e2", [0.4, 0.6, 0.5]),
    ]
    out = kv_transfer_gate(fleet, pairs, 8192, "plan", 10.0, 0.6, (0.92, "profiled"))
    assert out.verdict == "fail"
    assert len(out.failures) == 1 and out.failures[0].startswith("e0->e2: first token after 5.274")
    rec = out.evidence["recommendation"]
    assert rec["recommended_first_token_timeout_s"] == 8.5
    assert rec["prefill_basis"] == "profiled"
    assert out.evidence["first_token"]["n"] == 9
    assert out.evidence["first_token"]["min_s"] == 0.35
    assert out.evidence["first_token"]["max_s"] == 5.274
    assert any("recommended engine.first_token_timeout_s: 8.5" in n for n in out.notes)


def test_kv_transfer_requires_the_kv_to_move_where_the_metric_exists() -> None:
    fleet = loaded(fleet_doc(2)).contract
    moved_nothing = _pair("e0", "e1", [0.1, 0.1], kv=0.0)
    no_metric = PairResult("e1", "e0", [HandoffProbe(0.1, 0.1, 2)], None, None, None)
    out = kv_transfer_gate(fleet, [moved_nothing, no_metric], 512, "x", 10.0, 0.6, None)
    assert out.verdict == "fail"
    assert out.failures == [
        "e0->e1: e1's NIXL transfer count rose by 0 over 2 completed handoffs: the KV did not "
        "move (decode prefilled locally?)"
    ]
    assert any("e1->e0" in n and "not confirmed" in n for n in out.notes)
    # No store: the prefill the recommendation leaves room for is the slowest leg observed.
    assert "slowest prefill leg" in out.evidence["recommendation"]["prefill_basis"]


def test_kv_transfer_unbounded_handoff_makes_the_recommendation_impossible() -> None:
    fleet = loaded(fleet_doc(2)).contract
    stuck = PairResult(
        "e0",
        "e1",
        [HandoffProbe(0.1, None, 0, "no first token within the 10 s observation window")],
        0.0,
    )
    out = kv_transfer_gate(fleet, [stuck], 512, "x", 10.0, 0.6, None)
    assert out.verdict == "fail" and "e0->e1: handoff 1/1 failed" in out.failures[0]
    rec = out.evidence["recommendation"]
    assert rec["recommended_first_token_timeout_s"] is None
    assert "maximum is unknown" in rec["how"]


def test_kv_prompt_length_follows_plan_then_store_and_fits_the_context() -> None:
    store, _ = make_store({"e0": KIMI})
    s = CheckSettings()
    plan = BenchmarkPlan.model_validate(plan_doc("0" * 64, [point("a", 1.0)]))
    assert kv_prompt_tokens(s, store, plan, 16384)[0] == 8192
    assert kv_prompt_tokens(s, store, None, 16384)[0] == 8192
    assert kv_prompt_tokens(s, None, None, 16384) == (1024, "default (no plan, no profile store)")
    assert kv_prompt_tokens(s, store, None, 4096)[0] == 4096 - s.kv_output_tokens


# --- identity gates --------------------------------------------------------------------------


def _attestation(fleet: Any, engine: Any, **over: Any) -> dict[str, Any]:
    doc = {
        "schema": "narwhal.attestation/v1",
        "engine_id": engine.id,
        "model_id": fleet.model.id,
        "model_revision": fleet.model.revision,
        "config_sha256": "c" * 64,
        "shard_manifest_sha256": "a" * 64,
        "tp": fleet.engine.tp,
        "gpu_arch": fleet.engine.gpu_arch,
        "accelerator": fleet.engine.accelerator,
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "nixl": {"host": engine.nixl.host, "port": engine.nixl.port},
        "kv_cache": {"block_size": 16, "num_blocks": 4096, "block_bytes": 16384},
        "generation": f"gen-{engine.id}",
    }
    doc.update(over)
    return doc


def test_contract_passes_unpinned_hashes_as_evidence_and_fails_disagreement() -> None:
    fleet = loaded(fleet_doc(3)).contract
    docs = {e.id: _attestation(fleet, e) for e in fleet.engines}
    ok = contract_gate(fleet, docs, {})
    assert ok.verdict == "pass", ok.failures
    assert any("shard_manifest_sha256 is not pinned" in n for n in ok.notes)
    assert ok.evidence["engines"]["e0"]["shard_manifest_sha256"]["match"] is None

    docs["e1"] = _attestation(fleet, fleet.engines[1], shard_manifest_sha256="b" * 64)
    out = contract_gate(fleet, docs, {})
    assert out.verdict == "fail"
    assert out.failures == [
        f"engines disagree on shard_manifest_sha256: e0, e2 {'a' * 12}…; e1 {'b' * 12}…"
    ]


def test_contract_compares_pinned_identity_and_engine_facts() -> None:
    doc = fleet_doc(2)
    doc["model"]["config_sha256"] = "c" * 64
    doc["engines"][1]["generation"] = "gen-old"
    fleet = loaded(doc).contract
    e0, e1 = fleet.engines
    docs: dict[str, dict[str, Any] | None] = {
        "e0": _attestation(fleet, e0, config_sha256="d" * 64, tp=4, engine_id="e9"),
        "e1": _attestation(fleet, e1, nixl={"host": "127.0.0.1", "port": 1}),
    }
    out = contract_gate(fleet, docs, {})
    text = "\n".join(out.failures)
    assert "e0: attested config_sha256" in text
    assert "e0: attested tp 4 differs from the fleet's 8" in text
    assert "is engine 'e9''s" in text
    assert (
        f"e1: attested nixl 127.0.0.1:1 differs from the fleet's 127.0.0.1:{e1.nixl.port}" in text
    )
    assert "e1: attested generation gen-e1 differs from the fleet's gen-old" in text
    missing = contract_gate(fleet, {"e0": docs["e0"], "e1": None}, {"e1": "timed out"})
    assert "e1: no attestation to check (timed out)" in missing.failures


def test_health_names_silent_engines() -> None:
    fleet = loaded(fleet_doc(2)).contract
    results = [
        EngineHealth("e0", Call(200, 0.01), Call(200, 0.01), {"generation": "x"}),
        EngineHealth("e1", Call(None, 5.0, "no answer within 5 s"), Call(503, 0.01), None),
    ]
    out = health_gate(fleet, results, 5.0)
    assert out.failures == [
        "e1: /health did not answer 200: no answer within 5 s",
        "e1: attestation did not answer 200: HTTP 503",
    ]


def test_generation_names_the_odd_engine_out_and_counts_tokens() -> None:
    same = [1, 2, 3, 4]
    results = [
        GenerationResult("e0", 4, same, completion_tokens=4),
        GenerationResult("e1", 4, [1, 2, 9, 9], completion_tokens=4),
        GenerationResult("e2", 4, same, completion_tokens=4),
        GenerationResult("e3", 4, [1, 2, 3], completion_tokens=3),
    ]
    out = generation_gate(results, [7, 8], 4)
    assert out.failures == [
        "e3: returned 3 token ids, 4 requested",
        "e1 generated different tokens from e0, e2 for the same prompt: different weights or "
        "configuration",
    ]
    tie = generation_gate(results[:2], [7], 4)
    assert "engines generate different tokens for the same prompt (e0 vs e1)" in tie.failures[0]


def test_model_gate_requires_exactly_the_fleet_model() -> None:
    fleet = loaded(fleet_doc(3)).contract
    out = model_gate(
        fleet,
        [
            ModelsResult("e0", [fleet.model.id], 16384),
            ModelsResult("e1", ["other"], 16384),
            ModelsResult("e2", [fleet.model.id], 8192),
        ],
    )
    assert out.failures == [
        f"e1: serves 'other', not exactly {fleet.model.id!r}",
        "e2: max_model_len 8192 is below the fleet's 16384",
    ]


def test_tokenization_names_a_different_vocabulary_and_judges_the_estimate() -> None:
    same, other = Vocabulary(0), Vocabulary(7)
    prompts = list(TOKENIZATION_PROMPTS)
    results = [
        TokenizeResult("e0", [same.encode(p) for p in prompts]),
        TokenizeResult("e1", [other.encode(p) for p in prompts]),
        TokenizeResult("e2", [same.encode(p) for p in prompts]),
    ]
    out = tokenization_gate(prompts, results, 0.5)
    assert len(out.failures) == 1
    assert out.failures[0].startswith("e1 tokenizes ") and "differently from e0" in out.failures[0]
    est = out.evidence["router_estimate"]
    assert est["max_error"] <= 0.5
    agreeing = tokenization_gate(prompts, [results[0], results[2]], 0.5)
    assert agreeing.verdict == "pass"
    assert any("cold-start estimate" in n for n in agreeing.notes)


def test_tokenization_fails_prompts_past_the_routers_refusal_bound() -> None:
    # 40 bytes in one token: the router's 16-byte bound would refuse prompts that fit.
    prompts = ["x" * 40, "y" * 40]
    out = tokenization_gate(prompts, [TokenizeResult("e0", [[1], [2]])], 0.5)
    assert out.verdict == "fail" and "exceeds the router's 16-byte bound" in out.failures[0]


# --- pace -------------------------------------------------------------------------------------


def _pace(engine: str, prefill: float, decode: float, generation: str | None) -> PaceResult:
    return PaceResult(
        engine,
        generation,
        prefill_tokens=8192,
        prefill_s=[prefill] * 3,
        decode_input_tokens=512,
        decode_tokens=64,
        decode_s_per_token=decode,
    )


def test_pace_fails_a_slow_engine_and_a_restarted_one() -> None:
    store, _ = make_store({"e0": KIMI, "e1": KIMI, "e2": KIMI})
    p8192 = KIMI["a"] + KIMI["b"] * 8192 + KIMI["c"] * 8192**2
    d512 = KIMI["intercept"] + KIMI["slope"] + KIMI["ctx"] * 544
    out = pace_gate(
        store,
        [
            _pace("e0", p8192 * 1.1, d512 * 0.95, "gen-e0"),
            _pace("e1", p8192 * 3, d512 * 3, "gen-e1"),
            _pace("e2", p8192, d512, "gen-new"),
        ],
        0.35,
    )
    assert len(out.failures) == 3
    assert (
        out.failures[0].startswith("e1: prefill of 8192 tokens took") and "+200%" in out.failures[0]
    )
    assert out.failures[1].startswith("e1: decode took") and "+200%" in out.failures[1]
    assert out.failures[2] == (
        "engine e2 was profiled at generation gen-e2 but runs generation gen-new now "
        "(restarted): re-profile it"
    )
    assert out.evidence["engines"]["e0"]["prefill"]["deviation"] == pytest.approx(0.1)


# --- slo --------------------------------------------------------------------------------------


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


# --- report and the router's test -------------------------------------------------------------


def _gate(name: str, verdict: str = "pass", **kw: Any) -> dict[str, Any]:
    g: dict[str, Any] = {
        "name": name,
        "verdict": verdict,
        "summary": "s",
        "started_s": 0.0,
        "duration_s": 0.1,
        "evidence": {},
    }
    if verdict == "fail":
        g["failures"] = ["broken"]
    if verdict == "skip":
        g["skip"] = {"kind": kw.get("kind", "not_requested"), "reason": "r"}
    return g


def _report(fleet_sha: str, store_sha: str | None, gates: list[dict[str, Any]]) -> CheckReport:
    failed = any(g["verdict"] == "fail" for g in gates)
    partial = any(g.get("skip", {}).get("kind") == "not_requested" for g in gates)
    return CheckReport.model_validate(
        {
            "schema": "narwhal.check-report/v1",
            "created_at": "2026-01-01T00:00:00+00:00",
            "narwhal_version": "0.1.0",
            "fleet": {"path": "/x/fleet.json", "sha256": fleet_sha, "name": "f"},
            "profile_store": {"path": "s.json", "sha256": store_sha} if store_sha else None,
            "plan": None,
            "engines": {"e0": {"url": "http://127.0.0.1:1", "generation": "g"}},
            "settings": {},
            "gates": gates,
            "verdict": "fail" if failed else "pass",
            "complete": not partial,
            "duration_s": 1.0,
        }
    )


def test_qualification_problem_names_what_differs() -> None:
    f, s = "a" * 64, "b" * 64
    good = _report(f, s, [_gate(n) for n in GATE_NAMES])
    assert qualification_problem(good, f, "/x/fleet.json", s) is None
    stale = qualification_problem(good, "c" * 64, "/x/fleet.json", s)
    assert stale is not None and "fleet sha256 differs" in stale and "stale report" in stale
    other = qualification_problem(good, "c" * 64, "/y/other.json", s)
    assert other is not None and "the report is for another fleet (/x/fleet.json)" in other
    store = qualification_problem(good, f, "/x/fleet.json", None)
    assert store == f"profile store sha256 differs: report {'b' * 12}, served none"
    failed = _report(f, s, [_gate(n, "fail" if n == "kv_transfer" else "pass") for n in GATE_NAMES])
    assert qualification_problem(failed, f, "/x/fleet.json", s) == (
        "the report did not pass (failed gates: kv_transfer)"
    )
    partial = _report(
        f, s, [_gate(n, "skip" if n != "kv_transfer" else "pass") for n in GATE_NAMES]
    )
    problem = qualification_problem(partial, f, "/x/fleet.json", s)
    assert problem is not None and problem.startswith("the report is partial")
    # Skips for absent input (no store) do not make a report partial.
    no_store = _report(
        f,
        None,
        [
            _gate(n, "skip", kind="no_input") if n in ("pace", "slo") else _gate(n)
            for n in GATE_NAMES
        ],
    )
    assert no_store.complete and qualification_problem(no_store, f, "/x/fleet.json", None) is None
    assert "PASS" in render_table(no_store) and "no_input: r" in render_table(no_store)


def test_report_model_refuses_inconsistent_documents(tmp_path: Path) -> None:
    good = _report("a" * 64, None, [_gate(n) for n in GATE_NAMES]).document()
    path = tmp_path / "r.json"
    for mutate, words in (
        (lambda d: d.update(verdict="fail"), "verdict must be fail exactly"),
        (lambda d: d["gates"].reverse(), "gates must be exactly"),
        (lambda d: d["gates"][0].update(verdict="fail"), "a failure (and only a failure)"),
        (lambda d: d.update(extra=1), "unknown field"),
    ):
        doc = json.loads(json.dumps(good))
        mutate(doc)
        path.write_text(json.dumps(doc))
        with pytest.raises(ContractError) as exc:
            load_report(path)
        assert words in str(exc.value) and "\n" not in str(exc.value)
    path.write_text(json.dumps(good))
    assert load_report(path)[0].verdict == "pass"


# --- the runner, with recorded evidence -------------------------------------------------------


class FakeCollector:
    """Answers like a healthy fleet, except that ``down`` engines do not answer /health."""

    def __init__(self, fleet: Any, clock: VirtualClock, down: frozenset[str] = frozenset()):
        self.fleet, self.clock, self.down = fleet, clock, down
        self.attestations: dict[str, Any] = {}
        self.attestation_errors: dict[str, str] = {}
        self.closed = False

    async def fetch_attestations(self) -> None:
        for e in self.fleet.engines:
            self.attestations[e.id] = _attestation(self.fleet, e)

    def generation_of(self, spec: Any) -> str:
        return f"gen-{spec.id}"

    async def health(self) -> list[EngineHealth]:
        self.clock.advance(0.25)
        return [
            EngineHealth(
                e.id,
                Call(None, 5.0, "refused") if e.id in self.down else Call(200, 0.01),
                Call(200, 0.01),
                self.attestations[e.id],
            )
            for e in self.fleet.engines
        ]

    async def models(self) -> list[ModelsResult]:
        self.clock.advance(0.5)
        return [ModelsResult(e.id, [self.fleet.model.id], 16384) for e in self.fleet.engines]

    async def aclose(self) -> None:
        self.closed = True


def _run(lf: Any, requested: list[str], collector: FakeCollector, clock: VirtualClock) -> Any:
    return asyncio.run(
        run_check(
            CheckInputs(lf),
            CheckSettings(),
            requested,
            clock,
            lambda: dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
            collector=collector,  # type: ignore[arg-type]
        )
    )


def test_runner_orders_times_and_skips_gates() -> None:
    lf = loaded(fleet_doc(2))
    clock = VirtualClock(100.0)
    fake = FakeCollector(lf.contract, clock)
    report = _run(lf, ["model", "health", "contract"], fake, clock)
    assert fake.closed
    assert [g.verdict for g in report.gates] == [
        "pass", "pass", "skip", "pass", "skip", "skip", "skip", "skip"
    ]  # fmt: skip
    model = report.gate("model")
    assert model.started_s == 0.25 and model.duration_s == 0.5  # the virtual clock's times
    assert report.gate("pace").skip.kind == "not_requested"
    assert report.verdict == "pass" and not report.complete
    assert report.created_at == "2026-01-01T00:00:00+00:00"
    assert report.engines["e1"].generation == "gen-e1"
    assert report.settings["gates_requested"] == ["health", "contract", "model"]


def test_runner_blocks_live_gates_after_a_health_failure_and_skips_storeless_gates() -> None:
    lf = loaded(fleet_doc(2))
    clock = VirtualClock()
    report = _run(lf, list(GATE_NAMES), FakeCollector(lf.contract, clock, frozenset({"e1"})), clock)
    assert report.verdict == "fail" and report.complete
    assert report.gate("health").failures == ["e1: /health did not answer 200: refused"]
    for name in ("contract", "generation", "model", "tokenization", "kv_transfer"):
        skip = report.gate(name).skip
        assert skip is not None and skip.kind == "blocked" and "e1" in skip.reason
    for name in ("pace", "slo"):
        skip = report.gate(name).skip
        assert skip is not None and skip.kind == "no_input"


# --- CLI input errors (no engine is contacted) ------------------------------------------------


def test_cli_input_errors_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(fleet_doc(2)))
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text(json.dumps({"schema": "narwhal.benchmark-plan/v1"}))
    store, _ = make_store({"e0": KIMI, "e1": KIMI})
    store_path = tmp_path / "store.json"
    store_path.write_text(json.dumps(store.model_dump(mode="json", by_alias=True)))
    cases = [
        (["--fleet", str(tmp_path / "missing.json")], "cannot read"),
        (["--fleet", str(fleet), "--gates", "health,warp"], "unknown gate(s) warp"),
        (["--fleet", str(fleet), "--gates", "pace"], "--gates pace needs a profile store"),
        (["--fleet", str(fleet), "--plan", str(bad_plan)], "plan.json: fleet: required field"),
        (["--fleet", str(fleet), "--pace-tolerance", "0"], "--pace-tolerance: must be positive"),
        (["--fleet", str(fleet), "--kv-probes", "x"], "invalid int value"),
        (["--fleet", str(fleet), "--report", str(tmp_path)], "is a directory"),
        (["--gates", "health"], "the following arguments are required: --fleet"),
    ]
    good_plan = tmp_path / "good-plan.json"
    good_plan.write_text(json.dumps(plan_doc("0" * 64, [point("a", 1.0)])))
    cases.append((["--fleet", str(fleet), "--plan", str(good_plan)], "--plan: predicting"))
    for args, words in cases:
        # In process (fast); the console script itself is exercised by the live tests.
        try:
            code = cli.main(["--quiet", *args])
        except SystemExit as exc:  # argparse's own errors
            code = int(exc.code or 0)
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (args, err)
        assert lines[0].startswith("narwhal-check: ")


def test_cli_unreachable_fleet_fails_health_and_blocks_the_rest(tmp_path: Path) -> None:
    # Nothing listens on the fleet's ports: health fails fast, every live gate is blocked.
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(fleet_doc(2)))
    report = tmp_path / "report.json"
    r = check("--fleet", str(fleet), "--report", str(report), "--health-timeout", "2")
    assert r.returncode == 1, r.stderr
    doc, digest = load_report(report)
    assert doc.gate("health").verdict == "fail" and doc.gate("model").skip.kind == "blocked"
    assert (tmp_path / "report.json.sha256").read_text().split()[0] == digest
    assert "health        FAIL" in r.stdout
