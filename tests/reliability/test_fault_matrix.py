"""The fault matrix of issue 11: each failure a P/D deployment meets, on a live simulated
fleet with the simulator's fault injection, asserting what the client sees, the journal's
``request.end``, the router's metrics, and that no request outlives its bound.

Cases covered by tests elsewhere, not repeated here. RF: tests/integration/
test_router_failures.py; RR: tests/integration/test_router_resilience.py; SF: tests/integration/
test_sim_faults.py; JU: tests/unit/journal/test_writer.py; JP: tests/integration/
test_journal_process.py; OV: tests/reliability/test_overload.py.

| case               | test                                                                      |
|--------------------|---------------------------------------------------------------------------|
| prefill 5xx        | RF::test_prefill_5xx_retries_on_another_prefill_engine                    |
| prefill 5xx, all   | RF::test_prefill_failing_everywhere_is_a_clear_502                        |
| decode 5xx         | RF::test_decode_failure_before_first_token_retries_with_a_fresh_prefill   |
| first token late   | RF::test_first_token_deadline_aborts_and_retries_elsewhere                |
| ... on all pairs   | RF::test_deadline_everywhere_is_a_504                                     |
| ... fallback=fail  | RF::test_fallback_fail_gives_504_without_retry                            |
| stream cut         | RF::test_failure_after_first_token_ends_stream_with_error_event           |
| prefill refused    | RF::test_dead_prefill_engine_fails_over_and_ready_tracks_pairs            |
| abort in prefill   | RF::test_client_disconnect_during_prefill_closes_the_prefill_leg          |
| abort mid-stream   | RF::test_client_disconnect_mid_stream_closes_the_decode_leg               |
| random faults      | RR::test_every_request_ends_once_under_random_faults_and_disconnects      |
| router SIGKILL     | RR::test_sigkill_mid_stream_then_restart_closes_each_cut_off_request_once |
| simulator faults   | SF, the whole module                                                      |
| journal errors     | JU::test_write_failure_*, JP::test_real_file_size_limit (no router)       |
| abort in admission | OV::test_client_disconnect_while_queued_in_admission                      |

Everything else in the issue's list is here: engine crash mid-prefill, mid-handoff (prefill
engine killed between its prefill and the pull; decode crashing on the KV READ), mid-stream;
connection refused on a decode engine; KV READ stalled past the deadline; the KV lease expiring
while the decode is queued (and while its READ is slow); decode rejecting before admission;
5xx bursts; a 10x slow engine; /metrics lying or stopping; client disconnect between the legs
and during the first-token wait; the journal's file size limit under both policies.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.engines.legs import prefill_leg_body
from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import (
    TEST_TIME_SCALE,
    TIMER_SLACK_S,
    RouterProcess,
    admin,
    metric,
    raw_completion,
    running_fleet,
    running_router,
    stop_router,
)
from tests.reliability.support import (
    PROMPT,
    attempts,
    background,
    body,
    close_breakers,
    count_journal,
    end_of,
    engine_metric,
    engine_metrics,
    engine_view,
    journal_records,
    metric_delta,
    post,
    reference_text,
    restart_dead_engines,
    router_idle,
    sim_state,
    sse_events,
    start_router_limited,
    stream_text,
    timed_post,
)

FIRST_TOKEN_TIMEOUT_S = 1.5
KV_READ_TIMEOUT_S = 4.0
SIM = {"time_scale": TEST_TIME_SCALE, "kv_read_timeout_s": KV_READ_TIMEOUT_S}
ROUTER_ARGS = (
    "--breaker-open-seconds",
    "0.3",
    "--health-interval",
    "0.2",
    "--scrape-interval",
    "0.2",
)
# A request that meets one fault and one retry ends within this (the first-token deadline
# twice, a prefill and a few decode steps, and room for a busy machine).
BOUND_S = 2 * FIRST_TOKEN_TIMEOUT_S + 3.0
CRASH = 137
PREFILL, DECODE = ("e0", "e1"), ("e2", "e3")


# --------------------------------------------------------------------------------------------
# The shared fleet: e0, e1 prefill; e2, e3 decode


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, RouterProcess]]:
    directory = tmp_path_factory.mktemp("fault-matrix")
    with (
        running_fleet(directory, 4, sim=SIM, first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S) as fleet,
        running_router(directory, fleet.fleet_path, *ROUTER_ARGS) as router,
    ):
        yield fleet, router


@pytest.fixture
def clean(stack: tuple[SimFleet, RouterProcess]) -> Iterator[tuple[SimFleet, RouterProcess]]:
    """The shared stack with no faults, every engine up, healthy and closed in the router, and
    nothing in flight: before and after each test."""
    fleet, router = stack

    def settle() -> None:
        if restart_dead_engines(fleet):
            # A decode engine caches a prefill engine's NIXL metadata; its first READ from a
            # restarted one fails once and refreshes it. Refresh every pair here, so a test
            # meets only the faults it injects.
            warm_pairs(fleet)
        for engine in fleet.engines.values():
            assert admin(engine.url, "DELETE").status_code == 200
        assert close_breakers(router), [
            (e["id"], e["healthy"], e["breaker"]) for e in router.admin_state()["engines"]
        ]
        assert wait_until(lambda: router_idle(router), 10), router.admin_state()
        for engine in fleet.engines.values():
            assert wait_until(
                lambda u=engine.url: sim_state(u)["running"] + sim_state(u)["waiting"] == 0, 10
            ), engine.engine_id

    settle()
    yield stack
    settle()


def warm_pairs(fleet: SimFleet) -> None:
    for p in PREFILL:
        for d in DECODE:
            for _ in range(2):
                kv = httpx.post(
                    fleet.engines[p].url + "/v1/completions",
                    json=prefill_leg_body(body(1), chat=False),
                    timeout=10,
                ).json()["kv_transfer_params"]
                r = httpx.post(
                    fleet.engines[d].url + "/v1/completions",
                    json={**body(1), "kv_transfer_params": kv},
                    timeout=10,
                )
                if r.status_code == 200:
                    break


def first_hitting(
    router: RouterProcess,
    engine: str,
    leg: str,
    payload: dict[str, Any],
    tries: int = 8,
) -> tuple[httpx.Response, float, dict[str, Any]]:
    """Send ``payload`` until the scheduler routes one to ``engine`` for ``leg``; the ties of
    the least-loaded scheduler rotate, so a few tries suffice."""
    for _ in range(tries):
        r, elapsed = timed_post(router, payload, timeout=BOUND_S + 10)
        end = end_of(router, r.headers["x-request-id"])
        if any(a["leg"] == leg and a["engine"] == engine for a in end.get("attempts", [])):
            return r, elapsed, end
    raise AssertionError(f"no request's {leg} leg went to {engine} in {tries} tries")


def exited(fleet: SimFleet, engine_id: str, code: int = CRASH, timeout: float = 10) -> bool:
    process = fleet.engines[engine_id].process
    assert process is not None
    return wait_until(lambda: process.poll() is not None, timeout) and process.poll() == code


# --------------------------------------------------------------------------------------------
# Engine crashes


def test_engine_crash_mid_prefill_retries_on_the_other_prefill_engine(clean) -> None:
    fleet, router = clean
    admin(fleet.engines["e0"].url, "POST", {"crash_on_prefill": True})
    expected = reference_text(fleet.engines["e2"].url, PROMPT, 6)
    before = router.metrics()
    r, elapsed, end = first_hitting(router, "e0", "prefill", body(6))
    assert exited(fleet, "e0")
    # The client never saw the crash: the prefill was retried on e1, with the right answer.
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert elapsed < BOUND_S
    assert end["outcome"] == "ok" and end["prefill_engine"] == "e1"
    legs = attempts(end)
    assert legs[0] == ("prefill", "e0", "failed") and ("prefill", "e1", "ok") in legs
    after = router.metrics()
    assert metric_delta(before, after, "narwhal_leg_failures_total", engine="e0", leg="prefill")
    assert metric_delta(before, after, "narwhal_retries_total", leg="prefill") >= 1
    # The router notices the dead engine and keeps serving on the rest.
    assert wait_until(lambda: engine_view(router, "e0")["healthy"] is False, 5)
    assert httpx.get(router.url + "/ready").status_code == 200
    for _ in range(3):
        r = post(router, body(2), timeout=BOUND_S)
        assert r.status_code == 200, r.text
        assert end_of(router, r.headers["x-request-id"])["prefill_engine"] == "e1"


def test_prefill_engine_killed_after_its_prefill_before_the_pull(clean) -> None:
    """The decode leg is stalled in its KV READ while the prefill engine that holds the KV is
    SIGKILLed: the READ cannot complete, the decode emits nothing from it, and the router
    starts over with a fresh prefill on the surviving prefill engine."""
    fleet, router = clean
    expected = reference_text(fleet.engines["e2"].url, PROMPT, 6)
    for d in DECODE:
        admin(fleet.engines[d].url, "POST", {"hang_kv_read_s": 1.0})
    before = router.metrics()
    decode_tokens_before = sum(
        engine_metric(fleet.engines[d].url, "vllm:generation_tokens_total") for d in DECODE
    )
    t0 = time.monotonic()
    with background(lambda: post(router, body(6), timeout=BOUND_S + 10)) as result:
        # Which prefill engine holds the KV (its hold is listed until it is pulled)?
        holder: list[str] = []

        def held() -> bool:
            holder[:] = [p for p in PREFILL if sim_state(fleet.engines[p].url)["holds"]]
            return bool(holder)

        assert wait_until(held, 5, interval=0.01), "no prefill engine ever held the KV"
        victim = holder[0]
        fleet.kill(victim)
        # The retry's READ must not stall: only the READ already under way does.
        for d in DECODE:
            admin(fleet.engines[d].url, "DELETE")
        r = result(BOUND_S + 10)
    elapsed = time.monotonic() - t0
    survivor = next(p for p in PREFILL if p != victim)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert elapsed < BOUND_S
    end = end_of(router, r.headers["x-request-id"])
    assert end["outcome"] == "ok" and end["prefill_engine"] == survivor
    legs = attempts(end)
    assert legs[0] == ("prefill", victim, "ok")
    failed_decode = legs[1]
    assert failed_decode[0] == "decode" and failed_decode[2] in ("failed", "deadline_exceeded")
    assert ("handoff", victim, "stranded") in legs
    assert legs[-2:] == [
        ("prefill", survivor, "ok"),
        ("decode", end["decode_engine"], "first_token"),
    ]
    after = router.metrics()
    assert metric_delta(before, after, "narwhal_stranded_handoffs_total", engine=victim) == 1
    assert metric_delta(before, after, "narwhal_retries_total", leg="decode") == 1
    # The decode engines generated exactly the answer's tokens: none from the lost KV.
    decode_tokens = sum(
        engine_metric(fleet.engines[d].url, "vllm:generation_tokens_total") for d in DECODE
    )
    assert decode_tokens - decode_tokens_before == 6


def test_decode_engine_crashing_on_kv_read(clean) -> None:
    fleet, router = clean
    admin(fleet.engines["e2"].url, "POST", {"crash_on_kv_read": True})
    expected = reference_text(fleet.engines["e3"].url, PROMPT, 5)
    before = router.metrics()
    r, elapsed, end = first_hitting(router, "e2", "decode", body(5))
    assert exited(fleet, "e2")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert elapsed < BOUND_S
    assert end["outcome"] == "ok" and end["decode_engine"] == "e3"
    legs = attempts(end)
    assert legs[1] == ("decode", "e2", "failed")
    stranded = [a for a in end["attempts"] if a["outcome"] == "stranded"]
    assert len(stranded) == 1 and stranded[0]["reason"] == "decode_failed"
    # A fresh prefill for the retry: the first one's KV was meant for the dead engine.
    assert sum(1 for leg in legs if leg[0] == "prefill" and leg[2] == "ok") == 2
    after = router.metrics()
    assert metric_delta(before, after, "narwhal_leg_failures_total", engine="e2", leg="decode")
    assert metric_delta(before, after, "narwhal_stranded_handoffs_total", reason="decode_failed")


def test_engine_crash_mid_stream_then_connection_refused(clean) -> None:
    fleet, router = clean
    admin(fleet.engines["e2"].url, "POST", {"crash_after_tokens": 3})
    hit = None
    for _ in range(8):
        t0 = time.monotonic()
        r = post(router, body(40, stream=True), timeout=BOUND_S + 10)
        elapsed = time.monotonic() - t0
        end = end_of(router, r.headers["x-request-id"])
        if end["decode_engine"] == "e2":
            hit = (r, elapsed, end)
            break
    assert hit is not None
    r, elapsed, end = hit
    assert exited(fleet, "e2")
    # After the first token the request is continued on another pair from the tokens it was
    # sent (routing.migration): the client gets its whole answer, in one stream.
    assert r.status_code == 200 and elapsed < BOUND_S
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    tokens = [e for e in events[:-1] if isinstance(e, dict) and e.get("choices")]
    assert len(tokens) == 40
    assert end["outcome"] == "ok" and end["completion_tokens"] == 40
    assert end["migrations"] == 1
    migration = [a for a in end["attempts"] if a["leg"] == "migration"]
    assert migration[0]["engine"] == "e2" and migration[0]["outcome"] == "connection"
    assert migration[0]["after_tokens"] == 3

    # e2 is now a closed port: connection refused. Requests routed there before the health
    # probe notices are retried on e3; the client sees only successes.
    before = router.metrics()
    outcomes = []
    for _ in range(6):
        r, elapsed = timed_post(router, body(3), timeout=BOUND_S + 10)
        assert r.status_code == 200, r.text
        assert elapsed < BOUND_S
        e = end_of(router, r.headers["x-request-id"])
        outcomes.append(e["outcome"])
        assert e["decode_engine"] == "e3"
    assert outcomes == ["ok"] * 6
    assert wait_until(lambda: engine_view(router, "e2")["healthy"] is False, 5)
    assert metric(router.metrics(), "narwhal_engine_healthy", engine="e2") == 0
    assert metric_delta(before, router.metrics(), "narwhal_requests_total", outcome="ok") == 6


# --------------------------------------------------------------------------------------------
# KV READ stalls


def test_kv_read_stalled_past_the_deadline(clean) -> None:
    """The decode engine's READ stalls longer than the first-token deadline (but inside its own
    read timeout): the router gives up on that leg at the deadline, counts the stranded
    handoff, and retries on the other decode engine; with both stalled, a clear 504."""
    fleet, router = clean
    admin(fleet.engines["e2"].url, "POST", {"hang_kv_read_s": 3.0})
    expected = reference_text(fleet.engines["e3"].url, PROMPT, 5)
    before = router.metrics()
    r, elapsed, end = first_hitting(router, "e2", "decode", body(5, stream=True))
    assert r.status_code == 200
    assert stream_text(sse_events(r.text)) == expected
    assert FIRST_TOKEN_TIMEOUT_S <= elapsed < BOUND_S
    assert end["outcome"] == "ok" and end["decode_engine"] == "e3"
    deadline = next(a for a in end["attempts"] if a["outcome"] == "deadline_exceeded")
    assert (
        deadline["engine"] == "e2" and deadline["after_s"] >= FIRST_TOKEN_TIMEOUT_S - TIMER_SLACK_S
    )
    stranded = next(a for a in end["attempts"] if a["outcome"] == "stranded")
    assert stranded["reason"] == "deadline_exceeded"
    after = router.metrics()
    assert metric_delta(before, after, "narwhal_first_token_deadline_exceeded_total", engine="e2")
    assert metric_delta(
        before, after, "narwhal_stranded_handoffs_total", reason="deadline_exceeded"
    )
    # The abandoned READ finishes late and is then dropped: e2 decodes nothing and ends idle.
    assert wait_until(lambda: sim_state(fleet.engines["e2"].url)["waiting"] == 0, 5)

    admin(fleet.engines["e3"].url, "POST", {"hang_kv_read_s": 3.0})
    r, elapsed = timed_post(router, body(5), timeout=BOUND_S + 10)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "first_token_deadline_exceeded"
    assert elapsed < BOUND_S
    end = end_of(router, r.headers["x-request-id"])
    assert end["outcome"] == "deadline_exceeded" and end["status"] == 504
    assert sum(1 for a in end["attempts"] if a["outcome"] == "deadline_exceeded") == 2
    assert sum(1 for a in end["attempts"] if a["outcome"] == "stranded") == 2


# --------------------------------------------------------------------------------------------
# Decode rejecting before admission


def test_decode_rejecting_before_admission_releases_the_handoff(clean) -> None:
    """A text prompt whose length the router cannot know passes its checks; the prefill leg
    (one token, no min_tokens) fits, the decode leg does not: the engine cuts max_tokens to what
    the prompt leaves of the context (vLLM 0.32), below the client's min_tokens, and refuses it
    before admission. The prefill's KV would then be held by nobody until its lease expires:
    the router passes the engine's 400 through and has the decode engine pull the KV with a
    release leg (one token), so the prefill engine holds nothing."""
    fleet, router = clean
    prompt = " ".join(f"word{i}" for i in range(600))
    before = router.metrics()
    request = body(16000, prompt=prompt, min_tokens=16000)
    r, elapsed = timed_post(router, request, timeout=BOUND_S)
    assert r.status_code == 400, r.text
    assert "min_tokens must be less than or equal to max_tokens" in r.json()["error"]["message"]
    assert elapsed < BOUND_S
    end = end_of(router, r.headers["x-request-id"])
    assert end["outcome"] == "client_error" and end["status"] == 400
    legs = attempts(end)
    assert legs[0][0] == "prefill" and legs[0][2] == "ok"
    prefill = legs[0][1]
    assert legs[1:] == [("handoff", prefill, "released")], legs
    after = router.metrics()
    assert metric_delta(before, after, "narwhal_kv_released_total", engine=prefill) == 1
    assert metric_delta(before, after, "narwhal_stranded_handoffs_total") == 0
    # No retry: the request, not an engine, is at fault, and the decode engine's breaker
    # is untouched.
    assert metric_delta(before, after, "narwhal_retries_total") == 0
    assert metric_delta(before, after, "narwhal_leg_failures_total") == 0
    # Nothing is held on the prefill engine under the router's request id.
    assert wait_until(
        lambda: (
            not any(h.startswith(end["id"]) for h in sim_state(fleet.engines[prefill].url)["holds"])
        ),
        5,
    )
    # Nor does it stop the next request.
    assert post(router, body(2), timeout=BOUND_S).status_code == 200


# --------------------------------------------------------------------------------------------
# 5xx bursts


def test_5xx_burst_opens_the_breaker_and_it_recovers(clean) -> None:
    """A burst of 503s from one prefill and one decode engine under concurrent load: every
    client still gets its answer (retried elsewhere), the failing engines' breakers open, and
    they close again once the engines recover.

    The engines keep answering /health throughout, so a passing probe is no evidence: after
    each cool-off the breaker lets one half-open request through, and only that request's
    success closes it (before the fix, every probe closed it and the engine cost
    ``--breaker-failures`` failed legs per cool-off).
    """
    fleet, router = clean
    admin(fleet.engines["e0"].url, "POST", {"fail_next": 1000})
    admin(fleet.engines["e2"].url, "POST", {"fail_next": 1000})
    before = router.metrics()
    seen: set[tuple[str, str]] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            seen.update((e["id"], e["breaker"]) for e in router.admin_state()["engines"])

    n = 40
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: timed_post(router, body(3), BOUND_S + 10), range(n)))
    finally:
        stop.set()
        watcher.join(5)
    assert [r.status_code for r, _ in results] == [200] * n
    assert max(elapsed for _, elapsed in results) < BOUND_S
    ends = [end_of(router, r.headers["x-request-id"]) for r, _ in results]
    assert {e["outcome"] for e in ends} == {"ok"}
    assert {e["prefill_engine"] for e in ends} == {"e1"}
    assert {e["decode_engine"] for e in ends} == {"e3"}
    assert ("e0", "open") in seen and ("e2", "open") in seen, seen
    after = router.metrics()
    failures = metric_delta(before, after, "narwhal_leg_failures_total")
    retries = metric_delta(before, after, "narwhal_retries_total")
    assert failures == retries
    # Without a breaker every request would fail on e0 or e2 about half the time per leg;
    # with one, not every request pays a retry on both legs.
    assert 2 <= failures < 2 * n, failures
    print(f"\n5xx burst: {n} requests, {failures:.0f} failed legs (all retried)")
    assert metric_delta(before, after, "narwhal_requests_total", outcome="ok") == n

    # Healthy by /health all along: once the cool-off is over, a passing probe lets each breaker
    # half-open (no request is sent now), and only that; probes alone never close it (a probe
    # that did would open -> half-open -> closed in one step, never showing half-open).
    def breakers() -> dict[str, str]:
        return {e["id"]: e["breaker"] for e in router.admin_state()["engines"]}

    assert wait_until(lambda: (b := breakers())["e0"] == b["e2"] == "half_open", 5), breakers()
    admin(fleet.engines["e0"].url, "DELETE")
    admin(fleet.engines["e2"].url, "DELETE")
    # The half-open requests succeed now and close them.
    assert close_breakers(router, 10), router.admin_state()
    used: Counter[str] = Counter()
    for _ in range(8):
        r = post(router, body(2), timeout=BOUND_S)
        assert r.status_code == 200
        e = end_of(router, r.headers["x-request-id"])
        used.update([e["prefill_engine"], e["decode_engine"]])
    assert used["e0"] > 0 and used["e2"] > 0, used


# --------------------------------------------------------------------------------------------
# A slow engine


def test_ten_times_slow_decode_engine(clean) -> None:
    """e3 decodes 10x slower. Its requests still succeed (slowly); the least-outstanding-work
    scheduler sends it fewer of them, since its requests stay in flight longer."""
    fleet, router = clean
    admin(fleet.engines["e3"].url, "POST", {"slowdown": 10.0})
    n = 36
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: timed_post(router, body(24), 60), range(n)))
    assert [r.status_code for r, _ in results] == [200] * n
    ends = [end_of(router, r.headers["x-request-id"]) for r, _ in results]
    assert {e["outcome"] for e in ends} == {"ok"}
    share = Counter(e["decode_engine"] for e in ends)
    assert share["e3"] < share["e2"], share

    def tpot(e: dict[str, Any]) -> float:
        return (e["t_last_token"] - e["t_first_token"]) / (e["completion_tokens"] - 1)

    slow = [tpot(e) for e in ends if e["decode_engine"] == "e3"]
    fast = [tpot(e) for e in ends if e["decode_engine"] == "e2"]
    if slow:
        assert min(slow) > 3 * (sum(fast) / len(fast)), (slow, fast)
    # Slow is not stuck: no request took longer than its tokens at 10x need, plus slack.
    step_s = 0.24 / TEST_TIME_SCALE
    assert max(elapsed for _, elapsed in results) < 24 * step_s * 10 * 4 + 5


# --------------------------------------------------------------------------------------------
# /metrics that lies, stops or hangs


@contextlib.contextmanager
def external_load(url: str, n: int) -> Iterator[None]:
    """``n`` long streams sent straight to an engine (not through the router): load that
    only the engine's own /metrics can tell the router about. Closed (aborted) on exit."""
    client = httpx.Client(timeout=60)
    streams: list[Any] = []
    try:
        for _ in range(n):
            cm = client.stream("POST", url + "/v1/completions", json=body(4000, stream=True))
            response = cm.__enter__()
            streams.append(cm)
            assert response.status_code == 200
        assert wait_until(lambda: sim_state(url)["running"] >= n, 5)
        yield
    finally:
        for cm in streams:
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)
        client.close()
        assert wait_until(lambda: sim_state(url)["running"] == 0, 5)


