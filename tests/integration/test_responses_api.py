"""``POST /v1/responses`` through narwhal-serve on a live simulated fleet, with the ``openai``
SDK (sync and async, streamed and not): each answer is the chat answer through the router for
the same input (the simulated model is deterministic), each request one journal record."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, RouterProcess, admin, running_fleet, running_router

INSTRUCTIONS = "You answer briefly."
QUESTION = "What is the weather in Oslo?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, RouterProcess]]:
    directory = tmp_path_factory.mktemp("responses-api")
    with (
        running_fleet(directory, 2) as fleet,
        running_router(directory, fleet.fleet_path) as router,
    ):
        yield fleet, router


@pytest.fixture
def client(stack) -> Iterator[openai.OpenAI]:
    """An SDK client on the router, closed at the end of the test (an unclosed one warns)."""
    made = openai.OpenAI(base_url=stack[1].url + "/v1", api_key="x", max_retries=0)
    yield made
    made.close()


@pytest.fixture
async def async_client(stack) -> AsyncIterator[openai.AsyncOpenAI]:
    made = openai.AsyncOpenAI(base_url=stack[1].url + "/v1", api_key="x", max_retries=0)
    yield made
    await made.close()


def _end(router: RouterProcess, rid: str) -> dict[str, Any]:
    assert wait_until(lambda: rid in router.ends(), 5), f"no request.end for {rid}"
    end = router.ends()[rid]  # ends() fails on a second record for one id
    assert end["endpoint"] == "/v1/responses"
    return end


def _rid(response_id: str) -> str:
    assert response_id.startswith("resp_")
    return response_id[len("resp_") :]


def _chat(client: openai.OpenAI, max_tokens: int, **body: Any) -> Any:
    """The same question through the router's chat route."""
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
    ]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, **body
    )


@pytest.mark.parametrize("max_tokens", [40, 3], ids=["whole", "cut"])
def test_a_text_answer_is_the_chat_answer(stack, client, max_tokens) -> None:
    _, router = stack
    chat = _chat(client, max_tokens)
    got = client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=QUESTION,
        max_output_tokens=max_tokens,
        store=False,
    )
    assert got.object == "response" and got.model == MODEL
    assert got.output_text == chat.choices[0].message.content
    (item,) = got.output
    assert item.type == "message" and item.content[0].annotations == []
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == chat.usage.completion_tokens
    assert got.usage.total_tokens == chat.usage.total_tokens
    assert got.usage.input_tokens_details.cached_tokens >= 0
    assert got.usage.output_tokens_details.reasoning_tokens == 0
    assert got.instructions == INSTRUCTIONS and got.max_output_tokens == max_tokens
    if chat.choices[0].finish_reason == "length":
        assert got.status == "incomplete"
        assert got.incomplete_details.reason == "max_output_tokens"
    else:
        assert got.status == "completed" and got.incomplete_details is None
    if max_tokens == 3:
        assert got.status == "incomplete" and got.usage.output_tokens == 3
    end = _end(router, _rid(got.id))
    assert end["outcome"] == "ok" and end["completion_tokens"] == got.usage.output_tokens


