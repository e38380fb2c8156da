"""From an open decode stream to the client: SSE relay or one aggregated response.

Chunks pass through as the engine wrote them; only the final usage chunk is rewritten, so the
client's ``usage`` counts the prompt as the prefill engine did and the completion as the decode
engine did (and it is dropped when the client did not ask for it: the router always asks, to
know the count). An engine error or a stream that ends without ``[DONE]`` after the first token
ends the client's stream with an OpenAI error event, never a silent truncation; but one cut
after the answer's finish reason (the engine died or closed the connection before its usage
chunk) holds a whole answer, which ends as the engine would have ended it.

Two relays share the rendering (``EventRenderer``): ``relay_events`` pulls the stream a batch at
a time for a task that sends each piece through ASGI; ``PushRelay`` is handed the engine's bytes
as they arrive and writes them straight to the client's connection, with no task wake-up per
event (the router's own engine connections and uvicorn's httptools server; see
docs/performance.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from narwhal.engines.sse import SseSplitter
from narwhal.engines.stream_client import EngineStreamConnection
from narwhal.engines.transport import EngineTransportError
from narwhal.serve.errors import UpstreamFailed, error_body
from narwhal.serve.migration import MigrationTrace, Migrator
from narwhal.serve.pd import DecodeStream
from narwhal.serve.stalls import StallDeadline
from narwhal.serve.token_ids import IDS_KEY, NULL_IDS, keep_ids_parsed

__all__ = [
    "DONE_EVENT",
    "ClientWriter",
    "EventRenderer",
    "PushRelay",
    "StallWatch",
    "StreamTally",
    "aggregate",
    "cut_after_answer",
    "engine_fault",
    "note_chunk",
    "relay_events",
]

DONE_EVENT = b"data: [DONE]\n\n"

log = logging.getLogger("narwhal.serve")


def last_events(error: dict[str, Any]) -> bytes:
    """How a stream that broke ends: its OpenAI error event (``error_body``), then ``[DONE]``
    (the client must not take a truncated stream for a whole one)."""
    return b"data: " + orjson.dumps(error) + b"\n\n" + DONE_EVENT


def engine_fault(event: dict[str, Any]) -> bool:
    """Whether an engine's error event mid-stream is the engine's fault: a server error (vLLM
    writes ``code`` 500, or none), not a refusal of the request (a 4xx, which vLLM 0.32 sends
    in the stream for some fields: logprobs past 20, ``logit_bias`` out of the vocabulary)."""
    code = (event.get("error") or {}).get("code") if isinstance(event, dict) else None
    return not (type(code) is int and 400 <= code < 500)


@dataclass
class StreamTally:
    """Token accounting for one decode stream."""

    completion_tokens: int | None = None
    prompt_tokens: int | None = None  # as the decode engine's usage counts them
    # usage.prompt_tokens_details.cached_tokens (engines with --enable-prompt-tokens-details):
    # the prefill engine's prefix hit, which a decode leg reports for it (vLLM).
    cached_tokens: int | None = None
    token_events: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    done: bool = False
    non_text_deltas: bool = False  # a chat delta carried reasoning or tool calls
    cut: bool = False  # the engine cut the stream after the answer's finish reason


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _usage(usage: dict[str, Any], prompt_tokens: int | None) -> dict[str, Any]:
    out = dict(usage)
    if prompt_tokens is not None:
        out["prompt_tokens"] = prompt_tokens
        completion = out.get("completion_tokens") or 0
        out["total_tokens"] = prompt_tokens + completion
    return out


def lost_usage(
    tally: StreamTally, prompt_tokens: int | None, trace: MigrationTrace | None
) -> dict[str, Any] | None:
    """The usage of a whole answer whose engine cut its stream before the usage chunk: the ids
    the migration trace kept count its tokens, every leg's (None when no ids were kept: a
    stream that cannot be migrated has none, and a count of chunks is not one of tokens)."""
    if trace is None or not trace.generated:
        return None
    if prompt_tokens is None and trace.prompt_ids is not None:
        prompt_tokens = len(trace.prompt_ids)
    if prompt_tokens is None:
        return None
    completion = len(trace.generated)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
    }
    # The first prefill leg's details stand in, as in a continuation's usage; unknown, they
    # are left out as an engine leaves out what it does not report.
    if trace.prompt_details is not None:
        usage["prompt_tokens_details"] = trace.prompt_details
    return usage


# The finish reasons of a whole answer. vLLM ends an answer its engine gave up on (a
# shutdown, a sleep) with "abort": cut after that, it is not whole.
WHOLE_FINISHES = frozenset({"stop", "length", "tool_calls"})


def cut_after_answer(tally: StreamTally, message: str) -> bool:
    """Whether a stream that broke (``message``) had already carried its answer's finish
    reason: then the answer is whole, and only its usage chunk and ``[DONE]`` were lost (an
    engine that died or closed its connection right after its last token)."""
    if tally.finish_reason not in WHOLE_FINISHES:
        return False
    log.warning(
        "decode stream cut after its answer's last token (%s): the answer is whole", message
    )
    tally.done = tally.cut = True
    return True


def note_chunk(tally: StreamTally, obj: dict[str, Any], now: float) -> None:
    has_token = False
    finish = None
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content"):
                has_token = True
            # The usual delta is the text alone: one lookup, not four.
            if (len(delta) > 1 or "content" not in delta) and (
                delta.get("reasoning") or delta.get("reasoning_content") or delta.get("tool_calls")
            ):
                has_token = True
                tally.non_text_deltas = True
        elif choice.get("text"):
            has_token = True
        if choice.get("finish_reason"):
            finish = choice["finish_reason"]
    if has_token or finish:
        tally.token_events += 1
        if tally.first_token_at is None:
            tally.first_token_at = now
        tally.last_token_at = now
    if finish:
        tally.finish_reason = finish


class EventRenderer:
    """The client's SSE bytes for a decode stream's events, a batch at a time, keeping the
    stream's token accounting. ``finished`` once ``[DONE]`` has been rendered: the engine's own,
    or the one that follows an error event (then ``failure`` says what broke). Raises nothing:
    a malformed event becomes an error event.

    With a ``trace`` (``serve.migration``) the stream can be continued elsewhere: a break that
    the trace can continue from renders nothing and sets ``interrupted`` (why, and the detail)
    with ``finished``; the caller migrates the request and calls :meth:`resume`, or renders the
    break with :meth:`broken` when it cannot."""

    __slots__ = (
        "detail",
        "failure",
        "fault",
        "finished",
        "include_usage",
        "interrupted",
        "prefill_prompt_tokens",
        "tally",
        "trace",
    )

    def __init__(
        self,
        tally: StreamTally,
        include_usage: bool,
        prefill_prompt_tokens: int | None,
        trace: MigrationTrace | None = None,
    ) -> None:
        self.tally = tally
        self.include_usage = include_usage
        self.prefill_prompt_tokens = prefill_prompt_tokens
        self.finished = False
        self.failure: str | None = None  # what broke the stream, as its client was told
        self.fault = False  # the engine's fault (DecodeStream.broke), not the request's
        self.detail: str | None = None  # the last transport error's whole text (journal only)
        self.trace = trace
        self.interrupted: tuple[str, str] | None = None

    def interrupt(self, reason: str, message: str) -> bool:
        """The upstream broke (``reason``: engine_error, connection, stall): True, with
        ``interrupted`` set, when the trace can continue the request elsewhere."""
        if self.blocked() is not None:
            return False
        self.interrupted = (reason, message)
        self.finished = True
        return True

    def blocked(self) -> str | None:
        """Why the stream cannot be continued elsewhere now (no trace: migration is off for
        it), or None when it can."""
        trace = self.trace
        if trace is None:
            return "not migratable"
        tally = self.tally
        return trace.blocked(
            tally.token_events, tally.finish_reason is not None, tally.non_text_deltas
        )

    def resume(self) -> None:
        """A continuation's stream follows (``Migrator.resume``): render its events, translated
        by the trace, from here."""
        self.interrupted = None
        self.finished = False

    def render(self, batch: list[bytes]) -> bytes:
        """Every event of one upstream read in one piece: a burst costs one client write."""
        out: list[bytes] = []
        tally = self.tally
        now = time.monotonic()
        # The first stream's chunks have their ids kept unparsed (``kept``), the first of them
        # its head set; completions with logprobs are observed whole (their text offsets
        # continue); a continuation's chunks are translated. A migration begins between two
        # reads, never within one.
        trace = self.trace
        translated = observed = headless = None
        kept: list[bytes] | None = None
        if trace is not None:
            if trace.migrations:
                translated = trace
            elif trace.observes_text:
                observed = trace
            else:
                kept = trace.kept_ids
                if trace.head is None:
                    headless = trace
        blank = trace is not None and not trace.client_ids
        for payload in batch:
            if payload == b"[DONE]":
                tally.done = True
                self.finished = True
                out.append(DONE_EVENT)
                break
            if kept is not None:
                # The chunk's ids cut out before the parse, kept as the engine wrote them (parsed
                # only when a migration asks: ``MigrationTrace.generated``), null for a client
                # that did not ask. Every token of every migratable stream passes here, inline
                # (a call would cost as much as the splice). The key's spelling with its quotes
                # cannot occur inside a JSON string (a quote there is escaped), nor does
                # ``prompt_token_ids`` (no quote before ``token_ids``); a list of ids holds no
                # bracket. A migratable stream has one choice, so one list, which vLLM writes
                # last in its choice: the search from the end is the shorter.
                before, key, rest = payload.rpartition(IDS_KEY)
                if key:
                    ids, _, after = rest.partition(b"]")
                    kept.append(ids)
                    if blank:
                        payload = b"".join((before, NULL_IDS, after))
                elif b'"token_ids"' in payload:
                    payload = keep_ids_parsed(payload, kept, blank)
            try:
                obj = orjson.loads(payload)
            except ValueError as exc:
                message = f"decode stream broke: {type(exc).__name__}: {exc}"
                if not self.interrupt("malformed", message):
                    out.append(self.broken(message))
                break
            if isinstance(obj, dict) and "error" in obj:
                message = str((obj.get("error") or {}).get("message", "engine error"))
                # A refusal of the request (a 4xx) would be refused anywhere: passed on, not
                # continued elsewhere (each migration a failure on an engine that did no wrong).
                fault = engine_fault(obj)
                if fault and self.interrupt("engine_error", message):
                    break
                if fault:
                    # Ends as every broken stream does (a cut connection, a broken choice of
                    # several): the router's error, which names the engine's.
                    out.append(self.broken(f"decode stream broke: the engine's error: {message}"))
                    break
                out += (b"data: ", payload, b"\n\n", DONE_EVENT)
                self.failure = message
                self.fault = fault
                self.finished = True
                break
            if translated is not None and isinstance(obj, dict):
                obj = translated.translate(obj)
                payload = orjson.dumps(obj)
            if isinstance(obj, dict) and obj.get("usage") and not obj.get("choices"):
                tally.completion_tokens = obj["usage"].get("completion_tokens")
                tally.prompt_tokens = obj["usage"].get("prompt_tokens")
                tally.cached_tokens = _cached_tokens(obj["usage"])
                if self.include_usage:
                    obj["usage"] = _usage(obj["usage"], self.prefill_prompt_tokens)
                    out += (b"data: ", orjson.dumps(obj), b"\n\n")
            else:
                if isinstance(obj, dict):
                    note_chunk(tally, obj, now)
                    if observed is not None:
                        payload = observed.take(payload, obj)
                    elif headless is not None and obj.get("choices"):
                        headless.set_head(obj)
                        headless = None
                out += (b"data: ", payload, b"\n\n")
        return b"".join(out)

    def broken(self, message: str) -> bytes:
        """An error event and ``[DONE]``: the stream broke after its first token, when nothing
        can be retried, and the client must not take a truncated stream for a whole one."""
        self.failure = message
        self.fault = True
        self.finished = True
        return last_events(error_body(message, "upstream_error", None, 502))

    def ended(self, error: Exception | None) -> bytes:
        """What closes a stream whose upstream ended without ``[DONE]`` (nothing when the
        request can be continued elsewhere: ``interrupted``)."""
        if isinstance(error, EngineTransportError):
            message = f"decode stream broke: {error.reason}"  # the engine's address left out
            self.detail = str(error)  # the journal's
        elif error is not None:
            message = f"decode stream broke: {type(error).__name__}: {error}"
        else:
            message = "the decode engine closed the stream early"
        # A transport error or an early end, not a malformed event: the bytes that came are
        # the engine's whole answer only if they parsed.
        transport = error is None or isinstance(error, EngineTransportError)
        if transport and self.failure is None and cut_after_answer(self.tally, message):
            return self.whole()
        if self.interrupt("connection", message):
            return b""
        return self.broken(message)

    def whole(self) -> bytes:
        """The end of a whole answer whose engine cut the stream before its usage chunk and
        ``[DONE]`` (``cut_after_answer``): the usage, when the client asked for it and the
        trace's ids count it, then ``[DONE]``."""
        self.finished = True
        tally = self.tally
        out: list[bytes] = []
        trace = self.trace
        if tally.completion_tokens is None:
            usage = lost_usage(tally, self.prefill_prompt_tokens, trace)
            if usage is not None:
                tally.completion_tokens = usage["completion_tokens"]
                tally.prompt_tokens = usage["prompt_tokens"]
                tally.cached_tokens = _cached_tokens(usage)
                if self.include_usage and trace is not None and trace.head is not None:
                    chunk = {**trace.head, "choices": [], "usage": usage}
                    out += (b"data: ", orjson.dumps(chunk), b"\n\n")
        out.append(DONE_EVENT)
        return b"".join(out)

    def stalled(self, stall_s: float) -> bool:
        """No token for ``stall_s``: True (``interrupted``) when the request can be continued
        elsewhere; else the stream is left to run."""
        return self.interrupt("stall", f"no token from the decode engine for {stall_s:.3g} s")


