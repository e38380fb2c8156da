"""From an open decode stream to the client: SSE relay or one aggregated response.

Chunks pass through as the engine wrote them; only the final usage chunk is rewritten, so the
client's ``usage`` counts the prompt as the prefill engine did and the completion as the decode
engine did (and it is dropped when the client did not ask for it: the router always asks, to
know the count). An engine error or a stream that ends without ``[DONE]`` after the first token
ends the client's stream with an OpenAI error event, never a silent truncation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from narwhal.engines.transport import EngineTransportError
from narwhal.serve.errors import RouterError, error_body
from narwhal.serve.pd import DecodeStream
from narwhal.serve.record import RequestRecord

__all__ = ["DONE_EVENT", "StreamFailed", "StreamTally", "aggregate", "relay_events"]

DONE_EVENT = b"data: [DONE]\n\n"


@dataclass
class StreamTally:
    """Token accounting for one decode stream."""

    completion_tokens: int | None = None
    prompt_tokens: int | None = None  # as the decode engine's usage counts them
    token_events: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    done: bool = False


def _usage(usage: dict[str, Any], prompt_tokens: int | None) -> dict[str, Any]:
    out = dict(usage)
    if prompt_tokens is not None:
        out["prompt_tokens"] = prompt_tokens
        completion = out.get("completion_tokens") or 0
        out["total_tokens"] = prompt_tokens + completion
    return out


def _is_token_chunk(obj: dict[str, Any]) -> tuple[bool, str | None]:
    has_token = False
    finish = None
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                has_token = True
        elif choice.get("text"):
            has_token = True
        if choice.get("finish_reason"):
            finish = choice["finish_reason"]
    return has_token, finish


def _note(tally: StreamTally, obj: dict[str, Any], now: float) -> None:
    has_token, finish = _is_token_chunk(obj)
    if has_token or finish:
        tally.token_events += 1
        if tally.first_token_at is None:
            tally.first_token_at = now
        tally.last_token_at = now
    if finish:
        tally.finish_reason = finish


async def relay_events(
    stream: DecodeStream, include_usage: bool, tally: StreamTally
) -> AsyncIterator[bytes]:
    """Yield SSE bytes for the client: every event of one upstream read in one piece, so a
    burst from the engine costs one client write. Raises nothing upstream-related: errors
    become events, then ``StreamFailed``."""
    batch = stream.first_events
    try:
        while True:
            out: list[bytes] = []
            now = time.monotonic()
            for payload in batch:
                if payload == b"[DONE]":
                    tally.done = True
                    out.append(DONE_EVENT)
                    yield b"".join(out)
                    return
                obj = orjson.loads(payload)
                if isinstance(obj, dict) and "error" in obj:
                    out += (b"data: ", payload, b"\n\n", DONE_EVENT)
                    yield b"".join(out)
                    raise _StreamFailed(
                        str((obj.get("error") or {}).get("message", "engine error"))
                    )
                if isinstance(obj, dict) and obj.get("usage") and not obj.get("choices"):
                    tally.completion_tokens = obj["usage"].get("completion_tokens")
                    tally.prompt_tokens = obj["usage"].get("prompt_tokens")
                    if include_usage:
                        obj["usage"] = _usage(obj["usage"], stream.prefill_prompt_tokens)
                        out += (b"data: ", orjson.dumps(obj), b"\n\n")
                else:
                    if isinstance(obj, dict):
                        _note(tally, obj, now)
                    out += (b"data: ", payload, b"\n\n")
            if out:
                yield b"".join(out)
            batch = await stream.events.next_batch()
            if not batch:
                raise _StreamFailed("the decode engine closed the stream early")
    except (EngineTransportError, ValueError) as exc:
        message = f"decode stream broke: {type(exc).__name__}: {exc}"
        yield (
            b"data: "
            + orjson.dumps(error_body(message, "upstream_error", None, 502))
            + b"\n\n"
            + DONE_EVENT
        )
        raise _StreamFailed(message) from None


class _StreamFailed(Exception):
    pass


StreamFailed = _StreamFailed


async def aggregate(
    stream: DecodeStream,
    chat: bool,
    tally: StreamTally,
    record: RequestRecord,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """Collect a decode stream into one non-streamed OpenAI response."""
    texts: list[str] = []
    reasoning: list[str] = []
    token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    head: dict[str, Any] | None = None
    stop_reason = None
    batch, i = stream.first_events, 0
    try:
        while True:
            if i == len(batch):
                batch, i = await stream.events.next_batch(), 0
                if not batch:
                    raise RouterError(
                        502,
                        "the decode engine closed the stream early",
                        "upstream_error",
                        "stream_error",
                    )
            payload = batch[i]
            i += 1
            if payload == b"[DONE]":
                break
            obj = orjson.loads(payload)
            if not isinstance(obj, dict):
                raise RouterError(
                    502, "malformed chunk from the decode engine", "upstream_error", "decode_failed"
                )
            if "error" in obj:
                message = str((obj.get("error") or {}).get("message", "engine error"))
                raise RouterError(
                    502,
                    f"decode failed mid-generation: {message}",
                    "upstream_error",
                    "stream_error",
                )
            head = head or obj
            if obj.get("usage") and not obj.get("choices"):
                usage = obj["usage"]
            _note(tally, obj, time.monotonic())
            for choice in obj.get("choices") or ():
                if chat:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        texts.append(delta["content"])
                    more = delta.get("reasoning") or delta.get("reasoning_content")
                    if more:
                        reasoning.append(more)
                elif choice.get("text"):
                    texts.append(choice["text"])
                if isinstance(choice.get("token_ids"), list):
                    token_ids = token_ids or []
                    token_ids.extend(choice["token_ids"])
                if choice.get("stop_reason") is not None:
                    stop_reason = choice["stop_reason"]
    except (EngineTransportError, ValueError) as exc:
        raise RouterError(
            502,
            f"decode stream broke: {type(exc).__name__}: {exc}",
            "upstream_error",
            "stream_error",
        ) from None
    tally.done = True
    if usage is not None:
        tally.completion_tokens = usage.get("completion_tokens")
        tally.prompt_tokens = usage.get("prompt_tokens")
        usage = _usage(usage, stream.prefill_prompt_tokens)
    head = head or {}
    text = "".join(texts)
    if chat:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "tool_calls": [],
        }
        if reasoning:
            message["reasoning"] = "".join(reasoning)
        choice_out: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": tally.finish_reason,
            "stop_reason": stop_reason,
        }
        obj_type = "chat.completion"
    else:
        choice_out = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": tally.finish_reason,
            "stop_reason": stop_reason,
        }
        obj_type = "text_completion"
    if token_ids is not None:
        choice_out["token_ids"] = token_ids
    if prompt_token_ids is not None:
        if chat:
            extra = {"prompt_token_ids": prompt_token_ids}
        else:
            choice_out["prompt_token_ids"] = prompt_token_ids
            extra = {}
    else:
        extra = {}
    return {
        "id": head.get("id"),
        "object": obj_type,
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": [choice_out],
        "usage": usage,
        "system_fingerprint": None,
        **extra,
    }
