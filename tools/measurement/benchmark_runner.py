"""Run a benchmark plan's points against narwhal-serve, with gates and evidence for each.

    benchmark_runner.py --base URL --model M --plan PLAN --out DIR [--journal ROUTER_JOURNAL]
                        [--workload DIR] [--tokenize-url ENGINE_URL] [--scrape-interval S]
                        [--max-gap S] [--ready-timeout S] [--idle-timeout S] [--drain-timeout S]
                        [--journal-timeout S] [--admin-token-file F] [--api-key-env NAME]
                        [--strict-counters] [--skip-post-check]

Per point, in order: the router is ready and serves the plan's fleet; the fleet is idle (every
engine 0 running, 0 waiting; the router nothing in flight); ``load_trial.py run`` drives the
point while the router's and every engine's /metrics are scraped; the fleet drains to idle;
scrape coverage has no gap beyond ``--max-gap``; the client's outcomes reconcile with the
journal's ``request.end`` records. Evidence goes to DIR/points/NN-NAME/; DIR/report.md,
DIR/report.json and DIR/perf_<model>.csv summarise the plan; DIR/evidence/ holds the router's
whole journal, the check report it served on and the profile store, and
DIR/qualification-artifacts.tgz (with its .sha256) all of DIR. After the last point,
``narwhal-check --gates kv_transfer`` runs when it is installed.

Without ``--journal`` the runner asks the router where its journal is (``/admin/state``, with
``--admin-token-file``) or, on the router host, reads the ``--journal`` argument of the process
listening on the router's port; it refuses to start (exit 2) when neither finds a readable file.
A router with client API keys needs ``--api-key-env NAME`` (NAME an environment variable holding
one, passed on to load_trial.py); without it the runner refuses to start rather than send a plan
of refused requests.

Exit status: 0 every point measured with every gate passed, every verdict pass and the post-load
check passed or skipped; 1 otherwise; 2 bad arguments or inputs (plan, fleet, workload).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: the repository root for `tools` (tools/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from narwhal.contract import ContractError, LoadedFleet, load_fleet
from narwhal.contract.flags import http_url_problem, positive
from narwhal.testing import procs
from tools.measurement._out_dir import OutDirError, prepare_out_dir
from tools.measurement._provenance import git_commit, versions
from tools.measurement._router_journal import JournalNotFound, admin_state, find_router_journal
from tools.measurement._runner_bundle import BUNDLE_NAME, gather_evidence, write_bundle
from tools.measurement._runner_collect import (
    ENGINE_EXPECTED_COUNTERS,
    Collector,
    Sample,
    Target,
    counter_missing,
    coverage,
    idle_state,
    prefix_caching_state,
    router_expected_counters,
    scrape_once,
)
from tools.measurement._runner_journal import journal_slice, read_journal, reconcile, state_timeline
from tools.measurement._runner_report import csv_name, mad_command, write_csv, write_markdown
from tools.measurement._trial_stats import ClientRecord
from tools.measurement._trial_workload import WorkloadError, load_workload
from tools.measurement.benchmark_plan import LoadedPlan, PlanError, PlanPoint, load_plan

__all__ = ["RunnerConfig", "main", "run_plan"]

PROG = "benchmark_runner.py"
HERE = Path(__file__).resolve().parent
LOAD_TRIAL = HERE / "load_trial.py"
REPORT_SCHEMA = "narwhal.benchmark-report/v1"
TIMELINE_TYPES = ("router.start", "role.flip", "role.pin")


class UsageError(Exception):
    pass


@dataclass(frozen=True)
class RunnerConfig:
    base: str
    model: str
    plan_path: Path
    out: Path
    journal: Path
    workload: Path | None = None
    journal_source: str = "--journal"  # how the journal was found (without --journal)
    tokenize_url: str | None = None
    scrape_interval_s: float = 1.0
    max_gap_s: float | None = None  # default: 2.5 scrape intervals
    ready_timeout_s: float = 60.0
    idle_timeout_s: float = 120.0
    drain_timeout_s: float = 300.0
    journal_timeout_s: float = 30.0
    admin_token_file: Path | None = None
    # The environment variable holding the router's client API key (load_trial.py's flag).
    api_key_env: str | None = None
    strict_counters: bool = False
    post_check: bool = True
    check_command: tuple[str, ...] | None = None  # overrides the narwhal-check lookup (tests)

    @property
    def allowed_gap_s(self) -> float:
        return self.max_gap_s if self.max_gap_s is not None else 2.5 * self.scrape_interval_s


@dataclass
class Gate:
    name: str
    passed: bool
    detail: Any = None


@dataclass
class PointResult:
    index: int
    name: str
    rate: float
    requests: int
    status: str  # measured | gate_failed | not_run
    gates: list[Gate] = field(default_factory=list)
    diagnostics: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    reconciliation: dict[str, Any] | None = None
    command: list[str] = field(default_factory=list)
    evidence_dir: str = ""
    window: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gates"] = [asdict(g) for g in self.gates]
        return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")


def _poll(predicate: Any, timeout_s: float, interval_s: float = 0.2) -> Any:
    """Call ``predicate`` until it returns a truthy first element or the time is up; its last
    result."""
    last: list[Any] = []

    def done() -> bool:
        last[:] = [predicate()]
        return bool(last[0][0])

    procs.wait_until(done, timeout_s, interval_s)
    return last[0]


# --- gates -------------------------------------------------------------------------------


def gate_ready(client: httpx.Client, base: str, timeout_s: float) -> Gate:
    def ready() -> tuple[bool, str]:
        try:
            r = client.get(base + "/ready")
        except httpx.HTTPError as exc:
            return False, f"/ready: {type(exc).__name__}"
        try:
            reason = r.json().get("reason")
        except ValueError:
            reason = None
        return r.status_code == 200, f"HTTP {r.status_code}" + (f": {reason}" if reason else "")

    ok, why = _poll(ready, timeout_s)
    return Gate("router_ready", ok, {"last": why, "timeout_s": timeout_s})


_FLEET_INFO = re.compile(r'^narwhal_fleet_info\{.*fleet_sha256="([0-9a-f]+)"')


def gate_router_fleet(client: httpx.Client, router: Target, fleet_sha: str) -> Gate:
    sample = scrape_once(client, router)
    if not sample.ok:
        return Gate("router_fleet", False, f"/metrics unreadable: {sample.error}")
    served = [m.group(1) for k, v in sample.series.items() if v and (m := _FLEET_INFO.match(k))]
    return Gate(
        "router_fleet", fleet_sha in served, {"plan_fleet_sha256": fleet_sha, "served": served}
    )


def gate_idle(
    client: httpx.Client, router: Target, engines: list[Target], timeout_s: float, name: str
) -> Gate:
    started = time.monotonic()
    state = _poll(
        lambda: (lambda s: (s.idle, s))(idle_state(client, router, engines)), timeout_s, 0.25
    )[1]
    return Gate(
        name,
        state.idle,
        {
            "waited_s": round(time.monotonic() - started, 3),
            "timeout_s": timeout_s,
            "reasons": state.reasons,
            "values": state.values,
        },
    )


# --- one point ---------------------------------------------------------------------------


@dataclass
class PlanContext:
    cfg: RunnerConfig
    loaded: LoadedPlan
    fleet: LoadedFleet
    workload_dir: Path
    workload_sha256: str
    router: Target
    engines: list[Target]
    expected_router_counters: frozenset[str]
    commands: list[str] = field(default_factory=list)


def _load_records(path: Path) -> list[ClientRecord]:
    if not path.exists():
        return []
    return [
        ClientRecord.model_validate_json(line)
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def _admin_state(client: httpx.Client, cfg: RunnerConfig) -> Any:
    if cfg.admin_token_file is None:
        return None
    return admin_state(client, cfg.base, cfg.admin_token_file)


def _client_bound_s(point: PlanPoint) -> float:
    # Bounded: the schedule's span (with slack for a Poisson tail), the warmup, the last
    # request's timeout, and a margin for process start-up.
    return 3.0 * point.requests / point.rate + 2.0 * point.timeout_s + 60.0


def _run_client(
    ctx: PlanContext, point: PlanPoint, pdir: Path, run_id: str
) -> tuple[Gate, list[str]]:
    cfg = ctx.cfg
    cmd = [
        sys.executable,
        str(LOAD_TRIAL),
        "run",
        "--base",
        cfg.base,
        "--model",
        cfg.model,
        "--workload",
        str(ctx.workload_dir),
        "--rate",
        repr(point.rate),
        "--requests",
        str(point.requests),
        "--ttft",
        repr(point.ttft_s),
        "--tpot",
        repr(point.tpot_s),
        "--attainment",
        repr(point.attainment),
        "--timeout",
        repr(point.timeout_s),
        "--out",
        str(pdir / "client"),
        "--run-id",
        run_id,
    ]
    if ctx.loaded.plan.seed is not None:
        cmd += ["--seed", str(ctx.loaded.plan.seed)]
    cmd += _key_flag(cfg)
    bound = _client_bound_s(point)
    # In this process's group: a Ctrl-C that stops the runner stops its client too.
    proc = procs.start(cmd, pdir / "client.log", append=False, new_session=False)
    try:
        rc = proc.wait(bound)
    except subprocess.TimeoutExpired:
        procs.stop(proc, 10)
        return Gate("client_finished", False, f"load_trial.py exceeded {bound:.0f} s"), cmd
    summary = pdir / "client" / "summary.json"
    ok = rc in (0, 1) and summary.exists()
    tail = (pdir / "client.log").read_text(errors="replace").strip().splitlines()[-3:]
    return Gate("client_finished", ok, {"exit_code": rc, "output": tail}), cmd


def _wait_journal(
    ctx: PlanContext, run_id: str, expected: int
) -> tuple[list[dict[str, Any]], int, list[str]]:
    """The journal once it holds ``expected`` request.end records of the run (the router writes
    each end just after the response; bounded by --journal-timeout)."""
    prefix = run_id + "-"

    def count() -> tuple[bool, Any]:
        read = read_journal(ctx.cfg.journal)
        n = sum(
            1
            for r in read.records
            if r.get("type") == "request.end"
            and str(r.get("client_request_id", "")).startswith(prefix)
        )
        return n >= expected, read

    _, read = _poll(count, ctx.cfg.journal_timeout_s, 0.2)
    return read.records, read.invalid_lines, read.files


def _metric_total(sample: Sample, name: str) -> float:
    return sum(v for k, v in sample.series.items() if k == name or k.startswith(name + "{"))


def run_point(ctx: PlanContext, index: int, point: PlanPoint, http: httpx.Client) -> PointResult:
    cfg = ctx.cfg
    pdir = cfg.out / "points" / f"{index:02d}-{point.name}"
    pdir.mkdir(parents=True, exist_ok=True)
    result = PointResult(index, point.name, point.rate, point.requests, "not_run")
    result.evidence_dir = str(pdir)
    targets = [ctx.router, *ctx.engines]
    collector = Collector(targets, cfg.scrape_interval_s, timeout_s=max(1.0, cfg.scrape_interval_s))
    collector.start()
    try:
        result.gates.append(gate_ready(http, cfg.base, cfg.ready_timeout_s))
        result.gates.append(gate_router_fleet(http, ctx.router, ctx.fleet.sha256))
        result.gates.append(
            gate_idle(http, ctx.router, ctx.engines, cfg.idle_timeout_s, "fleet_idle_before")
        )
        _write_json(pdir / "admin_state_before.json", _admin_state(http, cfg))
        if not all(g.passed for g in result.gates):
            samples = collector.stop()
            _write_samples(pdir, samples)
            return _finish(pdir, result)
        run_id = f"{point.name}-{int(time.time() * 1000):x}"
        t_start, wall_start = time.monotonic(), time.time()
        gate, cmd = _run_client(ctx, point, pdir, run_id)
        result.command = cmd
        ctx.commands.append(shlex.join(cmd))
        result.gates.append(gate)
        result.gates.append(
            gate_idle(http, ctx.router, ctx.engines, cfg.drain_timeout_s, "fleet_idle_after")
        )
        t_end, wall_end = time.monotonic(), time.time()
        # Let one more scrape of every target land after the window closes.
        time.sleep(min(cfg.scrape_interval_s * 1.5, 5.0))
        _write_json(pdir / "admin_state_after.json", _admin_state(http, cfg))
    finally:
        samples = collector.stop()
    _write_samples(pdir, samples, origin=t_start)
    result.window = {
        "wall_start": wall_start,
        "wall_end": wall_end,
        "duration_s": t_end - t_start,
    }
    # Scrape coverage over the whole window: load and drain.
    covs = [coverage(samples, t.name, t_start, t_end, cfg.allowed_gap_s) for t in targets]
    result.gates.append(
        Gate(
            "scrape_coverage",
            all(c.complete for c in covs),
            [asdict(c) for c in covs],
        )
    )
    in_window = [s for s in samples if t_start <= s.t <= t_end]
    missing = counter_missing(in_window, ctx.router.name, ctx.expected_router_counters)
    for engine in ctx.engines:
        missing += counter_missing(in_window, engine.name, expected_names=ENGINE_EXPECTED_COUNTERS)
    for diag in missing:
        if diag["first_seen_t"] is not None:
            diag["first_seen_t"] = round(diag["first_seen_t"] - t_start, 3)
    result.diagnostics += missing
    if cfg.strict_counters:
        result.gates.append(Gate("counters_present", not missing, {"missing": len(missing)}))
    if ctx.loaded.plan.prefix_caching == "off":
        # The reference run's condition: a prompt served from the prefix cache would measure
        # the cache, not the fleet.
        states = [prefix_caching_state(in_window, e.name) for e in ctx.engines]
        result.gates.append(
            Gate(
                "prefix_caching_off",
                all(verdict == "off" for verdict, _ in states),
                [why for _, why in states],
            )
        )
    # Client records and summary.
    records = _load_records(pdir / "client" / "client_records.jsonl")
    summary_path = pdir / "client" / "summary.json"
    if summary_path.exists():
        result.summary = json.loads(summary_path.read_text())
    # Journal: the slice, the reconciliation, the timeline.
    reached = sum(1 for r in records if r.outcome != "connect_error")
    journal, invalid, files = _wait_journal(ctx, run_id, reached)
    mine, foreign = journal_slice(journal, run_id, wall_start - 1.0, wall_end + 1.0)
    with (pdir / "journal.jsonl").open("w", encoding="utf-8") as fh:
        for rec in mine:
            fh.write(json.dumps(rec, default=str) + "\n")
    rec_result = reconcile(records, mine, run_id) if records else None
    if rec_result is None:
        result.gates.append(Gate("journal_reconciled", False, "no client records to reconcile"))
    else:
        result.reconciliation = rec_result.to_json()
        result.reconciliation["journal_files"] = files
        result.gates.append(Gate("journal_reconciled", rec_result.passed, rec_result.problems))
    if invalid:
        result.diagnostics.append({"kind": "journal_invalid_lines", "count": invalid})
    left_open = [r.client_request_id for r in records if r.closed_after_done is False]
    if left_open:
        result.diagnostics.append(
            {
                "kind": "streams_left_open",
                "count": len(left_open),
                "client_request_ids": left_open[:20],
                "why": "the router kept these responses open after their [DONE]",
            }
        )
    if foreign:
        ids = {r.get("id") for r in foreign}
        result.diagnostics.append(
            {
                "kind": "foreign_requests",
                "count": len(ids),
                "why": "requests not sent by this run reached the router during the point",
            }
        )
    timeline = state_timeline(r for r in mine if r.get("type") in TIMELINE_TYPES)
    _write_json(pdir / "timeline.json", timeline)
    # Cross-checks between metrics and journal (diagnostics: explain, do not gate).
    router_ok = [s for s in in_window if s.target == ctx.router.name and s.ok]
    if len(router_ok) >= 2:
        first, last = router_ok[0], router_ok[-1]
        flips_metric = _metric_total(last, "narwhal_flips_total") - _metric_total(
            first, "narwhal_flips_total"
        )
        flips_journal = sum(1 for e in timeline if e["event"] == "role.flip")
        if flips_metric != flips_journal:
            result.diagnostics.append(
                {"kind": "flips_mismatch", "metrics_delta": flips_metric, "journal": flips_journal}
            )
        ended = _metric_total(last, "narwhal_requests_total") - _metric_total(
            first, "narwhal_requests_total"
        )
        journal_ended = sum(
            1
            for r in journal
            if r.get("type") == "request.end"
            and isinstance(r.get("ts"), int | float)
            and first.wall <= r["ts"] <= last.wall
        )
        if ended != journal_ended:
            result.diagnostics.append(
                {
                    "kind": "requests_metric_mismatch",
                    "metrics_delta": ended,
                    "journal_ends_between_scrapes": journal_ended,
                }
            )
    return _finish(pdir, result)


def _write_samples(pdir: Path, samples: list[Sample], origin: float | None = None) -> None:
    with (pdir / "metrics.jsonl").open("w", encoding="utf-8") as fh:
        for s in samples:
            obj = s.to_json()
            if origin is not None:
                obj["t_point_s"] = round(s.t - origin, 6)
            fh.write(json.dumps(obj) + "\n")


def _finish(pdir: Path, result: PointResult) -> PointResult:
    gates_ok = all(g.passed for g in result.gates)
    ran = any(g.name == "client_finished" for g in result.gates)
    result.status = "measured" if gates_ok and ran else ("gate_failed" if ran else "not_run")
    _write_json(pdir / "gates.json", [asdict(g) for g in result.gates])
    _write_json(pdir / "diagnostics.json", result.diagnostics)
    _write_json(pdir / "point.json", result.to_json())
    return result


# --- the plan ----------------------------------------------------------------------------


def _check_command() -> tuple[list[str], str]:
    """The narwhal-check console script beside this interpreter (or on PATH), else the module
    it runs: narwhal.check comes with narwhal, which this runner imports."""
    exe = shutil.which(
        "narwhal-check",
        path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    if exe:
        return [exe], "narwhal-check"
    return [sys.executable, "-m", "narwhal.check.cli"], "python -m narwhal.check.cli"


def post_load_check(ctx: PlanContext) -> dict[str, Any]:
    cfg = ctx.cfg
    if not cfg.post_check:
        return {"status": "skip", "reason": "--skip-post-check"}
    if cfg.check_command is not None:
        base, how = list(cfg.check_command), "--check-command"
    else:
        base, how = _check_command()
    report = cfg.out / "post_load_check.json"
    cmd = [
        *base,
        "--fleet",
        str(ctx.loaded.fleet_path),
        "--gates",
        "kv_transfer",
        "--report",
        str(report),
    ]
    ctx.commands.append(shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"status": "fail", "reason": "narwhal-check did not finish in 900 s", "cmd": cmd}
    except OSError as exc:
        return {"status": "fail", "reason": f"cannot run {how}: {exc}", "cmd": cmd}
    (cfg.out / "post_load_check.log").write_text(proc.stdout + proc.stderr)
    status = {0: "pass", 1: "fail"}.get(proc.returncode, "fail")
    last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
    return {
        "status": status,
        "reason": f"exit {proc.returncode}: {last[0][:300]}",
        "cmd": cmd,
        "report": str(report) if report.exists() else None,
    }


def _key_flag(cfg: RunnerConfig) -> list[str]:
    """load_trial.py's flag for the key (the variable's name: the key stays out of argv)."""
    return ["--api-key-env", cfg.api_key_env] if cfg.api_key_env else []


def _check_client_access(cfg: RunnerConfig) -> None:
    """The router takes the client's requests: a router with API keys refuses every request of
    a plan run without one, which would read as a plan whose every point missed."""
    headers = {}
    if cfg.api_key_env:
        headers["Authorization"] = f"Bearer {os.environ.get(cfg.api_key_env, '')}"
    try:
        answer = httpx.get(cfg.base + "/v1/models", headers=headers, timeout=10, trust_env=False)
    except httpx.HTTPError:
        return  # unreachable: the readiness gate of each point says so
    if answer.status_code in (401, 403):
        given = f"the key in ${cfg.api_key_env}" if cfg.api_key_env else "no API key"
        raise UsageError(
            f"the router refuses the client's requests with {given} (HTTP "
            f"{answer.status_code}): pass --api-key-env NAME, NAME an environment variable "
            "holding one of the router's client keys"
        )


def _prepare_workload(cfg: RunnerConfig, loaded: LoadedPlan, commands: list[str]) -> Path:
    out = cfg.out / "workload"
    plan = loaded.plan
    needed = max(p.requests for p in plan.points)
    cmd = [
        sys.executable,
        str(LOAD_TRIAL),
        "prepare",
        "--base",
        cfg.base,
        "--model",
        cfg.model,
        "--input-tokens",
        str(plan.workload.input_tokens),
        "--output-tokens",
        str(plan.workload.output_tokens),
        "--seed",
        str(plan.seed if plan.seed is not None else 1729),
        "--num-prompts",
        str(needed),
        "--out",
        str(out),
    ]
    if cfg.tokenize_url:
        cmd += ["--tokenize-url", cfg.tokenize_url]
    cmd += _key_flag(cfg)
    commands.append(shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise UsageError(f"workload preparation failed: {proc.stderr.strip()[-300:]}")
    return out


def run_plan(cfg: RunnerConfig) -> int:
    loaded = load_plan(cfg.plan_path)
    plan = loaded.plan
    try:
        fleet = load_fleet(loaded.fleet_path)
    except ContractError as exc:
        raise UsageError(f"plan fleet: {exc}") from None
    if fleet.sha256 != plan.fleet.sha256:
        raise UsageError(
            f"{loaded.fleet_path} hashes to {fleet.sha256}, the plan names {plan.fleet.sha256}"
        )
    if cfg.model != fleet.contract.model.id:
        raise UsageError(
            f"--model {cfg.model} but the plan's fleet serves {fleet.contract.model.id}"
        )
    _check_client_access(cfg)
    try:
        prepare_out_dir(cfg.out)
    except OutDirError as exc:
        raise UsageError(str(exc)) from None
    inputs = cfg.out / "inputs"
    inputs.mkdir(exist_ok=True)
    shutil.copyfile(loaded.path, inputs / "plan.json")
    shutil.copyfile(loaded.fleet_path, inputs / "fleet.json")
    commands = [shlex.join([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])]
    workload_dir = cfg.workload or (
        loaded.resolve(plan.workload_dir) if plan.workload_dir else None
    )
    if workload_dir is None:
        workload_dir = _prepare_workload(cfg, loaded, commands)
    wl = load_workload(workload_dir)
    if (wl.input_tokens, wl.output_tokens) != (
        plan.workload.input_tokens,
        plan.workload.output_tokens,
    ):
        raise UsageError(
            f"workload is {wl.input_tokens} in / {wl.output_tokens} out, the plan says "
            f"{plan.workload.input_tokens} / {plan.workload.output_tokens}"
        )
    largest = max(plan.points, key=lambda p: p.requests)
    if largest.requests > len(wl.requests):
        raise UsageError(
            f"the workload has {len(wl.requests)} prompts; point {largest.name} needs "
            f"{largest.requests} (load_trial.py prepare --num-prompts {largest.requests})"
        )
    checkout = git_commit()
    ctx = PlanContext(
        cfg=cfg,
        loaded=loaded,
        fleet=fleet,
        workload_dir=workload_dir,
        workload_sha256=wl.sha256,
        router=Target("router", cfg.base, "router"),
        engines=[Target(e.id, e.url, "engine") for e in fleet.contract.engines],
        expected_router_counters=router_expected_counters([e.id for e in fleet.contract.engines]),
        commands=commands,
    )
    plan_diags: list[dict[str, Any]] = []
    if checkout.get("commit") != plan.client_revision or checkout.get("dirty"):
        plan_diags.append(
            {
                "kind": "client_revision_mismatch",
                "plan": plan.client_revision,
                "checkout": checkout.get("commit"),
                "dirty": checkout.get("dirty"),
            }
        )
    started = time.time()
    results: list[PointResult] = []
    with httpx.Client(timeout=10.0) as http:
        for index, point in enumerate(plan.points):
            print(
                f"{PROG}: point {point.name} ({index + 1}/{len(plan.points)}): "
                f"{point.requests} requests at {point.rate:g} request/s",
                flush=True,
            )
            result = run_point(ctx, index, point, http)
            results.append(result)
            print(f"{PROG}: point {point.name}: {result.status}" + _one_line(result), flush=True)
        images = engine_images(fleet.contract, http)
    post = post_load_check(ctx)
    journaled = read_journal(cfg.journal).records
    timeline = state_timeline(r for r in journaled if r.get("type") in TIMELINE_TYPES)
    # The serving router's own record: the server half of each row's command (MAD records
    # both) and the pinned inputs only the router knows.
    head = next((r for r in reversed(journaled) if r.get("type") == "router.start"), {})
    server = head.get("command") if isinstance(head.get("command"), str) else None
    _write_json(cfg.out / "timeline.json", timeline)
    measured = [r for r in results if r.status == "measured"]
    verdicts_ok = all((r.summary or {}).get("verdict") == "pass" for r in measured)
    overall_ok = len(measured) == len(results) and verdicts_ok and post["status"] != "fail"
    reasons = []
    if len(measured) != len(results):
        reasons.append(f"{len(results) - len(measured)} point(s) failed a gate")
    if not verdicts_ok:
        reasons.append("a measured point missed its attainment target")
    if post["status"] == "fail":
        reasons.append("the post-load KV check failed")
    fleet_c = fleet.contract
    rows = [
        {
            "model": cfg.model,
            "tp": fleet_c.engine.tp,
            "inp": plan.workload.input_tokens,
            "out": plan.workload.output_tokens,
            "num_prompts": r.requests,
            "cmd": mad_command(server, shlex.join(r.command)),
            "point": r.name,
            "summary": r.summary or {},
            "attainment_target": plan.points[r.index].attainment,
            "fleet_sha256": fleet.sha256,
            "workload_sha256": wl.sha256,
            "plan_sha256": loaded.sha256,
            "narwhal_commit": (checkout.get("commit") or "")
            + ("-dirty" if checkout.get("dirty") else ""),
            "client_revision": plan.client_revision,
        }
        for r in measured
    ]
    csv_path = cfg.out / csv_name(cfg.model)
    write_csv(csv_path, rows)
    report = {
        "schema": REPORT_SCHEMA,
        "model": cfg.model,
        "overall": "pass" if overall_ok else "fail",
        "overall_reason": "; ".join(reasons) or "every gate passed and every point met its target",
        "started_wall": started,
        "ended_wall": time.time(),
        "inputs": {
            "Narwhal checkout": f"{checkout.get('commit')}"
            + (" (tree differs)" if checkout.get("dirty") else ""),
            "Benchmark client revision (plan)": plan.client_revision,
            "Model": cfg.model,
            "Router": cfg.base,
            "Fleet": f"{fleet_c.name}, {len(fleet_c.engines)} engines, TP {fleet_c.engine.tp}",
            "Fleet SHA-256": fleet.sha256,
            "Benchmark plan SHA-256": loaded.sha256,
            "Workload": f"{wl.input_tokens} input tokens, {wl.output_tokens} output tokens, "
            f"seed {wl.seed}; {len(wl.pool.distinct)} distinct IDs in a {len(wl.pool.ids)}-token "
            f"pool ({wl.pool.source})",
            "Workload SHA-256": wl.sha256,
            "Journal": str(cfg.journal)
            + ("" if cfg.journal_source == "--journal" else f" (from {cfg.journal_source})"),
            **router_inputs(head, fleet_c, images),
        },
        "plan_diagnostics": plan_diags,
        # Each point with the budgets the plan gave it (a run may hold a point to stricter
        # ones than the fleet's, which the pinned inputs show).
        "points": [
            {**r.to_json(), "budgets": _plan_budgets(plan.points[r.index])} for r in results
        ],
        "timeline": timeline,
        "post_load_check": post,
        "csv": str(csv_path),
        "commands": ctx.commands,
        "versions": versions(),
    }
    store = fleet.profile_store_path
    report["evidence_notes"] = gather_evidence(cfg.out, cfg.journal, head, loaded.fleet_path, store)
    report["bundle"] = BUNDLE_NAME
    _write_json(cfg.out / "report.json", report)
    write_markdown(cfg.out / "report.md", report)
    bundle, digest = write_bundle(cfg.out)
    print(
        f"{PROG}: {report['overall']}: {report['overall_reason']}; report {cfg.out / 'report.md'}"
    )
    print(f"{PROG}: evidence {bundle} sha256 {digest}")
    return 0 if overall_ok else 1


def _plan_budgets(point: PlanPoint) -> dict[str, float]:
    return {
        "ttft_s": point.ttft_s,
        "tpot_s": point.tpot_s,
        "attainment": point.attainment,
        "timeout_s": point.timeout_s,
    }


def _one_line(result: PointResult) -> str:
    failed = [g.name for g in result.gates if not g.passed]
    s = result.summary or {}
    parts = []
    if s:
        parts.append(f"{s.get('result')}, verdict {s.get('verdict')}")
    if failed:
        parts.append("failed gates: " + ", ".join(failed))
    return (" (" + "; ".join(parts) + ")") if parts else ""


def engine_images(fleet: Any, http: httpx.Client) -> dict[str, str | None]:
    """Each engine's image digest as its attestation reports it (None: not reported, or no
    attestation to ask)."""
    out: dict[str, str | None] = {}
    for engine in fleet.engines:
        digest = None
        if engine.attestation_url:
            try:
                doc = http.get(engine.attestation_url).json()
                digest = doc.get("image_digest") if isinstance(doc, dict) else None
            except (httpx.HTTPError, ValueError):
                digest = None
        out[engine.id] = digest if isinstance(digest, str) else None
    return out


def router_inputs(
    head: dict[str, Any], fleet: Any, images: dict[str, str | None]
) -> dict[str, str]:
    """The pinned inputs the reference run lists beyond the plan's: the router that served
    (its journaled router.start), the profile store and check report it served on, the
    engines' image, the budgets and the first-token deadline."""
    qualification = head.get("qualification") or {}
    digests = sorted({d for d in images.values() if d})
    if not digests:
        image = "not reported by the engines' attestations"
    elif len(digests) == 1 and all(images.values()):
        image = digests[0]
    else:
        image = "; ".join(f"{e} {d or 'not reported'}" for e, d in sorted(images.items()))
    return {
        "Narwhal router": f"version {head.get('version')}, pid {head.get('pid')}"
        if head
        else "no router.start in the journal",
        "Engine image": image,
        "Profile store SHA-256": head.get("profile_sha256") or "none",
        "Check report SHA-256": (
            f"{qualification.get('report_sha256')} ({qualification.get('report')})"
            if qualification.get("status") == "qualified"
            else f"none (qualification {qualification.get('status', 'unknown')})"
        ),
        "Fleet latency budgets": f"{fleet.budgets.ttft_s:g} s TTFT, {fleet.budgets.tpot_s:g} s "
        f"TPOT; first-token deadline {fleet.engine.first_token_timeout_s:g} s",
    }