def decode_engines_of(router: RouterProcess, n: int) -> Counter[str]:
    used: Counter[str] = Counter()
    for _ in range(n):
        r = post(router, body(2), timeout=BOUND_S)
        assert r.status_code == 200, r.text
        used[end_of(router, r.headers["x-request-id"])["decode_engine"]] += 1
    return used


def scraped(router: RouterProcess, engine_id: str) -> dict[str, Any]:
    return engine_view(router, engine_id)["scraped"]


def test_lying_metrics_are_believed_but_never_below_the_routers_own_count(clean) -> None:
    """e2 carries 6 streams the router did not send. While its /metrics tells the truth the
    router keeps new decodes off it; when it lies (reports idle) the router believes it and
    spreads work evenly: it cannot tell a lie from an idle engine. What it never does is let a
    scraped number hide its own in-flight legs (load = max(own, scraped))."""
    fleet, router = clean
    e2 = fleet.engines["e2"].url
    with external_load(e2, 6):
        assert wait_until(lambda: scraped(router, "e2")["running"] >= 6, 3)
        assert decode_engines_of(router, 6) == Counter({"e3": 6})
        admin(e2, "POST", {"metrics": "lie"})
        assert wait_until(lambda: scraped(router, "e2")["running"] == 0, 3)
        view = engine_view(router, "e2")
        assert view["scraped"]["age_s"] < 1.0  # fresh, and false
        assert sim_state(e2)["running"] >= 6
        used = decode_engines_of(router, 6)
        assert used["e2"] >= 2, used
        # The router's own legs still count: a stream it holds open on e2 is seen whatever
        # e2 reports.
        with httpx.stream(
            "POST", router.url + "/v1/completions", json=body(3000, stream=True), timeout=30
        ) as held:
            assert held.status_code == 200
            rid = held.headers["x-request-id"]
            lines = held.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            assert wait_until(
                lambda: sum(e["in_flight"]["decode"] for e in router.admin_state()["engines"]) == 1,
                3,
            )
            holder = next(
                e["id"] for e in router.admin_state()["engines"] if e["in_flight"]["decode"]
            )
            other = "e3" if holder == "e2" else "e2"
            if holder == "e2":
                # e2 reports 0 running; the router still counts its own leg there.
                assert engine_view(router, "e2")["scraped"]["running"] == 0
            used: Counter[str] = Counter()
            for _ in range(3):
                # Each time against a fresh scrape of the other engine (its last request over).
                assert wait_until(lambda: scraped(router, other)["running"] == 0, 3)
                used += decode_engines_of(router, 1)
            assert used == Counter({other: 3}), used
        assert end_of(router, rid)["outcome"] == "client_abort"


