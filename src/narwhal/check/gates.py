"""The gates: collected evidence in, a verdict with its evidence out. Pure: no sockets, no
files, no clock. Each function states what it proves in its docstring; ``docs/preflight.md``
says the same for operators, with what each gate does not prove.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from narwhal.check.evidence import (
    EngineHealth,
    GenerationResult,
    ModelsResult,
    PaceResult,
    PairResult,
    TokenizeResult,
)
from narwhal.check.plan import BenchmarkPlan
from narwhal.check.settings import CheckSettings
from narwhal.check.slo import (
    DES_METHOD,
    DES_REPLAYS,
    METHOD,
    LoadPoint,
    allocations,
    best_prediction,
    simulate_point,
)
from narwhal.contract import FleetContract
from narwhal.profiles.store import ProfileStore, engine_models, generation_problems
from narwhal.routing.prompt_length import (
    COLD_BYTES_PER_TOKEN,
    MAX_BYTES_PER_TOKEN,
    PromptLengthEstimator,
)

__all__ = [
    "DeadlineAdvice",
    "GateOutcome",
    "PaceProbePlan",
    "contract_gate",
    "generation_gate",
    "health_gate",
    "kv_prompt_tokens",
    "kv_transfer_gate",
    "model_gate",
    "pace_gate",
    "pace_probe_plan",
    "planned_prompt_tokens",
    "recommend_deadline",
    "slo_gate",
    "tokenization_gate",
]


@dataclass
class GateOutcome:
    verdict: Literal["pass", "fail"]
    summary: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)


def _outcome(
    summary: str, failures: list[str], notes: list[str], evidence: dict[str, Any]
) -> GateOutcome:
    if failures:
        return GateOutcome("fail", f"{len(failures)} problem(s)", failures, notes, evidence)
    return GateOutcome("pass", summary, [], notes, evidence)


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] + "…" if isinstance(value, str) and len(text) > 16 else text


def _pct(ratio: float) -> str:
    return f"{ratio * 100:+.0f}%"


# --- health -----------------------------------------------------------------------------------


def health_gate(
    fleet: FleetContract, results: Sequence[EngineHealth], bound_s: float
) -> GateOutcome:
    """Every engine's /health and attestation endpoint answer 200 within ``bound_s``."""
    failures: list[str] = []
    notes: list[str] = []
    engines: dict[str, Any] = {}
    for r in results:
        row: dict[str, Any] = {
            "health": {"status": r.health.status, "latency_s": _r(r.health.latency_s)}
        }
        if not r.health.ok:
            failures.append(f"{r.engine_id}: /health did not answer 200: {r.health.describe()}")
        if r.attestation is None:
            row["attestation"] = None
            notes.append(f"{r.engine_id}: the fleet gives no attestation_url")
        else:
            row["attestation"] = {
                "status": r.attestation.status,
                "latency_s": _r(r.attestation.latency_s),
            }
            if not r.attestation.ok:
                failures.append(
                    f"{r.engine_id}: attestation did not answer 200: {r.attestation.describe()}"
                )
            elif r.attestation_doc is None:
                failures.append(f"{r.engine_id}: attestation is not a JSON object")
        engines[r.engine_id] = row
    return _outcome(
        f"{len(results)} engines and their attestations answered within {bound_s} s",
        failures,
        notes,
        {"bound_s": bound_s, "engines": engines},
    )


# --- contract ---------------------------------------------------------------------------------

# Attested values every pair of NIXL peers must share: a decode engine reads the prefill
# engine's KV blocks byte for byte, so model, weights, parallelism, connector and block layout
# must all be the same.
_PEER_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model_id", ("model_id",)),
    ("model_revision", ("model_revision",)),
    ("config_sha256", ("config_sha256",)),
    ("shard_manifest_sha256", ("shard_manifest_sha256",)),
    ("image_digest", ("image_digest",)),
    ("tp", ("tp",)),
    ("gpu_arch", ("gpu_arch",)),
    ("accelerator", ("accelerator",)),
    ("kv_connector", ("kv_connector",)),
    ("kv_role", ("kv_role",)),
    ("kv_buffer_device", ("kv_buffer_device",)),
    ("kv_cache.block_size", ("kv_cache", "block_size")),
    ("kv_cache.block_bytes", ("kv_cache", "block_bytes")),
)


