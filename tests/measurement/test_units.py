"""Pure pieces of the measurement tools: plan and workload files, trace parsing, arrival
schedules, vLLM's metric definitions, reconciliation, scrape coverage, counter_missing, the
MAD CSV, and the CLIs' usage errors (exit 2, one line, no traceback)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from narwhal.contract import Budgets
from narwhal.testing.traces import trace_dir
from tools.measurement._runner_collect import (
    Sample,
    counter_missing,
    coverage,
    parse_metrics,
    prefix_caching_state,
    router_expected_counters,
)
from tools.measurement._runner_journal import journal_slice, reconcile, state_timeline
from tools.measurement._runner_report import (
    MAD_CORE_COLUMNS,
    csv_name,
    write_csv,
    write_markdown,
)
from tools.measurement._trial_client import poisson_schedule
from tools.measurement._trial_stats import ClientRecord, summarize
from tools.measurement._trial_workload import (
    SeedError,
    TokenPool,
    WorkloadError,
    build_fixed_workload,
    build_trace_workload,
    load_workload,
    make_pool,
    read_trace,
    save_workload,
)
from tools.measurement.benchmark_plan import PlanError, load_plan

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "measurement"
AZURE = trace_dir("azure-llm-2023", Path(__file__).resolve().parents[2])
SHA = "a" * 64


def _plan_doc(**over: object) -> dict:
    doc = {
        "schema": "narwhal.benchmark-plan/v1",
        "fleet": {"path": "fleet.json", "sha256": SHA},
        "client_revision": "abc",
        "workload": {"input_tokens": 8192, "output_tokens": 128},
        "points": [
            {
                "name": "r0.5",
                "rate": 0.5,
                "requests": 200,
                "ttft_s": 10,
                "tpot_s": 0.3,
                "attainment": 0.95,
                "timeout_s": 180,
            },
        ],
    }
    doc.update(over)
    return doc


# --- plan ------------------------------------------------------------------------------


def test_plan_loads_resolves_relative_paths_and_hashes_canonically(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps(_plan_doc(seed=1729), indent=4))
    (tmp_path / "other.json").write_text(json.dumps(_plan_doc(seed=1729)))
    a, b = load_plan(tmp_path / "plan.json"), load_plan(tmp_path / "other.json")
    assert a.sha256 == b.sha256  # whitespace does not change the identity
    assert a.fleet_path == tmp_path / "fleet.json"
    assert a.plan.seed == 1729 and a.plan.points[0].rate == 0.5


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        (_plan_doc(schema="narwhal.benchmark-plan/v2"), "schema must be"),
        (_plan_doc(extra=1), "extra"),
        (_plan_doc(fleet={"path": "f", "sha256": "xyz"}), "fleet.sha256"),
        (_plan_doc(points=[]), "points"),
        (_plan_doc(points=[_plan_doc()["points"][0]] * 2), "used twice"),
    ],
)
def test_plan_errors_are_one_line(tmp_path: Path, doc: dict, needle: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert needle in str(info.value) and "\n" not in str(info.value)


# --- workload ----------------------------------------------------------------------------


def _pool() -> TokenPool:
    return make_pool("engine./tokenize", "seed", [5, 6, 7, 8, 9, 10, 11, 12, 5, 6])


def test_fixed_workload_is_exact_deterministic_and_tamper_evident(tmp_path: Path) -> None:
    wl = build_fixed_workload("m", _pool(), 100, 7, seed=3, num_prompts=5, provenance={"x": 1})
    again = build_fixed_workload("m", _pool(), 100, 7, seed=3, num_prompts=5, provenance={})
    assert wl.sha256 == again.sha256  # provenance is not identity
    assert all(len(r.prompt) == 100 and r.output_tokens == 7 for r in [wl.warmup, *wl.requests])
    assert set(wl.requests[0].prompt) <= set(_pool().distinct)
    assert len({tuple(r.prompt) for r in wl.requests}) == 5  # distinct prompts: no cache hits
    save_workload(wl, tmp_path)
    assert load_workload(tmp_path).sha256 == wl.sha256
    doc = json.loads((tmp_path / "workload.json").read_text())
    doc["requests"][0]["prompt"][0] = 12 if doc["requests"][0]["prompt"][0] != 12 else 11
    (tmp_path / "workload.json").write_text(json.dumps(doc))
    with pytest.raises(WorkloadError, match="sha256"):
        load_workload(tmp_path)


def test_pool_needs_distinct_ids() -> None:
    # The qualification run's seed completion gave identical output ids: such a pool is refused.
    with pytest.raises(SeedError, match="distinct"):
        make_pool("completion.prompt_token_ids", "x", [42] * 28)


def test_azure_trace_rows_and_workload(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,20000,8\n"
        "2023-11-16 18:17:05.0000000,110,0\n"
    )
    rows, digest = read_trace(trace, 0, 10)
    assert [r.context_tokens for r in rows] == [4808, 20000, 110]
    assert rows[1].t_s == pytest.approx(0.052) and rows[2].t_s == pytest.approx(1.02004)
    assert rows[2].generated_tokens == 1  # at least one token is asked for
    wl = build_trace_workload("m", _pool(), trace, digest, rows, 0, 1, 16384, {})
    assert [len(r.prompt) for r in wl.requests] == [4808, 16384 - 8, 110]
    assert wl.trace is not None and wl.trace.capped_prompts == 1 and wl.has_arrivals
    bad = tmp_path / "bad.csv"
    bad.write_text("time,a,b\n1,2,3\n")
    with pytest.raises(WorkloadError, match="not an Azure LLM inference trace: no TIMESTAMP"):
        read_trace(bad, 0, 1)


@pytest.mark.parametrize(
    ("row", "says"),
    [
        # The 2024 Azure traces write an offset after the fraction: it was 'cannot parse'.
        ("2024-05-10 00:00:00.009930+00:00,374,44", None),
        ("2023-11-16 18:17:03.97,-5,44", "line 3: ContextTokens -5 is negative"),  # was read as 1
        ("2023-11-16 18:17:03.97,12,", "line 3: GeneratedTokens '' is not a whole number"),
        ("2023-11-16 18:17:03.97,12", "line 3: no GeneratedTokens"),
        ("2023-13-01 00:00:00,12,3", "line 3: TIMESTAMP '2023-13-01 00:00:00' is not a date"),
    ],
)
def test_a_trace_row_is_read_as_narwhal_fleetsim_reads_it(
    tmp_path: Path, row: str, says: str | None
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,1,1\n{row}\n")
    if says is None:
        rows, _ = read_trace(trace, 1, 1)
        assert [(r.t_s, r.context_tokens, r.generated_tokens) for r in rows] == [(0.0, 374, 44)]
    else:
        with pytest.raises(WorkloadError) as refused:
            read_trace(trace, 0, 5)
        assert f"{trace}: {says}" in str(refused.value)


def test_a_trace_that_is_not_utf8_is_refused_not_a_traceback(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,\xff,1\n")
    with pytest.raises(WorkloadError, match="not a readable CSV file"):
        read_trace(trace, 0, 5)


@pytest.mark.skipif(not AZURE.exists(), reason="shared Azure traces not present")
def test_real_azure_code_trace_parses() -> None:
    rows, _ = read_trace(AZURE / "AzureLLMInferenceTrace_code.csv", 0, 50)
    assert len(rows) == 50 and rows[0].t_s == 0 and rows[-1].t_s > 0
    assert all(rows[i].t_s <= rows[i + 1].t_s for i in range(49))


def test_poisson_schedule_is_seeded_and_has_the_rate() -> None:
    a, b = poisson_schedule(4000, 2.0, 7), poisson_schedule(4000, 2.0, 7)
    assert a == b and a[0] == 0.0 and a != poisson_schedule(4000, 2.0, 8)
    assert (len(a) - 1) / a[-1] == pytest.approx(2.0, rel=0.05)


# --- definitions -------------------------------------------------------------------------


def _rec(i: int, sent: float, ttft: float, e2e: float, out: int = 5, **kw: object) -> ClientRecord:
    base = dict(
        index=i,
        warmup=i < 0,
        client_request_id=f"run-{i}",
        router_request_id=f"r{i}",
        scheduled_s=None if i < 0 else sent,
        sent_s=sent,
        first_token_s=sent + ttft,
        end_s=sent + e2e,
        status=200,
        outcome="ok",
        prompt_tokens=10,
        expected_output_tokens=out,
        output_tokens=out,
        output_tokens_source="usage",
        chunks=out,
        itl=[(e2e - ttft) / (out - 1)] * (out - 1) if out > 1 else [],
    )
    base.update(kw)
    return ClientRecord(**base)


def test_summary_follows_vllm_definitions() -> None:
    records = [
        _rec(-1, -5.0, 1.0, 2.0),  # warmup: excluded from every number
        _rec(0, 0.0, 1.0, 3.0),  # TPOT (3-1)/(5-1) = 0.5: the first token excluded
        _rec(1, 1.0, 2.0, 2.4),  # TPOT 0.1
        _rec(2, 2.0, 0.5, 1.0, outcome="http_error", first_token_s=None, end_s=None),
    ]
    s = summarize(
        records,
        budgets=Budgets(ttft_s=1.5, tpot_s=0.3, attainment=0.5),
        timeout_s=10,
        offered_rate_rps=1.0,
        run_id="run",
        base="b",
        model="m",
        workload={},
        arrivals={},
        t0_wall=0.0,
        started_wall=0.0,
        ended_wall=0.0,
        command=[],
        versions={},
    )
    assert s.requests == 3 and s.completed == 2 and s.by_outcome == {"http_error": 1, "ok": 2}
    assert s.duration_s == pytest.approx(3.4)  # first send (0) -> last completion (1+2.4)
    assert s.completed_rate_rps == pytest.approx(2 / 3.4)
    assert s.output_throughput_tps == pytest.approx(10 / 3.4)
    assert s.total_token_throughput_tps == pytest.approx(30 / 3.4)
    assert s.tpot_s.p50 == pytest.approx(0.3) and s.tpot_s.max == pytest.approx(0.5)
    assert s.ttft_s.p50 == pytest.approx(1.5)
    # Within limits: only request 0? no: its TPOT 0.5 > 0.3; request 1's TTFT 2.0 > 1.5.
    assert s.within_limits == 0 and s.attainment == 0 and s.verdict == "fail"
    assert s.result == "0/3 within limits" and s.warmup["outcome"] == "ok"
    assert s.itl_s.count == 8 and s.peak_concurrency == 2


# --- reconciliation ----------------------------------------------------------------------


def _journal_for(records: list[ClientRecord]) -> list[dict]:
    out = []
    for r in records:
        out.append(
            {
                "type": "request.start",
                "id": r.router_request_id,
                "ts": 1.0,
                "client_request_id": r.client_request_id,
            }
        )
        out.append(
            {
                "type": "request.end",
                "id": r.router_request_id,
                "ts": 2.0,
                "outcome": "ok" if r.outcome == "ok" else "client_error",
                "status": r.status,
                "completion_tokens": r.output_tokens,
                "client_request_id": r.client_request_id,
            }
        )
    return out


def test_reconcile_matches_and_flags_every_kind_of_disagreement() -> None:
    records = [_rec(i, float(i), 0.1, 0.5) for i in range(-1, 4)]
    journal = _journal_for(records)
    good = reconcile(records, journal, "run")
    assert good.passed and good.client_terminal == good.journal_ends == 5

    missing = reconcile(records, [j for j in journal if j["id"] != "r2"], "run")
    assert not missing.passed and any("no request.end" in m["why"] for m in missing.mismatches)

    dup = reconcile(records, [*journal, journal[-1]], "run")
    assert not dup.passed and any("2 request.end" in m["why"] for m in dup.mismatches)

    unknown = [*journal, {**journal[-1], "id": "zz", "client_request_id": "run-99"}]
    assert any("has no record" in p for p in reconcile(records, unknown, "run").problems)

    flipped = [dict(j, outcome="stream_error") if j["id"] == "r1" else j for j in journal]
    assert reconcile(records, flipped, "run").mismatches[0]["why"] == "outcomes disagree"

    tokens = [dict(j, completion_tokens=4) if j["id"] == "r0" else j for j in journal]
    assert "completion tokens" in reconcile(records, tokens, "run").mismatches[0]["why"]

    # A request that never reached the router has no journal record, and needs none.
    gone = [*records, _rec(9, 9.0, 0.1, 0.5, outcome="connect_error", router_request_id=None)]
    assert reconcile(gone, journal, "run").passed


def test_journal_slice_and_timeline() -> None:
    records = [
        {"type": "router.start", "ts": 5.0, "engines": {"e0": "prefill", "e1": "prefill"}},
        {"type": "request.start", "ts": 6.0, "id": "a", "client_request_id": "run-000001"},
        {"type": "request.start", "ts": 6.5, "id": "b", "client_request_id": None},
        {
            "type": "role.flip",
            "ts": 7.0,
            "engine": "e1",
            "from_role": "prefill",
            "to_role": "decode",
            "role_generation": 1,
            "reason": "decode pressure",
            "forced": True,
        },
        {"type": "request.start", "ts": 99.0, "id": "c", "client_request_id": "other-1"},
    ]
    mine, foreign = journal_slice(records, "run", 4.0, 10.0)
    assert [r.get("id") for r in mine] == [None, "a", None]
    assert [r["id"] for r in foreign] == ["b"]
    timeline = state_timeline(records)
    assert timeline[-1]["roles"] == {"e0": "prefill", "e1": "decode"}
    assert timeline[-1]["generation"] == 1 and timeline[-1]["forced"] is True


# --- collectors --------------------------------------------------------------------------


def test_coverage_complete_and_with_a_hole() -> None:
    ok = [Sample("e0", t / 10, 0.0, True, 0.01) for t in range(0, 31)]
    assert coverage(ok, "e0", 0.0, 3.0, 0.25).complete
    holed = [s for s in ok if not 1.0 < s.t < 2.0]
    holed += [Sample("e0", 1.5, 0.0, False, 0.01, error="HTTP 503")]
    cov = coverage(holed, "e0", 0.0, 3.0, 0.25)
    assert not cov.complete and cov.failed == 1 and cov.max_gap_s == pytest.approx(1.0)
    # A window the scrapes do not reach to its end is a hole too.
    assert not coverage(ok, "e0", 0.0, 5.0, 0.25).complete


def test_counter_missing_from_router_definitions() -> None:
    expected = router_expected_counters(["e0", "e1"])
    assert 'narwhal_flips_total{from_role="prefill",to_role="decode"}' in expected
    assert 'narwhal_requests_total{outcome="ok"}' in expected
    full = {k: 0.0 for k in expected}
    partial = {k: v for k, v in full.items() if not k.startswith("narwhal_flips_total")}
    samples = [
        Sample("router", 1.0, 0.0, True, 0.0, series=partial),
        Sample("router", 2.0, 0.0, True, 0.0, series=full),
    ]
    diags = counter_missing(samples, "router", expected)
    assert {d["series"].split("{")[0] for d in diags} == {"narwhal_flips_total"}
    assert all(d["missing_in_scrapes"] == 1 and d["first_seen_t"] == 2.0 for d in diags)
    series, counters = parse_metrics(
        '# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine="0"} 3\n'
    )
    engine = [Sample("e0", 1.0, 0.0, True, 0.0, series=series, counters=counters)]
    assert not counter_missing(engine, "e0", expected_names=["vllm:prompt_tokens_total"])
    assert counter_missing(engine, "e0", expected_names=["vllm:generation_tokens_total"])


# --- CSV ---------------------------------------------------------------------------------


def test_mad_csv_core_columns_in_order(tmp_path: Path) -> None:
    summary = {
        "total_token_throughput_tps": 100.0,
        "output_throughput_tps": 10.0,
        "ttft_s": {"p50": 0.25},
        "tpot_s": {"p50": 0.0125},
        "itl_s": {"p50": 0.012},
        "e2el_s": {"p50": 2.0},
        "offered_rate_rps": 0.5,
        "completed_rate_rps": 0.46,
        "result": "200/200 within limits",
        "attainment": 1.0,
        "verdict": "pass",
        "peak_concurrency": 12,
    }
    path = tmp_path / csv_name("moonshotai/Kimi-K3")
    assert path.name == "perf_Kimi-K3.csv"
    write_csv(
        path,
        [
            {
                "model": "moonshotai/Kimi-K3",
                "tp": 8,
                "inp": 8192,
                "out": 128,
                "num_prompts": 200,
                "cmd": "load_trial.py run ...",
                "point": "r0.5",
                "summary": summary,
                "attainment_target": 0.95,
                "fleet_sha256": SHA,
                "workload_sha256": SHA,
                "plan_sha256": SHA,
                "narwhal_commit": "c",
                "client_revision": "r",
            }
        ],
    )
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ())[: len(MAD_CORE_COLUMNS)] == MAD_CORE_COLUMNS
        rows = {r["metric"]: r for r in reader}
    assert list(rows) == [
        "throughput_tot",
        "throughput_gen",
        "median_ttft",
        "median_tpot",
        "median_itl",
        "median_e2el",
    ]
    assert rows["median_ttft"]["performance"] == "250.0000" and rows["median_ttft"]["unit"] == "ms"
    assert rows["throughput_tot"]["unit"] == "tok/sec"
    assert rows["median_tpot"]["offered_rate_rps"] == "0.5000"


def test_report_md_names_each_point_with_its_own_budgets(tmp_path: Path) -> None:
    """The Measured points table (narwhal-qualify prints it at the end) names each point,
    gives its verdict and the budgets and target it was judged by (a point's may be
    stricter than the fleet's), and says where the warmup-inclusive counts are."""

    def point(name: str, ttft: float, verdict: str, attainment: float) -> dict[str, object]:
        return {
            "name": name,
            "rate": 4.0,
            "status": "measured",
            "gates": [{"name": "router_ready", "passed": True}],
            "diagnostics": [],
            "reconciliation": {"client_terminal": 25, "journal_ends": 25},
            "budgets": {"ttft_s": ttft, "tpot_s": 0.3, "attainment": 0.95, "timeout_s": 180},
            "summary": {
                "completed_rate_rps": 3.5,
                "output_throughput_tps": 100.0,
                "ttft_s": {"p50": 0.2, "p95": 0.3, "p99": 0.4},
                "tpot_s": {"p50": 0.02, "p95": 0.03, "p99": 0.04},
                "result": f"{round(attainment * 24)}/24 within limits",
                "attainment": attainment,
                "verdict": verdict,
            },
        }

    report = {
        "model": "moonshotai/Kimi-K3",
        "overall": "fail",
        "overall_reason": "a measured point missed its attainment target",
        "inputs": {"Fleet latency budgets": "10 s TTFT, 0.3 s TPOT"},
        "points": [point("r2", 10.0, "pass", 1.0), point("r4", 1.0, "fail", 22 / 24)],
        "timeline": [],
        "post_load_check": {"status": "pass", "reason": "exit 0"},
        "commands": [],
    }
    path = tmp_path / "report.md"
    write_markdown(path, report)
    md = path.read_text()
    table = md.split("## Measured points")[1].split("## Evidence per point")[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("|")]
    assert rows[0].startswith("| Point | Offered rate | Completed rate including drain |")
    assert rows[2].startswith("| r2 | 4 request/s |") and rows[3].startswith("| r4 | 4 request/s |")
    assert rows[2].endswith("| pass (attainment 1.000) | 10 s / 300 ms, 0.95 |"), rows[2]
    assert rows[3].endswith("| fail (attainment 0.917) | 1 s / 300 ms, 0.95 |"), rows[3]
    assert all(row.count("|") == rows[0].count("|") for row in rows)
    # The sentence under the table says where the counts that include the warmup are.
    assert "the client and journal counts under Evidence per point (report.md) include it" in table
    assert "Client / journal terminal" in md.split("## Evidence per point")[1]


# --- CLIs --------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=TOOLS
    )


