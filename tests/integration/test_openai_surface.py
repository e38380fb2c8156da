"""The OpenAI surface agentic clients use, through narwhal-serve on a live simulated fleet, with
the ``openai`` SDK: several choices (``n``, batched prompts), tool calls, logprobs; each answer
as the decode engine alone would give it, each request one journal record."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import (
    MODEL,
    VLLM_032_USAGE_KEYS,
    RouterProcess,
    running_fleet,
    running_router,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, RouterProcess]]:
    directory = tmp_path_factory.mktemp("openai-surface")
    with (
        running_fleet(directory, 4) as fleet,
        running_router(directory, fleet.fleet_path) as router,
    ):
        yield fleet, router


@pytest.fixture
def clients() -> Iterator[Callable[[str], openai.OpenAI]]:
    """SDK clients, closed at the end of the test (an unclosed one warns)."""
    made: list[openai.OpenAI] = []

    def make(url: str) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0))
        return made[-1]

    yield make
    for client in made:
        client.close()


def _end(router: RouterProcess, rid: str) -> dict[str, Any]:
    assert wait_until(lambda: rid in router.ends(), 5), f"no request.end for {rid}"
    return router.ends()[rid]


def test_n_choices_are_fanned_out_and_numbered(stack, clients) -> None:
    fleet, router = stack
    engine = clients(fleet.engines["e2"].url)
    one = engine.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6
    )
    raw = clients(router.url).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, n=3
    )
    got = raw.parse()
    assert [c.index for c in got.choices] == [0, 1, 2]
    # The simulated model is deterministic: each choice is the lone answer.
    assert {c.message.content for c in got.choices} == {one.choices[0].message.content}
    assert got.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert got.usage.completion_tokens == 3 * one.usage.completion_tokens
    end = _end(router, raw.headers["x-request-id"])
    assert got.id == f"chatcmpl-{raw.headers['x-request-id']}"  # as a lone request's id
    assert end["outcome"] == "ok" and end["choices"] == 3
    assert end["completion_tokens"] == 3 * one.usage.completion_tokens
    assert {a["choice"] for a in end["attempts"]} == {0, 1, 2}
    # Each choice's handoff moved the prompt's one partial block (16 tokens of 16,384 bytes).
    assert end["kv_bytes_moved"] == 3 * -(-one.usage.prompt_tokens // 16) * 16384, end
    # The usage keys of vLLM's whole answer, as a lone request's.
    assert set(raw.http_response.json()["usage"]) == VLLM_032_USAGE_KEYS


def test_batched_prompts_with_n_stream_as_one(stack, clients) -> None:
    fleet, router = stack
    engine = clients(fleet.engines["e2"].url)
    prompts = ["the first prompt of a batch", "a second, different prompt"]
    lone = [engine.completions.create(model=MODEL, prompt=p, max_tokens=5) for p in prompts]
    stream = clients(router.url).completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    ids, usage, finishes = set(), None, {}
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert len(ids) == 1 and next(iter(ids)).startswith("cmpl-") and not ids.pop().endswith("-0")
    # prompt i's choice j is index i * n + j, as vLLM numbers them
    assert texts == {
        0: lone[0].choices[0].text,
        1: lone[0].choices[0].text,
        2: lone[1].choices[0].text,
        3: lone[1].choices[0].text,
    }
    assert finishes == {i: "length" for i in range(4)}
    assert usage is not None
    assert usage.prompt_tokens == lone[0].usage.prompt_tokens + lone[1].usage.prompt_tokens
    assert usage.completion_tokens == 4 * 5


def test_a_bad_prompt_in_a_batch_is_named(stack) -> None:
    _, router = stack
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": ["fine", ""], "max_tokens": 3},
        timeout=10,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt[1]"
    assert _end(router, r.headers["x-request-id"])["outcome"] == "client_error"
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "n": 65, "max_tokens": 3},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _without_ids(choice: dict[str, Any]) -> dict[str, Any]:
    message = dict(choice["message"])
    message["tool_calls"] = [{**c, "id": None} for c in message.get("tool_calls") or []]
    return {**choice, "message": message}


def _joined(stream) -> tuple[dict[int, dict[str, Any]], str | None, list[Any], str]:
    """A chat stream's tool calls joined by index, its finish reason, logprobs and content."""
    calls: dict[int, dict[str, Any]] = {}
    finish, logprobs, content = None, [], []
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                joined = calls.setdefault(call.index, {"name": None, "arguments": ""})
                if call.function and call.function.name:
                    joined["name"] = call.function.name
                if call.function and call.function.arguments:
                    joined["arguments"] += call.function.arguments
            if choice.delta.content:
                content.append(choice.delta.content)
            if choice.logprobs and choice.logprobs.content:
                logprobs += [lp.model_dump() for lp in choice.logprobs.content]
            finish = choice.finish_reason or finish
    return calls, finish, logprobs, "".join(content)


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required", "auto", "none"],
    ids=["named", "required", "auto", "none"],
)
def test_tool_calls_equal_the_decode_engines_own_answer(stack, clients, tool_choice) -> None:
    fleet, router = stack
    body = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=tool_choice)
    engine, routed = clients(fleet.engines["e2"].url), clients(router.url)
    expected = engine.chat.completions.create(max_tokens=160, **body).model_dump()
    raw = routed.chat.completions.with_raw_response.create(max_tokens=160, **body)
    got = raw.parse().model_dump()
    assert _without_ids(got["choices"][0]) == _without_ids(expected["choices"][0])
    assert got["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    calls = got["choices"][0]["message"]["tool_calls"]
    if tool_choice in ("auto", "none"):
        assert not calls  # the simulated model never decides to call a tool
    else:
        (call,) = calls
        assert call["function"]["name"] == "get_weather" and call["id"]
        arguments = json.loads(call["function"]["arguments"])
        assert set(arguments) >= {"city", "unit"} and arguments["unit"] == "celsius"
    assert _end(router, raw.headers["x-request-id"])["outcome"] == "ok"
    # Streamed: the deltas joined by index give the same calls, through the router and not.
    direct = _joined(engine.chat.completions.create(max_tokens=160, stream=True, **body))
    routed_stream = _joined(routed.chat.completions.create(max_tokens=160, stream=True, **body))
    assert routed_stream == direct
    if calls:
        assert routed_stream[0][0]["arguments"] == calls[0]["function"]["arguments"]


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_a_tool_call_cut_by_max_tokens_ends_as_the_engine_ends_it(
    stack, clients, tool_choice
) -> None:
    """Named: the partial arguments; required: no call (vLLM cannot parse a cut array)."""
    fleet, router = stack
    body = dict(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=tool_choice, max_tokens=12
    )
    expected = clients(fleet.engines["e2"].url).chat.completions.create(**body).model_dump()
    got = clients(router.url).chat.completions.create(**body).model_dump()
    assert _without_ids(got["choices"][0]) == _without_ids(expected["choices"][0])
    assert got["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_equal_the_decode_engines_own(stack, clients, stream) -> None:
    fleet, router = stack
    engine, routed = clients(fleet.engines["e2"].url), clients(router.url)
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3)
    text = dict(model=MODEL, prompt="tell me about routers", max_tokens=8, logprobs=2)
    if not stream:
        expected = engine.chat.completions.create(**chat).model_dump()["choices"][0]
        got = routed.chat.completions.create(**chat).model_dump()["choices"][0]
        assert got == expected
        assert len(got["logprobs"]["content"]) == 8
        assert len(got["logprobs"]["content"][0]["top_logprobs"]) == 3
        expected = engine.completions.create(**text).model_dump()["choices"][0]
        got = routed.completions.create(**text).model_dump()["choices"][0]
        assert got == expected and len(got["logprobs"]["tokens"]) == 8
        return
    assert _joined(routed.chat.completions.create(stream=True, **chat)) == _joined(
        engine.chat.completions.create(stream=True, **chat)
    )


def test_structured_output_and_sampling_fields_pass_through(stack, clients) -> None:
    fleet, router = stack
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
    }
    body = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        seed=3,
        stop=["never appears"],
    )
    expected = clients(fleet.engines["e2"].url).chat.completions.create(**body).model_dump()
    got = clients(router.url).chat.completions.create(**body).model_dump()
    assert got["choices"] == expected["choices"]
    assert set(json.loads(got["choices"][0]["message"]["content"])) == {"answer", "sure"}


