"""Every fault the simulated engine can inject does what it says, against real engine processes.

Faults are set at run time through the guarded admin endpoint (and, for some, through the
engine's CLI flags). Tests that do not kill an engine share one fleet whose faults are cleared
and whose engines are checked idle (nothing running, waiting or leaked) around every test; a
test that kills an engine gets a fleet of its own.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.engines.legs import prefill_leg_body
from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import (
    ADMIN_TOKEN,
    MODEL,
    TEST_TIME_SCALE,
    admin,
    metric,
    running_fleet,
    write_fleet,
)

CRASH = 137
KV_READ_TIMEOUT_S = 2.0
SIM = {"time_scale": TEST_TIME_SCALE, "kv_read_timeout_s": KV_READ_TIMEOUT_S}
PROMPT = [300 + (i * 53) % 9000 for i in range(100)]  # 7 blocks of 16
# Thousands of 4.8 ms steps: a request that is still running whenever a test looks at it.
LONG_MAX_TOKENS = 4000
FAILED = "vllm:nixl_num_failed_transfers_total"
ABORTED = "vllm:request_success_total"


# --- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    # e1 (the decode engine) runs one sequence at a time, so a second request queues there.
    with running_fleet(
        tmp_path_factory.mktemp("faults"),
        2,
        sim=SIM,
        engine_args={"e1": ["--max-num-seqs", "1"]},
    ) as fleet:
        yield fleet


def state(url: str) -> dict[str, Any]:
    r = admin(url, "GET", path="/sim/state")
    assert r.status_code == 200, r.text
    return r.json()


def is_idle(url: str) -> bool:
    s = state(url)
    return s["running"] == 0 and s["waiting"] == 0


def reset(fleet: SimFleet) -> None:
    for engine in fleet.engines.values():
        assert engine.alive, f"shared engine {engine.engine_id} died"
        r = admin(engine.url, "DELETE")
        assert r.status_code == 200, r.text


@pytest.fixture
def fleet(shared_fleet: SimFleet) -> Iterator[SimFleet]:
    """The shared fleet, faults cleared and idle before and after the test."""
    reset(shared_fleet)
    for engine in shared_fleet.engines.values():
        assert wait_until(lambda e=engine: is_idle(e.url), 10), f"{engine.engine_id} not idle"
    yield shared_fleet
    reset(shared_fleet)
    for engine in shared_fleet.engines.values():
        assert wait_until(lambda e=engine: is_idle(e.url), 10), f"{engine.engine_id} busy after"
    # The decode engine never holds KV for anyone: every block must be back.
    decode = state(shared_fleet.engines["e1"].url)
    assert decode["free_blocks"] == decode["num_blocks"]


def urls(fleet: SimFleet) -> tuple[str, str]:
    return fleet.engines["e0"].url, fleet.engines["e1"].url


def body(max_tokens: int = 8, stream: bool = False, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    return out


def assert_openai_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert words in error["message"]


def read_stream(
    client: httpx.Client, url: str, request: dict[str, Any]
) -> tuple[list[str], bool, Exception | None]:
    """Stream a completion: (token texts, saw [DONE], the transport error that ended it)."""
    pieces: list[str] = []
    done = False
    try:
        with client.stream("POST", url + "/v1/completions", json=request) as r:
            assert r.status_code == 200
            for event in _events(r):
                if event == "[DONE]":
                    done = True
                elif event["choices"]:
                    pieces.append(event["choices"][0]["text"])
    except httpx.TransportError as exc:
        return pieces, done, exc
    return pieces, done, None


def _events(r: httpx.Response) -> Iterator[Any]:
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield "[DONE]" if data == "[DONE]" else json.loads(data)


def ttft(client: httpx.Client, url: str, request: dict[str, Any]) -> float:
    """Seconds from sending a streamed request to its first token chunk (then read it all)."""
    t0 = time.monotonic()
    first = None
    with client.stream("POST", url + "/v1/completions", json=request) as r:
        assert r.status_code == 200
        for event in _events(r):
            if first is None and event != "[DONE]" and event["choices"]:
                first = time.monotonic() - t0
    assert first is not None
    return first


@contextlib.contextmanager
def long_stream(client: httpx.Client, url: str) -> Iterator[httpx.Response]:
    """A long streamed request that is running (first token received) inside the block and
    closed by the client when the block ends."""
    with client.stream("POST", url + "/v1/completions", json=body(LONG_MAX_TOKENS, True)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        yield r


def exits_with(fleet: SimFleet, engine_id: str, code: int, timeout: float = 10.0) -> bool:
    process = fleet.engines[engine_id].process
    assert process is not None
    return wait_until(lambda: process.poll() is not None, timeout) and process.poll() == code


def whole_text(client: httpx.Client, url: str, request: dict[str, Any]) -> str:
    r = client.post(url + "/v1/completions", json=request)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def split_params(client: httpx.Client, prefill_url: str, request: dict[str, Any]) -> Any:
    r = client.post(prefill_url + "/v1/completions", json=prefill_leg_body(request, False))
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return params


# --- fail_next -------------------------------------------------------------------------------


def test_fail_next_via_admin(fleet: SimFleet) -> None:
    url, _ = urls(fleet)
    r = admin(url, "POST", {"fail_next": 2, "fail_status": 502})
    assert r.status_code == 200 and r.json()["fail_next"] == 2
    with httpx.Client(timeout=30) as client:
        first = client.post(url + "/v1/completions", json=body())
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        second = client.post(url + "/v1/chat/completions", json=chat)
        third = client.post(url + "/v1/completions", json=body())
    assert_openai_error(first, 502, "injected failure")
    assert_openai_error(second, 502, "injected failure")
    assert third.status_code == 200, third.text
    assert third.json()["usage"]["completion_tokens"] == 8
    faults = admin(url, "GET").json()
    assert faults["fail_next"] == 0 and faults["fail_status"] == 502


@pytest.fixture(scope="module")
def tokenless_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    """Engines started without --admin-token, with faults set by CLI flags only."""
    directory = tmp_path_factory.mktemp("tokenless")
    fleet = SimFleet(
        write_fleet(directory, 2, sim=SIM),
        admin_token=None,
        log_dir=directory / "logs",
        engine_args={
            "e0": ["--fault-fail-next", "2"],
            "e1": ["--fault-metrics", "stop"],
        },
    )
    try:
        fleet.start(timeout=60)
        yield fleet
    finally:
        fleet.stop()


def test_fail_next_via_cli_flag(tokenless_fleet: SimFleet) -> None:
    url = tokenless_fleet.engines["e0"].url
    with httpx.Client(timeout=30) as client:
        results = [client.post(url + "/v1/completions", json=body()) for _ in range(3)]
    assert_openai_error(results[0], 503, "injected failure")
    assert_openai_error(results[1], 503, "injected failure")
    assert results[2].status_code == 200, results[2].text


def test_metrics_stop_via_cli_flag(tokenless_fleet: SimFleet) -> None:
    url = tokenless_fleet.engines["e1"].url
    assert_openai_error(httpx.get(url + "/metrics", timeout=10), 503, "metrics unavailable")
    assert httpx.get(url + "/health", timeout=10).status_code == 200


# --- crashes ---------------------------------------------------------------------------------


def test_crash_now(tmp_path: Path) -> None:
    with running_fleet(tmp_path, 2, sim=SIM) as fleet:
        url, _ = urls(fleet)
        with contextlib.suppress(httpx.TransportError):
            admin(url, "POST", {"crash_now": True})
        assert exits_with(fleet, "e0", CRASH)
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=5)
        assert fleet.engines["e1"].alive


@pytest.mark.parametrize("via", ["admin", "cli"])
def test_crash_on_prefill(tmp_path: Path, via: str) -> None:
    engine_args = {"e0": ["--fault-crash-on-prefill"]} if via == "cli" else None
    with running_fleet(tmp_path, 2, sim=SIM, engine_args=engine_args) as fleet:
        url, _ = urls(fleet)
        if via == "admin":
            assert admin(url, "POST", {"crash_on_prefill": True}).status_code == 200
        assert admin(url, "GET").json()["crash_on_prefill"] is True
        # Requests that never reach a prefill step do not trigger it.
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.post(url + "/v1/completions", json=body(), timeout=30)
        assert exits_with(fleet, "e0", CRASH)
        assert fleet.engines["e1"].alive


def test_crash_on_kv_read(tmp_path: Path) -> None:
    with running_fleet(tmp_path, 2, sim=SIM) as fleet:
        prefill_url, decode_url = urls(fleet)
        assert admin(decode_url, "POST", {"crash_on_kv_read": True}).status_code == 200
        request = body()
        with httpx.Client(timeout=30) as client:
            # A request the decode engine prefills itself reads no KV: no crash.
            whole_text(client, decode_url, request)
            params = split_params(client, prefill_url, request)
            with pytest.raises(httpx.TransportError):
                client.post(
                    decode_url + "/v1/completions", json={**request, "kv_transfer_params": params}
                )
        assert exits_with(fleet, "e1", CRASH)
        assert fleet.engines["e0"].alive


def test_crash_after_tokens(tmp_path: Path) -> None:
    n = 5
    with running_fleet(tmp_path, 2, sim=SIM) as fleet:
        url, _ = urls(fleet)
        assert admin(url, "POST", {"crash_after_tokens": n}).status_code == 200
        with httpx.Client(timeout=30) as client:
            pieces, done, error = read_stream(client, url, body(50, stream=True))
        assert len(pieces) == n
        assert not done
        assert error is not None
        assert exits_with(fleet, "e0", CRASH)


# --- KV read hang ----------------------------------------------------------------------------


def test_kv_read_hang_past_the_timeout_fails_the_decode_leg(fleet: SimFleet) -> None:
    prefill_url, decode_url = urls(fleet)
    request = body()
    with httpx.Client(timeout=30) as client:
        before = client.get(decode_url + "/metrics").text
        assert admin(decode_url, "POST", {"hang_kv_read_s": KV_READ_TIMEOUT_S + 1}).is_success
        params = split_params(client, prefill_url, request)
        t0 = time.monotonic()
        r = client.post(
            decode_url + "/v1/completions", json={**request, "kv_transfer_params": params}
        )
        elapsed = time.monotonic() - t0
        after = client.get(decode_url + "/metrics").text
    assert_openai_error(r, 500, "KV transfer failed")
    assert KV_READ_TIMEOUT_S <= elapsed < KV_READ_TIMEOUT_S + 5
    assert metric(after, FAILED) - metric(before, FAILED) == 1


def test_short_kv_read_hang_only_delays(fleet: SimFleet) -> None:
    prefill_url, decode_url = urls(fleet)
    request = body()
    hang = 0.5
    with httpx.Client(timeout=30) as client:
        whole = whole_text(client, decode_url, request)
        before = client.get(decode_url + "/metrics").text
        assert admin(decode_url, "POST", {"hang_kv_read_s": hang}).is_success
        params = split_params(client, prefill_url, request)
        t0 = time.monotonic()
        r = client.post(
            decode_url + "/v1/completions", json={**request, "kv_transfer_params": params}
        )
        elapsed = time.monotonic() - t0
        after = client.get(decode_url + "/metrics").text
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == whole
    assert hang <= elapsed < KV_READ_TIMEOUT_S
    assert metric(after, FAILED) == metric(before, FAILED)
    count = "vllm:nixl_bytes_transferred_count"
    assert metric(after, count) - metric(before, count) == 1


# --- latency faults --------------------------------------------------------------------------


def test_stall_first_token(fleet: SimFleet) -> None:
    _, url = urls(fleet)
    stall = 1.0
    request = body(4, stream=True)
    with httpx.Client(timeout=30) as client:
        assert admin(url, "POST", {"stall_first_token_s": stall}).is_success
        stalled = ttft(client, url, request)
        assert admin(url, "DELETE").is_success
        fast = min(ttft(client, url, request) for _ in range(3))  # best of 3: robust to load
    assert stalled >= stall
    assert fast * 4 < stalled


def test_slowdown(fleet: SimFleet) -> None:
    _, url = urls(fleet)
    request = body(10)
    with httpx.Client(timeout=60) as client:
        normal_text = whole_text(client, url, request)  # also warms the connection
        normal = float("inf")
        for _ in range(3):  # best of 3: robust to load
            t0 = time.monotonic()
            assert whole_text(client, url, request) == normal_text
            normal = min(normal, time.monotonic() - t0)
        assert admin(url, "POST", {"slowdown": 20}).is_success
        t0 = time.monotonic()
        slow_text = whole_text(client, url, request)
        slow = time.monotonic() - t0
    assert slow_text == normal_text  # slower, not different
    # At least nine decode steps of 0.24 model seconds, each 20 times slower.
    assert slow >= 9 * 0.24 * 20 / TEST_TIME_SCALE
    assert slow / normal > 4


# --- dropped streams -------------------------------------------------------------------------


def test_drop_stream_after_tokens(fleet: SimFleet) -> None:
    _, url = urls(fleet)
    with httpx.Client(timeout=30) as client:
        # After 0 tokens: a stream cut before its first (it sent one, a QA pass found).
        for n in (3, 0):
            assert admin(url, "POST", {"drop_stream_after_tokens": n}).is_success
            pieces, done, error = read_stream(client, url, body(50, stream=True))
            assert len(pieces) == n
            assert not done
            assert isinstance(error, httpx.RemoteProtocolError)
        assert fleet.engines["e1"].alive
        # Only streams drop: with the fault still set a whole response comes back...
        assert len(whole_text(client, url, body(6)).split()) == 6
        assert admin(url, "DELETE").is_success
        # ...and without it streams finish again.
        pieces, done, error = read_stream(client, url, body(6, stream=True))
    assert error is None and done and len(pieces) == 6


# --- /metrics faults -------------------------------------------------------------------------


def test_metrics_lie_and_stop(fleet: SimFleet) -> None:
    _, url = urls(fleet)
    running = "vllm:num_requests_running"
    with httpx.Client(timeout=30) as client, long_stream(client, url):
        honest = client.get(url + "/metrics")
        assert honest.status_code == 200
        assert metric(honest.text, running) == 1
        assert metric(honest.text, "vllm:kv_cache_usage_perc") > 0
        assert admin(url, "POST", {"metrics": "lie"}).is_success
        lie = client.get(url + "/metrics")
        assert lie.status_code == 200
        assert metric(lie.text, running) == 0
        assert metric(lie.text, "vllm:num_requests_waiting") == 0
        assert metric(lie.text, "vllm:kv_cache_usage_perc") == 0
        # The rest of the exposition is untouched, and the request really is running.
        assert metric(lie.text, "vllm:generation_tokens_total") > 0
        assert state(url)["running"] == 1
        assert admin(url, "POST", {"metrics": "stop"}).is_success
        assert_openai_error(client.get(url + "/metrics"), 503, "metrics unavailable")
        assert admin(url, "POST", {"metrics": "ok"}).is_success
        assert metric(client.get(url + "/metrics").text, running) == 1


def test_metrics_hang(tmp_path: Path) -> None:
    # Own fleet: the hung handler never returns, and would hold up a graceful shutdown.
    with running_fleet(tmp_path, 2, sim=SIM) as fleet:
        url, _ = urls(fleet)
        assert admin(url, "POST", {"metrics": "hang"}).is_success
        t0 = time.monotonic()
        with pytest.raises(httpx.TimeoutException):
            httpx.get(url + "/metrics", timeout=1.0)
        assert time.monotonic() - t0 < 5
        # Only /metrics hangs: the engine still serves.
        r = httpx.post(url + "/v1/completions", json=body(), timeout=30)
        assert r.status_code == 200
        assert admin(url, "POST", {"metrics": "ok"}).is_success
        assert httpx.get(url + "/metrics", timeout=5).status_code == 200
        fleet.kill("e0")


# --- admin endpoint security -----------------------------------------------------------------


def test_admin_needs_the_token(fleet: SimFleet) -> None:
    url, _ = urls(fleet)
    wrong = {"Authorization": "Bearer not-the-token"}
    bare = {"Authorization": ADMIN_TOKEN}  # right token, wrong scheme
    for method, path, payload in [
        ("GET", "/sim/faults", None),
        ("POST", "/sim/faults", {"fail_next": 5}),
        ("DELETE", "/sim/faults", None),
        ("GET", "/sim/state", None),
    ]:
        for headers in ({}, wrong, bare):
            r = httpx.request(method, url + path, json=payload, headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == 401
    assert admin(url, "GET").json()["fail_next"] == 0  # the unauthorised POST changed nothing
    r = admin(url, "POST", {"no_such_fault": 1})
    assert r.status_code == 400


def test_admin_disabled_without_token(tokenless_fleet: SimFleet) -> None:
    url = tokenless_fleet.engines["e1"].url
    for method, path in [
        ("GET", "/sim/faults"),
        ("POST", "/sim/faults"),
        ("DELETE", "/sim/faults"),
        ("GET", "/sim/state"),
    ]:
        for headers in ({}, {"Authorization": f"Bearer {ADMIN_TOKEN}"}):
            r = httpx.request(method, url + path, json={}, headers=headers, timeout=10)
            assert r.status_code == 403, (method, path, r.text)
            assert "--admin-token" in r.json()["error"]["message"]
    with contextlib.suppress(httpx.TransportError):
        httpx.post(url + "/sim/faults", json={"crash_now": True}, timeout=10)
    assert tokenless_fleet.engines["e1"].alive


# --- client disconnects ----------------------------------------------------------------------


def test_client_closing_a_stream_aborts_it(fleet: SimFleet) -> None:
    _, url = urls(fleet)
    with httpx.Client(timeout=30) as client:
        before = client.get(url + "/metrics").text
        with long_stream(client, url):
            s = state(url)
            assert s["running"] == 1 and s["free_blocks"] < s["num_blocks"]
        assert wait_until(lambda: is_idle(url), 5)
        s = state(url)
        assert s["free_blocks"] == s["num_blocks"]
        after = client.get(url + "/metrics").text
    aborted = metric(after, ABORTED, finished_reason="abort") - metric(
        before, ABORTED, finished_reason="abort"
    )
    assert aborted == 1
    # The engine stopped generating for it: far fewer tokens than asked for.
    generated = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total"
    )
    assert generated < LONG_MAX_TOKENS / 2


def test_client_timing_out_while_queued_aborts_it(fleet: SimFleet) -> None:
    _, url = urls(fleet)  # e1 runs one sequence at a time
    outcome: dict[str, Any] = {}

    def queued() -> None:
        try:
            outcome["response"] = httpx.post(url + "/v1/completions", json=body(), timeout=1.5)
        except httpx.TimeoutException as exc:
            outcome["error"] = exc

    with httpx.Client(timeout=30) as client:
        before = client.get(url + "/metrics").text
        with long_stream(client, url):
            thread = threading.Thread(target=queued, daemon=True)
            thread.start()
            assert wait_until(lambda: state(url)["waiting"] == 1, 5), "never queued"
            thread.join(10)
            assert not thread.is_alive()
            assert isinstance(outcome.get("error"), httpx.TimeoutException), outcome
            # Aborted while the long request still runs: it left the queue, not ran later.
            assert wait_until(lambda: state(url)["waiting"] == 0, 5)
            s = state(url)
            assert s["running"] == 1
            mid = client.get(url + "/metrics").text
        assert wait_until(lambda: is_idle(url), 5)
        s = state(url)
        assert s["free_blocks"] == s["num_blocks"]
        after = client.get(url + "/metrics").text
    aborts = [metric(t, ABORTED, finished_reason="abort") for t in (before, mid, after)]
    assert aborts[1] - aborts[0] == 1  # the queued one
    assert aborts[2] - aborts[0] == 2  # and then the stream
    assert metric(mid, "vllm:num_requests_waiting") == 0


def test_client_timing_out_while_queued_behind_kv_holds_aborts_it(tmp_path: Path) -> None:
    # e0 has room for one prompt's blocks: an unpulled prefill hold fills it and the next
    # request queues with nothing running, so only the abort itself can take it off the queue.
    sims = [{**SIM, "num_blocks": 8}, SIM]
    with running_fleet(tmp_path, 2, sim=sims) as fleet:
        url, _ = urls(fleet)
        with httpx.Client(timeout=30) as client:
            params = split_params(client, url, body())
            assert state(url)["free_blocks"] == 8 - len(params["remote_block_ids"][0])
            t0 = time.monotonic()
            with pytest.raises(httpx.TimeoutException):
                # Salted: the same prompt unsalted would share the held blocks (a prefix hit).
                client.post(url + "/v1/completions", json=body(cache_salt="x"), timeout=1.0)
            assert time.monotonic() - t0 < 5
            assert wait_until(lambda: state(url)["waiting"] == 0, 5), state(url)
            metrics = client.get(url + "/metrics").text
        s = state(url)
    assert s["running"] == 0 and s["holds"] == [params["remote_request_id"]]
    assert metric(metrics, "vllm:num_requests_waiting") == 0
    assert metric(metrics, ABORTED, finished_reason="abort") == 1
