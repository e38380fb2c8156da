"""Server-sent events from an engine's byte stream, kept as raw bytes for pass-through."""

from __future__ import annotations

from collections.abc import AsyncIterator

__all__ = ["iter_sse_events"]


async def iter_sse_events(
    chunks: AsyncIterator[bytes], max_event_bytes: int = 1 << 24
) -> AsyncIterator[bytes]:
    """Yield each event's ``data`` payload (bytes, without the ``data: `` prefix).

    Events end with a blank line; comment and non-data lines are dropped. An event larger than
    ``max_event_bytes`` is an upstream protocol error.
    """
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            data = [
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if data:
                yield b"\n".join(data)
        if len(buffer) > max_event_bytes:
            raise ValueError("upstream SSE event exceeds the size limit")
    if buffer.strip():
        data = [line[5:].lstrip(b" ") for line in buffer.split(b"\n") if line.startswith(b"data:")]
        if data:
            yield b"\n".join(data)
