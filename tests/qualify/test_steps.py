"""The chain's steps and their bookkeeping, without a fleet: the benchmark step's command is
replaced by a stand-in runner that leaves what benchmark_runner.py leaves, so what the chain
makes of a fleet that failed its benchmark, of a broken runner, of a deleted plot and of the
workload's size is seen in seconds."""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from narwhal.qualify.chain import ChainFailed, run_chain
from narwhal.qualify.ledger import content_sha256
from narwhal.qualify.runfile import LoadedRun, load_run_file
from narwhal.qualify.steps import Step, chain_steps
from tests.check.support import make_store

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "qualify" / "local-sim.yaml"


def _loaded(tmp_path: Path, **over: Any) -> LoadedRun:
    doc = yaml.safe_load(SHIPPED.read_text())
    doc.update(over)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_run_file(path, ROOT, str(tmp_path / "run"))


def _step(steps: list[Step], name: str) -> Step:
    return next(s for s in steps if s.name == name)


def _point(name: str, within: int, requests: int, target: float = 0.95) -> dict[str, Any]:
    attainment = within / requests
    return {
        "index": 0,
        "name": name,
        "rate": 4.0,
        "requests": requests,
        "status": "measured",
        "gates": [{"name": "router_ready", "passed": True, "detail": "200"}],
        "summary": {
            "requests": requests,
            "completed": requests,
            "by_outcome": {"ok": requests},
            "within_limits": within,
            "attainment": attainment,
            "verdict": "pass" if attainment >= target else "fail",
            "result": f"{within}/{requests} within limits",
            "budgets": {"ttft_s": 1.0, "tpot_s": 0.3, "attainment": target},
        },
    }


def _runner(
    where: Path, report: dict[str, Any] | None, code: int, finished: bool = True
) -> list[str]:
    """A stand-in for benchmark_runner.py: writes ``report`` (and, ``finished``, the digest of
    its bundle, the runner's last act) under benchmark/ and exits ``code``."""
    script = textwrap.dedent(
        f"""
        import json, pathlib, sys
        out = pathlib.Path("benchmark")
        out.mkdir()
        report = json.loads({json.dumps(json.dumps(report))})
        if report is not None:
            (out / "report.json").write_text(json.dumps(report))
            (out / "report.md").write_text("# Benchmark report\\n")
            print("benchmark_runner.py: fail: a measured point missed its attainment target")
        if {finished!r}:
            (out / "qualification-artifacts.tgz.sha256").write_text("0" * 64 + "\\n")
        sys.exit({code})
        """
    )
    path = where / "benchmark_runner.py"
    path.write_text(script)
    return [sys.executable, str(path)]


def _measured_fail() -> dict[str, Any]:
    return {
        "overall": "fail",
        "overall_reason": "a measured point missed its attainment target",
        "points": [_point("r2", 24, 24), _point("r4", 22, 24)],
        "post_load_check": {"status": "pass", "reason": "exit 0: "},
    }


def _tail(loaded: LoadedRun, runner: list[str]) -> list[Step]:
    """The chain's last three steps as chain_steps makes them (the report is the real one),
    with the benchmark's command replaced and nothing running needed."""
    steps = chain_steps(loaded, _real_report)
    bench = replace(_step(steps, "benchmark"), argv=runner, needs=frozenset(), echo=False)
    return [bench, _step(steps, "report"), _step(steps, "bundle")]


def _real_report(run_dir: Path, title: str) -> str:
    from narwhal.qualify.report import write_report

    html, md = write_report(run_dir, title=title)
    return f"{html.name} and {md.name}"


def test_a_fleet_that_fails_its_benchmark_still_gets_its_report_and_bundle(
    tmp_path: Path,
) -> None:
    loaded = _loaded(tmp_path)
    rd = loaded.run_dir
    said: list[str] = []
    result = run_chain(
        loaded, _tail(loaded, _runner(tmp_path, _measured_fail(), 1)), out=said.append
    )
    assert result.ran == ["benchmark", "report", "bundle"], said
    why = "point r4: 22/24 within limits, attainment 0.917 below its target 0.95"
    assert result.failed_verdicts == [("benchmark", why)]
    for name in ("report.html", "report.md", "qualification-artifacts.tgz"):
        assert (rd / name).is_file(), name
    md = (rd / "report.md").read_text()
    assert "Overall: **fail**" in md and "The fleet did not qualify:" in md
    assert f"- {why}" in md and "FAIL (0.917 < target 0.95)" in md
    html = (rd / "report.html").read_text()
    assert 'class="verdict fail"' in html and why in html
    ledger = json.loads((rd / "steps.json").read_text())
    assert ledger["steps"]["benchmark"]["failed_verdict"] == why
    assert ledger["runs"][-1]["outcome"] == f"not qualified: benchmark: {why}"

    # A rerun does not measure again: the measurement is done, and still a failing one.
    said.clear()
    again = run_chain(
        loaded, _tail(loaded, _runner(tmp_path, _measured_fail(), 1)), out=said.append
    )
    assert again.ran == [] and again.skipped == ["benchmark", "report", "bundle"], said
    assert again.failed_verdicts == [("benchmark", why)]
    # And how to measure a mended fleet again, nothing it reads having changed.
    assert any("to measure again, delete benchmark " in line for line in said), said


