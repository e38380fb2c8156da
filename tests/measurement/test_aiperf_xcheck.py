"""Cross-check with a client nobody here wrote: aiperf 0.13.0 (installed by `make aiperf` into a
venv of its own, since its pins clash with the router's) runs the reference workload shape
against narwhal-serve offline, with a tokenizer that mirrors the simulator's vocabulary
installed into HF_HOME as narwhal/sim-vocab. Its request count, output tokens and input length
must equal the journal's; its TTFT median must agree with the journal's and with
load_trial.py's within max(50 ms, 50%) here (the tool's default, for a quiet machine, is
max(30 ms, 30%); docs/measurement.md explains both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import running_fleet, running_router
from tests.measurement.support import MODEL, SIM, TOOLS, load_trial

AIPERF = Path(__file__).resolve().parents[2] / ".venv" / "aiperf" / "bin" / "aiperf"
REQUESTS, RATE = 20, 4.0  # 0.2 request/s on the MI355X fleet's clock: little queueing


# `make test` installs aiperf and sets this, so the cross-check cannot pass by skipping there.
REQUIRED = os.environ.get("NARWHAL_AIPERF_REQUIRED") == "1"


@pytest.mark.slow
@pytest.mark.interop
def test_aiperf_agrees_with_journal_and_load_trial(tmp_path: Path) -> None:
    if not AIPERF.exists():
        why = f"aiperf not installed ({AIPERF} missing): run `make aiperf`"
        if REQUIRED:
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    with (
        running_fleet(tmp_path, 2, sim=SIM) as fleet,
        running_router(tmp_path, fleet.fleet_path) as router,
    ):
        wl = tmp_path / "wl"
        prep = load_trial(
            "prepare",
            "--base",
            router.url,
            "--input-tokens",
            "8192",
            "--output-tokens",
            "128",
            "--seed",
            "1729",
            "--num-prompts",
            str(REQUESTS),
            "--out",
            str(wl),
            "--tokenize-url",
            fleet.engines["e0"].url,
        )
        assert prep.returncode == 0, prep.stderr

        def measure(attempt: int) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
            lt = load_trial(
                "run",
                "--base",
                router.url,
                "--workload",
                str(wl),
                "--rate",
                str(RATE),
                "--requests",
                str(REQUESTS),
                "--ttft",
                "0.5",
                "--tpot",
                "0.015",
                "--attainment",
                "0.95",
                "--timeout",
                "9",
                "--out",
                str(tmp_path / f"lt{attempt}"),
            )
            assert lt.returncode in (0, 1), lt.stderr
            proc = subprocess.run(
                [
                    sys.executable,
                    str(TOOLS / "aiperf_xcheck.py"),
                    "--base",
                    router.url,
                    "--model",
                    MODEL,
                    "--journal",
                    str(router.journal),
                    "--out",
                    str(tmp_path / f"x{attempt}"),
                    "--input-tokens",
                    "8192",
                    "--output-tokens",
                    "128",
                    "--rate",
                    str(RATE),
                    "--requests",
                    str(REQUESTS),
                    "--timeout",
                    "9",
                    "--aiperf",
                    str(AIPERF),
                    "--sim-tokenizer",
                    "--load-trial-summary",
                    str(tmp_path / f"lt{attempt}" / "summary.json"),
                    # Looser than the tool's 30 ms / 30 % default: CI shares two CPUs between the
                    # fleet, the router and two clients, and the load_trial run is a separate run.
                    "--ttft-abs",
                    "0.05",
                    "--ttft-rel",
                    "0.5",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            return proc, json.loads((tmp_path / f"x{attempt}" / "xcheck.json").read_text())

        proc, result = measure(0)
        checks = result["checks"]
        if not checks["ttft_p50_aiperf_vs_load_trial"]["agree"] and all(
            check.get("agree", True)
            for name, check in checks.items()
            if name != "ttft_p50_aiperf_vs_load_trial"
        ):
            # aiperf agreed with the journal of its own run; only the comparison with the
            # separate load_trial run failed: one run met a stall of the shared two-core host
            # (a CI run saw load_trial's median at 0.32 s against aiperf's 0.09 s). Both runs
            # again, the first pair printed.
            print(f"first pair disagreed: {json.dumps(checks['ttft_p50_aiperf_vs_load_trial'])}")
            proc, result = measure(1)
    assert proc.returncode == 0, (proc.stdout, proc.stderr, json.dumps(result["checks"]))
    checks = result["checks"]
    assert checks["request_count"]["aiperf"] == checks["request_count"]["journal"] == REQUESTS
    assert checks["output_tokens"]["aiperf"] == checks["output_tokens"]["journal"] == REQUESTS * 128
    assert checks["input_tokens_mean"]["agree"]
    assert checks["ttft_p50_aiperf_vs_journal"]["agree"]
    assert checks["ttft_p50_aiperf_vs_load_trial"]["agree"]
    assert result["aiperf"]["aiperf_version"] == "0.13.0"
