"""The Responses API translated to chat completions and back: the chat body a request runs as,
what is refused (naming the field), the ``response`` object and the SSE events a chat answer
becomes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from narwhal.serve.errors import InvalidRequest, NotFound
from narwhal.serve.responses_output import ResponseEventStream, response_object
from narwhal.serve.responses_request import (
    ResponsesRequest,
    parse_responses_request,
    to_chat_body,
)

MODEL = "m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def chat_of(**body: Any) -> dict[str, Any]:
    return to_chat_body({"model": MODEL, **body}).chat_body


def test_a_string_input_with_instructions() -> None:
    chat = chat_of(input="hi", instructions="be brief", max_output_tokens=5, temperature=0.2)
    assert chat == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ],
        "max_tokens": 5,
        "temperature": 0.2,
        # vLLM's Responses path adds special tokens (its chat path does not).
        "add_special_tokens": True,
    }


def test_message_items_and_tool_turns_become_chat_messages() -> None:
    chat = chat_of(
        input=[
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "t"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "done", "annotations": []}],
            },
            {"role": "user", "content": "thanks"},
        ]
    )
    assert chat["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        # vLLM's construct_chat_messages_with_tool_call: reasoning and calls are one turn
        {
            "role": "assistant",
            "content": None,
            "reasoning": "t",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "thanks"},
    ]


def test_an_image_by_url_is_an_image_url_part() -> None:
    part = {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"}
    chat = chat_of(input=[{"role": "user", "content": [part]}])
    assert chat["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}}
    ]


def test_tools_choice_format_reasoning_and_streaming() -> None:
    chat = chat_of(
        input="q",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
        reasoning={"effort": "low", "summary": "auto"},
        seed=3,
        stop=["x"],
        stream=True,
    )
    assert chat["tools"] == [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "object"}},
    }
    assert chat["reasoning_effort"] == "low"
    assert (chat["seed"], chat["stop"]) == (3, ["x"])
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat_of(input="q", text={"format": {"type": "json_object"}})["response_format"] == {
        "type": "json_object"
    }
    assert "response_format" not in chat_of(input="q", text={"format": {"type": "text"}})
    # without tools, auto and none mean no tool (vLLM's check_tool_usage)
    assert "tool_choice" not in chat_of(input="q", tool_choice="auto")


def test_logprobs_and_partial_assistant_continuation() -> None:
    request = to_chat_body(
        {
            "model": MODEL,
            "input": [
                {"role": "user", "content": "q"},
                {"type": "message", "role": "assistant", "status": "incomplete", "content": "par"},
            ],
            "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
            "top_logprobs": 2,
        }
    )
    assert request.logprobs
    chat = request.chat_body
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False


def test_an_absent_store_is_stateless_and_echoed_false() -> None:
    request = to_chat_body({"model": MODEL, "input": "q"})
    assert request.echo["store"] is False and "store" not in request.chat_body
    assert to_chat_body({"model": MODEL, "input": "q", "store": False}).echo["store"] is False
    # vLLM without its store (its default) serves store: true as false rather than refuse it.
    stored = to_chat_body({"model": MODEL, "input": "q", "store": True})
    assert stored.echo["store"] is False and "store" not in stored.chat_body


@pytest.mark.parametrize("cap", ["2", 2.0, 2])
def test_the_response_repeats_the_cap_and_top_logprobs_as_applied(cap: Any) -> None:
    """As vLLM's from_request: the output cap it used (an integer, whatever form was sent),
    and top logprobs only when logprobs are included (they are not computed otherwise)."""
    body = {"model": MODEL, "input": "q", "max_output_tokens": cap, "top_logprobs": 3}
    request = to_chat_body(body)
    assert request.echo["max_output_tokens"] == 2 and type(request.echo["max_output_tokens"]) is int
    assert request.echo["top_logprobs"] is None
    included = to_chat_body({**body, "include": ["message.output_text.logprobs"]})
    assert included.echo["top_logprobs"] == 3
    assert to_chat_body({"model": MODEL, "input": "q"}).echo["max_output_tokens"] is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"truncation": "auto"}, "truncation"),
        ({"kv_transfer_params": {}}, "kv_transfer_params"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": []}]}, "tools[1]"),
        ({"tools": [{"type": "code_interpreter", "container": "auto"}]}, "tools[0]"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools[0]"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0]"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"include": ["message.input_image.image_url"]}, "include[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
            "input[0].encrypted_content",
        ),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(fields, param) -> None:
    body = {"model": MODEL, "input": "q", **fields}
    with pytest.raises(InvalidRequest) as caught:
        to_chat_body(body)
    assert caught.value.param == param
    assert caught.value.status == 400 and caught.value.body()["error"]["param"] == param


def test_a_refusal_says_why() -> None:
    with pytest.raises(InvalidRequest, match="keeps no conversation state"):
        to_chat_body({"model": MODEL, "input": "q", "conversation": "conv_1"})
    # An id the router cannot hold is vLLM's 404 for an id its store does not hold.
    with pytest.raises(NotFound, match="'resp_1' not found: the router stores no responses"):
        to_chat_body({"model": MODEL, "input": "q", "previous_response_id": "resp_1"})
    with pytest.raises(InvalidRequest, match="built-in tool 'web_search'"):
        to_chat_body({"model": MODEL, "input": "q", "tools": [{"type": "web_search"}]})


@pytest.mark.parametrize("raw", [b"{", b"[]"])
def test_a_body_that_is_not_an_object_is_refused(raw) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_responses_request(raw)
    assert caught.value.param is None


# --- chat answers back to Responses ---------------------------------------------------------

USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 4,
    "total_tokens": 14,
    "prompt_tokens_details": {"cached_tokens": 8},
}


def request_of(**body: Any) -> ResponsesRequest:
    return to_chat_body({"model": MODEL, "input": "q", **body})


def sdk(obj: dict[str, Any]) -> Response:
    """The object as the SDK's model validates it (strictly, not the SDK's lenient parse)."""
    return Response.model_validate(obj)


def test_a_text_completion_is_a_message_item() -> None:
    chat = {
        "id": "chatcmpl-1",
        "created": 7,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello", "reasoning": "think"},
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
    obj = response_object(chat, request_of(temperature=0.5, metadata={"k": "v"}), "resp_x")
    got = sdk(obj)
    assert (got.id, got.object, got.created_at, got.status) == (
        "resp_x",
        "response",
        7,
        "completed",
    )
    assert [item.type for item in got.output] == ["reasoning", "message"]
    assert got.output_text == "hello" and got.output[1].content[0].annotations == []
    assert got.output[0].content[0].text == "think"
    assert got.usage.input_tokens == 10 and got.usage.output_tokens == 4
    assert got.usage.total_tokens == 14 and got.usage.input_tokens_details.cached_tokens == 8
    assert got.temperature == 0.5 and got.metadata == {"k": "v"} and got.incomplete_details is None


def test_a_cut_completion_is_incomplete() -> None:
    chat = {
        "created": 1,
        "model": MODEL,
        "choices": [{"message": {"content": "par"}, "finish_reason": "length"}],
        "usage": USAGE,
    }
    obj = response_object(chat, request_of(max_output_tokens=4), "resp_x")
    got = sdk(obj)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.max_output_tokens == 4
    # As vLLM 0.32 answers: the message item is completed (the response says incomplete), its
    # text part names logprobs (null, not asked for), and without tools the choice is none.
    assert obj["output"][0]["status"] == "completed"
    assert obj["output"][0]["content"][0]["logprobs"] is None
    assert obj["tool_choice"] == "none" and obj["tools"] == []
    with_tools = response_object(chat, request_of(tools=[WEATHER]), "resp_y")
    assert with_tools["tool_choice"] == "auto"


def test_tool_calls_are_function_call_items() -> None:
    chat = {
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "message": {
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": USAGE,
    }
    request = request_of(tools=[WEATHER], tool_choice="required")
    got = sdk(response_object(chat, request, "resp_x"))
    (call,) = got.output
    assert call.type == "function_call" and call.call_id == "call_1"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert got.tool_choice == "required" and got.tools[0].name == "get_weather"


_SDK_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == "event: " + event["type"]
        _SDK_EVENT.validate_python(event)  # each event as the SDK's own model has it
        events.append(event)
    return events


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_chat_stream_becomes_responses_events() -> None:
    stream = ResponseEventStream(request_of(stream=True), "resp_x", 5, MODEL)
    raw = stream.start()
    for chunk in (
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning": "hm"}),
        _chunk({"content": "he"}),
        _chunk({"content": "llo"}, "stop"),
        {"choices": [], "usage": USAGE},
    ):
        raw += stream.chunk(chunk)
    raw += stream.finish()
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events[2:15]] == [0] * 6 + [1] * 7
    final = sdk(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "hello"
    assert final.usage.output_tokens == 4 and [i.type for i in final.output] == [
        "reasoning",
        "message",
    ]
    assert sdk(events[0]["response"]).status == "in_progress"


def test_streamed_tool_calls_are_function_call_events() -> None:
    stream = ResponseEventStream(request_of(stream=True, tools=[WEATHER]), "resp_x", 5, MODEL)
    raw = b""
    for chunk in (
        _chunk(
            {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]}
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
        _chunk(
            {"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "g", "arguments": "{}"}}]}
        ),
        _chunk({}, "tool_calls"),
    ):
        raw += stream.chunk(chunk)
    raw += stream.finish()
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[3]["arguments"] == '{"a": 1}'
    final = sdk(events[-1]["response"])
    assert [(i.call_id, i.name, i.arguments) for i in final.output] == [
        ("c1", "f", '{"a": 1}'),
        ("c2", "g", "{}"),
    ]


def test_a_cut_stream_completes_incomplete_and_an_error_is_an_error_event() -> None:
    stream = ResponseEventStream(request_of(stream=True), "resp_x", 5, MODEL)
    stream.chunk(_chunk({"content": "par"}, "length"))
    events = _events(stream.finish())
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    # The message item is done as completed, as vLLM's stream says it (the response is not).
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["status"] for e in done] == ["completed"]
    assert final["output"][0]["status"] == "completed"
    broken = ResponseEventStream(request_of(stream=True), "resp_x", 5, MODEL)
    broken.chunk(_chunk({"content": "par"}))
    (event,) = _events(
        broken.error({"error": {"message": "decode failed", "type": "upstream_error", "code": 502}})
    )
    assert event["type"] == "error" and event["message"] == "decode failed"
    assert event["code"] == "502" and broken.closed
