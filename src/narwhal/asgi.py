"""ASGI pieces shared by the router and the simulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = [
    "DisconnectAwareStreamingResponse",
    "EndpointResponse",
    "HotRouteDispatch",
    "register_hot_route",
    "tcp_bind_problem",
]


class _RouteRegistry(Protocol):
    """What ``register_hot_route`` needs of a framework app (FastAPI's and Starlette's)."""

    @property
    def routes(self) -> list[BaseRoute]: ...

    def add_api_route(
        self, path: str, endpoint: Callable[..., Any], *, methods: list[str]
    ) -> None: ...

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...


def register_hot_route(app: _RouteRegistry, path: str, endpoint: ASGIApp) -> None:
    """Declare ``POST path`` on the framework app (its one registration: the OpenAPI schema
    describes it, and a request that comes through the framework is served the same), marked
    for ``HotRouteDispatch`` to serve ahead of the framework."""

    async def route(request: Request) -> Response:
        return EndpointResponse(endpoint)

    route.hot_endpoint = endpoint  # type: ignore[attr-defined]  # HotRouteDispatch.of reads it
    app.add_api_route(path, route, methods=["POST"])


class HotRouteDispatch:
    """The ASGI entry point: a few hot ``POST`` routes go straight to their handlers, everything
    else (and the lifespan) through the framework app.

    FastAPI wraps every request in five middleware layers, each re-wrapping ``send`` for every
    chunk of a stream; profiling put them at several percent of the router's CPU per streamed
    request (docs/performance.md). The hot handlers already turn every failure into a response,
    so those layers add nothing there. The routes stay declared on the framework app as well, so
    the OpenAPI schema still describes them.
    """

    def __init__(self, app: ASGIApp, routes: dict[str, ASGIApp]) -> None:
        self.app = app
        self.routes = routes

    @classmethod
    def of(cls, app: _RouteRegistry) -> HotRouteDispatch:
        """The dispatch for the routes ``register_hot_route`` declared on ``app``."""
        routes: dict[str, ASGIApp] = {}
        for route in app.routes:
            endpoint = getattr(route, "endpoint", None)
            hot = getattr(endpoint, "hot_endpoint", None)
            if isinstance(route, Route) and hot is not None:
                routes[route.path] = hot
        return cls(app, routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


class EndpointResponse(Response):
    """A framework route's answer that hands the exchange to a plain ASGI endpoint (which reads
    the body and sends the response itself)."""

    def __init__(self, endpoint: ASGIApp) -> None:
        self.endpoint = endpoint
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.endpoint(scope, receive, send)


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A streaming response that stops its body iterator as soon as the client disconnects.

    Starlette under ASGI spec 2.4 only notices a disconnect when a write fails, which for a
    stream that is waiting on a queued request can be minutes away. Here a listener task
    watches ``receive`` and cancels the stream at once, so the iterator's ``finally`` can abort
    upstream work.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listener):
                if not task.done():
                    task.cancel()
            await asyncio.gather(stream, listener, return_exceptions=True)
        if stream.done() and not stream.cancelled():
            exc = stream.exception()
            if exc is not None and not isinstance(exc, OSError):
                raise exc
        if self.background is not None:
            with contextlib.suppress(Exception):
                await self.background()


def tcp_bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` (a host that does not resolve, an address
    in use or not on this machine), found by binding and releasing it as the server will
    (SO_REUSEADDR, every address the host resolves to); None when it can. So that a command
    refuses in one line before it starts, not with a traceback or a bare log line in its
    startup."""
    try:
        # "" is every interface to asyncio's and uvloop's servers, as None is to getaddrinfo.
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        return f"{host!r} does not resolve: {reason}"
    for family, kind, proto, _, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this kernel lacks (IPv6 off): the servers skip it too
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # As the servers bind it: the IPv6 address alone, beside an IPv4 listener.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None
