"""Pure routing logic with a virtual clock: breaker, fleet state, scheduler v0, leg bodies."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.engines.legs import decode_leg_body, prefill_leg_body
from narwhal.engines.scrape import parse_engine_load
from narwhal.engines.sse import SseSplitter, iter_sse_events
from narwhal.routing.breaker import BreakerState, CircuitBreaker
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.scheduler import NoPair, Pair, SchedulerV0, sample
from narwhal.simengine.fleet import local_fleet_document


def fleet_state(n: int = 4, clock: VirtualClock | None = None, **kwargs: Any) -> FleetState:
    doc = local_fleet_document(list(range(9000, 9000 + n)), list(range(9100, 9100 + n)), **kwargs)
    return FleetState(parse_fleet(doc, "test").contract, clock or VirtualClock(100.0))


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = VirtualClock()
    b = CircuitBreaker(clock, failure_threshold=3, open_seconds=5)
    for _ in range(2):
        b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allows_request()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allows_request()
    clock.advance(4.9)
    assert not b.allows_request()
    clock.advance(0.2)
    assert b.allows_request() and b.state is BreakerState.HALF_OPEN
    b.on_dispatch()
    assert not b.allows_request()  # one probe at a time
    b.record_failure()
    assert b.state is BreakerState.OPEN  # a failed probe reopens at once
    clock.advance(5)
    assert b.allows_request()
    b.on_dispatch()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.consecutive_failures == 0


def test_a_passing_health_probe_closes_only_a_breaker_that_failing_probes_opened() -> None:
    clock = VirtualClock()
    # The engine answers /health but fails requests: probes never close its breaker.
    b = CircuitBreaker(clock, failure_threshold=3, open_seconds=5)
    b.record_health(True)
    for _ in range(3):
        b.record_failure()
    assert b.state is BreakerState.OPEN
    for _ in range(3):
        clock.advance(5)
        b.record_health(True)
        assert b.allows_request() and b.state is BreakerState.HALF_OPEN
    b.on_dispatch()
    b.record_failure()  # the one half-open request fails: open again, not three more legs
    assert b.state is BreakerState.OPEN
    clock.advance(5)
    b.record_health(True)
    b.on_dispatch()
    b.record_success()
    assert b.state is BreakerState.CLOSED

    # The engine went down (probes failed too) and came back: a passing probe closes it.
    b = CircuitBreaker(clock, failure_threshold=3, open_seconds=5)
    for _ in range(2):
        b.record_failure()
    b.record_health(False)
    assert b.state is BreakerState.OPEN
    b.record_health(True)
    assert b.state is BreakerState.OPEN  # not before the cool-off
    clock.advance(5)
    b.record_health(True)
    assert b.state is BreakerState.CLOSED and not b.health_failed

    # A probe that failed once while all was well, then passed, is no evidence later.
    b = CircuitBreaker(clock, failure_threshold=3, open_seconds=5)
    b.record_health(False)
    b.record_health(True)
    for _ in range(3):
        b.record_failure()
    clock.advance(5)
    b.record_health(True)
    assert b.allows_request() and b.state is BreakerState.HALF_OPEN


def test_scheduler_picks_least_loaded_pair_and_rotates_ties() -> None:
    state = fleet_state(4)
    sched = SchedulerV0()
    picks = {
        (p.prefill, p.decode) for p in (sched.pick(state) for _ in range(8)) if isinstance(p, Pair)
    }
    assert picks == {("e0", "e2"), ("e0", "e3"), ("e1", "e2"), ("e1", "e3")}
    state.engines["e0"].in_flight_prefill = 3
    state.engines["e3"].in_flight_decode = 1
    pick = sched.pick(state)
    assert isinstance(pick, Pair) and (pick.prefill, pick.decode) == ("e1", "e2")


def test_scraped_load_counts_when_fresh_only() -> None:
    clock = VirtualClock(10.0)
    state = fleet_state(4, clock)
    sched = SchedulerV0()
    e1 = state.engines["e1"]
    e1.scraped.running, e1.scraped.waiting, e1.scraped.at = 5, 2, clock.now()
    for _ in range(4):
        pick = sched.pick(state)
        assert isinstance(pick, Pair) and pick.prefill == "e0"
    clock.advance(state.scrape_stale_s + 1)  # the engine stopped answering: its report is stale
    assert {sched.pick(state).prefill for _ in range(4)} == {"e0", "e1"}  # type: ignore[union-attr]


def test_engine_report_is_not_overwritten_by_router_count() -> None:
    clock = VirtualClock(10.0)
    state = fleet_state(4, clock)
    sched = SchedulerV0()
    # The router has nothing in flight on e2, but e2 reports a full batch: believe the engine.
    e2 = state.engines["e2"]
    e2.scraped.running, e2.scraped.at = 30, clock.now()
    assert all(sched.pick(state).decode == "e3" for _ in range(4))  # type: ignore[union-attr]


def test_filters_explain_why_nothing_fits() -> None:
    clock = VirtualClock(10.0)
    state = fleet_state(2, clock)
    sched = SchedulerV0()
    state.engines["e1"].healthy = False
    assert sched.pick(state) == NoPair(
        "no (prefill, decode) pair passes the available (healthy, breaker not open) filter"
    )
    state.engines["e1"].healthy = True
    state.engines["e1"].scraped.kv_cache_usage, state.engines["e1"].scraped.at = 0.99, clock.now()
    assert sched.pick(state) == NoPair("no (prefill, decode) pair passes the KV room filter")
    state.engines["e1"].scraped.kv_cache_usage = 0.5
    assert isinstance(sched.pick(state), Pair)
    # Healthy, its breaker open: out, and said so.
    breaker = state.engines["e1"].breaker
    for _ in range(breaker.failure_threshold):
        breaker.record_failure()
    assert "breaker not open" in sched.pick(state).reason  # type: ignore[union-attr]
    assert isinstance(sched.pick(state, exclude_decode={"e1"}), NoPair)


def test_permitted_pairs_are_respected() -> None:
    state = fleet_state(
        4, kv_transfer_pairs=[{"prefill": "e0", "decode": "e3"}, {"prefill": "e1", "decode": "e2"}]
    )
    sched = SchedulerV0()
    picks = {(p.prefill, p.decode) for p in (sched.pick(state) for _ in range(8))}  # type: ignore[union-attr]
    assert picks == {("e0", "e3"), ("e1", "e2")}


def test_readiness_needs_a_healthy_permitted_pair() -> None:
    state = fleet_state(4)
    for engine in state.engines.values():
        engine.healthy = True
    assert state.ready()[0]
    state.engines["e2"].healthy = state.engines["e3"].healthy = False
    assert state.ready() == (False, "no healthy engine in the decode role")
    state.engines["e2"].healthy = True
    state.engines["e0"].healthy = state.engines["e1"].healthy = False
    assert state.ready() == (False, "no healthy engine in the prefill role")
    # Answering their probes, with open breakers: said so, not "no healthy engine".
    state.engines["e0"].healthy = state.engines["e1"].healthy = True
    for engine in ("e0", "e1"):
        state.engines[engine].breaker.state = BreakerState.OPEN
        state.engines[engine].breaker.opened_at = state.clock.now()
    assert state.ready() == (
        False,
        "every healthy engine in the prefill role has its breaker open (e0, e1)",
    )


def test_set_role_honours_permissions_and_counts_generations() -> None:
    state = fleet_state(
        4, roles=[["prefill"], ["prefill", "decode"], ["prefill", "decode"], ["decode"]]
    )
    with pytest.raises(ValueError):
        state.set_role("e0", "decode")
    state.set_role("e1", "decode")
    assert state.engines["e1"].role == "decode" and state.engines["e1"].draining_from == "prefill"
    assert state.role_generation == 1


def test_leg_bodies_follow_vllm_proxy() -> None:
    client = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 50,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": False},
        "temperature": 0,
    }
    prefill = prefill_leg_body(client, chat=False)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["temperature"] == 0 and "max_completion_tokens" not in prefill
    chat = prefill_leg_body({"model": "m", "messages": [], "min_completion_tokens": 2}, chat=True)
    assert chat["max_tokens"] == chat["max_completion_tokens"] == 1
    assert "min_completion_tokens" not in chat
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "extra": "kept"}
    decode = decode_leg_body(client, params)
    assert decode["kv_transfer_params"] is params  # unchanged
    assert decode["min_tokens"] == 5 and decode["max_tokens"] == 50
    assert decode["stream"] is True and decode["stream_options"]["include_usage"] is True
    assert client["stream_options"] == {"include_usage": False}  # the client's body is untouched
    assert "kv_transfer_params" not in decode_leg_body(client, None)


def test_scrape_parser_sums_ranks_and_ignores_junk() -> None:
    text = (
        b'# HELP x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        b'vllm:num_requests_waiting{engine="0"} 4\nvllm:kv_cache_usage_perc 0.25\n'
        b'vllm:num_requests_waiting{engine="1"} NaN\n'
    )
    assert parse_engine_load(text) == {"running": 5.0, "waiting": 4.0, "kv_cache_usage": 0.25}
    assert parse_engine_load(b"not a vllm page\n") is None
    # Each data-parallel rank has its own cache: two full ranks are a full engine, not 2.
    ranks = b'vllm:kv_cache_usage_perc{engine="0"} 1.0\nvllm:kv_cache_usage_perc{engine="1"} 0.5\n'
    assert parse_engine_load(ranks)["kv_cache_usage"] == 0.75  # type: ignore[index]


def test_sse_parser_handles_split_chunks_and_crlf() -> None:
    async def chunks():
        for piece in (b'data: {"a"', b": 1}\r\n\r\ndata: [DO", b"NE]\n\n: comment\n\n"):
            yield piece

    async def collect() -> list[bytes]:
        return [e async for e in iter_sse_events(chunks())]

    assert asyncio.run(collect()) == [b'{"a": 1}', b"[DONE]"]


def test_sse_splitter_returns_every_event_a_chunk_completes_in_order() -> None:
    splitter = SseSplitter(max_event_bytes=64)
    assert splitter.feed(b"data: 1\n\ndata: 2\n\ndata: 3") == [b"1", b"2"]
    # A multi-line event, a comment, an event with no data, the line end split across chunks.
    assert splitter.feed(b"\r") == []
    assert splitter.feed(b"\n\r\nevent: x\ndata: a\ndata:b\n\n: c\n\nid: 7\n\n") == [
        b"3",
        b"a\nb",
    ]
    assert splitter.feed(b"data: tail") == []
    assert splitter.finish() == [b"tail"]
    assert splitter.finish() == []
    with pytest.raises(ValueError, match="size limit"):
        splitter.feed(b"data: " + b"x" * 100)


def test_the_schedulers_sample_draws_as_random_sample_does() -> None:
    """Scheduler v1 samples candidates with ``scheduler.sample``, ``Random.sample`` written
    out: it must pick the same engines and leave the generator in the same state (should a
    Python release change ``Random.sample``, this fails rather than the simulator's results
    silently moving)."""
    for n in (1, 5, 6, 30, 125, 277, 278, 875, 2000):
        population: list[Any] = [object() for _ in range(n)]
        for k in sorted({0, 1, min(n, 5), min(n, 8), min(n, 32), n}):
            for seed in range(5):
                ours, theirs = random.Random(seed), random.Random(seed)
                for _ in range(3):
                    assert sample(ours, population, k) == theirs.sample(population, k)
                assert ours.getstate() == theirs.getstate()