@pytest.mark.slow  # > 10 s: own routers, own fleet, or waits for staleness
def test_stopped_or_hanging_metrics_go_stale_and_are_not_routed_on(clean) -> None:
    """e2's /metrics reports 6 running, then stops answering (503): the router keeps the last
    value only while it is fresh (5 s), then falls back to its own in-flight count, so an
    engine that recovered while its metrics were down is not avoided forever. A /metrics that
    hangs is abandoned at the scrape timeout without starving the other engines' scrapes."""
    fleet, router = clean
    e2 = fleet.engines["e2"].url
    before = router.metrics()
    with external_load(e2, 6):
        assert wait_until(lambda: scraped(router, "e2")["running"] >= 6, 3)
        admin(e2, "POST", {"metrics": "stop"})
    # The engine is idle now, but the router's last scrape says 6.
    t_stop = time.monotonic()
    assert scraped(router, "e2")["running"] >= 6
    assert decode_engines_of(router, 3) == Counter({"e3": 3})
    assert wait_until(lambda: scraped(router, "e2")["age_s"] > 5.0, 8)
    # Stale: ignored. e2 gets work again although its /metrics still fails.
    used = decode_engines_of(router, 6)
    assert used["e2"] >= 2, used
    assert time.monotonic() - t_stop < 10
    after = router.metrics()
    assert metric_delta(before, after, "narwhal_engine_scrape_errors_total", engine="e2") >= 10

    admin(e2, "POST", {"metrics": "hang"})
    hanging = router.metrics()

    def e2_scrape_errors() -> float:
        return metric_delta(
            hanging, router.metrics(), "narwhal_engine_scrape_errors_total", engine="e2"
        )

    # e3's scrape age, sampled all the while e2's scrapes hang.
    e3_ages: list[float] = []

    def e2_failed_twice() -> bool:
        e3_ages.append(scraped(router, "e3")["age_s"])
        return e2_scrape_errors() >= 2

    # Two more failed scrapes of e2 (a scrape already under way may still have got its 503):
    # at least one hung until the scrape timeout and was abandoned.
    assert wait_until(e2_failed_twice, 15, interval=0.1), e2_scrape_errors()
    # Scrapes run together, each bounded at 2 s: e3 is still scraped every ~2 s (a round is
    # the hung scrape's 2 s plus the interval), so it never went stale (5 s) while e2 hung.
    # (One sample against ~2 s would be at the mercy of a loaded host's scheduling.)
    assert max(e3_ages) < 5.0, e3_ages
    assert decode_engines_of(router, 2).total() == 2


