"""narwhal-serve's failure paths, each on a live simulated fleet with fault injection: the
client-visible result, the journal record and the metrics."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import (
    ADMIN_TOKEN,
    MODEL,
    TIMER_SLACK_S,
    RouterProcess,
    admin,
    metric,
    raw_completion,
    running_fleet,
    running_router,
    start_router,
    stop_router,
)

PROMPT = [300 + (i * 7) % 9000 for i in range(120)]
ROUTER_ARGS = ("--breaker-open-seconds", "0.3", "--health-interval", "0.2")


# Both relays (events pushed from the engine connection, or pulled by a task per stream) take
# every failure path.
@pytest.fixture(scope="module", params=["push", "asgi"])
def stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[SimFleet, RouterProcess]]:
    directory = tmp_path_factory.mktemp("router-failures")
    with (
        running_fleet(directory, 4, first_token_timeout_s=1.0) as fleet,
        running_router(
            directory, fleet.fleet_path, *ROUTER_ARGS, "--relay", request.param
        ) as router,
    ):
        yield fleet, router


@pytest.fixture(autouse=True)
def clear_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        fleet, router = request.getfixturevalue("stack")
        for engine in fleet.engines.values():
            if engine.alive:
                admin(engine.url, "DELETE")

        def breakers_closed() -> bool:
            return all(e["breaker"] == "closed" for e in router.admin_state()["engines"])

        # Closed breakers for the next test: a probe or a success closes a half-open one.
        if not wait_until(breakers_closed, 5):
            for _ in range(4):
                post(router, max_tokens=1)
            assert wait_until(breakers_closed, 5)


def post(
    router: RouterProcess, stream: bool = False, timeout: float = 30, **body: Any
) -> httpx.Response:
    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **body}
    if stream:
        payload["stream"] = True
    return httpx.post(router.url + "/v1/completions", json=payload, timeout=timeout)


def end_of(router: RouterProcess, response: httpx.Response) -> dict[str, Any]:
    rid = response.headers["x-request-id"]
    assert wait_until(lambda: rid in router.ends(), 5)
    return router.ends()[rid]


def sse(response: httpx.Response) -> list[Any]:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_prefill_5xx_retries_on_another_prefill_engine(stack) -> None:
    fleet, router = stack
    admin(fleet.engines["e0"].url, "POST", {"fail_next": 10})
    before = router.metrics()
    retried = None
    for _ in range(6):
        r = post(router)
        assert r.status_code == 200, r.text
        end = end_of(router, r)
        assert end["outcome"] == "ok"
        if any(a["leg"] == "prefill" and a["outcome"] == "failed" for a in end["attempts"]):
            retried = end
            break
    assert retried is not None, "no request was sent to the failing prefill engine"
    assert [a["engine"] for a in retried["attempts"] if a["leg"] == "prefill"] == ["e0", "e1"]
    assert retried["prefill_engine"] == "e1"
    after = router.metrics()
    assert (
        metric(after, "narwhal_retries_total", leg="prefill")
        - metric(before, "narwhal_retries_total", leg="prefill")
        >= 1
    )
    assert metric(after, "narwhal_leg_failures_total", engine="e0", leg="prefill") > metric(
        before, "narwhal_leg_failures_total", engine="e0", leg="prefill"
    )


def test_prefill_failing_everywhere_is_a_clear_502(stack) -> None:
    fleet, router = stack
    for engine in ("e0", "e1"):
        admin(fleet.engines[engine].url, "POST", {"fail_next": 2})
    before = router.metrics()
    r = post(router)
    assert r.status_code == 502
    assert r.json()["error"]["type"] == "upstream_error"
    assert "prefill failed" in r.json()["error"]["message"]
    end = end_of(router, r)
    assert end["outcome"] == "prefill_failed" and end["status"] == 502
    assert (
        metric(router.metrics(), "narwhal_requests_total", outcome="prefill_failed")
        == metric(before, "narwhal_requests_total", outcome="prefill_failed") + 1
    )


def test_decode_failure_before_first_token_retries_with_a_fresh_prefill(stack) -> None:
    fleet, router = stack
    admin(fleet.engines["e2"].url, "POST", {"fail_next": 10})
    before = router.metrics()
    retried = None
    for _ in range(6):
        r = post(router, max_tokens=5)
        assert r.status_code == 200, r.text
        end = end_of(router, r)
        if any(a["leg"] == "decode" and a["outcome"] == "failed" for a in end["attempts"]):
            retried = end
            break
    assert retried is not None
    legs = [(a["leg"], a["engine"], a["outcome"]) for a in retried["attempts"]]
    assert ("decode", "e2", "failed") in legs and ("decode", "e3", "first_token") in legs
    assert sum(1 for leg in legs if leg[0] == "prefill" and leg[2] == "ok") == 2  # fresh prefill
    assert any(a["outcome"] == "stranded" for a in retried["attempts"])
    assert retried["decode_engine"] == "e3" and retried["completion_tokens"] == 5
    after = router.metrics()
    assert metric(after, "narwhal_stranded_handoffs_total", reason="decode_failed") > metric(
        before, "narwhal_stranded_handoffs_total", reason="decode_failed"
    )
    assert metric(after, "narwhal_retries_total", leg="decode") > metric(
        before, "narwhal_retries_total", leg="decode"
    )


def holds(fleet: SimFleet, request_id: str) -> list[str]:
    """The KV holds of ``request_id`` on every engine (those of earlier tests' stranded
    handoffs wait out their lease)."""
    return [
        hold
        for engine in fleet.engines.values()
        if engine.alive
        for hold in admin(engine.url, "GET", path="/sim/state").json()["holds"]
        if hold.startswith(request_id)
    ]


def test_a_decode_leg_the_engine_refuses_releases_the_prefilled_kv(stack) -> None:
    # top_logprobs past the engine's max_logprobs is refused by the decode engine only (the
    # prefill leg does not carry it): the KV the prefill handed out is pulled by a release leg
    # at once, not held until its lease (30 s).
    fleet, router = stack
    before = router.metrics()
    r = post(router, logprobs=50)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "greater than max allowed" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "logprobs"
    end = end_of(router, r)
    assert end["outcome"] == "client_error" and end["status"] == 400
    prefill, decode = end["prefill_engine"], end["decode_engine"]
    legs = [(a["leg"], a["engine"], a["outcome"]) for a in end["attempts"]]
    assert ("handoff", prefill, "released") in legs, legs
    assert not any(a["outcome"] == "stranded" for a in end["attempts"])
    released = next(a for a in end["attempts"] if a["outcome"] == "released")
    assert released["via"] == decode
    assert wait_until(lambda: not holds(fleet, end["id"]), 5), "the prefill engine still holds it"
    after = router.metrics()
    assert metric(after, "narwhal_kv_released_total", engine=prefill) == (
        metric(before, "narwhal_kv_released_total", engine=prefill) + 1
    )
    assert metric(after, "narwhal_stranded_handoffs_total") == metric(
        before, "narwhal_stranded_handoffs_total"
    )
    # vLLM refuses it in the decode leg's stream (a 200 whose only event is the 400): the
    # client's error, not a failing decode engine. More of them than the breaker's threshold
    # (3) open no breaker, and the next request is answered.
    for _ in range(4):
        assert post(router, logprobs=50).status_code == 400
    after = router.metrics()
    for engine in ("e2", "e3"):
        assert metric(after, "narwhal_leg_failures_total", engine=engine, leg="decode") == (
            metric(before, "narwhal_leg_failures_total", engine=engine, leg="decode")
        )
    assert all(e["breaker"] == "closed" for e in router.admin_state()["engines"])
    assert post(router).status_code == 200


def test_every_choice_of_a_refused_request_releases_its_kv(stack) -> None:
    # n = 3: three prefills, three refused decode legs. The first refusal ends the request and
    # cancels the other choices; their release legs run on to their end all the same. The
    # decode engines' READs take 0.3 s, so that every choice has reached its release before
    # the first one ends (the choices reach theirs within milliseconds of each other), and
    # each release leg still has 0.7 s of its 1 s deadline for a loaded host's overhead.
    fleet, router = stack
    for engine in ("e2", "e3"):
        admin(fleet.engines[engine].url, "POST", {"hang_kv_read_s": 0.3})
    before = router.metrics()
    r = post(router, logprobs=50, n=3, temperature=1.0)
    assert r.status_code == 400, r.text
    end = end_of(router, r)
    handoffs = [a["outcome"] for a in end["attempts"] if a["leg"] == "handoff"]
    assert len(handoffs) == 3 and set(handoffs) <= {"released", "releasing"}, end["attempts"]

    def released() -> float:
        return metric(router.metrics(), "narwhal_kv_released_total") - metric(
            before, "narwhal_kv_released_total"
        )

    assert wait_until(lambda: released() == 3, 10), released()
    assert metric(router.metrics(), "narwhal_stranded_handoffs_total") == metric(
        before, "narwhal_stranded_handoffs_total"
    )
    assert wait_until(lambda: not holds(fleet, end["id"]), 5), holds(fleet, end["id"])


def test_a_release_leg_that_cannot_pull_leaves_the_kv_stranded_as_refused(stack) -> None:
    fleet, router = stack
    for engine in ("e2", "e3"):  # the release leg's READ stalls past the 1 s deadline
        admin(fleet.engines[engine].url, "POST", {"hang_kv_read_s": 3.0})
    before = router.metrics()
    r = post(router, logprobs=50)
    assert r.status_code == 400, r.text
    end = end_of(router, r)
    assert end["outcome"] == "client_error"
    prefill = end["prefill_engine"]
    stranded = [a for a in end["attempts"] if a["outcome"] == "stranded"]
    assert len(stranded) == 1 and stranded[0]["reason"] == "decode_refused"
    assert stranded[0]["engine"] == prefill
    assert not any(a["outcome"] == "released" for a in end["attempts"])
    after = router.metrics()
    assert metric(
        after, "narwhal_stranded_handoffs_total", engine=prefill, reason="decode_refused"
    ) == (
        metric(before, "narwhal_stranded_handoffs_total", engine=prefill, reason="decode_refused")
        + 1
    )

    # The abandoned release leg's READ ends on its own: the next test starts from an idle fleet
    # as the router sees it (a decode engine still busy with it would not be picked).
    def router_sees_idle() -> bool:
        return all(
            not e["scraped"]["running"]
            and not e["scraped"]["waiting"]
            and e["in_flight"] == {"prefill": 0, "decode": 0}
            for e in router.admin_state()["engines"]
        )

    assert wait_until(router_sees_idle, 10)


def test_first_token_deadline_aborts_and_retries_elsewhere(stack) -> None:
    fleet, router = stack
    admin(fleet.engines["e2"].url, "POST", {"stall_first_token_s": 3.0})
    before = router.metrics()
    retried = None
    for _ in range(6):
        r = post(router, stream=True)
        assert r.status_code == 200, r.text
        end = end_of(router, r)
        if any(a["outcome"] == "deadline_exceeded" for a in end["attempts"]):
            retried = end
            break
    assert retried is not None
    assert retried["outcome"] == "ok" and retried["decode_engine"] == "e3"
    deadline = next(a for a in retried["attempts"] if a["outcome"] == "deadline_exceeded")
    assert deadline["engine"] == "e2" and deadline["after_s"] >= 1.0 - TIMER_SLACK_S
    # The stalled leg was abandoned at its deadline, not waited out: the router's own clock
    # (the leg's time since its start) is below the 3 s first-token stall. The client's wall
    # clock would add the retry's fresh prefill and decode, whatever a loaded host makes them.
    assert deadline["after_s"] < 3.0, deadline
    after = router.metrics()
    missed = metric(after, "narwhal_first_token_deadline_exceeded_total", engine="e2") - metric(
        before, "narwhal_first_token_deadline_exceeded_total", engine="e2"
    )
    assert missed >= 1

    def waits(sample: str, engine: str) -> float:
        return metric(sample, "narwhal_first_token_waits_total", engine=engine)

    # Every e2 leg of these requests missed: the share the alert reads is 100%, and the leg
    # retried on e3 ended its wait in time.
    assert waits(after, "e2") - waits(before, "e2") == missed
    assert waits(after, "e3") - waits(before, "e3") >= 1
    # The aborted decode leg was closed: the stalled engine is not left streaming.
    assert wait_until(
        lambda: admin(fleet.engines["e2"].url, "GET", path="/sim/state").json()["running"] == 0, 5
    )


def test_deadline_everywhere_is_a_504(stack) -> None:
    fleet, router = stack
    for engine in ("e2", "e3"):
        admin(fleet.engines[engine].url, "POST", {"stall_first_token_s": 3.0})
    r = post(router, stream=True)
    assert r.status_code == 504
    body = r.json()
    assert body["error"]["code"] == "first_token_deadline_exceeded"
    end = end_of(router, r)
    assert end["outcome"] == "deadline_exceeded" and end["status"] == 504
    missed = [a["engine"] for a in end["attempts"] if a["outcome"] == "deadline_exceeded"]
    assert sorted(missed) == ["e2", "e3"]
    # Both legs missed: the message says so and names the last (it named one engine only).
    assert (
        f"on any pair tried (2 legs, the last decode on {missed[-1]}: " in body["error"]["message"]
    ), body


def test_failure_after_first_token_ends_stream_with_error_event(stack) -> None:
    fleet, router = stack
    # Every engine breaks its streams after 2 tokens: each break is continued on another pair
    # (routing.migration) until the request's migration limit (2), then the client gets an
    # error event, never a silent truncation.
    for engine in fleet.engines.values():
        admin(engine.url, "POST", {"drop_stream_after_tokens": 2})
    r = post(router, stream=True, max_tokens=10)
    assert r.status_code == 200
    events = sse(r)
    assert events[-1] == "[DONE]"
    assert "error" in events[-2]
    tokens = [e for e in events[:-2] if isinstance(e, dict) and e.get("choices")]
    assert len(tokens) == 6
    end = end_of(router, r)
    assert end["outcome"] == "stream_error" and end["migrations"] == 2
    # Non-streamed: the client never sees a truncated completion as if it were whole.
    r = post(router, max_tokens=10)
    assert r.status_code == 502
    assert end_of(router, r)["outcome"] == "stream_error"


def test_client_disconnect_mid_stream_closes_the_decode_leg(stack) -> None:
    fleet, router = stack
    with httpx.stream(
        "POST",
        router.url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "stream": True},
    ) as r:
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    assert wait_until(lambda: rid in router.ends(), 5)
    end = router.ends()[rid]
    # The client had its 200 and the start of its answer: the record says so.
    assert end["outcome"] == "client_abort" and end["status"] == 200
    # No usage came; the tokens relayed before it left are counted by their ids.
    assert isinstance(end["completion_tokens"], int) and 1 <= end["completion_tokens"] < 2000
    for engine in ("e2", "e3"):
        url = fleet.engines[engine].url
        assert wait_until(
            lambda u=url: admin(u, "GET", path="/sim/state").json()["running"] == 0, 5
        )


def test_client_disconnect_during_prefill_closes_the_prefill_leg(stack) -> None:
    fleet, router = stack
    for engine in ("e0", "e1"):
        admin(fleet.engines[engine].url, "POST", {"slowdown": 5000.0})
    # Hang up once the router has the prefill leg in flight, not on a client timer (on a busy
    # host a timer can fire before the leg was sent). The record is found by the client's
    # X-Request-Id: an earlier test's request may be journaled late.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    with raw_completion(router, body, "disconnect-in-prefill") as client_id:
        assert wait_until(
            lambda: any(e["in_flight"]["prefill"] for e in router.admin_state()["engines"]),
            5,
            interval=0.01,
        )

    def aborted() -> dict[str, Any] | None:
        return next(
            (e for e in router.ends().values() if e["client_request_id"] == client_id), None
        )

    assert wait_until(lambda: aborted() is not None, 5)
    end = aborted()
    assert end is not None
    assert end["outcome"] == "client_abort" and end["status"] is None
    # The prefill leg the client left is in the journal as tried.
    assert [(a["leg"], a["outcome"]) for a in end["attempts"]] == [("prefill", "cancelled")]
    for engine in ("e0", "e1"):
        url = fleet.engines[engine].url
        assert wait_until(
            lambda u=url: admin(u, "GET", path="/sim/state").json()["running"] == 0, 5
        )


def test_http_oddities_are_refused_alike_on_every_route(stack, tmp_path: Path) -> None:
    """Found by a probe of the router's HTTP surface: a stray slash was a 307 to the client's
    Host header; the admin routes read bodies past --max-body-bytes whole; the generation
    routes took the last of two Authorization headers and the others the first; a pin that
    changed nothing was journaled."""
    fleet, _ = stack
    keys = tmp_path / "keys"
    keys.write_text("sk-good\n")
    router = start_router(
        tmp_path,
        fleet.fleet_path,
        "--api-keys-file",
        str(keys),
        "--max-body-bytes",
        "2000",
        "--body-timeout",
        "1",
    )
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        good = {"Authorization": "Bearer sk-good"}
        slash = httpx.post(
            router.url + "/v1/completions/",
            json=body,
            headers={**good, "Host": "evil.example.com"},
            timeout=30,
        )
        assert slash.status_code == 404 and "location" not in slash.headers
        assert slash.json()["error"]["type"] == "invalid_request_error"
        token = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        big = httpx.post(
            router.url + "/admin/roles/flip",
            content=b'{"engine": "e0", "to": "decode", "pad": "' + b"x" * 5000 + b'"}',
            headers=token,
            timeout=30,
        )
        assert big.status_code == 413, big.text
        assert big.json()["error"]["type"] == "invalid_request_error"
        for first, second, status in (("sk-good", "bad", 200), ("bad", "sk-good", 401)):
            headers = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")]
            for method, path, json_body in (
                ("POST", "/v1/completions", body),
                ("GET", "/v1/models", None),
            ):
                answer = httpx.request(
                    method, router.url + path, json=json_body, headers=headers, timeout=30
                )
                assert answer.status_code == status, (path, first, answer.text)
        for _ in range(2):
            pinned = httpx.post(
                router.url + "/admin/roles/pin", json={"pinned": True}, headers=token, timeout=10
            )
            assert pinned.status_code == 200 and pinned.json() == {"pinned": True}

        def pins() -> int:
            return sum(r["type"] == "role.pin" for r in router.records())

        # The journal is written behind the answer (a thread, in order): the first pin's
        # record lands a moment later; a record of the second would follow it (checked below,
        # once a later request's record is in).
        assert wait_until(lambda: pins() >= 1, 5)
        # A body that stops arriving: a 408 after --body-timeout and the connection closed (a
        # stalled client held its request slot, and any drain, for as long as it liked).
        host, port = router.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=15) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-good\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
            )
            answer = b""
            while chunk := conn.recv(65536):  # until the router closes the connection
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        assert json.loads(payload)["error"]["type"] == "invalid_request_error"

        def stalled() -> list[dict]:
            return [
                e
                for e in router.ends().values()
                if e["status"] == 408 and e["outcome"] == "client_error"
            ]

        # The journal is written behind the answer: its record may land a moment later.
        assert wait_until(lambda: len(stalled()) >= 1, 10)
        assert len(stalled()) == 1
        # Journaled in order: any record of the second (unchanged) pin precedes this one.
        assert pins() == 1
    finally:
        stop_router(router)


def test_a_client_hanging_up_mid_body_on_the_other_routes_leaves_no_traceback(stack) -> None:
    """/tokenize and the admin routes read their bodies through the framework: a client that
    hung up while its body arrived raised Starlette's ClientDisconnect out of the route (a
    traceback in the router's log for every such client)."""
    _, router = stack
    host, port = router.url.removeprefix("http://").split(":")
    logged = router.log_path.stat().st_size
    for path, extra in (
        ("/tokenize", b""),
        ("/detokenize", b""),
        ("/admin/roles/pin", f"Authorization: Bearer {ADMIN_TOKEN}\r\n".encode()),
    ):
        with socket.create_connection((host, int(port)), timeout=15) as conn:
            conn.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode()
                + extra
                + b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
            )
            time.sleep(0.2)  # the route is reading the body
    # The router still answers, and said nothing of the three but, at most, a line each.
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200
    time.sleep(0.5)
    with router.log_path.open("rb") as log:
        log.seek(logged)
        tail = log.read().decode(errors="replace")
    assert "Traceback" not in tail and "ClientDisconnect" not in tail, tail