def _get(doc: Mapping[str, Any], path: Sequence[str]) -> Any:
    node: Any = doc
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


@dataclass
class _Comparer:
    """Compares one engine's attested values with the fleet's, recording each row."""

    engine_id: str
    rows: dict[str, Any]
    failures: list[str]

    def __call__(self, what: str, attested: Any, expected: Any, required: bool = True) -> None:
        row: dict[str, Any] = {"fleet": expected, "attested": attested}
        self.rows[what] = row
        if attested is None:
            row["match"] = None if not required else False
            if required:
                self.failures.append(f"{self.engine_id}: the attestation reports no {what}")
            return
        row["match"] = attested == expected
        if attested != expected:
            self.failures.append(
                f"{self.engine_id}: attested {what} {_short(attested)} differs from the "
                f"fleet's {_short(expected)}"
            )


def contract_gate(
    fleet: FleetContract,
    attestations: Mapping[str, dict[str, Any] | None],
    fetch_errors: Mapping[str, str],
) -> GateOutcome:
    """Each engine's attestation matches the fleet, and the engines agree with each other.

    Against the fleet: engine id, model id and revision, config and shard-manifest hashes
    (where the fleet pins them: null means "not pinned", reported but not failed), TP, GPU
    architecture, accelerator, KV connector, role and buffer device (where attested), NIXL side
    channel, generation (where the fleet pins it), readiness, checkpoint drift and a live
    engine process (sidecar attestations). Across engines: every value NIXL peers must share.
    """
    failures: list[str] = []
    notes: list[str] = []
    model, eng = fleet.model, fleet.engine
    per_engine: dict[str, Any] = {}
    for spec in fleet.engines:
        e = spec.id
        doc = attestations.get(e)
        if doc is None:
            why = fetch_errors.get(e) or "the fleet gives no attestation_url"
            failures.append(f"{e}: no attestation to check ({why})")
            per_engine[e] = None
            continue
        rows: dict[str, Any] = {}
        compare = _Comparer(e, rows, failures)
        state = doc.get("state")
        if state not in (None, "ready"):
            failures.append(f"{e}: attestation state is {state!r}, not ready")
        if doc.get("engine_id") is not None and doc.get("engine_id") != e:
            failures.append(
                f"{e}: the attestation at {spec.attestation_url} is engine "
                f"{doc.get('engine_id')!r}'s (wrong URL in the fleet?)"
            )
        compare("model_id", doc.get("model_id"), model.id)
        compare("model_revision", doc.get("model_revision"), model.revision)
        for key in ("config_sha256", "shard_manifest_sha256"):
            pinned = getattr(model, key)
            if pinned is not None:
                compare(key, doc.get(key), pinned)
            else:
                rows[key] = {"fleet": None, "attested": doc.get(key), "match": None}
        compare("tp", doc.get("tp"), eng.tp)
        compare("gpu_arch", doc.get("gpu_arch"), eng.gpu_arch)
        compare("accelerator", doc.get("accelerator"), eng.accelerator, required=False)
        compare("kv_connector", doc.get("kv_connector"), eng.kv_connector, required=False)
        compare("kv_role", doc.get("kv_role"), eng.kv_role, required=False)
        compare(
            "kv_buffer_device", doc.get("kv_buffer_device"), eng.kv_buffer_device, required=False
        )
        nixl = doc.get("nixl")
        expected_nixl = f"{spec.nixl.host}:{spec.nixl.port}"
        attested_nixl = (
            f"{nixl.get('host')}:{nixl.get('port')}" if isinstance(nixl, Mapping) else None
        )
        compare("nixl", attested_nixl, expected_nixl, required=False)
        if attested_nixl is None:
            notes.append(f"{e}: the attestation does not report its NIXL side channel")
        if spec.generation is not None:
            compare("generation", doc.get("generation"), spec.generation)
        else:
            rows["generation"] = {"fleet": None, "attested": doc.get("generation"), "match": None}
        drift = doc.get("drift")
        if isinstance(drift, list) and drift:
            first = drift[0] if isinstance(drift[0], Mapping) else {}
            failures.append(
                f"{e}: the checkpoint drifted since it was attested: {first.get('path')} "
                f"{first.get('kind')} ({len(drift)} change(s))"
            )
        if doc.get("engine_alive") is False:
            failures.append(f"{e}: the attestation's engine process (pid {doc.get('pid')}) is gone")
        per_engine[e] = rows
    for key in ("config_sha256", "shard_manifest_sha256"):
        if getattr(model, key) is None:
            notes.append(f"model.{key} is not pinned by the fleet: compared across engines only")

    # Agreement between engines, on what they attest (whatever the fleet pins).
    agreement: dict[str, Any] = {}
    for what, path in _PEER_KEYS:
        # Keyed by repr: values may be unhashable (lists) and 1 must differ from "1".
        groups: dict[str, tuple[Any, list[str]]] = {}
        for e, doc in attestations.items():
            if doc is None:
                continue
            value = _get(doc, path)
            if value is not None:
                groups.setdefault(repr(value), (value, []))[1].append(e)
        if not groups:
            continue
        agreement[what] = [{"value": v, "engines": sorted(ids)} for v, ids in groups.values()]
        if len(groups) > 1:
            ranked = sorted(groups.values(), key=lambda vi: (-len(vi[1]), sorted(vi[1])))
            parts = [f"{', '.join(sorted(ids))} {_short(value)}" for value, ids in ranked]
            failures.append(f"engines disagree on {what}: {'; '.join(parts)}")
    return _outcome(
        f"{len(fleet.engines)} attestations match the fleet and each other",
        failures,
        notes,
        {"engines": per_engine, "agreement": agreement},
    )