# --------------------------------------------------------------------------------------------
# Client disconnects between the legs and during the first-token wait


@pytest.mark.parametrize(
    "phase, fault",
    [
        ("kv_read", {"hang_kv_read_s": 2.5}),  # between the legs: the KV is being pulled
        ("first_token", {"stall_first_token_s": 2.5}),  # decode running, first token held
    ],
)
def test_client_disconnect_during_the_handoff(clean, phase: str, fault: dict[str, Any]) -> None:
    fleet, router = clean
    for d in DECODE:
        admin(fleet.engines[d].url, "POST", fault)
    before = router.metrics()
    # The record is found by the client's X-Request-Id: an earlier test's request (answered,
    # its record not yet written) may be journaled after this one started.
    # Hang up once the decode engine holds the leg (its READ, or its first token, stalled),
    # not on a timer: on a busy host a timer can fire before the leg ever got there.
    with raw_completion(router, body(5), f"handoff-disconnect-{phase}") as client_id:
        assert wait_until(
            lambda: (
                any(sim_state(fleet.engines[d].url)["waiting"] for d in DECODE)
                if phase == "kv_read"
                else any(e["in_flight"]["decode"] for e in router.admin_state()["engines"])
            ),
            5,
            interval=0.01,
        )
        # Kept on purpose: the first-token hold has no outward sign (the engine may finish the
        # decode behind it), so hang up a little into the 2.5 s fault window, well inside it.
        time.sleep(0.2)

    def aborted() -> dict[str, Any] | None:
        return next(
            (e for e in router.ends().values() if e["client_request_id"] == client_id), None
        )

    assert wait_until(lambda: aborted() is not None, 5)
    end = aborted()
    assert end is not None
    assert end["outcome"] == "client_abort" and end["status"] is None
    legs = attempts(end)
    assert legs and legs[0][0] == "prefill" and legs[0][2] == "ok"
    # The decode leg the client left is in the journal as tried.
    assert legs[-1] == ("decode", end["decode_engine"], "cancelled"), legs
    assert end["decode_engine"] in DECODE and end["t_first_token"] is None
    after = router.metrics()
    assert metric_delta(before, after, "narwhal_requests_total", outcome="client_abort") == 1
    # Nothing leaks: the router's in-flight counts, the decode engine's blocks, the prefill
    # engine's hold (released when the abandoned READ completes, long before its lease).
    assert wait_until(lambda: router_idle(router), 5), router.admin_state()
    for d in DECODE:
        url = fleet.engines[d].url
        assert wait_until(
            lambda u=url: (
                (s := sim_state(u))["running"] + s["waiting"] == 0
                and s["free_blocks"] == s["num_blocks"]
            ),
            6,
        ), sim_state(url)

    # This request's hold goes when the abandoned READ completes (the client left once the
    # decode engine had the leg; had it left before, nothing would be pulled and only the
    # 30 s lease would free it). Other tests' stranded holds may still be there: not ours.
    def held(url: str) -> list[str]:
        return [h for h in sim_state(url)["holds"] if h.startswith(end["id"])]

    for p in PREFILL:
        url = fleet.engines[p].url
        assert wait_until(lambda u=url: not held(u), 6), (p, held(url))
    for d in DECODE:
        admin(fleet.engines[d].url, "DELETE")
    assert post(router, body(2), timeout=BOUND_S).status_code == 200


