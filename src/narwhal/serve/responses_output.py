"""A chat-completions answer translated back into the Responses API: a whole ``response``
object, or the stream of Responses SSE events (``event: <type>`` / ``data: {...}``, numbered by
``sequence_number``) that a chat SSE stream turns into.

The shapes are vLLM 0.32's (``entrypoints/openai/responses/streaming_events.py``, the "simple"
processor for non-harmony models), which the ``openai`` SDK parses: one output item per kind of
delta (reasoning, message text, each tool call), closed when the next kind starts, and
``response.completed`` last, carrying the whole response (its status says whether it was cut by
``max_output_tokens``).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from narwhal.serve.responses_request import ResponsesRequest

__all__ = ["ResponseEventStream", "response_object"]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int(prompt_details.get("cached_tokens") or 0),
            "cache_write_tokens": 0,  # required by the SDK's model; engines do not report it
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": int(completion_details.get("reasoning_tokens") or 0)
        },
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def _status(finish_reason: Any) -> tuple[str, dict[str, Any] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _output_logprobs(content: Any) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` as an ``output_text`` part's logprobs."""
    out = []
    for entry in content if isinstance(content, list) else ():
        if not isinstance(entry, dict):
            continue
        out.append(
            {
                "token": entry.get("token", ""),
                "bytes": entry.get("bytes") or [],
                "logprob": entry.get("logprob", 0.0),
                "top_logprobs": [
                    {
                        "token": top.get("token", ""),
                        "bytes": top.get("bytes") or [],
                        "logprob": top.get("logprob", 0.0),
                    }
                    for top in entry.get("top_logprobs") or ()
                    if isinstance(top, dict)
                ],
            }
        )
    return out


