"""The simulated engine's KV event publisher: vLLM's ``ZmqEventPublisher`` on the wire.

A PUB socket sends each step's events as one ``KVEventBatch`` (topic, 8-byte big-endian
sequence number, msgpack body); the last ``buffer_steps`` batches are kept for the ROUTER
replay socket, which answers a start sequence number with every buffered batch from it and an
end marker. Settings are vLLM's ``--kv-events-config`` JSON (``KVEventsSettings.parse``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import orjson
import zmq
import zmq.asyncio

from narwhal.engines.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from narwhal.simengine import kv_blocks

__all__ = ["KVEventPublisher", "KVEventsSettings", "check_bindable"]

log = logging.getLogger(__name__)

MEDIUM = "GPU"


@dataclass(frozen=True)
class KVEventsSettings:
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""
    # As vLLM: the PUB socket binds an endpoint with a wildcard (or ipc/inproc) and connects to
    # any other (a subscriber that binds); the replay socket always binds.
    bind: bool = True

    @staticmethod
    def parse(text: str) -> KVEventsSettings | None:
        """vLLM's ``--kv-events-config`` JSON; None when it does not enable zmq publishing.
        Raises ValueError naming the field that is wrong."""
        try:
            raw: Any = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {
            "enable_kv_cache_events",
            "publisher",
            "endpoint",
            "replay_endpoint",
            "buffer_steps",
            "hwm",
            "max_queue_size",
            "topic",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field {unknown[0]!r}")
        publisher = raw.get("publisher", "zmq")
        if publisher not in ("zmq", "null"):  # vLLM's EventPublisherFactory knows these two
            raise ValueError(
                f"--kv-events-config: unknown publisher {publisher!r} (vLLM's: 'zmq', 'null')"
            )
        if not raw.get("enable_kv_cache_events") or publisher != "zmq":
            return None
        settings = KVEventsSettings(
            endpoint=raw.get("endpoint", "tcp://*:5557"),
            replay_endpoint=raw.get("replay_endpoint"),
            buffer_steps=raw.get("buffer_steps", 10_000),
            hwm=raw.get("hwm", 100_000),
            topic=raw.get("topic", ""),
        )
        endpoint = settings.endpoint
        if isinstance(endpoint, str):
            settings = dataclasses.replace(
                settings,
                bind="*" in endpoint
                or "::" in endpoint
                or endpoint.startswith(("ipc://", "inproc://")),
            )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(settings, name)
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise ValueError(f"--kv-events-config: {name} must be a zmq address")
            if value is not None and value.startswith("tcp://"):
                port = value.rpartition(":")[2]
                # libzmq takes a port past 65535 modulo 65536: tcp://*:99999 binds 34463.
                if port != "*" and not (port.isdigit() and int(port) < 65536):
                    raise ValueError(
                        f"--kv-events-config: {name} {value!r}: the port must be from 0 to "
                        "65535 (or *)"
                    )
        for name in ("buffer_steps", "hwm"):
            value = getattr(settings, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        if not isinstance(settings.topic, str):
            raise ValueError("--kv-events-config: topic must be a string")
        return settings


def _wire(event: kv_blocks.KVEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(event, kv_blocks.BlockStored):
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
            extra_keys=list(event.extra_keys) if event.extra_keys else None,
            group_idx=0,
        )
    if isinstance(event, kv_blocks.BlockRemoved):
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM, group_idx=0)
    return AllBlocksCleared()


def check_bindable(settings: KVEventsSettings) -> None:
    """Bind (and release) the endpoints the publisher will bind, so that an address in use or
    one zmq cannot take is a usage error before the engine starts rather than a traceback in
    its startup. ValueError naming the endpoint and zmq's reason."""
    wanted = [("endpoint", settings.endpoint, zmq.PUB)] if settings.bind else []
    if settings.replay_endpoint is not None:
        wanted.append(("replay_endpoint", settings.replay_endpoint, zmq.ROUTER))
    ctx = zmq.Context()
    held: list[zmq.Socket[bytes]] = []
    try:
        for name, address, kind in wanted:  # all held at once: the two may collide
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            held.append(sock)
            try:
                sock.bind(address)
            except zmq.ZMQError as exc:
                raise ValueError(
                    f"--kv-events-config: {name} {address!r} cannot be bound: {exc.strerror}"
                ) from None
    finally:
        for sock in held:
            sock.close(linger=0)
        ctx.term()  # waits for the sockets to close: their ports are free again


class KVEventPublisher:
    def __init__(self, settings: KVEventsSettings) -> None:
        self.settings = settings
        self._topic = settings.topic.encode()
        self._seq = count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        # PUB sends synchronously and never blocks (NOBLOCK); the replay socket is awaited.
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.published = 0

    def start(self) -> None:
        pub = self._sync_ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(self.settings.hwm)
        if self.settings.bind:
            pub.bind(self.settings.endpoint)
        else:
            pub.connect(self.settings.endpoint)
        self._pub = pub
        if self.settings.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.settings.replay_endpoint)
            self._replay = replay
            self._replay_task = asyncio.ensure_future(self._serve_replay())

    def publish(self, events: Sequence[kv_blocks.KVEvent]) -> None:
        """One batch (one engine step's events); never blocks: past the high-water mark a
        subscriber misses batches, as with vLLM, and must replay them."""
        if not events or self._pub is None:
            return
        seq = next(self._seq)
        payload = encode_batch(
            KVEventBatch(ts=time.time(), events=[_wire(e) for e in events], data_parallel_rank=0)
        )
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        self.published += 1

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        self._sync_ctx.term()

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV event replay request (%d frames)", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart(
                (client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b"")
            )