def test_a_streamed_answer_is_the_chat_answer(stack, client) -> None:
    _, router = stack
    chat = _chat(client, 12)
    events = list(
        client.responses.create(
            model=MODEL,
            instructions=INSTRUCTIONS,
            input=QUESTION,
            max_output_tokens=12,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == chat.choices[0].message.content
    done = events[-1].response
    assert done.output_text == text and done.id == events[0].response.id
    assert done.usage.input_tokens == chat.usage.prompt_tokens
    assert done.usage.output_tokens == chat.usage.completion_tokens
    assert _end(router, _rid(done.id))["outcome"] == "ok"
    # The SDK's stream helper assembles the same response.
    with client.responses.stream(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12
    ) as stream:
        final = stream.get_final_response()
    assert final.output_text == text and final.status == done.status
    _end(router, _rid(final.id))


async def test_async_clients_stream_and_not(stack, async_client) -> None:
    _, router = stack
    body: dict[str, Any] = dict(model=MODEL, input=QUESTION, max_output_tokens=6)
    whole = await async_client.responses.create(**body)
    text = ""
    completed = None
    async for event in await async_client.responses.create(stream=True, **body):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.completed":
            completed = event.response
    assert completed is not None and text == whole.output_text == completed.output_text
    assert completed.usage.output_tokens == whole.usage.output_tokens
    for response in (whole, completed):
        assert _end(router, _rid(response.id))["outcome"] == "ok"


def test_a_named_function_tool_gives_a_function_call(stack, client) -> None:
    _, router = stack
    body: dict[str, Any] = dict(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=160,
    )
    got = client.responses.create(**body)
    assert got.status == "completed"  # the forced arguments end with the model's EOS
    (call,) = got.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    arguments = json.loads(call.arguments)  # the simulated engine forces valid arguments
    assert set(arguments) >= {"city", "unit"}
    assert got.tool_choice.name == "get_weather" and got.tools[0].name == "get_weather"
    assert _end(router, _rid(got.id))["outcome"] == "ok"
    streamed = list(client.responses.create(stream=True, **body))
    deltas = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == call.arguments
    (item,) = streamed[-1].response.output
    assert item.type == "function_call" and item.arguments == call.arguments
    # The next turn, stateless: the call and its output sent back as input items.
    follow = client.responses.create(
        model=MODEL,
        input=[
            *body["input"],
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "12 C, sunny"},
        ],
        tools=[WEATHER],
        max_output_tokens=8,
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "12 C, sunny"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        max_tokens=8,
    )
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("background", True, "background"),
        ("tools", [{"type": "web_search"}], "tools[0]"),
    ],
)
def test_what_needs_state_is_refused_with_the_field(stack, field, value, param) -> None:
    _, router = stack
    r = httpx.post(
        router.url + "/v1/responses",
        json={"model": MODEL, "input": QUESTION, field: value},
        timeout=10,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    end = _end(router, r.headers["x-request-id"])
    assert end["outcome"] == "client_error" and end["status"] == 400


def test_a_refusal_names_the_responses_field_not_the_chat_one(stack, client) -> None:
    # max_output_tokens becomes the chat body's max_tokens; a refusal of it names the field
    # the client sent, as vLLM's own Responses endpoint does.
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10**6)
    assert caught.value.param == "max_output_tokens"
    assert "- max_output_tokens=1000000 cannot be greater" in caught.value.message
    _, router = stack
    rid = caught.value.response.headers["x-request-id"]
    assert _end(router, rid)["outcome"] == "client_error"


def test_the_sdk_raises_the_refusal(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=QUESTION, conversation="conv_1")
    assert caught.value.param == "conversation"
    assert "conversation state" in caught.value.message
    # As vLLM answers an id its store does not hold (the router holds none).
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_1")
    assert missing.value.param == "previous_response_id"
    assert "stores no responses" in missing.value.message


def test_store_true_is_answered_without_storing(client) -> None:
    """vLLM without its store (its default) serves store: true, answering store false."""
    answer = client.responses.create(model=MODEL, input=QUESTION, store=True, max_output_tokens=4)
    assert answer.store is False and answer.status in ("completed", "incomplete")


def test_bad_json_is_a_400_in_the_chat_paths_shape(stack) -> None:
    _, router = stack
    r = httpx.post(
        router.url + "/v1/responses",
        content=b"{",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert _end(router, r.headers["x-request-id"])["outcome"] == "client_error"


def test_a_stream_broken_mid_answer_ends_with_an_error_event(stack, client) -> None:
    fleet, router = stack
    try:
        for engine in fleet.engines.values():
            assert admin(engine.url, "POST", {"drop_stream_after_tokens": 2}).is_success
        events = list(
            client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, stream=True)
        )
    finally:
        for engine in fleet.engines.values():
            admin(engine.url, "DELETE")
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "error"
    assert "response.completed" not in kinds
    # Each break is continued on another engine (routing.migration) while one is left that
    # has not failed the request, and every engine breaks its streams after 2 tokens: 2 tokens
    # from each leg, then the error event.
    assert events[-1].message
    end = _end(router, _rid(events[0].response.id))
    assert end["outcome"] == "stream_error" and end["migrations"] >= 1
    assert kinds.count("response.output_text.delta") == 2 * (end["migrations"] + 1)
