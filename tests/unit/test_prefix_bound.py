"""``bench/prefix_bound.py``: the fluid bound that issue 19's goals are set beside (its
arithmetic is ``narwhal.testing.fluid_bound``'s, tested in test_fluid_bound.py): hit rates,
arguments, and (where the Mooncake traces are present) the figures docs/routing.md quotes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "prefix_bound.py"
_spec = importlib.util.spec_from_file_location("prefix_bound", SCRIPT)
assert _spec is not None and _spec.loader is not None
bound = importlib.util.module_from_spec(_spec)
sys.modules["prefix_bound"] = bound  # dataclasses look their module up by name
_spec.loader.exec_module(bound)


def test_a_lower_hit_rate_never_raises_the_bound() -> None:
    requests = [
        (float(t), 20000, 10240 * (t % 2), 300) for t in range(400)
    ]  # arrival, prompt, cached, output
    ideal = sum(r[2] for r in requests) / sum(r[1] for r in requests)
    for share in (1.0, 0.95):
        top = bound.fleet_at(requests, ideal, ideal)[0].with_met_share(share)
        low = bound.fleet_at(requests, ideal, 0.0)[0].with_met_share(share)
        assert top.prefill_s.sum() < low.prefill_s.sum()
        assert (top.decode_s == low.decode_s).all()
        assert top.fractional(8)[0] > low.fractional(8)[0]
        assert top.static(8)[0] >= low.static(8)[0]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(not bound.DATA_DIR.exists(), reason="the Mooncake traces are not present")
@pytest.mark.parametrize(
    ("args", "lines"),
    [
        (
            ["--traces", "conversation", "--sizes", "8", "--hit-rates", "0.18",
             "--measured", "power_of_two=1.658", "--measured", "round_robin=1.540"],
            ["ideal hit rate (unbounded cache) 0.382",
             "bound 2.801 req/s at 1.84P (fluid split), 2.784 at 2P/6D (whole engines)"
             " [2.406; 2.385 at 2P/6D]",
             "bound 2.563 req/s at 2.38P (fluid split), 2.331 at 2P/6D (whole engines)",
             "bound_ratio_ideal_over_hit_0.180_conversation_8: 1.093 (fluid split), 1.194"
             " (whole engines) [1.084 (fluid split), 1.204 (whole engines)]",
             "bound_over_measured_power_of_two_conversation_8: 1.689 (fluid split), 1.679",
             "bound_over_measured_round_robin_conversation_8: 1.819 (fluid split), 1.808"],
        ),
        (
            ["--traces", "synthetic", "--sizes", "8", "--hit-rates", "0.299"],
            ["bound 5.643 req/s at 2.98P (fluid split), 5.643 at 3P/5D (whole engines)"
             " [4.640; 4.567 at 3P/5D]",
             "bound_ratio_ideal_over_hit_0.299_synthetic_8: 1.454 (fluid split), 1.472"],
        ),
    ],
)  # fmt: skip
def test_the_figures_the_docs_quote(args: list[str], lines: list[str]) -> None:
    out = run(*args)
    assert out.returncode == 0, out.stderr
    for line in lines:
        assert line in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.skipif(not bound.DATA_DIR.exists(), reason="the Mooncake traces are not present")
def test_the_64_engine_figures_the_docs_quote() -> None:
    out = run(
        "--traces", "conversation", "--sizes", "64", "--hit-rates", "0.084",
        "--measured", "power_of_two=13.967", "--measured", "round_robin=12.85",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for line in (
        "bound 26.797 req/s at 17.11P (fluid split), 26.796 at 17P/47D (whole engines)"
        " [22.053; 21.832 at 18P/46D]",
        "bound 22.672 req/s at 23.01P (fluid split), 22.672 at 23P/41D (whole engines)",
        "bound_over_measured_power_of_two_conversation_64: 1.919 (fluid split), 1.919",
        "bound_over_measured_round_robin_conversation_64: 2.085 (fluid split), 2.085",
    ):
        assert line in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--measured", "foo"], "--measured: NAME=REQ_S, got 'foo'"),
        (["--measured", "x=0"], "--measured: a name and a goodput above 0, got 'x=0'"),
        (["--sizes", "abc"], "--sizes: comma-separated numbers, got 'abc'"),
        (["--sizes", "1"], "--sizes: fleets of at least 2 engines, got '1'"),
        (["--hit-rates", "nan"], "--hit-rates: finite numbers, got 'nan'"),
        (["--traces", "x"], "--traces: one or more of conversation, synthetic, got 'x'"),
        (["--target", "0"], "--target: a share above 0 and at most 1, got 0.0"),
    ],
)
def test_arguments_it_cannot_run_with_are_named(args: list[str], says: str) -> None:
    out = run(*args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"prefix_bound.py: error: {says}"


@pytest.mark.skipif(not bound.DATA_DIR.exists(), reason="the Mooncake traces are not present")
def test_a_hit_rate_above_the_ideal_is_refused() -> None:
    out = run("--traces", "conversation", "--sizes", "8", "--hit-rates", "0.5")
    assert out.returncode == 2 and "conversation's ideal is 0.382, got 0.5" in out.stderr


@pytest.mark.skipif(not bound.DATA_DIR.exists(), reason="the Mooncake traces are not present")
def test_a_fleet_the_benchmark_plays_the_trace_back_to_back_for_is_refused() -> None:
    out = run("--traces", "synthetic", "--sizes", "67")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "prefix_bound.py: error: --sizes: synthetic's 3993 requests are one copy of the trace"
        " up to 66 engines (bench/prefix_goodput.py plays it back to back beyond), got 67"
    )