def _delta_logprobs(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A delta event's logprobs: as the part's, without bytes (vLLM's ``_to_stream_logprobs``)."""
    return [
        {
            "token": lp["token"],
            "logprob": lp["logprob"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]
            ],
        }
        for lp in logprobs
    ]


def _reasoning_of(message: dict[str, Any]) -> str | None:
    # vLLM 0.32 names it "reasoning"; earlier versions "reasoning_content".
    text = message.get("reasoning")
    if text is None:
        text = message.get("reasoning_content")
    return text if isinstance(text, str) else None


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    # vLLM's part names its logprobs, null when not asked for.
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _envelope(
    request: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: Any,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "output": output,
        "usage": usage,
        **request.echo,
    }


def response_object(
    chat: dict[str, Any], request: ResponsesRequest, response_id: str
) -> dict[str, Any]:
    """The ``response`` object for a chat completion (one choice)."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status, incomplete = _status(choice.get("finish_reason"))
    output: list[dict[str, Any]] = []
    reasoning = _reasoning_of(message)
    if reasoning:
        output.append(
            {
                "id": _item_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": "completed",
            }
        )
    content = message.get("content")
    if isinstance(content, str) and content:
        logprobs = None
        if request.logprobs:
            logprobs = _output_logprobs((choice.get("logprobs") or {}).get("content"))
        output.append(
            {
                "id": _item_id("msg"),
                "type": "message",
                "role": "assistant",
                # vLLM's message item is completed even when the answer was cut (the
                # response's own status says incomplete).
                "status": "completed",
                "content": [_text_part(content, logprobs)],
            }
        )
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        output.append(
            {
                "id": _item_id("fc"),
                "type": "function_call",
                "call_id": call.get("id") or _item_id("call"),
                "name": function.get("name", ""),
                "arguments": function.get("arguments", ""),
                "status": "completed",
            }
        )
    created = chat.get("created")
    return _envelope(
        request,
        response_id,
        created if isinstance(created, int) else 0,
        chat.get("model"),
        status,
        output,
        _usage(chat.get("usage")),
        incomplete,
    )


class ResponseEventStream:
    """Chat stream chunks in, Responses SSE bytes out: ``start()`` first, ``chunk(obj)`` per
    chat chunk, then ``finish()`` (at the chat stream's ``[DONE]``) or ``error(obj)`` (at its
    error event)."""

    def __init__(
        self, request: ResponsesRequest, response_id: str, created_at: int, model: Any
    ) -> None:
        self.request = request
        self.response_id = response_id
        self.created_at = created_at
        self.model = model
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items done so far
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.closed = False
        # The item being streamed: its kind ("reasoning", "message", "function_call", or None),
        # id, accumulated text (or arguments) and, for a tool call, the chat call index.
        self._kind: str | None = None
        self._id = ""
        self._text = ""
        self._logprobs: list[dict[str, Any]] = []
        self._call: dict[str, Any] = {}
        self._call_index: Any = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return _envelope(
            self.request,
            self.response_id,
            self.created_at,
            self.model,
            status,
            list(self.output),
            usage,
            incomplete,
        )

    def start(self) -> bytes:
        response = self._response("in_progress")
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    # --- one item at a time ----------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._id, "output_index": len(self.output)}

    def _open(self, kind: str, call: dict[str, Any] | None = None) -> bytes:
        self._kind, self._text, self._logprobs = kind, "", []
        index = len(self.output)
        if kind == "reasoning":
            self._id = _item_id("rs")
            item = {"id": self._id, "type": "reasoning", "summary": [], "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            self._id = _item_id("msg")
            item = {
                "id": self._id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "status": "in_progress",
            }
            part = _text_part("", [])
        else:
            self._id = _item_id("fc")
            function = (call or {}).get("function") or {}
            self._call_index = (call or {}).get("index")
            self._call = {
                "id": self._id,
                "type": "function_call",
                "call_id": (call or {}).get("id") or _item_id("call"),
                "name": function.get("name") or "",
                "arguments": "",
                "status": "in_progress",
            }
            return self._event("response.output_item.added", output_index=index, item=self._call)
        out = self._event("response.output_item.added", output_index=index, item=item)
        return out + self._event(
            "response.content_part.added", content_index=0, part=part, **self._where()
        )

    def _close(self) -> bytes:
        kind, where = self._kind, self._where()
        if kind is None:
            return b""
        self._kind = None
        if kind == "function_call":
            item = {**self._call, "arguments": self._text, "status": "completed"}
            out = self._event(
                "response.function_call_arguments.done",
                arguments=self._text,
                name=item["name"],
                **where,
            )
        elif kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": self._text}
            item = {
                "id": self._id,
                "type": "reasoning",
                "summary": [],
                "content": [part],
                "status": "completed",
            }
            out = self._event(
                "response.reasoning_text.done", content_index=0, text=self._text, **where
            )
            out += self._event("response.content_part.done", content_index=0, part=part, **where)
        else:
            logprobs = self._logprobs if self.request.logprobs else None
            part = _text_part(self._text, logprobs)
            item = {
                "id": self._id,
                "type": "message",
                "role": "assistant",
                "content": [part],
                "status": "completed",  # as vLLM's, a cut answer's too
            }
            out = self._event(
                "response.output_text.done",
                content_index=0,
                text=self._text,
                logprobs=_delta_logprobs(self._logprobs),
                **where,
            )
            out += self._event("response.content_part.done", content_index=0, part=part, **where)
        out += self._event(
            "response.output_item.done", output_index=where["output_index"], item=item
        )
        self.output.append(item)
        return out

    def _switch(self, kind: str, call: dict[str, Any] | None = None) -> bytes:
        if self._kind == kind and (kind != "function_call" or call is None):
            return b""
        return self._close() + self._open(kind, call)

    # --- the chat stream -------------------------------------------------------------------

    def chunk(self, obj: dict[str, Any]) -> bytes:
        """The events for one chat chunk (a usage-only chunk yields none)."""
        if isinstance(obj.get("usage"), dict):
            self.usage = _usage(obj["usage"])
        out = b""
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = _reasoning_of(delta)
            if reasoning:
                out += self._switch("reasoning")
                self._text += reasoning
                out += self._event(
                    "response.reasoning_text.delta",
                    content_index=0,
                    delta=reasoning,
                    **self._where(),
                )
            content = delta.get("content")
            if isinstance(content, str) and content:
                out += self._switch("message")
                self._text += content
                logprobs: list[dict[str, Any]] = []
                if self.request.logprobs:
                    logprobs = _output_logprobs((choice.get("logprobs") or {}).get("content"))
                    self._logprobs += logprobs
                out += self._event(
                    "response.output_text.delta",
                    content_index=0,
                    delta=content,
                    logprobs=_delta_logprobs(logprobs),
                    **self._where(),
                )
            for call in delta.get("tool_calls") or ():
                if self._kind != "function_call" or call.get("index") != self._call_index:
                    out += self._switch("function_call", call)
                arguments = (call.get("function") or {}).get("arguments")
                if isinstance(arguments, str) and arguments:
                    self._text += arguments
                    out += self._event(
                        "response.function_call_arguments.delta", delta=arguments, **self._where()
                    )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> bytes:
        """The open item closed and ``response.completed`` with the whole response."""
        self.closed = True
        out = self._close()
        status, _ = _status(self.finish_reason)
        return out + self._event("response.completed", response=self._response(status, self.usage))

    def error(self, obj: dict[str, Any]) -> bytes:
        """The chat stream's error event as a Responses ``error`` event (the stream ends)."""
        self.closed = True
        found = obj.get("error")
        error: dict[str, Any] = found if isinstance(found, dict) else {}
        code = error.get("code")
        return self._event(
            "error",
            code=None if code is None else str(code),
            message=str(error.get("message") or "the stream failed"),
            param=error.get("param"),
        )
