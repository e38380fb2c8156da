"""ASGI pieces shared by the router and the simulated engine."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["DisconnectAwareStreamingResponse"]


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A streaming response that stops its body iterator as soon as the client disconnects.

    Starlette under ASGI spec 2.4 only notices a disconnect when a write fails, which for a
    stream that is waiting on a queued request can be minutes away. Here a listener task
    watches ``receive`` and cancels the stream at once, so the iterator's ``finally`` can abort
    upstream work.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listener):
                if not task.done():
                    task.cancel()
            await asyncio.gather(stream, listener, return_exceptions=True)
        if stream.done() and not stream.cancelled():
            exc = stream.exception()
            if exc is not None and not isinstance(exc, OSError):
                raise exc
        if self.background is not None:
            with contextlib.suppress(Exception):
                await self.background()
