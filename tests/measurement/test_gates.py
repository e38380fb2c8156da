"""Each of the runner's gates trips for the right reason, and a point that fails one is reported
as such and kept out of the CSV: a busy fleet before a point, a router that is not ready, a
journal that lost records, an engine /metrics endpoint that stops answering mid-point. Also:
prepare straight from an engine (non-streamed prompt ids), and a trace-driven run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.testing.ports import free_ports
from narwhal.testing.procs import wait_until
from narwhal.testing.traces import trace_dir
from tests.helpers import admin, running_fleet, start_router, stop_router
from tests.measurement.support import (
    SIM,
    engines_idle,
    gate,
    journal_has,
    load_trial,
    point,
    report,
    run_runner,
    runner_cmd,
    when,
    write_plan,
)

AZURE_CODE = (
    trace_dir("azure-llm-2023", Path(__file__).resolve().parents[2])
    / "AzureLLMInferenceTrace_code.csv"
)
IN, OUT = 1024, 32
# test_metrics_endpoint_stops_mid_point: the scrape gap the runner allows, and e1's outage.
MAX_GAP_S = 3.0
OUTAGE_S = 2 * MAX_GAP_S


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("gates")
    # Prefix caching off, as the reference run measures (the runner checks it).
    with running_fleet(d, 2, sim=SIM, prefix_caching={"enabled": False}) as fleet:
        router = start_router(d, fleet.fleet_path)
        try:
            wl = d / "workload"
            # Straight from an engine: the non-streamed completion carries the prompt ids.
            prep = load_trial(
                "prepare",
                "--base",
                fleet.engines["e0"].url,
                "--input-tokens",
                str(IN),
                "--output-tokens",
                str(OUT),
                "--seed",
                "7",
                "--num-prompts",
                "30",
                "--out",
                str(wl),
            )
            assert prep.returncode == 0, prep.stderr
            yield {"dir": d, "fleet": fleet, "router": router, "workload": wl}
        finally:
            stop_router(router)


def _excluded_from_csv(out: Path) -> None:
    with (out / "perf_Kimi-K3.csv").open(newline="") as fh:
        assert list(csv.DictReader(fh)) == []
    assert "excluded from the CSV" in (out / "report.md").read_text()


@pytest.mark.slow
def test_prepare_from_an_engine_uses_the_completions_prompt_ids(env: dict[str, Any]) -> None:
    doc = json.loads((env["workload"] / "workload.json").read_text())
    assert doc["pool"]["source"] == "completion.prompt_token_ids"
    assert len(doc["requests"]) == 30 and len(doc["requests"][0]["prompt"]) == IN


@pytest.mark.slow
def test_router_returns_prompt_token_ids(env: dict[str, Any]) -> None:
    body = {
        "model": "moonshotai/Kimi-K3",
        "prompt": "hello there",
        "max_tokens": 2,
        "return_token_ids": True,
    }
    got = httpx.post(env["router"].url + "/v1/completions", json=body, timeout=30).json()
    assert got["choices"][0].get("prompt_token_ids")


@pytest.mark.slow
def test_busy_fleet_before_a_point(env: dict[str, Any], tmp_path: Path) -> None:
    fleet, router = env["fleet"], env["router"]
    e1 = fleet.engines["e1"].url
    stop = threading.Event()

    def busy() -> None:
        # A long generation straight on an engine: the fleet is not ours to measure.
        body = {
            "model": "moonshotai/Kimi-K3",
            "prompt": [300, 301, 302],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", e1 + "/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: not engines_idle([e1]), 10)
        proc, out = _one_point(
            tmp_path, router, fleet.fleet_path, env, "--idle-timeout", "1", "--skip-post-check"
        )
    finally:
        stop.set()
        thread.join(30)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    p = report(out)["points"][0]
    assert p["status"] == "not_run"
    idle = gate(p, "fleet_idle_before")
    assert not idle["passed"] and "e1: vllm:num_requests_running = 1" in idle["detail"]["reasons"]
    assert not any(g["name"] == "client_finished" for g in p["gates"])  # no load was sent
    _excluded_from_csv(out)
    assert wait_until(lambda: engines_idle([e.url for e in fleet.engines.values()]), 30)


@pytest.mark.slow
def test_router_not_ready(env: dict[str, Any], tmp_path: Path) -> None:
    # The same engines, both in the prefill role and no flipping: no P/D pair, not ready.
    doc = json.loads(env["fleet"].fleet_path.read_text())
    for engine in doc["engines"]:
        engine["initial_role"] = "prefill"
    doc["roles"] = {"enabled": False, "min_prefill": 1, "min_decode": 0}
    fleet_path = tmp_path / "fleet.json"
    fleet_path.write_text(json.dumps(doc))
    router = start_router(tmp_path, fleet_path, wait_ready=False)
    try:
        assert wait_until(lambda: _answers(router.url + "/health"), 30)
        proc, out = _one_point(
            tmp_path, router, fleet_path, env, "--ready-timeout", "1", "--skip-post-check"
        )
    finally:
        stop_router(router)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    p = report(out)["points"][0]
    ready = gate(p, "router_ready")
    assert p["status"] == "not_run" and not ready["passed"]
    assert ready["detail"]["last"].startswith("HTTP 503")
    assert gate(p, "fleet_idle_before")["passed"]  # only readiness failed
    _excluded_from_csv(out)


@pytest.mark.slow
def test_a_router_with_api_keys_is_measured_with_one(env: dict[str, Any], tmp_path: Path) -> None:
    """A router with client keys refuses a keyless client: the runner says so before any point
    (it read as a plan whose every point missed); with --api-key-env the plan is measured."""
    keys = tmp_path / "keys"
    keys.write_text("sk-bench\n")
    fleet_path = env["fleet"].fleet_path
    router = start_router(tmp_path, fleet_path, "--api-keys-file", str(keys))
    try:
        refused, out = _one_point(tmp_path, router, fleet_path, env, "--skip-post-check")
        assert refused.returncode == 2, refused.stderr
        assert "HTTP 401" in refused.stderr and "--api-key-env" in refused.stderr
        assert "Traceback" not in refused.stderr and not (out / "points").exists()
        plan = tmp_path / "plan.json"
        unset_key = ("--api-key-env", "NARWHAL_TEST_UNSET_KEY")
        unset = run_runner(runner_cmd(router.url, plan, out, router.journal, None, *unset_key))
        assert unset.returncode == 2 and "the variable is not set" in unset.stderr
        # The subject is the key, not the pace: a TPOT limit with room (the budget's 15 ms
        # against a 13 ms median missed once on a host running two suites at once).
        measured = point("p", 10, 5, tpot_s=0.05)
        plan = write_plan(tmp_path / "plan.json", fleet_path, [measured], IN, OUT)
        keyed = subprocess.run(
            [
                *runner_cmd(router.url, plan, tmp_path / "keyed", router.journal, env["workload"]),
                "--api-key-env",
                "BENCH_KEY",
                "--skip-post-check",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "BENCH_KEY": "sk-bench"},
        )
    finally:
        stop_router(router)
    assert keyed.returncode == 0, keyed.stderr[-2000:]
    assert report(tmp_path / "keyed")["points"][0]["status"] == "measured"
    assert "sk-bench" not in (tmp_path / "keyed" / "report.md").read_text()


def _one_point(
    tmp_path: Path, router: Any, fleet_path: Path, env: dict[str, Any], *extra: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The runner on a one-point plan (5 requests at 10/s) of the env's workload: its process
    and its output directory."""
    plan = write_plan(tmp_path / "plan.json", fleet_path, [point("p", 10, 5)], IN, OUT)
    out = tmp_path / "out"
    cmd = runner_cmd(router.url, plan, out, router.journal, env["workload"])
    return run_runner([*cmd, *extra]), out


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_journal_missing_records(env: dict[str, Any], tmp_path: Path) -> None:
    # A journal rotated by size with five backups: older records of the point are gone.
    fleet = env["fleet"]
    router = start_router(
        tmp_path, fleet.fleet_path, "--journal-max-bytes", "1500", port=free_ports(1)[0]
    )
    try:
        plan = write_plan(tmp_path / "plan.json", fleet.fleet_path, [point("p", 20, 24)], IN, OUT)
        out = tmp_path / "out"
        cmd = runner_cmd(router.url, plan, out, router.journal, env["workload"])
        proc = run_runner([*cmd, "--journal-timeout", "2", "--skip-post-check"])
    finally:
        stop_router(router)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    p = report(out)["points"][0]
    rec = gate(p, "journal_reconciled")
    assert p["status"] == "gate_failed" and not rec["passed"]
    assert any("counts differ" in why for why in rec["detail"])
    assert p["reconciliation"]["client_terminal"] == 25
    assert p["reconciliation"]["journal_ends"] < 25
    assert any(
        m["why"] == "no request.end in the journal" for m in p["reconciliation"]["mismatches"]
    )
    # Every other gate passed: the measurement itself was fine, its evidence is not.
    assert all(g["passed"] for g in p["gates"] if g["name"] != "journal_reconciled")
    _excluded_from_csv(out)


