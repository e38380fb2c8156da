"""The simulated engine's OpenAI surface over HTTP, against a real engine process: n choices,
logprobs, forced tool calls and response formats, streamed and not, with a stream aggregating to
exactly the non-streamed answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import MODEL, TEST_TIME_SCALE, running_fleet, sse_events

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "when": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
            },
            "required": ["city", "unit", "when"],
        },
    },
}
ARGS = '{"city": "", "unit": "celsius", "when": [0]}'
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("surface")
    with running_fleet(directory, 2, sim={"time_scale": TEST_TIME_SCALE}) as fleet:
        yield fleet.engines["e0"].url


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def post(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    chat: bool = True,
    headers: dict[str, str] | None = None,
) -> Any:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = client.post(url + path, json={"model": MODEL, **body}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def stream(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    chat: bool = True,
    headers: dict[str, str] | None = None,
) -> list[Any]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    payload = {"model": MODEL, **body, "stream": True}
    with client.stream("POST", url + path, json=payload, headers=headers) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def aggregate(events: list[Any], chat: bool) -> dict[int, dict[str, Any]]:
    """Per choice index: text, tool-call arguments, logprobs and finish reason of a stream."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            agg = out.setdefault(
                choice["index"], {"text": "", "calls": {}, "logprobs": None, "finish": None}
            )
            if chat:
                delta = choice["delta"]
                agg["text"] += delta.get("content") or ""
                for call in delta.get("tool_calls", []):
                    entry = agg["calls"].setdefault(call["index"], {"arguments": ""})
                    for key in ("id", "type"):
                        if key in call:
                            entry[key] = call[key]
                    if call["function"].get("name"):
                        entry["name"] = call["function"]["name"]
                    entry["arguments"] += call["function"]["arguments"]
            else:
                agg["text"] += choice["text"]
            lp = choice["logprobs"]
            if lp is not None:
                if agg["logprobs"] is None:
                    agg["logprobs"] = {k: [] for k in lp}
                for key, values in lp.items():
                    agg["logprobs"][key].extend(values)
            agg["finish"] = choice["finish_reason"] or agg["finish"]
    return out


