"""How the router's request legs reach an engine: one ``POST`` per leg, over pooled keep-alive
HTTP/1.1 connections, with the engine's answer read whole (a prefill leg) or chunk by chunk (a
decode stream).

Two implementations behind one small interface, chosen by ``--engine-transport``:

- ``aiohttp`` (the default): the legs go over the router's own connections
  (``narwhal.engines.stream_client``: asyncio protocols with httptools, the C parser uvicorn
  uses), the GETs of health probes and metric scrapes through aiohttp's client. Profiling put
  httpx's client layer (request and response objects, URL merging, cookie extraction, auth and
  redirect plumbing) at about a fifth of the router's CPU per request even with aiohttp moving
  the bytes under it, and aiohttp's own client at 0.1 ms a prefill leg more than these
  connections (docs/performance.md).
- ``httpx`` uses httpx's own client and transport (httpcore), kept for comparison and as a
  fallback.

Both raise :class:`EngineTransportError` for every failure that is the engine's or the network's
(refused, reset, timed out, a body cut short), so callers handle one exception type; an HTTP
error status is not an exception, it is the response's ``status``.

A request the engine closed the connection on before a byte of answer (the keep-alive race: an
engine closes an idle pooled connection just as the router writes into it) is sent again on a
new connection, once, as the decode streams' own pool does. At worst the engine got it and died
before answering; the second try then finds the engine refusing connections.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Literal, Protocol

import aiohttp
import httpx

from narwhal.engines.base import EngineTransportError, Timeouts, wrapped_transport_error
from narwhal.engines.stream_client import EngineStreamPool, OrphanedAnswer

__all__ = [
    "ENGINE_TRANSPORTS",
    "AiohttpEngineClient",
    "EngineClient",
    "EngineResponse",
    "EngineTransportError",
    "HttpxEngineClient",
    "Timeouts",
    "fetch",
    "make_engine_client",
    "read_prefix",
]

ENGINE_TRANSPORTS = ("aiohttp", "httpx")
EngineTransportName = Literal["aiohttp", "httpx"]


class EngineResponse(Protocol):
    """An engine's answer whose head has arrived; the body is read on demand."""

    status: int

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        ...

    async def read_chunk(self) -> bytes:
        """The body bytes that have arrived, waiting for some; ``b""`` at its end."""
        ...

    async def aclose(self) -> None:
        """Release the connection: pooled again after a complete body, dropped otherwise, so
        no later request can read the rest of an abandoned one."""
        ...


async def read_prefix(response: EngineResponse, limit: int) -> bytes:
    """The body's first ``limit`` bytes or fewer (an error answer worth quoting)."""
    content = b""
    while len(content) < limit:
        chunk = await response.read_chunk()
        if not chunk:
            break
        content += chunk
    return content[:limit]


async def fetch(client: EngineClient, path: str) -> tuple[int, bytes]:
    """``GET path`` read whole: status and body. Raises ``EngineTransportError``."""
    response = await client.get(path)
    try:
        return response.status, await response.read()
    finally:
        await response.aclose()


