"""The goodput benchmarks refuse arguments they cannot run with, naming the flag, before they
start a process: ``bench/goodput.py --time-scale 0`` ended in a ZeroDivisionError after
starting eight engines, ``--trace-start -5`` read the trace from its end, and ``--windows 0``
or ``--max-points 0`` profiled a fleet to measure nothing."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.testing.goodput import quick_defaults

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--time-scale", "0"], "--time-scale: must be greater than 0, got 0"),
        (["--trace-start", "-5"], "--trace-start: must be at least 0, got -5"),
        (["--windows", "0"], "--windows: must be at least 1, got 0"),
        (["--max-points", "0"], "--max-points: must be at least 1, got 0"),
        (["--precision", "1.5"], "--precision: a relative width below 1, got 1.5"),
        (["--bracket-step", "1"], "--bracket-step: must be greater than 1, got 1"),
        (["--blocks", "1"], "--blocks: must be at least 2, got 1"),
        (["--prefill", "0"], "--prefill: at least one prefill engine, got 0"),
        (["--prefill", "8"], "--prefill 8 of --engines 8 leaves no decode engine"),
        (["--time-scale", "nan"], "--time-scale: must be greater than 0, got nan"),
        (
            ["--profile-concurrency", "1,x"],
            "--profile-concurrency: expected comma-separated numbers, got '1,x'",
        ),
    ],
)
def test_goodput_refuses_a_number_it_cannot_run_with(args: list[str], says: str) -> None:
    result = run("goodput.py", *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"goodput.py: error: {says}"
    assert "starting" not in result.stderr  # no engine was started


@pytest.mark.parametrize("script", ["policies_des.py", "prefix_goodput.py"])
def test_virtual_benchmarks_refuse_a_negative_patience(script: str) -> None:
    result = run(script, "--abandon-after-s", "-3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"{script}: error: --abandon-after-s: must be 0 (clients wait) or more, got -3"
    )


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("policies_des.py", ["--sizes", "1"], "--sizes: each must be at least 2, got 1"),
        ("policies_des.py", ["--sizes", "x"], "--sizes: expected comma-separated numbers, got 'x'"),
        ("policies_des.py", ["--windows", "0"], "--windows: must be at least 1, got 0"),
        ("policies_des.py", ["--block", "0"], "--block: must be at least 1, got 0"),
        ("policies_des.py", ["--precision", "0"], "--precision: must be greater than 0, got 0"),
        ("policies_des.py", ["--precision", "5"], "--precision: a relative width below 1, got 5"),
        ("policies_des.py", ["--splits", "0,0.5"],
         "--splits: each must be greater than 0 and below 1, got 0"),
        ("policies_des.py", ["--splits", "x"],
         "--splits: expected comma-separated numbers, got 'x'"),
        ("policies_des.py", ["--workloads", ","],
         "--workloads: expected one or more of code, conv, fixed: ','"),
        ("prefix_goodput.py", ["--precision", "1"],
         "--precision: a relative width below 1, got 1"),
        ("baselines_agreement.py", ["--rates", "abc"],
         "--rates: expected comma-separated numbers, got 'abc'"),
        ("baselines_agreement.py", ["--rates", "1,-1"],
         "--rates: each must be greater than 0, got -1"),
        ("baselines_agreement.py", ["--time-scale", "0"],
         "--time-scale: must be greater than 0, got 0"),
        ("baselines_agreement.py", ["--repeats", "0"], "--repeats: must be at least 1, got 0"),
        ("baselines_agreement.py", ["--requests", "0"], "--requests: must be at least 1, got 0"),
        ("prefix_goodput.py", ["--splits", "0.5,1"],
         "--splits: each must be greater than 0 and below 1, got 1"),
        ("prefix_goodput.py", ["--sizes", "0"], "--sizes: each must be at least 2, got 0"),
        ("prefix_goodput.py", ["--history-ttl-s", "0"],
         "--history-ttl-s: must be greater than 0, got 0"),
        ("prefix_goodput.py", ["--resamples", "0"], "--resamples: must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_virtual_benchmarks_refuse_a_number_they_cannot_run_with(
    script: str, args: list[str], says: str
) -> None:
    result = run(script, *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"{script}: error: {says}"


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        # TypeError, ZeroDivisionError, AssertionError, KeyError before (a CLI fuzz pass).
        ("des_speed.py", ["--requests", "0"], "--requests: must be greater than 0, got 0"),
        ("des_speed.py", ["--engines", "1"], "--engines: must be at least 2, got 1"),
        ("des_speed.py", ["--load", "nan"], "--load: must be greater than 0, got nan"),
        ("des_speed.py", ["--candidates", "0"], "--candidates: must be greater than 0"),
        ("migration_render.py", ["--repeats", "0"], "--repeats: must be greater than 0, got 0"),
        ("migration_render.py", ["--requests", "0"], "--requests: must be greater than 0"),
        ("migration_render.py", ["--tokens", "0"], "--tokens: must be greater than 0, got 0"),
        ("soak.py", ["--minutes", "nan"], "--minutes: must be greater than 0, got nan"),
        ("soak.py", ["--fault-every", "-1"], "--fault-every: must be at least 0, got -1"),
    ],
)
def test_the_other_benchmarks_refuse_degenerate_arguments(
    script: str, args: list[str], says: str
) -> None:
    r = run(script, *args)
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_quick_keeps_what_the_command_line_names() -> None:
    """``--quick`` set its windows, sizes and resamples over the ones given, and missed
    ``--systems=...`` written with an equals sign."""
    args = argparse.Namespace(sizes="64", windows=16, resamples=1000, systems="v1")
    quick_defaults(
        args,
        ["--quick", "--sizes=64", "--resamples", "7"],
        {"sizes": "8", "windows": 3, "resamples": 200, "systems": "v1,round_robin"},
    )
    assert (args.sizes, args.windows, args.resamples, args.systems) == (
        "64",
        3,
        1000,
        "v1,round_robin",
    )
    result = run("goodput.py", "--quick", "--windows", "0")
    assert result.stderr.strip().splitlines()[-1] == (
        "goodput.py: error: --windows: must be at least 1, got 0"
    )


def test_policies_des_refuses_a_trace_it_cannot_read_in_one_line(tmp_path: Path) -> None:
    """A trace of other columns, or too few rows to make a window, ended in a ValueError,
    IndexError or ZeroDivisionError traceback; only a missing file was refused."""
    azure = tmp_path / "azure-llm-2023"
    azure.mkdir()
    (azure / "AzureLLMInferenceTrace_code.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
    )
    (azure / "AzureLLMInferenceTrace_conv.csv").write_text("a,b\n1,2\n")
    env = {**os.environ, "NARWHAL_DATA_DIR": str(tmp_path)}
    for workload, says in [
        ("code", "holds 1 requests; a window needs 2"),
        ("conv", "not an Azure LLM inference trace"),
    ]:
        result = subprocess.run(
            [sys.executable, str(BENCH / "policies_des.py"), "--workloads", workload],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert result.returncode == 2
        last = result.stderr.strip().splitlines()[-1]
        assert (
            last.startswith(f"policies_des.py: error: the {workload} workload: ") and says in last
        )
        assert "Traceback" not in result.stderr