def build_parser() -> argparse.ArgumentParser:
    positive_seconds = positive(float)
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="narwhal-serve base URL")
    p.add_argument(
        "--model", required=True, help="model to request; must be the plan's fleet's model id"
    )
    p.add_argument("--plan", required=True, help="benchmark plan JSON (narwhal.benchmark-plan/v1)")
    p.add_argument(
        "--out", required=True, help="output directory (created): evidence, reports, artifacts"
    )
    p.add_argument(
        "--journal",
        help="the router's journal file (default: the path the router's /admin/state names, with "
        "--admin-token-file, else the --journal of the process listening on --base's port)",
    )
    p.add_argument("--workload", help="a prepared workload dir (default: the plan's, or prepare)")
    p.add_argument("--tokenize-url", help="engine URL for prepare's /tokenize fallback")
    p.add_argument(
        "--scrape-interval",
        type=positive_seconds,
        default=1.0,
        help="seconds between scrapes of the router's and engines' /metrics (default %(default)s)",
    )
    p.add_argument("--max-gap", type=positive_seconds, help="allowed scrape gap, s (2.5 intervals)")
    p.add_argument(
        "--ready-timeout",
        type=positive_seconds,
        default=60.0,
        help="seconds to wait for the router's /ready before each point (default %(default)s)",
    )
    p.add_argument(
        "--idle-timeout",
        type=positive_seconds,
        default=120.0,
        help="seconds to wait for an idle fleet before each point (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=positive_seconds,
        default=300.0,
        help="seconds to wait for the fleet to drain to idle after each point (default "
        "%(default)s)",
    )
    p.add_argument(
        "--journal-timeout",
        type=positive_seconds,
        default=30.0,
        help="seconds to wait for the journal to hold every request.end of a point (default "
        "%(default)s)",
    )
    p.add_argument("--admin-token-file", help="snapshot /admin/state before and after each point")
    p.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding a client API key of the router (one with keys)",
    )
    p.add_argument(
        "--strict-counters",
        action="store_true",
        help="make counter_missing a failed gate, not a diagnostic",
    )
    p.add_argument(
        "--skip-post-check",
        action="store_true",
        help="do not run narwhal-check --gates kv_transfer after the last point",
    )
    return p


