"""Request bodies, read within --max-body-bytes and --body-timeout: refused (413) by their
declared length, or as soon as more arrives, never read whole first; a body not whole within
the timeout is a 408. The generation routes read theirs from ASGI directly (``read_body``), the
framework's routes (tokenize, admin) through their ``Request`` (``read_limited_body``): both
the same reader."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import Receive

from narwhal.serve.errors import BodyTimeout, ClientClosedRequest, PayloadTooLarge

__all__ = ["ClientGone", "read_body", "read_limited_body"]


class ClientGone(Exception):
    """The client hung up while its request body was still arriving."""


async def read_body(
    receive: Receive, declared: bytes | str | None, limit: int, timeout_s: float | None
) -> bytes:
    """A request's whole body from ASGI ``receive`` (``declared``: its Content-Length, checked
    before reading), at most ``limit`` bytes (``PayloadTooLarge`` past it) within ``timeout_s``
    (``BodyTimeout`` past it; None: the caller bounds it). A client that disconnects raises
    ``ClientGone``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(receive, declared, limit)
    except TimeoutError:
        assert timeout_s is not None
        raise BodyTimeout(timeout_s) from None


async def read_limited_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """``read_body`` of a framework route, whose errors are all ``RouterError``s the route
    answers with: a client that disconnects raises ``ClientClosedRequest`` (Starlette's own
    ``ClientDisconnect`` would leave the route as an unhandled exception, a traceback per
    client). It reads ``request.receive`` itself: for a body nothing has read yet (these routes
    read theirs once, first)."""
    try:
        return await read_body(
            request.receive, request.headers.get("content-length"), limit, timeout_s
        )
    except ClientGone:
        raise ClientClosedRequest() from None


async def _read(receive: Receive, declared: bytes | str | None, limit: int) -> bytes:
    too_large = PayloadTooLarge(f"request body exceeds {limit} bytes")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        if not message.get("more_body", False):
            if not chunks:
                return chunk  # the whole body in one message, the usual case
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)