def test_stop_strings_end_the_answer_through_the_router(stack, clients) -> None:
    """An agent's stop sequence, through the P/D router with the openai SDK: the answer ends
    before it, streamed and not, as the decode engine's own answer does (the prefill leg
    carries no stop: its one token is thrown away)."""
    fleet, router = stack
    routed, engine = clients(router.url), clients(fleet.engines["e2"].url)
    body: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    full = routed.chat.completions.create(**body).choices[0].message.content
    assert full
    stop = full.split()[3][1:3]
    body["stop"] = [stop]
    got = routed.chat.completions.create(**body).model_dump()
    expected = engine.chat.completions.create(**body).model_dump()
    (choice,) = got["choices"]
    assert choice["message"]["content"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert _without_ids(choice) == _without_ids(expected["choices"][0])
    assert got["usage"]["completion_tokens"] == 4
    chunks = list(routed.chat.completions.create(stream=True, **body))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full[: full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "hot"), ("top_logprobs", 3), ("top_p", 0), ("tool_choice", "required")],
)
def test_the_engines_refusals_reach_the_client(stack, field, value) -> None:
    """Bad values are the engine's to refuse (as vLLM refuses them), once, with its 400."""
    _, router = stack
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, field: value, "max_tokens": 4},
        timeout=10,
    )
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    end = _end(router, r.headers["x-request-id"])
    assert end["outcome"] == "client_error" and end["status"] == 400


