"""One pooled HTTP client per engine, created once and shared by every request.

The request legs go through httpx's client API; the bytes move either with aiohttp (the
default: a C HTTP parser, about a third less router CPU per request, docs/performance.md) or
with httpx's own httpcore transport (``--engine-transport httpx``, kept for comparison).
"""

from __future__ import annotations

import socket
from typing import Literal

import httpx

from narwhal.contract import FleetContract
from narwhal.engines.aiohttp_transport import AiohttpTransport

__all__ = ["ENGINE_TRANSPORTS", "EnginePool"]

ENGINE_TRANSPORTS = ("aiohttp", "httpx")
# vLLM's API server (uvicorn) closes a connection idle for 5 s. A pooled connection must be
# dropped before that, or a request can be written into a socket the engine is closing and
# fail with a spurious 502.
KEEPALIVE_EXPIRY_S = 4.0


class EnginePool:
    def __init__(
        self,
        fleet: FleetContract,
        max_connections: int = 2048,
        transport: Literal["aiohttp", "httpx"] = "aiohttp",
    ) -> None:
        timeout = httpx.Timeout(
            connect=fleet.engine.connect_timeout_s,
            read=fleet.engine.request_timeout_s,
            write=fleet.engine.request_timeout_s,
            pool=fleet.engine.connect_timeout_s,
        )
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=256,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )

        def engine_transport() -> httpx.AsyncBaseTransport:
            # TCP_NODELAY: a streamed response must not wait on delayed ACKs between small
            # writes (aiohttp sets it on every connection it opens).
            if transport == "aiohttp":
                return AiohttpTransport(max_connections, KEEPALIVE_EXPIRY_S)
            return httpx.AsyncHTTPTransport(
                limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            )

        self._clients: dict[str, httpx.AsyncClient] = {
            spec.id: httpx.AsyncClient(
                base_url=spec.url,
                timeout=timeout,
                limits=limits,
                # Engines are only ever the fleet's URLs: no proxies from the environment, no
                # redirects to somewhere else.
                trust_env=False,
                follow_redirects=False,
                transport=engine_transport(),
            )
            for spec in fleet.engines
        }
        # A separate short-timeout client per engine for probes and scrapes.
        probe_timeout = httpx.Timeout(2.0, connect=1.0)
        self._probes: dict[str, httpx.AsyncClient] = {
            spec.id: httpx.AsyncClient(
                base_url=spec.url, timeout=probe_timeout, trust_env=False, follow_redirects=False
            )
            for spec in fleet.engines
        }

    def client(self, engine_id: str) -> httpx.AsyncClient:
        return self._clients[engine_id]

    def probe(self, engine_id: str) -> httpx.AsyncClient:
        return self._probes[engine_id]

    async def aclose(self) -> None:
        for client in (*self._clients.values(), *self._probes.values()):
            await client.aclose()
