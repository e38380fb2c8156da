"""The KV event wire format against vLLM's, and the subscriber's ordering: a lost batch is
replayed from the engine's buffer, a loss beyond it resets the engine's entries, a reordered or
repeated batch is applied once, and a restarted engine's new sequence resets and restarts."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from narwhal.engines.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSubscriber,
    RemovedBlocks,
    StoredBlocks,
    apply_kv_events,
    decode_batch,
    encode_batch,
)
from narwhal.routing.prefix import PrefixIndex, chain_keys
from narwhal.simengine import kv_blocks
from narwhal.simengine.kv_events import KVEventPublisher, KVEventsSettings
from narwhal.testing.ports import free_ports


def test_the_wire_format_is_vllms() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[b"\x01" * 32],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            )
        ],
        data_parallel_rank=0,
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    # An array [ts, events, rank]; each event a map tagged with its class name, vLLM 0.32's
    # required fields present even when null, defaulted ones left out.
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"\x01" * 32],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            }
        ],
        0,
    ]
    ts, events = decode_batch(encode_batch(batch))
    assert ts == 1.5 and events == [StoredBlocks([b"\x01" * 32], None, (1, 2, 3, 4), 4, None)]
    # Other media (an offload tier) are not what the engine can hit without a load.
    removed = {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
    cpu = msgspec.msgpack.encode([2.0, [removed]])
    assert decode_batch(cpu) == (2.0, [])
    with pytest.raises(ValueError):
        decode_batch(b"\x93")
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode({"ts": 1}))


def test_batches_the_typed_reader_does_not_fit_are_read_leniently() -> None:
    stored = {"type": "BlockStored", "block_hashes": [1], "token_ids": [5, 6], "block_size": 2}
    removed = [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in (2, 3)]
    cleared = {"type": "AllBlocksCleared"}
    salted = {**stored, "extra_keys": [["salt-a"]], "parent_block_hash": None}
    expected = [
        RemovedBlocks([2, 3]),  # consecutive removals arrive as one
        StoredBlocks([1], None, (5, 6), 2, "salt-a"),
        None,
        RemovedBlocks([2, 3]),
    ]
    # The typed reader: an older vLLM's events (no medium, no lora fields) are read as well.
    typed = decode_batch(msgspec.msgpack.encode([3.0, [*removed, salted, cleared, *removed]]))
    assert typed == (3.0, expected)
    # An event kind this router does not know, or a longer batch array, takes the lenient path:
    # the same events, the unknown one skipped.
    unknown = {"type": "BlockMoved", "block_hashes": [9]}
    body = [3.0, [removed[0], unknown, removed[1], salted, cleared, *removed], 0, "more"]
    ts, events = decode_batch(msgspec.msgpack.encode(body))
    assert ts == 3.0
    assert events == [
        RemovedBlocks([2]),
        RemovedBlocks([3]),
        StoredBlocks([1], None, [5, 6], 2, "salt-a"),
        None,
        RemovedBlocks([2]),
        RemovedBlocks([3]),
    ]


def test_applied_events_make_the_engines_entries_precise() -> None:
    index = PrefixIndex(4)
    index.add_engine("e0", 64)
    routed = chain_keys(list(range(100, 108)), 4)
    index.record_routed("e0", routed, 0.0)
    tokens = list(range(12))
    stored = StoredBlocks([b"h0", b"h1"], None, tokens[:8], 4, None)
    # The first batch replaces routing history with the engine's own word.
    assert apply_kv_events(index, "e0", [stored]) is None
    assert index.is_precise("e0") and index.match(routed, 0.0) == {}
    assert index.match(chain_keys(tokens, 4), 0.0) == {"e0": 2}
    more = StoredBlocks([b"h2"], b"h1", tokens[8:], 4, None)
    foreign = StoredBlocks([b"x"], None, tokens[:8], 8, None)
    assert apply_kv_events(index, "e0", [more, foreign, RemovedBlocks([b"h1"])]) == 8
    assert index.match(chain_keys(tokens, 4), 0.0) == {"e0": 1}
    assert apply_kv_events(index, "e0", [None]) is None  # AllBlocksCleared
    assert index.blocks_held("e0") == 0


def _batch(ts: float, *hashes: int) -> bytes:
    events: list[Any] = [BlockRemoved(block_hashes=[h], medium="GPU") for h in hashes]
    return encode_batch(KVEventBatch(ts=ts, events=events, data_parallel_rank=0))


class Recorder:
    def __init__(self) -> None:
        self.removed: list[int] = []
        self.resets = 0

    def events(self, events: list[Any]) -> None:
        for event in events:
            assert isinstance(event, RemovedBlocks)
            self.removed.extend(int(h) for h in event.block_hashes)

    def reset(self) -> None:
        self.resets += 1


async def _with_publisher(buffer_steps: int, body: Any) -> None:
    pub_port, replay_port = free_ports(2)
    publisher = KVEventPublisher(
        KVEventsSettings(
            endpoint=f"tcp://127.0.0.1:{pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            buffer_steps=buffer_steps,
        )
    )
    publisher.start()
    try:
        await body(publisher, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    finally:
        await publisher.close()


def _publish(publisher: KVEventPublisher, *hashes: int) -> None:
    for h in hashes:
        publisher.publish([kv_blocks.BlockRemoved([h])])


def test_a_lost_batch_is_replayed_and_a_repeated_one_applied_once() -> None:
    async def body(publisher: KVEventPublisher, endpoint: str, replay: str) -> None:
        _publish(publisher, 10, 11, 12, 13)  # sequence numbers 0..3
        seen = Recorder()
        sub = KVEventSubscriber("e0", endpoint, replay, "", seen.events, seen.reset)
        buffered = dict(publisher._buffer)
        await sub._receive(0, buffered[0])
        # Batches 1 and 2 lost: 3 arrives, 1..2 come from the replay socket first.
        await sub._receive(3, buffered[3])
        assert seen.removed == [10, 11, 12, 13] and sub.gaps == 1 and seen.resets == 0
        # A batch seen again (a replay overlapping the live stream) changes nothing.
        await sub._receive(2, buffered[2])
        assert seen.removed == [10, 11, 12, 13] and sub.next_seq == 4

    asyncio.run(_with_publisher(100, body))


def test_a_loss_beyond_the_replay_buffer_resets_the_engine() -> None:
    async def body(publisher: KVEventPublisher, endpoint: str, replay: str) -> None:
        _publish(publisher, *range(20, 30))  # 0..9, only 7..9 still buffered
        seen = Recorder()
        sub = KVEventSubscriber("e0", endpoint, replay, "", seen.events, seen.reset)
        await sub._receive(0, _batch(1.0, 20))
        buffered = dict(publisher._buffer)
        await sub._receive(9, buffered[9])
        assert seen.resets == 1
        assert seen.removed == [20, 29]  # applied from the live batch on
        assert sub.next_seq == 10

    asyncio.run(_with_publisher(3, body))


def test_without_a_replay_socket_a_gap_resets() -> None:
    seen = Recorder()
    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", seen.events, seen.reset)

    async def body() -> None:
        await sub._receive(0, _batch(1.0, 1))
        await sub._receive(2, _batch(3.0, 3))

    asyncio.run(body())
    assert seen.resets == 1 and seen.removed == [1, 3]


def test_a_restarted_engine_resets_its_entries_and_starts_over() -> None:
    seen = Recorder()
    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", seen.events, seen.reset)

    async def body() -> None:
        for seq in range(5):
            await sub._receive(seq, _batch(1.0 + seq, 100 + seq))
        # The engine restarted: its sequence begins again, stamped after the last batch.
        await sub._receive(0, _batch(10.0, 200))
        await sub._receive(1, _batch(11.0, 201))

    asyncio.run(body())
    assert seen.resets == 1
    assert seen.removed == [100, 101, 102, 103, 104, 200, 201]
    assert sub.next_seq == 2


def test_an_unreadable_batch_resets_and_the_stream_goes_on() -> None:
    seen = Recorder()
    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", seen.events, seen.reset)

    async def body() -> None:
        await sub._receive(0, _batch(1.0, 1))
        await sub._receive(1, b"not msgpack \xc1")
        await sub._receive(2, _batch(3.0, 3))

    asyncio.run(body())
    assert seen.resets == 1 and sub.bad_payloads == 1 and seen.removed == [1, 3]


def test_a_subscriber_started_late_gets_the_buffered_history_over_zmq() -> None:
    async def body(publisher: KVEventPublisher, endpoint: str, replay: str) -> None:
        _publish(publisher, 1, 2, 3)
        seen = Recorder()
        sub = KVEventSubscriber("e0", endpoint, replay, "", seen.events, seen.reset)
        task = asyncio.ensure_future(sub.run())
        try:
            for _ in range(100):  # the SUB socket connects asynchronously
                _publish(publisher, 4)
                await asyncio.sleep(0.02)
                if seen.removed:
                    break
            assert seen.removed[:4] == [1, 2, 3, 4] and seen.resets == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(_with_publisher(100, body))