class StallWatch:
    """The stall deadline of a stream read batch by batch (``relay_events``, ``aggregate``): a
    wait for the engine that lasts the stall period interrupts the stream when its trace can
    continue it elsewhere (``interrupted``); a stream that cannot be continued is waited for as
    long as it takes (the engine's request timeout bounds it). The router's sweeper
    (``serve.stalls``) asks it every period, so a wait costs a timestamp, not a timer: when it
    finds a wait past the deadline it cancels the task, as ``asyncio.timeout`` does."""

    __slots__ = ("_deadline", "_fired", "_renderer", "_task", "_waiting_since")

    def __init__(self, renderer: EventRenderer, deadline: StallDeadline | None) -> None:
        self._renderer = renderer
        self._deadline = deadline
        self._task: asyncio.Task[Any] | None = None
        self._waiting_since: float | None = None
        self._fired = False

    async def next_batch(self, stream: DecodeStream) -> list[bytes] | None:
        """The stream's next batch of events; None when it stalled (``interrupted``)."""
        deadline = self._deadline
        if deadline is None or self._renderer.trace is None:
            return await stream.events.next_batch()
        if self._task is None:
            self._task = asyncio.current_task()
            deadline.sweeper.watch(self)
        self._waiting_since = time.monotonic()
        try:
            return await stream.events.next_batch()
        except asyncio.CancelledError:
            if not self._fired:
                raise
            self._fired = False
            task = self._task
            if task is not None and task.uncancel() > 0:
                raise  # cancelled from outside as well
            self._renderer.stalled(deadline.stall_s)
            return None
        finally:
            self._waiting_since = None

    def sweep(self, now: float) -> None:
        since = self._waiting_since
        deadline = self._deadline
        if since is None or self._fired or deadline is None or self._task is None:
            return
        if now - since < deadline.stall_s or self._renderer.blocked() is not None:
            return
        self._fired = True
        self._task.cancel()

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.sweeper.unwatch(self)


