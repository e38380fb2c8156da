"""The engine clients (aiohttp, the default, and httpx), for legs read whole and for decode
streams: the same answers and the same ``EngineTransportError`` for every network failure,
against real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from narwhal.contract import parse_fleet
from narwhal.engines.client import EnginePool
from narwhal.engines.sse import SseEventStream
from narwhal.engines.transport import (
    ENGINE_TRANSPORTS,
    EngineClient,
    EngineTransportError,
    Timeouts,
    fetch,
    make_engine_client,
    read_prefix,
)
from narwhal.simengine.fleet import local_fleet_document

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

pytestmark = pytest.mark.parametrize("transport", ENGINE_TRANSPORTS)
# A leg read whole (post) and a decode stream (stream: the router's own connections under the
# aiohttp transport) honour the same contract.
LEGS = pytest.mark.parametrize("leg", ["post", "stream"])


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


@contextlib.asynccontextmanager
async def engine_client(
    transport: str, base: str, read_s: float = 5.0
) -> AsyncIterator[EngineClient]:
    client = make_engine_client(transport, base, Timeouts(5.0, read_s), 16, 4.0)  # type: ignore[arg-type]
    try:
        yield client
    finally:
        await client.aclose()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    body = await reader.readexactly(length) if length else b""
    return head, body


async def each_request(reader: asyncio.StreamReader) -> AsyncIterator[tuple[bytes, bytes]]:
    """Every request on one connection, until the client closes it."""
    while True:
        try:
            yield await read_request(reader)
        except asyncio.IncompleteReadError:
            return


@LEGS
async def test_post_and_stream_pass_bytes_and_reuse_the_connection(
    transport: str, leg: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for head, body in each_request(reader):
            assert b"x-request-id: r1" in head.lower()
            assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            chunks = [b"data: " + body + b"\n\n", b"data: [DONE]\n\n"]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            writer.write(b"Transfer-Encoding: chunked\r\nX-Engine: e0\r\n\r\n")
            for c in chunks:
                writer.write(b"%x\r\n%s\r\n" % (len(c), c))
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    headers = {"X-Request-Id": "r1", "Content-Type": "application/json"}
    async with server(handler) as (base, peers), engine_client(transport, base) as c:
        for i in range(3):
            r = await getattr(c, leg)("/v1/completions", b'{"n":%d}' % i, headers)
            assert r.status == 200
            assert await r.read() == b'data: {"n":%d}\n\ndata: [DONE]\n\n' % i
            await r.aclose()
        r = await getattr(c, leg)("/v1/completions", b"{}", headers)
        events = SseEventStream(r)
        got = []
        while batch := await events.next_batch():
            got += batch
        await r.aclose()
        assert got == [b"{}", b"[DONE]"]
        assert len(peers) == 1  # one kept-alive connection served all four


@LEGS
async def test_an_error_status_is_an_answer_and_its_body_is_quoted_up_to_a_limit(
    transport: str, leg: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = b"x" * 10_000
        writer.write(
            b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()

    async with server(handler) as (base, _), engine_client(transport, base) as c:
        r = await getattr(c, leg)("/v1/completions", b"{}", {})
        assert r.status == 400
        assert await read_prefix(r, 1000) == b"x" * 1000
        await r.aclose()


@LEGS
async def test_connection_refused_is_a_transport_error(transport: str, leg: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        async with engine_client(transport, f"http://127.0.0.1:{port}") as c:
            with pytest.raises(EngineTransportError) as info:
                await getattr(c, leg)("/v1/completions", b"{}", {})
            assert not info.value.timeout


@LEGS
async def test_a_stalled_response_is_a_timeout(transport: str, leg: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # no answer: silent until the client gives up

    async with server(handler) as (base, _), engine_client(transport, base, read_s=0.2) as c:
        with pytest.raises(EngineTransportError) as info:
            await getattr(c, leg)("/slow", b"{}", {})
        assert info.value.timeout


@LEGS
async def test_a_stream_cut_mid_body_is_a_transport_error(transport: str, leg: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata: \r\n")
        await writer.drain()
        writer.transport.abort()

    async with server(handler) as (base, _), engine_client(transport, base) as c:
        r = await getattr(c, leg)("/v1/completions", b"{}", {})
        with pytest.raises(EngineTransportError):
            while await r.read_chunk():
                pass
        await r.aclose()


@LEGS
async def test_an_abandoned_stream_does_not_leave_its_connection_in_the_pool(
    transport: str, leg: str
) -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _request in each_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"9\r\ndata: a\n\n\r\n")
            await writer.drain()
            if not release.is_set():
                release.set()
                await reader.read()  # the rest never comes: silent until the router gives up
                return
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with server(handler) as (base, peers), engine_client(transport, base) as c:
        r = await getattr(c, leg)("/v1/completions", b"{}", {})
        assert await r.read_chunk() == b"data: a\n\n"
        await r.aclose()  # the router gave up on this stream (a deadline, a client that left)
        r = await getattr(c, leg)("/v1/completions", b"{}", {})
        # A fresh connection, and none of the abandoned stream's bytes in this response.
        assert await r.read() == b"data: a\n\n" and len(peers) == 2
        await r.aclose()


@LEGS
async def test_closing_the_client_closes_its_pool(transport: str, leg: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()  # until the client closes its end
        closed.set()

    closed = asyncio.Event()
    async with server(handler) as (base, _):
        async with engine_client(transport, base) as c:
            r = await getattr(c, leg)("/", b"{}", {})
            assert await r.read() == b"ok"
            await r.aclose()
        await asyncio.wait_for(closed.wait(), 5)


async def test_fetch_gets_a_whole_answer(transport: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        assert head.startswith(b"GET /metrics HTTP/1.1\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
        await writer.drain()

    async with server(handler) as (base, _), engine_client(transport, base) as c:
        assert await fetch(c, "/metrics") == (503, b"busy")


async def test_the_engine_pool_sends_the_engine_api_key_on_every_request(transport: str) -> None:
    """The fleet's engine key goes on prefill legs, decode streams, probes and scrapes alike,
    and only when one is configured."""
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for head, _ in each_request(reader):
            heads.append(head.lower())
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async with server(handler) as (base0, _), server(handler) as (base1, _):
        ports = [int(base.rsplit(":", 1)[1]) for base in (base0, base1)]
        fleet = parse_fleet(local_fleet_document(ports, [1, 2]), "f").contract
        for key in ("s3cret-key", None):
            heads.clear()
            pool = EnginePool(fleet, transport=transport, api_key=key)  # type: ignore[arg-type]
            try:
                for answer in (
                    await pool.client("e0").post("/v1/completions", b"{}", {}),
                    await pool.client("e1").stream("/v1/completions", b"{}", {}),
                    await pool.probe("e0").get("/health"),
                    await pool.probe("e1").get("/metrics"),
                ):
                    assert await answer.read() == b"ok"
                    await answer.aclose()
            finally:
                await pool.aclose()
            assert len(heads) == 4
            for head in heads:
                assert (b"authorization: bearer s3cret-key\r\n" in head) == (key is not None)
                assert head.count(b"authorization:") == (1 if key else 0)


@LEGS
async def test_a_request_the_engine_closed_a_pooled_connection_on_is_sent_again_once(
    transport: str, leg: str
) -> None:
    """The keep-alive race: the engine closes an idle connection just as the router writes the
    next request into it. The request goes again, once, on a new connection, and succeeds."""
    requests = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        served = 0
        async for _head, body in each_request(reader):
            requests += 1
            if served == 1:
                return  # the second request on a connection: closed without a byte of answer
            served += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async with server(handler) as (base, peers), engine_client(transport, base) as c:
        for i in range(3):
            r = await getattr(c, leg)("/v1/completions", b'{"n":%d}' % i, {})
            assert r.status == 200
            assert await r.read() == b'{"n":%d}' % i
            await r.aclose()
    # Requests 2 and 3 each met a closed pooled connection and were sent again on a new one.
    assert requests == 5
    assert len(peers) == 3


@LEGS
async def test_an_engine_that_closes_every_connection_unanswered_gets_two_tries(
    transport: str, leg: str
) -> None:
    requests = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1  # and closed, unanswered

    async with server(handler) as (base, _), engine_client(transport, base) as c:
        with pytest.raises(EngineTransportError):
            r = await getattr(c, leg)("/v1/completions", b"{}", {})
            await r.read()
    assert 1 <= requests <= 2


@LEGS
async def test_a_slow_answer_on_a_pooled_connection_is_not_sent_again(
    transport: str, leg: str
) -> None:
    """A read timeout on a kept-alive connection is not the keep-alive race: the engine has the
    request and may still be working on it, so a second copy (same request id) must not go."""
    requests = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        async for _head, body in each_request(reader):
            requests += 1
            if requests == 2:
                await asyncio.sleep(1.0)  # longer than the read timeout, shorter than the test
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async with server(handler) as (base, peers), engine_client(transport, base, read_s=0.3) as c:
        r = await getattr(c, leg)("/v1/completions", b"{}", {})
        assert await r.read() == b"{}"
        await r.aclose()
        with pytest.raises(EngineTransportError) as info:
            r = await getattr(c, leg)("/v1/completions", b"{}", {})
            await r.read()
        assert info.value.timeout
        await asyncio.sleep(0.3)
    assert requests == 2
    assert len(peers) == 1


@LEGS
@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n",
    ],
    ids=["http10", "connection-close"],
)
async def test_an_answer_ended_by_the_engines_close_is_whole(
    transport: str, leg: str, head: bytes
) -> None:
    """Neither Content-Length nor chunking (an HTTP/1.0 server, a proxy closing): the body is
    what came before the orderly close, and the connection is not reused."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head + b'{"a":')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"1}")
        await writer.drain()

    async with server(handler) as (base, peers), engine_client(transport, base) as c:
        for _ in range(2):
            r = await getattr(c, leg)("/v1/completions", b"{}", {})
            assert r.status == 200
            assert await r.read() == b'{"a":1}'
            await r.aclose()
    assert len(peers) == 2


@LEGS
async def test_a_body_shorter_than_its_length_is_a_transport_error(
    transport: str, leg: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\nabc")
        await writer.drain()

    async with server(handler) as (base, _), engine_client(transport, base) as c:
        r = await getattr(c, leg)("/v1/completions", b"{}", {})
        with pytest.raises(EngineTransportError):
            await r.read()
        await r.aclose()


@LEGS
async def test_informational_heads_are_skipped_and_the_next_answer_is_its_own(
    transport: str, leg: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)  # the informational heads arrive on their own
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nfirst")
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")
        await writer.drain()

    async with server(handler) as (base, peers), engine_client(transport, base) as c:
        for status, body in ((201, b"first"), (200, b"second")):
            r = await getattr(c, leg)("/v1/completions", b"{}", {})
            assert r.status == status
            assert await r.read() == body
            await r.aclose()
    assert len(peers) == 1