# --- generation -------------------------------------------------------------------------------


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
            "latency_s": _r(r.latency_s),
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
    return _outcome(
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


# --- model ------------------------------------------------------------------------------------


def model_gate(fleet: FleetContract, results: Sequence[ModelsResult]) -> GateOutcome:
    """``/v1/models`` on every engine lists exactly the fleet's model id, with a
    ``max_model_len`` at least the fleet's."""
    failures: list[str] = []
    engines: dict[str, Any] = {}
    want = fleet.model.id
    for r in results:
        engines[r.engine_id] = {"ids": r.ids, "max_model_len": r.max_model_len, "error": r.error}
        if r.error is not None:
            failures.append(f"{r.engine_id}: /v1/models failed: {r.error}")
            continue
        if r.ids != [want]:
            failures.append(
                f"{r.engine_id}: serves {', '.join(map(repr, r.ids or [])) or 'no model'}, "
                f"not exactly {want!r}"
            )
        if r.max_model_len is None:
            failures.append(f"{r.engine_id}: /v1/models reports no max_model_len")
        elif r.max_model_len < fleet.model.max_model_len:
            failures.append(
                f"{r.engine_id}: max_model_len {r.max_model_len} is below the fleet's "
                f"{fleet.model.max_model_len}"
            )
    return _outcome(
        f"{len(results)} engines serve exactly {want} with max_model_len >= "
        f"{fleet.model.max_model_len}",
        failures,
        [],
        {"model": want, "max_model_len": fleet.model.max_model_len, "engines": engines},
    )


# --- pace -------------------------------------------------------------------------------------


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
    return _outcome(
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
        "measured_s": _r(measured),
        "profiled_s": _r(profiled),
        "deviation": None if measured is None else _r(measured / profiled - 1, 4),
        "samples_s": [_r(s) for s in samples] if samples is not None else None,
    }


# --- tokenization -----------------------------------------------------------------------------


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
        return _outcome("", failures or ["no engine tokenized the prompt set"], notes, evidence)
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
                "bytes_per_token": _r(ratio, 4),
                "estimate": estimate,
                "error": _r(error, 4),
                "cold_start_estimate": cold,
                "cold_start_error": _r(abs(cold - count) / count if count else None, 4),
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
        "converged_bytes_per_token": _r(converged, 4),
        "max_error": _r(worst, 4),
        "prompts": rows,
    }
    return _outcome(
        f"{len(results)} engines agree on {len(prompts)} prompts; router estimate within "
        f"{worst:.0%} (tolerance {tolerance:.0%})",
        failures,
        notes,
        evidence,
    )


