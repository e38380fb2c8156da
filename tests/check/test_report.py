"""The check report format (``narwhal.contract.check_report``) as narwhal-check writes it, the
test narwhal-serve applies to it, and narwhal-check's table of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from narwhal.check.table import render_table
from narwhal.contract import (
    GATE_NAMES,
    CheckReport,
    ContractError,
    load_report,
    qualification_problem,
)


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
        # Strict types, as in the fleet file: a hand-edited report is not coerced.
        (lambda d: d.update(complete="yes"), "complete"),
        (lambda d: d.update(duration_s="12.5"), "duration_s"),
        (lambda d: d["gates"][0].update(duration_s="0.1"), "duration_s"),
    ):
        doc = json.loads(json.dumps(good))
        mutate(doc)
        path.write_text(json.dumps(doc))
        with pytest.raises(ContractError) as exc:
            load_report(path)
        assert words in str(exc.value) and "\n" not in str(exc.value)
    path.write_text(json.dumps(good))
    assert load_report(path)[0].verdict == "pass"
