"""narwhal-serve's one invariant under stress: every request that reaches the router ends with
exactly one ``request.end``, whatever the engines, the clients or the router process itself do.

1. A seeded random mix of concurrent requests (streamed and not, completions and chat, clients
   that hang up early) while a seeded loop flips faults on the engines: each client's
   observation must match the outcome the journal recorded, and the outcome counters must
   add up to the number of requests.
2. The router is SIGKILLed with streams in flight and restarted on the same journal: recovery
   closes each cut-off request exactly once, as ``router_restart``, and says so in its
   ``router.start``.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.journal import recover
from narwhal.testing.procs import wait_until
from tests.helpers import (
    MODEL,
    RouterProcess,
    admin,
    metric,
    running_fleet,
    running_router,
    start_router,
    stop_router,
)

PROMPT = [300 + (i * 7) % 9000 for i in range(120)]
CHAT_PROMPT = " ".join(f"word{i}" for i in range(60))
ROUTER_ARGS = ("--breaker-open-seconds", "0.3", "--health-interval", "0.2")
FIRST_TOKEN_TIMEOUT_S = 1.0
# A status the client saw -> the outcomes the router may have recorded for it.
STATUS_OUTCOMES = {
    502: {"prefill_failed", "decode_failed", "stream_error"},  # stream_error: non-streamed
    503: {"unavailable"},
    504: {"deadline_exceeded"},
}
UPSTREAM_FAILURES = {"prefill_failed", "decode_failed", "deadline_exceeded", "unavailable"}


# --------------------------------------------------------------------------------------------
# Clients


@dataclass
class Plan:
    """One client: what it asks for and how it behaves."""

    cid: str  # sent as X-Request-Id: the router journals it as client_request_id
    chat: bool
    stream: bool
    max_tokens: int
    abort: str | None  # None, "first_chunk" (hang up after it) or "timeout" (short timeout)
    timeout: float
    delay: float


@dataclass
class Seen:
    """What the client observed."""

    status: int | None = None
    router_id: str | None = None
    headers_at: float | None = None  # time.monotonic() when the response head arrived
    done: bool = False
    error_event: bool = False
    events_after_error: int = 0
    chunks: int = 0
    disconnected: bool = False  # the client hung up (on purpose) before the end
    body: Any = None
    failure: str | None = None  # anything the client did not expect


def payload(plan: Plan) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": plan.max_tokens}
    if plan.chat:
        body["messages"] = [{"role": "user", "content": CHAT_PROMPT}]
    else:
        body["prompt"] = PROMPT
    if plan.stream:
        body["stream"] = True
    return body


def run_client(url: str, plan: Plan, first_chunk: threading.Event | None = None) -> Seen:
    time.sleep(plan.delay)
    seen = Seen()
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    timeout = httpx.Timeout(plan.timeout, connect=10.0)
    try:
        with httpx.stream(
            "POST",
            url + path,
            json=payload(plan),
            headers={"X-Request-Id": plan.cid},
            timeout=timeout,
        ) as r:
            seen.headers_at = time.monotonic()
            seen.status = r.status_code
            seen.router_id = r.headers.get("x-request-id")
            if r.status_code != 200 or not plan.stream:
                seen.body = json.loads(r.read())
                return seen
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    seen.done = True
                    continue
                if seen.error_event:
                    seen.events_after_error += 1
                obj = json.loads(data)
                if "error" in obj:
                    seen.error_event = True
                    continue
                seen.chunks += 1
                if first_chunk is not None:
                    first_chunk.set()
                if plan.abort == "first_chunk":
                    seen.disconnected = True
                    return seen  # leaving the block closes the connection mid-stream
    except httpx.TimeoutException as exc:
        if plan.abort == "timeout":
            seen.disconnected = True
        else:
            seen.failure = f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        seen.failure = f"{type(exc).__name__}: {exc}"
    return seen


def expected_outcomes(plan: Plan, seen: Seen) -> set[str]:
    """The journal outcomes consistent with what the client saw."""
    if seen.disconnected:
        if seen.chunks or seen.status is not None:
            # Hung up once the stream was under way: the router may have finished it first.
            return {"client_abort", "ok", "stream_error"}
        # Timed out before any answer (timeout < first-token deadline, and far shorter than
        # max_tokens decode steps): the router cannot have answered ok or 504 before it saw
        # the hang-up, but a fast failure may have crossed the client's timeout on the wire.
        return {"client_abort", "prefill_failed", "decode_failed", "unavailable", "stream_error"}
    if seen.status == 200:
        if not plan.stream:
            return {"ok"}
        return {"stream_error"} if seen.error_event else {"ok"}
    assert seen.status in STATUS_OUTCOMES, seen
    return STATUS_OUTCOMES[seen.status]


def make_plans(rng: random.Random, n: int) -> list[Plan]:
    plans = []
    for i in range(n):
        stream = rng.random() < 0.6
        kind = rng.random()
        if kind < 0.15 and stream:
            abort, max_tokens, timeout = "first_chunk", rng.randint(150, 250), 30.0
        elif kind < 0.3:
            # Shorter than the first-token deadline; max_tokens >= 150 decode steps take
            # well over a second, so an ok cannot beat the timeout.
            abort, max_tokens, timeout = "timeout", rng.randint(150, 250), rng.uniform(0.15, 0.4)
        else:
            abort, max_tokens, timeout = None, rng.randint(2, 40), 60.0
        plans.append(
            Plan(
                cid=f"resilience-{i:03d}",
                chat=rng.random() < 0.4,
                stream=stream,
                max_tokens=max_tokens,
                abort=abort,
                timeout=timeout,
                delay=rng.uniform(0.0, 4.0),
            )
        )
    return plans


# --------------------------------------------------------------------------------------------
# Faults


def flip_faults(urls: list[str], rng: random.Random, stop: threading.Event, max_flips: int) -> int:
    """Set or clear a random fault on a random engine, every 0.1-0.3 s, until ``stop``."""
    flips = 0
    while flips < max_flips and not stop.wait(rng.uniform(0.1, 0.3)):
        url = rng.choice(urls)
        action = rng.choice(["fail_next", "stall", "drop", "slowdown", "clear", "clear"])
        if action == "clear":
            response = admin(url, "DELETE")
        else:
            fault = {
                "fail_next": {"fail_next": rng.randint(1, 3)},
                "stall": {"stall_first_token_s": FIRST_TOKEN_TIMEOUT_S + 0.5},
                "drop": {"drop_stream_after_tokens": rng.randint(1, 4)},
                "slowdown": {"slowdown": rng.uniform(2.0, 8.0)},
            }[action]
            response = admin(url, "POST", fault)
        assert response.status_code == 200, response.text
        flips += 1
    for url in urls:
        admin(url, "DELETE")
    return flips


# --------------------------------------------------------------------------------------------
# Journal


def journal_view(router: RouterProcess) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(request.start by id, request.end by id), asserting no id starts or ends twice."""
    starts: dict[str, dict[str, Any]] = {}
    for rec in router.records():
        if rec["type"] == "request.start":
            assert rec["id"] not in starts, f"two request.start records for {rec['id']}"
            starts[rec["id"]] = rec
    return starts, router.ends()  # ends() asserts one request.end per id


