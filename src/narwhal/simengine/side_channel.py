"""The NIXL side channel: how a decode engine learns where a prefill engine's KV lives.

vLLM's NixlConnector answers a handshake on ``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT`` with its
agent metadata; the decode side caches it per remote engine. Ours is one request line and one
JSON line over TCP. A cached peer is dropped when a transfer to it fails, so a prefill engine
that restarted (new agent, new generation) is looked up afresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import orjson

from narwhal.simengine.kv_transfer import KVPeerInfo

__all__ = ["PeerDirectory", "serve_side_channel"]

log = logging.getLogger(__name__)

_HELLO = b"NARWHAL-KV-PEER 1\n"
_MAX_LINE = 1 << 20


async def serve_side_channel(
    host: str, port: int, info: Callable[[], KVPeerInfo]
) -> asyncio.Server:
    payload_cache: dict[str, bytes] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(reader.readline(), 5.0)
            if hello != _HELLO:
                return
            if "v" not in payload_cache:
                payload_cache["v"] = orjson.dumps(info().to_wire()) + b"\n"
            writer.write(payload_cache["v"])
            await writer.drain()
        except (TimeoutError, OSError) as exc:
            log.debug("side channel client: %s", exc)
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, reuse_address=True, limit=_MAX_LINE)


class PeerDirectory:
    """Looks peers up over their side channels and caches what they said."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self._cache: dict[tuple[str, int], KVPeerInfo] = {}

    async def lookup(self, host: str, port: int) -> KVPeerInfo:
        cached = self._cache.get((host, port))
        if cached is not None:
            return cached
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=_MAX_LINE), self.timeout
        )
        try:
            writer.write(_HELLO)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), self.timeout)
        finally:
            writer.close()
        if not line:
            raise ValueError("side channel closed without an answer")
        info = KVPeerInfo.from_wire(orjson.loads(line))
        self._cache[(host, port)] = info
        return info

    def invalidate(self, host: str, port: int) -> None:
        self._cache.pop((host, port), None)