@pytest.mark.parametrize(
    ("report", "code", "finished", "needle"),
    [
        # The runner crashed before its report: nothing measured.
        (None, 1, False, "exited with status 1"),
        # A crash after the report, before the bundle it writes last.
        (_measured_fail(), 1, False, "point r4: 22/24 within limits"),
        # Bad input (exit 2), whatever is on disk.
        (_measured_fail(), 2, True, "point r4: 22/24 within limits"),
    ],
)
def test_a_benchmark_step_that_broke_still_stops_the_chain(
    tmp_path: Path, report: dict[str, Any] | None, code: int, finished: bool, needle: str
) -> None:
    loaded = _loaded(tmp_path)
    with pytest.raises(ChainFailed) as info:
        run_chain(
            loaded, _tail(loaded, _runner(tmp_path, report, code, finished)), out=lambda _: None
        )
    assert info.value.step == "benchmark" and needle in str(info.value), str(info.value)
    assert not (loaded.run_dir / "report.html").exists()
    assert not (loaded.run_dir / "qualification-artifacts.tgz").exists()


def test_only_a_measured_miss_is_a_finished_measurement(tmp_path: Path) -> None:
    from narwhal.qualify.steps import benchmark_verdict

    out = tmp_path / "benchmark"
    out.mkdir()
    (out / "qualification-artifacts.tgz.sha256").write_text("0" * 64 + "\n")

    def verdict(report: dict[str, Any], code: int = 1) -> str | None:
        (out / "report.json").write_text(json.dumps(report))
        return benchmark_verdict(tmp_path, code)

    assert verdict(_measured_fail()) == (
        "point r4: 22/24 within limits, attainment 0.917 below its target 0.95"
    )
    assert verdict(_measured_fail(), code=2) is None
    gate_failed = _measured_fail()
    gate_failed["points"][0]["status"] = "gate_failed"
    assert verdict(gate_failed) is None  # the evidence does not back a measurement
    post_failed = _measured_fail()
    post_failed["post_load_check"] = {"status": "fail", "reason": "exit 1: kv_transfer"}
    assert verdict(post_failed) is None
    passed = {**_measured_fail(), "overall": "pass", "points": [_point("r2", 24, 24)]}
    assert verdict(passed) is None


def _workload(loaded: LoadedRun) -> Step:
    return _step(chain_steps(loaded, _real_report), "workload")


def test_the_workload_is_sized_to_the_largest_point(tmp_path: Path) -> None:
    points = [{"name": "r2", "rate": 2, "requests": 24}, {"name": "r4", "rate": 4, "requests": 300}]
    big = _workload(_loaded(tmp_path, benchmark={"points": points}))
    argv = big.argv
    # load_trial.py's default is 256 prompts (and the warmup): a point of 300 needs more.
    assert argv[argv.index("--num-prompts") + 1] == "300", argv
    # Up to the default, the command is as before the size was given: a run made then keeps
    # its workload (and does not measure again) after an upgrade.
    small = _workload(_loaded(tmp_path, benchmark={"points": points[:1]}))
    assert "--num-prompts" not in small.argv
    # A change of size changes the step's key: a resumed run prepares the workload again.
    assert big.key_args != small.key_args


def _fake_report(run_dir: Path, title: str) -> str:
    (run_dir / "report.html").write_text("<html></html>")
    (run_dir / "report.md").write_text("![ttft](report-plots/ttft.svg)\n")
    (run_dir / "report-plots").mkdir(exist_ok=True)
    (run_dir / "report-plots" / "ttft.svg").write_text("<svg/>")
    return "report.html and report.md"


def test_deleted_plots_redo_the_report(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path)
    report = _step(chain_steps(loaded, _fake_report), "report")
    assert run_chain(loaded, [report], out=lambda _: None).ran == ["report"]
    assert run_chain(loaded, [report], out=lambda _: None).skipped == ["report"]
    (loaded.run_dir / "report-plots" / "ttft.svg").unlink()
    assert run_chain(loaded, [report], out=lambda _: None).ran == ["report"]
    assert content_sha256(loaded.run_dir / "report-plots" / "ttft.svg") is not None


def test_the_profile_table_names_its_units(tmp_path: Path) -> None:
    from narwhal.qualify.console import profile_lines

    store, digest = make_store(
        {"e0": {"a": 0.02, "b": 1e-4, "c": 1e-9, "intercept": 0.02, "slope": 1e-4, "ctx": 1e-8}}
    )
    (tmp_path / "profile-store.json").write_text(
        json.dumps(store.model_dump(mode="json", by_alias=True))
    )
    lines = profile_lines(tmp_path)
    head = lines[0].split()
    for column in ("prefill@1024", "prefill@8192"):
        assert head[head.index(column) + 1] == "(s)", lines[0]
    assert "decode_intercept (s/token)" in lines[0]
    assert "decode_slope (s/token/stream)" in lines[0]
    assert "ctx_coef (s/token/ctx token)" in lines[0]
    assert lines[1].startswith("e0 ") and lines[-1].endswith(f"sha256 {digest}")
    # The profile step shows this table, not narwhal-profile's (which has no units).
    profile = _step(chain_steps(_loaded(tmp_path), _fake_report), "profile")
    assert profile.show is profile_lines and not profile.echo


def test_the_check_takes_the_run_files_pace_tolerance(tmp_path: Path) -> None:
    def check_argv(**check: Any) -> list[str]:
        return _step(chain_steps(_loaded(tmp_path, check=check), _fake_report), "check").argv

    argv = check_argv(pace_repeats=3, pace_tolerance=1.0)
    assert argv[argv.index("--pace-tolerance") + 1] == "1.0", argv
    # Omitted: narwhal-check's default, and the command as before the field existed.
    assert "--pace-tolerance" not in check_argv(pace_repeats=3)