# --------------------------------------------------------------------------------------------
# The journal's disk full: RLIMIT_FSIZE on the router process (a real EFBIG from the kernel)

JOURNAL_LIMIT = 6000  # bytes: router.start and a handful of requests


def _statuses(router: RouterProcess, n: int) -> list[httpx.Response]:
    out = []
    for _ in range(n):
        r, elapsed = timed_post(router, body(2), timeout=BOUND_S)
        assert elapsed < BOUND_S
        out.append(r)
    return out


@pytest.mark.slow  # > 10 s: own routers, own fleet, or waits for staleness
def test_journal_disk_full_fail_closed_refuses_and_says_so(clean, tmp_path: Path) -> None:
    fleet, _ = clean
    journal = tmp_path / "journal" / "router.jsonl"
    router = start_router_limited(
        tmp_path, fleet.fleet_path, *ROUTER_ARGS, journal=journal, fsize_limit=JOURNAL_LIMIT
    )
    restarted: RouterProcess | None = None
    try:
        responses = _statuses(router, 40)
        codes = [r.status_code for r in responses]
        assert 200 in codes and 503 in codes, codes
        first_refusal = codes.index(503)
        # Once refused, always refused (the failure is sticky until a restart), and nothing
        # but 200 or a journal 503: no 5xx from the failure itself.
        assert set(codes[:first_refusal]) == {200} and set(codes[first_refusal:]) == {503}
        for r in responses[first_refusal:]:
            assert r.headers["retry-after"] == "5"
            assert "journal" in r.json()["error"]["message"]
        ready = httpx.get(router.url + "/ready", timeout=5)
        assert ready.status_code == 503
        assert ready.json()["reason"] == "the journal is not accepting records"
        state = router.admin_state()["journal"]
        assert state["accepting"] is False and state["healthy"] is False
        assert "File too large" in state["last_error"]
        assert wait_until(lambda: "refusing new requests (fail_closed)" in log_text(router), 5)
        m = router.metrics()
        assert metric(m, "narwhal_journal_write_errors_total") >= 1
        assert (
            metric(m, "narwhal_admission_rejections_total", reason="journal_unavailable")
            == len(codes) - first_refusal
        )
        # Refused requests reached the router: turned away (rejected) and missed, though no
        # record can say so (a QA pass: the attainment read 100% while 72% were refused).
        refused = len(codes) - first_refusal
        assert metric(m, "narwhal_requests_total", outcome="rejected") == refused
        assert metric(m, "narwhal_requests_total") == len(codes)
        assert metric(m, "narwhal_slo_requests_total", result="missed") >= refused

        # What the journal says it wrote is exactly the file; what it lost it counted.
        data = journal.read_bytes()
        assert len(data) <= JOURNAL_LIMIT and data.endswith(b"\n")
        written = count_journal(journal)
        served = [r.headers["x-request-id"] for r in responses[:first_refusal]]
        missing = sum((rid not in written.starts) + (rid not in written.ends) for rid in served)
        assert missing >= 1  # the write that failed was one of these requests' records
        assert metric(m, "narwhal_journal_dropped_total") >= missing
        assert stop_router(router) == 0
        # The log says, once and loudly, why it refused.
        assert "File too large" in log_text(router)
        # A short router.stop may still fit where a long record did not: it must not claim a
        # clean stop for a journal that lost records.
        for rec in journal_records(journal):
            if rec["type"] == "router.stop":
                assert rec["clean"] is False and rec["journal_dropped"] >= missing, rec
                assert "File too large" in rec["journal_error"]

        # Restarted without the limit: recovery closes what the full disk left open, and the
        # router serves again.
        restarted = start_router_limited(tmp_path, fleet.fleet_path, *ROUTER_ARGS, journal=journal)
        r = post(restarted, body(2), timeout=BOUND_S)
        assert r.status_code == 200
        end_of(restarted, r.headers["x-request-id"])
        after = count_journal(journal)
        assert after.duplicate_ends == 0 and not after.open_ids
        recovered = {rid for rid, e in after.ends.items() if e["outcome"] == "router_restart"}
        assert recovered == {
            rid for rid in served if rid in written.starts and rid not in written.ends
        }
    finally:
        stop_router(router)
        if restarted is not None:
            stop_router(restarted)