@pytest.mark.parametrize(
    "args",
    [
        (
            "load_trial.py",
            "run",
            "--base",
            "http://127.0.0.1:9",
            "--workload",
            "/nonexistent",
            "--rate",
            "1",
            "--requests",
            "1",
            "--ttft",
            "1",
            "--tpot",
            "1",
            "--attainment",
            "0.9",
            "--timeout",
            "1",
            "--out",
            "/tmp/x",
        ),
        ("load_trial.py", "run", "--rate", "-1"),
        (
            "load_trial.py",
            "prepare",
            "--base",
            "http://127.0.0.1:9",
            "--seed",
            "1",
            "--out",
            "/tmp/x",
            "--trace",
            "/nonexistent.csv",
        ),
        (
            "benchmark_runner.py",
            "--base",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--plan",
            "/nonexistent.json",
            "--out",
            "/tmp/x",
            "--journal",
            "/tmp/j",
        ),
        ("benchmark_runner.py", "--base", "u"),
    ],
)
def test_cli_input_errors_exit_2_without_traceback(args: tuple[str, ...]) -> None:
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip()


def test_prepare_against_nothing_is_one_line_exit_1() -> None:
    proc = _cli(
        "load_trial.py",
        "prepare",
        "--base",
        "http://127.0.0.1:9",
        "--input-tokens",
        "8",
        "--output-tokens",
        "2",
        "--seed",
        "1",
        "--out",
        "/tmp/never-written",
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _scrape(t: float, series: dict[str, float]) -> Sample:
    return Sample(target="e0", t=t, wall=t, ok=True, latency_s=0.0, series=series)


def test_prefix_caching_is_off_only_when_the_engine_says_so_and_nothing_hit() -> None:
    info = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="%s",engine="0"}'
    hits = 'vllm:prefix_cache_hits_total{engine="0"}'
    off = [_scrape(0, {info % "False": 1, hits: 0}), _scrape(1, {info % "False": 1, hits: 0})]
    assert prefix_caching_state(off, "e0")[0] == "off"
    on = [_scrape(0, {info % "True": 1, hits: 0}), _scrape(1, {info % "True": 1, hits: 0})]
    assert prefix_caching_state(on, "e0") == (
        "on",
        "e0: vllm:cache_config_info says enable_prefix_caching=True",
    )
    # A hit in the window means the cache served a prompt, whatever the config says.
    hit = [_scrape(0, {info % "False": 1, hits: 0}), _scrape(1, {info % "False": 1, hits: 32})]
    assert prefix_caching_state(hit, "e0")[0] == "on"
    # Not published: not observed off.
    bare = [_scrape(0, {hits: 0}), _scrape(1, {hits: 0})]
    assert prefix_caching_state(bare, "e0")[0] == "unknown"
    assert prefix_caching_state([], "e0") == ("unknown", "e0: no scrape in the window")


