"""The router's own decode-stream connections (``narwhal.engines.stream_client``): pushing body
pieces to a sink, stalls, back-pressure, keep-alive reuse and its races, the pool's limit;
against raw HTTP/1.1 servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from narwhal.engines.base import EngineTransportError, Timeouts
from narwhal.engines.stream_client import (
    ORPHAN_GRACE_S,
    READ_BUFFER_HIGH_WATER,
    EngineStreamConnection,
    EngineStreamPool,
)
from narwhal.testing.procs import async_wait_until
from tests.unit.test_engine_transport import Handler, each_request, read_request, server

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Sink:
    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.ends: list[EngineTransportError | None] = []
        self.ended = asyncio.Event()

    def on_body(self, data: bytes) -> None:
        self.pieces.append(data)

    def on_end(self, error: EngineTransportError | None) -> None:
        self.ends.append(error)
        self.ended.set()


@contextlib.asynccontextmanager
async def pool_for(
    handler: Handler, read_s: float = 5.0, connect_s: float = 5.0, limit: int = 16
) -> AsyncIterator[tuple[EngineStreamPool, list[int]]]:
    async with server(handler) as (base, peers):
        pool = EngineStreamPool(base, Timeouts(connect_s, read_s), limit, 4.0)
        try:
            yield pool, peers
        finally:
            await pool.aclose()


async def open_stream(pool: EngineStreamPool) -> EngineStreamConnection:
    return await pool.post("/v1/completions", b"{}", {"Content-Type": "application/json"})


async def pushed_to_its_end(conn: EngineStreamConnection, sink: Sink | None = None) -> Sink:
    sink = sink or Sink()
    conn.push(sink)
    await asyncio.wait_for(sink.ended.wait(), 5)
    return sink


async def test_pushed_pieces_arrive_in_order_then_the_end_and_the_connection_is_reused() -> None:
    step = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _request in each_request(reader):
            writer.write(HEAD + chunk(b"data: 1\n\n"))
            await writer.drain()
            await step.wait()
            step.clear()
            for piece in (b"data: 2\n\n", b"data: 3\n\n"):
                writer.write(chunk(piece))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with pool_for(handler) as (pool, peers):
        for _ in range(2):
            conn = await open_stream(pool)
            assert conn.status == 200
            assert await conn.read_chunk() == b"data: 1\n\n"  # pulled until the first token
            sink = Sink()
            conn.push(sink)
            step.set()
            await asyncio.wait_for(sink.ended.wait(), 5)
            assert b"".join(sink.pieces) == b"data: 2\n\ndata: 3\n\n"
            assert sink.ends == [None]
            conn.release()
        assert len(peers) == 1


async def test_pieces_received_before_push_go_to_the_sink_first() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(b"data: a\n\n") + chunk(b"data: b\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with pool_for(handler) as (pool, _):
        conn = await open_stream(pool)
        # The whole answer is buffered before the push.
        assert await async_wait_until(lambda: conn._complete, 5)
        sink = Sink()
        conn.push(sink)
        assert b"".join(sink.pieces) == b"data: a\n\ndata: b\n\n" and sink.ends == [None]
        conn.release()


async def test_a_pushed_stream_cut_by_the_engine_ends_with_an_error() -> None:
    pushed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await pushed.wait()
        writer.transport.abort()

    async with pool_for(handler) as (pool, _):
        conn = await open_stream(pool)
        sink = Sink()
        conn.push(sink)
        pushed.set()
        await asyncio.wait_for(sink.ended.wait(), 5)
        assert sink.pieces == [b"data: 1\n\n"]
        assert len(sink.ends) == 1 and isinstance(sink.ends[0], EngineTransportError)
        assert not sink.ends[0].timeout
        conn.release()


async def test_a_stalled_pushed_stream_times_out_but_a_paused_one_does_not() -> None:
    read_s = 0.3
    silence = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await silence.wait()  # silent until the test ends the silence
        writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with pool_for(handler, read_s=read_s) as (pool, _):
        conn = await open_stream(pool)
        sink = await pushed_to_its_end(conn)
        assert sink.ends[0] is not None and sink.ends[0].timeout
        conn.release()

        # Paused by the router (its client is slow): the engine's silence is not a stall.
        conn = await open_stream(pool)
        conn.pause_reading()
        sink = Sink()
        conn.push(sink)
        # The scenario itself: silent for three read timeouts, during which the stall watchdog
        # checks (and lets be) the paused stream every 50 ms.
        await asyncio.sleep(3 * read_s)
        assert sink.ends == []
        silence.set()
        conn.resume_reading()
        await asyncio.wait_for(sink.ended.wait(), 5)
        assert b"".join(sink.pieces) == b"data: 1\n\ndata: 2\n\n" and sink.ends == [None]
        conn.release()


async def test_a_request_on_a_kept_alive_connection_the_engine_dropped_is_sent_again() -> None:
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        async for _request in each_request(reader):
            if served == 1:
                served += 1
                writer.transport.abort()  # the idle connection closed as the request came
                return
            served += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async with pool_for(handler) as (pool, peers):
        for _ in range(2):
            conn = await open_stream(pool)
            assert await conn.read() == b"ok"
            conn.release()
        assert served == 3 and len(peers) == 2


async def test_a_dropped_connection_after_part_of_an_answer_is_not_sent_again() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 20")  # part of a head, then gone: the engine saw the request
        await writer.drain()
        writer.transport.abort()

    async with pool_for(handler) as (pool, peers):
        conn = await open_stream(pool)
        assert await conn.read() == b"ok"
        conn.release()
        with pytest.raises(EngineTransportError):
            await open_stream(pool)
        assert len(peers) == 1


async def test_the_pool_limit_queues_a_request_for_the_next_free_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _request in each_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async with pool_for(handler, connect_s=0.5, limit=1) as (pool, peers):
        first = await open_stream(pool)
        waiting = asyncio.ensure_future(open_stream(pool))
        assert await async_wait_until(lambda: len(pool._waiters) == 1, 5)  # queued for a slot
        assert not waiting.done()
        assert await first.read() == b"ok"
        first.release()  # handed straight to the waiting request
        second = await asyncio.wait_for(waiting, 5)
        assert await second.read() == b"ok"
        # Held and never released: the next request gives up after the connect timeout.
        with pytest.raises(EngineTransportError) as info:
            await open_stream(pool)
        assert info.value.timeout
        second.release()
        assert len(peers) == 1


async def test_a_request_waiting_for_a_connection_is_not_sent_until_it_has_one() -> None:
    """``on_send`` tells the router whether a decode leg may have reached its engine: not while
    it waits for a free connection (cancelled there, it never did), once written it has."""
    received: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _head, body in each_request(reader):
            received.append(body)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    sends: list[str] = []
    async with pool_for(handler, limit=1) as (pool, _peers):
        first = await pool.post("/v1/completions", b"1", {}, lambda: sends.append("first"))
        assert sends == ["first"]
        waiting = asyncio.ensure_future(
            pool.post("/v1/completions", b"2", {}, lambda: sends.append("second"))
        )
        assert await async_wait_until(lambda: len(pool._waiters) == 1, 5)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert sends == ["first"]
        assert await first.read() == b"ok"
        first.release()
        third = await pool.post("/v1/completions", b"3", {}, lambda: sends.append("third"))
        assert await third.read() == b"ok"
        third.release()
        assert sends == ["first", "third"] and received == [b"1", b"3"]


async def test_a_connection_handed_to_a_request_cancelled_meanwhile_goes_to_the_next() -> None:
    """A request handed the free connection in the moment it is cancelled (its client left):
    the connection goes to the next waiting request, not lost to the pool until it idles out."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _request in each_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async with pool_for(handler, connect_s=30.0, limit=1) as (pool, peers):
        first = await open_stream(pool)
        assert await first.read() == b"ok"
        cancelled = asyncio.ensure_future(open_stream(pool))
        after = asyncio.ensure_future(open_stream(pool))
        assert await async_wait_until(lambda: len(pool._waiters) == 2, 5)
        first.release()  # handed to the first waiter...
        cancelled.cancel()  # ...which is cancelled before it runs
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        second = await asyncio.wait_for(after, 10)  # not the 30 s connect timeout
        assert await second.read() == b"ok"
        second.release()
        assert len(peers) == 1