def assert_one_end_per_start(starts: dict[str, Any], ends: dict[str, Any]) -> None:
    assert set(ends) == set(starts), (
        f"started, never ended: {sorted(set(starts) - set(ends))}; "
        f"ended, never started: {sorted(set(ends) - set(starts))}"
    )


# --------------------------------------------------------------------------------------------
# 1. Random requests under random faults


@pytest.mark.slow  # (the longest of the fast subset: make test runs it)
def test_every_request_ends_once_under_random_faults_and_disconnects(tmp_path: Path) -> None:
    n = 60
    plans = make_plans(random.Random(20240611), n)
    with (
        running_fleet(tmp_path, 4, first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S) as fleet,
        running_router(tmp_path, fleet.fleet_path, *ROUTER_ARGS) as router,
    ):
        before = router.metrics()
        ends_before = set(router.ends())
        stop = threading.Event()
        urls = [e.url for e in fleet.engines.values()]
        with ThreadPoolExecutor(max_workers=13) as pool:
            faults = pool.submit(flip_faults, urls, random.Random(7), stop, 150)
            try:
                futures = [pool.submit(run_client, router.url, plan) for plan in plans]
                seen = [f.result(timeout=90) for f in futures]  # generous "no hang" bound
            finally:
                stop.set()
            flips = faults.result(timeout=30)

        # Exactly n new request.end records (poll: ends of hung-up clients land a bit later).
        assert wait_until(lambda: len(set(router.ends()) - ends_before) >= n, 15), (
            f"{n - len(set(router.ends()) - ends_before)} request(s) never ended"
        )
        time.sleep(0.3)  # would a late duplicate show up?
        starts, ends = journal_view(router)
        assert_one_end_per_start(starts, ends)
        new_ends = {rid: e for rid, e in ends.items() if rid not in ends_before}
        assert len(new_ends) == n
        by_cid = {e["client_request_id"]: e for e in new_ends.values()}
        assert sorted(by_cid) == sorted(p.cid for p in plans), "a client's request went missing"

        router_ids = [s.router_id for s in seen if s.router_id is not None]
        assert len(router_ids) == len(set(router_ids))
        # Each client's observation matches its journal outcome.
        mismatches = []
        for plan, s in zip(plans, seen, strict=True):
            assert s.failure is None, (plan, s)
            end = by_cid[plan.cid]
            if s.router_id is not None:
                assert s.router_id == end["id"], (plan, s, end)
            if plan.stream and s.status == 200 and not s.disconnected:
                # A stream always ends with [DONE]; an error event is its last event.
                assert s.done and s.events_after_error == 0, (plan, s)
            if s.status is not None and s.status != 200:
                assert set(s.body) == {"error"}, (plan, s)
                assert end["status"] == s.status, (plan, s, end)
            if end["outcome"] == "ok":
                assert end["completion_tokens"] == plan.max_tokens, (plan, end)
            if end["outcome"] not in expected_outcomes(plan, s):
                mismatches.append((plan, s, end["outcome"], end.get("error")))
        assert not mismatches, "\n".join(map(str, mismatches))

        # The outcome counters add up to n, outcome by outcome as in the journal.
        after = router.metrics()
        total = metric(after, "narwhal_requests_total") - metric(before, "narwhal_requests_total")
        assert total == n
        outcomes = Counter(e["outcome"] for e in new_ends.values())
        for outcome, count in outcomes.items():
            delta = metric(after, "narwhal_requests_total", outcome=outcome) - metric(
                before, "narwhal_requests_total", outcome=outcome
            )
            assert delta == count, (outcome, delta, count)
        assert metric(after, "narwhal_requests_total", outcome="internal_error") == 0
        hung_up = Counter(
            by_cid[p.cid]["outcome"] for p, s in zip(plans, seen, strict=True) if s.disconnected
        )
        print(f"\n{flips} fault flips; outcomes {dict(sorted(outcomes.items()))}")
        print(f"hung-up clients' outcomes {dict(hung_up)}")

        # The mix did what it is for: successes, hang-ups and upstream failures all happened.
        assert outcomes["ok"] >= 1 and outcomes["client_abort"] >= 1, outcomes
        assert sum(outcomes[o] for o in UPSTREAM_FAILURES | {"stream_error"}) >= 1, outcomes

        # Nothing leaked: no request, prefill or decode leg is still counted in flight.
        def idle() -> bool:
            state = router.admin_state()
            return state["in_flight_requests"] == 0 and all(
                e["in_flight"] == {"prefill": 0, "decode": 0} for e in state["engines"]
            )

        assert wait_until(idle, 10), router.admin_state()
        for url in urls:
            assert wait_until(
                lambda u=url: admin(u, "GET", path="/sim/state").json()["running"] == 0, 10
            )


