"""``POST /v1/responses``, stateless: the request is translated into a chat-completions request
(``responses_request``), served by the P/D chat path (``GenerationEndpoint``) and its answer
translated back (``responses_output``).

Running the chat endpoint itself, with a ``receive`` that hands it the translated body and a
``send`` that translates what it sends, keeps everything the hot path guarantees: admission,
scheduling, the KV handoff, the first-token deadline, exactly one journal record (under the
scope's path, ``/v1/responses``), metrics, and a client hang-up stopping the upstream work. A
refused request is refused from inside that path (the translating ``receive`` raises), so it
is journaled and answered in the OpenAI error shape like any other. The wrapped ``send`` is
not uvicorn's, so the chat endpoint relays through ASGI messages rather than its direct
writer.
"""

from __future__ import annotations

import logging
import re
import time

import orjson
from starlette.types import Message, Receive, Scope, Send

from narwhal.engines.lax import is_json

# The chat endpoint's own body reader: the same limit, the same 413, and a hang-up while the
# body arrives raised as the exception that endpoint journals as a client abort.
from narwhal.serve.bodies import read_body
from narwhal.serve.errors import InternalError, InvalidRequest
from narwhal.serve.generation import GenerationEndpoint
from narwhal.serve.responses_output import ResponseEventStream, response_object
from narwhal.serve.responses_request import ResponsesRequest, parse_responses_request

__all__ = ["ResponsesEndpoint"]

log = logging.getLogger("narwhal.serve")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


class _Exchange:
    """One request: the translating ``receive`` and ``send`` the chat endpoint is called with."""

    def __init__(
        self, receive: Receive, send: Send, limit: int, json_body: bool, model: str
    ) -> None:
        self._receive = receive
        self._send = send
        self._limit = limit
        self._json_body = json_body
        self._model = model  # the fleet's: a stream that started was for it
        self._body_read = False
        self.request: ResponsesRequest | None = None
        self._response_id = ""
        self._passthrough = False
        self._start: Message | None = None  # a JSON answer's start, held until its body is known
        self._refusal = False  # that answer is a 4xx (its fields named as the client named them)
        self._body: list[bytes] = []
        self._events: ResponseEventStream | None = None
        self._pending = b""

    async def receive(self) -> Message:
        if self._body_read:
            return await self._receive()  # the chat endpoint's disconnect watch
        self._body_read = True
        # Within the generation route's own --body-timeout (it reads through this receive).
        raw = await read_body(self._receive, None, self._limit, None)
        if not self._json_body:
            # As it came: the chat endpoint refuses it for its Content-Type, before its body
            # is read as JSON (as vLLM checks the media type first).
            return {"type": "http.request", "body": raw, "more_body": False}
        self.request = parse_responses_request(raw)  # InvalidRequest: the endpoint answers 400
        try:
            body = orjson.dumps(self.request.chat_body)
        except TypeError:
            # orjson reads 1024 levels of nesting but writes at most 254 (as the chat path).
            raise InvalidRequest("request body is nested too deeply") from None
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            await self._on_start(message)
        elif kind == "http.response.body" and not self._passthrough:
            await self._on_body(message.get("body", b""), message.get("more_body", False))
        else:
            await self._send(message)

    async def _on_start(self, message: Message) -> None:
        headers: list[tuple[bytes, bytes]] = list(message.get("headers", []))
        if 400 <= message["status"] < 500 and self.request is not None:
            # A refusal of the translated chat body: held, to name the field the client sent.
            self._start, self._refusal = message, True
            return
        if message["status"] != 200 or self.request is None:
            # Errors are already in the OpenAI shape the Responses API uses: unchanged. (A
            # start the server refuses, the response having begun, leaves the stream translated.)
            await self._send(message)
            self._passthrough = True
            return
        request_id = _header(headers, b"x-request-id") or b""
        # The response id names the journal record it belongs to.
        self._response_id = "resp_" + request_id.decode("latin-1")
        content_type = _header(headers, b"content-type") or b""
        if not content_type.startswith(b"text/event-stream"):
            self._start = message
            return
        # The model the chat path served (a request without one, or with "", is the fleet's).
        self._events = ResponseEventStream(
            self.request, self._response_id, int(time.time()), self._model
        )
        await self._send(message)
        await self._send(
            {"type": "http.response.body", "body": self._events.start(), "more_body": True}
        )

    async def _on_body(self, body: bytes, more_body: bool) -> None:
        if self._events is None:
            self._body.append(body)
            if not more_body:
                await self._send_answer(b"".join(self._body))
            return
        out = self._translate_events(body)
        if not more_body and not self._events.closed:
            # The chat relay always ends with [DONE]; a stream that does not is broken.
            out += self._events.error({"error": {"message": "the chat stream ended early"}})
        if out or not more_body:
            await self._send({"type": "http.response.body", "body": out, "more_body": more_body})

    def _translate_events(self, body: bytes) -> bytes:
        events = self._events
        assert events is not None  # only called on a stream
        self._pending += body.replace(b"\r\n", b"\n")
        *complete, self._pending = self._pending.split(b"\n\n")
        out = b""
        for event in complete:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:") or events.closed:
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    out += events.finish()
                    continue
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    out += events.error({"error": {"message": "malformed chat stream event"}})
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    out += events.error(obj)
                else:
                    out += events.chunk(obj)
        return out

    async def _send_answer(self, raw: bytes) -> None:
        start, request = self._start, self.request
        assert start is not None and request is not None  # set by _on_start
        status = 200
        if self._refusal:
            sent = {"input"}
            if request.echo.get("max_output_tokens") is not None:
                sent.add("max_output_tokens")
            status, body = start["status"], _as_responses_refusal(raw, sent)
        else:
            try:
                body = orjson.dumps(response_object(orjson.loads(raw), request, self._response_id))
            except Exception:  # a chat answer this cannot read: a 500, never a traceback
                log.exception("request %s: chat answer not translatable", self._response_id)
                status, body = 500, orjson.dumps(InternalError().body())
        headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
        headers.append((b"content-length", b"%d" % len(body)))
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