async def test_a_malformed_answer_is_a_transport_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with pool_for(handler) as (pool, _):
        with pytest.raises(EngineTransportError, match="malformed"):
            await open_stream(pool)


async def test_a_sink_that_fails_ends_its_stream_with_an_error() -> None:
    pushed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD)
        await writer.drain()
        await pushed.wait()  # the piece arrives at the pushed stream, not in its buffer
        writer.write(chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()

    class BrokenSink(Sink):
        def on_body(self, data: bytes) -> None:
            raise RuntimeError("bug")

    async with pool_for(handler) as (pool, _):
        conn = await open_stream(pool)
        sink = BrokenSink()
        conn.push(sink)
        pushed.set()
        await asyncio.wait_for(sink.ended.wait(), 5)
        assert len(sink.ends) == 1 and "relay failed: RuntimeError" in str(sink.ends[0])
        conn.release()


async def test_an_unread_answer_stops_the_reading_above_the_high_water_mark() -> None:
    # Far more than the router's high-water mark and the kernel's socket buffers together.
    size = 64 * READ_BUFFER_HIGH_WATER
    written = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        piece = b"x" * 65536
        while written < size:
            writer.write(piece)
            await writer.drain()  # blocks once the router stops reading
            written += len(piece)
        await reader.read()

    async with pool_for(handler) as (pool, _):
        conn = await open_stream(pool)
        # Nobody reads, so the router stops reading once past its high-water mark, and the
        # engine's writes are held back.
        assert await async_wait_until(lambda: conn._paused, 10)
        assert written < size
        body = await asyncio.wait_for(conn.read(), 10)
        assert len(body) == size and written == size
        conn.release()


async def test_a_whole_answer_whose_caller_is_cancelled_as_it_arrives_goes_to_on_orphan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's task is cancelled in the turn of the loop the answer arrives (a client
    leaving as its prefill leg answers): the answer, read whole, goes to ``on_orphan`` instead
    of being dropped, and the connection serves the next request. Cancelled before any answer,
    there is nothing to hand."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _request in each_request(reader):
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{"kv": 1}')
            await writer.drain()

    orphans: list[tuple[int, bytes]] = []
    waiting: list[asyncio.Task[object]] = []
    complete = EngineStreamConnection.on_message_complete

    def complete_and_cancel(self: EngineStreamConnection) -> None:
        complete(self)
        if waiting:
            waiting.pop().cancel()  # inside data_received: before the task hears of the head

    monkeypatch.setattr(EngineStreamConnection, "on_message_complete", complete_and_cancel)
    async with pool_for(handler) as (pool, peers):
        task = asyncio.ensure_future(
            pool.post("/v1/completions", b"{}", {}, on_orphan=lambda *a: orphans.append(a))
        )
        waiting.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert orphans == [(200, b'{"kv": 1}')]
        conn = await open_stream(pool)  # the same connection, its answer read
        assert await conn.read() == b'{"kv": 1}'
        conn.release()
        assert len(peers) == 1


