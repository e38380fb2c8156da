"""The qualification run's story on the simulator: working handoffs whose first token takes
seconds fail kv_transfer under the packaged 2.5 s deadline; the report recommends a deadline;
the fleet copy that changes only that value passes and narwhal-serve serves it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from narwhal.contract import load_report
from tests.check.support import check, fleet_copy, serve_ready, serve_refused
from tests.helpers import running_fleet

pytestmark = pytest.mark.slow


def test_slow_handoffs_fail_the_packaged_deadline_and_the_recommended_one_qualifies(
    tmp_path: Path,
) -> None:
    # KV READs into e1 stall 2.8 s, into e0 0.3 s: every handoff works, some take seconds
    # (the reference saw 0.348 to 5.274 s).
    stalls = {"e0": ["--fault-hang-kv-read-s", "0.3"], "e1": ["--fault-hang-kv-read-s", "2.8"]}
    with running_fleet(
        tmp_path, 2, sim={"time_scale": 20.0}, engine_args=stalls, first_token_timeout_s=2.5
    ) as fleet:
        packaged = fleet.fleet_path
        first = tmp_path / "report-packaged.json"
        r = check("--fleet", str(packaged), "--report", str(first), "--kv-probes", "2")
        assert r.returncode == 1, r.stdout
        report = load_report(first)[0]
        kv = report.gate("kv_transfer")
        assert kv.verdict == "fail"
        assert len(kv.failures) == 1 and kv.failures[0].startswith("e0->e1: first token after ")
        assert "exceeds first_token_timeout_s 2.5 s" in kv.failures[0]
        dist = kv.evidence["first_token"]
        assert dist["n"] == 4 and 0.3 <= dist["min_s"] < 1.0 and 2.8 <= dist["max_s"] < 4.0
        rec = kv.evidence["recommendation"]
        value = rec["recommended_first_token_timeout_s"]
        # Above the observed maximum with the 60% margin, rounded up to 0.5 s, and below the
        # TTFT budget after the prefill.
        assert value == math.ceil(dist["max_s"] * 1.6 / 0.5) * 0.5
        assert value + rec["prefill_s"] < 10.0
        assert "rounded up" in rec["how"]
        assert f"recommended engine.first_token_timeout_s: {value:g} s" in r.stdout
        # Every other gate passed; without a profile store pace and slo had no input.
        for g in report.gates:
            if g.name in ("pace", "slo"):
                assert g.skip is not None and g.skip.kind == "no_input"
            elif g.name != "kv_transfer":
                assert g.verdict == "pass", (g.name, g.failures)

        # The qualified copy changes only engine.first_token_timeout_s.
        qualified = fleet_copy(
            packaged, tmp_path / "fleet-qualified.json", engine={"first_token_timeout_s": value}
        )
        before, after = json.loads(packaged.read_text()), json.loads(qualified.read_text())
        assert after["engine"].pop("first_token_timeout_s") == value
        before["engine"].pop("first_token_timeout_s")
        assert before == after
        # As the reference run spells it: narwhal-check without --report, in the run's
        # directory (the report is check-report.json there).
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        r = check("--fleet", str(qualified), "--kv-probes", "2", cwd=run_dir)
        assert r.returncode == 0, r.stdout
        second = run_dir / "check-report.json"
        report = load_report(second)[0]
        assert report.verdict == "pass" and report.complete
        assert report.gate("kv_transfer").verdict == "pass"

        # narwhal-serve: the qualified fleet serves; the packaged one is not what was qualified.
        journal = tmp_path / "journal.jsonl"
        ok, log = serve_ready(
            qualified, journal, tmp_path / "serve.log", "--check-report", str(second)
        )
        assert ok, log[-3000:]
        # And narwhal-serve without --check-report, as the reference run serves: the report
        # the check left in the working directory, or beside the fleet file, qualifies it.
        ok, log = serve_ready(qualified, journal, tmp_path / "serve-found.log", cwd=run_dir)
        assert ok, log[-3000:]
        assert f"report {second}" in log
        beside = qualified.parent / "check-report.json"
        shutil.copy(second, beside)
        ok, log = serve_ready(qualified, journal, tmp_path / "serve-beside.log")
        assert ok, log[-3000:]
        assert f"report {beside}" in log
        # A report there that does not qualify the fleet served: refused, with its reason.
        line = serve_refused(packaged, journal)
        assert "check-report.json: does not qualify this fleet: fleet sha256 differs" in line
        beside.unlink()
        line = serve_refused(packaged, journal)
        assert "this fleet is not qualified: no narwhal-check report at" in line
        line = serve_refused(packaged, journal, "--check-report", str(second))
        assert "fleet sha256 differs" in line and "another fleet" in line
        line = serve_refused(packaged, journal, "--check-report", str(first))
        assert "the report did not pass (failed gates: kv_transfer)" in line
