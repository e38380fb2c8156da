"""The router's own HTTP/1.1 connections to an engine, for the legs it sends: decode streams,
whose bytes are pushed to the client as they arrive instead of being pulled by a task, and the
prefill, release and tokenize legs, read whole.

A decode stream carries one event per token for minutes. Pulled through a client library, each
event costs a stream reader, a timer re-armed on every read, a task wake-up and the coroutine
layers above it; with thousands of streams stepping together those wake-ups are what keeps the
event loop busy (docs/performance.md). Here each engine connection is an ``asyncio.Protocol``
with llhttp's C parser (``httptools``, which uvicorn uses too). Until the first token it is read
like any response (``read_chunk``, the ``EngineResponse`` interface); the relay then calls
:meth:`EngineStreamConnection.push`, and from there each body piece is handed to the relay's
sink inside ``data_received``, with no task in between.

Connections are pooled per engine and reused (keep-alive), at most ``max_connections`` open at
once for all of an engine's legs together; a request written into a pooled connection that the
engine closed meanwhile is sent again on a new one, once, when no byte of an answer came back
and the read did not time out (a slow engine may still be working on it). A read stalled for
the read timeout fails the leg (one timer per stream, re-armed only when it fires, not on every
read). Informational heads (100, 103) are skipped; an answer with neither length nor chunking
ends at the engine's orderly close. Every failure is an :class:`EngineTransportError`, like the
other engine transports.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
from collections.abc import Callable, Mapping
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from narwhal.engines.base import EngineTransportError, Timeouts, wrapped_transport_error

__all__ = ["EngineStreamConnection", "EngineStreamPool", "OrphanedAnswer", "StreamSink"]

# Body bytes held for a reader that has not taken them; above this the connection stops reading
# from the engine until it does (a client slower than its engine is held back, not buffered).
READ_BUFFER_HIGH_WATER = 256 * 1024
# How long an answer whose caller was cancelled is still awaited before the connection is
# dropped (the engine then aborts the request): an engine that had finished it as the caller
# left has its answer on the way, and the KV handoff in that answer would be lost; one still
# working gets its abort this much later.
ORPHAN_GRACE_S = 0.2

# Called with an answer's status and whole body when its caller let go of it unread (see
# ``EngineStreamPool.post``).
OrphanedAnswer = Callable[[int, bytes], None]

log = logging.getLogger(__name__)


class StreamSink(Protocol):
    """What a pushed stream's body goes to (called from ``data_received``: must not block)."""

    def on_body(self, data: bytes) -> None: ...

    def on_end(self, error: EngineTransportError | None) -> None:
        """The answer ended: complete (``None``) or broken."""
        ...


