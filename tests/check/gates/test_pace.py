"""The pace gate against recorded probes and a synthetic profile store."""

from __future__ import annotations

import pytest

from narwhal.check.evidence import PaceResult
from narwhal.check.gates.pace import pace_gate
from tests.check.support import KIMI, make_store


def _pace(engine: str, prefill: float, decode: float, generation: str | None) -> PaceResult:
    return PaceResult(
        engine,
        generation,
        prefill_tokens=8192,
        prefill_s=[prefill] * 3,
        decode_input_tokens=512,
        decode_tokens=64,
        decode_s_per_token=decode,
    )


def test_pace_fails_a_slow_engine_and_a_restarted_one() -> None:
    store, _ = make_store({"e0": KIMI, "e1": KIMI, "e2": KIMI})
    p8192 = KIMI["a"] + KIMI["b"] * 8192 + KIMI["c"] * 8192**2
    d512 = KIMI["intercept"] + KIMI["slope"] + KIMI["ctx"] * 544
    out = pace_gate(
        store,
        [
            _pace("e0", p8192 * 1.1, d512 * 0.95, "gen-e0"),
            _pace("e1", p8192 * 3, d512 * 3, "gen-e1"),
            _pace("e2", p8192, d512, "gen-new"),
        ],
        0.35,
    )
    assert len(out.failures) == 3
    assert (
        out.failures[0].startswith("e1: prefill of 8192 tokens took") and "+200%" in out.failures[0]
    )
    assert out.failures[1].startswith("e1: decode took") and "+200%" in out.failures[1]
    assert out.failures[2] == (
        "engine e2 was profiled at generation gen-e2 but runs generation gen-new now "
        "(restarted): re-profile it"
    )
    assert out.evidence["engines"]["e0"]["prefill"]["deviation"] == pytest.approx(0.1)