@pytest.mark.parametrize("late_s", [0.05, 0.6], ids=["within-grace", "past-grace"])
async def test_an_answer_on_its_way_as_the_caller_is_cancelled_is_awaited_briefly(
    late_s: float,
) -> None:
    """The engine had finished as the caller left; its answer comes a moment later: awaited
    for ``ORPHAN_GRACE_S`` and handed to ``on_orphan``. Later than that, the connection is
    dropped (the engine aborts the request) and nothing is handed."""
    assert 0.05 < ORPHAN_GRACE_S < 0.6
    requested = asyncio.Event()
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _request in each_request(reader):
            requested.set()
            await asyncio.sleep(late_s)
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{"kv": 1}')
            await writer.drain()
        closed.set()

    orphans: list[tuple[int, bytes]] = []
    async with pool_for(handler) as (pool, peers):
        task = asyncio.ensure_future(
            pool.post("/v1/completions", b"{}", {}, on_orphan=lambda *a: orphans.append(a))
        )
        await asyncio.wait_for(requested.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        if late_s < ORPHAN_GRACE_S:
            assert await async_wait_until(lambda: orphans == [(200, b'{"kv": 1}')], 5)
            conn = await open_stream(pool)  # the connection went back to the pool
            assert await conn.read() == b'{"kv": 1}'
            conn.release()
            assert len(peers) == 1 and not closed.is_set()
        else:
            await asyncio.wait_for(closed.wait(), 5)  # dropped once the grace ran out
            assert orphans == []


async def test_a_body_cut_by_its_readers_cancellation_goes_whole_to_on_orphan() -> None:
    """Cancelled between the head and the end of a large body (a prefill answer carrying the
    prompt's ids): what was read stays with the connection, the rest is read past the
    high-water mark (nobody would resume it) and the whole body goes to ``on_orphan``."""
    body = b"x" * (READ_BUFFER_HIGH_WATER + 100_000)
    first = 100_000
    cancelled = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        writer.write(body[:first])
        await writer.drain()
        await cancelled.wait()
        writer.write(body[first:])
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    orphans: list[tuple[int, bytes]] = []
    async with pool_for(handler) as (pool, peers):
        conn = await pool.post("/v1/completions", b"{}", {}, on_orphan=lambda *a: orphans.append(a))
        reading = asyncio.ensure_future(conn.read())
        assert await async_wait_until(lambda: conn._buffered >= first, 5)
        await asyncio.sleep(0.05)  # the reader has run and waits for the rest
        assert not reading.done()
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        conn.release()  # as the cancelled caller does: the rest of the answer is awaited
        assert not conn._released and conn._orphan_timer is not None
        cancelled.set()
        assert await async_wait_until(lambda: len(orphans) == 1, 5)
        assert orphans[0] == (200, body)
        again = await open_stream(pool)  # the connection went back to the pool
        assert await again.read() == b"ok"
        again.release()
        assert len(peers) == 1
