"""uvicorn's httptools protocol with the bounds a public endpoint needs and the disconnects it
misses. What the stock protocol leaves open (found by a security review, uvicorn 0.55):

- A request head has no size limit and no time limit: a client that sends header bytes and
  never ends the head makes the router hold them all (httptools buffers a header until it is
  whole), with no API key needed. Here a head is at most ``max_head_bytes`` (431 past it) and
  must be whole within ``head_timeout_s`` of the connection's start or the request's first
  byte (408 past it, the connection closed); a connection that sends nothing at all is closed
  at the same deadline.
- With pipelined requests the stock protocol marks only the newest request disconnected when
  the connection is lost: the one being answered never hears of it, so its generation runs on
  for nobody and its writes meet a closed transport. Here every request of the connection not
  yet answered is told.
- A response sent before the request's body was read (a 401, a 413, a 405) left the connection
  open, and a client that trickles the rest of its body one byte at a time keeps it open for
  good (each byte re-arms keep-alive). Here such a connection is closed once the response is
  out, and the response says so (``Connection: close``): without it a client that pools
  connections sent its next request into the closing one and read a reset. (An answer that
  starts before its request's body ended closes the connection too, even if the body then
  ends first: its head went out saying so. No route answers before reading its body.)

- uvicorn answers a request its parser cannot read with a plain-text 400, and a WebSocket
  upgrade (the router serves none) with an empty 403. Here the 400 has the OpenAI error shape
  and an Upgrade header is ignored: the request is answered as HTTP by the route it names.

- uvicorn streams a response of unknown length chunked whatever the request's HTTP version,
  and HTTP/1.0 has no chunked encoding: an HTTP/1.0 client (nginx's ``proxy_pass`` by default,
  ``proxy_http_version 1.0``) read the chunk sizes as part of the event stream. Here such a
  response to an HTTP/1.0 request is sent as it is, ended by closing the connection.

Refusals before the head is whole are the HTTP server's, as the 400 for an unparsable request
is: no request reached the router, so none is journaled; the body is the OpenAI error shape
every other refusal has.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

__all__ = [
    "MAX_HEAD_BYTES",
    "BoundedHttpProtocol",
    "Http10ResponseCycle",
    "bounded_http_protocol",
]

log = logging.getLogger(__name__)

# A request line and headers: an API key, a request id and the usual headers take a few KiB.
MAX_HEAD_BYTES = 64 * 1024


class BoundedHttpProtocol(HttpToolsProtocol):
    """See the module. Configured by :func:`bounded_http_protocol`."""

    max_head_bytes: ClassVar[int] = MAX_HEAD_BYTES
    head_timeout_s: ClassVar[float] = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0  # bytes received since the head began (while it is incomplete)
        self._head_size = 0  # the parsed head's URL and headers
        self._head_started = False  # a request's first byte came, its head is not whole yet
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._cycles: weakref.WeakSet[RequestResponseCycle] = weakref.WeakSet()
        # The cycle whose keep-alive waits for its body (on_headers_complete), and whether the
        # server is shutting down (uvicorn then ends keep-alive for good).
        self._keep_alive_held: RequestResponseCycle | None = None
        self._shutting_down = False

    # --- the head's bounds ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still in an unfinished head (a read may also end a head and carry body bytes: then
        # the head is measured as parsed, in on_headers_complete).
        if self._in_head and self._head_bytes > self.max_head_bytes:
            self._refuse(431, self._too_large)

    @property
    def _too_large(self) -> str:
        return f"the request head is larger than {self.max_head_bytes} bytes"

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._in_head = True
        self._head_started = True
        self._head_size = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        if self._refused:
            return
        super().on_url(url)
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        super().on_header(name, value)
        self._head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        if self._refused:
            return  # a request pipelined behind a refused one: the connection is closing
        self._in_head = False
        self._head_started = False
        self._head_bytes = 0
        self._cancel_head_timer()
        if self._head_size > self.max_head_bytes:
            self._refuse(431, self._too_large)
            return
        if self.parser.should_upgrade() and self._declares_body():
            # The parser reads no body past an Upgrade request's head: the request would reach
            # its route without the body it sent.
            self._refuse(
                400,
                "protocol upgrades are not supported: send the request without an Upgrade header",
            )
            return
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before and cycle.keep_alive:
            # Until its body is whole, an answer to this request ends the connection and says
            # so (on_response_complete closes it); the body's end gives keep-alive back.
            cycle.keep_alive = False
            self._keep_alive_held = cycle

    def _declares_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (
                name == b"content-length" and value.strip() != b"0"
            ):
                return True
        return False

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        held, self._keep_alive_held = self._keep_alive_held, None
        if (
            held is not None
            and not held.response_started
            and not self._shutting_down
            # The parser stops at an Upgrade request's head: on_response_complete closes its
            # connection, so its answer says so.
            and not self.parser.should_upgrade()
        ):
            held.keep_alive = True
        self._in_head = True  # the next request's head, if one comes (pipelined or kept alive)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing():
            return
        if self._head_started:
            if self._answering:
                # A head pipelined behind a response still being written: judged again once
                # that response is out (nothing can be written into it).
                self._arm_head_timer()
                return
            self._refuse(408, f"the request head was not whole within {self.head_timeout_s:g} s")
        elif self.cycle is None:
            # Nothing sent on this connection at all: nothing to answer. (Between requests of
            # a kept-alive connection, uvicorn's keep-alive timeout closes it.)
            self.transport.close()

    @property
    def _answering(self) -> bool:
        """A response of this connection is being written."""
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, message: str) -> None:
        self._refused = True
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        if self._answering:
            # A refusal cannot go into the middle of another response: the connection ends.
            self.transport.close()
            return
        body = orjson.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": status,
                }
            }
        )
        self.transport.write(
            b"".join(
                (
                    STATUS_LINE[status],
                    b"content-type: application/json\r\n",
                    b"content-length: %d\r\n" % len(body),
                    b"connection: close\r\n\r\n",
                    body,
                )
            )
        )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # A request the parser cannot read: the OpenAI error shape (uvicorn's is plain text).
        self._refuse(400, msg)

    def _should_upgrade(self) -> bool:
        # The router serves no WebSocket (uvicorn runs with ws="none"): an Upgrade header is
        # ignored and the request answered as HTTP, by the route it names.
        return False

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn warns of every such request, and tells to install a WebSocket library: a
        # client's header is not the operator's business (nor worth a log line each).
        pass

    # --- disconnects the stock protocol misses ----------------------------------------------

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._cycles.add(cycle)
        if (
            _HTTP10_ADAPTABLE
            and cycle.scope["http_version"] == "1.0"
            and type(cycle) is RequestResponseCycle
        ):
            # uvicorn builds its cycle inside on_headers_complete; its class is swapped here,
            # before the cycle's task first runs, rather than that method copied whole.
            cycle.__class__ = Http10ResponseCycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
        # Every request of this connection not yet answered, not only the newest.
        for cycle in list(self._cycles):
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()

    def shutdown(self) -> None:
        self._shutting_down = True
        super().shutdown()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.response_complete:
            return
        if cycle.more_body:
            # Answered before its body was read: the rest of it is not worth reading.
            self.transport.close()
        elif self.parser.should_upgrade():
            # The parser stops at an Upgrade request's head: nothing more on this connection
            # can be read as HTTP (a body of its own included).
            self.transport.close()


class Http10ResponseCycle(RequestResponseCycle):
    """An HTTP/1.0 request's cycle: a response of unknown length is sent close-delimited, as
    HTTP/1.0 ends such a body (uvicorn sends it chunked; the connection closes after every
    HTTP/1.0 response there already). Streams take the ASGI relay, not the direct writer,
    which writes chunks."""

    _close_delimited = False

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self.response_started:
            names = {name.lower() for name, _ in message.get("headers", ())}
            if (
                b"content-length" not in names
                and b"transfer-encoding" not in names
                and self.scope["method"] != "HEAD"
                and message["status"] not in (204, 304)
            ):
                # Not chunked, and a length uvicorn's body accounting never runs out of; the
                # last body message sets it to what is left.
                self.chunked_encoding = False
                self.expected_content_length = _UNKNOWN_LENGTH
                self._close_delimited = True
        elif (
            kind == "http.response.body"
            and self._close_delimited
            and not message.get("more_body", False)
        ):
            self.expected_content_length = len(message.get("body", b""))
        await super().send(message)


_UNKNOWN_LENGTH = 1 << 62


def _adaptable() -> bool:
    """Whether this uvicorn's cycle takes the HTTP/1.0 class (one whose cycle has slots would
    refuse it): tried once, on a bare instance."""
    probe = RequestResponseCycle.__new__(RequestResponseCycle)
    try:
        probe.__class__ = Http10ResponseCycle
    except TypeError:
        return False
    return True


_HTTP10_ADAPTABLE = _adaptable()


def bounded_http_protocol(head_timeout_s: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type:
    """The protocol class for uvicorn's ``http=`` with these bounds."""
    if not _HTTP10_ADAPTABLE:
        log.warning(
            "this uvicorn's response cycle cannot be adapted: HTTP/1.0 clients get streamed"
            " answers chunked, which they cannot read"
        )
    return type(
        "BoundedHttpProtocol",
        (BoundedHttpProtocol,),
        {"head_timeout_s": head_timeout_s, "max_head_bytes": max_head_bytes},
    )
