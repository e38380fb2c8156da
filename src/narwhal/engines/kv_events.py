"""vLLM's KV cache events on the wire, and the router's subscription to one engine's stream.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``,
``vllm/distributed/kv_events.py``) publishes one ``KVEventBatch`` per engine step on a ZMQ PUB
socket as three frames: topic, an 8-byte big-endian sequence number, and the msgpack body
(msgspec: the batch an array ``[ts, events, data_parallel_rank]``, each event a map tagged
``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``). Its ROUTER replay socket
answers a start sequence number (8 bytes, big-endian) with every buffered batch from it as
``(topic, seq, payload)`` and then an end marker (sequence -1, empty payload).

``KVEventBatch`` and its events below are vLLM 0.32's structs field for field (what the
simulated engine publishes); ``decode_batch`` reads any vLLM's batches leniently (a field this
version lacks or adds is no reason to drop an engine's events). ``KVEventSubscriber`` keeps an
engine's stream in order: a gap in the sequence is replayed from the engine's buffer; what
cannot be replayed, and an engine whose sequence starts over (a restart), reset the engine's
entries (``on_reset``), so the index under-reports rather than claims blocks an engine lost.
``apply_kv_events`` applies a delivered batch to the prefix index (``narwhal.routing.prefix``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from narwhal.routing.prefix import PackedTokenIds, PrefixIndex

__all__ = [
    "END_SEQ",
    "UNREADABLE_LOG_EVERY_S",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventSubscriber",
    "MsgpackTokenIds",
    "RemovedBlocks",
    "StoredBlocks",
    "apply_kv_events",
    "decode_batch",
    "encode_batch",
]

log = logging.getLogger(__name__)

END_SEQ = -1
UNREADABLE_LOG_EVERY_S = 60.0


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (msgspec tags each with its class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


_TOKEN_IDS = msgspec.msgpack.Decoder(tuple[int, ...])


def _array_header(data: bytes) -> tuple[int, int]:
    """A msgpack array's (length, header bytes); (-1, 0) for anything else."""
    if not data:
        return -1, 0
    first = data[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, 1
    if first == 0xDC and len(data) >= 3:
        return int.from_bytes(data[1:3], "big"), 3
    if first == 0xDD and len(data) >= 5:
        return int.from_bytes(data[1:5], "big"), 5
    return -1, 0


class MsgpackTokenIds:
    """A ``BlockStored``'s token ids still in msgpack: compared with a prompt the router sent by
    packing the prompt's slice the same way (msgpack's shortest forms, as vLLM's msgspec writes
    them; another packing only costs the comparison, never a wrong key), read only when that
    fails. Reading ~8,000 ids and hashing them was most of a long prompt's event cost."""

    __slots__ = ("_data", "_header", "_len")

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._len, self._header = _array_header(data)

    def __len__(self) -> int:
        return max(self._len, 0)

    def __eq__(self, other: object) -> bool:
        # A value: two packed ids are equal when their bytes are (and hash so); against a
        # sequence, by content (events compare as their contents).
        if isinstance(other, MsgpackTokenIds):
            return self._data == other._data
        if isinstance(other, Sequence):
            try:
                return list(self.unpack()) == list(other)
            except ValueError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._data)

    def unpack(self) -> tuple[int, ...]:
        try:
            return _TOKEN_IDS.decode(self._data)
        except msgspec.DecodeError as exc:
            raise ValueError(f"token ids: {exc}") from None

    def joins(self, parts: Sequence[Any]) -> bool:
        # msgpack packs each int on its own, so ids one after another are their items' bytes
        # one after another (each array's header left out).
        if not all(isinstance(p, MsgpackTokenIds) for p in parts):
            return False
        if sum(max(p._len, 0) for p in parts) != self._len:
            return False
        items = memoryview(self._data)[self._header :]
        at = 0
        for p in parts:
            piece = memoryview(p._data)[p._header :]
            if items[at : at + len(piece)] != piece:
                return False
            at += len(piece)
        return at == len(items)

    def equals(self, tokens: Sequence[int], start: int, stop: int, probe: int) -> bool:
        if stop - start != self._len:
            return False
        try:
            head = _ENCODER.encode(tokens[start : min(stop, start + probe)])
            if not self._data.startswith(head[_array_header(head)[1] :], self._header):
                return False
            return _ENCODER.encode(tokens[start:stop]) == self._data
        except (TypeError, OverflowError, msgspec.EncodeError):
            return False


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    block_hashes: Sequence[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: Sequence[int] | PackedTokenIds
    block_size: int
    salt: str | None  # the cache_salt of block 0 (vLLM: in its extra keys)


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    block_hashes: Sequence[bytes | int]


ReadEvent = StoredBlocks | RemovedBlocks | None  # None: AllBlocksCleared


def apply_kv_events(index: PrefixIndex, engine_id: str, events: Iterable[ReadEvent]) -> int | None:
    """Apply a batch of ``engine_id``'s events, in order, to the prefix index, whose entries for
    the engine come from its events from now on (``PrefixIndex.set_precise``). Returns the
    first block size other than the index's that a ``BlockStored`` carried (its blocks cannot
    be indexed), else None."""
    index.set_precise(engine_id, True)
    foreign: int | None = None
    for event in events:
        if isinstance(event, RemovedBlocks):
            index.removed(engine_id, event.block_hashes)
        elif isinstance(event, StoredBlocks):
            placed = index.stored(
                engine_id,
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                event.salt,
            )
            if not placed and event.block_size != index.block_size and foreign is None:
                foreign = event.block_size
        else:
            index.clear(engine_id)
    return foreign


# What the router reads of a batch, typed: msgspec builds these in C, without a dict per event.
# Fields the router does not use are not declared (msgspec skips them), and those it needs but
# some vLLM leaves out have defaults; a batch these do not fit (an event kind they do not know,
# a longer array) is read by the lenient path below instead.
class _ReadStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[bytes | int]
    token_ids: msgspec.Raw
    block_size: int
    parent_block_hash: bytes | int | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None


class _ReadRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[bytes | int]
    medium: str | None = None


class _ReadCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _ReadBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ReadStored | _ReadRemoved | _ReadCleared]
    data_parallel_rank: Any = None


