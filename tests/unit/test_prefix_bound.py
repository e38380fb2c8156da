"""``bench/prefix_bound.py``: the fluid bound that issue 19's goals are set beside. Its split
arithmetic, the chunked prefill of uncached tokens, and (where the Mooncake traces are present)
the figures docs/routing.md quotes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.simengine.timing import CALIBRATION

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "prefix_bound.py"
_spec = importlib.util.spec_from_file_location("prefix_bound", SCRIPT)
assert _spec is not None and _spec.loader is not None
bound = importlib.util.module_from_spec(_spec)
sys.modules["prefix_bound"] = bound  # dataclasses look their module up by name
_spec.loader.exec_module(bound)


def test_the_split_arithmetic() -> None:
    b = bound.Bound(hit_rate=0.0, prefill_s=1.0, decode_rps=0.5, batch=1)
    rate, prefill = b.fractional(8)
    # P / 1.0 = 0.5 x (8 - P): P = 8/3, both pools full.
    assert rate == pytest.approx(8 / 3) and prefill == pytest.approx(8 / 3)
    # Whole engines: 2P carries 2 (prefill-bound), 3P min(3, 2.5) = 2.5 (decode-bound).
    assert b.static(8) == (2.5, 3)
    assert b.static(8)[0] <= rate


def test_prefill_charges_only_the_uncached_tokens_and_a_full_step_s_share_of_its_cost() -> None:
    model = CALIBRATION.prefill
    n = model.max_tokens
    # Full chunks pay the step's fixed cost whole: two steps.
    assert bound.prefill_seconds(2 * n, 0) == pytest.approx(
        model.chunk_seconds(0, n) + model.chunk_seconds(n, n)
    )
    assert bound.prefill_seconds(2 * n, n) == pytest.approx(model.chunk_seconds(n, n))
    # A short tail shares its step with others: its tokens' share of the fixed cost only
    # (the simulator charges it once per step, whatever the step packs).
    tail = bound.prefill_seconds(100, 99)
    assert tail == pytest.approx(model.chunk_seconds(99, 1) - model.a + model.a / n)
    assert tail < model.chunk_seconds(99, 1)


def test_a_lower_hit_rate_never_raises_the_bound() -> None:
    requests = [bound.Request(20000, 300, 0), bound.Request(20000, 300, 10240)] * 5
    ideal = sum(r.cached for r in requests) / sum(r.prompt for r in requests)
    top, low = bound.bound_at(requests, ideal, ideal), bound.bound_at(requests, ideal, 0.0)
    assert top.prefill_s < low.prefill_s and top.decode_rps == low.decode_rps
    assert top.fractional(8)[0] > low.fractional(8)[0]
    assert top.static(8)[0] >= low.static(8)[0]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(not bound.DATA_DIR.exists(), reason="the Mooncake traces are not present")
@pytest.mark.parametrize(
    ("args", "lines"),
    [
        (
            ["--traces", "conversation", "--sizes", "8", "--hit-rates", "0.18",
             "--measured", "power_of_two=1.658", "--measured", "round_robin=1.540"],
            ["ideal hit rate (unbounded cache) 0.382",
             "bound 2.321 req/s at 1.88P (fluid split), 2.277 at 2P/6D",
             "bound_ratio_ideal_over_hit_0.180_conversation_8: 1.080 (fluid split), 1.200",
             "bound_over_measured_power_of_two_conversation_8: 1.400",
             "bound_over_measured_round_robin_conversation_8: 1.507"],
        ),
        (
            ["--traces", "conversation", "--sizes", "64", "--hit-rates", "0.084",
             "--measured", "power_of_two=13.967", "--measured", "round_robin=12.85"],
            ["bound 18.572 req/s at 15.05P (fluid split), 18.505 at 15P/49D",
             "bound 16.685 req/s at 20.03P (fluid split), 16.663 at 20P/44D",
             "bound_ratio_ideal_over_hit_0.084_conversation_64: 1.113 (fluid split), 1.111",
             "bound_over_measured_power_of_two_conversation_64: 1.330",
             "bound_over_measured_round_robin_conversation_64: 1.445"],
        ),
        (
            ["--traces", "synthetic", "--sizes", "8", "--hit-rates", "0.299"],
            ["bound 4.500 req/s at 2.84P (fluid split), 4.359 at 3P/5D",
             "bound_ratio_ideal_over_hit_0.299_synthetic_8: 1.359 (fluid split), 1.383"],
        ),
    ],
)  # fmt: skip
def test_the_figures_the_docs_quote(args: list[str], lines: list[str]) -> None:
    out = run(*args)
    assert out.returncode == 0, out.stderr
    for line in lines:
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