@pytest.mark.slow  # > 10 s: own routers, own fleet, or waits for staleness
def test_journal_disk_full_best_effort_keeps_serving_and_counts(clean, tmp_path: Path) -> None:
    fleet, _ = clean
    journal = tmp_path / "journal" / "router.jsonl"
    router = start_router_limited(
        tmp_path,
        fleet.fleet_path,
        *ROUTER_ARGS,
        "--journal-on-error",
        "best_effort",
        journal=journal,
        fsize_limit=JOURNAL_LIMIT,
    )
    try:
        responses = _statuses(router, 30)
        assert [r.status_code for r in responses] == [200] * 30
        ready = httpx.get(router.url + "/ready", timeout=5)
        assert ready.status_code == 200  # serving unrecorded is this policy's choice
        state = router.admin_state()["journal"]
        assert state["accepting"] is True and state["healthy"] is False
        assert "File too large" in state["last_error"]
        assert wait_until(lambda: "dropping records (best_effort)" in log_text(router), 5)
        data = journal.read_bytes()
        assert len(data) <= JOURNAL_LIMIT and data.endswith(b"\n")
        written = count_journal(journal)
        lost = sum(
            (r.headers["x-request-id"] not in written.starts)
            + (r.headers["x-request-id"] not in written.ends)
            for r in responses
        )
        assert lost > 30  # most records of 30 requests did not fit
        m = router.metrics()
        assert metric(m, "narwhal_journal_dropped_total") >= lost
        assert metric(m, "narwhal_journal_write_errors_total") >= 1
        assert metric(m, "narwhal_requests_total", outcome="ok") == 30
    finally:
        stop_router(router)


