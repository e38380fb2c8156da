"""Server-sent events from an engine's byte stream, kept as raw bytes for pass-through."""

from __future__ import annotations

from collections.abc import AsyncIterator

from narwhal.engines.transport import EngineResponse

__all__ = ["SseEventStream", "SseSplitter", "iter_sse_events"]

MAX_EVENT_BYTES = 1 << 24


class SseSplitter:
    """Cuts a byte stream into events and yields each event's ``data`` payload (bytes, without
    the ``data: `` prefix). Events end with a blank line; comment and non-data lines are
    dropped. An event larger than ``max_event_bytes`` is an upstream protocol error
    (``ValueError``)."""

    __slots__ = ("_buffer", "_max")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buffer = b""
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        """Every event the bytes so far complete, in order."""
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            event = buffer[start:end]
            start = end + 2
            if event.startswith(b"data: ") and b"\n" not in event:
                out.append(event[6:].lstrip(b" "))  # the usual case: one data line
            else:
                data = _data_lines(event)
                if data is not None:
                    out.append(data)
        self._buffer = buffer[start:] if start else buffer
        if len(self._buffer) > self._max:
            raise ValueError("upstream SSE event exceeds the size limit")
        return out

    def finish(self) -> list[bytes]:
        """The last event of a stream that ended without its blank line, if any."""
        rest, self._buffer = self._buffer, b""
        if not rest.strip():
            return []
        data = _data_lines(rest)
        return [] if data is None else [data]


def _data_lines(event: bytes) -> bytes | None:
    data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


class SseEventStream:
    """The events of an engine's streamed answer, a batch at a time: every event that one read
    of the socket completed. A relay that handles a batch at once writes it to its client in
    one go (a decode step of a large batch delivers many events together)."""

    __slots__ = ("_ended", "_response", "splitter")

    def __init__(self, response: EngineResponse, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._response = response
        # Public: a relay that takes the stream over continues with what it has buffered.
        self.splitter = SseSplitter(max_event_bytes)
        self._ended = False

    async def next_batch(self) -> list[bytes]:
        """The next events, at least one; ``[]`` once the stream has ended.

        Raises ``EngineTransportError`` when the stream breaks and ``ValueError`` for an
        oversized event."""
        while not self._ended:
            chunk = await self._response.read_chunk()
            if not chunk:
                self._ended = True
                return self.splitter.finish()
            events = self.splitter.feed(chunk)
            if events:
                return events
        return []


async def iter_sse_events(
    chunks: AsyncIterator[bytes], max_event_bytes: int = MAX_EVENT_BYTES
) -> AsyncIterator[bytes]:
    """Each event's ``data`` payload from an iterator of byte chunks (see ``SseSplitter``)."""
    splitter = SseSplitter(max_event_bytes)
    async for chunk in chunks:
        for data in splitter.feed(chunk):
            yield data
    for data in splitter.finish():
        yield data