def test_n_choices(client: httpx.Client, url: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 6, "ignore_eos": True}
    one = post(client, url, body)
    three = post(client, url, {**body, "n": 3, "temperature": 0.8, "seed": 1})
    texts = [c["message"]["content"] for c in three["choices"]]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert texts[0] == one["choices"][0]["message"]["content"]  # choice 0 is the n=1 answer
    assert len(set(texts)) == 3
    assert three["usage"]["completion_tokens"] == 18
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    events = stream(
        client,
        url,
        {**body, "n": 3, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    roles = [e for e in events[:3]]
    assert [r["choices"] for r in roles] == [
        [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        for i in range(3)
    ]
    token_chunks = events[3:-1]
    assert all(len(e["choices"]) == 1 for e in token_chunks)
    # Continuous usage counts the chunk's own choice.
    seen = {0: 0, 1: 0, 2: 0}
    for e in token_chunks:
        i = e["choices"][0]["index"]
        seen[i] += 1
        assert e["usage"]["completion_tokens"] == seen[i]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 18
    agg = aggregate(events, chat=True)
    assert [agg[i]["text"] for i in range(3)] == texts
    assert all(agg[i]["finish"] == "length" for i in range(3))
    completions = post(client, url, {"prompt": "hello", "max_tokens": 4, "n": 2}, chat=False)
    assert [c["index"] for c in completions["choices"]] == [0, 1]
    assert completions["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_logprobs_stream_equals_whole(client: httpx.Client, url: str, chat: bool) -> None:
    if chat:
        body: dict[str, Any] = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 4}
    else:
        body = {"prompt": "hello there", "logprobs": 4}
    body.update(max_tokens=5, ignore_eos=True, n=2)
    whole = post(client, url, body, chat)
    agg = aggregate(stream(client, url, body, chat), chat)
    for choice in whole["choices"]:
        lp = choice["logprobs"]
        assert agg[choice["index"]]["logprobs"] == lp
        if chat:
            assert len(lp["content"]) == 5
            for entry in lp["content"]:
                assert len(entry["top_logprobs"]) == 4
                assert entry["top_logprobs"][0]["token"] == entry["token"]
                assert entry["logprob"] == max(t["logprob"] for t in entry["top_logprobs"])
            assert "".join(e["token"] for e in lp["content"]) == choice["message"]["content"]
        else:
            assert "".join(lp["tokens"]) == choice["text"]
            assert lp["text_offset"][0] == 0
            assert all(len(t) == 4 for t in lp["top_logprobs"])
            assert lp["token_logprobs"] == [max(t.values()) for t in lp["top_logprobs"]]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_strings_end_the_answer_as_vllm_ends_it(
    client: httpx.Client, url: str, chat: bool
) -> None:
    """A stop string cuts the text before it (through it with include_stop_str_in_output),
    ends the choice with finish reason stop and the string as its stop reason, and counts the
    tokens up to the one that completed it; not before min_tokens; a stream holds back what
    could be a stop string's start, and aggregates to the whole answer."""
    prompt = {"messages": MESSAGES} if chat else {"prompt": "a story about routers"}
    base = {**prompt, "max_tokens": 30, "temperature": 0}

    def text_of(answer: dict[str, Any]) -> str:
        choice = answer["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]

    whole = post(client, url, base, chat)
    full = text_of(whole)
    words = full.split()
    stop = words[4][1:3]  # inside the fifth word: the text before it ends mid-word
    at = full.index(stop)
    cases = [
        ({"stop": [stop]}, full[:at], "stop", stop),
        (
            {"stop": ["never", stop], "include_stop_str_in_output": True},
            full[: at + 2],
            "stop",
            stop,
        ),
        ({"stop": stop}, full[:at], "stop", stop),
        ({"stop": ["never appears"]}, full, "length", None),
    ]
    for extra, text, finish, reason in cases:
        answer = post(client, url, {**base, **extra}, chat)
        choice = answer["choices"][0]
        assert (text_of(answer), choice["finish_reason"], choice["stop_reason"]) == (
            text,
            finish,
            reason,
        ), extra
        tokens = answer["usage"]["completion_tokens"]
        assert tokens == (30 if reason is None else len(full[: at + 2].split())), extra
        events = stream(
            client, url, {**base, **extra, "stream_options": {"include_usage": True}}, chat
        )
        streamed = aggregate(events, chat)[0]
        assert (streamed["text"], streamed["finish"]) == (text, finish), extra
        last = [e for e in events if e["choices"]][-1]["choices"][0]
        assert last["stop_reason"] == reason
        assert events[-1]["usage"]["completion_tokens"] == tokens
        if reason is not None and "include_stop_str_in_output" not in extra:
            # No chunk ever showed the stop string's first character after the cut.
            seen = ""
            for event in events:
                for c in event["choices"]:
                    seen += (c["delta"].get("content") or "") if chat else c["text"]
                    assert text.startswith(seen) and len(seen) <= len(text)
    # min_tokens past the stop string's token: not checked before it, so it runs on.
    answer = post(client, url, {**base, "stop": [stop], "min_tokens": len(words)}, chat)
    assert answer["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_end_the_answer_as_vllm_ends_it(client: httpx.Client, url: str) -> None:
    """A stop token id ends the choice (finish reason stop, the id as stop reason), counted,
    its text left out unless include_stop_str_in_output (vLLM's detokenizer skips a
    stop-terminated request's last token); not before min_tokens."""
    base = {"prompt": "a story about routers", "max_tokens": 30, "temperature": 0}
    whole = post(client, url, {**base, "return_token_ids": True}, chat=False)["choices"][0]
    ids, text = whole["token_ids"], whole["text"]
    stop_id = ids[5]
    cut = ids.index(stop_id)  # its first occurrence ends the answer
    before = first_words(ids[:cut], text)
    for extra, want in (
        ({"stop_token_ids": [stop_id]}, before),
        ({"stop_token_ids": [stop_id], "include_stop_str_in_output": True}, None),
    ):
        answer = post(client, url, {**base, **extra}, chat=False)
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id, extra
        assert answer["usage"]["completion_tokens"] == cut + 1
        if want is not None:
            assert choice["text"] == want
        else:
            assert choice["text"].startswith(before) and len(choice["text"]) > len(before)
        events = stream(
            client, url, {**base, **extra, "stream_options": {"include_usage": True}}, False
        )
        assert aggregate(events, False)[0]["text"] == choice["text"]
        assert [e for e in events if e["choices"]][-1]["choices"][0]["stop_reason"] == stop_id
    late = post(client, url, {**base, "stop_token_ids": [stop_id], "min_tokens": cut + 2}, False)
    assert late["choices"][0]["finish_reason"] == "length"


def first_words(ids: list[int], text: str) -> str:
    """The text of the first ``len(ids)`` tokens of an answer whose words are one token each
    (the simulated model writes words with a leading space)."""
    words = text.split(" ")[1:]
    return "".join(" " + w for w in words[: len(ids)])


@pytest.mark.parametrize(
    ("tool_choice", "finish", "arguments"),
    [
        (NAMED, "stop", ARGS),
        ("required", "tool_calls", ARGS),
    ],
    ids=["named", "required"],
)
def test_forced_tool_calls(
    client: httpx.Client, url: str, tool_choice: Any, finish: str, arguments: str
) -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": tool_choice}
    same_id = {"X-Request-Id": f"tools-{finish}"}
    whole = post(client, url, body, headers=same_id)
    choice = whole["choices"][0]
    message = choice["message"]
    assert message["content"] == ""
    assert choice["finish_reason"] == finish
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": arguments}
    # Every character of the arguments, the call's frame and EOS are completion tokens.
    frame = 0 if tool_choice == NAMED else len('[{"name": "get_weather", "parameters": }]')
    assert whole["usage"]["completion_tokens"] == len(arguments) + frame + 1
    events = stream(client, url, body, headers=same_id)
    agg = aggregate(events, chat=True)[0]
    assert agg["text"] == ""
    assert agg["finish"] == finish
    assert agg["calls"] == {
        0: {
            "id": agg["calls"][0]["id"],
            "type": "function",
            "name": "get_weather",
            "arguments": arguments,
        }
    }
    # Ids are deterministic in the response id (vLLM's are random): a stream aggregates to
    # exactly the non-streamed answer of the same request id.
    assert agg["calls"][0]["id"] == call["id"]


def test_truncated_tool_call_finishes_by_length(client: httpx.Client, url: str) -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 5}
    choice = post(client, url, body)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == ARGS[:5]
    required = post(client, url, {**body, "tool_choice": "required"})["choices"][0]
    assert required["finish_reason"] == "length"
    assert "tool_calls" not in required["message"]  # vLLM drops an empty list


def test_auto_and_none_answer_text(client: httpx.Client, url: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True}
    plain = post(client, url, body)
    for extra in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"}):
        got = post(client, url, {**body, **extra})
        assert got["choices"] == plain["choices"]


def test_response_formats(client: httpx.Client, url: str) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "score": {"type": "number", "minimum": 2}},
        "required": ["answer", "score"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    chat = post(client, url, {"messages": MESSAGES, "response_format": fmt})
    assert json.loads(chat["choices"][0]["message"]["content"]) == {"answer": "", "score": 2}
    assert chat["choices"][0]["finish_reason"] == "stop"
    text = post(
        client, url, {"prompt": "x", "response_format": {"type": "json_object"}}, chat=False
    )
    assert json.loads(text["choices"][0]["text"]) == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": "hot"}, "body.temperature"),
        ({"top_p": 0}, "top_p"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logprobs": True, "top_logprobs": 30}, "logprobs"),
    ],
)
def test_bad_fields_are_400(
    client: httpx.Client, url: str, body: dict[str, Any], param: str
) -> None:
    r = client.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == 400 and error["param"] == param and error["message"]


def test_the_openai_sdk_reads_it(url: str) -> None:
    # Closed: an SDK client left to the garbage collector warns of its socket in whichever
    # test the collection lands (seen failing another test's file under xdist).
    with openai.OpenAI(base_url=url + "/v1", api_key="x") as sdk:
        reply = sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=NAMED,  # type: ignore[arg-type]
            logprobs=True,
            top_logprobs=2,
            n=2,
        )
    assert [c.index for c in reply.choices] == [0, 1]
    calls = reply.choices[1].message.tool_calls
    assert calls is not None and calls[0].function.arguments == ARGS  # type: ignore[union-attr]
    assert reply.choices[0].logprobs is not None
    assert reply.choices[0].logprobs.content is not None
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2
