"""Requests with several choices (``n > 1``, a batch of completion prompts), served as one P/D
request per choice.

vLLM's P/D protocol cannot carry ``n`` on the legs: an engine-native ``n`` runs its choices as
child requests that would each pull the same remote KV blocks once, and the prefill engine frees
them after the first pull. So each choice is a request of its own (``n = 1``, one prompt),
admitted, scheduled (the prefix index sends a prompt's later choices where its KV already is)
and handed over like any other; the client sees one answer: choices numbered as vLLM numbers
them (prompt ``i``'s choice ``j`` is ``i * n + j``), one id, one usage (each prompt counted
once, completions summed) and, streamed, one ``[DONE]``.

The client's request keeps its one journal record: its attempts are every choice's legs (each
tagged with its ``choice``), its engines and times those of choice 0, its ``choices`` the count.
If any choice fails before its first token the whole request fails with that choice's error and
the others are cancelled; a choice that breaks mid-stream ends the client's stream with an error
event, as a lone stream would.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Send

from narwhal.engines.transport import EngineTransportError
from narwhal.serve.errors import UpstreamFailed, error_body, with_detail
from narwhal.serve.migration import Migrator
from narwhal.serve.pd import DecodeStream, PDRouter
from narwhal.serve.record import RequestRecord
from narwhal.serve.relay import (
    DONE_EVENT,
    StreamTally,
    aggregate,
    cut_after_answer,
    engine_fault,
    last_events,
    note_chunk,
)
from narwhal.serve.validation import ClientRequest

__all__ = ["ChoiceSet", "ChoiceStreams", "aggregate_choices", "open_choices"]


@dataclass
class ChoiceSet:
    """The open decode streams of one request's choices, each with its own record and tally."""

    router: PDRouter
    request: ClientRequest
    records: list[RequestRecord]
    streams: list[DecodeStream]
    tallies: list[StreamTally]

    def client_id(self, engine_id: Any) -> Any:
        """The id the client sees: the engine's id for choice 0 with the choice's request id
        replaced by the client request's (``chatcmpl-<id>``, as a lone request's)."""
        child = self.records[0].id
        if isinstance(engine_id, str) and engine_id.endswith(child):
            return engine_id[: -len(child)] + child.rsplit("-", 1)[0]
        return engine_id

    def merged_tally(self) -> StreamTally:
        """The client request's accounting: completions summed (unknown when a choice's is:
        a partial sum undercounts, and a TPOT from it is too slow), the earliest first token
        and the latest last one."""
        out = StreamTally(done=all(t.done for t in self.tallies))
        counts = [t.completion_tokens for t in self.tallies]
        out.completion_tokens = None if None in counts else sum(c for c in counts if c is not None)
        out.token_events = sum(t.token_events for t in self.tallies)
        firsts = [t.first_token_at for t in self.tallies if t.first_token_at is not None]
        lasts = [t.last_token_at for t in self.tallies if t.last_token_at is not None]
        out.first_token_at = min(firsts) if firsts else None
        out.last_token_at = max(lasts) if lasts else None
        return out

    def prompt_tokens(self) -> int | None:
        """Each prompt counted once (vLLM's usage for ``n > 1`` and for a batch)."""
        n = self.request.choices_per_prompt
        counts = [self.records[i].prompt_tokens for i in range(0, len(self.records), n)]
        return sum(c for c in counts if c is not None) if None not in counts else None

    def usage(self, usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        if any(u is None for u in usages):
            return None
        prompt = self.prompt_tokens()
        completion = sum(int((u or {}).get("completion_tokens") or 0) for u in usages)
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": (prompt or 0) + completion,
            "completion_tokens": completion,
        }
        n = self.request.choices_per_prompt
        cached = [(usages[i] or {}).get("prompt_tokens_details") for i in range(0, len(usages), n)]
        if all(isinstance(c, dict) for c in cached):
            total = sum(int(c.get("cached_tokens") or 0) for c in cached if isinstance(c, dict))
            out["prompt_tokens_details"] = {"cached_tokens": total}
        return out

    def merge_into(self, record: RequestRecord) -> None:
        """Choice 0's engines and times, every choice's legs, into the client's record."""
        record.restore_legs(self.records[0].legs_snapshot())
        record.prompt_tokens = self.prompt_tokens()
        record.choices = len(self.records)
        merge_attempts(record, self.records)

    async def release(self, outcome: str) -> None:
        """Every choice's decode leg ends (the lifecycle hears each) and its connection
        closes. Synchronous up to the closes, so a cancellation cannot skip the ends."""
        for stream, record, tally in zip(self.streams, self.records, self.tallies, strict=True):
            record.outcome = outcome
            record.completion_tokens = tally.completion_tokens
            stream.cut = tally.cut
            self.router.finish(stream, record)
        for stream, tally in zip(self.streams, self.tallies, strict=True):
            with contextlib.suppress(Exception):
                await stream.aclose(drain=tally.done)


