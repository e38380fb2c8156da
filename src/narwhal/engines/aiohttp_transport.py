"""An httpx transport that moves the bytes with aiohttp.

Profiling the router under load (docs/performance.md) put about a third of its CPU in httpcore:
its pure-Python HTTP/1.1 state machine (h11), its connection pool's bookkeeping on every
request, and anyio's per-read cancel scopes. aiohttp parses HTTP with a C parser and keeps a
cheaper pool. Keeping httpx's client API on top means every caller keeps the same requests,
responses, timeouts and exception types (``httpx.HTTPError`` and its subclasses): only the
layer below the client changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import httpx

__all__ = ["AiohttpTransport"]


def _translate(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The httpx exception a caller would have seen for the same failure."""
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError | asyncio.TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.ReadError(message, request=request)


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _translate(exc, self._request) from exc

    async def aclose(self) -> None:
        # A body read to its end goes back to the pool; aiohttp closes the connection of one
        # abandoned part way (a client that left, a deadline), so no later request on it can
        # read the rest of this one (tests/unit/test_aiohttp_transport.py).
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp session (one connection pool) per engine, created on first use inside the
    running event loop."""

    def __init__(self, max_connections: int, keepalive_expiry_s: float) -> None:
        self._max_connections = max_connections
        self._keepalive_expiry_s = keepalive_expiry_s
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                keepalive_timeout=self._keepalive_expiry_s,
                # Engines are addressed by IP and port from the fleet file: no DNS cache to
                # go stale, no happy-eyeballs racing.
                use_dns_cache=False,
                enable_cleanup_closed=False,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                # No cookies, no automatic decompression: the router relays engine bytes.
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                trust_env=False,
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._open()
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.get("pool"),
            sock_connect=timeouts.get("connect"),
            sock_read=timeouts.get("read"),
        )
        body = await request.aread()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        try:
            response = await session.request(
                request.method,
                str(request.url),
                data=body or None,
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
                compress=None,
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _translate(exc, request) from exc
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_ResponseStream(response, request),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