class EngineClient(Protocol):
    async def post(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_orphan: OrphanedAnswer | None = None,
    ) -> EngineResponse:
        """Send ``body`` (JSON) and wait for the answer's head. ``on_orphan(status, body)``:
        called instead of dropping a successful answer the caller releases without having
        read it (cancelled: a client leaving as its prefill leg answered), when it is whole or
        arrives within a short grace, so a KV handoff in it is not lost. A transport that
        cannot tell (httpx) never calls it."""
        ...

    async def stream(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> EngineResponse:
        """A ``POST`` whose answer is a long event stream (a decode leg). ``on_send`` is called
        once the request may reach the engine (before its first byte is written): a stream
        cancelled before that never reached it."""
        ...

    async def get(self, path: str) -> EngineResponse:
        """A ``GET`` (health probes, metric scrapes); waits for the answer's head."""
        ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------------------------
# aiohttp


def _aiohttp_error(exc: BaseException) -> EngineTransportError:
    timeout = isinstance(exc, aiohttp.ServerTimeoutError | asyncio.TimeoutError)
    return wrapped_transport_error(exc, timeout=timeout)


class _AiohttpResponse:
    __slots__ = ("_response", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _aiohttp_error(exc) from exc

    async def read_chunk(self) -> bytes:
        try:
            return await self._response.content.readany()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _aiohttp_error(exc) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpEngineClient:
    """Request legs over the router's own keep-alive connections to one engine
    (``narwhal.engines.stream_client``: a leg read whole, or a decode stream whose events it can
    push to the client); one aiohttp session, opened on first use inside the running event
    loop, for the GETs of health probes and metric scrapes."""

    def __init__(
        self,
        base_url: str,
        timeouts: Timeouts,
        max_connections: int,
        keepalive_s: float,
        headers: Mapping[str, str] | None = None,
    ):
        self._streams = EngineStreamPool(
            base_url, timeouts, max_connections, keepalive_s, headers=headers
        )
        self._headers = dict(headers or {})
        self._base = base_url.rstrip("/")
        self._timeouts = timeouts
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                keepalive_timeout=self._keepalive_s,
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
                # Sent on every request of the session (the engine API key's Authorization).
                headers=self._headers,
                trust_env=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self._timeouts.connect_s,
                    sock_connect=self._timeouts.connect_s,
                    sock_read=self._timeouts.read_s,
                ),
            )
        return self._session

    async def post(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_orphan: OrphanedAnswer | None = None,
    ) -> EngineResponse:
        # The router's own connections, as the decode streams: a prefill leg's ~75 KB
        # token-id body cost 0.16 ms of router CPU through aiohttp's client at concurrency 1
        # and 0.06 through these (0.09 and 0.03 at 8).
        return await self._streams.post(path, body, headers, on_orphan=on_orphan)

    async def stream(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> EngineResponse:
        return await self._streams.post(path, body, headers, on_send)

    async def get(self, path: str) -> EngineResponse:
        session = self._open()
        try:
            response = await session.get(self._base + path, allow_redirects=False)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _aiohttp_error(exc) from exc
        return _AiohttpResponse(response)

    async def aclose(self) -> None:
        await self._streams.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None


# --------------------------------------------------------------------------------------------
# httpx


def _httpx_error(exc: httpx.HTTPError) -> EngineTransportError:
    return wrapped_transport_error(exc, timeout=isinstance(exc, httpx.TimeoutException))


# The engine closed the connection before a byte of answer ("Server disconnected without
# sending a response", or reset while the request was written or its answer awaited).
_HTTPX_CLOSED_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class _HttpxResponse:
    __slots__ = ("_chunks", "_response", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self._chunks: AsyncIterator[bytes] | None = None

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.HTTPError as exc:
            raise _httpx_error(exc) from exc

    async def read_chunk(self) -> bytes:
        if self._chunks is None:
            self._chunks = self._response.aiter_raw()
        try:
            return await anext(self._chunks, b"")
        except httpx.HTTPError as exc:
            raise _httpx_error(exc) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxEngineClient:
    def __init__(
        self,
        base_url: str,
        timeouts: Timeouts,
        max_connections: int,
        keepalive_s: float,
        headers: Mapping[str, str] | None = None,
    ):
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=256,
            keepalive_expiry=keepalive_s,
        )
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(
                connect=timeouts.connect_s,
                read=timeouts.read_s,
                write=timeouts.read_s,
                pool=timeouts.connect_s,
            ),
            limits=limits,
            headers=dict(headers or {}),
            # Engines are only ever the fleet's URLs: no proxies from the environment, no
            # redirects to somewhere else.
            trust_env=False,
            follow_redirects=False,
            # TCP_NODELAY: a streamed response must not wait on delayed ACKs between small
            # writes (aiohttp sets it on every connection it opens).
            transport=httpx.AsyncHTTPTransport(
                limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            ),
        )

    async def post(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_orphan: OrphanedAnswer | None = None,
    ) -> EngineResponse:
        return await self._send(
            self._client.build_request("POST", path, content=body, headers=headers)
        )

    async def stream(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> EngineResponse:
        if on_send is not None:
            on_send()  # httpx does not say when it writes: from the start, then
        return await self.post(path, body, headers)

    async def get(self, path: str) -> EngineResponse:
        return await self._send(self._client.build_request("GET", path))

    async def _send(self, request: httpx.Request) -> EngineResponse:
        try:
            try:
                response = await self._client.send(request, stream=True)
            except _HTTPX_CLOSED_UNANSWERED:
                response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _httpx_error(exc) from exc
        return _HttpxResponse(response)

    async def aclose(self) -> None:
        await self._client.aclose()


def make_engine_client(
    transport: EngineTransportName,
    base_url: str,
    timeouts: Timeouts,
    max_connections: int,
    keepalive_s: float,
    headers: Mapping[str, str] | None = None,
) -> EngineClient:
    """An engine's client; ``headers`` go on every request it sends (legs, probes, scrapes)."""
    if transport == "aiohttp":
        return AiohttpEngineClient(base_url, timeouts, max_connections, keepalive_s, headers)
    return HttpxEngineClient(base_url, timeouts, max_connections, keepalive_s, headers)