@pytest.mark.slow
def test_prefix_caching_on_fails_the_point(env: dict[str, Any], tmp_path: Path) -> None:
    # The same model and workload on engines that cache prefixes (vLLM's default).
    with running_fleet(tmp_path, 2, sim=SIM) as fleet:
        router = start_router(tmp_path, fleet.fleet_path)
        try:
            proc, out = _one_point(tmp_path, router, fleet.fleet_path, env, "--skip-post-check")
        finally:
            stop_router(router)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    p = report(out)["points"][0]
    cached = gate(p, "prefix_caching_off")
    assert p["status"] == "gate_failed" and not cached["passed"]
    assert "e0: vllm:cache_config_info says enable_prefix_caching=True" in cached["detail"]
    # Every other gate passed: the point is refused for the cache alone.
    assert [g["name"] for g in p["gates"] if not g["passed"]] == ["prefix_caching_off"]
    _excluded_from_csv(out)


@pytest.mark.slow
def test_metrics_endpoint_stops_mid_point(env: dict[str, Any], tmp_path: Path) -> None:
    fleet, router = env["fleet"], env["router"]
    e1 = fleet.engines["e1"].url

    def outage() -> None:
        admin(e1, body={"metrics": "stop"})  # 503 from /metrics
        # Kept on purpose: the outage's length is the scenario. The gate flags a hole in e1's
        # samples longer than the allowed gap, and nothing the test can see counts the
        # runner's failed scrapes; so twice the allowance. The runner's idle check after the
        # load polls e1's /metrics too, and waits (within its drain timeout) for it to return.
        time.sleep(OUTAGE_S)
        admin(e1, "DELETE")

    thread = when(lambda: journal_has(router.journal, '"client_request_id":"mstop-', 4), outage, 60)
    plan = write_plan(tmp_path / "plan.json", fleet.fleet_path, [point("mstop", 8, 24)], IN, OUT)
    out = tmp_path / "out"
    cmd = runner_cmd(router.url, plan, out, router.journal, env["workload"])
    try:
        # Finer scrapes than the other tests, so the outage is many missed scrapes; the 3 s
        # allowance keeps a loaded router's late answers from failing the healthy targets.
        proc = run_runner(
            [*cmd, "--skip-post-check", "--scrape-interval", "0.25", "--max-gap", str(MAX_GAP_S)]
        )
    finally:
        thread.join(10)
        admin(e1, "DELETE")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    p = report(out)["points"][0]
    cov = {c["target"]: c for c in gate(p, "scrape_coverage")["detail"]}
    assert p["status"] == "gate_failed" and not gate(p, "scrape_coverage")["passed"]
    assert not cov["e1"]["complete"] and cov["e1"]["failed"] >= 3
    assert cov["e1"]["max_gap_s"] >= MAX_GAP_S and cov["e1"]["gaps"]
    assert cov["router"]["complete"] and cov["e0"]["complete"]
    assert gate(p, "journal_reconciled")["passed"]
    _excluded_from_csv(out)


