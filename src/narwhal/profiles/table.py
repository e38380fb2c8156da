"""A profile store as a table for people (narwhal-profile prints it, narwhal-qualify shows it):
one row per engine, every column headed with its unit."""

from __future__ import annotations

import statistics

from narwhal.profiles.store import ProfileStore

__all__ = ["profile_table"]


def _r2(value: float) -> str:
    # One that rounds to zero is 0.0000, not -0.0000 (a fit no better than the mean).
    return f"{0.0 if abs(value) < 5e-5 else value:.4f}"


def profile_table(store: ProfileStore) -> list[str]:
    """One row per engine: the median prefill time per profiled length and the fitted decode
    model, every column headed with its unit (a decode time per token grows by ``slope`` per
    concurrent stream and by ``ctx_coef`` per token of context)."""
    lens = store.plan.prefill_lens
    head = (
        ["engine", "generation"]
        + [f"prefill@{n} (s)" for n in lens]
        + [
            "decode_intercept (s/token)",
            "decode_slope (s/token/stream)",
            "ctx_coef (s/token/ctx token)",
            "prefill_r2",  # R²: no unit
            "decode_r2",
        ]
    )
    rows = [head]
    for engine_id, p in sorted(store.engines.items()):
        medians = [
            statistics.median(s.seconds for s in p.prefill_samples if s.input_tokens == n)
            for n in lens
        ]
        rows.append(
            [engine_id, (p.generation or "-")[:12]]
            + [f"{m:.4f}" for m in medians]
            + [
                f"{p.decode_fit.intercept:.5f}",
                f"{p.decode_fit.slope:.6f}",
                f"{p.decode_fit.ctx_coef:.3e}",
                _r2(p.prefill_fit.r2),
                _r2(p.decode_fit.r2),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
