"""Engine faults the client never sees (issue 23), on a live simulated fleet: a decode engine
killed, stopped (SIGSTOP) or answering an error mid-stream has its streams continued on the other
decode engine token for token; a hung prefill engine is hedged within the TTFT budget. Every
request ends with exactly one journal record, and the answers equal the unbroken ones (the
simulated engines generate autoregressively: a continuation of a prompt's output from its
token ids generates the rest of that output)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, RouterProcess, admin, metric, running_fleet, running_router

# Engines killed, stopped and restarted under live streams: about 90 s, run by make test.
pytestmark = pytest.mark.slow

PROMPTS = [[300 + (i * 7 + k * 13) % 9000 for i in range(100 + 10 * k)] for k in range(6)]
MAX_TOKENS = 48
ROUTER_ARGS = ("--breaker-open-seconds", "0.3", "--health-interval", "0.2")
# Tight enough that a stall or a hung prefill is noticed within a test's patience.
ROUTING = {
    "migration": {"stall_floor_s": 0.5, "stall_tpot_factor": 2.0},
    "hedge": {"floor_s": 0.3},
}
TTFT_BUDGET_S = 3.0


@pytest.fixture(scope="module", params=["push", "asgi"])
def stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[SimFleet, RouterProcess]]:
    directory = tmp_path_factory.mktemp("migration")
    with (
        running_fleet(
            directory,
            4,
            first_token_timeout_s=2.0,
            ttft_s=TTFT_BUDGET_S,
            tpot_s=0.2,
            routing=ROUTING,
            # A decode step of about 50 ms: 48 tokens take long enough to break mid-stream.
            # Usage names the prompt's cached tokens, as vLLM's does with this flag on: a
            # migrated answer's must too.
            sim={"time_scale": 5.0, "enable_prompt_tokens_details": True},
        ) as fleet,
        running_router(
            directory, fleet.fleet_path, *ROUTER_ARGS, "--relay", request.param
        ) as router,
    ):
        yield fleet, router


@pytest.fixture(autouse=True)
def healthy_fleet(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every engine of the shared stack running, unstopped and without faults after each
    test."""
    yield
    if "stack" not in request.fixturenames:
        return
    fleet, router = request.getfixturevalue("stack")
    for engine_id, engine in fleet.engines.items():
        if engine.process is not None and engine.alive:
            os.kill(engine.process.pid, signal.SIGCONT)
            admin(engine.url, "DELETE")
        else:
            fleet.restart(engine_id)

    def all_ready() -> bool:
        engines = router.admin_state()["engines"]
        return all(e["breaker"] == "closed" and e["healthy"] for e in engines)

    # A breaker the fault opened closes on a request that succeeds (half-open probe).
    if not wait_until(all_ready, 1):
        for prompt in PROMPTS[:4]:
            complete(router, prompt, max_tokens=1)
        assert wait_until(all_ready, 10)