def log_text(router: RouterProcess) -> str:
    return router.log_path.read_text(errors="replace")


# --------------------------------------------------------------------------------------------
# The KV lease expiring before the decode pulls it

LEASE_S = 0.5
LEASE_DEADLINE_S = 8.0  # long enough that the lease, not the deadline, decides these cases


@pytest.fixture(scope="module")
def lease_stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SimFleet, RouterProcess]]:
    """e0 prefills and frees unpulled KV after 0.5 s; e1 and e2 decode one sequence at a
    time, so a decode leg that arrives while they are busy waits in their queue."""
    directory = tmp_path_factory.mktemp("lease")
    prefill = {**SIM, "kv_lease_s": LEASE_S}
    decode = {**SIM, "max_num_seqs": 1}
    with (
        running_fleet(
            directory,
            3,
            sim=[prefill, decode, decode],
            initial_roles=["prefill", "decode", "decode"],
            first_token_timeout_s=LEASE_DEADLINE_S,
        ) as fleet,
        running_router(directory, fleet.fleet_path, *ROUTER_ARGS) as router,
    ):
        yield fleet, router


def _lease_counters(fleet: SimFleet) -> dict[str, float]:
    e0, e1, e2 = (engine_metrics(fleet.engines[e].url) for e in ("e0", "e1", "e2"))
    return {
        "expired": metric(e0, "vllm:nixl_num_kv_expired_reqs_total"),
        "verify_failures": metric(e1, "narwhal_sim:kv_verify_failures_total")
        + metric(e2, "narwhal_sim:kv_verify_failures_total"),
        "decode_tokens": metric(e1, "vllm:generation_tokens_total")
        + metric(e2, "vllm:generation_tokens_total"),
    }


