"""Cache-aware scheduling (scheduler v1 with the prefix index): a cached prefix is predicted
as the prefill it saves and the blocks it spares the handoff, and it competes against queueing
honestly; the lifecycle records where it sent each prompt."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import Budgets, parse_fleet
from narwhal.profiles.models import DecodeLatencyModel, PrefillLatencyModel
from narwhal.profiles.store import EngineModels
from narwhal.routing.admission import Admit
from narwhal.routing.breaker import BreakerState
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.lifecycle import HedgeEnd, Lifecycle, LifecycleObserver, Ticket
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.prefix import PrefixIndex, chain_keys, prompt_keys, text_keys
from narwhal.routing.scheduler import Pair, RequestShape, SchedulerV0, SchedulerV1
from narwhal.simengine.fleet import local_fleet_document

PROMPT = 4000
KEYS = tuple(chain_keys(list(range(PROMPT)), 16))  # 250 full blocks
# What an engine holding the whole prompt serves from its cache: whole blocks within all but
# the last token (vLLM's max_cache_hit_length = num_tokens - 1), 249 of the 250.
HIT = (PROMPT - 1) // 16 * 16


def models() -> EngineModels:
    return EngineModels(
        prefill=PrefillLatencyModel(0.01, 1e-4, 0.0, 128, 8192),
        decode=DecodeLatencyModel(0.04, 0.002, 0.0, 8, 8192),
        generation="g",
    )


def state(clock: VirtualClock, **routing: object) -> FleetState:
    doc = local_fleet_document(
        list(range(9000, 9004)),
        list(range(9100, 9104)),
        ttft_s=2.0,
        tpot_s=0.1,
        first_token_timeout_s=1.0,
    )
    if routing:
        doc["routing"] = routing
    fleet = FleetState(parse_fleet(doc, "t").contract, clock)
    for e in fleet.engines.values():
        e.healthy = True
    return fleet


def scheduler() -> SchedulerV1:
    return SchedulerV1(
        LatencyPredictor({f"e{i}": models() for i in range(4)}, default_transfer_s=0.02),
        Budgets(ttft_s=2.0, tpot_s=0.1, attainment=0.95),
    )


def routed(events: bool = True) -> tuple[VirtualClock, PrefixIndex, Lifecycle]:
    """A fleet at time 0 whose engines publish KV events (``events``) or do not, with its
    prefix index and a lifecycle routing with scheduler v1."""
    clock = VirtualClock(0.0)
    fleet = state(clock)
    index = fleet.prefix_index
    assert index is not None
    if events:
        for engine in fleet.engines:
            index.set_precise(engine, True)
    return clock, index, Lifecycle(fleet, scheduler())


def test_a_cached_prefix_is_the_prefill_it_saves_and_the_blocks_it_spares() -> None:
    clock = VirtualClock(0.0)
    fleet = state(clock)
    index = fleet.prefix_index
    assert index is not None
    index.record_routed("e1", KEYS[:200], 0.0)  # 3,200 tokens of the prompt on e1
    index.record_routed("e3", KEYS, 0.0)  # the whole prompt on e3
    pick = scheduler().pick(fleet, RequestShape(prompt_tokens=PROMPT, max_tokens=10, prefix=KEYS))
    assert isinstance(pick, Pair)
    assert (pick.prefill, pick.decode) == ("e1", "e3")
    assert pick.cached_tokens == 3200
    assert pick.decode_cached_tokens == HIT  # an engine always computes the last token
    # 800 tokens computed instead of 4,000: 0.01 + 1e-4 * 800.
    assert pick.predicted_prefill_s == pytest.approx(0.09)
    # The handoff moves what e3 lacks: the last block's 16 tokens' worth of the learnt 0.02 s.
    assert pick.predicted_ttft_s == pytest.approx(0.09 + 0.02 * (PROMPT - HIT) / PROMPT + 0.042)
    blind = scheduler().pick(fleet, RequestShape(prompt_tokens=PROMPT, max_tokens=10))
    assert isinstance(blind, Pair)
    assert blind.predicted_prefill_s == pytest.approx(0.41) and blind.cached_tokens == 0


def test_affinity_loses_to_a_cold_engine_only_when_its_queue_costs_too_much() -> None:
    """The engine holding the prefix is taken while it is ready within the prefix window (half
    the TTFT budget, 1 s) of the soonest and within three quarters of the budget (1.5 s); past
    either, the cold idle engine."""
    clock = VirtualClock(0.0)
    fleet = state(clock)
    assert fleet.prefix_index is not None
    fleet.prefix_index.record_routed("e1", KEYS, 0.0)
    shape = RequestShape(prompt_tokens=PROMPT, max_tokens=10, prefix=KEYS)
    # e1's queue (0.3 s) is less than the 0.4 s its cache saves: e1 is the soonest.
    fleet.engines["e1"].prefill_work["q"] = (0.3, 0.0)
    pick = scheduler().pick(fleet, shape)
    assert isinstance(pick, Pair) and pick.prefill == "e1"
    # Ready at 1.31 s, 0.9 s after cold e0 (0.41 s): within the window, e1 still.
    fleet.engines["e1"].prefill_work["q"] = (1.3, 0.0)
    pick = scheduler().pick(fleet, shape)
    assert isinstance(pick, Pair) and (pick.prefill, pick.cached_tokens) == ("e1", HIT)
    # Ready at 1.51 s: past three quarters of the budget (and 1.1 s after e0): e0, cold and idle.
    fleet.engines["e1"].prefill_work["q"] = (1.5, 0.0)
    pick = scheduler().pick(fleet, shape)
    assert isinstance(pick, Pair) and (pick.prefill, pick.cached_tokens) == ("e0", 0)
    # Ready at 1.46 s: within the limit, but past the window (1.05 s after e0): e0.
    fleet.engines["e1"].prefill_work["q"] = (1.45, 0.0)
    pick = scheduler().pick(fleet, shape)
    assert isinstance(pick, Pair) and pick.prefill == "e0"


def test_a_sampled_pool_still_scores_the_engines_holding_the_prefix() -> None:
    """In a pool larger than ``candidates`` v1 scores a random sample; the engines holding the
    prompt's prefix are scored whether the sample drew them or not."""
    clock = VirtualClock(0.0)
    fleet = state(clock)  # e0, e1 prefill; e2, e3 decode
    index = fleet.prefix_index
    assert index is not None
    index.record_routed("e1", KEYS, 0.0)
    index.record_routed("e3", KEYS, 0.0)
    shape = RequestShape(prompt_tokens=PROMPT, max_tokens=10, prefix=KEYS)
    for seed in range(8):  # samples of one engine a role: e0 or e2 drawn about half the time
        sampled = SchedulerV1(
            LatencyPredictor({f"e{i}": models() for i in range(4)}, default_transfer_s=0.02),
            Budgets(ttft_s=2.0, tpot_s=0.1, attainment=0.95),
            candidates=1,
            rng=random.Random(seed),
        )
        pick = sampled.pick(fleet, shape)
        assert isinstance(pick, Pair)
        assert (pick.prefill, pick.decode) == ("e1", "e3"), seed
        assert pick.cached_tokens == HIT


