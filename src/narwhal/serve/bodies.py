"""Request bodies of the framework's routes (tokenize, admin), read within --max-body-bytes:
refused (413) by their declared length, or as soon as more arrives, never read whole first.
The generation routes read theirs from ASGI directly (``serve.generation.read_body``)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from narwhal.serve.errors import BodyTimeout, PayloadTooLarge

__all__ = ["read_limited_body"]


async def read_limited_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, at most ``limit`` bytes (``PayloadTooLarge`` past it) within ``timeout_s``
    (``BodyTimeout`` past it)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(request, limit)
    except TimeoutError:
        raise BodyTimeout(timeout_s) from None


async def _read(request: Request, limit: int) -> bytes:
    too_large = PayloadTooLarge(f"request body exceeds {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)
