"""The two generation routes, ``POST /v1/completions`` and ``/v1/chat/completions``, as plain
ASGI: the router's hot path.

They speak ASGI directly instead of going through a framework request, ``StreamingResponse`` and
per-phase watcher tasks: profiling put those layers at several percent of the router's CPU per
request (docs/performance.md). What they guarantee is unchanged: every request that reaches the
router ends with exactly one ``request.end`` record, every failure is an OpenAI error with the
right status, and a client that hangs up stops the upstream work at once.

A client that leaves is noticed by one watcher task per request, which waits for the ASGI
``http.disconnect`` message and then cancels the request's own task; the handler tells that
cancellation apart from any other (a server shutdown) by the watcher's ``gone`` flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from narwhal.engines.lax import NOT_JSON, is_json
from narwhal.engines.stream_client import EngineStreamConnection
from narwhal.serve.bodies import ClientGone, read_body
from narwhal.serve.errors import (
    InternalError,
    InvalidRequest,
    NotAccepting,
    RouterError,
    Unauthorized,
    with_detail,
)
from narwhal.serve.fanout import ChoiceSet, ChoiceStreams, aggregate_choices, open_choices
from narwhal.serve.ledger import RequestLedger
from narwhal.serve.migration import MigrationTrace, Migrator, new_trace
from narwhal.serve.pd import DecodeStream
from narwhal.serve.record import RequestRecord
from narwhal.serve.relay import (
    EventRenderer,
    PushRelay,
    StreamTally,
    aggregate,
    last_events,
    relay_events,
)
from narwhal.serve.services import Services
from narwhal.serve.stalls import StallDeadline
from narwhal.serve.validation import parse_client_request

__all__ = ["GenerationEndpoint"]

log = logging.getLogger("narwhal.serve")

_CLIENT_ID_RE = re.compile(r"[^A-Za-z0-9._:-]")
_SSE_CONTENT_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")
_JSON_CONTENT_TYPE = (b"content-type", b"application/json")
_GONE_BEFORE_FIRST_TOKEN = "client disconnected before the first token"
_SHUT_DOWN = "the router shut down before the request completed"
_JOURNAL_DOWN = (
    "the request journal cannot record requests; refusing them rather than serve unrecorded"
)


class DisconnectWatch:
    """Waits for the client to hang up, then cancels the task serving it (once, and only while
    watching)."""

    __slots__ = ("_absorbed", "_task", "_watcher", "gone")

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._absorbed = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._task is not None:
            self.gone = True
            self._task.cancel()

    def stop(self) -> None:
        """Stop watching: the response is complete (the server reports that as a disconnect
        too) or the request is over."""
        self._task = None
        self._watcher.cancel()

    def absorb(self) -> bool:
        """In an ``except CancelledError``: True (and the cancellation undone) when the client
        hung up; False for any other cancellation, which the caller re-raises."""
        task = asyncio.current_task()
        if self.gone and not self._absorbed and task is not None:
            self._absorbed = True
            task.uncancel()
            return True
        return False


class _DirectWriter:
    """Body pieces of a started chunked response written straight to the client's connection
    (uvicorn's httptools server): what its ``send`` does for a body message, without the ASGI
    call, for the relay that runs inside the engine connection's ``data_received``."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow

    @classmethod
    def of(cls, send: Send) -> _DirectWriter | None:
        """The writer behind ``send`` once the response has started, or None when ``send`` is
        not uvicorn's httptools cycle (another server, a wrapper): then the ASGI relay runs."""
        cycle: Any = getattr(send, "__self__", None)
        if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl":
            return None
        try:
            writer = cls(cycle)
            ready = cycle.response_started and not cycle.response_complete
            chunked = cycle.chunked_encoding
        except AttributeError:  # a uvicorn whose cycle is not what this was written for
            return None
        return writer if ready and chunked else None

    @property
    def paused(self) -> bool:
        return self._flow.write_paused and not self._cycle.disconnected

    def write(self, data: bytes) -> None:
        if data and not self._cycle.disconnected:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    async def drain(self) -> None:
        await self._flow.drain()


async def _send_response(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, exc: RouterError, request_id: bytes | None = None) -> None:
    headers = [_JSON_CONTENT_TYPE]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    if request_id is not None:
        headers.append((b"x-request-id", request_id))
    await _send_response(send, exc.status, orjson.dumps(exc.body()), headers)


def _cut_by_drain(status: int | None) -> tuple[str, int, str]:
    """The outcome, status and error of a request the drain's end (--drain-timeout) cancelled:
    ``__call__`` answers its client a 503, or ends a stream whose 200 (``status``) went out
    with the shutdown's error."""
    return "router_shutdown", 503 if status is None else status, _SHUT_DOWN


@contextlib.contextmanager
def _through_drain_end(ledger: RequestLedger) -> Iterator[None]:
    """Around a request's release, after its record is written: the drain's end cancelling it
    there does not unwind the rest (an answer already whole is still sent, not the shutdown's
    503). Any other cancellation does."""
    try:
        yield
    except asyncio.CancelledError:
        if not ledger.draining:
            raise


async def _end_at_shutdown(send: Send, request_id: bytes) -> None:
    """Whatever part of a response was sent, complete it with the shutdown's error: a 503 when
    nothing was, an error event and ``[DONE]`` to a stream, nothing to a complete response.
    The server's ``send`` refuses a message out of order, which says what was sent (the push
    relay writes past it, so it cannot be told beforehand)."""
    refusal = NotAccepting(_SHUT_DOWN, 1)
    try:
        await _send_error(send, refusal, request_id)
        return
    except RuntimeError:
        pass  # the response has started
    event = last_events(refusal.body())
    with contextlib.suppress(RuntimeError, OSError):  # RuntimeError: it was complete
        await send({"type": "http.response.body", "body": event, "more_body": False})


class GenerationEndpoint:
    """One generation route. Called with ASGI's ``(scope, receive, send)``."""

    def __init__(self, services: Services, chat: bool) -> None:
        self.services = services
        self.ledger = services.ledger
        self.chat = chat

    def _not_accepting(self, reason: str, message: str, retry_after_s: int) -> RouterError:
        self.services.metrics.admission_rejections.labels(reason).inc()
        return NotAccepting(message, retry_after_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record_id = uuid.uuid4().hex
        try:
            await self._serve(scope, receive, send, record_id)
        except asyncio.CancelledError:
            if not self.ledger.draining:
                raise
            # The server cancelled the request at the end of the drain (--drain-timeout): its
            # record says router_shutdown; the client gets an OpenAI error, not the server's
            # plain-text 500 or a cut stream. Nothing awaits this task any more, but the loop's
            # close cancels it again: a client too slow to take the error in a second gets none.
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await _end_at_shutdown(send, record_id.encode())

    async def _serve(self, scope: Scope, receive: Receive, send: Send, record_id: str) -> None:
        services, ledger = self.services, self.ledger
        if not services.journal.accepting:
            ledger.refused_unjournaled()
            await _send_error(send, self._not_accepting("journal_unavailable", _JOURNAL_DOWN, 5))
            return
        authorization = client_id = declared_length = content_type = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                # The first, as every other route reads it (Starlette's headers.get).
                if authorization is None:
                    authorization = value
            elif name == b"x-request-id":
                client_id = value
            elif name == b"content-length":
                declared_length = value
            elif name == b"content-type" and content_type is None:
                content_type = value  # the first, as the other routes read it
        record = RequestRecord(
            id=record_id,
            arrival=time.time(),
            arrival_mono=time.monotonic(),
            endpoint=scope["path"],
        )
        if client_id:
            cleaned = _CLIENT_ID_RE.sub("", client_id.decode("latin-1"))[:128]
            record.client_request_id = cleaned or None
        if not ledger.open(record):
            ledger.refused_unjournaled()
            await _send_error(send, self._not_accepting("journal_unavailable", _JOURNAL_DOWN, 5))
            return
        request_id = record.id.encode()
        if ledger.draining:
            # Refused, and journaled like any request that reached the router.
            refusal = self._not_accepting("draining", "the router is shutting down", 1)
            ledger.close(record, refusal.outcome, refusal.status, refusal.message)
            await _send_error(send, refusal, request_id)
            return
        watch: DisconnectWatch | None = None
        try:
            try:
                if not services.auth.client_allowed(
                    authorization.decode("latin-1") if authorization else ""
                ):
                    raise Unauthorized()
                settings = services.settings
                raw = await read_body(
                    receive, declared_length, settings.max_body_bytes, settings.body_timeout_s
                )
                if not is_json(content_type):
                    raise InvalidRequest(NOT_JSON)
                fleet = services.settings.fleet.contract
                creq = parse_client_request(
                    raw, self.chat, fleet.model.id, fleet.model.max_model_len
                )
                record.stream = creq.stream
                if creq.prompt_tokens_exact is not None:
                    record.prompt_tokens = creq.prompt_tokens_exact
                watch = DisconnectWatch(receive)
                trace: MigrationTrace | None = None
                if creq.choices:
                    choices = await open_choices(services.router, creq, record)
                else:
                    trace = new_trace(creq, fleet.routing.migration, fleet.model.max_model_len)
                    stream = await services.router.open(creq, record, token_ids=trace is not None)
            except RouterError as exc:
                ledger.close(record, exc.outcome, exc.status, exc.journal_error)
                if watch is not None:
                    watch.stop()  # a completed response reads as a disconnect
                await _send_error(send, exc, request_id)
                return
            except ClientGone:
                ledger.close(record, "client_abort", None, _GONE_BEFORE_FIRST_TOKEN)
                return
            except asyncio.CancelledError:
                if watch is not None and watch.absorb():
                    ledger.close(record, "client_abort", None, _GONE_BEFORE_FIRST_TOKEN)
                    return
                if ledger.draining:
                    ledger.close(record, *_cut_by_drain(None))
                else:
                    ledger.close(record, "client_abort", None, "cancelled before the first token")
                raise
            except Exception as exc:  # never a traceback to the client, always a record
                log.exception("request %s failed", record.id)
                ledger.close(record, "internal_error", 500, f"{type(exc).__name__}: {exc}")
                if watch is not None:
                    watch.stop()
                await _send_error(send, InternalError(), request_id)
                return
            # From here the open stream is released on every path (no await before the try).
            tally = StreamTally()
            try:
                if creq.choices:
                    await self._serve_choices(send, watch, choices, record)
                else:
                    migrator = Migrator(services.router, creq, record, stream, trace)
                    if creq.stream:
                        await self._relay(send, watch, migrator, creq.include_usage, tally)
                    else:
                        await self._aggregate(send, watch, migrator, tally, creq.body)
            except asyncio.CancelledError:
                # The client left while the stream was being released (the record is written).
                if not watch.absorb():
                    raise
        finally:
            if watch is not None:
                watch.stop()

    async def _release(
        self,
        migrator: Migrator,
        record: RequestRecord,
        outcome: str,
        status: int | None,
        error: str | None,
        tally: StreamTally,
    ) -> None:
        """The request's record, then its decode leg's end, then the upstream connection. The
        first two are synchronous: a cancellation landing in the await (the client hanging up
        at [DONE]) must not skip them."""
        trace = migrator.trace
        if tally.completion_tokens is None and trace is not None:
            # No usage came (the answer was cut short): the tokens relayed, counted by their
            # ids, which a migratable leg returns.
            tally.completion_tokens = len(trace.generated)
        stream = migrator.stream
        if stream.broke and stream.ticket.phase == "streaming":
            # The leg that broke after its first token, which nothing tried to continue: its
            # attempt said only ``first_token`` (a migration's break is its ``migration``
            # attempt, whose leg the lifecycle has ended).
            pair = stream.ticket.pair
            leg = "local" if pair is not None and pair.local else "decode"
            record.attempt(leg, stream.engine, "broke", after_tokens=tally.completion_tokens)
        self.ledger.close(record, outcome, status, error, tally)
        stream.cut = tally.cut
        self.services.router.finish(stream, record)
        with _through_drain_end(self.ledger):
            await stream.aclose(drain=tally.done)

    async def _relay(
        self,
        send: Send,
        watch: DisconnectWatch,
        migrator: Migrator,
        include_usage: bool,
        tally: StreamTally,
    ) -> None:
        error: str | None
        outcome, status, error = "client_abort", None, "client disconnected mid-stream"
        record = migrator.record
        stream = migrator.stream
        renderer = EventRenderer(tally, include_usage, stream.prefill_prompt_tokens, migrator.trace)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [_SSE_CONTENT_TYPE, (b"x-request-id", record.id.encode())],
                }
            )
            status = 200  # the client has its 200: a disconnect from here is journaled with it
            writer = _DirectWriter.of(send) if self.services.settings.relay == "push" else None
            while True:
                stream = migrator.stream
                pushed = writer is not None and isinstance(stream.response, EngineStreamConnection)
                if pushed:
                    assert writer is not None
                    tail = await self._push(writer, stream, renderer, migrator.stall_deadline)
                else:
                    tail = b""
                    async for chunk in relay_events(stream, renderer, migrator.stall_deadline):
                        if renderer.interrupted:
                            tail = chunk
                            break
                        # Every way the relay ends writes [DONE] last: that write completes
                        # the response, in the same socket write as the chunked terminator.
                        if renderer.finished:
                            watch.stop()
                        await send(
                            {
                                "type": "http.response.body",
                                "body": chunk,
                                "more_body": not renderer.finished,
                            }
                        )
                    else:
                        if not renderer.interrupted:
                            break
                if renderer.interrupted is None:
                    if pushed:
                        # The last piece through the server: it completes the response, with
                        # the chunked terminator in the same write.
                        watch.stop()  # the server reports a completed response as a disconnect
                        await send({"type": "http.response.body", "body": tail, "more_body": False})
                    break
                if tail:
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
                reason, message = renderer.interrupted
                if await migrator.resume(reason, message) is not None:
                    renderer.resume()
                    continue
                renderer.interrupted = None
                tail = renderer.broken(f"{message} (and no pair could continue the request)")
                watch.stop()
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                break
            if renderer.failure is not None:
                journaled = with_detail(renderer.failure, renderer.detail)
                outcome, status, error = "stream_error", 200, journaled
                migrator.stream.broke = renderer.fault
            else:
                outcome, status, error = "ok", 200, None
        except asyncio.CancelledError:
            if not watch.absorb():
                if self.ledger.draining:
                    outcome, status, error = _cut_by_drain(status)
                raise
        except Exception as exc:
            log.exception("request %s: relay failed", record.id)
            outcome, status, error = "internal_error", 200, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await self._release(migrator, record, outcome, status, error, tally)

    async def _push(
        self,
        writer: _DirectWriter,
        stream: DecodeStream,
        renderer: EventRenderer,
        deadline: StallDeadline | None,
    ) -> bytes:
        """Relay ``stream`` from its engine connection's callbacks straight to the client; the
        last piece, for the caller to send."""
        assert isinstance(stream.response, EngineStreamConnection)
        relay = PushRelay(renderer, stream.events.splitter, writer, stream.response)
        relay.start(stream.first_events)
        try:
            return await relay.run(deadline)
        finally:
            if relay.pauses:
                pauses = self.services.metrics.slow_client_pauses
                pauses.labels(stream.engine).inc(relay.pauses)

    async def _serve_choices(
        self, send: Send, watch: DisconnectWatch, choices: ChoiceSet, record: RequestRecord
    ) -> None:
        """A request of several choices (``serve.fanout``): one stream or one answer, one
        record, every choice's leg released."""
        error: str | None
        outcome, status, error = "client_abort", None, "client disconnected mid-generation"
        failure: RouterError | None = None
        result = None
        request_id = record.id.encode()
        try:
            if choices.request.stream:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [_SSE_CONTENT_TYPE, (b"x-request-id", request_id)],
                    }
                )
                status = 200  # as in _relay
                merged = ChoiceStreams(choices, choices.request.include_usage)
                await merged.run(send, watch.stop)
                if merged.failure is not None:
                    outcome, status, error = "stream_error", 200, merged.failure
                else:
                    outcome, status, error = "ok", 200, None
            else:
                result = await aggregate_choices(choices, self.chat)
                outcome, status, error = "ok", 200, None
        except RouterError as exc:
            outcome, status, error = exc.outcome, exc.status, exc.journal_error
            failure = exc
        except asyncio.CancelledError:
            if not watch.absorb():
                if self.ledger.draining:
                    outcome, status, error = _cut_by_drain(status)
                raise
        except Exception as exc:
            log.exception("request %s: choices failed", record.id)
            outcome, status, error = "internal_error", 500, f"{type(exc).__name__}: {exc}"
            failure = InternalError()
        finally:
            choices.merge_into(record)
            self.ledger.close(record, outcome, status, error, choices.merged_tally())
            with _through_drain_end(self.ledger):
                await choices.release(outcome)
        if choices.request.stream or watch.gone:
            return
        watch.stop()
        if failure is not None:
            await _send_error(send, failure, request_id)
        elif result is not None:
            headers = [_JSON_CONTENT_TYPE, (b"x-request-id", request_id)]
            await _send_response(send, 200, orjson.dumps(result), headers)

    async def _aggregate(
        self,
        send: Send,
        watch: DisconnectWatch,
        migrator: Migrator,
        tally: StreamTally,
        body: dict[str, Any],
    ) -> None:
        error: str | None
        outcome, status, error = "client_abort", None, "cancelled mid-generation"
        failure: RouterError | None = None
        result = None
        record = migrator.record
        try:
            ids = migrator.stream.prompt_token_ids if body.get("return_token_ids") else None
            result = await aggregate(migrator, self.chat, tally, ids, body)
            outcome, status, error = "ok", 200, None
        except RouterError as exc:
            outcome, status, error = exc.outcome, exc.status, exc.journal_error
            failure = exc
        except asyncio.CancelledError:
            if not watch.absorb():
                if self.ledger.draining:
                    outcome, status, error = _cut_by_drain(status)
                raise
            error = "client disconnected mid-generation"
        finally:
            await self._release(migrator, record, outcome, status, error, tally)
        if watch.gone:
            return
        watch.stop()
        request_id = record.id.encode()
        if failure is not None:
            await _send_error(send, failure, request_id)
        elif result is not None:
            headers = [_JSON_CONTENT_TYPE, (b"x-request-id", request_id)]
            await _send_response(send, 200, orjson.dumps(result), headers)
