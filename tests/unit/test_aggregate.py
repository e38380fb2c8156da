"""The router's non-streamed answer, joined from the decode engine's stream: what a lone vLLM
engine answers unstreamed (tool calls by index, logprobs in order, several choices)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from narwhal.serve.errors import UpstreamFailed
from narwhal.serve.migration import Migrator
from narwhal.serve.record import RequestRecord
from narwhal.serve.relay import StreamTally, aggregate


class _Events:
    def __init__(self, batches: list[list[bytes]]) -> None:
        self.batches = batches

    async def next_batch(self) -> list[bytes]:
        return self.batches.pop(0) if self.batches else []


def _run(chunks: list[dict[str, Any] | bytes], chat: bool = True, body: dict | None = None):
    payloads = [c if isinstance(c, bytes) else orjson.dumps(c) for c in chunks]
    stream = SimpleNamespace(
        first_events=payloads[:1],
        events=_Events([[p] for p in payloads[1:]]),
        prefill_prompt_tokens=11,
    )
    record = RequestRecord(id="r", arrival=0.0, arrival_mono=0.0, endpoint="/v1/x")
    tally = StreamTally()
    migrator = Migrator(None, None, record, stream, None)  # type: ignore[arg-type]
    result = asyncio.run(aggregate(migrator, chat, tally, None, body or {}))
    return result, tally


def _chunk(index: int, delta: dict[str, Any], finish: str | None = None, **more: Any):
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, **more}
    return {"id": "chatcmpl-1", "created": 5, "model": "m", "choices": [choice]}


USAGE = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 7}}


def test_tool_calls_are_assembled_by_index() -> None:
    call0 = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get"}}
    call1 = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "put"}}
    chunks = [
        _chunk(0, {"role": "assistant", "content": ""}),
        _chunk(0, {"tool_calls": [call0]}),
        _chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _chunk(0, {"tool_calls": [call1]}),
        _chunk(0, {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}),
        _chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
        _chunk(0, {}, "tool_calls"),
        USAGE,
        b"[DONE]",
    ]
    result, tally = _run(chunks)
    (choice,) = result["choices"]
    message = choice["message"]
    assert message["tool_calls"] == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get", "arguments": '{"city": "Oslo"}'},
        },
        {"id": "call_b", "type": "function", "function": {"name": "put", "arguments": "{}"}},
    ]
    # auto: vLLM's parser leaves no content when everything went to tool calls
    assert message["content"] is None
    assert choice["finish_reason"] == "tool_calls"
    assert result["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 7,
        "total_tokens": 18,
        # as vLLM 0.32 writes a whole answer's usage
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    # a tool-call delta is output: the first token is the first tool-call delta
    assert tally.token_events == 6 and tally.first_token_at is not None
    # a named or required tool choice answers content "" (vLLM: content or "")
    named = {"tool_choice": {"type": "function", "function": {"name": "get"}}}
    assert _run(chunks, body=named)[0]["choices"][0]["message"]["content"] == ""
    assert (
        _run(chunks, body={"tool_choice": "required"})[0]["choices"][0]["message"]["content"] == ""
    )


def test_reasoning_content_and_logprobs_are_joined_in_order() -> None:
    def lp(token: str) -> dict[str, Any]:
        return {"content": [{"token": token, "logprob": -0.5, "bytes": [1], "top_logprobs": []}]}

    chunks = [
        _chunk(0, {"role": "assistant", "content": ""}),
        _chunk(0, {"reasoning": "think "}, logprobs=lp("think")),
        _chunk(0, {"reasoning": "more"}, logprobs=lp("more")),
        _chunk(0, {"content": "Hello"}, logprobs=lp("Hello")),
        _chunk(0, {"content": " world"}, "stop", logprobs=lp(" world"), stop_reason=None),
        USAGE,
        b"[DONE]",
    ]
    result, _ = _run(chunks)
    (choice,) = result["choices"]
    assert choice["message"]["content"] == "Hello world"
    assert choice["message"]["reasoning"] == "think more"
    assert [t["token"] for t in choice["logprobs"]["content"]] == [
        "think",
        "more",
        "Hello",
        " world",
    ]
    assert choice["finish_reason"] == "stop"


def test_completion_logprobs_concatenate_field_by_field() -> None:
    def chunk(text: str, offset: int, finish: str | None = None) -> dict[str, Any]:
        logprobs = {
            "text_offset": [offset],
            "token_logprobs": [-0.1],
            "tokens": [text],
            "top_logprobs": [{text: -0.1}],
        }
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {"id": "cmpl-1", "created": 1, "model": "m", "choices": [choice]}

    result, _ = _run(
        [chunk("a", 0), chunk("bc", 1), chunk("d", 3, "length"), USAGE, b"[DONE]"], chat=False
    )
    (choice,) = result["choices"]
    assert choice["text"] == "abcd"
    assert choice["logprobs"] == {
        "text_offset": [0, 1, 3],
        "token_logprobs": [-0.1, -0.1, -0.1],
        "tokens": ["a", "bc", "d"],
        "top_logprobs": [{"a": -0.1}, {"bc": -0.1}, {"d": -0.1}],
    }
    assert choice["finish_reason"] == "length"


def test_several_choices_keep_their_indices() -> None:
    chunks = [
        _chunk(0, {"role": "assistant", "content": ""}),
        _chunk(1, {"role": "assistant", "content": ""}),
        _chunk(1, {"content": "b"}),
        _chunk(0, {"content": "a"}),
        _chunk(1, {}, "length"),
        _chunk(0, {}, "stop"),
        USAGE,
        b"[DONE]",
    ]
    result, _ = _run(chunks)
    assert [
        (c["index"], c["message"]["content"], c["finish_reason"]) for c in result["choices"]
    ] == [
        (0, "a", "stop"),
        (1, "b", "length"),
    ]


def test_a_stream_without_done_is_a_failure() -> None:
    with pytest.raises(UpstreamFailed):
        _run([_chunk(0, {"content": "a"})])