def merge_attempts(record: RequestRecord, children: list[RequestRecord]) -> None:
    """Every choice's legs in the client's record, in time order, each tagged with its
    choice, and the KV bytes their handoffs moved."""
    attempts = [dict(a, choice=i) for i, child in enumerate(children) for a in child.attempts]
    record.attempts.extend(sorted(attempts, key=lambda a: a.get("t", 0.0)))
    moved = [c.kv_bytes_moved for c in children if c.kv_bytes_moved is not None]
    if moved:
        record.kv_bytes_moved = (record.kv_bytes_moved or 0) + sum(moved)


def _child_records(record: RequestRecord, count: int) -> list[RequestRecord]:
    # Each choice's legs carry its own id to the engines: vLLM keys a KV handoff by it.
    return [
        RequestRecord(
            id=f"{record.id}-{i}",
            arrival=record.arrival,
            arrival_mono=record.arrival_mono,
            endpoint=record.endpoint,
            stream=record.stream,
        )
        for i in range(count)
    ]


async def open_choices(
    router: PDRouter, request: ClientRequest, record: RequestRecord
) -> ChoiceSet:
    """Open every choice's decode stream, or raise the first choice's error with nothing left
    open on any engine (the others cancelled, their legs in ``record``)."""
    records = _child_records(record, len(request.choices))
    record.choices = len(records)
    tasks = [
        asyncio.ensure_future(router.open(one, child))
        for one, child in zip(request.choices, records, strict=True)
    ]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        await _abandon(router, tasks, records)
        merge_attempts(record, records)
        raise
    failed = [t for t in done if not t.cancelled() and t.exception() is not None]
    if failed:
        await _abandon(router, tasks, records)
        merge_attempts(record, records)
        # The first to fail in request order names the error.
        first = min(failed, key=tasks.index).exception()
        assert first is not None
        raise first
    assert not pending
    streams = [t.result() for t in tasks]
    return ChoiceSet(router, request, records, streams, [StreamTally() for _ in streams])


async def _abandon(
    router: PDRouter, tasks: list[asyncio.Task[DecodeStream]], records: list[RequestRecord]
) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for task, child in zip(tasks, records, strict=True):
        if task.cancelled() or task.exception() is not None:
            continue
        stream = task.result()
        child.outcome = "cancelled"
        router.finish(stream, child)
        with contextlib.suppress(Exception):
            await stream.aclose()


