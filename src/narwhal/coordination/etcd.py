"""A small asyncio client for etcd v3, through etcd's own JSON gateway (``/v3/...``) over the
HTTP client the router already has (httpx).

Why the gateway and not a gRPC client library: it is etcd's documented, versioned HTTP surface
(every etcd since 3.4 serves it on the client port), so nothing new has to be installed beside
the router; the maintained asyncio gRPC clients (``aetcd``, ``etcd3aio``) pull grpcio and
protobuf into a process whose hot path must stay small, and the coordination traffic is a few
requests per second. What the router needs is small: get, put, a transaction, leases (grant,
keep alive, revoke) and a watch, which the gateway streams as newline-delimited JSON.

Keys and values are bytes on the wire (base64 in JSON); 64-bit integers are JSON strings, and
proto3 leaves out every field at its default value (``false``, ``0``, a ``PUT`` event type).

Every failure to reach etcd, or an answer that is not etcd's, raises :class:`EtcdUnavailable`;
the caller decides what a missing coordination service means. Endpoints are tried in order,
starting with the one that answered last.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

__all__ = [
    "Compare",
    "EtcdClient",
    "EtcdUnavailable",
    "KeyValue",
    "Operation",
    "WatchEvent",
    "prefix_end",
]


class EtcdUnavailable(Exception):
    """etcd did not answer, or answered with an error."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    deleted: bool
    kv: KeyValue


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: the key's ``target`` (``CREATE``, ``MOD``, ``VALUE``)
    equal to ``value``. ``CREATE`` 0 means the key does not exist."""

    key: str
    target: str
    value: int | bytes

    def as_json(self) -> dict[str, Any]:
        field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[self.target]
        value = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key.encode()), "target": self.target, field: value}


@dataclass(frozen=True)
class Operation:
    """One request of a transaction: put ``value`` at ``key`` (with ``lease``), or delete
    ``key`` when ``value`` is None."""

    key: str
    value: bytes | None = None
    lease: int = 0

    def as_json(self) -> dict[str, Any]:
        key = _b64(self.key.encode())
        if self.value is None:
            return {"request_delete_range": {"key": key}}
        put: dict[str, Any] = {"key": key, "value": _b64(self.value)}
        if self.lease:
            put["lease"] = str(self.lease)
        return {"request_put": put}


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return raw.decode()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _kv(data: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(data["key"]).decode(),
        value=base64.b64decode(data.get("value", "")),
        create_revision=int(data.get("create_revision", 0)),
        mod_revision=int(data.get("mod_revision", 0)),
        lease=int(data.get("lease", 0)),
    )


class EtcdClient:
    """``endpoints``: ``http://host:port`` of each etcd member."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s
        self._current = 0
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = orjson.dumps(body)
        last: Exception | None = None
        count = len(self.endpoints)
        for step in range(count):
            index = (self._current + step) % count
            try:
                response = await self._http.post(
                    self.endpoints[index] + path,
                    content=payload,
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError as exc:
                last = exc
                continue
            try:
                data = orjson.loads(response.content)
            except orjson.JSONDecodeError:
                last = EtcdUnavailable(f"{path}: HTTP {response.status_code}, not JSON")
                continue
            if response.status_code != 200 or "error" in data:
                # An answer from etcd itself (a lease not found, a request too large): trying
                # another member would get the same one.
                raise EtcdUnavailable(f"{path}: {data.get('message') or data.get('error')}")
            self._current = index
            return data
        # (A timeout's message is empty: its name says what happened.)
        why = f"{type(last).__name__}: {last}" if str(last) else type(last).__name__
        raise EtcdUnavailable(f"{path}: no etcd endpoint answered ({why})")

    # --- keys -------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        data = await self._call("/v3/kv/range", {"key": _b64(key.encode())})
        kvs = data.get("kvs")
        return _kv(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, and the store's revision they were read at."""
        data = await self._call(
            "/v3/kv/range",
            {"key": _b64(prefix.encode()), "range_end": _b64(prefix_end(prefix).encode())},
        )
        return [_kv(kv) for kv in data.get("kvs", ())], int(data["header"]["revision"])

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """The store's revision after the put."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        data = await self._call("/v3/kv/put", body)
        return int(data["header"]["revision"])

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key.encode())})

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Operation],
        failure: Sequence[Operation] = (),
    ) -> tuple[bool, int]:
        """Whether every compare held (and ``success`` ran; else ``failure``), and the store's
        revision after it."""
        data = await self._call(
            "/v3/kv/txn",
            {
                "compare": [c.as_json() for c in compares],
                "success": [o.as_json() for o in success],
                "failure": [o.as_json() for o in failure],
            },
        )
        return bool(data.get("succeeded", False)), int(data["header"]["revision"])

    # --- leases -----------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        data = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(data["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease`` once: its TTL from now, 0 when it has expired (its keys are gone)."""
        data = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    # --- watch ------------------------------------------------------------------------------

    async def watch_prefix(
        self, prefix: str, start_revision: int
    ) -> AsyncIterator[tuple[int, list[WatchEvent]]]:
        """Every change under ``prefix`` from ``start_revision`` on, as (revision, events)
        batches, for as long as the stream lasts (no read timeout: a quiet fleet sends nothing).
        Raises EtcdUnavailable when the stream cannot start or breaks, or when etcd has
        compacted the revisions asked for (read the keys again and watch from there)."""
        body = orjson.dumps(
            {
                "create_request": {
                    "key": _b64(prefix.encode()),
                    "range_end": _b64(prefix_end(prefix).encode()),
                    "start_revision": str(start_revision),
                }
            }
        )
        endpoint = self.endpoints[self._current]
        timeout = httpx.Timeout(self.timeout_s, read=None)
        try:
            async with self._http.stream(
                "POST", endpoint + "/v3/watch", content=body, timeout=timeout
            ) as response:
                if response.status_code != 200:
                    raise EtcdUnavailable(f"watch: HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    data = orjson.loads(line)
                    if "error" in data:
                        raise EtcdUnavailable(f"watch: {data['error']}")
                    result = data.get("result", {})
                    if int(result.get("compact_revision", 0)):
                        raise EtcdUnavailable("watch: revisions compacted")
                    if result.get("canceled"):
                        raise EtcdUnavailable(f"watch canceled: {result.get('cancel_reason')}")
                    events = [
                        WatchEvent(e.get("type") == "DELETE", _kv(e["kv"]))
                        for e in result.get("events", ())
                    ]
                    revision = int(result.get("header", {}).get("revision", 0))
                    yield revision, events
        except httpx.HTTPError as exc:
            self._current = (self._current + 1) % len(self.endpoints)
            raise EtcdUnavailable(f"watch: {exc}") from exc
        except orjson.JSONDecodeError as exc:
            raise EtcdUnavailable(f"watch: not JSON ({exc})") from exc
        raise EtcdUnavailable("watch: the stream ended")
