"""What narwhal-qualify shows on the console about a step's outputs, read from the files the step
wrote (the step's own console output stays in its log)."""

from __future__ import annotations

import statistics
from pathlib import Path

from narwhal.contract import ContractError, read_json_document
from narwhal.profiles.store import ProfileStore, parse_profile_store
from narwhal.qualify.layout import PROFILE_STORE

__all__ = ["profile_lines", "profile_table"]


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


def profile_lines(run_dir: Path) -> list[str]:
    """The profile step's console lines: its store's table and SHA-256."""
    path = run_dir / PROFILE_STORE
    try:
        raw = read_json_document(path)
        store, digest = parse_profile_store(raw, str(path))
    except ContractError as exc:
        return [f"no profile table: {exc}"]
    return [*profile_table(store), f"profile store: {PROFILE_STORE}  sha256 {digest}"]