# Chat fields a refusal may name, and the Responses fields they were translated from.
_RESPONSES_FIELD = {"max_tokens": "max_output_tokens", "messages": "input"}
_WORD_MAX_TOKENS = re.compile(r"\bmax_tokens\b")


def _as_responses_refusal(raw: bytes, sent: set[str]) -> bytes:
    """A refusal of the translated chat body, naming the field the client sent
    (``max_output_tokens``, not the chat ``max_tokens`` it became), as vLLM's own Responses
    endpoint names it; anything else unchanged. ``sent``: the Responses fields the client set."""
    try:
        doc = orjson.loads(raw)
        error = doc["error"]
        chat_field = error.get("param")
        field = _RESPONSES_FIELD.get(chat_field) if isinstance(chat_field, str) else None
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return raw
    if field is None or field not in sent:
        return raw
    error["param"] = field
    if field == "max_output_tokens" and isinstance(error.get("message"), str):
        error["message"] = _WORD_MAX_TOKENS.sub("max_output_tokens", error["message"])
    return orjson.dumps(doc)


class ResponsesEndpoint:
    """``POST /v1/responses`` on the chat endpoint ``chat``. Called with ASGI's ``(scope,
    receive, send)``."""

    def __init__(self, chat: GenerationEndpoint) -> None:
        if not chat.chat:
            raise ValueError("the Responses API runs on the chat-completions endpoint")
        self.chat = chat
        self.limit = chat.services.settings.max_body_bytes
        self.model = chat.services.settings.fleet.contract.model.id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        json_body = is_json(_header(scope["headers"], b"content-type"))
        exchange = _Exchange(receive, send, self.limit, json_body, self.model)
        await self.chat(scope, exchange.receive, exchange.send)
