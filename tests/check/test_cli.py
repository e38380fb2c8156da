"""narwhal-check's command line: input errors (no engine is contacted) and an unreachable
fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.check import cli
from narwhal.contract import load_report
from tests.check.support import KIMI, check, fleet_doc, make_store, plan_doc, point


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
        (["--fleet", str(fleet), "--pace-tolerance", "0"], "--pace-tolerance: must be a finite"),
        # The report records each setting; JSON has no infinity (it was written as null).
        (["--fleet", str(fleet), "--probe-timeout", "inf"], "--probe-timeout: must be a finite"),
        (["--fleet", str(fleet), "--kv-margin", "nan"], "--kv-margin: must be a finite number"),
        (["--fleet", str(fleet), "--kv-probes", "x"], "invalid int value"),
        (["--fleet", str(fleet), "--report", str(tmp_path)], "is a directory"),
        # A device or a pipe swallows the report or fails its write, after the gates ran.
        (["--fleet", str(fleet), "--report", "/dev/null"], "/dev/null is a character device"),
        # Refused before the gates run (it failed after them, saying "File exists").
        (
            ["--fleet", str(fleet), "--report", str(store_path / "r.json")],
            f"--report: {store_path} is not a directory",
        ),
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


def test_help_gives_every_tuning_flags_default() -> None:
    """docs/preflight.md quotes them (50%, 3, 0.6): --help must say them too."""
    from narwhal.check.cli import _parser

    text = " ".join(_parser().format_help().split())
    assert "estimate (default 0.5)" in text
    assert "handoffs per pair (default 3)" in text
    assert "observed maximum (default 0.6)" in text


def test_cli_refuses_a_report_that_would_overwrite_an_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--report`` (or its .sha256) naming an input replaced it with the report, exit 0: refused
    before anything is read from an engine or written, however the path is spelled."""
    doc = fleet_doc(2)
    doc["engine"]["api_key_file"] = "engine.key"
    (tmp_path / "engine.key").write_text("secret\n")
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(doc))
    store, digest = make_store({"e0": KIMI, "e1": KIMI})
    store_path = tmp_path / "store.json"
    store_path.write_text(json.dumps(store.model_dump(mode="json", by_alias=True)))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_doc("0" * 64, [point("a", 1.0)])))
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(fleet)
    (tmp_path / "hard.json").hardlink_to(store_path)
    # The fleet pins the store (profile_store.path), relative to its own directory.
    pinned = tmp_path / "pinned" / "fleet.json"
    pinned.parent.mkdir()
    pinned.write_text(
        json.dumps({**doc, "profile_store": {"path": "../store.json", "sha256": digest}})
    )
    (pinned.parent / "engine.key").write_text("secret\n")
    sidecar_fleet = tmp_path / "r.json.sha256"
    sidecar_fleet.write_text(json.dumps(doc))
    given = ["--fleet", str(fleet), "--profiles", str(store_path)]
    cases = [
        (given, fleet, "is the file given with --fleet"),
        (given, tmp_path / "sub" / ".." / "fleet.json", "is the file given with --fleet"),
        (given, tmp_path / "link.json", "is the file given with --fleet"),
        (given, store_path, "is the file given with --profiles"),
        (given, tmp_path / "hard.json", "is the file given with --profiles"),
        ([*given, "--plan", str(plan)], plan, "is the file given with --plan"),
        (given, tmp_path / "engine.key", "is the fleet's engine.api_key_file"),
        (["--fleet", str(pinned)], store_path, "is the fleet's profile_store.path"),
        (
            ["--fleet", str(sidecar_fleet)],
            tmp_path / "r.json",
            "its r.json.sha256 is the file given with --fleet",
        ),
    ]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for args, report, words in cases:
        code = cli.main(["--quiet", *args, "--report", str(report)])
        err = capsys.readouterr().err
        assert code == 2, (args, report, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0] == f"narwhal-check: --report {report}: {words} (it would be overwritten)"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_cli_refuses_empty_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty --profiles (an unset $STORE) ran as "no profile store" and exit 0."""
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(fleet_doc(2)))
    for flag in ("--fleet", "--profiles", "--plan", "--report"):
        args = {"--fleet": str(fleet), "--report": str(tmp_path / "r.json"), flag: ""}
        code = cli.main(["--quiet", *(x for kv in args.items() for x in kv)])
        err = capsys.readouterr().err
        assert code == 2, (flag, err)
        assert err == f"narwhal-check: {flag}: an empty path\n"
    assert not (tmp_path / "r.json").exists()