def complete(router: RouterProcess, prompt: list[int], **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    payload.update(body)
    return httpx.post(router.url + "/v1/completions", json=payload, timeout=60)


def streamed_text(response: httpx.Response) -> tuple[str, list[dict[str, Any]], bool]:
    """The joined text, the chunks, and whether an error event arrived."""
    chunks, error = [], False
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = orjson.loads(line[6:])
        if "error" in obj:
            error = True
        chunks.append(obj)
    text = "".join(
        (c.get("text") or (c.get("delta") or {}).get("content") or "")
        for chunk in chunks
        for c in chunk.get("choices") or ()
    )
    return text, chunks, error


def stream_request(router: RouterProcess, prompt: list[int], chat: bool = False) -> httpx.Response:
    if chat:
        text = " ".join(f"w{t}" for t in prompt[:40])
        payload: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return httpx.post(router.url + "/v1/chat/completions", json=payload, timeout=60)
    payload = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return httpx.post(router.url + "/v1/completions", json=payload, timeout=60)


def baseline(router: RouterProcess, chat: bool = False) -> list[str]:
    """Every prompt's unbroken answer, streamed at once."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: stream_request(router, p, chat), PROMPTS))
    return [streamed_text(r)[0] for r in responses]


def under_fault(
    router: RouterProcess, fault: Any, chat: bool = False, after_s: float = 0.2
) -> list[httpx.Response]:
    """Every prompt streamed at once; ``fault()`` runs ``after_s`` after the first stream
    reached its decode engine (waited for: on a loaded host a fixed sleep could end before any
    had, or after all were done)."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream_request, router, p, chat) for p in PROMPTS]
        assert wait_until(
            lambda: any(e["in_flight"]["decode"] for e in router.admin_state()["engines"]),
            30,
            interval=0.02,
        )
        time.sleep(after_s)
        fault()
        return [f.result() for f in futures]


def decode_engine_with_streams(router: RouterProcess) -> str:
    """The decode engine holding the most streams now (from the router's admin state)."""
    engines = router.admin_state()["engines"]
    decoding = [e for e in engines if e["role"] == "decode"]
    return max(decoding, key=lambda e: e["in_flight"]["decode"])["id"]


def check_answers(
    router: RouterProcess, responses: list[httpx.Response], expected: list[str]
) -> list[dict[str, Any]]:
    """Every answer whole and equal to the unbroken one; usage as the client received; one
    journal record each. Returns the records."""
    ends = []
    for response, want in zip(responses, expected, strict=True):
        assert response.status_code == 200
        text, chunks, error = streamed_text(response)
        assert not error, response.text[-500:]
        assert text == want
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert len(usage) == 1 and usage[0]["completion_tokens"] == MAX_TOKENS
        # The client's prompt's details (its first prefill's), a migrated answer's too: not the
        # continuation prompt's, and not left out.
        assert isinstance(usage[0].get("prompt_tokens_details"), dict), usage
        assert isinstance(usage[0]["prompt_tokens_details"].get("cached_tokens"), int), usage
        roles = [
            c
            for chunk in chunks
            for c in chunk.get("choices") or ()
            if "role" in (c.get("delta") or {})
        ]
        assert len(roles) <= 1  # a continuation adds no second role chunk
        assert len({chunk["id"] for chunk in chunks}) == 1  # one id throughout
        rid = response.headers["x-request-id"]
        # ends() refuses a second request.end record for one request.
        assert wait_until(lambda rid=rid: rid in router.ends(), 5)
        ends.append(router.ends()[rid])
    for end in ends:
        assert end["outcome"] == "ok" and end["completion_tokens"] == MAX_TOKENS
    return ends


def migrated(ends: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in ends if e.get("migrations")]


def test_decode_engine_killed_mid_stream_is_invisible(stack) -> None:
    fleet, router = stack
    expected = baseline(router)
    before = metric(router.metrics(), "narwhal_migrations_total", reason="connection")
    victim: list[str] = []

    def kill() -> None:
        victim.append(decode_engine_with_streams(router))
        fleet.kill(victim[0])

    ends = check_answers(router, under_fault(router, kill), expected)
    moved = migrated(ends)
    assert moved, "no stream was on the killed engine"
    for end in moved:
        legs = [a for a in end["attempts"] if a["leg"] == "migration"]
        assert legs[0]["engine"] == victim[0] and legs[0]["outcome"] == "connection"
    after = metric(router.metrics(), "narwhal_migrations_total", reason="connection")
    assert after - before == len(moved)


def test_every_decode_engine_killed_mid_stream_is_rescued_on_another_engine(stack) -> None:
    """From a QA pass: with both decode engines killed, a continuation tried the other (dead
    too, its health probes not yet failed), and once that leg failed the stream ended with an
    error event, while the prefill engines, which may decode, were healthy: the rescue (a local
    leg on any healthy engine) ran only when the continuation's first pick found no pair. Now
    it also runs once the continuation's legs are spent."""
    fleet, router = stack
    expected = baseline(router)
    victims = [e["id"] for e in router.admin_state()["engines"] if e["role"] == "decode"]
    assert len(victims) == 2
    before = metric(router.metrics(), "narwhal_migrations_total")

    def kill_both() -> None:
        for engine_id in victims:
            fleet.kill(engine_id)

    ends = check_answers(router, under_fault(router, kill_both), expected)
    moved = migrated(ends)
    assert moved, "no stream was on the killed engines"
    for end in moved:
        legs = [(a["leg"], a["engine"], a["outcome"]) for a in end["attempts"]]
        # The answer ended on an engine that was not killed, prefilling its continuation.
        assert legs[-1][0] == "local" and legs[-1][1] not in victims, legs
    # The metric counts the continuations that went on, as the journal does (a first try on
    # the other dead engine that found no first token is none).
    after = metric(router.metrics(), "narwhal_migrations_total")
    assert after - before == sum(end["migrations"] for end in moved)


def test_decode_engine_stopped_mid_stream_is_migrated_as_stalled(stack) -> None:
    fleet, router = stack
    expected = baseline(router)
    stopped: list[int] = []

    def stop() -> None:
        engine = fleet.engines[decode_engine_with_streams(router)]
        assert engine.process is not None
        stopped.append(engine.process.pid)
        os.kill(engine.process.pid, signal.SIGSTOP)

    try:
        ends = check_answers(router, under_fault(router, stop), expected)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    moved = migrated(ends)
    assert moved
    assert all(
        a["outcome"] == "stall" for e in moved for a in e["attempts"] if a["leg"] == "migration"
    )


def test_engine_error_after_tokens_is_continued_in_chat(stack) -> None:
    fleet, router = stack
    expected = baseline(router, chat=True)
    for engine_id in ("e2", "e3"):
        admin(fleet.engines[engine_id].url, "POST", {"error_after_tokens": 10})
    # Both decode engines fail every stream after 10 tokens: a request breaks on one, then on
    # the other (or not, once that one's breaker has opened on the failures), and finishes as a
    # local leg on a prefill engine when no decode engine is left that has not failed it (the
    # rescue): one or two migrations, the whole answer.
    ends = check_answers(router, under_fault(router, lambda: None, chat=True), expected)
    for end in ends:
        legs = [(a["leg"], a["engine"], a["outcome"]) for a in end["attempts"]]
        assert end["migrations"] in (1, 2), legs
        assert sum(1 for leg in legs if leg[0] == "migration") == end["migrations"]
        assert legs[-1][0] == "local" and legs[-1][1] in ("e0", "e1"), legs


def test_engine_error_in_an_unstreamed_answer_is_continued(stack) -> None:
    fleet, router = stack

    def answer_all() -> list[httpx.Response]:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(lambda p: complete(router, p), PROMPTS))

    expected = [r.json()["choices"][0]["text"] for r in answer_all()]
    for engine_id in ("e2", "e3"):
        admin(fleet.engines[engine_id].url, "POST", {"error_after_tokens": 10})
    for response, want in zip(answer_all(), expected, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == want
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert body["choices"][0]["token_ids"] is None  # the router's ids are not the client's
        rid = response.headers["x-request-id"]
        assert wait_until(lambda rid=rid: rid in router.ends(), 5)
        end = router.ends()[rid]
        assert end["outcome"] == "ok" and end["migrations"] >= 1


def test_logprobs_offsets_and_usage_in_every_chunk_go_on_past_the_splice(stack) -> None:
    """A completion with logprobs broken (once or twice) mid-stream: its text offsets and, for
    a client that asked for usage in every chunk, each chunk's usage, equal the unbroken
    answer's, streamed and not (offsets shifted by what the client had at each splice)."""
    fleet, router = stack
    options = {"include_usage": True, "continuous_usage_stats": True}

    def streamed(prompt: list[int]) -> tuple[list[int], list[int], str]:
        response = complete(router, prompt, logprobs=1, stream=True, stream_options=options)
        assert response.status_code == 200, response.text
        _, chunks, error = streamed_text(response)
        assert not error, response.text[-500:]
        choices = [(chunk, c) for chunk in chunks for c in chunk.get("choices") or ()]
        offsets = [o for _, c in choices for o in (c.get("logprobs") or {})["text_offset"]]
        usage = [chunk["usage"]["completion_tokens"] for chunk, _ in choices]
        return offsets, usage, response.headers["x-request-id"]

    def unstreamed(prompt: list[int]) -> tuple[list[int], str]:
        response = complete(router, prompt, logprobs=1)
        assert response.status_code == 200, response.text
        offsets = response.json()["choices"][0]["logprobs"]["text_offset"]
        return offsets, response.headers["x-request-id"]

    prompts = PROMPTS[:2]
    expected = [(streamed(p)[:2], unstreamed(p)[0]) for p in prompts]
    for want_streamed, _ in expected:
        assert len(want_streamed[0]) == MAX_TOKENS and want_streamed[1][-1] == MAX_TOKENS
    for engine_id in ("e2", "e3"):
        admin(fleet.engines[engine_id].url, "POST", {"error_after_tokens": 10})
    for prompt, (want_streamed, want_offsets) in zip(prompts, expected, strict=True):
        offsets, usage, rid = streamed(prompt)
        assert (offsets, usage) == want_streamed
        got, rid_unstreamed = unstreamed(prompt)
        assert got == want_offsets
        for request_id in (rid, rid_unstreamed):
            assert wait_until(lambda r=request_id: r in router.ends(), 5)
            assert router.ends()[request_id]["migrations"] >= 1


def test_text_held_back_for_a_stop_string_reaches_the_client_past_the_splice(stack) -> None:
    """With a stop string the engine holds back its text's last len(stop) - 1 characters
    while their ids have gone out; a continuation starts after the ids, so the router
    recovers that text (an engine's /detokenize) and sends it before the continuation's:
    the answer equals the unbroken one, completions (streamed, with logprobs, unstreamed)
    and chat."""
    fleet, router = stack
    stop = {"stop": ["qqqqqqqqqqqq", "zz"]}  # never matched: 11 characters held back

    def streamed(prompt: list[int], **extra: Any) -> tuple[str, list[int], str]:
        response = complete(router, prompt, stream=True, **stop, **extra)
        assert response.status_code == 200, response.text
        text, chunks, error = streamed_text(response)
        assert not error, response.text[-500:]
        offsets = [
            o
            for chunk in chunks
            for c in chunk.get("choices") or ()
            for o in (c.get("logprobs") or {}).get("text_offset") or ()
        ]
        return text, offsets, response.headers["x-request-id"]

    def unstreamed(prompt: list[int]) -> tuple[str, str]:
        response = complete(router, prompt, **stop)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"], response.headers["x-request-id"]

    def chat(prompt: list[int]) -> tuple[str, str]:
        text = " ".join(f"w{t}" for t in prompt[:40])
        payload = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            **stop,
        }
        response = httpx.post(router.url + "/v1/chat/completions", json=payload, timeout=60)
        assert response.status_code == 200, response.text
        answer, _, error = streamed_text(response)
        assert not error, response.text[-500:]
        return answer, response.headers["x-request-id"]

    prompt = PROMPTS[2]
    want_text, want_offsets, _ = streamed(prompt, logprobs=1)
    want_plain = streamed(prompt)[0]
    want_chat = chat(prompt)[0]
    assert len(want_text) > 40 and want_plain == want_text == unstreamed(prompt)[0]
    for engine_id in ("e2", "e3"):
        admin(fleet.engines[engine_id].url, "POST", {"error_after_tokens": 10})
    text, offsets, rid_logprobs = streamed(prompt, logprobs=1)
    assert (text, offsets) == (want_text, want_offsets)
    plain, _, rid_plain = streamed(prompt)
    assert plain == want_plain
    whole, rid_whole = unstreamed(prompt)
    assert whole == want_text
    answer, rid_chat = chat(prompt)
    assert answer == want_chat
    for request_id in (rid_logprobs, rid_plain, rid_whole, rid_chat):
        assert wait_until(lambda r=request_id: r in router.ends(), 5)
        end = router.ends()[request_id]
        assert end["outcome"] == "ok" and end["migrations"] >= 1


