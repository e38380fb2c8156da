"""Raw asyncio HTTP/1.1 for the benchmarks' load clients, so that no HTTP library sits between
the router and the clock: connections with ``TCP_NODELAY``, response heads, and streamed
completions (one connection each, ``Connection: close``) whose SSE events' tokens are timed
(``time.perf_counter``) as the chunk carrying them arrives."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import orjson

__all__ = ["TRANSPORT_ERRORS", "StreamSink", "StreamTimes", "post_stream"]

# What a broken connection or a malformed response raises from ``post_stream``.
TRANSPORT_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


class StreamSink(Protocol):
    """Where ``post_stream`` puts what arrives."""

    status: int

    def on_tokens(self, n: int, now: float) -> None:
        """An event carrying ``n`` tokens (choices with text) arrived at ``now``."""

    def on_done(self) -> None:
        """``data: [DONE]`` arrived."""

    def on_error(self) -> None:
        """An error event, or an event that is not JSON, arrived."""


@dataclass
class StreamTimes:
    """A ``StreamSink`` that keeps the first and last token times and the token count."""

    status: int = 0
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    done: bool = False
    error: bool = False

    def on_tokens(self, n: int, now: float) -> None:
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += n

    def on_done(self) -> None:
        self.done = True

    def on_error(self) -> None:
        self.error = True


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to 127.0.0.1:``port`` with Nagle off (``TCP_NODELAY``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    """A response's status and its headers (names and values lower-cased)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip().lower()
    return status, headers


async def post_stream(
    port: int, body: bytes, request_id: str, sink: StreamSink, path: str = "/v1/completions"
) -> bool:
    """POST ``body`` (JSON, ``X-Request-Id: request_id``) to 127.0.0.1:``port``, set
    ``sink.status`` from the response head and, for a 200, feed ``sink`` every SSE event until
    the server closes the response; False (the body unread) for any other status.

    ``sink`` is filled in as the response arrives: a caller that cancels the request (a TTFT
    budget passed) keeps what came. Raises one of ``TRANSPORT_ERRORS`` if the connection fails.
    """
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await connect(port)
        writer.write(
            (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"X-Request-Id: {request_id}\r\nConnection: close\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        sink.status, headers = await read_head(reader)
        if sink.status != 200:
            return False
        on_chunk = _event_splitter(sink)
        if headers.get(b"transfer-encoding") == b"chunked":
            await _read_chunked(reader, on_chunk)
        else:
            length = headers.get(b"content-length")
            data = await (reader.readexactly(int(length)) if length else reader.read())
            on_chunk(data, time.perf_counter())
        return True
    finally:
        if writer is not None:
            writer.close()


def _event_splitter(sink: StreamSink) -> Callable[[bytes, float], None]:
    """A chunk handler that cuts the byte stream into SSE events and reports each to ``sink``."""
    buf = bytearray()

    def on_chunk(data: bytes, now: float) -> None:
        buf.extend(data)
        for _ in range(100_000):
            end = buf.find(b"\n\n")
            if end < 0:
                return
            event = bytes(buf[:end])
            del buf[: end + 2]
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                sink.on_done()
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                sink.on_error()
                continue
            if "error" in obj:
                sink.on_error()
                continue
            n = sum(1 for ch in obj.get("choices") or () if ch.get("text"))
            if n:
                sink.on_tokens(n, now)

    return on_chunk


async def _read_chunked(
    reader: asyncio.StreamReader, on_chunk: Callable[[bytes, float], None]
) -> None:
    for _ in range(10_000_000):
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            return
        data = (await reader.readexactly(size + 2))[:-2]
        on_chunk(data, time.perf_counter())
    raise RuntimeError("too many chunks")