@pytest.mark.slow
@pytest.mark.skipif(not AZURE_CODE.exists(), reason="shared Azure traces not present")
def test_trace_workload_replays_trace_arrivals(env: dict[str, Any], tmp_path: Path) -> None:
    router, fleet = env["router"], env["fleet"]
    wl = tmp_path / "wl"
    prep = load_trial(
        "prepare",
        "--base",
        router.url,
        "--trace",
        str(AZURE_CODE),
        "--trace-rows",
        "20",
        "--seed",
        "3",
        "--out",
        str(wl),
        "--tokenize-url",
        fleet.engines["e0"].url,
    )
    assert prep.returncode == 0, prep.stderr
    doc = json.loads((wl / "workload.json").read_text())
    assert doc["trace"]["rows"] == 20 and doc["input_tokens"] is None
    assert [len(r["prompt"]) for r in doc["requests"][:2]] == [4808, 3180]  # the trace's rows
    run = load_trial(
        "run",
        "--base",
        router.url,
        "--workload",
        str(wl),
        "--requests",
        "20",
        "--ttft",
        "1",
        "--tpot",
        "0.05",
        "--attainment",
        "0.5",
        "--timeout",
        "20",
        "--out",
        str(tmp_path / "r"),
        "--trace-speedup",
        "4",
    )
    assert run.returncode in (0, 1), run.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["arrivals"] == {"process": "trace", "speedup": 4.0}
    assert summary["completed"] == 20
    expected = sum(r["output_tokens"] for r in doc["requests"][:20])
    assert summary["total_output_tokens"] == expected