def test_routing_prefix_off_or_caching_off_is_cache_blind() -> None:
    clock = VirtualClock(0.0)
    assert state(clock, prefix={"enabled": False}).prefix_index is None
    doc = local_fleet_document([9000, 9001], [9100, 9101])
    doc["engine"]["prefix_caching"] = {"enabled": False}
    assert FleetState(parse_fleet(doc, "t").contract, clock).prefix_index is None


def test_the_lifecycle_records_both_engines_of_a_handoff() -> None:
    clock = VirtualClock(0.0)
    fleet = state(clock)
    lifecycle = Lifecycle(fleet, scheduler())
    ticket = lifecycle.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    verdict = lifecycle.admit(ticket)
    assert isinstance(verdict, Admit)
    assert fleet.prefix_index is not None
    held = fleet.prefix_index.match(KEYS, clock.now())
    assert held == {verdict.pair.prefill: 250, verdict.pair.decode: 250}
    # Once it is done, the next request with that prefix is predicted as a hit on both.
    clock.advance(0.5)
    lifecycle.prefill_done(ticket, "ok", prompt_tokens=PROMPT)
    lifecycle.first_token(ticket)
    clock.advance(0.5)
    lifecycle.finished(ticket, completion_tokens=10, complete=True)
    second = lifecycle.arrive("r2", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    again = lifecycle.admit(second)
    assert isinstance(again, Admit) and again.pair.cached_tokens == HIT


@pytest.mark.parametrize("events", [False, True], ids=["history", "events"])
def test_a_failed_leg_leaves_no_claim_to_steer_the_prompts_sharing_it(events: bool) -> None:
    """The dispatch records both engines as holding the prompt. A prefill leg that fails leaves
    neither holding it, and a decode leg that fails before its first token may not have pulled
    it: the claims go, so the next request sharing the prefix is not sent to wait for a hit
    that does not come."""
    clock, index, lifecycle = routed(events)
    ticket = lifecycle.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    first = lifecycle.admit(ticket)
    assert isinstance(first, Admit)
    assert index.match(KEYS, clock.now()) == {first.pair.prefill: 250, first.pair.decode: 250}
    clock.advance(0.1)
    lifecycle.prefill_done(ticket, "failed")
    assert index.match(KEYS, clock.now()) == {}
    retry = lifecycle.retry(ticket)
    assert isinstance(retry, Pair) and retry.cached_tokens == 0
    assert retry.prefill != first.pair.prefill
    assert index.match(KEYS, clock.now()) == {retry.prefill: 250, retry.decode: 250}
    # The retry's prefill is done, its decode leg fails before its first token: the prefill
    # engine still holds the prompt, the decode engine's claim goes.
    clock.advance(0.1)
    lifecycle.prefill_done(ticket, "ok", prompt_tokens=PROMPT)
    lifecycle.decode_failed(ticket, "failed")
    assert index.match(KEYS, clock.now()) == {retry.prefill: 250}


def test_a_hedged_prefill_leg_keeps_its_claim_for_it_runs_on() -> None:
    """A hedge ends the slow leg in the counts, not on its engine (it may answer first): its
    claim on the prompt stands beside the hedge's."""
    clock, index, lifecycle = routed()
    ticket = lifecycle.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    first = lifecycle.admit(ticket)
    assert isinstance(first, Admit)
    clock.advance(0.3)
    hedge = lifecycle.hedge_prefill(ticket, budget_left_s=1.7)
    assert isinstance(hedge, Pair) and hedge.prefill != first.pair.prefill
    held = index.match(KEYS, clock.now())
    assert held[first.pair.prefill] == 250 and held[hedge.prefill] == 250


def test_a_hedge_decoding_where_its_slow_leg_would_is_predicted_to_pull_every_block() -> None:
    """The decode engine's claim on the prompt is the request's own, in flight, not pulled:
    the hedge's handoff moves every block all the same (what the journal's
    kv_blocks_predicted and kv_bytes_moved read). It said one block before."""
    clock, index, lifecycle = routed()
    ticket = lifecycle.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    first = lifecycle.admit(ticket)
    assert isinstance(first, Admit) and first.pair.decode_cached_tokens == 0
    clock.advance(0.3)
    others = [e for e in lifecycle.state.in_role("decode") if e.id != first.pair.decode]
    for e in others:
        e.healthy = False  # for the hedge to decode where the slow leg would
    hedge = lifecycle.hedge_prefill(ticket, budget_left_s=1.7)
    assert isinstance(hedge, Pair) and hedge.decode == first.pair.decode
    assert index.match(KEYS, clock.now())[hedge.decode] == 250  # the claim stands
    assert ticket.pair is not None and ticket.pair.decode_cached_tokens == 0


class _Heard(LifecycleObserver):
    """What the lifecycle told its observer: breaker verdicts and model corrections, by
    engine."""

    def __init__(self) -> None:
        self.verdicts: list[str] = []
        self.corrections: list[str] = []

    def breaker(self, engine: str, state: BreakerState) -> None:
        self.verdicts.append(engine)

    def correction(self, engine: str, phase: str, ratio: float, drifted: bool) -> None:
        self.corrections.append(engine)


def hedged(events: bool) -> tuple[VirtualClock, PrefixIndex, Lifecycle, Ticket, Pair, Pair]:
    """A request whose prefill leg was hedged 0.3 s after its dispatch, on a pair whose
    decode engine is not the slow leg's either; the clock 0.2 s later. Returns the slow leg's
    pair and the hedge's."""
    clock, index, lifecycle = routed(events)
    lifecycle.observer = _Heard()
    lifecycle.predictor = lifecycle.scheduler.predictor  # type: ignore[attr-defined]
    ticket = lifecycle.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    first = lifecycle.admit(ticket)
    assert isinstance(first, Admit)
    clock.advance(0.3)
    decode = lifecycle.state.engines[first.pair.decode]
    decode.healthy = False  # for the hedge to decode elsewhere
    hedge = lifecycle.hedge_prefill(ticket, budget_left_s=1.7)
    decode.healthy = True
    assert isinstance(hedge, Pair) and hedge.prefill != first.pair.prefill
    assert hedge.decode != first.pair.decode
    clock.advance(0.2)
    return clock, index, lifecycle, ticket, first.pair, hedge


@pytest.mark.parametrize("events", [False, True], ids=["history", "events"])
@pytest.mark.parametrize(
    "winner", ["hedge", "slow", "slow-after-hedge-failed", "slow-with-hedge-answered"]
)
def test_a_hedge_race_leaves_claims_only_where_the_prompt_is(events: bool, winner: str) -> None:
    """Of a hedged prefill's two legs the first to answer wins and the other is cancelled
    (what it computed stays in its engine's cache: its claim stays); the slow leg's decode
    engine gives its claim back (the request decodes on the hedge's); a hedge that failed
    gives its claim back. A hedge that lost is no sample of its engine's speed, and a verdict
    on it only when it failed."""
    clock, index, lifecycle, ticket, slow, hedge = hedged(events)
    heard = lifecycle.observer
    assert isinstance(heard, _Heard)
    heard.verdicts.clear()
    failures = lifecycle.state.engines[hedge.prefill].breaker.consecutive_failures
    if winner == "hedge":
        lifecycle.prefill_done(ticket, "ok", prompt_tokens=PROMPT)
        held = {slow.prefill: 250, hedge.prefill: 250, hedge.decode: 250}
    else:
        ended: HedgeEnd = {
            "slow": "cancelled",
            "slow-after-hedge-failed": "failed",
            "slow-with-hedge-answered": "answered",
        }[winner]  # type: ignore[assignment]
        lifecycle.prefill_done(ticket, "ok", prompt_tokens=PROMPT, hedge_ended=ended)
        held = {slow.prefill: 250, hedge.decode: 250}
        if ended != "failed":
            held[hedge.prefill] = 250
    assert index.match(KEYS, clock.now()) == held
    breaker = lifecycle.state.engines[hedge.prefill].breaker
    if winner in ("hedge", "slow-with-hedge-answered"):
        assert hedge.prefill in heard.verdicts and breaker.consecutive_failures == 0
    elif winner == "slow":
        assert hedge.prefill not in heard.verdicts and breaker.consecutive_failures == failures
    else:
        assert breaker.consecutive_failures == failures + 1
    assert (hedge.prefill in heard.corrections) is (winner == "hedge")
    assert slow.prefill not in heard.corrections
    assert ticket.phase == "decode" and ticket.pair == hedge


@pytest.mark.parametrize("events", [False, True], ids=["history", "events"])
@pytest.mark.parametrize("then", ["failed", "refused"])
def test_a_slow_leg_that_failed_gives_its_claims_back(events: bool, then: str) -> None:
    """The slow leg fails while its hedge runs on: its engines' claims go at once; the hedge
    then fails too (nothing is held) or is refused (nothing computed there either)."""
    clock, index, lifecycle, ticket, _slow, hedge = hedged(events)
    lifecycle.slow_leg_failed(ticket)
    assert index.match(KEYS, clock.now()) == {hedge.prefill: 250, hedge.decode: 250}
    lifecycle.prefill_done(ticket, "failed" if then == "failed" else "refused")
    assert index.match(KEYS, clock.now()) == {}


@pytest.mark.parametrize("events", [False, True], ids=["history", "events"])
@pytest.mark.parametrize("then", ["slow-answers", "slow-fails", "client-leaves"])
def test_a_hedge_that_failed_is_counted_once_when_it_fails(events: bool, then: str) -> None:
    """The hedge fails while the slow leg runs on: counted against its engine at once (and its
    claim taken back), never again however the request ends; its engine is one the request's
    retries avoid."""
    clock, index, lifecycle, ticket, slow, hedge = hedged(events)
    breaker = lifecycle.state.engines[hedge.prefill].breaker
    before = breaker.consecutive_failures
    lifecycle.hedge_failed(ticket)
    assert breaker.consecutive_failures == before + 1
    assert hedge.prefill in ticket.failed_prefill
    assert hedge.prefill not in index.match(KEYS, clock.now())
    with pytest.raises(ValueError, match="no hedge running"):
        lifecycle.hedge_failed(ticket)
    if then == "slow-answers":
        lifecycle.prefill_done(ticket, "ok", prompt_tokens=PROMPT, hedge_ended="failed")
        assert index.match(KEYS, clock.now()) == {slow.prefill: 250, hedge.decode: 250}
    elif then == "slow-fails":
        lifecycle.slow_leg_failed(ticket)
        lifecycle.prefill_done(ticket, "failed")
        assert index.match(KEYS, clock.now()) == {}
    else:
        # Its breaker opened and cooled off meanwhile: another request is its half-open probe,
        # which the cancelled request (whose verdict is in) must leave alone.
        breaker.state = BreakerState.HALF_OPEN
        breaker.probe_in_flight = True
        lifecycle.cancel(ticket)
        assert breaker.probe_in_flight
    assert breaker.consecutive_failures == before + 1


@pytest.mark.parametrize("then", ["slow-answers", "slow-fails", "client-leaves"])
def test_a_failed_hedge_hands_its_queued_prefill_back_to_the_slow_engine(then: str) -> None:
    """While the request waits on the slow leg after its hedge failed, the slow engine's queue
    holds the leg's predicted prefill again (the scheduler would see it idle otherwise), as
    dispatched; the race's end takes it off every queue."""
    clock, _index, lifecycle, ticket, slow, hedge = hedged(False)
    engines = lifecycle.state.engines
    queued = engines[hedge.prefill].prefill_work[ticket.id]
    assert ticket.id not in engines[slow.prefill].prefill_work
    lifecycle.hedge_failed(ticket)
    work = engines[slow.prefill].prefill_work.get(ticket.id)
    assert work is not None and work[1] == 0.0 and work != queued  # the slow leg's own
    assert ticket.id not in engines[hedge.prefill].prefill_work
    assert engines[slow.prefill].queued_prefill_s(clock.now()) > 0.0
    if then == "slow-answers":
        lifecycle.prefill_done(ticket, "ok", prompt_tokens=PROMPT, hedge_ended="failed")
    elif then == "slow-fails":
        lifecycle.slow_leg_failed(ticket)
        lifecycle.prefill_done(ticket, "failed")
    else:
        lifecycle.cancel(ticket)
    assert all(ticket.id not in e.prefill_work for e in engines.values())
    assert all(e.in_flight_prefill == 0 for e in engines.values())


@pytest.mark.parametrize("events", [False, True], ids=["history", "events"])
def test_a_hedge_refused_as_the_slow_leg_answered_gives_its_claim_back(events: bool) -> None:
    """Refused (HTTP 4xx): the engine computed nothing but is fine: a success verdict, no
    claim."""
    clock, index, lifecycle, ticket, slow, hedge = hedged(events)
    breaker = lifecycle.state.engines[hedge.prefill].breaker
    breaker.consecutive_failures = 2
    lifecycle.prefill_done(ticket, "ok", prompt_tokens=PROMPT, hedge_ended="refused")
    assert index.match(KEYS, clock.now()) == {slow.prefill: 250, hedge.decode: 250}
    assert breaker.consecutive_failures == 0


@pytest.mark.parametrize("events", [False, True], ids=["history", "events"])
def test_a_slow_leg_refused_leaves_the_cancelled_hedge_its_claim(events: bool) -> None:
    clock, index, lifecycle, ticket, _slow, hedge = hedged(events)
    lifecycle.prefill_done(ticket, "refused", hedge_ended="cancelled")
    assert ticket.phase == "done"
    assert index.match(KEYS, clock.now()) == {hedge.prefill: 250}


@pytest.mark.parametrize("events", [False, True], ids=["history", "events"])
@pytest.mark.parametrize("how", ["refused", "cancelled", "hedged-then-cancelled"])
def test_a_prefill_refused_or_cancelled_leaves_claims_where_the_prompt_may_be(
    events: bool, how: str
) -> None:
    """An engine that refused the prompt (HTTP 4xx) computed nothing: no engine of its pair
    keeps a claim. A request cancelled during its prefill (its client left; engines abort it):
    the prefill engines keep theirs (what they computed stays cached), its decode engine, which
    pulled nothing, does not."""
    if how == "hedged-then-cancelled":
        clock, index, lifecycle, ticket, slow, hedge = hedged(events)
        lifecycle.cancel(ticket)
        held = {slow.prefill: 250, hedge.prefill: 250}
    else:
        clock, index, lifecycle = routed(events)
        ticket = lifecycle.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
        first = lifecycle.admit(ticket)
        assert isinstance(first, Admit)
        clock.advance(0.3)
        if how == "refused":
            lifecycle.prefill_done(ticket, "refused")
            held = {}
        else:
            lifecycle.cancel(ticket)
            held = {first.pair.prefill: 250}
    assert ticket.phase == "done"
    assert index.match(KEYS, clock.now()) == held


def test_only_a_hedged_leg_can_answer_as_the_slow_one() -> None:
    _, _, lifecycle = routed()
    ticket = lifecycle.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    assert isinstance(lifecycle.admit(ticket), Admit)
    with pytest.raises(ValueError, match="no hedged leg"):
        lifecycle.prefill_done(ticket, "ok", hedge_ended="cancelled")
    with pytest.raises(ValueError, match="no hedged leg"):
        lifecycle.slow_leg_failed(ticket)
    with pytest.raises(ValueError, match="no hedge running"):
        lifecycle.hedge_failed(ticket)


def test_a_burst_follows_a_prompt_still_in_flight_to_engines_that_publish_events() -> None:
    """Engines that publish KV events say what they hold only once they computed it; until
    then the router's own routing stands in, for the TTFT budget: a request sharing the prompt
    that arrives meanwhile follows the first (predicted cached) rather than computing the same
    blocks on an idle engine."""
    clock, index, lifecycle = routed()
    first = lifecycle.admit(
        lifecycle.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    )
    assert isinstance(first, Admit) and first.pair.cached_tokens == 0
    clock.advance(0.05)
    second = lifecycle.admit(
        lifecycle.arrive("r2", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    )
    assert isinstance(second, Admit)
    assert second.pair.prefill == first.pair.prefill
    assert second.pair.cached_tokens == HIT
    # No engine said it stored the prompt within the TTFT budget (2 s): nothing is held.
    clock.advance(2.01)
    assert index.match(KEYS, clock.now()) == {}


def test_the_lifecycle_matches_the_prefix_only_for_a_scheduler_that_did_not() -> None:
    """v1 matched the prompt against the index and found nothing on either engine: the pick
    says it looked, and the lifecycle does not match it again. v0 never looks: the lifecycle
    matches for it, and records what its engines hold."""
    clock = VirtualClock(0.0)
    fleet = state(clock)
    index = fleet.prefix_index
    assert index is not None
    lookups: list[tuple[int, ...]] = []
    match = index.match

    def counted(keys: Sequence[int], now: float, in_flight: bool = True) -> dict[str, int]:
        lookups.append(tuple(keys))
        return match(keys, now, in_flight)

    index.match = counted  # type: ignore[method-assign]
    cold = Lifecycle(fleet, scheduler())
    verdict = cold.admit(cold.arrive("r1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS))
    assert isinstance(verdict, Admit)
    assert verdict.pair.prefix_looked
    assert (verdict.pair.cached_tokens, verdict.pair.decode_cached_tokens) == (0, 0)
    assert lookups == [KEYS]  # the scheduler's, and no other
    lookups.clear()
    for engine in fleet.engines:
        index.record_routed(engine, KEYS, 0.0)
    blind = Lifecycle(fleet, SchedulerV0())
    ticket = blind.arrive("r2", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    verdict = blind.admit(ticket)
    assert isinstance(verdict, Admit) and not verdict.pair.prefix_looked
    assert lookups == [KEYS]  # the lifecycle's
    assert ticket.pair is not None
    assert (ticket.pair.cached_tokens, ticket.pair.decode_cached_tokens) == (HIT,) * 2


@pytest.mark.parametrize("scheduler_kind", ["v1", "v0"])
def test_a_text_prompts_hits_are_counted_at_the_bytes_per_token_learnt(scheduler_kind: str) -> None:
    """A text prompt's keys are blocks of 64 bytes: what they stand for in tokens follows the
    router's bytes per token, as its prompt's length does. At one byte a token (a byte-level
    tokenizer) a block is 64 tokens, not 16: the prediction read a quarter of the hit."""
    clock = VirtualClock(0.0)
    fleet = state(clock)
    index = fleet.prefix_index
    assert index is not None
    text = "".join(chr(ord("a") + i % 26) for i in range(6400))  # 100 blocks of 64 bytes
    keys = tuple(text_keys([text], 16))
    assert len(keys) == 100
    for engine in fleet.engines:
        index.record_routed(engine, keys, 0.0, exact=False)
    lifecycle = Lifecycle(fleet, scheduler() if scheduler_kind == "v1" else SchedulerV0())
    lifecycle.lengths.observe(6400, 6400)  # the engines counted a token a byte
    ticket = lifecycle.arrive(
        "r1", max_tokens=10, prompt_bytes=6400 + 8, prefix=keys, prefix_exact=False
    )
    assert isinstance(lifecycle.admit(ticket), Admit) and ticket.pair is not None
    # 6,400 of the 6,408 estimated tokens, in whole blocks of 16 within all but the last one.
    assert (ticket.pair.cached_tokens, ticket.pair.decode_cached_tokens) == (6400, 6400)
    lifecycle.lengths.bytes_per_token = 4.0  # 4 bytes a token: a key is a block of 16
    again = lifecycle.arrive(
        "r2", max_tokens=10, prompt_bytes=6408, prefix=keys, prefix_exact=False
    )
    assert isinstance(lifecycle.admit(again), Admit) and again.pair is not None
    assert again.pair.cached_tokens == 1600


def test_prompt_keys_of_client_requests() -> None:
    ids = list(range(100))
    assert prompt_keys({"prompt": ids}, False, 16) == tuple(chain_keys(ids, 16))
    assert prompt_keys({"prompt": ids, "cache_salt": "t"}, False, 16) == tuple(
        chain_keys(ids, 16, "t")
    )
    text = "x" * 200  # 3 blocks of 64 bytes
    assert len(prompt_keys({"prompt": text}, False, 16)) == 3
    assert prompt_keys({"prompt": [ids, ids]}, False, 16) == ()  # a batch: no one prefix
    # JSON's true and false among ids are 1 and 0 to vLLM (the router forwards them as they
    # came): the same keys, first id included.
    assert prompt_keys({"prompt": [True, False, *ids[2:]]}, False, 16) == tuple(
        chain_keys([1, 0, *ids[2:]], 16)
    )
    system = {"role": "system", "content": "s" * 100}
    chat = {"messages": [system, {"role": "user", "content": "u"}]}
    longer = {"messages": [*chat["messages"], {"role": "user", "content": "more" * 40}]}
    a, b = prompt_keys(chat, True, 16), prompt_keys(longer, True, 16)
    assert a and b[: len(a)] == a  # a conversation's next turn extends its prefix
    # Special tokens added to a chat (a Responses request's translation) begin other tokens
    # from the first: no match with the same chat without them. The routes' defaults are
    # keyed as if unsaid.
    assert not set(prompt_keys({**chat, "add_special_tokens": True}, True, 16)) & set(a)
    assert prompt_keys({**chat, "add_special_tokens": False}, True, 16) == a
    plain = {"prompt": text}
    assert prompt_keys({**plain, "add_special_tokens": True}, False, 16) == prompt_keys(
        plain, False, 16
    )
    assert prompt_keys({**plain, "add_special_tokens": False}, False, 16) != prompt_keys(
        plain, False, 16
    )
    # Text keys never match token keys, whatever the bytes.
    assert not set(text_keys([text], 16)) & set(chain_keys(list(text.encode()), 16))


def test_the_kv_a_decode_engine_pulls_is_the_prompts_blocks_less_those_it_holds() -> None:
    clock = VirtualClock(0.0)
    fleet = state(clock)
    # A simulated engine's block: 16 tokens of sim.block_bytes (16,384 by default).
    assert fleet.kv_pulled("e2", PROMPT + 1, 0) == (251, 251 * 16384)  # the partial last whole
    assert fleet.kv_pulled("e2", PROMPT, HIT) == (1, 16384)
    # A hold past the prompt's last token counts as vLLM finds it: within all but that token.
    assert fleet.kv_pulled("e2", PROMPT, PROMPT) == (1, 16384)
    assert fleet.kv_pulled("e2", PROMPT, None) is None  # caching on, no index: unknown
    doc = local_fleet_document(
        [9000, 9001], [9100, 9101], sim={"block_bytes": 4096}, prefix_caching={"enabled": False}
    )
    blind = FleetState(parse_fleet(doc, "t").contract, clock)
    # Engines that cache nothing pull every block, whatever the index would say.
    assert blind.kv_pulled("e1", 33, None) == (3, 3 * 4096)
    doc = local_fleet_document([9000, 9001], [9100, 9101], prefix_caching={"block_size": 16})
    for engine in doc["engines"]:
        engine.pop("sim")
    real = FleetState(parse_fleet(doc, "t").contract, clock)
    assert real.kv_pulled("e1", 32, 16) == (1, None)  # no block bytes said: blocks only
    doc["engine"]["prefix_caching"]["block_bytes"] = 1000
    real = FleetState(parse_fleet(doc, "t").contract, clock)
    assert real.kv_pulled("e1", 32, 16) == (1, 1000)


def test_what_a_decode_leg_finds_held_leaves_out_claims_in_flight() -> None:
    """From a review: the choices of one request (or requests sharing a prompt) picked one
    after another onto one decode engine each saw the previous one's in-flight claim as held,
    and the journal said 1 block moved where every block did (vLLM's prefix cache holds a
    pulled block once it lands). What a decode leg finds is what the engine holds now."""
    _, index, lifecycle = routed()
    decode = lifecycle.state.in_role("decode")
    for e in decode[1:]:
        e.healthy = False  # one decode engine for both
    first = lifecycle.arrive("r-0", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    second = lifecycle.arrive("r-1", max_tokens=10, prompt_tokens=PROMPT, prefix=KEYS)
    for ticket in (first, second):
        assert isinstance(lifecycle.admit(ticket), Admit)
    d = decode[0].id
    assert second.pair is not None and second.pair.decode == d
    assert second.pair.decode_cached_tokens == HIT  # the pick's view: it will hold them
    assert lifecycle.decode_holds(second, d, PROMPT) == 0  # what a leg finds there now
    # Once the engine says it stored them (its hashes are its own), a leg finds them.
    full = PROMPT // 16 * 16
    assert index.stored(d, list(range(1, full // 16 + 1)), None, list(range(full)), 16)
    assert lifecycle.decode_holds(second, d, PROMPT) == HIT