# --- kv_transfer ------------------------------------------------------------------------------


def planned_prompt_tokens(
    store: ProfileStore | None, plan: BenchmarkPlan | None
) -> tuple[int | None, str]:
    """The prompt length the budgets are judged at, and why that one."""
    if plan is not None:
        return plan.workload.input_tokens, "the benchmark plan's workload input_tokens"
    if store is not None:
        return (
            max(store.plan.prefill_lens),
            "the longest prompt the profile store was measured at (no --plan)",
        )
    return None, "no plan and no profile store"


def kv_prompt_tokens(
    settings: CheckSettings,
    store: ProfileStore | None,
    plan: BenchmarkPlan | None,
    max_model_len: int,
) -> tuple[int, str]:
    """The handoff probes' prompt length, and why that one."""
    if settings.kv_prompt_tokens is not None:
        tokens, why = settings.kv_prompt_tokens, "--kv-prompt-tokens"
    else:
        planned, why = planned_prompt_tokens(store, plan)
        tokens = planned if planned is not None else 1024
        if planned is None:
            why = "default (no plan, no profile store)"
    # Prompt plus the streamed tokens must fit the engines' context.
    room = max_model_len - settings.kv_output_tokens
    if tokens > room:
        return room, f"{why}, capped at max_model_len - output tokens"
    return tokens, why


@dataclass(frozen=True)
class DeadlineAdvice:
    value_s: float | None
    lower_s: float
    upper_s: float
    headroom_s: float | None
    how: str

    def document(self) -> dict[str, Any]:
        return {
            "recommended_first_token_timeout_s": self.value_s,
            "lower_bound_s": _r(self.lower_s),
            "upper_bound_s": _r(self.upper_s),
            "ttft_left_after_prefill_and_deadline_s": _r(self.headroom_s),
            "how": self.how,
        }


def recommend_deadline(
    observed_max_s: float, ttft_s: float, prefill_s: float, margin: float
) -> DeadlineAdvice:
    """A first-token deadline above the observed maximum with ``margin`` (relative), rounded
    up to 0.5 s (0.1 s, 0.01 s when the budget is tight), and below the TTFT budget minus the
    prefill, so a request whose deadline expires still has its prefill inside the budget."""
    lower = observed_max_s * (1 + margin)
    upper = ttft_s - prefill_s
    base = (
        f"observed maximum {observed_max_s:.3f} s x (1 + margin {margin:g}) = {lower:.3f} s, "
        f"rounded up; must stay below TTFT budget {ttft_s:g} s - prefill {prefill_s:.3f} s = "
        f"{upper:.3f} s"
    )
    if observed_max_s >= upper:
        return DeadlineAdvice(
            None,
            lower,
            upper,
            None,
            f"impossible: the slowest handoff ({observed_max_s:.3f} s) plus the prefill "
            f"({prefill_s:.3f} s) already exceeds the TTFT budget {ttft_s:g} s; no deadline "
            "both admits the observed handoffs and fits the budget (fix the KV path or raise "
            "the budget)",
        )
    value: float | None = None
    for step in (0.5, 0.1, 0.01):
        candidate = round(max(1, math.ceil(lower / step - 1e-9)) * step, 2)
        if candidate < upper:
            value = candidate
            break
    how = base
    if value is None:
        # The margin does not fit: the largest deadline that does, still above the maximum.
        value = (math.ceil(upper * 100 - 1e-9) - 1) / 100
        if value <= observed_max_s:
            value = round((observed_max_s + upper) / 2, 4)
        how = f"{base}; the margin does not fit, so the largest value below the bound"
    return DeadlineAdvice(value, lower, upper, ttft_s - prefill_s - value, how)


