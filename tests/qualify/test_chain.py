"""narwhal-qualify end to end on the simulated fleet, as ``make qualify`` runs it: every gate
passes, the report renders in a real browser, the bundle holds the pinned inputs, a second run
reuses every step; and hidden faults stop the chain at the right step with a one-line reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from narwhal.qualify.report import PLOT_IDS
from narwhal.testing.procfs import stat_fields
from narwhal.testing.procs import wait_until
from tests.qualify.browser import load_page

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "qualify" / "local-sim.yaml"
SIM_PLAN = ROOT / "configs" / "launch" / "local-sim.yaml"
QUALIFY = str(Path(sys.executable).with_name("narwhal-qualify"))
ALL_STEPS = [
    "plan-check",
    "capture",
    "finalize",
    "profile",
    "pin",
    "plan",
    "check",
    "workload",
    "benchmark",
    "report",
    "bundle",
]


@dataclass
class Run:
    run_dir: Path
    proc: subprocess.CompletedProcess[str]

    @property
    def out(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def ledger(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "steps.json").read_text())


def qualify(run_file: Path, run_dir: Path, timeout: float = 600) -> Run:
    proc = subprocess.run(
        [QUALIFY, str(run_file), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    return Run(run_dir, proc)


def nothing_serves() -> bool:
    """No engine of local-sim.json and no router left running."""
    for port in (18080, 18100, 18101, 18102, 18103):
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return False
    return True


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = qualify(SHIPPED, tmp_path_factory.mktemp("qualify") / "run")
    assert run.proc.returncode == 0, run.out
    return run


def test_the_shipped_run_passes_every_step(first: Run) -> None:
    assert "Traceback" not in first.out
    assert first.ledger()["runs"][-1]["ran"] == ALL_STEPS
    assert "overall: PASS" in first.out
    assert "every gate passed and every point met its target" in first.out
    # The profile, every column with its unit.
    assert "prefill@256 (s)" in first.out and "decode_intercept (s/token)" in first.out
    # The reference run's results table (each point named) and role timeline end the output.
    assert "| Point | Offered rate | Completed rate including drain |" in first.out
    assert "| r2 | 2 request/s |" in first.out and "| r4 | 4 request/s |" in first.out
    assert "State timeline:" in first.out and "router.start roles" in first.out
    assert nothing_serves(), "the chain left its router or engines running"


def test_the_bundle_holds_every_pinned_input(first: Run) -> None:
    rd = first.run_dir
    bundle = rd / "qualification-artifacts.tgz"
    digest = hashlib.sha256(bundle.read_bytes()).hexdigest()
    assert (rd / "qualification-artifacts.tgz.sha256").read_text() == f"{digest}  {bundle.name}\n"
    assert f"evidence {bundle} sha256 {digest}" in first.out
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
    assert {
        "fleet-final.json",
        "fleet-qualified.json",
        "fleet-qualified.json.sha256",
        "profile-store.json",
        "check-report.json",
        "benchmark-plan.json",
        "workload/workload.json",
        "router-journal.jsonl",
        "benchmark/report.json",
        "benchmark/report.md",
        "report.html",
        "report.md",
        "steps.json",
        "inputs/run.yaml",
        "inputs/fleet.json",
        "inputs/launch-plan-0-local-sim.yaml",
        "inputs/profiling-limits.json",
    } <= names, sorted(names)
    assert "benchmark/qualification-artifacts.tgz" not in names  # its files are there already
    # The served fleet pins the profile store the chain measured, the plan that fleet.
    fleet = json.loads((rd / "fleet-qualified.json").read_text())
    assert fleet["profile_store"]["path"] == "profile-store.json"
    plan = json.loads((rd / "benchmark-plan.json").read_text())
    fleet_sha = (rd / "fleet-qualified.json.sha256").read_text().strip()
    assert plan["fleet"] == {"path": "fleet-qualified.json", "sha256": fleet_sha}
    report = json.loads((rd / "benchmark" / "report.json").read_text())
    assert all(p["status"] == "measured" for p in report["points"])


def test_the_report_renders_in_a_browser_with_every_plot(first: Run) -> None:
    page = load_page(first.run_dir / "report.html")
    assert page.console_errors == [], page.console
    for plot in PLOT_IDS:
        start = page.dom.find(f'id="{plot}"')
        assert start >= 0, f"no figure {plot}"
        assert "<svg" in page.dom[start : page.dom.find("</figure>", start)], f"{plot}: no svg"


def test_a_second_run_reuses_every_step_and_starts_nothing(first: Run) -> None:
    again = qualify(SHIPPED, first.run_dir, timeout=120)
    assert again.proc.returncode == 0, again.out
    last = again.ledger()["runs"][-1]
    assert last["ran"] == [] and last["skipped"] == ALL_STEPS
    assert "starting" not in again.out
    # A lost output is redone alone: the report needs neither the engines nor the router.
    (first.run_dir / "report.html").unlink()
    third = qualify(SHIPPED, first.run_dir, timeout=120)
    assert third.proc.returncode == 0, third.out
    ran = third.ledger()["runs"][-1]["ran"]
    assert ran[0] == "report" and set(ran) <= {"report", "bundle"}, ran
    assert "starting" not in third.out and (first.run_dir / "report.html").exists()
    # A plot is the report's output too.
    shutil.rmtree(first.run_dir / "report-plots")
    fourth = qualify(SHIPPED, first.run_dir, timeout=120)
    assert fourth.proc.returncode == 0, fourth.out
    ran = fourth.ledger()["runs"][-1]["ran"]
    assert ran[0] == "report" and set(ran) <= {"report", "bundle"}, ran
    assert (first.run_dir / "report-plots" / "ttft.svg").is_file()


# --- hidden faults ----------------------------------------------------------------------


def variant(
    directory: Path,
    *,
    engine_args: dict[str, dict[str, Any]] | None = None,
    plan_args: dict[str, Any] | None = None,
    points: list[dict[str, Any]] | None = None,
    **run_over: Any,
) -> Path:
    """The shipped run with its own launch plan (per-engine or plan-wide sim flags), short
    answers and small points."""
    plan = yaml.safe_load(SIM_PLAN.read_text())
    if plan_args is not None:
        plan["simulated"]["args"] = plan_args
    for engine in plan["engines"]:
        if engine_args and engine["id"] in engine_args:
            engine["args"] = engine_args[engine["id"]]
    plan_path = directory / "plan.yaml"
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    run = yaml.safe_load(SHIPPED.read_text())
    run["launch_plans"] = [str(plan_path)]
    run["benchmark"]["points"] = points or [{"name": "r4", "rate": 4, "requests": 8}]
    # Short answers: the faults need the chain to reach their step, not the reference shape
    # (the shipped run above measures that). The probes stay the shipped ones: the pace gate
    # needs prefills long enough to time (1,024 tokens take ~15 ms here, inside its noise).
    run["workload"] = {"input_tokens": 8192, "output_tokens": 32, "seed": 1729}
    # Pace is none of these runs' subject, and it comes before the gate a fault is for: load
    # that moves between the profile and the check (this runs beside other suites) moved every
    # engine's prefill +85% once (tests/check/test_check_live.py), so it is allowed here.
    run["check"] = {**run["check"], "pace_tolerance": 2.0}
    run.update(run_over)
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return path


def stopped_at(run: Run, step: str) -> str:
    """The one-line reason of a chain that stopped at ``step``."""
    assert run.proc.returncode == 1, run.out
    assert "Traceback" not in run.out
    lines = [ln for ln in run.proc.stdout.splitlines() if ln.startswith("narwhal-qualify: stopped")]
    assert len(lines) == 1 and lines[0].startswith(f"narwhal-qualify: stopped at {step}: "), run.out
    assert nothing_serves(), "the chain left its router or engines running"
    return lines[0]


def test_a_pair_whose_kv_transfer_fails_stops_at_the_check(tmp_path: Path) -> None:
    # e2's READs of KV stall past the fleet's 2.5 s first-token deadline.
    run_file = variant(tmp_path, engine_args={"e2": {"--fault-hang-kv-read-s": 4}})
    run = qualify(run_file, tmp_path / "run")
    line = stopped_at(run, "check")
    assert "gate kv_transfer failed" in line
    ran = run.ledger()["runs"][-1]["ran"]
    assert ran == ALL_STEPS[: ALL_STEPS.index("check")], ran


def test_prefix_caching_on_stops_at_the_benchmark(tmp_path: Path) -> None:
    # Engines and fleet agree that caching is on (vLLM's default); the run measures with it off.
    fleet = json.loads((ROOT / "configs/fleet/local-sim.json").read_text())
    fleet["engine"]["prefix_caching"] = {"enabled": True}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    run_file = variant(tmp_path, plan_args={"--time-scale": 10}, fleet=str(tmp_path / "fleet.json"))
    line = stopped_at(qualify(run_file, tmp_path / "run"), "benchmark")
    assert "gate prefix_caching_off failed" in line
    assert "vllm:cache_config_info says enable_prefix_caching=True" in line


SIM_ENGINES = [f"http://127.0.0.1:{port}" for port in (18100, 18101, 18102, 18103)]


def _set_faults(body: dict[str, Any]) -> None:
    for url in SIM_ENGINES:
        reply = httpx.post(
            f"{url}/sim/faults", json=body, headers={"Authorization": "Bearer qa"}, timeout=10
        )
        assert reply.status_code == 200, reply.text


@contextlib.contextmanager
def slowed_during_the_benchmark(run_dir: Path) -> Iterator[list[str]]:
    """Once the benchmark step starts, every engine runs 20x slower (a decode step of ~0.5 s
    against the 0.3 s TPOT budget: every request misses it), which neither the profile nor the
    check saw; back to normal once the point is measured, so the post-load KV check passes."""
    done: list[str] = []

    def act() -> None:
        log = run_dir / "logs" / "10-benchmark.log"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not log.exists():
            time.sleep(0.2)
        _set_faults({"slowdown": 20})
        done.append("slowed")
        while time.monotonic() < deadline and "point r4: measured" not in log.read_text():
            time.sleep(0.2)
        _set_faults({"slowdown": 1})
        done.append("restored")

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    try:
        yield done
    finally:
        thread.join(30)


def test_a_fleet_that_fails_its_benchmark_gets_its_report_and_bundle(tmp_path: Path) -> None:
    """Every gate passes, the point misses its attainment target: a finished measurement. The
    report says fail and why, the bundle is written, and the command says the fleet did not
    qualify (exit 1); a rerun does not measure again."""
    plan_args = {"--time-scale": 10, "--no-enable-prefix-caching": True, "--admin-token": "qa"}
    run_file = variant(tmp_path, plan_args=plan_args)
    run_dir = tmp_path / "run"
    with slowed_during_the_benchmark(run_dir) as done:
        run = qualify(run_file, run_dir)
    assert done == ["slowed", "restored"], run.out
    assert run.proc.returncode == 1, run.out
    assert "Traceback" not in run.out and "stopped at" not in run.out, run.out
    assert run.ledger()["runs"][-1]["ran"] == ALL_STEPS
    verdict = [ln for ln in run.proc.stdout.splitlines() if "did not qualify" in ln]
    assert len(verdict) == 1 and verdict[0].startswith(
        "narwhal-qualify: the fleet did not qualify: benchmark: point r4: "
    ), run.out
    assert "below its target 0.95" in verdict[0]
    assert run.proc.stdout.rstrip().endswith(verdict[0])
    for name in ("report.html", "report.md", "qualification-artifacts.tgz"):
        assert (run_dir / name).is_file(), name
    md = (run_dir / "report.md").read_text()
    assert "Overall: **fail**" in md and "- point r4: " in md and "over the TPOT budget" in md
    assert nothing_serves()

    again = qualify(run_file, run_dir, timeout=120)
    assert again.proc.returncode == 1, again.out
    last = again.ledger()["runs"][-1]
    assert last["ran"] == [] and last["skipped"] == ALL_STEPS, again.out
    assert "starting" not in again.out
    assert verdict[0] in again.proc.stdout.splitlines(), again.out


def test_a_tag_only_image_stops_at_the_plan_check(tmp_path: Path) -> None:
    plan = yaml.safe_load((ROOT / "configs/launch/kimi-k3-mi355x.yaml").read_text())
    plan["image"] = plan["image"].split("@")[0] + ":v0.29.0"
    plan_path = tmp_path / "kimi.yaml"
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    run = yaml.safe_load(SHIPPED.read_text())
    run.update(
        fleet=str(ROOT / "configs/fleet/kimi-k3-mi355x.example.json"),
        launch_plans=[str(plan_path)],
    )
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(run, sort_keys=False))
    line = stopped_at(qualify(run_file, tmp_path / "run", timeout=120), "plan-check")
    assert "is a tag without a digest" in line


def _restart(pid: int) -> subprocess.Popen[bytes]:
    """kill -9 an engine and start it again exactly as it ran: a new generation."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    raw_env = Path(f"/proc/{pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
    env = dict(e.split(b"=", 1) for e in raw_env if b"=" in e)
    cwd = os.readlink(f"/proc/{pid}/cwd")
    os.kill(pid, signal.SIGKILL)
    # Gone (or a zombie: its sockets closed) before its replacement binds the same ports.
    assert wait_until(lambda: not _alive(pid), 10), f"engine pid {pid} outlived SIGKILL"
    return subprocess.Popen(
        [a.decode() for a in argv],
        env={k.decode(): v.decode() for k, v in env.items()},
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextlib.contextmanager
def restarted_during(run_dir: Path, log_name: str, engine: str) -> Iterator[list[Any]]:
    """Once the step's log appears, restart ``engine``; the restarted process is killed at
    the end (the chain does not own it)."""
    started: list[subprocess.Popen[bytes]] = []

    def act() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (run_dir / "logs" / log_name).exists():
            time.sleep(0.2)
        time.sleep(1.0)
        pid = int((run_dir / "engines" / f"engine-{engine}.pid").read_text())
        started.append(_restart(pid))

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    try:
        yield started
    finally:
        thread.join(10)
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_an_engine_restarted_mid_run_stops_the_step_it_happened_in(tmp_path: Path) -> None:
    run_file = variant(tmp_path, points=[{"name": "r2", "rate": 2, "requests": 40}])
    run_dir = tmp_path / "run"
    with restarted_during(run_dir, "10-benchmark.log", "e1") as restarted:
        run = qualify(run_file, run_dir)
    assert restarted, "the engine was never restarted"
    line = stopped_at(run, "benchmark")
    assert "engine e1 restarted: generation" in line, line


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def test_a_killed_chain_stops_everything_it_started(tmp_path: Path) -> None:
    """SIGTERM to narwhal-qualify mid-benchmark: the step (in a session of its own), the router
    and the engines stop with it; the ledger keeps the finished steps for the rerun."""
    run_file = variant(tmp_path, points=[{"name": "r2", "rate": 2, "requests": 60}])
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [QUALIFY, str(run_file), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "logs" / "10-benchmark.log").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "never reached benchmark"
            time.sleep(0.2)
        time.sleep(2)
        assert _step_processes(run_dir, (b"benchmark_runner.py",)), (
            "the benchmark step is not running"
        )
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out.decode()
    assert "interrupted" in out.decode()
    assert _processes_mentioning(str(run_dir)) == []
    assert nothing_serves()
    ledger = json.loads((run_dir / "steps.json").read_text())
    assert "workload" in ledger["steps"] and "benchmark" not in ledger["steps"]
    assert ledger["runs"][-1]["outcome"] == "interrupted"


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is gone to reap it."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _step_processes(
    run_dir: Path, scripts: tuple[bytes, ...] = (b"benchmark_runner.py", b"load_trial.py")
) -> list[int]:
    """The benchmark step's processes working in ``run_dir`` (the runner, its load generator):
    those running one of ``scripts``. The working directory tells this run's from another
    test worker's."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if not any(script in cmdline for script in scripts):
                continue
            if Path(os.readlink(entry / "cwd")) == run_dir.resolve():
                found.append(int(entry.name))
    return found


def test_a_step_a_chain_killed_outright_left_running_is_stopped_by_the_next(
    tmp_path: Path,
) -> None:
    """SIGKILL to narwhal-qualify mid-benchmark leaves the step running (its own session:
    nothing stops it); the next chain on the run directory stops it before anything runs, so
    its load never reaches the new router and the evidence is the new chain's alone."""
    run_file = variant(tmp_path, points=[{"name": "r2", "rate": 2, "requests": 20}])
    run_dir = tmp_path / "run"
    argv = [QUALIFY, str(run_file), "--run-dir", str(run_dir)]
    killed = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=ROOT)
    rerun = None
    try:
        deadline = time.monotonic() + 300
        # This run's benchmark runner (the workload step before it runs load_trial.py too;
        # another test worker's runner works in another directory).
        while not _step_processes(run_dir, (b"benchmark_runner.py",)):
            assert killed.poll() is None and time.monotonic() < deadline, "never reached benchmark"
            time.sleep(0.2)
        time.sleep(2)  # its load generator started
        # Frozen first: with its output's reader gone, the step dies at its next line
        # (BrokenPipeError), which on a loaded host came before the next chain had started
        # and looked (a fresh clone's make test). Frozen, it stays until that chain stops it.
        left = _step_processes(run_dir)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        killed.kill()
        killed.wait(timeout=30)
        time.sleep(1)
        assert left and all(_alive(pid) for pid in left), "the step died with the chain"
        rerun = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, text=True
        )
        out, _ = rerun.communicate(timeout=600)
    finally:
        if killed.poll() is None:
            killed.kill()
        if rerun is not None and rerun.poll() is None:
            rerun.send_signal(signal.SIGTERM)
            try:
                rerun.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                rerun.kill()
        for pid in _step_processes(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert rerun.returncode == 0, out
    assert "stopping the step an earlier run here left running" in out, out
    assert not any(_alive(pid) for pid in left)
    assert nothing_serves()
    # The journal the evidence holds: the rerun's requests only (one run id), all of them.
    starts = [
        json.loads(line)
        for line in (run_dir / "router-journal.jsonl").read_text().splitlines()
        if '"request.start"' in line
    ]
    runs = {r["client_request_id"].rsplit("-", 1)[0] for r in starts if r.get("client_request_id")}
    assert len(runs) == 1, runs