# --------------------------------------------------------------------------------------------
# 2. SIGKILL mid-stream, restart on the same journal


@pytest.mark.slow  # (the longest of the fast subset: make test runs it)
def test_sigkill_mid_stream_then_restart_closes_each_cut_off_request_once(
    tmp_path: Path,
) -> None:
    n = 30
    rng = random.Random(99)
    journal = tmp_path / "journal" / "router.jsonl"
    plans = [
        Plan(
            cid=f"killed-{i:03d}",
            chat=rng.random() < 0.3,
            stream=True,
            max_tokens=rng.randint(800, 1000),  # >= 4 s of decode steps: mid-stream at the kill
            abort=None,
            timeout=30.0,
            # Most start together; the last few come after the router has died.
            delay=rng.uniform(0.0, 0.3) if i < n - 5 else rng.uniform(2.0, 3.0),
        )
        for i in range(n)
    ]
    with running_fleet(tmp_path, 2, first_token_timeout_s=5.0) as fleet:
        router = start_router(tmp_path, fleet.fleet_path, journal=journal)
        restarted: RouterProcess | None = None
        try:
            old_pid = router.process.pid
            streaming = threading.Semaphore(0)

            class Started(threading.Event):
                def set(self) -> None:
                    if not self.is_set():
                        super().set()
                        streaming.release()

            with ThreadPoolExecutor(max_workers=n) as pool:
                futures = [pool.submit(run_client, router.url, p, Started()) for p in plans]
                for _ in range(10):  # streams are under way
                    assert streaming.acquire(timeout=20), "streams never started"
                time.sleep(0.5)  # the rest of the first wave under way (decode takes seconds)
                killed_at = time.monotonic()
                router.process.kill()
                assert router.process.wait(10) == -9
                seen = [f.result(timeout=60) for f in futures]

            # The clients: none finished, and the cut-off streams failed rather than hang.
            cut_mid_stream = [s for s in seen if s.chunks]
            assert len(cut_mid_stream) >= 10
            # The journal's writer puts a record on file within about 20 ms of its queueing (it
            # never blocks the event loop): a kill -9 loses the records of that last window,
            # a stream's start among them (docs/router.md, The journal). Streams that got
            # their response head well before the kill were journaled.
            settled = {
                s.router_id: s
                for s in seen
                if s.headers_at is not None and s.headers_at < killed_at - 0.25
            }
            assert all(s.failure is not None and not s.done for s in seen), seen
            records_at_kill = router.records()
            assert not any(r["type"] == "router.stop" for r in records_at_kill)

            restarted = start_router(tmp_path, fleet.fleet_path, journal=journal)
            starts, ends = journal_view(restarted)
            assert_one_end_per_start(starts, ends)
            cut_off = {rid for rid, e in ends.items() if e["outcome"] == "router_restart"}
            # Nothing had finished before the kill, so every started request was cut off.
            assert cut_off == set(starts)
            assert all(ends[rid]["previous_pid"] == old_pid for rid in cut_off)
            by_cid = {s["client_request_id"]: rid for rid, s in starts.items()}
            for plan, s in zip(plans, seen, strict=True):
                if s.router_id is None:
                    continue
                if s.router_id in settled or plan.cid in by_cid:  # its head came: journaled
                    assert by_cid.get(plan.cid) == s.router_id
                    assert s.router_id in cut_off
            assert len(cut_off) >= sum(1 for s in settled.values() if s.chunks) >= 5
            print(
                f"\n{len(cut_mid_stream)} cut mid-stream, {len(cut_off)} closed by recovery, "
                f"{sum(s.status is None for s in seen)} without a response"
            )

            # The new process's router.start reports the recovery, after the ends it wrote.
            records = restarted.records()
            starts_idx = [i for i, r in enumerate(records) if r["type"] == "router.start"]
            assert len(starts_idx) == 2
            head = records[starts_idx[1]]
            assert head["pid"] == restarted.process.pid != old_pid
            recovery = head["recovery"]
            assert recovery["closed_requests"] == len(cut_off)
            assert recovery["previous_pid"] == old_pid
            assert recovery["previous_clean_shutdown"] is False
            assert recovery["unmatched_ends"] == 0
            restart_ends = [
                i
                for i, r in enumerate(records)
                if r["type"] == "request.end" and r["outcome"] == "router_restart"
            ]
            assert all(starts_idx[0] < i < starts_idx[1] for i in restart_ends)
            # The outcome counter has them too: one per request that reached a router.
            restarts = metric(
                restarted.metrics(), "narwhal_requests_total", outcome="router_restart"
            )
            assert restarts == len(cut_off)
            # And each missed its budgets, as the attainment counts it (the dashboards' two
            # denominators disagreed).
            missed = metric(restarted.metrics(), "narwhal_slo_requests_total", result="missed")
            assert missed >= len(cut_off)

            # The engines let go of the dead router's legs.
            for engine in fleet.engines.values():
                assert wait_until(
                    lambda u=engine.url: admin(u, "GET", path="/sim/state").json()["running"] == 0,
                    10,
                )

            # The restarted router serves.
            r = httpx.post(
                restarted.url + "/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            assert rid not in ends
            assert wait_until(lambda: rid in restarted.ends(), 5)
            assert restarted.ends()[rid]["outcome"] == "ok"
        finally:
            stop_router(router)
            if restarted is not None:
                assert stop_router(restarted) == 0

        # After a clean stop, nothing is left open for a third process to close.
        final = recover(journal)
        assert final.clean_shutdown is True
        assert final.open_requests == {}
        assert final.unmatched_ends == 0
