"""What a client can do to the router's HTTP server, on raw sockets (serve/http_protocol.py):
a request head too large or too slow is refused and its connection closed, a connection that
sends nothing is closed, a response sent before the body was read closes the connection, and
pipelined requests whose client hung up end as client aborts (not internal errors, not a
generation run for nobody)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, RouterProcess, api_keys_file, running_fleet, running_router

KEY = "sk-bounds-key-1"
HEAD_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    # A decode step of about 20 ms: 100 tokens outlast the client that hangs up at 0.3 s.
    with running_fleet(
        tmp_path_factory.mktemp("bounds-fleet"), 2, sim={"time_scale": 2.0}
    ) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def router(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    directory = tmp_path_factory.mktemp("bounds")
    with running_router(
        directory,
        fleet.fleet_path,
        "--api-keys-file",
        str(api_keys_file(directory, KEY)),
        "--body-timeout",
        str(HEAD_TIMEOUT_S),
    ) as router:
        yield router


def connect(router: RouterProcess) -> socket.socket:
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_all(sock: socket.socket, within_s: float = 10) -> bytes:
    """Everything until the router closes the connection (fails if it does not)."""
    sock.settimeout(within_s)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def status_and_error(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


def test_a_head_that_grows_without_end_is_refused(router: RouterProcess) -> None:
    with connect(router) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        # The router closes once the head passes its limit: sending fails then. Sent until it
        # does (bounded): the kernel's loopback buffers hold over a megabyte, so a router
        # descheduled for a moment on a loaded machine lets a fixed 1 MB go through unread.
        deadline = time.monotonic() + 10
        with pytest.raises(OSError):
            while time.monotonic() < deadline:
                sock.sendall(b"a" * 65536)
                time.sleep(0.01)
        status, error = status_and_error(read_all(sock))
    assert status == 431 and "larger than 65536 bytes" in str(error["message"])


def test_a_whole_head_too_large_is_refused(router: RouterProcess) -> None:
    with connect(router) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(100))
            + b"\r\n"
        )
        status, _ = status_and_error(read_all(sock))
    assert status == 431


def test_a_head_not_whole_in_time_is_408_and_an_idle_connection_is_closed(
    router: RouterProcess,
) -> None:
    # The router's deadline runs from its accept: t0 is taken before the connection, so the
    # time waited here is never shorter than the router's (a lower bound whatever the load).
    t0 = time.monotonic()
    with connect(router) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        status, error = status_and_error(read_all(sock))
        waited = time.monotonic() - t0
    assert status == 408 and "not whole within" in str(error["message"])
    assert waited >= HEAD_TIMEOUT_S * 0.8
    with connect(router) as sock:
        assert read_all(sock) == b""  # nothing sent, nothing answered: closed


def test_an_answer_before_the_body_closes_the_connection(router: RouterProcess) -> None:
    """A 401 sent before the body was read: a client trickling the rest of its body kept the
    connection for good (each byte re-armed keep-alive)."""
    with connect(router) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{"
        )
        sock.settimeout(0.2)
        t0 = time.monotonic()
        raw = b""
        closed = False
        while not closed and time.monotonic() - t0 < 4:
            try:
                sock.sendall(b" ")
                chunk = sock.recv(65536)
                raw += chunk
                closed = not chunk
            except TimeoutError:
                continue  # open, nothing to read
            except OSError:
                closed = True  # reset
    assert raw.startswith(b"HTTP/1.1 401") and closed
    # And it says so: a pooling client sent its next request into the closing connection.
    assert b"\r\nconnection: close\r\n" in raw.partition(b"\r\n\r\n")[0].lower() + b"\r\n"


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response of known length: (head, body)."""
    sock.settimeout(10)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def test_a_body_that_comes_after_its_head_keeps_the_connection(router: RouterProcess) -> None:
    """Keep-alive is held back only while a body is on its way: a request whose body arrives
    in a later segment, answered once it is read, leaves the connection open for the next."""
    data = json.dumps({"model": MODEL, "max_tokens": 2, "prompt": "hello"}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    with connect(router) as sock:
        for _ in range(2):
            sock.sendall(head)
            time.sleep(0.2)  # the route is waiting for the body by now
            sock.sendall(data)
            response_head, body = read_response(sock)
            assert response_head.startswith(b"HTTP/1.1 200"), response_head
            assert b"connection: close" not in response_head.lower()
            assert json.loads(body)["choices"]


def test_pipelined_requests_whose_client_hung_up_end_as_client_aborts(
    router: RouterProcess, fleet: SimFleet
) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 100}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\nX-Request-Id: pipelined-hang-up\r\n"
        b"Content-Length: %d\r\n\r\n%s"
    ) % (KEY.encode(), len(body), body)
    with connect(router) as sock:
        sock.sendall(request + request)
        time.sleep(0.3)

    # The request being answered ends as the client's abort: no answer to a closed
    # connection recorded as ok, no internal error, no traceback.
    # This test's own requests, by their id: an earlier test's refusal may be journaled after
    # this one began (the journal is written asynchronously), so "not seen before" would not be
    # "this test's". (The pipelined one behind never starts: the connection is gone first.)
    def own_ends() -> list[dict[str, Any]]:
        return [
            r
            for r in router.records()
            if r["type"] == "request.end" and r.get("client_request_id") == "pipelined-hang-up"
        ]

    assert wait_until(lambda: bool(own_ends()), 10)
    time.sleep(0.5)
    ends = own_ends()
    assert ends and all(e["outcome"] == "client_abort" for e in ends), ends
    assert all(e["status"] is None for e in ends), ends
    log = Path(router.log_path).read_text()
    assert "Traceback" not in log and "internal_error" not in log