def test_hung_prefill_engine_is_hedged_within_the_ttft_budget(stack) -> None:
    fleet, router = stack
    expected = baseline(router)
    engine = fleet.engines["e0"]
    assert engine.process is not None
    before = metric(router.metrics(), "narwhal_hedges_total", leg="prefill", outcome="hedge")
    os.kill(engine.process.pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            responses = list(pool.map(lambda p: stream_request(router, p), PROMPTS))
    finally:
        os.kill(engine.process.pid, signal.SIGCONT)
    ends = check_answers(router, responses, expected)
    # Hedged after half the TTFT budget (scheduler v0: no latency model), answered by e1.
    for end in ends:
        assert end["t_first_token"] < TTFT_BUDGET_S
    hedged = [e for e in ends if any(a["outcome"] == "hedged" for a in e["attempts"])]
    assert hedged, "no request was sent to the stopped prefill engine"
    for end in hedged:
        (hedge,) = [a for a in end["attempts"] if a["outcome"] == "hedged"]
        assert hedge["engine"] == "e0" and hedge["hedge"] == "e1"
        assert end["prefill_engine"] == "e1"
    after = metric(router.metrics(), "narwhal_hedges_total", leg="prefill", outcome="hedge")
    assert after - before == len(hedged)
    # The slow legs count against e0's breaker, as failures.
    failed = metric(router.metrics(), "narwhal_leg_failures_total", engine="e0", leg="prefill")
    assert failed >= len(hedged)


def test_token_ids_reach_only_a_client_that_asked_for_them(stack) -> None:
    """The router asks the decode engine for ids to migrate with; the prompt's ids are cut out
    of the first chunk before any parse. A client that asked gets every list as the engine wrote
    it, the others null, on both routes."""
    _, router = stack
    prompt = PROMPTS[1]
    for route, body in (
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 w2 w3"}]}),
    ):
        for asked in (False, True):
            payload = {
                "model": MODEL,
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
                **body,
                **({"return_token_ids": True} if asked else {}),
            }
            response = httpx.post(router.url + route, json=payload, timeout=60)
            assert response.status_code == 200
            _, chunks, error = streamed_text(response)
            assert not error and chunks
            first = chunks[0]
            prompt_ids = first.get("prompt_token_ids")
            if prompt_ids is None and first["choices"]:
                prompt_ids = first["choices"][0].get("prompt_token_ids")
            ids = [c.get("token_ids") for chunk in chunks for c in chunk["choices"]]
            if asked:
                assert isinstance(prompt_ids, list) and prompt_ids
                if route == "/v1/completions":
                    assert prompt_ids == prompt
                assert sum(len(i or []) for i in ids) == 8
            else:
                assert prompt_ids is None and all(i is None for i in ids), chunks[0]


def test_request_that_cannot_be_continued_exactly_still_ends_with_an_error_event(stack) -> None:
    fleet, router = stack
    for engine_id in ("e2", "e3"):
        admin(fleet.engines[engine_id].url, "POST", {"drop_stream_after_tokens": 1})
    # A structured output: its grammar's state is in the broken engine (the simulated
    # json_object answer is "{", "}" and EOS: broken after its first token).
    payload = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 20,
        "stream": True,
        "response_format": {"type": "json_object"},
    }
    response = httpx.post(router.url + "/v1/completions", json=payload, timeout=60)
    _, _, error = streamed_text(response)
    assert error
    rid = response.headers["x-request-id"]
    assert wait_until(lambda: rid in router.ends(), 5)
    end = router.ends()[rid]
    assert end["outcome"] == "stream_error" and not end.get("migrations")
    # The leg that broke says so (it said only first_token), once; the error says its cause
    # once (it was repeated in brackets).
    legs = [(a["leg"], a["outcome"]) for a in end["attempts"]]
    assert legs[-2:] == [("decode", "first_token"), ("decode", "broke")], legs
    assert end["attempts"][-1]["engine"] == end["decode_engine"]
    assert end["error"].count("closed") <= 1, end["error"]
    # The engine logged its injected drop as one line, not a traceback.
    assert fleet.log_dir is not None
    log = (fleet.log_dir / f"engine-{end['decode_engine']}.log").read_text()
    assert "fault injection: dropping the connection" in log
    assert "Traceback" not in log, log[-2000:]


