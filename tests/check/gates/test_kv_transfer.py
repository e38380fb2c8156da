"""The kv_transfer gate against recorded handoffs, its deadline recommendation and the
handoff probes' prompt length."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.check.evidence import HandoffProbe, KVEventsSeen, PairResult
from narwhal.check.gates.kv_transfer import (
    kv_events_findings,
    kv_prompt_tokens,
    kv_transfer_gate,
    recommend_deadline,
)
from narwhal.check.plan import BenchmarkPlan
from narwhal.check.settings import CheckSettings
from tests.check.support import KIMI, fleet_doc, loaded, make_store, plan_doc, point


def test_recommendation_reproduces_the_qualification_run() -> None:
    # Observed 0.348-5.274 s, 8,192-token prefill 0.92 s, 10 s TTFT: the run chose 8.5 s,
    # "leaving about 0.6 s of the 10 s TTFT budget after the measured prefill".
    advice = recommend_deadline(5.274, ttft_s=10.0, prefill_s=0.92, margin=0.6)
    assert advice.value_s == 8.5
    assert advice.headroom_s == pytest.approx(0.58)
    assert advice.lower_s == pytest.approx(5.274 * 1.6)
    assert advice.upper_s == pytest.approx(9.08)
    # The packaged deadline is below the observed maximum: the gate would have failed.
    assert 2.5 < 5.274


def test_recommendation_when_the_margin_does_not_fit_or_nothing_does() -> None:
    tight = recommend_deadline(8.0, ttft_s=10.0, prefill_s=0.92, margin=0.6)
    assert tight.value_s is not None and 8.0 < tight.value_s < 9.08
    assert "margin does not fit" in tight.how
    impossible = recommend_deadline(9.5, ttft_s=10.0, prefill_s=0.92, margin=0.6)
    assert impossible.value_s is None and impossible.how.startswith("impossible")
    fine_steps = recommend_deadline(0.03, ttft_s=10.0, prefill_s=0.1, margin=0.6)
    assert fine_steps.value_s == 0.5


def _pair(p: str, d: str, firsts: list[float], kv: float | None = None, **kw: Any) -> PairResult:
    probes = [HandoffProbe(prefill_s=0.1, first_token_s=f, tokens=2) for f in firsts]
    # No bytes: what they should be depends on the prompt (block_bytes_finding's test).
    return PairResult(p, d, probes, float(len(firsts)) if kv is None else kv, None, 0.0, **kw)


def test_kv_transfer_names_the_slow_pair_and_recommends() -> None:
    fleet = loaded(fleet_doc(3)).contract
    pairs = [
        _pair("e0", "e1", [0.35, 0.4, 0.5]),
        _pair("e0", "e2", [3.1, 5.274, 4.0]),
        _pair("e1", "e2", [0.4, 0.6, 0.5]),
    ]
    out = kv_transfer_gate(fleet, pairs, 8192, "plan", 10.0, 0.6, (0.92, "profiled"))
    assert out.verdict == "fail"
    assert len(out.failures) == 1 and out.failures[0].startswith("e0->e2: first token after 5.274")
    rec = out.evidence["recommendation"]
    assert rec["recommended_first_token_timeout_s"] == 8.5
    assert rec["prefill_basis"] == "profiled"
    assert out.evidence["first_token"]["n"] == 9
    assert out.evidence["first_token"]["min_s"] == 0.35
    assert out.evidence["first_token"]["max_s"] == 5.274
    assert any("recommended engine.first_token_timeout_s: 8.5" in n for n in out.notes)


def test_kv_transfer_requires_the_kv_to_move_where_the_metric_exists() -> None:
    fleet = loaded(fleet_doc(2)).contract
    moved_nothing = _pair("e0", "e1", [0.1, 0.1], kv=0.0)
    no_metric = PairResult("e1", "e0", [HandoffProbe(0.1, 0.1, 2)], None, None, None)
    out = kv_transfer_gate(fleet, [moved_nothing, no_metric], 512, "x", 10.0, 0.6, None)
    assert out.verdict == "fail"
    assert out.failures == [
        "e0->e1: e1's NIXL transfer count rose by 0 over 2 completed handoffs: the KV did not "
        "move (decode prefilled locally?)"
    ]
    assert any("e1->e0" in n and "not confirmed" in n for n in out.notes)
    # No store: the prefill the recommendation leaves room for is the slowest leg observed.
    assert "slowest prefill leg" in out.evidence["recommendation"]["prefill_basis"]


def test_kv_transfer_unbounded_handoff_makes_the_recommendation_impossible() -> None:
    fleet = loaded(fleet_doc(2)).contract
    stuck = PairResult(
        "e0",
        "e1",
        [HandoffProbe(0.1, None, 0, "no first token within the 10 s observation window")],
        0.0,
    )
    out = kv_transfer_gate(fleet, [stuck], 512, "x", 10.0, 0.6, None)
    assert out.verdict == "fail" and "e0->e1: handoff 1/1 failed" in out.failures[0]
    rec = out.evidence["recommendation"]
    assert rec["recommended_first_token_timeout_s"] is None
    assert "maximum is unknown" in rec["how"]


def test_kv_prompt_length_follows_plan_then_store_and_fits_the_context() -> None:
    store, _ = make_store({"e0": KIMI})
    s = CheckSettings()
    plan = BenchmarkPlan.model_validate(plan_doc("0" * 64, [point("a", 1.0)]))
    assert kv_prompt_tokens(s, store, plan, 16384)[0] == 8192
    assert kv_prompt_tokens(s, store, None, 16384)[0] == 8192
    assert kv_prompt_tokens(s, None, None, 16384) == (1024, "default (no plan, no profile store)")
    assert kv_prompt_tokens(s, store, None, 4096)[0] == 4096 - s.kv_output_tokens


def _events_fleet(routing: dict[str, Any] | None = None, **prefix_caching: Any) -> Any:
    doc = fleet_doc(3, kv_event_ports=[(1001, 1002), (1003, 1004), (1005, 1006)])
    if routing is not None:
        doc["routing"] = routing
    del doc["engines"][2]["kv_events"]
    if prefix_caching:
        doc["engine"]["prefix_caching"] = prefix_caching
    return loaded(doc).contract


def _seen(engine: str, **kw: Any) -> KVEventsSeen:
    fields: dict[str, Any] = {
        "batches": 3,
        "stored_blocks": 64,
        "block_sizes": (16,),
        "replay": "ok",
    }
    fields.update(kw)
    return KVEventsSeen(engine, f"tcp://h:{engine}", f"tcp://h:r{engine}", **fields)


def test_kv_events_of_engines_that_ran_a_handoff_are_judged() -> None:
    fleet = _events_fleet()
    failures, notes, evidence = kv_events_findings(
        fleet,
        [_seen("e0"), _seen("e1", batches=0, stored_blocks=0, replay=None)],
        {"e0", "e1"},
        512,
    )
    assert failures == [
        "e1: KV events at tcp://h:e1: no batch during its handoffs: the router would route to "
        "it by its routing history only (is vLLM's --kv-events-config publishing there, with "
        "prefix caching on?)"
    ]
    assert notes == [
        "e2: no kv_events in the fleet: the router routes to it by its own routing history "
        "(approximate)"
    ]
    assert evidence["e0"]["batches"] == 3 and evidence["e0"]["replay"] == "ok"


@pytest.mark.parametrize(
    ("seen", "says"),
    [
        (_seen("e0", block_sizes=(16, 32)), "blocks of 32 tokens where the fleet's"),
        (_seen("e0", bad_payloads=2), "2 batches the router cannot read"),
        (_seen("e0", stored_blocks=0), "3 batches, none storing a block"),
        (_seen("e0", replay="no answer within 2 s"), "replay at tcp://h:re0: no answer"),
        (_seen("e0", error="KeyError: 'x'"), "the subscription stopped reading: KeyError"),
    ],
)
def test_kv_events_the_router_could_not_use_fail(seen: KVEventsSeen, says: str) -> None:
    failures, _, _ = kv_events_findings(_events_fleet(), [seen], {"e0"}, 512)
    assert len(failures) == 1 and says in failures[0], failures


def test_kv_events_are_not_judged_where_the_router_would_not_read_them() -> None:
    silent = _seen("e0", batches=0, stored_blocks=0)
    failures, notes, _ = kv_events_findings(_events_fleet(), [silent], set(), 512)
    assert failures == [] and "e0: completed no handoff" in notes[-1]
    failures, notes, _ = kv_events_findings(_events_fleet(enabled=False), [silent], {"e0"}, 512)
    assert failures == []
    assert notes == ["e0: KV events not judged: the fleet's prefix caching is off"]
    routing_off = _events_fleet(routing={"prefix": {"enabled": False}})
    failures, notes, _ = kv_events_findings(routing_off, [silent], {"e0"}, 512)
    assert failures == []
    assert notes == ["e0: KV events not judged: the fleet's routing.prefix is off"]
    failures, notes, _ = kv_events_findings(_events_fleet(), [silent], {"e0"}, 8)
    assert failures == [] and "the probes' 8-token prompts fill no 16-token block" in notes[-1]


def test_prefill_engines_that_report_no_cached_tokens_get_a_note() -> None:
    """vLLM reports usage.prompt_tokens_details.cached_tokens only with
    --enable-prompt-tokens-details: routing works without it, but the router's predicted hits
    have nothing to be compared with. A note (not a failure) names the prefill engines."""
    fleet = loaded(fleet_doc(3)).contract

    def pair(p: str, d: str, reports: bool | None) -> PairResult:
        probes = [
            HandoffProbe(prefill_s=0.1, first_token_s=0.2, tokens=2, reports_cached_tokens=reports)
        ] * 2
        return PairResult(p, d, probes, 2.0, 2 * 64 * 16384.0, 0.0)  # 1,024 tokens, sim blocks

    pairs = [pair("e0", "e1", False), pair("e1", "e2", True), pair("e2", "e0", None)]
    out = kv_transfer_gate(fleet, pairs, 1024, "plan", 10.0, 0.6, None)
    assert out.verdict == "pass"
    said = [n for n in out.notes if "prompt_tokens_details" in n]
    assert len(said) == 1 and said[0].startswith("e0: no usage.prompt_tokens_details")
    assert out.evidence["pairs"]["e0->e1"]["probes"][0]["reports_cached_tokens"] is False
    # Not judged where the router indexes no prefixes.
    off = fleet_doc(3)
    off["engine"]["prefix_caching"] = {"enabled": False}
    out = kv_transfer_gate(loaded(off).contract, pairs, 1024, "plan", 10.0, 0.6, None)
    assert not [n for n in out.notes if "prompt_tokens_details" in n]


def test_kv_transfer_holds_the_fleets_block_bytes_to_what_the_handoffs_moved() -> None:
    # Simulated engines: a block is their sim.block_size tokens of sim.block_bytes.
    doc = fleet_doc(2)
    for engine in doc["engines"]:
        engine["sim"]["block_bytes"] = 4096
    fleet = loaded(doc).contract
    # 1,000 tokens: 63 blocks of 16 (the partial last one whole), two handoffs.
    probes = _pair("e0", "e1", [0.1, 0.1]).probes
    right = PairResult("e0", "e1", probes, 2.0, 2 * 63 * 4096.0, 0.0)
    assert kv_transfer_gate(fleet, [right], 1000, "x", 10.0, 0.6, None).failures == []
    wrong = PairResult("e0", "e1", probes, 2.0, 2 * 63 * 8192.0, 0.0)
    out = kv_transfer_gate(fleet, [wrong], 1000, "x", 10.0, 0.6, None)
    assert out.failures == [
        "e0->e1: e1 pulled 516,096 bytes a handoff for 1000 prompt tokens (63 blocks of 16), "
        "where the fleet's block_bytes 4,096 makes 258,048: the router's kv_bytes_moved would "
        "misreport (a block of 8,192 bytes?)"
    ]
    # Real engines whose fleet does not say a block's bytes: nothing to hold them to.
    for engine in doc["engines"]:
        engine.pop("sim")
    assert (
        kv_transfer_gate(loaded(doc).contract, [wrong], 1000, "x", 10.0, 0.6, None).failures == []
    )