def test_the_evidence_bundle_is_reproducible_and_holds_what_the_router_ran_on(
    tmp_path: Path,
) -> None:
    from tools.measurement._runner_bundle import gather_evidence, write_bundle

    out = tmp_path / "out"
    (out / "points" / "00-p").mkdir(parents=True)
    (out / "report.json").write_text("{}")
    (out / "points" / "00-p" / "summary.json").write_text("{}")
    journal = tmp_path / "journal.jsonl"
    journal.write_text('{"type": "router.start"}\n')
    report = tmp_path / "check-report.json"
    report.write_text("{}")
    (tmp_path / "check-report.json.sha256").write_text("ab\n")
    (tmp_path / "profiles.json").write_text("{}")
    head = {"qualification": {"status": "qualified", "report": str(report)}}
    store = str(tmp_path / "profiles.json")  # as LoadedFleet.profile_store_path resolves it
    notes = gather_evidence(out, journal, head, tmp_path / "fleet.json", store)
    assert notes == []
    _, first = write_bundle(out)
    _, again = write_bundle(out)  # the bundle and its digest are not bundled
    assert first == again
    with tarfile.open(out / "qualification-artifacts.tgz") as tar:
        assert sorted(tar.getnames()) == [
            "evidence/check/check-report.json",
            "evidence/check/check-report.json.sha256",
            "evidence/journal/journal.jsonl",
            "evidence/profiles/profiles.json",
            "points/00-p/summary.json",
            "report.json",
        ]
    missing = gather_evidence(out, journal, {"qualification": {"status": "skipped"}}, journal, None)
    assert missing == [
        "check report: none (qualification skipped)",
        "profile store: none (the router ran without one)",
    ]
    # A store the router was given by --profiles, not pinned in the fleet: its router.start
    # names it, and that is the file copied.
    served = tmp_path / "served-store.json"
    served.write_text('{"served": true}')
    head = {"qualification": {"status": "skipped"}, "profile_store": str(served)}
    assert gather_evidence(tmp_path / "o2", journal, head, journal, None) == [
        "check report: none (qualification skipped)"
    ]
    assert (
        tmp_path / "o2" / "evidence" / "profiles" / served.name
    ).read_text() == served.read_text()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--base", "notaurl"], "--base: 'notaurl' is not a router URL (http://HOST:PORT)"),
        (["--admin-token-file", "{tmp}/none"], "--admin-token-file: {tmp}/none is not a file"),
        (["--journal", "{tmp}/none.jsonl"], "--journal: {tmp}/none.jsonl is not a file"),
        (["--journal", "{tmp}"], "--journal: {tmp} is not a file"),
    ],
)
def test_the_runner_refuses_inputs_that_are_not_there_before_any_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    """Found probing the runner: a token file that is not there was blamed on the journal (or,
    with --journal, a bare '[Errno 2]' mid-point); a journal that is not there ran the plan to
    'no router.start in the journal'; --base notaurl said 'the router () is not on this host'."""
    from tools.measurement import benchmark_runner

    argv = ["--base", "http://127.0.0.1:9", "--model", "m", "--plan", str(tmp_path / "p.json")]
    argv += ["--out", str(tmp_path / "out")]
    argv += [arg.format(tmp=tmp_path) for arg in extra]
    assert benchmark_runner.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"benchmark_runner.py: {says.format(tmp=tmp_path)}")
    assert not (tmp_path / "out").exists()