def test_migration_off_in_the_fleet_keeps_the_old_behaviour(tmp_path: Path) -> None:
    with (
        running_fleet(tmp_path, 4, routing={"migration": {"limit": 0}}) as fleet,
        running_router(tmp_path, fleet.fleet_path, *ROUTER_ARGS) as router,
    ):
        for engine_id in ("e2", "e3"):
            admin(fleet.engines[engine_id].url, "POST", {"drop_stream_after_tokens": 2})
        response = stream_request(router, PROMPTS[0])
        _, chunks, error = streamed_text(response)
        assert error
        assert len([c for c in chunks if c.get("choices")]) == 2


def test_a_stream_broken_where_it_cannot_be_continued_counts_against_its_engine(stack) -> None:
    """Several choices (n > 1) are not continued elsewhere: a decode engine that breaks them
    after their first tokens failed the request, and its leg counted as a success (the first
    token's), so an engine breaking every such stream never had its breaker opened (a QA
    pass: 11 of 20 tool-call requests failed on one engine, its breaker closed). Each such
    break is now a decode leg failure on its engine."""
    fleet, router = stack
    for engine_id in ("e2", "e3"):
        admin(fleet.engines[engine_id].url, "POST", {"error_after_tokens": 3})

    def failures() -> float:
        text = router.metrics()
        return sum(
            metric(text, "narwhal_leg_failures_total", engine=e, leg="decode") for e in ("e2", "e3")
        )

    before = failures()
    broken = 0
    errors = []
    for prompt in PROMPTS[:3]:
        response = complete(router, prompt, n=2, temperature=1.0, stream=True)
        assert response.status_code == 200
        _, chunks, error = streamed_text(response)
        broken += error
        errors += [c["error"] for c in chunks if "error" in c]
    assert broken == 3  # every request's stream ended with an error event
    assert failures() - before >= 3
    # A lone stream that cannot be continued (structured output) ends with the same error as
    # several choices do: the router's, naming the engine's (it passed vLLM's own on, type
    # InternalServerError and code 500, where n > 1 gave upstream_error and 502). The simulated
    # json_object answer is "{", "}" and EOS: broken after its first token.
    for engine_id in ("e2", "e3"):
        admin(fleet.engines[engine_id].url, "POST", {"error_after_tokens": 1})
    lone = httpx.post(
        router.url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPTS[0],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "response_format": {"type": "json_object"},
        },
        timeout=60,
    )
    assert lone.status_code == 200
    _, chunks, error = streamed_text(lone)
    assert error, chunks
    (last,) = [c["error"] for c in chunks if "error" in c]
    assert {e["type"] for e in errors} == {last["type"]} == {"upstream_error"}
    assert {e["code"] for e in errors} == {last["code"]} == {502}
    assert "the engine's error" in last["message"], last