def _input_problem(
    base: str, admin_token_file: Path | None, journal: str | None, api_key_env: str | None = None
) -> str | None:
    """What is wrong with the run's inputs before anything is sent: a router URL that is not
    one, a token file, a journal or a key variable that is not there (each found only
    mid-point before)."""
    if http_url_problem(base) is not None:  # a port of letters too
        return f"--base: {base!r} is not a router URL (http://HOST:PORT)"
    if api_key_env is not None and not os.environ.get(api_key_env):
        return f"--api-key-env {api_key_env}: the variable is not set"
    if admin_token_file is not None and not admin_token_file.is_file():
        return f"--admin-token-file: {admin_token_file} is not a file"
    if journal is not None and not Path(journal).is_file():
        return (
            f"--journal: {journal} is not a file (the router's journal, as narwhal-serve's "
            "--journal names it)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = args.base.rstrip("/")
    admin_token_file = Path(args.admin_token_file) if args.admin_token_file else None
    problem = _input_problem(base, admin_token_file, args.journal, args.api_key_env)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    journal_source = "--journal"
    if args.journal:
        journal = Path(args.journal)
    else:
        try:
            journal, journal_source = find_router_journal(base, admin_token_file)
        except (JournalNotFound, OSError) as exc:
            print(
                f"{PROG}: --journal not given and the router's journal was not found ({exc}): "
                "pass --journal",
                file=sys.stderr,
            )
            return 2
        print(f"{PROG}: the router's journal: {journal} (from {journal_source})", file=sys.stderr)
    cfg = RunnerConfig(
        base=base,
        model=args.model,
        plan_path=Path(args.plan),
        out=Path(args.out),
        journal=journal,
        journal_source=journal_source,
        workload=Path(args.workload) if args.workload else None,
        tokenize_url=args.tokenize_url,
        scrape_interval_s=args.scrape_interval,
        max_gap_s=args.max_gap,
        ready_timeout_s=args.ready_timeout,
        idle_timeout_s=args.idle_timeout,
        drain_timeout_s=args.drain_timeout,
        journal_timeout_s=args.journal_timeout,
        admin_token_file=admin_token_file,
        api_key_env=args.api_key_env,
        strict_counters=args.strict_counters,
        post_check=not args.skip_post_check,
    )
    try:
        return run_plan(cfg)
    except (UsageError, PlanError, WorkloadError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