class EngineStreamConnection(asyncio.Protocol):
    """One connection to an engine, carrying one request at a time."""

    __slots__ = (
        "_answered",
        "_buffered",
        "_chunks",
        "_closed",
        "_complete",
        "_error",
        "_head",
        "_keep_alive",
        "_last_data",
        "_length_known",
        "_loop",
        "_on_orphan",
        "_orphan_timer",
        "_parser",
        "_paused",
        "_pool",
        "_released",
        "_sink",
        "_transport",
        "_waiter",
        "_watchdog",
        "_whole",
        "idle_since",
        "reused",
        "status",
    )

    def __init__(self, pool: EngineStreamPool) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self.status = 0
        self._keep_alive = False
        self._length_known = False  # the head had Content-Length or Transfer-Encoding
        self._head: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._sink: StreamSink | None = None
        self._complete = False
        self._error: EngineTransportError | None = None
        self._closed = False
        self._released = True
        self._answered = False  # a byte of the current answer arrived
        self._paused = False
        self._last_data = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        # Until the caller takes the answer: where it goes if the caller lets go of it unread.
        self._on_orphan: OrphanedAnswer | None = None
        self._orphan_timer: asyncio.TimerHandle | None = None  # set while an orphan is awaited
        self._whole = False  # the answer is wanted whole: no pause above the high-water mark
        self.reused = False
        self.idle_since = 0.0

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.Transport, transport)
        sock = self._transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each event is a small write on the engine's side; no delayed-ACK stalls here.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self._released:
            # Bytes outside any request: the connection cannot be trusted for the next one.
            self._abort(EngineTransportError("engine sent bytes outside a request"))
            return
        self._answered = True
        self._last_data = self._loop.time()
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abort(EngineTransportError(f"malformed HTTP answer: {exc}"))
            return
        self._deliver()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._pool._forget(self)
        if not self._complete and self._error is None and not self._released:
            if (
                exc is None
                and self.status >= 200
                and not self._length_known
                and self.status not in (204, 304)
            ):
                # A head with neither length nor chunking (HTTP/1.0, a proxy's
                # "Connection: close"): the orderly close is the body's end.
                self._complete = True
                self._ended()
                return
            why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
            self._error = EngineTransportError(f"engine closed the connection mid-answer{why}")
        self._ended()

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._length_known and name.lower() in (b"content-length", b"transfer-encoding"):
            self._length_known = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            return  # an informational head (100 Continue, 103 Early Hints): the answer follows
        self.status = status
        self._keep_alive = self._parser.should_keep_alive()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        # Delivered once per read (``_deliver``): a burst of events is one write to the client.
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self.status == 0:
            # An informational head ended: its headers say nothing of the answer's body.
            self._length_known = False
            return
        self._complete = True
        self._ended()

    # -- internals -----------------------------------------------------------------------

    def _deliver(self) -> None:
        """Hand what the last read brought to the sink, or wake the reader."""
        if not self._chunks:
            return
        sink = self._sink
        if sink is None:
            if self._buffered > READ_BUFFER_HIGH_WATER and not self._whole:
                self.pause_reading()  # read_chunk resumes it
            self._wake()
            return
        chunks, self._chunks = self._chunks, []
        self._buffered = 0
        try:
            sink.on_body(b"".join(chunks) if len(chunks) > 1 else chunks[0])
        except Exception as exc:  # a bug in the sink must still end its stream
            log.exception("decode stream sink failed")
            self._abort(EngineTransportError(f"relay failed: {type(exc).__name__}: {exc}"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _ended(self) -> None:
        """The answer is over, complete or broken: tell whoever is waiting for it."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        head = self._head
        if head is not None and not head.done():
            head.set_exception(self._error or EngineTransportError("answer ended before its head"))
        self._deliver()
        sink = self._sink
        if sink is not None:
            self._sink = None
            sink.on_end(self._error if not self._complete else None)
        self._wake()
        if self._orphan_timer is not None:
            # Not from inside the parser's callback: releasing may hand the connection to the
            # next request at once.
            self._loop.call_soon(self._settle_orphan)

    def _abort(self, error: EngineTransportError) -> None:
        if self._error is None and not self._complete:
            self._error = error
        if self._transport is not None:
            self._transport.abort()  # connection_lost follows and ends the answer

    def _check_stall(self) -> None:
        self._watchdog = None
        if self._complete or self._closed or self._released:
            return
        read_s = self._pool.timeouts.read_s
        idle = self._loop.time() - self._last_data
        if self._paused or idle < read_s:
            # Paused: the client is slow, not the engine.
            self._watchdog = self._loop.call_later(max(read_s - idle, 0.05), self._check_stall)
            return
        self._abort(EngineTransportError(f"no data from the engine for {read_s} s", timeout=True))

    # -- the request ---------------------------------------------------------------------

    def usable(self, now: float, keepalive_s: float) -> bool:
        return not self._closed and now - self.idle_since < keepalive_s

    def begin(
        self, request: bytes, on_orphan: OrphanedAnswer | None = None
    ) -> asyncio.Future[None]:
        """Write one request; the future resolves when the answer's head has arrived."""
        assert self._transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self._length_known = False
        self._on_orphan = on_orphan
        self._chunks = []
        self._buffered = 0
        self._complete = False
        self._error = None
        self._released = False
        self._answered = False
        self._whole = False
        self._head = self._loop.create_future()
        self._last_data = self._loop.time()
        self._watchdog = self._loop.call_later(self._pool.timeouts.read_s, self._check_stall)
        if self._closed or self._transport.is_closing():
            self._error = EngineTransportError("engine closed the connection")
            self._ended()
        else:
            self._transport.write(request)
        return self._head

    @property
    def answered(self) -> bool:
        return self._answered

    def _watch_orphan(self, on_orphan: OrphanedAnswer) -> bool:
        """Released with the answer untaken (its caller was cancelled): a whole answer already
        here goes to ``on_orphan`` now (False: release as usual); one still on its way is
        awaited for ``ORPHAN_GRACE_S`` (True: the connection releases itself when it ends, with
        the answer to ``on_orphan`` if it came whole, or when the grace runs out)."""
        if self.status >= 300:
            return False
        if self._complete:
            self._hand_orphan(on_orphan)
            return False
        if self._error is not None or self._closed:
            return False
        self._on_orphan = on_orphan
        self._orphan_timer = self._loop.call_later(ORPHAN_GRACE_S, self._orphan_expired)
        self._whole = True
        if self._paused:
            self.resume_reading()
        return True

    def _orphan_expired(self) -> None:
        if self._complete:  # it ended in this same turn, its settling not run yet
            self._settle_orphan()
            return
        self._orphan_timer = None
        self._on_orphan = None
        self.release()  # not complete: dropped, and the engine aborts the request

    def _settle_orphan(self) -> None:
        if self._orphan_timer is None:
            return  # settled already
        self._orphan_timer.cancel()
        self._orphan_timer = None
        on_orphan, self._on_orphan = self._on_orphan, None
        if self._complete and on_orphan is not None:
            self._hand_orphan(on_orphan)
        self.release()

    def _hand_orphan(self, on_orphan: OrphanedAnswer) -> None:
        if self._error is not None or self.status < 200:
            return
        body = b"".join(self._chunks)
        self._chunks = []
        self._buffered = 0
        try:
            on_orphan(self.status, body)
        except Exception:  # the caller is cancelled: nobody else would see it
            log.exception("handling an answer whose request was cancelled failed")

    # -- EngineResponse ------------------------------------------------------------------

    async def read_chunk(self) -> bytes:
        while True:
            if self._chunks:
                chunk = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
                self._chunks = []
                self._buffered = 0
                self._on_orphan = None  # the caller reads the answer itself
                if self._paused:
                    self.resume_reading()
                return chunk
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        # The body stays in the connection until it is whole (not paused above the high-water
        # mark: it is wanted whole anyway), so a reader cancelled meanwhile leaves all of it
        # to the orphan watch.
        self._whole = True
        if self._paused:
            self.resume_reading()
        while not self._complete:
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        body = b"".join(self._chunks)
        self._chunks = []
        self._buffered = 0
        self._on_orphan = None
        return body

    async def aclose(self) -> None:
        self.release()

    def release(self) -> None:
        """Back to the pool after a complete answer; closed otherwise, so no later request can
        read the rest of an abandoned one. An answer posted with ``on_orphan`` and not taken
        goes there first (awaited briefly if still on its way)."""
        if self._released:
            return
        on_orphan, self._on_orphan = self._on_orphan, None
        if on_orphan is not None and self._watch_orphan(on_orphan):
            return
        self._released = True
        self._sink = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._paused:
            self.resume_reading()
        if (
            self._complete
            and self._keep_alive
            and self._error is None
            and not self._closed
            and not self._chunks
        ):
            self._pool._put_idle(self)
        else:
            self._abort(self._error or EngineTransportError("released before its end"))

    # -- push ----------------------------------------------------------------------------

    def push(self, sink: StreamSink) -> None:
        """From now on, hand each body piece to ``sink`` as it arrives (the pieces already
        received first), then ``sink.on_end`` once. Pull reads must have stopped."""
        self._sink = sink
        self._deliver()
        if self._sink is sink and (self._complete or self._error is not None):
            self._ended()

    def detach(self) -> None:
        """Stop pushing: what arrives later is buffered for ``read_chunk`` again."""
        self._sink = None

    def pause_reading(self) -> None:
        if not self._paused and self._transport is not None and not self._closed:
            self._paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            if not self._closed:
                self._transport.resume_reading()


class EngineStreamPool:
    """Keep-alive connections to one engine for its decode legs."""

    def __init__(
        self,
        base_url: str,
        timeouts: Timeouts,
        max_connections: int,
        keepalive_s: float,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        # Header lines sent with every request (the engine API key), encoded once.
        self._default_headers = b"".join(
            b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in (headers or {}).items()
        )
        self.timeouts = timeouts
        self._host = parts.hostname or "127.0.0.1"
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._ssl = ssl.create_default_context()
        self._port = parts.port or (443 if self._ssl else 80)
        self._authority = parts.netloc.encode("idna")
        self._max = max_connections
        self._keepalive_s = keepalive_s
        self._idle: list[EngineStreamConnection] = []
        self._all: set[EngineStreamConnection] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[EngineStreamConnection | None]] = (
            collections.deque()
        )
        self._closed = False

    def _request(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [b"POST %s HTTP/1.1\r\nHost: %s\r\n" % (path.encode(), self._authority)]
        lines.append(self._default_headers)
        lines += [b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in headers.items()]
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        lines.append(body)
        return b"".join(lines)

    async def post(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
        *,
        on_orphan: OrphanedAnswer | None = None,
    ) -> EngineStreamConnection:
        """Send a request and wait for the answer's head; the connection is the response.
        ``on_send`` is called as the request is written (after any wait for a connection);
        ``on_orphan(status, body)`` when the caller releases a successful answer it did not take
        (cancelled before or while reading it: a client leaving as its prefill leg answered)
        and the whole answer is here, or arrives within ``ORPHAN_GRACE_S``: a KV handoff in it
        is not lost."""
        request = self._request(path, body, headers)
        for attempt in range(2):
            conn = await self._acquire(fresh=attempt > 0)
            if on_send is not None:
                on_send()
            try:
                await conn.begin(request, on_orphan)
            except BaseException as exc:
                conn.release()
                # Sent again only when the engine closed the idle connection as we wrote to
                # it: not after a read timeout, when the engine may still be working on it.
                stale = conn.reused and not conn.answered
                if (
                    isinstance(exc, EngineTransportError)
                    and not exc.timeout
                    and attempt == 0
                    and stale
                ):
                    continue
                raise
            return conn
        raise AssertionError("unreachable")

    async def _acquire(self, fresh: bool) -> EngineStreamConnection:
        if self._closed:
            raise EngineTransportError("engine client is closed")
        loop = asyncio.get_running_loop()
        now = loop.time()
        # One connect budget for the wait for a free slot and the connect that follows it.
        deadline = now + self.timeouts.connect_s
        while self._idle and not fresh:
            conn = self._idle.pop()
            if conn.usable(now, self._keepalive_s):
                conn.reused = True
                return conn
            conn._abort(EngineTransportError("idle too long"))
        if len(self._all) + self._opening >= self._max:
            waiter: asyncio.Future[EngineStreamConnection | None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    handed = await waiter
            except (TimeoutError, asyncio.CancelledError) as exc:
                if waiter.done() and not waiter.cancelled():
                    # Handed a connection (or a free slot) just as the wait timed out or was
                    # cancelled: passed on to the next request, or nobody would use it.
                    late = waiter.result()
                    if late is not None:
                        self._put_idle(late)
                    else:
                        self._hand_over(None)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise EngineTransportError(
                    f"no free connection to the engine within {self.timeouts.connect_s} s",
                    timeout=True,
                ) from None
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if handed is not None:
                handed.reused = True
                return handed
        self._opening += 1
        opened = False
        try:
            async with asyncio.timeout_at(deadline):
                _, conn = await loop.create_connection(
                    lambda: EngineStreamConnection(self),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                )
            opened = True
        except TimeoutError:
            raise EngineTransportError(
                f"no connection to the engine within {self.timeouts.connect_s} s", timeout=True
            ) from None
        except OSError as exc:
            raise wrapped_transport_error(exc, timeout=False) from None
        finally:
            self._opening -= 1
            if not opened:
                self._hand_over(None)  # the slot it held is free for a waiting request
        self._all.add(conn)
        if self._closed:
            conn._abort(EngineTransportError("engine client is closed"))
            raise EngineTransportError("engine client is closed")
        return conn

    def _hand_over(self, conn: EngineStreamConnection | None) -> bool:
        """Give the first waiting request ``conn``, or (None) a free slot to connect in."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def _put_idle(self, conn: EngineStreamConnection) -> None:
        if self._hand_over(conn):
            return
        conn.reused = False
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.append(conn)

    def _forget(self, conn: EngineStreamConnection) -> None:
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)
        self._hand_over(None)

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn._abort(EngineTransportError("engine client is closed"))
        self._idle.clear()
