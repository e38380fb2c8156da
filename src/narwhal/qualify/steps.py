"""The qualification chain's steps, in the reference run's order, as commands.

Each step is the command an operator would type (the reference run's spelling, run from the
run directory so its files are named as the run names them) or, for the few links no tool
makes, a short in-process action: pinning the profile store in the fleet, writing the
benchmark plan against that fleet, the report, the bundle. A step declares the files it reads
and writes (the ledger keys and checks them) and what must be running for it: the fleet's
engines, the router. ``capture`` and ``finalize`` *observe* the running fleet: they run
whenever the fleet is up, and what follows them reruns only if what they saw changed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from narwhal.contract import canonical_json, load_fleet, sha256_hex
from narwhal.qualify.bundle import BUNDLE_NAME, write_bundle
from narwhal.qualify.console import profile_lines
from narwhal.qualify.layout import (
    BENCHMARK,
    CHECK_REPORT,
    FLEET_FINAL,
    FLEET_QUALIFIED,
    JOURNAL,
    PLAN,
    PLOTS_DIR,
    PROFILE_STORE,
    WORKLOAD,
)
from narwhal.qualify.runfile import LoadedRun, RunFile

__all__ = [
    "Step",
    "benchmark_verdict",
    "chain_steps",
    "console_script",
    "explain_benchmark",
    "explain_check",
    "workload_prompts",
]


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    argv: list[str] = field(default_factory=list)  # empty: ``action`` runs in-process
    action: Callable[[], str] | None = None  # returns its one-line result
    inputs: dict[str, Path] = field(default_factory=dict)
    outputs: dict[str, Path] = field(default_factory=dict)
    needs: frozenset[str] = frozenset()  # "fleet" (engines up), "router" (narwhal-serve up)
    observes: bool = False
    echo: bool = False  # the command's stdout lines are the step's progress
    explain: Callable[[Path], str | None] | None = None  # why it failed, from its outputs
    # For a step that measures the fleet: given its non-zero exit status, the fleet's failing
    # verdict (one line) when the step finished its measurement and the fleet failed it, or
    # None when the step itself broke. A failing verdict is a finished result: the chain goes
    # on to the report and the bundle, and then says the fleet did not qualify.
    verdict: Callable[[Path, int], str | None] | None = None
    # Lines shown on the console once the step is done (read from its outputs).
    show: Callable[[Path], list[str]] | None = None
    not_declared: str | None = None  # listed for the record, never run
    # What an in-process action depends on besides its input files (keys the step too).
    params: dict[str, str] = field(default_factory=dict)

    @property
    def key_args(self) -> list[str]:
        return self.argv + [f"{k}={v}" for k, v in sorted(self.params.items())]


def _fleet_qualified(run_dir: Path) -> str:
    """fleet-final.json with the profile store pinned (path relative to the run directory,
    where every step runs), and its .sha256: the fleet the check qualifies and the router
    serves."""
    doc = json.loads((run_dir / FLEET_FINAL).read_text(encoding="utf-8"))
    store = json.loads((run_dir / PROFILE_STORE).read_text(encoding="utf-8"))
    doc["profile_store"] = {"path": PROFILE_STORE, "sha256": sha256_hex(store)}
    out = run_dir / FLEET_QUALIFIED
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    digest = load_fleet(out).sha256
    out.with_name(out.name + ".sha256").write_text(digest + "\n")
    return f"profile store {doc['profile_store']['sha256'][:12]} pinned; fleet {digest[:12]}"


def _git_revision(checkout: Path) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def _benchmark_plan(loaded: LoadedRun, revision: str) -> str:
    run, run_dir = loaded.run, loaded.run_dir
    fleet_sha = (run_dir / (FLEET_QUALIFIED + ".sha256")).read_text().strip()
    plan: dict[str, Any] = {
        "schema": "narwhal.benchmark-plan/v1",
        "fleet": {"path": FLEET_QUALIFIED, "sha256": fleet_sha},
        "client_revision": revision,
        "workload": {
            "input_tokens": run.workload.input_tokens,
            "output_tokens": run.workload.output_tokens,
        },
        "points": [
            {
                "name": p.name,
                "rate": p.rate,
                "requests": p.requests,
                "ttft_s": run.budgets.ttft_s,
                "tpot_s": run.budgets.tpot_s,
                "attainment": run.budgets.attainment,
                "timeout_s": run.benchmark.timeout_s,
            }
            for p in run.benchmark.points
        ],
        "seed": run.workload.seed,
        "workload_dir": WORKLOAD,
        "prefix_caching": run.benchmark.prefix_caching,
    }
    (run_dir / PLAN).write_text(json.dumps(plan, indent=2) + "\n", encoding="utf-8")
    return f"{len(plan['points'])} points; plan {sha256_hex(plan)[:12]}"


def explain_check(run_dir: Path) -> str | None:
    """The first failed gate's own explanation, from the check report."""
    try:
        report = json.loads((run_dir / CHECK_REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for gate in report.get("gates") or []:
        if gate.get("verdict") == "fail":
            first = (gate.get("failures") or [""])[0]
            return f"gate {gate.get('name')} failed: {gate.get('summary')}" + (
                f": {first}" if first else ""
            )
    return None


def explain_benchmark(run_dir: Path) -> str | None:
    """The first point that failed a gate or its verdict, or the post-load check."""
    try:
        report = json.loads((run_dir / BENCHMARK / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for point in report.get("points") or []:
        failed = [g for g in point.get("gates") or [] if not g.get("passed")]
        if failed:
            detail = failed[0].get("detail")
            if isinstance(detail, list) and all(isinstance(d, str) for d in detail):
                text = "; ".join(detail)
            else:
                text = detail if isinstance(detail, str) else canonical_json(detail).decode()
            return f"point {point.get('name')}: gate {failed[0].get('name')} failed: {text}"[:400]
        summary = point.get("summary") or {}
        if point.get("status") == "measured" and summary.get("verdict") not in (None, "pass"):
            verdict = summary.get("verdict")
            return f"point {point.get('name')}: {summary.get('result')} (verdict {verdict})"
    post = report.get("post_load_check") or {}
    if post.get("status") not in (None, "pass", "skipped"):
        return f"post-load KV check {post.get('status')}: {post.get('reason')}"
    return None


# benchmark_runner.py's exit status when the plan ran to its end and something failed (a gate,
# a verdict, the post-load check); 2 is bad input, anything else a crash.
_RUNNER_FAILED = 1


def benchmark_verdict(run_dir: Path, code: int) -> str | None:
    """The fleet's failing verdict when benchmark_runner.py measured every point and a point
    missed its attainment target: a valid measurement (every gate passed, the post-load KV
    check did not fail), which the report and the bundle must still hold. None when the
    runner broke or a gate failed: the evidence does not back a measurement then."""
    if code != _RUNNER_FAILED:
        return None
    out = run_dir / BENCHMARK
    try:
        report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    # The runner writes its bundle's digest last: without it the run did not reach its end
    # (a crash after the report is an exit status 1 too).
    if not isinstance(report, dict) or not (out / (BUNDLE_NAME + ".sha256")).is_file():
        return None
    points = report.get("points")
    if report.get("overall") != "fail" or not isinstance(points, list) or not points:
        return None
    post = report.get("post_load_check") or {}
    if not isinstance(post, dict) or post.get("status") not in (None, "pass", "skip", "skipped"):
        return None
    missed = []
    for point in points:
        if not isinstance(point, dict) or point.get("status") != "measured":
            return None  # a point that failed a gate (or never ran): nothing to stand on
        summary = point.get("summary")
        if not isinstance(summary, dict):
            return None
        if summary.get("verdict") != "pass":
            missed.append(_missed(point, summary))
    return "; ".join(missed) or None


def _missed(point: dict[str, Any], summary: dict[str, Any]) -> str:
    """``point r4: 22/24 within limits, attainment 0.917 below its target 0.95``."""
    attainment, target = summary.get("attainment"), (summary.get("budgets") or {}).get("attainment")
    line = f"point {point.get('name')}: {summary.get('result')}"
    if isinstance(attainment, int | float) and isinstance(target, int | float):
        line += f", attainment {attainment:.3f} below its target {target:g}"
    return line


def console_script(name: str) -> str:
    """A console script of this install (beside the interpreter), as the reference run calls
    them (``.venv/bin/narwhal-check``)."""
    return str(Path(sys.executable).with_name(name))


def workload_prompts(run: RunFile) -> int:
    """The prompts the workload needs besides its warmup (``load_trial.py prepare
    --num-prompts``): every point sends the workload's first ``requests`` prompts after the
    warmup, so the largest point's requests."""
    return max(p.requests for p in run.benchmark.points)


# load_trial.py prepare's --num-prompts default: the workload of every run before the size
# was given (tools/measurement is not imported here).
PREPARE_DEFAULT_PROMPTS = 256


def _workload_size(run: RunFile) -> list[str]:
    """``--num-prompts`` for a run whose largest point needs more than prepare's default
    (prepare adds the warmup prompt to these). In the command, so a change of size redoes
    the step; left out up to the default, so the runs made before it keep their workload (a
    key that changed would measure every finished run again)."""
    needed = workload_prompts(run)
    return ["--num-prompts", str(needed)] if needed > PREPARE_DEFAULT_PROMPTS else []


def _csv(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def chain_steps(loaded: LoadedRun, write_report: Callable[[Path, str], str]) -> list[Step]:
    """Every step of the run, in order (``write_report`` renders the report and returns its
    one-line result; it is passed in so the chain's order can be read without the plots)."""
    run, rd, tools = loaded.run, loaded.run_dir, loaded.checkout / "tools"
    py = sys.executable
    fleet, plans = loaded.fleet_path, loaded.launch_plans
    router = f"http://{run.router.host}:{run.router.port}"
    prof = run.profiling
    revision = _git_revision(loaded.checkout)
    steps = [
        Step(
            "plan-check",
            "launch plans obey their rules and agree with the fleet",
            [
                py,
                str(tools / "deployment/launch_plan.py"),
                "check",
                *map(str, plans),
                "--fleet",
                str(fleet),
            ],
            inputs={"fleet": fleet, **{f"plan{i}": p for i, p in enumerate(plans)}},
        ),
    ]
    if loaded.deployment_file is not None and run.deployment is not None:
        steps.append(
            Step(
                "deploy",
                "the pinned package built and installed on every host",
                [
                    py,
                    str(tools / "deployment/deploy_hosts.py"),
                    "--deployment",
                    str(loaded.deployment_file),
                    "--commit",
                    run.deployment.commit,
                    "--repo",
                    str(loaded.checkout),
                    "--report",
                    "deploy-report.json",
                ],
                inputs={"deployment": loaded.deployment_file},
                outputs={"deploy-report.json": rd / "deploy-report.json"},
                echo=True,
            )
        )
    else:
        steps.append(Step("deploy", "", not_declared="no deployment declared: engines run here"))
    steps += [
        Step(
            "capture",
            "the running engines' live facts (KV geometry, NIXL side channels)",
            [
                py,
                str(tools / "deployment/launch_plan.py"),
                "capture",
                *map(str, plans),
                "--out",
                "live.json",
            ],
            outputs={"live.json": rd / "live.json"},
            needs=frozenset({"fleet"}),
            observes=True,
        ),
        Step(
            "finalize",
            "the fleet filled from the engines' attestations",
            [
                py,
                str(tools / "deployment/attestation_contract.py"),
                "finalize-fleet",
                "--fleet",
                str(fleet),
                "--out",
                FLEET_FINAL,
                "--live",
                "live.json",
            ],
            inputs={"live.json": rd / "live.json"},
            outputs={FLEET_FINAL: rd / FLEET_FINAL},
            needs=frozenset({"fleet"}),
            observes=True,
        ),
        Step(
            "profile",
            "latency models of the current engine generations",
            [
                console_script("narwhal-profile"),
                "--fleet",
                FLEET_FINAL,
                "--limits",
                str(loaded.limits),
                "--prefill-lens",
                _csv(prof.prefill_lens),
                "--decode-input-lens",
                _csv(prof.decode_input_lens),
                "--decode-concurrency",
                _csv(prof.decode_concurrency),
                "--decode-tokens",
                str(prof.decode_tokens),
                "--prefill-repeats",
                str(prof.prefill_repeats),
                # As the reference run spells it: the store is profile-store.json where it runs.
            ],
            inputs={FLEET_FINAL: rd / FLEET_FINAL, "limits": loaded.limits},
            outputs={PROFILE_STORE: rd / PROFILE_STORE},
            needs=frozenset({"fleet"}),
            # The store's table with units on every column (narwhal-profile's own, without
            # them, stays in the step's log).
            show=profile_lines,
        ),
        Step(
            "pin",
            "the profile store pinned in the fleet the router will serve",
            action=lambda: _fleet_qualified(rd),
            inputs={FLEET_FINAL: rd / FLEET_FINAL, PROFILE_STORE: rd / PROFILE_STORE},
            outputs={
                FLEET_QUALIFIED: rd / FLEET_QUALIFIED,
                FLEET_QUALIFIED + ".sha256": rd / (FLEET_QUALIFIED + ".sha256"),
            },
        ),
        Step(
            "plan",
            "the benchmark plan against that fleet",
            action=lambda: _benchmark_plan(loaded, revision),
            inputs={FLEET_QUALIFIED: rd / FLEET_QUALIFIED, "run": loaded.path},
            outputs={PLAN: rd / PLAN},
            params={"client_revision": revision},
        ),
        Step(
            "check",
            "every preflight gate against the running engines",
            [console_script("narwhal-check"), "--fleet", FLEET_QUALIFIED, "--plan", PLAN]
            + ["--report", CHECK_REPORT, "--quiet"]
            + (["--pace-repeats", str(run.check.pace_repeats)] if run.check.pace_repeats else [])
            + (
                ["--pace-tolerance", repr(run.check.pace_tolerance)]
                if run.check.pace_tolerance
                else []
            )
            + (["--kv-probes", str(run.check.kv_probes)] if run.check.kv_probes else []),
            inputs={FLEET_QUALIFIED: rd / FLEET_QUALIFIED, PLAN: rd / PLAN},
            outputs={CHECK_REPORT: rd / CHECK_REPORT},
            needs=frozenset({"fleet"}),
            echo=True,
            explain=explain_check,
        ),
        Step(
            "workload",
            "one seeded workload for every point",
            [
                py,
                str(tools / "measurement/load_trial.py"),
                "prepare",
                "--base",
                router,
                "--input-tokens",
                str(run.workload.input_tokens),
                "--output-tokens",
                str(run.workload.output_tokens),
                "--seed",
                str(run.workload.seed),
                *_workload_size(run),
                "--out",
                WORKLOAD,
            ],
            inputs={FLEET_QUALIFIED: rd / FLEET_QUALIFIED},
            outputs={WORKLOAD: rd / WORKLOAD},
            needs=frozenset({"fleet", "router"}),
        ),
        Step(
            "benchmark",
            "the plan's points, with gates, reconciliation and evidence",
            [
                py,
                str(tools / "measurement/benchmark_runner.py"),
                "--base",
                router,
                "--model",
                loaded.fleet.contract.model.id,
                "--plan",
                PLAN,
                "--out",
                BENCHMARK,
            ],
            inputs={PLAN: rd / PLAN, WORKLOAD: rd / WORKLOAD, CHECK_REPORT: rd / CHECK_REPORT},
            outputs={BENCHMARK: rd / BENCHMARK},
            needs=frozenset({"fleet", "router"}),
            echo=True,
            explain=explain_benchmark,
            verdict=benchmark_verdict,
        ),
        Step(
            "report",
            "the report: results, distributions, the KV gate, the role timeline",
            action=lambda: write_report(rd, run.name),
            inputs={
                BENCHMARK: rd / BENCHMARK,
                CHECK_REPORT: rd / CHECK_REPORT,
                PROFILE_STORE: rd / PROFILE_STORE,
                JOURNAL: rd / JOURNAL,
            },
            params={"title": run.name},
            # The plots too: report.md links them, and a deleted one is redone on resume.
            outputs={
                "report.html": rd / "report.html",
                "report.md": rd / "report.md",
                PLOTS_DIR: rd / PLOTS_DIR,
            },
        ),
    ]
    evidence = {
        name: path
        for step in steps
        for name, path in step.outputs.items()
        if name != "live.json"  # its capture time changes on every look: not evidence of change
    }
    steps.append(
        Step(
            "bundle",
            "the evidence bundle and its SHA-256",
            action=lambda: _bundle(loaded),
            inputs={
                **evidence,
                **steps[0].inputs,
                "run": loaded.path,
                "limits": loaded.limits,
                JOURNAL: rd / JOURNAL,
            },
            outputs={
                BUNDLE_NAME: rd / BUNDLE_NAME,
                BUNDLE_NAME + ".sha256": rd / (BUNDLE_NAME + ".sha256"),
            },
        )
    )
    return steps


def _copy_inputs(loaded: LoadedRun) -> None:
    """The run's own inputs, which live outside the run directory, into RUN/inputs/: the run
    file, the fleet as written, the launch plans, the profiling limits, the deployment."""
    inputs = loaded.run_dir / "inputs"
    if inputs.exists():
        shutil.rmtree(inputs)
    inputs.mkdir()
    named = [("run.yaml", loaded.path), ("fleet.json", loaded.fleet_path)]
    named += [(f"launch-plan-{i}-{p.name}", p) for i, p in enumerate(loaded.launch_plans)]
    named.append(("profiling-limits.json", loaded.limits))
    if loaded.deployment_file is not None:
        named.append((f"deployment-{loaded.deployment_file.name}", loaded.deployment_file))
    for name, path in named:
        shutil.copyfile(path, inputs / name)


def _bundle(loaded: LoadedRun) -> str:
    _copy_inputs(loaded)
    bundle, digest = write_bundle(loaded.run_dir)
    return f"{bundle} sha256 {digest}"
