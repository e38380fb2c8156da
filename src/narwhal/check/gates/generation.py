"""The generation gate: every engine generates the same greedy tokens from the same token-id
prompt (same weights and configuration)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from narwhal.check.evidence import GenerationResult
from narwhal.check.gates.common import GateOutcome, outcome, rounded

__all__ = ["generation_gate"]


def generation_gate(
    results: Sequence[GenerationResult], prompt_tokens: Sequence[int] | None, requested: int
) -> GateOutcome:
    """Every engine completes a greedy generation of exactly ``requested`` tokens from the same
    token-id prompt, and all engines produce the same tokens (same weights)."""
    failures: list[str] = []
    engines: dict[str, Any] = {}
    outputs: dict[str, tuple[Any, ...]] = {}
    for r in results:
        engines[r.engine_id] = {
            "tokens": r.tokens,
            "text": r.text,
            "completion_tokens": r.completion_tokens,
            "finish_reason": r.finish_reason,
            "latency_s": rounded(r.latency_s),
            "error": r.error,
        }
        if r.error is not None:
            failures.append(f"{r.engine_id}: generation failed: {r.error}")
            continue
        count = r.completion_tokens if r.completion_tokens is not None else -1
        if r.tokens is not None and len(r.tokens) != requested:
            failures.append(
                f"{r.engine_id}: returned {len(r.tokens)} token ids, {requested} requested"
            )
        elif count != requested:
            failures.append(
                f"{r.engine_id}: usage reports {r.completion_tokens} completion tokens, "
                f"{requested} requested"
            )
        else:
            # Token ids where the engine returns them; text otherwise (a weaker comparison).
            outputs[r.engine_id] = tuple(r.tokens) if r.tokens is not None else (r.text,)
    groups: dict[tuple[Any, ...], list[str]] = {}
    for e, out in outputs.items():
        groups.setdefault(out, []).append(e)
    if len(groups) > 1:
        ranked = sorted(groups.values(), key=lambda ids: (-len(ids), ids))
        majority = ranked[0]
        if len(ranked[0]) == len(ranked[1]):
            parts = " vs ".join(", ".join(ids) for ids in ranked)
            failures.append(
                f"engines generate different tokens for the same prompt ({parts}): "
                "different weights or configuration"
            )
        else:
            for ids in ranked[1:]:
                failures.append(
                    f"{', '.join(ids)} generated different tokens from {', '.join(majority)} "
                    "for the same prompt: different weights or configuration"
                )
    return outcome(
        f"{len(results)} engines generated the same {requested} greedy tokens",
        failures,
        [],
        {
            "prompt_tokens": list(prompt_tokens) if prompt_tokens is not None else None,
            "requested_tokens": requested,
            "distinct_outputs": len(groups),
            "engines": engines,
        },
    )