def _dist(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

    return {
        "n": len(ordered),
        "min_s": _r(ordered[0]),
        "p50_s": _r(statistics.median(ordered)),
        "p90_s": _r(q(0.9)),
        "max_s": _r(ordered[-1]),
        "mean_s": _r(statistics.fmean(ordered)),
    }


def kv_transfer_gate(
    fleet: FleetContract,
    pairs: Sequence[PairResult],
    prompt_tokens: int,
    prompt_basis: str,
    window_s: float,
    margin: float,
    profiled_prefill: tuple[float, str] | None,
) -> GateOutcome:
    """Every permitted (prefill, decode) pair completes real handoffs: the prefill leg returns
    kv_transfer_params, the decode leg pulls the KV (its NIXL transfer count rises, where the
    engine exports it) and streams its tokens, with every first token (decode leg start to its
    first token, the router's deadline clock) within ``first_token_timeout_s``.

    Also reports the first-token distribution and a recommended deadline (``recommend_deadline``)
    against the prefill time: ``profiled_prefill`` (seconds at the planned prompt length on the
    slowest prefill engine, and why) when a store is given, else the slowest prefill leg seen.
    """
    deadline = fleet.engine.first_token_timeout_s
    failures: list[str] = []
    notes: list[str] = []
    per_pair: dict[str, Any] = {}
    all_first: list[float] = []
    all_prefill: list[float] = []
    unbounded = False
    for pair in pairs:
        firsts = [p.first_token_s for p in pair.probes if p.first_token_s is not None]
        prefills = [p.prefill_s for p in pair.probes if p.prefill_s is not None]
        all_first += firsts
        all_prefill += prefills
        errors = [(i, p.error) for i, p in enumerate(pair.probes) if p.error is not None]
        completed = sum(1 for p in pair.probes if p.error is None)
        per_pair[pair.name] = {
            "first_token": _dist(firsts),
            "prefill_leg": _dist(prefills),
            "probes": [
                {
                    "prefill_s": _r(p.prefill_s),
                    "first_token_s": _r(p.first_token_s),
                    "tokens": p.tokens,
                    "error": p.error,
                }
                for p in pair.probes
            ],
            "kv_transfers": pair.kv_transfers,
            "kv_bytes": pair.kv_bytes,
            "failed_transfers": pair.failed_transfers,
        }
        for i, error in errors:
            failures.append(f"{pair.name}: handoff {i + 1}/{len(pair.probes)} failed: {error}")
            if "no first token within" in error:
                unbounded = True
        if firsts and max(firsts) > deadline:
            over = sum(1 for f in firsts if f > deadline)
            failures.append(
                f"{pair.name}: first token after {max(firsts):.3f} s ({over} of "
                f"{len(pair.probes)} handoffs over) exceeds first_token_timeout_s {deadline:g} s"
            )
        if pair.kv_transfers is None:
            notes.append(
                f"{pair.name}: {pair.decode} exports no vllm:nixl_bytes_transferred: KV movement "
                "not confirmed by metrics"
            )
        elif completed and pair.kv_transfers < completed:
            failures.append(
                f"{pair.name}: {pair.decode}'s NIXL transfer count rose by "
                f"{pair.kv_transfers:g} over {completed} completed handoffs: the KV did not move "
                "(decode prefilled locally?)"
            )
    if not pairs:
        failures.append("the fleet has no permitted pair to probe")

    if profiled_prefill is not None:
        prefill_s, prefill_basis = profiled_prefill
    elif all_prefill:
        prefill_s = max(all_prefill)
        prefill_basis = (
            f"the slowest prefill leg of these probes ({prompt_tokens} tokens; no profile store)"
        )
    else:
        prefill_s, prefill_basis = 0.0, "no prefill measured"
    if unbounded:
        advice: dict[str, Any] = {
            "recommended_first_token_timeout_s": None,
            "how": f"impossible to say: a handoff produced no first token within the "
            f"{window_s:g} s observation window, so the maximum is unknown",
        }
    elif all_first:
        advice = recommend_deadline(
            max(all_first), fleet.budgets.ttft_s, prefill_s, margin
        ).document()
    else:
        advice = {"recommended_first_token_timeout_s": None, "how": "no handoff completed"}
    advice["prefill_s"] = _r(prefill_s)
    advice["prefill_basis"] = prefill_basis
    recommended = advice.get("recommended_first_token_timeout_s")
    if recommended is not None and recommended >= fleet.engine.request_timeout_s:
        notes.append(
            f"the recommended deadline {recommended:g} s is not below engine.request_timeout_s "
            f"{fleet.engine.request_timeout_s:g} s: raise that too"
        )
    dist = _dist(all_first)
    evidence = {
        "first_token_timeout_s": deadline,
        "prompt_tokens": prompt_tokens,
        "prompt_basis": prompt_basis,
        "handoffs_per_pair": max((len(p.probes) for p in pairs), default=0),
        "observation_window_s": window_s,
        "first_token": dist,
        "prefill_leg": _dist(all_prefill),
        "pairs": per_pair,
        "recommendation": advice,
    }
    summary = (
        f"{len(pairs)} pairs x {evidence['handoffs_per_pair']} handoffs: first token "
        f"{dist.get('min_s', 0):.3f}-{dist.get('max_s', 0):.3f} s (p50 "
        f"{dist.get('p50_s', 0):.3f}) within the {deadline:g} s deadline; recommended "
        f"{recommended} s"
    )
    if failures and recommended is not None:
        notes.append(
            f"recommended engine.first_token_timeout_s: {recommended:g} s ({advice['how']})"
        )
    return _outcome(summary, failures, notes, evidence)


# --- slo --------------------------------------------------------------------------------------


def slo_gate(
    fleet: FleetContract,
    fleet_sha256: str,
    store: ProfileStore,
    plan: BenchmarkPlan | None,
    handoff_p50_s: float | None,
    tpot_headroom: float,
) -> GateOutcome:
    """The budgets are reachable by the profiled engines: the first-token deadline plus the
    profiled prefill (at the planned prompt length) fits the TTFT budget on every prefill-capable
    engine; the batch-1 decode time leaves ``tpot_headroom`` of the TPOT budget on every
    decode-capable engine; with a plan, each point's predicted attainment (``slo.METHOD``)
    meets its target."""
    failures: list[str] = []
    notes: list[str] = []
    models = engine_models(store)
    budgets, deadline = fleet.budgets, fleet.engine.first_token_timeout_s
    length, length_basis = planned_prompt_tokens(store, plan)
    assert length is not None  # a store is given
    output = plan.workload.output_tokens if plan is not None else store.plan.decode_tokens
    context = length + output / 2
    missing = [e.id for e in fleet.engines if e.id not in models]
    for e in missing:
        failures.append(f"{e}: has no profile in the store: its latency is unknown")
    ttft_rows: dict[str, Any] = {}
    for spec in fleet.prefill_capable():
        if spec.id not in models:
            continue
        pred = models[spec.id].prefill.predict(length)
        left = budgets.ttft_s - deadline - pred.seconds
        ttft_rows[spec.id] = {
            "prefill_s": _r(pred.seconds),
            "extrapolated": pred.extrapolated,
            "ttft_left_s": _r(left),
        }
        if pred.extrapolated:
            notes.append(f"{spec.id}: prefill at {length} tokens is extrapolated from the profile")
        if left < 0:
            failures.append(
                f"{spec.id}: profiled prefill of {length} tokens ({pred.seconds:.3f} s) + "
                f"first-token deadline {deadline:g} s = {pred.seconds + deadline:.3f} s exceeds "
                f"the TTFT budget {budgets.ttft_s:g} s"
            )
    tpot_rows: dict[str, Any] = {}
    allowed = budgets.tpot_s * (1 - tpot_headroom)
    for spec in fleet.decode_capable():
        if spec.id not in models:
            continue
        pred = models[spec.id].decode.predict(1, context)
        tpot_rows[spec.id] = {
            "batch1_s_per_token": _r(pred.seconds),
            "extrapolated": pred.extrapolated,
            "headroom": _r(1 - pred.seconds / budgets.tpot_s, 4),
        }
        if pred.extrapolated:
            notes.append(
                f"{spec.id}: decode at {context:g} tokens of context is extrapolated from the "
                "profile (profile longer decode inputs to cover it)"
            )
        if pred.seconds > allowed:
            failures.append(
                f"{spec.id}: batch-1 decode {pred.seconds:.4f} s/token at {context:g} tokens of "
                f"context leaves {1 - pred.seconds / budgets.tpot_s:.0%} of the TPOT budget "
                f"{budgets.tpot_s:g} s (needs {tpot_headroom:.0%} headroom)"
            )
    evidence: dict[str, Any] = {
        "prompt_tokens": length,
        "prompt_basis": length_basis,
        "output_tokens": output,
        "budgets": {"ttft_s": budgets.ttft_s, "tpot_s": budgets.tpot_s},
        "first_token_timeout_s": deadline,
        "tpot_headroom": tpot_headroom,
        "ttft": ttft_rows,
        "tpot": tpot_rows,
    }
    if plan is not None:
        evidence["plan"] = _plan_evidence(
            fleet, fleet_sha256, plan, models, handoff_p50_s, failures, missing
        )
    summary = (
        f"deadline + profiled prefill at {length} tokens fits {budgets.ttft_s:g} s; batch-1 "
        f"decode leaves >= {tpot_headroom:.0%} of {budgets.tpot_s:g} s"
    )
    if plan is not None:
        summary += f"; {len(plan.points)} plan points predicted to meet their targets"
    return _outcome(summary, failures, notes, evidence)


def _plan_evidence(
    fleet: FleetContract,
    fleet_sha256: str,
    plan: BenchmarkPlan,
    models: Mapping[str, Any],
    handoff_p50_s: float | None,
    failures: list[str],
    missing: list[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "method": METHOD,
        "handoff_basis": (
            f"kv_transfer gate's median first-token latency {handoff_p50_s:.4f} s"
            if handoff_p50_s is not None
            else "no kv_transfer measurement: one batch-1 decode step + 20 ms transfer"
        ),
        "points": {},
    }
    if plan.fleet.sha256 != fleet_sha256:
        failures.append(
            f"the plan was written for fleet sha256 {plan.fleet.sha256[:12]} "
            f"({plan.fleet.path}), not this fleet ({fleet_sha256[:12]})"
        )
    if missing:
        return out
    candidates = allocations(fleet)
    seed = plan.seed if plan.seed is not None else 0
    for index, point in enumerate(plan.points):
        load = LoadPoint(
            rate=point.rate,
            input_tokens=plan.workload.input_tokens,
            output_tokens=plan.workload.output_tokens,
            ttft_s=point.ttft_s,
            tpot_s=point.tpot_s,
            timeout_s=point.timeout_s,
        )
        initial, best = best_prediction(models, candidates, load, handoff_p50_s)
        simulated = simulate_point(fleet, models, load, point.requests, seed + index, handoff_p50_s)
        row: dict[str, Any] = {
            "rate": point.rate,
            "requests": point.requests,
            "target": point.attainment,
            "analytic": best.document(),
            "analytic_initial_allocation": initial.document(),
        }
        if simulated is not None:
            out["method"] = DES_METHOD
            out["cross_check"] = METHOD
            predicted = simulated.attainment
            row["simulated"] = {
                **simulated.summary,
                "attainment_per_replay": list(simulated.per_seed),
                "first_seed": seed + index * DES_REPLAYS,
                "transfer_s": _r(simulated.transfer_s),
                "timed_out": simulated.timed_out,
            }
            sim = simulated.summary
            why = (
                f"simulated {sim['met_slo']}/{sim['offered']} within budgets over "
                f"{DES_REPLAYS} replays, {sim['rejected']} rejected, {sim['deadline_missed']} "
                f"past the deadline, TTFT p95 {sim['ttft_p95_s']} s, TPOT p95 "
                f"{sim['tpot_p95_s']} s"
            )
        else:
            predicted = best.attainment
            why = "; ".join(best.limits) or "no limit identified"
        row["predicted_attainment"] = _r(predicted, 4)
        out["points"][point.name] = row
        if predicted < point.attainment:
            failures.append(
                f"plan point {point.name!r} ({point.rate:g} req/s): predicted attainment "
                f"{predicted:.3f} is below the target {point.attainment:g} ({why})"
            )
    if fleet.roles.enabled:
        out["analytic_allocation"] = "best split the role controller may reach"
    return out
