"""The aiohttp transport under httpx's client: the same responses and the same httpx exceptions
as httpx's own transport, against real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from narwhal.engines.aiohttp_transport import AiohttpTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw HTTP/1.1 server; yields its base URL and the peer port of every connection."""
    peers: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[1])
        # CancelledError: a handler still waiting when the test's loop ends.
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await handler(reader, writer)
        writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", peers
    finally:
        srv.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    body = await reader.readexactly(length) if length else b""
    return head, body


def client(base: str, read_s: float = 5.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base,
        transport=AiohttpTransport(16, 4.0),
        timeout=httpx.Timeout(5.0, read=read_s),
    )


async def test_post_and_stream_pass_bytes_and_reuse_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            assert b"x-request-id: r1" in head.lower()
            chunks = [b"data: " + body + b"\n\n", b"data: [DONE]\n\n"]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            writer.write(b"Transfer-Encoding: chunked\r\nX-Engine: e0\r\n\r\n")
            for c in chunks:
                writer.write(b"%x\r\n%s\r\n" % (len(c), c))
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with server(handler) as (base, peers), client(base) as c:
        for i in range(3):
            r = await c.post(
                "/v1/completions", content=b'{"n":%d}' % i, headers={"X-Request-Id": "r1"}
            )
            assert r.status_code == 200 and r.headers["x-engine"] == "e0"
            assert r.content == b'data: {"n":%d}\n\ndata: [DONE]\n\n' % i
        req = c.build_request(
            "POST", "/v1/completions", content=b"{}", headers={"X-Request-Id": "r1"}
        )
        resp = await c.send(req, stream=True)
        got = b"".join([chunk async for chunk in resp.aiter_bytes()])
        await resp.aclose()
        assert got.endswith(b"data: [DONE]\n\n")
        assert len(peers) == 1  # one kept-alive connection served all four


async def test_connection_refused_is_httpx_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        async with client(f"http://127.0.0.1:{port}") as c:
            with pytest.raises(httpx.ConnectError):
                await c.get("/health")


async def test_a_stalled_response_is_httpx_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with server(handler) as (base, _), client(base, read_s=0.2) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.get("/slow")


async def test_a_stream_cut_mid_body_is_an_httpx_transport_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata: \r\n")
        await writer.drain()
        writer.transport.abort()

    async with server(handler) as (base, _), client(base) as c:
        req = c.build_request("POST", "/v1/completions", content=b"{}")
        resp = await c.send(req, stream=True)
        with pytest.raises(httpx.TransportError):
            async for _ in resp.aiter_bytes():
                pass
        await resp.aclose()


async def test_an_abandoned_stream_does_not_leave_its_connection_in_the_pool() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"9\r\ndata: a\n\n\r\n")
            await writer.drain()
            if not release.is_set():
                release.set()
                await asyncio.sleep(0.5)  # the rest of this stream never comes in time
                return
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with server(handler) as (base, peers), client(base) as c:
        req = c.build_request("POST", "/v1/completions", content=b"{}")
        resp = await c.send(req, stream=True)
        async for _ in resp.aiter_bytes():
            break  # the router gave up on this stream (a deadline, a client that left)
        await resp.aclose()
        r = await c.post("/v1/completions", content=b"{}")
        # A fresh connection, and none of the abandoned stream's bytes in this response.
        assert r.content == b"data: a\n\n" and len(peers) == 2


async def test_closing_the_transport_closes_its_session() -> None:
    transport = AiohttpTransport(4, 4.0)
    async with (
        server(lambda r, w: asyncio.sleep(0)) as (base, _),
        httpx.AsyncClient(base_url=base, transport=transport) as c,
    ):
        with contextlib.suppress(httpx.HTTPError):
            await c.get("/")
    assert transport._session is None