def test_a_stream_cut_after_its_last_token_is_a_whole_answer(stack) -> None:
    """An engine that closes its connection right after the answer's finish reason, before
    the usage chunk and ``[DONE]`` (it died then, or something between cut it), left a whole
    answer that the client got as an error event, or a 502 not streamed (a QA pass). It ends
    as the engine would have ended it: the usage counted from the ids the router kept, no
    error, outcome ok; with several choices (no ids kept) without the usage."""
    fleet, router = stack
    expected = baseline(router)
    for engine_id in ("e2", "e3"):
        admin(fleet.engines[engine_id].url, "POST", {"drop_stream_after_tokens": MAX_TOKENS})
    responses = [stream_request(router, p) for p in PROMPTS[:2]]
    ends = check_answers(router, responses, expected[:2])
    assert not any(e.get("migrations") for e in ends)

    response = complete(router, PROMPTS[0])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == expected[0]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["usage"]["prompt_tokens"] == len(PROMPTS[0])

    response = complete(router, PROMPTS[1], n=2, temperature=1.0, stream=True)
    assert response.status_code == 200
    _, chunks, error = streamed_text(response)
    assert not error, response.text[-500:]
    finished = {
        c["index"] for chunk in chunks for c in chunk.get("choices") or () if c["finish_reason"]
    }
    assert finished == {0, 1}
    for rid in (response.headers["x-request-id"],):
        assert wait_until(lambda rid=rid: rid in router.ends(), 5)
        assert router.ends()[rid]["outcome"] == "ok"


