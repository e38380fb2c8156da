"""The pace gate: the profile store still describes the live engines (same generation,
prefill and decode times within a tolerance), and the probe sizes the collector uses for it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from narwhal.check.evidence import PaceResult
from narwhal.check.gates.common import GateOutcome, outcome, rounded
from narwhal.profiles.store import ProfileStore, engine_models, generation_problems

__all__ = ["PaceProbePlan", "pace_gate", "pace_probe_plan"]


@dataclass(frozen=True)
class PaceProbePlan:
    prefill_tokens: int
    decode_input_tokens: int
    decode_tokens: int


def pace_probe_plan(store: ProfileStore) -> PaceProbePlan:
    """The probe sizes the pace gate uses: the longest profiled prefill (most signal against
    per-request overhead) and the shortest profiled decode input at the profiled length."""
    return PaceProbePlan(
        prefill_tokens=max(store.plan.prefill_lens),
        decode_input_tokens=min(store.plan.decode_input_lens),
        decode_tokens=store.plan.decode_tokens,
    )


def pace_gate(store: ProfileStore, results: Sequence[PaceResult], tolerance: float) -> GateOutcome:
    """The store describes the live engines: each engine's profiled generation is the one
    running now, and a short prefill and decode probe lands within ``tolerance`` (relative,
    either way) of what the store recorded for that engine at the same sizes."""
    failures: list[str] = []
    models = engine_models(store)
    engines: dict[str, Any] = {}
    for r in results:
        e = r.engine_id
        profile = store.engines.get(e)
        row: dict[str, Any] = {
            "generation": {
                "profiled": profile.generation if profile else None,
                "live": r.live_generation,
            }
        }
        engines[e] = row
        if profile is None:
            failures.append(f"{e}: has no profile in the store: profile it")
            continue
        if r.live_generation is None:
            failures.append(
                f"{e}: its live generation is unknown (attestation unreadable): cannot prove "
                "the store describes this engine process"
            )
        else:
            failures.extend(generation_problems(store, {e: r.live_generation}))
        if r.error is not None:
            failures.append(f"{e}: pace probe failed: {r.error}")
            continue
        if r.idle_problem is not None:
            failures.append(f"{e}: cannot measure pace: {r.idle_problem}")
            continue
        # Prefill: against the store's own samples at that length (the fit where none).
        measured = statistics.median(r.prefill_s) if r.prefill_s else None
        samples = [s.seconds for s in profile.prefill_samples if s.input_tokens == r.prefill_tokens]
        profiled = (
            statistics.median(samples)
            if samples
            else models[e].prefill.predict(r.prefill_tokens).seconds
        )
        row["prefill"] = _pace_row(r.prefill_tokens, measured, profiled, r.prefill_s)
        if measured is None:
            failures.append(f"{e}: the prefill probe produced no measurement")
        elif abs(measured / profiled - 1) > tolerance:
            failures.append(
                f"{e}: prefill of {r.prefill_tokens} tokens took {measured:.4f} s, profiled "
                f"{profiled:.4f} s ({_pct(measured / profiled - 1)}, tolerance "
                f"±{tolerance:.0%}): re-profile or fix the engine"
            )
        decode_samples = [
            s.seconds_per_token
            for s in profile.decode_samples
            if s.input_tokens == r.decode_input_tokens and s.concurrency == 1
        ]
        profiled_d = (
            statistics.median(decode_samples)
            if decode_samples
            else models[e].decode.seconds_per_token(1, r.decode_input_tokens + r.decode_tokens / 2)
        )
        measured_d = r.decode_s_per_token
        row["decode"] = _pace_row(r.decode_input_tokens, measured_d, profiled_d, None)
        row["decode"]["tokens"] = r.decode_tokens
        if measured_d is None:
            failures.append(f"{e}: the decode probe produced no measurement")
        elif abs(measured_d / profiled_d - 1) > tolerance:
            failures.append(
                f"{e}: decode took {measured_d:.5f} s/token at batch 1, profiled "
                f"{profiled_d:.5f} s/token ({_pct(measured_d / profiled_d - 1)}, tolerance "
                f"±{tolerance:.0%}): re-profile or fix the engine"
            )
    return outcome(
        f"{len(results)} engines run their profiled generation within ±{tolerance:.0%} of "
        "their profiled prefill and decode times",
        failures,
        [],
        {"tolerance": tolerance, "engines": engines},
    )


def _pace_row(
    tokens: int, measured: float | None, profiled: float, samples: list[float] | None
) -> dict[str, Any]:
    return {
        "input_tokens": tokens,
        "measured_s": rounded(measured),
        "profiled_s": rounded(profiled),
        "deviation": None if measured is None else rounded(measured / profiled - 1, 4),
        "samples_s": [rounded(s) for s in samples] if samples is not None else None,
    }


def _pct(ratio: float) -> str:
    return f"{ratio * 100:+.0f}%"
