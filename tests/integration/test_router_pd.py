"""narwhal-serve in front of a live simulated fleet: the happy path, exactly as one engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import narwhal
from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import (
    MODEL,
    VLLM_032_ANSWER_KEYS,
    VLLM_032_USAGE_KEYS,
    RouterProcess,
    metric,
    running_fleet,
    running_router,
)

PROMPT = " ".join(f"token{i} of a long prompt" for i in range(50))
IDS = [300 + (i * 53) % 9000 for i in range(200)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, RouterProcess]]:
    directory = tmp_path_factory.mktemp("router-pd")
    with (
        running_fleet(directory, 4) as fleet,
        running_router(directory, fleet.fleet_path) as router,
    ):
        yield fleet, router


def whole(fleet: SimFleet, chat: bool, **body: object) -> openai.types.Completion:
    client = openai.OpenAI(base_url=fleet.engines["e2"].url + "/v1", api_key="x", max_retries=0)
    if chat:
        return client.chat.completions.create(model=MODEL, **body)  # type: ignore[arg-type]
    return client.completions.create(model=MODEL, **body)  # type: ignore[arg-type]


def through(router: RouterProcess, chat: bool, **body: object):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    if chat:
        return client.chat.completions.create(model=MODEL, **body)  # type: ignore[arg-type]
    return client.completions.create(model=MODEL, **body)  # type: ignore[arg-type]


def collect_stream(stream, chat: bool) -> tuple[str, object]:
    text, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            if piece:
                text.append(piece)
    return "".join(text), usage


@pytest.mark.parametrize("prompt", [PROMPT, IDS], ids=["text", "token-ids"])
def test_completion_equals_one_engine(stack, prompt) -> None:
    fleet, router = stack
    expected = whole(fleet, False, prompt=prompt, max_tokens=12)
    got = through(router, False, prompt=prompt, max_tokens=12)
    assert got.choices[0].text == expected.choices[0].text
    assert got.choices[0].finish_reason == expected.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    assert got.usage.completion_tokens == expected.usage.completion_tokens == 12
    assert got.usage.total_tokens == expected.usage.total_tokens


@pytest.mark.parametrize("prompt", [PROMPT, IDS], ids=["text", "token-ids"])
def test_streamed_completion_equals_one_engine(stack, prompt) -> None:
    fleet, router = stack
    body = dict(prompt=prompt, max_tokens=9, stream=True, stream_options={"include_usage": True})
    exp_text, exp_usage = collect_stream(whole(fleet, False, **body), False)
    got_text, got_usage = collect_stream(through(router, False, **body), False)
    assert got_text == exp_text
    assert got_usage is not None and exp_usage is not None
    assert got_usage.prompt_tokens == exp_usage.prompt_tokens
    assert got_usage.completion_tokens == exp_usage.completion_tokens == 9
    assert got_usage.total_tokens == exp_usage.total_tokens


def test_chat_equals_one_engine(stack) -> None:
    fleet, router = stack
    messages = [{"role": "user", "content": PROMPT}]
    expected = whole(fleet, True, messages=messages, max_tokens=7)
    got = through(router, True, messages=messages, max_tokens=7)
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    assert got.usage.completion_tokens == expected.usage.completion_tokens == 7


def test_streamed_chat_equals_one_engine(stack) -> None:
    fleet, router = stack
    body = dict(
        messages=[{"role": "user", "content": PROMPT}],
        max_completion_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    exp_text, exp_usage = collect_stream(whole(fleet, True, **body), True)
    got_text, got_usage = collect_stream(through(router, True, **body), True)
    assert got_text == exp_text
    assert got_usage.prompt_tokens == exp_usage.prompt_tokens
    assert got_usage.completion_tokens == exp_usage.completion_tokens == 6


def test_stream_without_usage_gets_no_usage_chunk(stack) -> None:
    _, router = stack
    with httpx.stream(
        "POST",
        router.url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True},
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert not any('"choices":[]' in ln for ln in lines)


@pytest.mark.parametrize("include_usage", [False, True])
def test_continuous_usage_only_for_a_client_that_asked_for_usage(stack, include_usage) -> None:
    # vLLM: continuous_usage_stats counts usage in every chunk only with include_usage; the
    # decode leg always asks for usage (the router counts with it), the client did not.
    _, router = stack
    options = {"continuous_usage_stats": True, "include_usage": include_usage}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", router.url + "/v1/completions", timeout=30, json={**body, "stream_options": options}
    ) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    with_choices = [e for e in events if e["choices"]]
    assert len(with_choices) >= 3
    if include_usage:
        assert all(e.get("usage") for e in with_choices)
        assert not events[-1]["choices"] and events[-1]["usage"]["completion_tokens"] == 3
    else:
        assert not any(e.get("usage") for e in events), events


def test_journal_and_metrics_record_the_handoff(stack) -> None:
    fleet, router = stack
    r = httpx.post(
        router.url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": IDS, "max_tokens": 5},
        headers={"X-Request-Id": "client-id-1"},
    )
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    # The journal is written by its own thread: the record lands just after the response.
    assert wait_until(lambda: rid in router.ends(), 5)
    ends = router.ends()
    starts = [
        rec for rec in router.records() if rec["type"] == "request.start" and rec["id"] == rid
    ]
    assert len(starts) == 1
    end = ends[rid]
    assert end["outcome"] == "ok" and end["status"] == 200
    assert end["client_request_id"] == "client-id-1"
    assert end["prompt_tokens"] == len(IDS) and end["completion_tokens"] == 5
    assert end["prefill_engine"] in ("e0", "e1") and end["decode_engine"] in ("e2", "e3")
    assert end["handoff"] == "nixl"
    for key in (
        "t_prefill_start",
        "t_prefill_end",
        "t_decode_start",
        "t_first_token",
        "t_last_token",
    ):
        assert end[key] is not None, key
    assert (
        end["t_prefill_start"]
        <= end["t_prefill_end"]
        <= end["t_decode_start"]
        <= end["t_first_token"]
        <= end["t_last_token"]
    )
    assert end["handoff_first_token_s"] > 0
    text = router.metrics()
    assert metric(text, "narwhal_requests_total", outcome="ok") >= 1
    assert metric(text, "narwhal_kv_handoff_seconds_count") >= 1
    # No prompt and no completion text in the journal.
    raw = router.journal.read_text()
    assert "token1 of a long prompt" not in raw
    decode_metrics = httpx.get(fleet.engines[end["decode_engine"]].url + "/metrics").text
    assert metric(decode_metrics, "vllm:nixl_bytes_transferred_count") >= 1


def test_every_counter_exists_at_zero_from_start(stack) -> None:
    _, router = stack
    text = router.metrics()
    for outcome in (
        "ok",
        "client_error",
        "deadline_exceeded",
        "decode_failed",
        "prefill_failed",
        "client_abort",
        "router_restart",
    ):
        assert f'narwhal_requests_total{{outcome="{outcome}"}}' in text
    for engine in ("e0", "e1", "e2", "e3"):
        assert f'narwhal_first_token_deadline_exceeded_total{{engine="{engine}"}}' in text
        assert (
            f'narwhal_stranded_handoffs_total{{engine="{engine}",reason="decode_failed"}}' in text
        )
    assert 'narwhal_flips_total{from_role="prefill",to_role="decode"}' in text
    assert "narwhal_fleet_info{" in text
    assert "narwhal_journal_backlog" in text


def test_models_ready_health_admin(stack) -> None:
    _, router = stack
    models = httpx.get(router.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(router.url + "/health").status_code == 200
    ready = httpx.get(router.url + "/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    # vLLM's /ping (GET and POST, SageMaker's probe) is the router's readiness.
    for method in ("GET", "POST"):
        ping = httpx.request(method, router.url + "/ping")
        assert ping.status_code == 200 and ping.json()["ready"] is True
    # vLLM's /version, and which contract this router runs.
    version = httpx.get(router.url + "/version").json()
    assert version["version"] == narwhal.__version__ and version["server"] == "narwhal-serve"
    assert version["fleet_sha256"] == router.admin_state()["fleet"]["sha256"]
    assert httpx.get(router.url + "/admin/state").status_code == 401
    state = router.admin_state()
    assert {e["id"]: e["role"] for e in state["engines"]} == {
        "e0": "prefill",
        "e1": "prefill",
        "e2": "decode",
        "e3": "decode",
    }
    assert all(e["healthy"] for e in state["engines"])


def test_token_id_prompt_length_checked_before_any_engine(stack, tmp_path: Path) -> None:
    _, router = stack
    before = router.metrics()
    # A prompt that fills the context leaves nothing to generate, one past it does not fit:
    # refused as vLLM 0.32 refuses them (its messages and params).
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": [400] * 16384, "max_tokens": 1},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": [400] * 16386, "max_tokens": 1},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input_tokens"
    assert "your prompt contains 16386 input tokens" in r.json()["error"]["message"]
    after = router.metrics()
    # No engine leg was attempted for it.
    assert metric(after, "narwhal_prefill_seconds_count") == metric(
        before, "narwhal_prefill_seconds_count"
    )


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_routed_whole_answer_has_vllm_032_keys(stack, chat: bool) -> None:
    """The router builds a whole answer from the decode stream: with the keys vLLM 0.32's own
    whole answer has (tests.helpers.VLLM_032_ANSWER_KEYS)."""
    _, router = stack
    body: dict[str, object] = {"model": MODEL, "max_tokens": 3}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = IDS
    path = "/v1/chat/completions" if chat else "/v1/completions"
    answer = httpx.post(router.url + path, json=body, timeout=30).json()
    assert set(answer) == VLLM_032_ANSWER_KEYS[chat]
    assert set(answer["usage"]) == VLLM_032_USAGE_KEYS


def test_prompt_token_ids_come_back_when_asked(stack) -> None:
    _, router = stack
    r = httpx.post(
        router.url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": IDS, "max_tokens": 3, "return_token_ids": True},
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["prompt_token_ids"] == IDS
    r = httpx.post(
        router.url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": IDS, "max_tokens": 3},
    )
    assert r.json()["choices"][0].get("prompt_token_ids") is None


def test_a_chat_answer_without_a_generation_prompt_has_the_last_messages_role(stack) -> None:
    # vLLM's get_chat_request_role: "assistant", or with add_generation_prompt false the last
    # message's role, in the stream's first delta and in the whole answer the router rebuilds.
    fleet, router = stack
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "add_generation_prompt": False,
    }
    path = "/v1/chat/completions"
    direct = httpx.post(fleet.engines["e2"].url + path, json=body, timeout=30).json()
    routed = httpx.post(router.url + path, json=body, timeout=30).json()
    assert direct["choices"][0]["message"]["role"] == "user"
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    with httpx.stream("POST", router.url + path, json={**body, "stream": True}, timeout=30) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "user"
    answer = {**body, "add_generation_prompt": True}
    routed = httpx.post(router.url + path, json=answer, timeout=30).json()
    assert routed["choices"][0]["message"]["role"] == "assistant"


def test_loosely_typed_numbers_and_flags_are_read_as_vllm_reads_them(stack) -> None:
    # vLLM's request models are pydantic in lax mode: max_tokens 2.0 (an agent framework that
    # computes it), "3" or n 2.0 and stream "true" are served; 2.5 is refused, as by vLLM.
    fleet, router = stack
    base = {"model": MODEL, "prompt": PROMPT, "ignore_eos": True}
    for url in (fleet.engines["e2"].url, router.url):
        r = httpx.post(url + "/v1/completions", json={**base, "max_tokens": 2.0}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        r = httpx.post(
            url + "/v1/completions", json={**base, "max_tokens": "3", "n": 2.0}, timeout=30
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 6
        r = httpx.post(url + "/v1/completions", json={**base, "max_tokens": 2.5}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        # Token ids too: 300.0 and "301" are 300 and 301; 301.5 is refused.
        ids = {**base, "prompt": [300.0, "301", 302], "max_tokens": 2}
        for prompt in ([300.0, "301", 302], ["300", 301, 302]):
            r = httpx.post(url + "/v1/completions", json={**ids, "prompt": prompt}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 3
        r = httpx.post(url + "/v1/completions", json={**ids, "prompt": [300, 301.5]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    streamed = {**base, "max_tokens": 2, "stream": "true"}
    with httpx.stream("POST", router.url + "/v1/completions", json=streamed, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    r = httpx.post(router.url + "/v1/completions", json={**streamed, "stream": "no"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(
        router.url + "/v1/responses",
        json={"model": MODEL, "input": PROMPT, "max_output_tokens": 4.0, "stream": "false"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] <= 4
