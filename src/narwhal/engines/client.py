"""One pooled HTTP client per engine, created once and shared by every request."""

from __future__ import annotations

import socket

import httpx

from narwhal.contract import FleetContract

__all__ = ["EnginePool"]


class EnginePool:
    def __init__(self, fleet: FleetContract, max_connections: int = 2048) -> None:
        timeout = httpx.Timeout(
            connect=fleet.engine.connect_timeout_s,
            read=fleet.engine.request_timeout_s,
            write=fleet.engine.request_timeout_s,
            pool=fleet.engine.connect_timeout_s,
        )
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=256, keepalive_expiry=30.0
        )
        # TCP_NODELAY: a streamed response must not wait on delayed ACKs between small writes.
        transport_options = {"socket_options": [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]}
        self._clients: dict[str, httpx.AsyncClient] = {
            spec.id: httpx.AsyncClient(
                base_url=spec.url,
                timeout=timeout,
                limits=limits,
                # Engines are only ever the fleet's URLs: no proxies from the environment, no
                # redirects to somewhere else.
                trust_env=False,
                follow_redirects=False,
                transport=httpx.AsyncHTTPTransport(limits=limits, **transport_options),
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
