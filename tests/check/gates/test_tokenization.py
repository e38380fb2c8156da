"""The tokenization gate against recorded tokenizations (the simulator's vocabularies)."""

from __future__ import annotations

from narwhal.check.evidence import TokenizeResult
from narwhal.check.gates.tokenization import tokenization_gate
from narwhal.check.settings import TOKENIZATION_PROMPTS
from narwhal.simengine.vocab import Vocabulary


def test_tokenization_names_a_different_vocabulary_and_judges_the_estimate() -> None:
    same, other = Vocabulary(0), Vocabulary(7)
    prompts = list(TOKENIZATION_PROMPTS)
    results = [
        TokenizeResult("e0", [same.encode(p) for p in prompts]),
        TokenizeResult("e1", [other.encode(p) for p in prompts]),
        TokenizeResult("e2", [same.encode(p) for p in prompts]),
    ]
    out = tokenization_gate(prompts, results, 0.5)
    assert len(out.failures) == 1
    assert out.failures[0].startswith("e1 tokenizes ") and "differently from e0" in out.failures[0]
    est = out.evidence["router_estimate"]
    assert est["max_error"] <= 0.5
    agreeing = tokenization_gate(prompts, [results[0], results[2]], 0.5)
    assert agreeing.verdict == "pass"
    assert any("cold-start estimate" in n for n in agreeing.notes)


def test_tokenization_fails_prompts_past_the_routers_refusal_bound() -> None:
    # 40 bytes in one token: the router's 16-byte bound would refuse prompts that fit.
    prompts = ["x" * 40, "y" * 40]
    out = tokenization_gate(prompts, [TokenizeResult("e0", [[1], [2]])], 0.5)
    assert out.verdict == "fail" and "exceeds the router's 16-byte bound" in out.failures[0]
