"""One pooled client per engine for the request legs, created once and shared by every request,
and a separate short-timeout client per engine for health probes and metric scrapes."""

from __future__ import annotations

from narwhal.contract import FleetContract
from narwhal.engines.transport import (
    ENGINE_TRANSPORTS,
    EngineClient,
    EngineTransportName,
    Timeouts,
    make_engine_client,
)

__all__ = ["ENGINE_TRANSPORTS", "EnginePool"]

# vLLM's API server (uvicorn) closes a connection idle for 5 s. A pooled connection must be
# dropped before that, or a request can be written into a socket the engine is closing and
# fail with a spurious 502.
KEEPALIVE_EXPIRY_S = 4.0
PROBE_CONNECT_TIMEOUT_S = 1.0
PROBE_READ_TIMEOUT_S = 2.0


class EnginePool:
    def __init__(
        self,
        fleet: FleetContract,
        max_connections: int = 2048,
        transport: EngineTransportName = "aiohttp",
        api_key: str | None = None,
    ) -> None:
        # vLLM's --api-key guards only its /v1 routes, but the key goes on every request
        # (legs, probes, scrapes, /tokenize): a proxy in front of an engine may guard more.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        timeouts = Timeouts(fleet.engine.connect_timeout_s, fleet.engine.request_timeout_s)
        self._clients: dict[str, EngineClient] = {
            spec.id: make_engine_client(
                transport, spec.url, timeouts, max_connections, KEEPALIVE_EXPIRY_S, headers
            )
            for spec in fleet.engines
        }
        # Probes and scrapes must not queue behind a busy pool, and a stalled engine must fail
        # its probe within seconds.
        probe_timeouts = Timeouts(PROBE_CONNECT_TIMEOUT_S, PROBE_READ_TIMEOUT_S)
        self._probes: dict[str, EngineClient] = {
            spec.id: make_engine_client(
                transport, spec.url, probe_timeouts, 4, KEEPALIVE_EXPIRY_S, headers
            )
            for spec in fleet.engines
        }

    def client(self, engine_id: str) -> EngineClient:
        return self._clients[engine_id]

    def probe(self, engine_id: str) -> EngineClient:
        return self._probes[engine_id]

    async def aclose(self) -> None:
        for client in (*self._clients.values(), *self._probes.values()):
            await client.aclose()
