"""Overload, and admission control under it: a profiled 1P1D fleet behind scheduler v1.

Offered load of about 5x what the fleet can serve within its budgets, for a bounded time:
the router's memory stays bounded, the requests it admits meet the budgets, the rest get 429
with Retry-After at once, nothing gets a 5xx, every request is journaled exactly once, and
latency is back to normal within seconds after the load stops. Also here, because it needs a
profile store: a client that disconnects while queued in admission.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procfs import rss_kib
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, RouterProcess, metric, running_fleet, running_router
from tests.integration.test_profile_v1 import profile, write_limits
from tests.reliability.support import RssSampler, count_journal, end_of, engine_metric, metric_delta

pytestmark = pytest.mark.slow

# Real-time engines (time_scale 1) with a cheap model: a decode step costs
# 0.02 + 0.01 * batch seconds, so the TPOT budget (10% above the step at batch 4) admits a
# batch of at most 4. A small capacity keeps 5x of it cheap for the test's own client.
SIM = {
    "time_scale": 1.0,
    "prefill_a": 0.01,
    "prefill_b": 5e-5,
    "prefill_c": 0.0,
    "decode_intercept": 0.02,
    "decode_slope": 0.01,
    "decode_ctx_coef": 0.0,
}
TTFT_S, TPOT_S = 2.0, 0.066
FIRST_TOKEN_TIMEOUT_S = 1.9
PROMPT = [300 + (i * 11) % 9000 for i in range(512)]
MAX_TOKENS = 24
MAX_BATCH = 4
STEP_S = 0.02 + 0.01 * MAX_BATCH
# One request holds a decode slot for about MAX_TOKENS steps at the full batch.
CAPACITY_RPS = MAX_BATCH / (MAX_TOKENS * STEP_S + 0.05)
OFFERED_RPS = 5 * CAPACITY_RPS
LOAD_S = 20.0


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, Path, Path]]:
    directory = tmp_path_factory.mktemp("overload")
    with running_fleet(
        directory,
        2,
        sim=SIM,
        initial_roles=["prefill", "decode"],
        ttft_s=TTFT_S,
        tpot_s=TPOT_S,
        first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S,
        role_control={"enabled": False},
    ) as fleet:
        store = directory / "store.json"
        result = profile(
            fleet.fleet_path,
            write_limits(directory),
            store,
            prefill_lens="256,512,1024",
            decode_lens="512",
            decode_tokens="16",
        )
        assert result.returncode == 0, result.stderr
        yield fleet, store, directory


def fleet_variant(directory: Path, fleet: SimFleet, name: str, **changes: Any) -> Path:
    """The same engines under other budgets or routing policy (a new fleet file)."""
    doc = json.loads(fleet.fleet_path.read_text())
    for key, value in changes.items():
        doc[key] = {**doc.get(key, {}), **value}
    path = directory / name
    path.write_text(json.dumps(doc, indent=2))
    return path


def completion(timeout: float = 30) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@dataclass
class Result:
    sent_at: float
    status: int | None = None
    latency: float | None = None
    retry_after: str | None = None
    code: Any = None
    error: str | None = None
    router_id: str | None = None
    client_id: str = ""


async def open_loop(url: str, rate: float, seconds: float, max_in_flight: int) -> list[Result]:
    """Arrivals at a fixed rate for ``seconds`` (not waiting for answers: an open loop, as
    real clients behave), each bounded by a 30 s timeout and the whole by ``max_in_flight``."""
    results: list[Result] = []
    # Idle connections are dropped before the router's keep-alive timeout (uvicorn: 5 s), so
    # the client never reuses one the router is closing (a race no server can prevent).
    limits = httpx.Limits(
        max_connections=max_in_flight, max_keepalive_connections=64, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        gate = asyncio.Semaphore(max_in_flight)

        async def one(res: Result) -> None:
            try:
                r = await client.post(
                    url + "/v1/completions",
                    json=completion(),
                    headers={"X-Request-Id": res.client_id},
                )
                res.status = r.status_code
                res.retry_after = r.headers.get("retry-after")
                res.router_id = r.headers.get("x-request-id")
                if r.status_code != 200:
                    res.code = r.json()["error"].get("code")
            except httpx.HTTPError as exc:
                res.error = f"{type(exc).__name__}: {exc}"
            finally:
                res.latency = time.monotonic() - res.sent_at
                gate.release()

        tasks = []
        t0 = time.monotonic()
        n = int(rate * seconds)
        for i in range(n):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await gate.acquire()
            res = Result(sent_at=time.monotonic(), client_id=f"overload-{i:05d}")
            results.append(res)
            tasks.append(asyncio.create_task(one(res)))
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return results


def e2e(router: RouterProcess) -> float:
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/completions", json=completion(), timeout=30)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_overload_at_five_times_capacity(profiled) -> None:
    fleet, store, directory = profiled
    with running_router(directory, fleet.fleet_path, "--profiles", str(store)) as router:
        baseline = [e2e(router) for _ in range(5)]
        normal = statistics.median(baseline)
        pid = router.process.pid
        rss_start = rss_kib(pid)
        assert rss_start is not None, "the router is gone"
        before = router.metrics()
        with RssSampler(pid, 0.5) as rss:
            t_load = time.monotonic()
            results = asyncio.run(open_loop(router.url, OFFERED_RPS, LOAD_S, 400))
            t_stop = time.monotonic()
            after_load = router.metrics()  # every load request has its answer by now
            # Recovery: once the admitted requests have drained, a request is served at the
            # normal latency again.
            recovered_at = None
            deadline = t_stop + 15
            while time.monotonic() < deadline:
                r = httpx.post(router.url + "/v1/completions", json=completion(), timeout=30)
                if r.status_code == 200 and r.elapsed.total_seconds() <= 1.5 * normal + 0.1:
                    recovered_at = time.monotonic()
                    break
                time.sleep(0.2)
            after_recovery = [e2e(router) for _ in range(3)]
        assert router.process.poll() is None, "the router died under load"
        metrics = router.metrics()

        journal = count_journal(router.journal)
        for e in journal.ends.values():
            if e["outcome"] not in ("ok", "rejected"):
                print("unexpected:", e["outcome"], e["status"], e["error"], e.get("attempts"))
        statuses = Counter(r.status for r in results)
        print(
            f"\ncapacity ~{CAPACITY_RPS:.1f} req/s, offered {OFFERED_RPS:.1f} req/s for "
            f"{LOAD_S:.0f} s ({t_stop - t_load:.1f} s): {len(results)} sent, {dict(statuses)}"
        )
        by_client = {
            e["client_request_id"]: e
            for e in count_journal(router.journal).ends.values()
            if e["client_request_id"]
        }
        errors = [(r, by_client.get(r.client_id)) for r in results if r.error]
        assert not errors, errors[:5]
        assert set(statuses) <= {200, 429}, statuses  # no 5xx, nothing else
        rejected = [r for r in results if r.status == 429]
        assert all(r.retry_after == "1" and r.code == "over_budget" for r in rejected)
        # Rejection is immediate: it costs the client no waiting.
        assert statistics.median(r.latency for r in rejected) < 0.5
        admitted = [r for r in results if r.status == 200]
        admitted_rps = len(admitted) / LOAD_S
        print(f"admitted {admitted_rps:.1f} req/s, rejected {len(rejected) / len(results):.0%}")
        assert len(rejected) >= 0.5 * len(results)
        assert 0.4 * CAPACITY_RPS <= admitted_rps <= 1.5 * CAPACITY_RPS

        # Every request journaled exactly once, each 429 as "rejected".
        ids = {r.router_id for r in results}
        assert None not in ids and len(ids) == len(results)
        assert ids <= set(journal.starts) and ids <= set(journal.ends)
        assert journal.duplicate_starts == 0 and journal.duplicate_ends == 0
        outcomes = Counter(journal.ends[i]["outcome"] for i in ids)
        assert outcomes == {"ok": len(admitted), "rejected": len(rejected)}, outcomes
        assert metric_delta(
            before, after_load, "narwhal_admission_rejections_total", reason="over_budget"
        ) == len(rejected)

        # The admitted requests met the budgets (the router's own measurements).
        ends = [journal.ends[r.router_id] for r in admitted]
        ttft_ok = [e["t_first_token"] <= TTFT_S for e in ends]
        tpot = [
            (e["t_last_token"] - e["t_first_token"]) / (e["completion_tokens"] - 1) for e in ends
        ]
        met = [a and t <= TPOT_S for a, t in zip(ttft_ok, tpot, strict=True)]
        attainment = sum(met) / len(met)
        print(
            f"admitted: TTFT p50 {statistics.median(e['t_first_token'] for e in ends):.3f} s, "
            f"TPOT p50 {statistics.median(tpot):.4f} s max {max(tpot):.4f} s, "
            f"both budgets met by {attainment:.1%}"
        )
        half_n = len(met) // 2
        decode_ratio = metric(metrics, "narwhal_latency_ratio", engine="e1", phase="decode")
        prefill_ratio = metric(metrics, "narwhal_latency_ratio", engine="e0", phase="prefill")
        print(
            f"budgets met in the first / second half of the load: "
            f"{sum(met[:half_n]) / max(1, half_n):.0%} / "
            f"{sum(met[half_n:]) / max(1, len(met) - half_n):.0%}; learnt ratios: decode "
            f"{decode_ratio:.2f}, prefill {prefill_ratio:.2f}"
        )
        # How many decodes ran at once: the budget allows MAX_BATCH.
        spans = [
            (e["arrival"] + e["t_decode_start"], e["arrival"] + e["t_last_token"]) for e in ends
        ]
        peak_batch = max(sum(1 for s0, s1 in spans if s0 <= t <= s1) for t, _ in spans)
        print(f"peak concurrent decodes {peak_batch} (budget allows {MAX_BATCH})")
        # Misses concentrate in the first seconds of the burst, before the corrections have
        # samples (on this 2-core host: 76-81% in the first half, 100% in the second), and are
        # marginal (TPOT up to ~0.075 s against 0.066 s). The floor catches a regression; the
        # fleet's own target (0.95) is reported, not asserted.
        assert attainment >= 0.7, attainment

        # Memory: bounded while rejecting hundreds of requests, and flat, not growing.
        samples = [kib for t, kib in rss.samples if t <= t_stop - t_load]
        peak = max(samples)
        half = len(samples) // 2
        first_half, second_half = max(samples[:half]), max(samples[half:])
        print(
            f"router RSS: {rss_start / 1024:.1f} MiB before, peak {peak / 1024:.1f} MiB, "
            f"halves {first_half / 1024:.1f} / {second_half / 1024:.1f} MiB"
        )
        assert peak - rss_start < 64 * 1024
        assert second_half - first_half < 16 * 1024

        # Recovery within seconds after the load stopped.
        assert recovered_at is not None, "latency never returned to normal"
        print(
            f"normal e2e {normal:.3f} s; recovered {recovered_at - t_stop:.1f} s after the "
            f"load stopped; then {[round(x, 3) for x in after_recovery]}"
        )
        assert recovered_at - t_stop < 5.0
        assert max(after_recovery) <= 1.5 * normal + 0.2


def test_client_disconnect_while_queued_in_admission(profiled) -> None:
    """Admission policy ``queue`` with a TPOT budget no pair can meet. The first request finds
    the pair idle and is served anyway (an idle pair is never refused: that is how learnt
    predictions recover after a burst); while it runs, the next ones wait in the admission
    queue. A client that hangs up there is journaled as client_abort, leaves the queue at once
    and no engine ever hears of it; one that waits gets 429 at the queue timeout."""
    fleet, store, directory = profiled
    path = fleet_variant(
        directory,
        fleet,
        "fleet-queue.json",
        budgets={"tpot_s": 0.001},  # a decode step takes 0.02 s at least
        routing={"admission": "queue", "queue_max": 8, "queue_timeout_s": 2.0},
    )
    with running_router(directory, path, "--profiles", str(store)) as router:
        engines_before = {
            e.engine_id: engine_metric(e.url, "vllm:request_success_total")
            for e in fleet.engines.values()
        }
        before = router.metrics()
        with httpx.stream(
            "POST",
            router.url + "/v1/completions",
            json={**completion(), "max_tokens": 400, "stream": True},
            timeout=30,
        ) as busy:
            assert busy.status_code == 200
            busy_id = busy.headers["x-request-id"]
            lines = busy.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            ids_before = set(router.ends())
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(router.url + "/v1/completions", json=completion(), timeout=0.6)

            def new_end() -> dict[str, Any] | None:
                new = [e for rid, e in router.ends().items() if rid not in ids_before]
                return new[0] if new else None

            assert wait_until(lambda: new_end() is not None, 3)
            end = new_end()
            assert end is not None
            assert end["outcome"] == "client_abort" and end["status"] is None
            assert end["prefill_engine"] is None and end["decode_engine"] is None
            # No leg: only its wait in the queue (about the client's 0.6 s).
            [queued] = end["attempts"]
            assert (queued["leg"], queued["engine"], queued["outcome"]) == (
                "admission",
                "",
                "queued",
            )
            assert queued["admitted"] is False and 0.4 <= queued["waited_s"] < 3, queued
            assert metric(router.metrics(), "narwhal_admission_queue") == 0

            t0 = time.monotonic()
            r = httpx.post(router.url + "/v1/completions", json=completion(), timeout=10)
            waited = time.monotonic() - t0
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_timeout"
            assert 2.0 <= waited < 5.0
            rejected = end_of(router, r.headers["x-request-id"])
            assert rejected["outcome"] == "rejected"
            assert [(a["outcome"], a["admitted"]) for a in rejected["attempts"]] == [
                ("queued", False)
            ]
            assert rejected["attempts"][0]["waited_s"] >= 2.0
        busy_end = end_of(router, busy_id)
        assert ("admission", "e0", "idle_pair") in [
            (a["leg"], a["engine"], a["outcome"]) for a in busy_end["attempts"]
        ]
        after = router.metrics()
        assert metric_delta(before, after, "narwhal_requests_total", outcome="client_abort") == 2
        assert (
            metric_delta(
                before, after, "narwhal_admission_rejections_total", reason="queue_timeout"
            )
            == 1
        )
        assert metric(after, "narwhal_admission_queue") == 0
        # Only the busy request reached the engines (one prefill leg, one decode leg).
        served = sum(
            engine_metric(e.url, "vllm:request_success_total") - engines_before[e.engine_id]
            for e in fleet.engines.values()
        )
        assert served == 2