async def aggregate_choices(choices: ChoiceSet, chat: bool) -> dict[str, Any]:
    """The one non-streamed answer: each choice aggregated as a lone answer, renumbered."""
    request = choices.request
    tasks = [
        asyncio.ensure_future(
            aggregate(
                Migrator(choices.router, one, child, stream, None),  # choices are not migrated
                chat,
                tally,
                stream.prompt_token_ids if one.body.get("return_token_ids") else None,
                one.body,
            )
        )
        for stream, tally, child, one in zip(
            choices.streams, choices.tallies, choices.records, request.choices, strict=True
        )
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        # One choice failed (or the client left): the others stop here, not as orphans
        # reading streams that release() is about to close.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            raise failure
    results = [task.result() for task in tasks]
    out = dict(results[0])
    out["id"] = choices.client_id(out.get("id"))
    merged: list[dict[str, Any]] = []
    for i, result in enumerate(results):
        for choice in result["choices"]:
            merged.append({**choice, "index": i})
    out["choices"] = merged
    usage = choices.usage([r.get("usage") for r in results])
    if usage is not None:
        # vLLM's whole answer has both details (null when not reported), as each choice's had.
        usage.setdefault("prompt_tokens_details", None)
        usage.setdefault("completion_tokens_details", None)
    out["usage"] = usage
    return out


class ChoiceStreams:
    """The choices' streams merged into the client's one SSE stream: each event renumbered to
    its choice and given the first choice's id, the engines' usage chunks held back for one
    summed usage chunk (when the client asked) before the one ``[DONE]``."""

    def __init__(self, choices: ChoiceSet, include_usage: bool) -> None:
        self.choices = choices
        self.include_usage = include_usage
        self.failure: str | None = None
        self._usages: list[dict[str, Any] | None] = [None] * len(choices.streams)
        self._id: Any = None
        # Every chunk of an OpenAI stream carries one ``created``: the first chunk's.
        self._created: Any = None

    def _render(self, i: int, batch: list[bytes]) -> tuple[bytes, bool]:
        """The client's bytes for choice ``i``'s events; True once that choice is done."""
        out: list[bytes] = []
        tally = self.choices.tallies[i]
        now = time.monotonic()
        for payload in batch:
            if payload == b"[DONE]":
                tally.done = True
                return b"".join(out), True
            obj = orjson.loads(payload)
            if not isinstance(obj, dict):
                raise ValueError("a stream event that is not a JSON object")
            if "error" in obj:
                self.choices.streams[i].broke = engine_fault(obj)
                raise UpstreamFailed(
                    "stream_error",
                    str((obj.get("error") or {}).get("message", "engine error")),
                )
            if obj.get("usage") and not obj.get("choices"):
                self._usages[i] = obj["usage"]
                tally.completion_tokens = obj["usage"].get("completion_tokens")
                continue
            note_chunk(tally, obj, now)
            self._id = self._id or self.choices.client_id(obj.get("id"))
            obj["id"] = self._id
            if self._created is None:
                self._created = obj.get("created")
            if self._created is not None:
                obj["created"] = self._created
            for choice in obj.get("choices") or ():
                if isinstance(choice, dict):
                    choice["index"] = i
            out += (b"data: ", orjson.dumps(obj), b"\n\n")
        return b"".join(out), False

    async def run(self, send: Send, before_last: Callable[[], None]) -> None:
        """Send every choice's events as they come, then the usage and ``[DONE]``; a choice
        that breaks ends the stream with an error event (``failure`` says why).
        ``before_last`` runs just before the last piece is sent."""
        streams = self.choices.streams
        # Bounded: while the client is slow to read (``send`` waits on its flow control), the
        # pumps wait too and stop reading the engines, whose connections then push back; an
        # unbounded queue held the whole answer of every choice for a client that stopped
        # reading.
        queue: asyncio.Queue[tuple[int, list[bytes] | BaseException]] = asyncio.Queue(
            maxsize=len(streams)
        )

        async def pump(i: int) -> None:
            await queue.put((i, streams[i].first_events))
            if b"[DONE]" in streams[i].first_events:
                return
            while True:
                try:
                    batch = await streams[i].events.next_batch()
                except Exception as exc:
                    await queue.put((i, exc))
                    return
                await queue.put((i, batch))
                if not batch or b"[DONE]" in batch:
                    return

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        open_ = set(range(len(streams)))
        try:
            while open_:
                i, item = await queue.get()
                if i not in open_:
                    continue
                try:
                    if (isinstance(item, BaseException) or not item) and cut_after_answer(
                        self.choices.tallies[i], f"choice {i}: {item or 'closed early'}"
                    ):
                        open_.discard(i)  # its answer is whole; only its usage is lost
                        continue
                    if isinstance(item, BaseException):
                        streams[i].broke = True
                        transport = isinstance(item, EngineTransportError)
                        why = item.reason if isinstance(item, EngineTransportError) else f"{item}"
                        detail = str(item) if transport else None
                        raise UpstreamFailed(
                            "stream_error", f"{type(item).__name__}: {why}", detail
                        )
                    if not item:
                        streams[i].broke = True
                        raise UpstreamFailed(
                            "stream_error", "the decode engine closed the stream early"
                        )
                    out, finished = self._render(i, item)
                except (UpstreamFailed, ValueError) as exc:
                    if not isinstance(exc, UpstreamFailed):  # an event that is no JSON object
                        streams[i].broke = True
                    message = exc.message if isinstance(exc, UpstreamFailed) else str(exc)
                    told = f"decode stream of choice {i} broke: {message}"
                    detail = exc.detail if isinstance(exc, UpstreamFailed) else None
                    self.failure = with_detail(told, detail)  # journal
                    body = last_events(error_body(told, "upstream_error", None, 502))
                    before_last()
                    await send_body(send, body, last=True)
                    return
                if finished:
                    open_.discard(i)
                if out:
                    await send_body(send, out, last=False)
            tail = b""
            if self.include_usage:
                usage = self.choices.usage(self._usages)
                if usage is not None:
                    chunk = {
                        "id": self._id,
                        "object": "chat.completion.chunk"
                        if self.choices.request.chat
                        else "text_completion",
                        "created": int(time.time()) if self._created is None else self._created,
                        "model": self.choices.request.model,
                        "choices": [],
                        "usage": usage,
                    }
                    tail = b"data: " + orjson.dumps(chunk) + b"\n\n"
            before_last()
            await send_body(send, tail + DONE_EVENT, last=True)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


async def send_body(send: Send, body: bytes, last: bool) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": not last})