def test_the_context_is_applied_as_vllm_032_applies_it(stack) -> None:
    """A max_tokens past what the prompt leaves is cut to it, not refused (vLLM 0.32; the
    router refused such token-id prompts); a max_tokens past the context, or a prompt that
    leaves nothing, is refused before any engine."""
    _, router = stack
    context = 16384  # the test fleet's max_model_len
    long_prompt = [300 + i % 9000 for i in range(context - 4)]
    r = post(router, prompt=long_prompt, max_tokens=10, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = post(router, max_tokens=context + 1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "cannot be greater than max_model_len" in r.json()["error"]["message"]
    r = post(router, prompt=[300] * context, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "must be at least 1, got 0" in r.json()["error"]["message"]


def test_unknown_and_bad_requests_are_client_errors_without_5xx(stack) -> None:
    _, router = stack
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"model": 3, "prompt": "x"}).encode(), 400, "model"),
        (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"model": MODEL, "prompt": "x", "n": 65}).encode(), 400, "n"),
        (json.dumps({"model": MODEL, "prompt": "x", "best_of": 3}).encode(), 400, "best_of"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "prompt_logprobs": 2}).encode(),
            400,
            "prompt_logprobs",
        ),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
        (
            json.dumps(
                {"model": MODEL, "prompt": "x", "kv_transfer_params": {"remote_host": "10.0.0.1"}}
            ).encode(),
            400,
            "kv_transfer_params",
        ),
        (json.dumps({"model": MODEL, "prompt": "a" * (16384 * 17)}).encode(), 400, "input_tokens"),
        (json.dumps({"model": MODEL, "prompt": [1] * 20000}).encode(), 400, "input_tokens"),
        (
            # Options that say something (vLLM accepts empty ones on a request not streamed).
            json.dumps(
                {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}
            ).encode(),
            400,
            "stream_options",
        ),
        (json.dumps([1, 2]).encode(), 400, None),
    ]
    before = router.metrics()
    for raw, status, param in cases:
        r = httpx.post(
            router.url + "/v1/completions",
            content=raw,
            timeout=10,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == status, (raw[:80], r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param, (raw[:80], error)
        assert end_of(router, r)["outcome"] == "client_error"
    too_big = httpx.post(
        router.url + "/v1/completions", content=b"x" * (17 * 1024 * 1024), timeout=30
    )
    assert too_big.status_code == 413 and "error" in too_big.json()
    after = router.metrics()
    assert (
        metric(after, "narwhal_requests_total", outcome="client_error")
        - metric(before, "narwhal_requests_total", outcome="client_error")
        == len(cases) + 1
    )
    for outcome in ("internal_error",):
        assert metric(after, "narwhal_requests_total", outcome=outcome) == 0


def test_a_body_not_sent_as_json_is_refused_as_vllm_refuses_it(stack) -> None:
    """vLLM 0.32 answers 400 on its JSON routes to a request whose Content-Type is not
    application/json (parameters and case aside), or that has none (``curl -d`` sends a form
    type): so does the router, on every route it passes to the engines, journaled."""
    _, router = stack
    completion = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    bodies = {
        "/v1/completions": completion,
        "/v1/chat/completions": json.dumps(chat).encode(),
        "/v1/responses": json.dumps(
            {"model": MODEL, "input": "x", "max_output_tokens": 16}
        ).encode(),
        "/tokenize": json.dumps({"model": MODEL, "prompt": "x"}).encode(),
    }
    refused = [None, "", "text/plain", "application/x-www-form-urlencoded", "application/jsonx"]
    served = ["application/json", "application/json; charset=utf-8", "Application/JSON"]
    # The media type is checked before the body is read as JSON (vLLM's order).
    bodies_not_json = {path: b"{not json" for path in bodies}
    for path, raw in bodies_not_json.items():
        r = httpx.post(router.url + path, content=raw, headers={"Content-Type": "text/plain"})
        assert r.status_code == 400 and "Unsupported Media Type" in r.json()["error"]["message"]
    for path, raw in bodies.items():
        for content_type in refused + served:
            headers = {} if content_type is None else {"Content-Type": content_type}
            r = httpx.post(router.url + path, content=raw, headers=headers, timeout=30)
            if content_type in served:
                assert r.status_code == 200, (path, content_type, r.text)
                continue
            assert r.status_code == 400, (path, content_type, r.text)
            error = r.json()["error"]
            assert error["message"] == "Unsupported Media Type: Only 'application/json' is allowed"
            assert error["param"] is None
            if path != "/tokenize":  # not a generation: not journaled (docs/journal.md)
                assert end_of(router, r)["outcome"] == "client_error"


def test_dead_prefill_engine_fails_over_and_ready_tracks_pairs(tmp_path: Path) -> None:
    with (
        running_fleet(
            tmp_path, 3, initial_roles=["prefill", "prefill", "decode"], first_token_timeout_s=1.0
        ) as fleet,
        running_router(tmp_path, fleet.fleet_path, *ROUTER_ARGS) as router,
    ):
        fleet.kill("e0")
        for _ in range(4):
            r = post(router)
            assert r.status_code == 200, r.text

        def e0_healthy() -> bool:
            return next(e for e in router.admin_state()["engines"] if e["id"] == "e0")["healthy"]

        # The health probe (every 0.2 s), not the requests, marks it: wait for the probe.
        assert wait_until(lambda: e0_healthy() is False, 5)
        assert wait_until(
            lambda: metric(router.metrics(), "narwhal_engine_healthy", engine="e0") == 0, 5
        )
        fleet.kill("e2")
        assert wait_until(lambda: httpx.get(router.url + "/ready").status_code == 503, 5)
        assert "decode" in httpx.get(router.url + "/ready").json()["reason"]
        r = post(router)
        assert r.status_code in (502, 503)
        assert "error" in r.json()
        assert end_of(router, r)["outcome"] in ("unavailable", "decode_failed")


def test_fallback_fail_gives_504_without_retry(tmp_path: Path) -> None:
    with running_fleet(
        tmp_path,
        3,
        initial_roles=["prefill", "decode", "decode"],
        first_token_timeout_s=1.0,
        routing={"fallback": "fail"},
    ) as fleet:
        router = start_router(tmp_path, fleet.fleet_path, *ROUTER_ARGS)
        try:
            for engine in ("e1", "e2"):
                admin(fleet.engines[engine].url, "POST", {"stall_first_token_s": 3.0})
            r = post(router, stream=True)
            assert r.status_code == 504
            end = end_of(router, r)
            assert end["outcome"] == "deadline_exceeded"
            assert sum(1 for a in end["attempts"] if a["leg"] == "decode") == 1
        finally:
            stop_router(router)


def test_api_keys_and_sigterm_drain(tmp_path: Path) -> None:
    with running_fleet(tmp_path, 2) as fleet:
        keys = tmp_path / "keys"
        keys.write_text("sk-test-1\nsk-test-2\n")
        router = start_router(tmp_path, fleet.fleet_path, "--api-keys-file", str(keys))
        try:
            ok = httpx.post(
                router.url + "/v1/completions",
                timeout=30,
                headers={"Authorization": "Bearer sk-test-2"},
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
            )
            assert ok.status_code == 200
            bad = httpx.post(
                router.url + "/v1/completions",
                timeout=30,
                headers={"Authorization": "Bearer sk-wrong"},
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
            )
            assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
            assert end_of(router, bad)["outcome"] == "client_error"
            # A long stream in flight when SIGTERM arrives still completes. Long enough to
            # be in flight still when the signal comes: at the tests' time scale 150 tokens
            # took under a second, and on a loaded host the answer had ended (and the drained
            # router exited: its /ready refused) before the checks below.
            with httpx.stream(
                "POST",
                router.url + "/v1/completions",
                timeout=60,
                headers={"Authorization": "Bearer sk-test-1"},
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 600, "stream": True},
            ) as r:
                lines = iter(r.iter_lines())
                first = next(ln for ln in lines if ln.startswith("data: "))
                assert first
                router.process.send_signal(15)
                # While it drains the router still listens: not ready, and a new request is
                # a journaled 503 `draining`, not a refused connection.
                assert wait_until(
                    lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 503, 5
                )
                assert "draining" in httpx.get(router.url + "/ready", timeout=5).text
                refused = httpx.post(
                    router.url + "/v1/completions",
                    timeout=30,
                    headers={"Authorization": "Bearer sk-test-1"},
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                )
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["type"] == "service_unavailable"
                refused_id = refused.headers["x-request-id"]
                rest = [ln for ln in lines if ln.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert not any('"error"' in ln for ln in rest)
            assert router.process.wait(30) == 0
        finally:
            stop_router(router)
        records = router.records()
        assert records[-1]["type"] == "router.stop" and records[-1]["clean"] is True
        ends = [r for r in records if r["type"] == "request.end"]
        assert [e["outcome"] for e in ends] == ["ok", "client_error", "rejected", "ok"]
        assert ends[2]["id"] == refused_id and ends[2]["status"] == 503
        assert "sk-test" not in router.journal.read_text()


def test_a_drain_that_runs_out_ends_open_requests_with_openai_errors(tmp_path: Path) -> None:
    """Requests still open when --drain-timeout runs out end as router_shutdown, and their
    clients get an OpenAI error: a stream its error event and [DONE], a request not yet
    answered a 503 (not the server's plain-text 500 or a cut stream, nor a traceback)."""
    with running_fleet(tmp_path, 2) as fleet:
        for engine in fleet.engines.values():  # slow enough to outlast the drain
            admin(engine.url, "POST", {"slowdown": 10.0})
        router = start_router(tmp_path, fleet.fleet_path, "--drain-timeout", "1")
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400}
        try:
            with (
                httpx.Client(timeout=60) as client,
                client.stream(
                    "POST", router.url + "/v1/completions", json={**body, "stream": True}
                ) as streamed,
            ):
                pool = ThreadPoolExecutor(1)
                whole = pool.submit(client.post, router.url + "/v1/completions", json=body)
                lines = iter(streamed.iter_lines())
                assert next(ln for ln in lines if ln.startswith("data: "))
                assert wait_until(lambda: _open(router) == 2, 10)
                router.process.send_signal(15)
                rest = [ln for ln in lines if ln.startswith("data: ")]
                answer = whole.result(60)
                pool.shutdown()
            assert rest[-1] == "data: [DONE]", rest[-3:]
            error = json.loads(rest[-2].removeprefix("data: "))["error"]
            assert error["type"] == "service_unavailable" and "shut down" in error["message"]
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["type"] == "service_unavailable"
            assert router.process.wait(30) == 0
        finally:
            stop_router(router)
        ends = [r for r in router.records() if r["type"] == "request.end"]
        assert sorted(e["outcome"] for e in ends) == ["router_shutdown", "router_shutdown"]
        # Each with the status its client got: the stream its 200, the other the 503.
        assert sorted((e["stream"], e["status"]) for e in ends) == [(False, 503), (True, 200)]
        assert {e["error"] for e in ends} == {"the router shut down before the request completed"}
        # The 503 names its record, as every other answer does.
        assert answer.headers["x-request-id"] in {e["id"] for e in ends if not e["stream"]}
        log = router.log_path.read_text()
        assert "Exception in ASGI application" not in log and "Traceback" not in log, log


def test_a_second_signal_cuts_the_drain_short(tmp_path: Path) -> None:
    """SIGTERM starts a drain of up to --drain-timeout (60 s here); a second SIGTERM ends it:
    the open stream gets the shutdown's error event within seconds, not another 60."""
    with running_fleet(tmp_path, 2) as fleet:
        for engine in fleet.engines.values():  # slow enough to outlast the test
            admin(engine.url, "POST", {"slowdown": 10.0})
        router = start_router(tmp_path, fleet.fleet_path, "--drain-timeout", "60")
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True}
        try:
            with httpx.stream(
                "POST", router.url + "/v1/completions", json=body, timeout=60
            ) as streamed:
                lines = iter(streamed.iter_lines())
                assert next(ln for ln in lines if ln.startswith("data: "))
                router.process.send_signal(15)
                assert wait_until(
                    lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 503, 5
                )
                router.process.send_signal(15)
                rest = [ln for ln in lines if ln.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and "shut down" in rest[-2], rest[-2:]
            assert router.process.wait(20) == 0  # the second signal, not the 60 s timeout
        finally:
            stop_router(router)
        (end,) = [r for r in router.records() if r["type"] == "request.end"]
        assert (end["outcome"], end["status"]) == ("router_shutdown", 200)


def _open(router: RouterProcess) -> int:
    """Requests the router's journal has opened and not ended."""
    records = router.records()
    ended = {r["id"] for r in records if r["type"] == "request.end"}
    return sum(1 for r in records if r["type"] == "request.start" and r["id"] not in ended)


@pytest.mark.slow  # (the longest of the fast subset: make test runs it)
def test_one_health_probe_timeout_is_tolerated_two_in_a_row_mark_unhealthy(
    tmp_path: Path,
) -> None:
    """A loaded host stalls an engine's API server for seconds: one /health probe that times
    out leaves the engine in routing, and so do any number while it answers legs (busy, not
    hung); idle, the second in a row marks it unhealthy; the next answer brings it back. Each
    timeout is counted by reason."""
    with (
        running_fleet(tmp_path, 2, initial_roles=["prefill", "decode"]) as fleet,
        running_router(tmp_path, fleet.fleet_path, *ROUTER_ARGS) as router,
    ):
        e1 = fleet.engines["e1"].url

        def timeouts() -> float:
            return metric(
                router.metrics(),
                "narwhal_health_probe_failures_total",
                engine="e1",
                reason="timeout",
            )

        def healthy() -> float:
            return metric(router.metrics(), "narwhal_engine_healthy", engine="e1")

        assert wait_until(lambda: healthy() == 1, 10)
        admin(e1, "POST", {"hang_health_next": 1})
        # Sample health all along: a tolerated timeout must never show as unhealthy.
        seen: list[float] = []
        assert wait_until(lambda: seen.append(healthy()) or timeouts() == 1, 15)
        # The probe after the timeout answers: the streak is over.
        time.sleep(1.0)
        seen.append(healthy())
        assert set(seen) == {1}, seen
        assert timeouts() == 1
        assert post(router).status_code == 200

        # Busy, not hung: while e1 answers legs, timeouts in a row do not take it out.
        admin(e1, "POST", {"hang_health_next": 3})
        deadline = time.monotonic() + 20
        while timeouts() < 4 and time.monotonic() < deadline:
            assert post(router).status_code == 200
            seen.append(healthy())
        assert timeouts() == 4, "the hung probes did not time out"
        assert set(seen) == {1}, seen
        # Idle (nothing answered since the probe before): two timeouts in a row count.
        time.sleep(0.5)
        admin(e1, "POST", {"hang_health_next": 2})
        assert wait_until(lambda: healthy() == 0, 15), "two timeouts in a row did not count"
        assert timeouts() == 6
        assert wait_until(lambda: healthy() == 1, 10), "the engine did not come back"
        assert post(router).status_code == 200
        unreachable = metric(
            router.metrics(),
            "narwhal_health_probe_failures_total",
            engine="e1",
            reason="unreachable",
        )
        assert unreachable == 0
