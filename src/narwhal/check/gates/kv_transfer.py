"""The kv_transfer gate: every permitted (prefill, decode) pair completes real handoffs
within the first-token deadline; and the deadline it recommends from what it observed."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from narwhal.check.evidence import KVEventsSeen, PairResult
from narwhal.check.gates.common import GateOutcome, outcome, planned_prompt_tokens, rounded
from narwhal.check.plan import BenchmarkPlan
from narwhal.check.settings import CheckSettings
from narwhal.contract import FleetContract
from narwhal.profiles.store import ProfileStore

__all__ = [
    "DeadlineAdvice",
    "block_bytes_finding",
    "cached_tokens_notes",
    "kv_events_findings",
    "kv_prompt_tokens",
    "kv_transfer_gate",
    "recommend_deadline",
]


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
            "lower_bound_s": rounded(self.lower_s),
            "upper_bound_s": rounded(self.upper_s),
            "ttft_left_after_prefill_and_deadline_s": rounded(self.headroom_s),
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
        "min_s": rounded(ordered[0]),
        "p50_s": rounded(statistics.median(ordered)),
        "p90_s": rounded(q(0.9)),
        "max_s": rounded(ordered[-1]),
        "mean_s": rounded(statistics.fmean(ordered)),
    }


def block_bytes_finding(fleet: FleetContract, pair: PairResult, prompt_tokens: int) -> str | None:
    """Where the fleet says a KV block's bytes (``engine.prefix_caching.block_bytes``, a
    simulated engine's ``sim.block_bytes``): the bytes each probe handoff pulled (by the decode
    engine's NIXL metrics) against what they make of a ``prompt_tokens`` prompt, every block of
    it (the probes' prompts are salted: the decode engine holds none of them). A wrong value
    would misreport every request's ``kv_bytes_moved`` in the router's journal."""
    block_tokens, block_bytes = fleet.kv_block(pair.decode)
    if block_bytes is None or pair.kv_bytes is None or not pair.kv_transfers:
        return None
    blocks = -(-prompt_tokens // block_tokens)
    pulled = pair.kv_bytes / pair.kv_transfers
    if pulled == blocks * block_bytes:
        return None
    return (
        f"{pair.name}: {pair.decode} pulled {pulled:,.0f} bytes a handoff for {prompt_tokens} "
        f"prompt tokens ({blocks} blocks of {block_tokens}), where the fleet's block_bytes "
        f"{block_bytes:,} makes {blocks * block_bytes:,}: the router's kv_bytes_moved would "
        f"misreport (a block of {pulled / blocks:,.0f} bytes?)"
    )


def kv_transfer_gate(
    fleet: FleetContract,
    pairs: Sequence[PairResult],
    prompt_tokens: int,
    prompt_basis: str,
    window_s: float,
    margin: float,
    profiled_prefill: tuple[float, str] | None,
    kv_events: Sequence[KVEventsSeen] = (),
) -> GateOutcome:
    """Every permitted (prefill, decode) pair completes real handoffs: the prefill leg returns
    kv_transfer_params, the decode leg pulls the KV (its NIXL transfer count rises, where the
    engine exports it) and streams its tokens, with every first token (decode leg start to its
    first token, the router's deadline clock) within ``first_token_timeout_s``.

    Also reports the first-token distribution and a recommended deadline (``recommend_deadline``)
    against the prefill time: ``profiled_prefill`` (seconds at the planned prompt length on the
    slowest prefill engine, and why) when a store is given, else the slowest prefill leg seen.

    And every engine the fleet says publishes KV events (``kv_events``) published, during the
    handoffs it took part in, batches the router can read, of blocks of the fleet's block size,
    with a replay socket that gives them back (``kv_events_findings``).
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
                    "prefill_s": rounded(p.prefill_s),
                    "first_token_s": rounded(p.first_token_s),
                    "tokens": p.tokens,
                    "error": p.error,
                    "reports_cached_tokens": p.reports_cached_tokens,
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
        elif pair.kv_transfers == completed:  # every transfer counted is one of the probes'
            wrong = block_bytes_finding(fleet, pair, prompt_tokens)
            if wrong is not None:
                failures.append(wrong)
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
    advice["prefill_s"] = rounded(prefill_s)
    advice["prefill_basis"] = prefill_basis
    recommended = advice.get("recommended_first_token_timeout_s")
    if recommended is not None and recommended >= fleet.engine.request_timeout_s:
        notes.append(
            f"the recommended deadline {recommended:g} s is not below engine.request_timeout_s "
            f"{fleet.engine.request_timeout_s:g} s: raise that too"
        )
    answered = [p for p in pairs if any(x.error is None for x in p.probes)]
    ran = {engine for p in answered for engine in (p.prefill, p.decode)}
    event_failures, event_notes, events_evidence = kv_events_findings(
        fleet, kv_events, ran, prompt_tokens
    )
    failures += event_failures
    notes += event_notes
    notes += cached_tokens_notes(fleet, pairs)
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
        "kv_events": events_evidence,
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
    return outcome(summary, failures, notes, evidence)


def cached_tokens_notes(fleet: FleetContract, pairs: Sequence[PairResult]) -> list[str]:
    """Prefill engines whose answers carry no ``usage.prompt_tokens_details.cached_tokens``
    (vLLM reports it only with ``--enable-prompt-tokens-details``), where the router indexes
    prefixes: a note, as routing works without it, but the router cannot set its predicted
    hits beside the engine's (the journal's ``cached_tokens_reported``, the hit rate panel,
    NarwhalPrefixHitsOverPredicted)."""
    if not (fleet.engine.prefix_caching.enabled and fleet.routing.prefix.enabled):
        return []
    seen: dict[str, set[bool]] = {}
    for pair in pairs:
        for probe in pair.probes:
            if probe.reports_cached_tokens is not None:
                seen.setdefault(pair.prefill, set()).add(probe.reports_cached_tokens)
    silent = sorted(e for e, answers in seen.items() if answers == {False})
    if not silent:
        return []
    return [
        f"{', '.join(silent)}: no usage.prompt_tokens_details.cached_tokens in the prefill "
        "answers (vLLM's --enable-prompt-tokens-details): the router cannot compare its "
        "predicted prefix hits with the engine's (cached_tokens_reported, the Prefix hit rate "
        "panel, NarwhalPrefixHitsOverPredicted)"
    ]


def kv_events_findings(
    fleet: FleetContract, seen: Sequence[KVEventsSeen], ran: set[str], prompt_tokens: int
) -> tuple[list[str], list[str], dict[str, Any]]:
    """Judge the engines' KV event streams as the handoffs left them: (failures, notes,
    evidence). Only engines that completed a handoff (``ran``) are judged, and only where the
    router reads the streams (prefix caching on and ``routing.prefix`` enabled) and the probes'
    prompts (``prompt_tokens``) fill a block: their prefills stored blocks (a prefill engine)
    or their KV pulls did (a decode engine), which vLLM publishes. An engine without
    ``kv_events`` is routed to by the router's own routing history (approximate): a note."""
    failures: list[str] = []
    notes: list[str] = []
    evidence: dict[str, Any] = {}
    cache = fleet.engine.prefix_caching
    read = cache.enabled and fleet.routing.prefix.enabled
    silent = [e.id for e in fleet.engines if e.kv_events is None]
    if silent and read:
        notes.append(
            f"{', '.join(silent)}: no kv_events in the fleet: the router routes to "
            f"{'them' if len(silent) > 1 else 'it'} by its own routing history (approximate)"
        )
    for s in seen:
        evidence[s.engine_id] = {
            "endpoint": s.endpoint,
            "replay_endpoint": s.replay_endpoint,
            "batches": s.batches,
            "stored_blocks": s.stored_blocks,
            "removed_blocks": s.removed_blocks,
            "cleared": s.cleared,
            "block_sizes": list(s.block_sizes),
            "unreadable_batches": s.bad_payloads,
            "resets": s.resets,
            "replay": s.replay,
            "error": s.error,
        }
        if not read:
            why = "prefix caching" if not cache.enabled else "routing.prefix"
            notes.append(f"{s.engine_id}: KV events not judged: the fleet's {why} is off")
            continue
        if prompt_tokens < cache.block_size:
            notes.append(
                f"{s.engine_id}: KV events not judged: the probes' {prompt_tokens}-token "
                f"prompts fill no {cache.block_size}-token block"
            )
            continue
        if s.engine_id not in ran:
            notes.append(f"{s.engine_id}: completed no handoff: its KV events not judged")
            continue
        where = f"{s.engine_id}: KV events at {s.endpoint}"
        if s.error is not None:
            failures.append(f"{where}: the subscription stopped reading: {s.error}")
            continue
        if s.batches == 0:
            failures.append(
                f"{where}: no batch during its handoffs: the router would route to it by its "
                "routing history only (is vLLM's --kv-events-config publishing there, with "
                "prefix caching on?)"
            )
            continue
        if s.stored_blocks == 0:
            failures.append(f"{where}: {s.batches} batches, none storing a block")
        if s.bad_payloads:
            failures.append(f"{where}: {s.bad_payloads} batches the router cannot read")
        foreign = [b for b in s.block_sizes if b != cache.block_size]
        if foreign:
            failures.append(
                f"{where}: blocks of {foreign[0]} tokens where the fleet's "
                f"engine.prefix_caching.block_size is {cache.block_size}: the router cannot "
                "index them"
            )
        if s.replay_endpoint is not None and s.replay is not None and s.replay != "ok":
            failures.append(
                f"{s.engine_id}: KV event replay at {s.replay_endpoint}: {s.replay}: a gap in "
                "its events could not be filled (the router would reset its index instead)"
            )
    return failures, notes, evidence