async def relay_events(
    stream: DecodeStream, renderer: EventRenderer, deadline: StallDeadline | None = None
) -> AsyncIterator[bytes]:
    """Yield SSE bytes for the client, reading the stream a batch at a time. Every way it ends
    yields ``[DONE]`` last, unless the stream was ``interrupted`` to be continued elsewhere;
    ``renderer.failure`` then says whether the stream broke."""
    batch: list[bytes] | None = stream.first_events
    watch = StallWatch(renderer, deadline)
    try:
        while True:
            out = renderer.render(batch or [])
            if out:
                yield out
            if renderer.finished:
                return
            try:
                batch = await watch.next_batch(stream)
            except (EngineTransportError, ValueError) as exc:
                yield renderer.ended(exc)
                return
            if batch is None:
                return
            if not batch:
                yield renderer.ended(None)
                return
    finally:
        watch.close()


class PushRelay:
    """The sink of a pushed decode stream (``EngineStreamConnection.push``): in the engine
    connection's ``data_received``, cut the bytes into events, render them and write them to
    the client at once. The last piece (ending with ``[DONE]``) is left in ``tail`` for the
    request's task to send, so the server completes the response as usual.

    The request's task waits in :meth:`run`, woken when the stream ends or when the client's
    connection cannot take more (the engine connection is paused then; the task resumes it once
    the client has drained).
    """

    __slots__ = (
        "_active_at",
        "_connection",
        "_deadline",
        "_splitter",
        "_stall_s",
        "_waiter",
        "_writer",
        "pauses",
        "renderer",
        "tail",
    )

    def __init__(
        self,
        renderer: EventRenderer,
        splitter: SseSplitter,
        writer: ClientWriter,
        connection: EngineStreamConnection,
    ) -> None:
        self.pauses = 0  # times the engine was paused for the client
        self.renderer = renderer
        self._splitter = splitter
        self._writer = writer
        self._connection = connection
        self.tail: bytes | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._active_at = time.monotonic()  # since when a stall is counted (client pauses)
        self._deadline: StallDeadline | None = None
        self._stall_s: float | None = None  # the deadline's, once a sweep has asked for it

    def start(self, first_events: list[bytes]) -> None:
        out = self.renderer.render(first_events)
        if self.renderer.finished:
            self._finish(out)
            return
        if out:
            self._writer.write(out)
        self._connection.push(self)

    def on_body(self, data: bytes) -> None:
        if self.tail is not None:
            return
        try:
            events = self._splitter.feed(data)
        except ValueError as exc:
            self._finish(self.renderer.ended(exc))
            return
        if not events:
            return
        out = self.renderer.render(events)
        if self.renderer.finished:
            self._finish(out)
            return
        self._writer.write(out)
        if self._writer.paused:
            self._connection.pause_reading()
            self._wake()

    def on_end(self, error: EngineTransportError | None) -> None:
        if self.tail is not None:
            return
        if error is not None:
            self._finish(self.renderer.ended(error))
            return
        out = self.renderer.render(self._splitter.finish())
        self._finish(out if self.renderer.finished else out + self.renderer.ended(None))

    def _finish(self, tail: bytes) -> None:
        self.tail = tail
        self._connection.detach()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def run(self, deadline: StallDeadline | None = None) -> bytes:
        """Wait for the end, resuming the engine after back-pressure; the tail to send (when
        the renderer is ``interrupted``, the last piece before the break). A stream with no
        token for its ``deadline``'s period is interrupted when its trace can continue it
        elsewhere (the router's sweeper asks: :meth:`sweep`)."""
        loop = asyncio.get_running_loop()
        if deadline is not None:
            self._deadline = deadline
            deadline.sweeper.watch(self)
        try:
            while self.tail is None:
                if self._writer.paused:
                    self.pauses += 1
                    await self._writer.drain()
                    self._connection.resume_reading()
                    self._active_at = time.monotonic()
                    continue
                self._waiter = waiter = loop.create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
        finally:
            if deadline is not None:
                deadline.sweeper.unwatch(self)
        return self.tail

    def sweep(self, now: float) -> None:
        """Interrupt a stream with no token for its stall period when its trace can continue
        it elsewhere (a client holding the stream up restarts the clock when it drains)."""
        if self.tail is not None or self._deadline is None:
            return
        stall_s = self._stall_s
        if stall_s is None:
            stall_s = self._stall_s = self._deadline.stall_s
        last = max(self.renderer.tally.last_token_at or 0.0, self._active_at)
        if now - last >= stall_s and not self._writer.paused and self.renderer.stalled(stall_s):
            self._finish(b"")