class _ReadMapBatch(msgspec.Struct, gc=False):
    # vLLM releases after 0.32 publish the batch as a map ({"ts", "events", ...}), not an array.
    ts: float
    events: list[_ReadStored | _ReadRemoved | _ReadCleared]


_READER = msgspec.msgpack.Decoder(_ReadBatch)
# msgspec raises RecursionError, not DecodeError, for msgpack nested past its depth limit.
_UNREADABLE = (msgspec.DecodeError, RecursionError)
_MAP_READER = msgspec.msgpack.Decoder(_ReadMapBatch)


def _salt_of(extra_keys: Any) -> str | None:
    """vLLM puts block 0's ``cache_salt`` last among the block's string extra keys."""
    extra = extra_keys or []
    if extra and isinstance(extra[0], list | tuple):
        strings = [k for k in extra[0] if isinstance(k, str)]
        return strings[-1] if strings else None
    return None


def decode_batch(payload: bytes) -> tuple[float, list[ReadEvent]]:
    """A batch's time stamp and events in order; raises ValueError for a body that is not a KV
    event batch. Events of other media than the GPU's (CPU offload tiers) and kinds it does not
    know are skipped: the index is of what an engine can hit without a load. Consecutive
    removals come as one ``RemovedBlocks`` (vLLM publishes one event per evicted block: a
    12,000-token prompt's turn through a full cache is ~500 of them per engine)."""
    batch: _ReadBatch | _ReadMapBatch
    try:
        batch = _READER.decode(payload)
    except _UNREADABLE:
        try:
            batch = _MAP_READER.decode(payload)
        except _UNREADABLE:
            return _decode_leniently(payload)
    out: list[ReadEvent] = []
    removed: list[bytes | int] | None = None
    for event in batch.events:
        if event.__class__ is _ReadRemoved:
            if event.medium is None or event.medium == "GPU":
                if removed is None:
                    removed = []
                    out.append(RemovedBlocks(removed))
                removed += event.block_hashes
            continue
        if event.__class__ is _ReadStored:
            if event.medium is not None and event.medium != "GPU":
                continue
            out.append(
                StoredBlocks(
                    event.block_hashes,
                    event.parent_block_hash,
                    MsgpackTokenIds(bytes(event.token_ids)),
                    event.block_size,
                    _salt_of(event.extra_keys) if event.parent_block_hash is None else None,
                )
            )
        else:
            out.append(None)
        removed = None
    return _stamp(batch.ts), out


def _stamp(ts: float) -> float:
    """A batch's time stamp, which orders a restarted engine's new sequence after the old:
    an infinite or NaN one would put every later batch before it (a restart never seen)."""
    ts = float(ts)
    if not math.isfinite(ts):
        raise ValueError(f"time stamp {ts!r} is not a finite number")
    return ts