def test_an_idle_connection_is_closed_while_others_are_served(router: RouterProcess) -> None:
    """The deadline is the connection's own: another connection's request in flight (a
    stream here) does not keep an idle one open."""
    body = json.dumps(
        {"model": MODEL, "prompt": "hello there", "max_tokens": 200, "stream": True}
    ).encode()
    with connect(router) as busy:
        busy.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
            % (KEY.encode(), len(body), body)
        )
        with connect(router) as idle:
            t0 = time.monotonic()
            assert read_all(idle) == b""
            assert time.monotonic() - t0 < HEAD_TIMEOUT_S * 4


def test_a_head_begun_behind_another_request_is_held_to_the_deadline(
    router: RouterProcess,
) -> None:
    """A second head that starts in the same read as a whole request, then trickles: its
    time bound holds (the read's bytes went to the first request's count)."""
    with connect(router) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nX-A: 1")
        t0 = time.monotonic()
        sock.settimeout(0.5)
        raw = b""
        closed = False
        while not closed and time.monotonic() - t0 < HEAD_TIMEOUT_S * 6:
            try:
                sock.sendall(b"1")  # one more byte of the header, now and then
                chunk = sock.recv(65536)
                raw += chunk
                closed = not chunk
            except TimeoutError:
                continue
            except OSError:
                closed = True
    assert closed, raw
    assert raw.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in raw


def test_an_unreadable_request_is_refused_in_the_openai_shape(router: RouterProcess) -> None:
    """uvicorn's own answer is plain text: the router's has the shape of every other error."""
    with connect(router) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, error = status_and_error(read_all(sock))
    assert status == 400 and error["type"] == "invalid_request_error", error
    assert "Invalid HTTP request" in str(error["message"])


def test_a_websocket_upgrade_is_answered_as_http(router: RouterProcess) -> None:
    """The router serves no WebSocket: an Upgrade header is ignored (a bodiless request is
    answered by its route, then the connection closes: nothing after the head can be read as
    HTTP), and a request with a body, which the parser would not read, is refused saying why.
    uvicorn answered an empty 403, and told the operator's log to install a WebSocket
    library."""
    upgrade = (
        b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    )
    with connect(router) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n")
        raw = read_all(sock)
    assert raw.startswith(b"HTTP/1.1 200"), raw
    # The connection closes after it, and its answer says so.
    assert b"\r\nconnection: close\r\n" in raw.partition(b"\r\n\r\n")[0].lower() + b"\r\n"
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with connect(router) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\n%sContent-Length: %d\r\n\r\n%s"
            % (KEY.encode(), upgrade, len(body), body)
        )
        status, error = status_and_error(read_all(sock))
    assert status == 400 and "upgrades are not supported" in str(error["message"]), error
    log = Path(router.log_path).read_text()
    assert "Unsupported upgrade" not in log and "WebSocket library" not in log


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_http10_client_gets_its_stream_unchunked_and_ended_by_the_close(
    router: RouterProcess, path: str
) -> None:
    """HTTP/1.0 has no chunked encoding (nginx proxies with HTTP/1.0 by default): the chunk
    sizes were read as part of the event stream."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "stream": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    data = json.dumps(body).encode()
    with connect(router) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        raw = read_all(sock)  # the router ends the body by closing
    head, _, stream = raw.partition(b"\r\n\r\n")
    headers = head.lower().split(b"\r\n")
    assert headers[0].startswith(b"http/1.1 200"), head
    assert b"transfer-encoding: chunked" not in headers and b"connection: close" in headers
    events = [line for line in stream.split(b"\n") if line]
    assert all(line.startswith(b"data: ") for line in events), stream[:200]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks and all(
        c["object"] in ("text_completion", "chat.completion.chunk") for c in chunks
    )
    # A response of known length (an error, here) is as before: its Content-Length.
    with connect(router) as sock:
        sock.sendall(f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode())
        raw = read_all(sock)
    status, error = status_and_error(raw)
    assert status == 401 and error["type"]
    assert b"content-length: " in raw.partition(b"\r\n\r\n")[0].lower()


def test_http10_keep_alive_and_pipelining_get_one_answer_each_connection(
    router: RouterProcess,
) -> None:
    """An HTTP/1.0 client asking to keep the connection, with a second request pipelined behind
    a stream: the stream is ended by the close (HTTP/1.0 has no other end for it), so the
    second request is not answered on that connection, and nothing hangs."""
    body = json.dumps({"model": MODEL, "max_tokens": 3, "stream": True, "prompt": "hello"}).encode()
    head = (
        f"POST /v1/completions HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Connection: keep-alive\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with connect(router) as sock:
        sock.sendall(head + body + head + body)
        raw = read_all(sock)
    assert raw.count(b"HTTP/1.1 200") == 1 and raw.endswith(b"data: [DONE]\n\n")
    assert b"transfer-encoding" not in raw.lower()