def _assert_lease_case(
    fleet: SimFleet,
    router: RouterProcess,
    r: httpx.Response,
    elapsed: float,
    before: dict[str, float],
    router_before: str,
    expected: str,
    other_decode_tokens: int,
) -> dict[str, Any]:
    """The request whose first decode attempt met freed KV: retried, right answer, and not
    one token generated from the freed blocks."""
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected  # no garbage from zeroed blocks
    assert elapsed < LEASE_DEADLINE_S
    end = end_of(router, r.headers["x-request-id"])
    assert end["outcome"] == "ok"
    failed = [a for a in end["attempts"] if a["leg"] == "decode" and a["outcome"] == "failed"]
    assert len(failed) == 1, end["attempts"]
    assert "does not match the prompt" in failed[0]["error"]
    stranded = [a for a in end["attempts"] if a["outcome"] == "stranded"]
    assert [(a["engine"], a["reason"]) for a in stranded] == [("e0", "decode_failed")]
    assert end["decode_engine"] != failed[0]["engine"]
    after = _lease_counters(fleet)
    assert after["expired"] - before["expired"] == 1
    assert after["verify_failures"] - before["verify_failures"] == 1
    # The decode engines generated the busy requests' tokens and this answer's: the attempt
    # that read the freed blocks produced none.
    assert after["decode_tokens"] - before["decode_tokens"] == other_decode_tokens + 6
    m = router.metrics()
    assert metric_delta(router_before, m, "narwhal_stranded_handoffs_total", reason="decode_failed")
    assert metric_delta(router_before, m, "narwhal_retries_total", leg="decode") == 1
    return end


@pytest.mark.slow  # > 10 s: own routers, own fleet, or waits for staleness
def test_kv_lease_expires_while_the_decode_is_queued(lease_stack) -> None:
    """Both decode engines are busy with a long request each (sent to them directly). The
    router's decode leg waits in an engine's queue while e0's lease on its KV runs out and
    the blocks are zeroed and freed. When the decode is admitted its READ brings back freed
    blocks, verification fails, no token is emitted, and the router starts over with a fresh
    prefill on the other decode engine, which is free by then."""
    fleet, router = lease_stack
    expected = reference_text(fleet.engines["e0"].url, PROMPT, 6)
    busy_tokens = 300  # ~1.5 s of decode steps: three leases
    before = _lease_counters(fleet)
    router_before = router.metrics()
    with ThreadPoolExecutor(2) as pool:
        busy = [
            pool.submit(
                httpx.post,
                fleet.engines[d].url + "/v1/completions",
                json=body(busy_tokens),
                timeout=60,
            )
            for d in ("e1", "e2")
        ]
        for d in ("e1", "e2"):
            assert wait_until(lambda u=fleet.engines[d].url: sim_state(u)["running"] == 1, 5)
        t0 = time.monotonic()
        with background(lambda: post(router, body(6), timeout=LEASE_DEADLINE_S + 10)) as result:
            # The decode leg is queued behind a busy request, and the lease runs out.
            assert wait_until(
                lambda: any(sim_state(fleet.engines[d].url)["waiting"] for d in ("e1", "e2")), 5
            )
            assert wait_until(lambda: not sim_state(fleet.engines["e0"].url)["holds"], 5)
            assert any(b.running() for b in busy), "the busy requests ended before the lease"
            r = result(LEASE_DEADLINE_S + 10)
        elapsed = time.monotonic() - t0
        assert [b.result(30).status_code for b in busy] == [200, 200]
    _assert_lease_case(fleet, router, r, elapsed, before, router_before, expected, 2 * busy_tokens)


@pytest.mark.slow  # > 10 s: own routers, own fleet, or waits for staleness
def test_kv_lease_expires_during_a_slow_kv_read(lease_stack) -> None:
    """The same hazard without a queue: e1's READ starts after a 1.2 s stall (inside its read
    timeout, past the 0.5 s lease), so it reads blocks the prefill engine has freed."""
    fleet, router = lease_stack
    expected = reference_text(fleet.engines["e0"].url, PROMPT, 6)
    admin(fleet.engines["e1"].url, "POST", {"hang_kv_read_s": 1.2})
    try:
        for _ in range(6):
            before = _lease_counters(fleet)
            router_before = router.metrics()
            r, elapsed = timed_post(router, body(6), timeout=LEASE_DEADLINE_S + 10)
            end = end_of(router, r.headers["x-request-id"])
            if any(a["engine"] == "e1" for a in end["attempts"] if a["leg"] == "decode"):
                break
        else:
            raise AssertionError("no request was routed to e1")
        end = _assert_lease_case(fleet, router, r, elapsed, before, router_before, expected, 0)
        assert end["decode_engine"] == "e2"
    finally:
        admin(fleet.engines["e1"].url, "DELETE")
    assert wait_until(lambda: router_idle(router), 5)