def _decode_leniently(payload: bytes) -> tuple[float, list[ReadEvent]]:
    """``decode_batch`` for a batch the typed reader does not fit, read as plain msgpack."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    except RecursionError:
        raise ValueError("msgpack nested too deeply to be a KV event batch") from None
    if isinstance(raw, dict):  # a later vLLM's map form
        raw = [raw.get("ts"), raw.get("events")]
    if (
        not isinstance(raw, list)
        or len(raw) < 2
        or not isinstance(raw[0], int | float)
        or not isinstance(raw[1], list)
    ):
        raise ValueError("not a KVEventBatch ([ts, events, ...] or {ts, events, ...})")
    out: list[ReadEvent] = []
    for event in raw[1]:
        if not isinstance(event, dict):
            raise ValueError("a KV event is not a map")
        kind = event.get("type")
        medium = event.get("medium")
        if medium not in (None, "GPU"):
            continue
        # A field missing or of the wrong type is an unreadable batch, not a crash of the
        # subscriber that reads it.
        try:
            if kind == "BlockStored":
                out.append(
                    StoredBlocks(
                        list(event["block_hashes"]),
                        event.get("parent_block_hash"),
                        list(event["token_ids"]),
                        int(event["block_size"]),
                        _salt_of(event.get("extra_keys")),
                    )
                )
            elif kind == "BlockRemoved":
                out.append(RemovedBlocks(list(event["block_hashes"])))
            elif kind == "AllBlocksCleared":
                out.append(None)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a {kind} event is malformed: {exc!r}") from None
    return _stamp(raw[0]), out


class KVEventSubscriber:
    """One engine's KV event stream, delivered in sequence order to ``on_events``.

    ``on_reset`` is called when the engine's past entries can no longer be trusted: a gap that
    the replay socket cannot fill (or no replay socket), a sequence that starts again from 0
    (the engine restarted), a batch that cannot be read or applied, or a subscription started
    again after a fault (``run`` called again). ``on_events`` gets each batch's events in
    order; ``on_unreadable`` is told of each batch that could not be read or applied."""

    def __init__(
        self,
        engine_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_events: Callable[[list[ReadEvent]], None],
        on_reset: Callable[[], None],
        replay_timeout_s: float = 2.0,
        on_unreadable: Callable[[], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        catch_up: bool = False,
    ) -> None:
        self.engine_id = engine_id
        # Read the replay buffer as the subscription starts (``_catch_up``): what a router wants
        # (to know an idle engine's cache), not a check that the live stream publishes.
        self.catch_up = catch_up
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.on_events = on_events
        self.on_reset = on_reset
        self.on_unreadable = on_unreadable
        # Told, after ``on_reset``, when the reset is the engine's restart (its sequence began
        # again): its cache is empty, which a lost stream or an unreadable batch does not say.
        self.on_restart = on_restart
        self.replay_timeout_s = replay_timeout_s
        self.next_seq: int | None = None
        self.replaying = False  # waiting for the replay socket (the live stream waits too)
        self.last_ts = float("-inf")  # the last delivered batch's time stamp
        self.batches = 0
        self.gaps = 0
        self.resets = 0
        self.bad_payloads = 0
        self.runs = 0
        # An engine that sends unreadable batches sends them at its step rate: one warning
        # with its traceback, then a count at most every UNREADABLE_LOG_EVERY_S.
        self._unreadable_logged_at = float("-inf")
        self._unreadable_unlogged = 0
        self._ctx = zmq.asyncio.Context.instance()

    async def run(self) -> None:
        """Subscribe and deliver until cancelled. Called again after a fault ended a run, it
        starts from a clean slate: the engine's entries are reset and the next batch is taken
        as a stream's first (what came before it, from the replay socket)."""
        self.runs += 1
        if self.runs > 1:
            self.next_seq = None
            self.replaying = False
            self._reset("its subscription started again after a fault")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            if self.catch_up and self.replay_endpoint is not None:
                await self._catch_up()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    # No sequence number to judge by: the next batch's shows any gap.
                    self._unreadable(f"message of {len(frames)} frames (not 3) dropped")
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0 or len(seq_bytes) != 8:
                    # vLLM counts its batches from 0 in 8 bytes; -1 ends a replay and is
                    # never published. Dropped as unreadable: the next batch shows any gap.
                    self._unreadable(f"message with sequence number {seq_bytes.hex()} dropped")
                    continue
                await self._receive(seq, payload)
        finally:
            sub.close(linger=0)

    async def _receive(self, seq: int, payload: bytes) -> None:
        expected = self.next_seq
        if expected is not None and seq < expected:
            # Either already delivered (a replay overlapped the live stream) or a new sequence
            # from a restarted engine: a batch stamped after the last one delivered.
            try:
                ts, _ = decode_batch(payload)
            except ValueError:
                return
            if ts <= self.last_ts:
                return
            self._reset("its event sequence started over (an engine restart)")
            if self.on_restart is not None:
                self.on_restart()
            expected = self.next_seq = None
        if expected is None:
            # The first batch of a stream: what the engine published before it (a slow
            # joiner, a router started after the engine) comes from the replay buffer.
            if seq > 0:
                await self._replay_from(0, seq, complete_required=False)
        elif seq > expected:
            self.gaps += 1
            await self._replay_from(expected, seq, complete_required=True)
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        if self.next_seq is not None and seq < self.next_seq:
            return
        try:
            ts, events = decode_batch(payload)
        except ValueError as exc:
            self.next_seq = seq + 1
            self._unreadable(f"batch {seq} unreadable (its entries reset): {exc}")
            self._reset("a batch could not be read", quiet=True)
            return
        self.next_seq = seq + 1
        self.last_ts = max(self.last_ts, ts)
        self.batches += 1
        try:
            self.on_events(events)
        except Exception:  # a batch the index cannot apply must not end the subscription
            self._unreadable(
                f"batch {seq} could not be applied (its entries reset)", traceback=True
            )
            self._reset("a batch could not be applied", quiet=True)

    def _unreadable(self, what: str, traceback: bool = False) -> None:
        self.bad_payloads += 1
        if self.on_unreadable is not None:
            self.on_unreadable()
        now = time.monotonic()
        if now - self._unreadable_logged_at < UNREADABLE_LOG_EVERY_S:
            self._unreadable_unlogged += 1
            return
        more = self._unreadable_unlogged
        self._unreadable_logged_at = now
        self._unreadable_unlogged = 0
        log.warning(
            "engine %s: KV event %s%s",
            self.engine_id,
            what,
            f"; {more} more since the last warning" if more else "",
            exc_info=traceback,
        )

    def _reset(self, why: str, quiet: bool = False) -> None:
        self.resets += 1
        if not quiet:  # an unreadable batch's reset is in its own (throttled) warning
            log.warning("engine %s: KV event index reset: %s", self.engine_id, why)
        self.on_reset()

    async def _catch_up(self) -> None:
        """What the engine published before this subscription (a router started after it),
        read from its replay buffer at once: an engine that publishes nothing for a while (idle,
        holding a cache) would otherwise stay unknown until its next batch. The live stream
        then goes on from there (a batch already read is ignored; a gap is replayed)."""
        self.replaying = True
        try:
            got = await self.fetch_replay(0)
        finally:
            self.replaying = False
        for seq, payload in sorted(got or []):
            if seq >= 0 and (self.next_seq is None or seq >= self.next_seq):
                self._deliver(seq, payload)

    async def _replay_from(self, start: int, live_seq: int, complete_required: bool) -> None:
        """Deliver the batches ``start .. live_seq-1`` from the engine's replay buffer. When
        the engine's earlier entries were relied on (``complete_required``) and the buffer
        cannot supply them all, reset instead: the stream counts again from ``live_seq``."""
        self.replaying = True
        try:
            got = await self.fetch_replay(start) if self.replay_endpoint else None
        finally:
            self.replaying = False
        wanted = sorted((s, p) for s, p in (got or []) if start <= s < live_seq)
        complete = [s for s, _ in wanted] == list(range(start, live_seq))
        if complete or not complete_required:
            for s, p in wanted:
                self._deliver(s, p)
        else:
            self._reset(f"events {start}..{live_seq - 1} lost and not replayable")
            self.next_seq = None

    async def fetch_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The batches the engine's replay buffer holds from sequence ``start`` on, or None
        when its replay socket does not answer within ``replay_timeout_s`` or answers wrongly."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:  # b"", topic, seq, payload
                        return None
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == END_SEQ:
                        return out
                    out.append((seq, frames[3]))
        except TimeoutError:
            log.warning("engine %s: KV event replay timed out", self.engine_id)
            return None
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)