def test_an_output_directory_is_made_or_refused_naming_the_flag(tmp_path: Path) -> None:
    """load_trial, benchmark_runner and aiperf_xcheck make --out before their trials: a file
    there was a raw '[Errno 17] File exists' (load_trial's after the whole trial had run)."""
    from tools.measurement._out_dir import OutDirError, prepare_out_dir

    prepare_out_dir(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    prepare_out_dir(tmp_path / "a" / "b")  # again: fine
    (tmp_path / "f").write_text("")
    with pytest.raises(OutDirError, match=r"^--out: .*/f exists and is not a directory$"):
        prepare_out_dir(tmp_path / "f")
    with pytest.raises(OutDirError, match=r"^--out: cannot create .*/f/sub: Not a directory$"):
        prepare_out_dir(tmp_path / "f" / "sub")


def test_load_trial_refuses_a_base_that_is_not_a_url_before_reading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--base notaurl ran the trial and printed only '0/N within limits' (the reason in
    client_records.jsonl)."""
    from tools.measurement import load_trial

    argv = ["run", "--base", "notaurl", "--workload", str(tmp_path / "none")]
    argv += ["--out", str(tmp_path / "out"), "--requests", "1", "--ttft", "1", "--tpot", "1"]
    argv += ["--attainment", "0.9", "--timeout", "5"]
    assert load_trial.main(argv) == 2
    assert "--base: 'notaurl' is not a router URL (http://HOST:PORT)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
