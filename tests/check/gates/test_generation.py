"""The generation gate against recorded generations."""

from __future__ import annotations

from narwhal.check.evidence import GenerationResult
from narwhal.check.gates.generation import generation_gate


def test_generation_names_the_odd_engine_out_and_counts_tokens() -> None:
    same = [1, 2, 3, 4]
    results = [
        GenerationResult("e0", 4, same, completion_tokens=4),
        GenerationResult("e1", 4, [1, 2, 9, 9], completion_tokens=4),
        GenerationResult("e2", 4, same, completion_tokens=4),
        GenerationResult("e3", 4, [1, 2, 3], completion_tokens=3),
    ]
    out = generation_gate(results, [7, 8], 4)
    assert out.failures == [
        "e3: returned 3 token ids, 4 requested",
        "e1 generated different tokens from e0, e2 for the same prompt: different weights or "
        "configuration",
    ]
    tie = generation_gate(results[:2], [7], 4)
    assert "engines generate different tokens for the same prompt (e0 vs e1)" in tie.failures[0]