class ClientWriter(Protocol):
    """Writes body pieces straight to the client's connection, bypassing the ASGI ``send``."""

    @property
    def paused(self) -> bool:
        """The client's connection holds more unsent bytes than it should."""
        ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


@dataclass
class _ChoiceParts:
    """One choice's deltas, as the engine streamed them, to be joined into the message the
    engine would have answered unstreamed (vLLM's ``chat_completion_full_generator``)."""

    texts: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    # Tool calls by their index: id, type and name from the first delta that has them, the
    # arguments concatenated in order.
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    # The first delta's: vLLM's "assistant", or with add_generation_prompt false the last
    # message's role (as its unstreamed answer says too).
    role: str = "assistant"

    def add(self, choice: dict[str, Any], chat: bool) -> None:
        if chat:
            delta = choice.get("delta") or {}
            if isinstance(delta.get("role"), str):
                self.role = delta["role"]
            if delta.get("content"):
                self.texts.append(delta["content"])
            more = delta.get("reasoning") or delta.get("reasoning_content")
            if more:
                self.reasoning.append(more)
            for call in delta.get("tool_calls") or ():
                self._tool_call(call)
        elif choice.get("text"):
            self.texts.append(choice["text"])
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self.logprobs = self.logprobs or {}
            for key, value in logprobs.items():
                if isinstance(value, list):
                    self.logprobs.setdefault(key, []).extend(value)
        if isinstance(choice.get("token_ids"), list):
            self.token_ids = self.token_ids or []
            self.token_ids.extend(choice["token_ids"])
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        if choice.get("stop_reason") is not None:
            self.stop_reason = choice["stop_reason"]

    def _tool_call(self, call: Any) -> None:
        if not isinstance(call, dict):
            return
        index = call.get("index")
        index = index if isinstance(index, int) else len(self.tool_calls)
        joined = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
        )
        if call.get("id") and not joined["id"]:
            joined["id"] = call["id"]
        if call.get("type"):
            joined["type"] = call["type"]
        function = call.get("function")
        if isinstance(function, dict):
            if function.get("name") and not joined["function"]["name"]:
                joined["function"]["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                joined["function"]["arguments"] += function["arguments"]

    def message(self, forced_tool: str | None) -> dict[str, Any]:
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if forced_tool == "required":
            calls = _required_calls(calls, self.finish_reason)
        if self.texts:
            content: str | None = "".join(self.texts)
        elif forced_tool:
            content = ""  # vLLM: a named or required tool choice answers ``content or ""``
        elif calls or self.reasoning:
            content = None  # the parsers' content when everything went to tools or reasoning
        else:
            content = ""
        message: dict[str, Any] = {
            "role": self.role,
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if calls:  # vLLM 0.32's ChatMessage drops an empty list when serialised
            message["tool_calls"] = calls
        message["reasoning"] = "".join(self.reasoning) if self.reasoning else None
        return message


def _required_calls(calls: list[dict[str, Any]], finish_reason: str | None) -> list[dict[str, Any]]:
    """A required tool choice's calls as vLLM answers them unstreamed: it parses the whole
    output as a JSON array and re-serialises each call's parameters with ``json.dumps``, and a
    truncated array (stopped on its length cap) parses to no calls at all."""
    if finish_reason == "length":
        return []
    out = []
    for call in calls:
        try:
            arguments = json.dumps(json.loads(call["function"]["arguments"] or "null"))
        except ValueError:
            return []
        out.append({**call, "function": {**call["function"], "arguments": arguments}})
    return out


def _forced_tool(body: dict[str, Any]) -> str | None:
    """ "named" or "required" when the tool choice forces a call (vLLM then answers content
    "" beside the calls), else None."""
    choice = body.get("tool_choice")
    if choice == "required":
        return "required"
    return "named" if isinstance(choice, dict) else None


async def aggregate(
    migrator: Migrator,
    chat: bool,
    tally: StreamTally,
    prompt_token_ids: list[int] | None = None,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collect a decode stream into the non-streamed OpenAI response the engine would have
    given: each choice's content, reasoning, tool calls (assembled by index from their deltas),
    logprobs and token ids concatenated in order; ``usage`` as the relay counts it. A stream
    that breaks is continued on another pair when the migrator's trace allows it."""
    choices: dict[int, _ChoiceParts] = {}
    usage: dict[str, Any] | None = None
    head: dict[str, Any] | None = None
    # vLLM stamps its whole answers with the engine's fingerprint; a stream carries it on its
    # last chunk (the usage chunk, which the decode leg always asks for).
    fingerprint: Any = None
    trace = migrator.trace
    stream = migrator.stream
    # Renders nothing here: its trace observes the chunks and it says when a break can be
    # continued elsewhere (``interrupted``).
    renderer = EventRenderer(tally, False, None, trace)
    prefill_prompt_tokens = stream.prefill_prompt_tokens  # the client's prompt, as counted
    batch: list[bytes] | None = stream.first_events
    watch = StallWatch(renderer, migrator.stall_deadline)
    refused = False  # the engine refused the request (a 4xx error event): not its fault
    try:
        i = 0
        while True:
            try:
                if renderer.interrupted or batch is None:
                    reason, message = renderer.interrupted or ("stall", "the decode stream stalled")
                    resumed = await migrator.resume(reason, message)
                    if resumed is None:
                        message = f"decode failed mid-generation: {message}"
                        raise UpstreamFailed("stream_error", message)
                    renderer.resume()
                    stream = resumed
                    batch, i = stream.first_events, 0
                    watch.close()  # the new stream's own deadline (its pair's TPOT)
                    watch = StallWatch(renderer, migrator.stall_deadline)
                    continue
                if i == len(batch):
                    batch, i = await watch.next_batch(stream), 0
                    if batch is not None and not batch:
                        message = "the decode engine closed the stream early"
                        if cut_after_answer(tally, message):
                            break
                        if not renderer.interrupt("connection", message):
                            raise UpstreamFailed("stream_error", message)
                    continue
                payload = batch[i]
                i += 1
                if payload == b"[DONE]":
                    break
                obj = orjson.loads(payload)
                if not isinstance(obj, dict):
                    raise UpstreamFailed("decode_failed", "malformed chunk from the decode engine")
                if "error" in obj:
                    detail = str((obj.get("error") or {}).get("message", "engine error"))
                    fault = engine_fault(obj)
                    if fault and renderer.interrupt("engine_error", detail):
                        continue
                    refused = not fault
                    raise UpstreamFailed("stream_error", f"decode failed mid-generation: {detail}")
                if trace is not None:
                    if trace.migrations:
                        obj = trace.translate(obj)
                    else:
                        trace.note(obj)
                head = head or obj
                if obj.get("usage") and not obj.get("choices"):
                    usage = obj["usage"]
                if obj.get("system_fingerprint") is not None:
                    fingerprint = obj["system_fingerprint"]
                note_chunk(tally, obj, time.monotonic())
                for choice in obj.get("choices") or ():
                    if isinstance(choice, dict):
                        index = choice.get("index")
                        parts = choices.setdefault(
                            index if isinstance(index, int) else 0, _ChoiceParts()
                        )
                        parts.add(choice, chat)
            except (EngineTransportError, ValueError, AttributeError, TypeError) as exc:
                transport = isinstance(exc, EngineTransportError)
                # Worded as a streamed answer's break is (``ended``): a transport error's kind,
                # without its class name or the engine's address.
                why = exc.reason if isinstance(exc, EngineTransportError) else None
                message = f"decode stream broke: {why or f'{type(exc).__name__}: {exc}'}"
                if transport and cut_after_answer(tally, message):
                    break
                if not renderer.interrupt("connection", message):
                    told_not = str(exc) if transport else None  # the journal's
                    raise UpstreamFailed("stream_error", message, told_not) from None
    except UpstreamFailed:
        # Every failure here but a refusal is the engine's: its leg ends failed
        # (PDRouter.finish; a leg a failed continuation already ended is left as it is).
        migrator.stream.broke = not refused
        raise
    finally:
        watch.close()
    tally.done = True
    if usage is None:
        usage = lost_usage(tally, prefill_prompt_tokens, trace)
    if usage is not None:
        tally.completion_tokens = usage.get("completion_tokens")
        tally.prompt_tokens = usage.get("prompt_tokens")
        tally.cached_tokens = _cached_tokens(usage)
        usage = _usage(usage, prefill_prompt_tokens)
    head = head or {}
    forced_tool = _forced_tool(body) if chat and body is not None else None
    out: list[dict[str, Any]] = []
    for index in sorted(choices) or [0]:
        parts = choices.get(index) or _ChoiceParts()
        choice_out: dict[str, Any] = {"index": index}
        if chat:
            choice_out["message"] = parts.message(forced_tool)
        else:
            choice_out["text"] = "".join(parts.texts)
        choice_out.update(
            logprobs=parts.logprobs,
            finish_reason=parts.finish_reason,
            stop_reason=parts.stop_reason,
            # The ids the router asked for to migrate with are the client's only if it asked.
            token_ids=parts.token_ids if trace is None or trace.client_ids else None,
            routed_experts=None,
        )
        if not chat:
            choice_out["prompt_logprobs"] = None
            choice_out["prompt_token_ids"] = prompt_token_ids
        out.append(choice_out)
    if isinstance(usage, dict):
        # vLLM's whole answer has both (null when not reported); its stream leaves them out.
        usage.setdefault("prompt_tokens_details", None)
        usage.setdefault("completion_tokens_details", None)
    answer: dict[str, Any] = {
        "id": head.get("id"),
        "object": "chat.completion" if chat else "text_completion",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": out,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage,
    }
    # vLLM 0.32's whole answer: a chat answer's prompt fields are top-level, a completion's in
    # its choices.
    if chat:
        answer.update(prompt_logprobs=None, prompt_token_ids=prompt_token_ids, prompt_text=None)
    answer.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return answer