def test_a_hedged_prefill_that_fails_on_both_engines_says_two_legs(stack, tmp_path: Path) -> None:
    """Both prefill engines hung: the slow leg is hedged on the other engine and both time
    out; the 502 counted the attempt, "1 leg", where the journal names two engines (a QA
    pass). It counts the legs."""
    fleet, _ = stack
    stopped = [fleet.engines[e].process for e in ("e0", "e1")]
    with running_router(tmp_path, fleet.fleet_path, *ROUTER_ARGS, "--prefill-timeout", "1.5") as r:
        for process in stopped:
            assert process is not None
            os.kill(process.pid, signal.SIGSTOP)
        try:
            response = complete(r, PROMPTS[0])
        finally:
            for process in stopped:
                assert process is not None
                os.kill(process.pid, signal.SIGCONT)
        assert response.status_code == 502, response.text
        message = response.json()["error"]["message"]
        rid = response.headers["x-request-id"]
        assert wait_until(lambda: rid in r.ends(), 5)
        end = r.ends()[rid]
        failed = [a for a in end["attempts"] if a["leg"] == "prefill" and a["outcome"] == "failed"]
        assert len(failed) >= 2 and {a["engine"] for a in failed} == {"e0", "e1"}, end["attempts"]
        assert f"({len(failed)} legs, the last" in message, message
        # The last leg to fail is the hedge, on the other engine than the pick's: the message
        # named the pick's engine with the hedge's error (a QA pass).
        assert f"the last prefill on {failed[-1]['engine']}: timed out)" in message, (
            message,
            end["attempts"],
        )
