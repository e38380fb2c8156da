"""The tokenization gate: every engine tokenizes a fixed prompt set identically, and the
router's bytes-per-token prompt-length estimate holds on it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from narwhal.check.evidence import TokenizeResult
from narwhal.check.gates.common import GateOutcome, outcome, rounded
from narwhal.routing.prompt_length import (
    COLD_BYTES_PER_TOKEN,
    MAX_BYTES_PER_TOKEN,
    PromptLengthEstimator,
)

__all__ = ["tokenization_gate"]


def tokenization_gate(
    prompts: Sequence[str], results: Sequence[TokenizeResult], tolerance: float
) -> GateOutcome:
    """Every engine tokenizes the fixed prompt set identically, and the router's prompt-length
    estimate for text is within ``tolerance`` of the real count.

    The router estimates a text prompt's tokens from its UTF-8 size with
    ``PromptLengthEstimator``: 4 bytes per token until its first prefill answer, then an EWMA of
    the observed bytes per token, clamped to [1, 16]. On a steady mix it converges to the mix's
    mean bytes per token; the gate holds that converged estimate to ``tolerance`` on every
    prompt, and requires every prompt below ``MAX_BYTES_PER_TOKEN`` (16) bytes per token, the
    bound the router uses to refuse oversized text prompts before any engine sees them (above
    it, the router would refuse prompts that fit). The cold-start error (4 bytes per token) is
    reported, not judged: it lasts one request.
    """
    failures: list[str] = []
    notes: list[str] = []
    ok = [r for r in results if r.tokens is not None and len(r.tokens) == len(prompts)]
    for r in results:
        if r.error is not None:
            failures.append(f"{r.engine_id}: /tokenize failed: {r.error}")
        elif r.tokens is None or len(r.tokens) != len(prompts):
            failures.append(f"{r.engine_id}: /tokenize did not answer every prompt")
    evidence: dict[str, Any] = {"prompts": len(prompts), "tolerance": tolerance}
    if not ok:
        return outcome("", failures or ["no engine tokenized the prompt set"], notes, evidence)
    reference = ok[0]
    assert reference.tokens is not None
    disagree: dict[str, Any] = {}
    for r in ok[1:]:
        assert r.tokens is not None
        differing = [
            i for i, (a, b) in enumerate(zip(reference.tokens, r.tokens, strict=True)) if a != b
        ]
        if not differing:
            continue
        i = differing[0]
        a, b = reference.tokens[i], r.tokens[i]
        at = next(
            (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        disagree[r.engine_id] = differing
        failures.append(
            f"{r.engine_id} tokenizes {len(differing)} of {len(prompts)} prompts differently "
            f"from {reference.engine_id} (prompt {i}: {len(b)} vs {len(a)} tokens, first "
            f"difference at token {at}): different tokenizer or vocabulary"
        )
    evidence["reference_engine"] = reference.engine_id
    evidence["disagreeing_engines"] = disagree

    sizes = [len(p.encode("utf-8")) for p in prompts]
    counts = [len(t) for t in reference.tokens]
    ratios = [s / c if c else float("inf") for s, c in zip(sizes, counts, strict=True)]
    estimator = PromptLengthEstimator()
    converged = min(max(statistics.fmean(ratios), estimator.min_ratio), estimator.max_ratio)
    learnt = PromptLengthEstimator(bytes_per_token=converged)
    rows = []
    worst = 0.0
    for i, (size, count, ratio) in enumerate(zip(sizes, counts, ratios, strict=True)):
        estimate = learnt.estimate(size)
        cold = max(1, round(size / COLD_BYTES_PER_TOKEN))
        error = abs(estimate - count) / count if count else float("inf")
        worst = max(worst, error)
        rows.append(
            {
                "bytes": size,
                "tokens": count,
                "bytes_per_token": rounded(ratio, 4),
                "estimate": estimate,
                "error": rounded(error, 4),
                "cold_start_estimate": cold,
                "cold_start_error": rounded(abs(cold - count) / count if count else None, 4),
            }
        )
        if ratio > MAX_BYTES_PER_TOKEN:
            failures.append(
                f"prompt {i}: {ratio:.1f} bytes per token exceeds the router's "
                f"{MAX_BYTES_PER_TOKEN:g}-byte bound: it would refuse prompts that fit"
            )
        elif error > tolerance:
            failures.append(
                f"prompt {i}: the router's converged estimate {estimate} tokens is "
                f"{error:.0%} off the engines' {count} (tolerance {tolerance:.0%})"
            )
    cold_worst = max(r["cold_start_error"] or 0.0 for r in rows)
    if cold_worst > tolerance:
        notes.append(
            f"the router's cold-start estimate ({COLD_BYTES_PER_TOKEN:g} bytes/token) is up to "
            f"{cold_worst:.0%} off on this tokenizer until its first prefill answer corrects it"
        )
    evidence["router_estimate"] = {
        "method": (
            "PromptLengthEstimator converged to the mix's mean bytes/token (clamped to "
            f"[{estimator.min_ratio:g}, {estimator.max_ratio:g}]); cold start "
            f"{COLD_BYTES_PER_TOKEN:g} bytes/token"
        ),
        "converged_bytes_per_token": rounded(converged, 4),
        "max_error": rounded(worst, 4),
        "prompts": rows,
    }
    return outcome(
        f"{len(results)} engines agree on {len(prompts)} prompts; router estimate within "
        f"{worst:.0%} (tolerance {tolerance:.0%})",
        failures,
        notes,
        evidence,
    )
