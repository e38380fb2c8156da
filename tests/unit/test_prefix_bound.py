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


def test_prefill_charges_only_the_uncached_tokens_chunk_by_chunk() -> None:
    model = CALIBRATION.prefill
    n = model.max_tokens
    assert bound.prefill_seconds(2 * n, 0) == pytest.approx(
        model.chunk_seconds(0, n) + model.chunk_seconds(n, n)
    )
    assert bound.prefill_seconds(2 * n, n) == pytest.approx(model.chunk_seconds(n, n))
    # A prompt found whole still computes its last token.
    assert bound.prefill_seconds(100, 100) == pytest.approx(model.chunk_seconds(99, 1))


def test_a_lower_hit_rate_never_raises_the_bound() -> None:
    requests = [bound.Request(20000, 300, 0), bound.Request(20000, 300, 10240)] * 5
    ideal = sum(r.cached for r in requests) / sum(r.prompt for r in requests)
    top, low = bound.bound_at(requests, ideal, ideal), bound.bound_at(requests, ideal, 0.0)
    assert top.prefill_s < low.prefill_s and top.decode_rps == low.decode_rps
    assert top.fractional(8)[0] > low.fractional(8)[0]
    assert top.static(8)[0] >= low.static(8)[0]


@pytest.mark.skipif(not bound.DATA_DIR.exists(), reason="the Mooncake traces are not present")
def test_the_conversation_figures_the_docs_quote() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--traces", "conversation", "--sizes", "8",
         "--hit-rates", "0.18", "--measured", "round_robin=1.540"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "ideal hit rate (unbounded cache) 0.382" in out
    assert "bound 2.312 req/s at 1.91P (fluid split), 2.277 at 2P/6D" in out
    assert "bound_ratio_ideal_over_hit_0.180_conversation_8: 1.079 (fluid split), 1.200" in out
    assert "bound_over_measured_round_robin_conversation_8: 1.501" in out