def test_the_async_sdk_streams_a_named_tool_call_and_n_choices(stack) -> None:
    fleet, router = stack
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def run() -> tuple[Any, Any, Any]:
        async with (
            openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as routed,
            openai.AsyncOpenAI(
                base_url=fleet.engines["e3"].url + "/v1", api_key="x", max_retries=0
            ) as engine,
        ):
            body = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=named)
            expected = await engine.chat.completions.create(max_tokens=160, **body)
            stream = await routed.chat.completions.create(max_tokens=160, stream=True, **body)
            arguments = ""
            async for chunk in stream:
                for choice in chunk.choices:
                    for call in choice.delta.tool_calls or ():
                        arguments += call.function.arguments or ""
            several = await routed.completions.create(
                model=MODEL, prompt="two answers", n=2, max_tokens=3, temperature=0.7
            )
            return expected, arguments, several

    expected, arguments, several = asyncio.run(run())
    assert arguments == expected.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(arguments)["unit"] == "celsius"
    assert [c.index for c in several.choices] == [0, 1]
    assert several.usage.completion_tokens == 6


def test_a_choice_the_engine_refuses_fails_the_request_once(stack) -> None:
    _, router = stack
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "n": 3, "max_tokens": 3, "top_p": 7},
        timeout=10,
    )
    assert r.status_code == 400, r.text
    end = _end(router, r.headers["x-request-id"])
    assert end["outcome"] == "client_error"
    assert end["choices"] == 3
    ids = [rec["id"] for rec in router.records() if rec["type"] == "request.end"]
    assert ids.count(r.headers["x-request-id"]) == 1


def test_models_are_listed_and_retrieved_and_unknown_routes_are_openai_errors(
    stack, clients
) -> None:
    """``models.retrieve`` (GET /v1/models/{id}: ids hold a slash) answers the served model's
    card and a clear 404 for any other; a path the router does not serve, and a method a route
    does not take, are OpenAI-shaped errors like every other, not the framework's."""
    _, router = stack
    client = clients(router.url)
    (listed,) = client.models.list().data
    got = client.models.retrieve(MODEL)
    assert got.id == MODEL == listed.id and got.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("meta/not-served")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "not-served" in missing.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model=MODEL, input="hello")
    assert unknown.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert "POST /v1/embeddings" in unknown.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as stored:
        client.responses.retrieve("resp_123")
    assert "stores no responses" in stored.value.body["message"]  # type: ignore[index]
    for operation in (
        lambda: client.responses.delete("resp_123"),
        lambda: client.responses.cancel("resp_123"),
        lambda: client.responses.input_items.list("resp_123"),
    ):
        with pytest.raises(openai.NotFoundError) as stored:
            operation()
        assert "No response with id 'resp_123'" in stored.value.body["message"]  # type: ignore[index]
    # Routes the router does not serve under /v1/responses/ are not taken for response ids
    # ("No response with id 'input_tokens'" before).
    for path in ("input_tokens", "compact"):
        with pytest.raises(openai.NotFoundError) as unknown:
            client.post(f"/responses/{path}", body={"model": MODEL, "input": "hi"}, cast_to=object)
        body = unknown.value.body
        assert f"Invalid URL (POST /v1/responses/{path}): no such route" in body["message"]  # type: ignore[index]
    empty = httpx.get(router.url + "/v1/responses/", timeout=10)
    assert empty.status_code == 404 and "no such route" in empty.json()["error"]["message"]
    wrong = httpx.get(router.url + "/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    error = wrong.json()["error"]
    assert error["code"] == 405 and "GET /v1/chat/completions" in error["message"]
    # Probes that ask with HEAD (load balancers, uptime checks) get the GET's status.
    for path in ("/health", "/ready"):
        probed = httpx.head(router.url + path, timeout=10)
        assert probed.status_code == 200 and probed.content == b"", (path, probed)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("model", [None, ""])
def test_a_request_without_a_model_is_served_by_the_fleets_model(stack, route, model) -> None:
    """vLLM serves a request whose model is missing or empty with its one model (its
    ``_is_model_supported``): so does the router, the answer naming the served model."""
    _, router = stack
    body: dict[str, Any] = {"max_tokens": 3}
    if route == "/v1/completions":
        body["prompt"] = "hello"
    elif route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body = {"input": "hello", "max_output_tokens": 3}
    if model is not None:
        body["model"] = model
    response = httpx.post(router.url + route, json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL
    assert _end(router, response.headers["x-request-id"])["outcome"] == "ok"
    # Streamed: every chunk (every Responses event's response) names the served model.
    streamed = httpx.post(router.url + route, json={**body, "stream": True}, timeout=30)
    assert streamed.status_code == 200, streamed.text
    events = [
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    models = {e.get("model") or (e.get("response") or {}).get("model") for e in events}
    assert models - {None} == {MODEL}
    if route == "/v1/responses":
        assert {e["response"]["model"] for e in events if "response" in e} == {MODEL}


@pytest.mark.parametrize("fields", [{"echo": 0}, {"echo": "false"}, {"best_of": "1"}])
def test_an_unsupported_field_set_off_is_served_through_to_the_engine(stack, fields) -> None:
    """vLLM reads 0 and "false" as false, "1" as 1: the router and the simulated engine
    accept the field off however it is written, as vLLM does."""
    _, router = stack
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}
    response = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert _end(router, response.headers["x-request-id"])["outcome"] == "ok"
