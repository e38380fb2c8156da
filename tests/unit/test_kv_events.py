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
    MsgpackTokenIds,
    RemovedBlocks,
    StoredBlocks,
    apply_kv_events,
    decode_batch,
    encode_batch,
)
from narwhal.routing.prefix import PrefixIndex, chain_keys, token_prompt
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
    # Later vLLMs publish the batch as a map: read typed, and leniently with an unknown event.
    as_map = {"ts": 3.0, "events": [*removed, salted, cleared, *removed], "data_parallel_rank": 0}
    assert decode_batch(msgspec.msgpack.encode(as_map)) == (3.0, expected)
    as_map["events"] = [unknown, *removed]
    assert decode_batch(msgspec.msgpack.encode(as_map)) == (
        3.0,
        [RemovedBlocks([2]), RemovedBlocks([3])],
    )


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
    restarts: list[int] = []
    sub = KVEventSubscriber(
        "e0",
        "tcp://127.0.0.1:1",
        None,
        "",
        seen.events,
        seen.reset,
        on_restart=lambda: restarts.append(seen.resets),
    )

    async def body() -> None:
        for seq in range(5):
            await sub._receive(seq, _batch(1.0 + seq, 100 + seq))
        # The engine restarted: its sequence begins again, stamped after the last batch.
        await sub._receive(0, _batch(10.0, 200))
        await sub._receive(1, _batch(11.0, 201))

    asyncio.run(body())
    assert seen.resets == 1
    assert restarts == [1]  # told after the reset: a restarted engine's cache is empty
    assert seen.removed == [100, 101, 102, 103, 104, 200, 201]
    assert sub.next_seq == 2


def test_a_batch_stamped_at_no_finite_time_is_unreadable_and_a_restart_still_seen() -> None:
    """A batch stamped +inf (a QA pass's bogus publisher) was read, and every later batch was
    stamped before it: the engine's restart (its sequence from 0 again) was dropped silently,
    for good, the index frozen on what the old process held."""
    seen = Recorder()
    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", seen.events, seen.reset)

    async def body() -> None:
        await sub._receive(0, _batch(1.0, 1))
        await sub._receive(1, _batch(float("inf"), 2))
        await sub._receive(2, _batch(float("nan"), 3))
        await sub._receive(0, _batch(5.0, 10))  # restarted

    asyncio.run(body())
    assert sub.bad_payloads == 2 and seen.removed == [1, 10]
    assert seen.resets == 3  # two unreadable batches, then the restart
    assert sub.next_seq == 1


def test_an_unreadable_batch_resets_and_the_stream_goes_on() -> None:
    seen = Recorder()
    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", seen.events, seen.reset)

    async def body() -> None:
        await sub._receive(0, _batch(1.0, 1))
        await sub._receive(1, b"not msgpack \xc1")
        await sub._receive(2, _batch(3.0, 3))

    asyncio.run(body())
    assert seen.resets == 1 and sub.bad_payloads == 1 and seen.removed == [1, 3]


@pytest.mark.parametrize(
    "event",
    [
        {"type": "BlockStored", "token_ids": [5, 6], "block_size": 2},  # no block_hashes
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [5], "block_size": "x"},
        {"type": "BlockRemoved", "block_hashes": 4},
    ],
)
def test_a_malformed_event_is_an_unreadable_batch_not_a_crash(event: dict[str, object]) -> None:
    """The lenient reader's fields missing or of the wrong type: a ValueError, which the
    subscriber counts and resets on; before, a KeyError or TypeError ended its task for good."""
    payload = msgspec.msgpack.encode({"ts": 1.0, "events": [event], "extra": 1})
    with pytest.raises(ValueError, match="event is malformed"):
        decode_batch(payload)
    seen = Recorder()
    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", seen.events, seen.reset)

    async def body() -> None:
        await sub._receive(0, payload)
        await sub._receive(1, _batch(2.0, 3))

    asyncio.run(body())
    assert sub.bad_payloads == 1 and seen.resets == 1 and seen.removed == [3]


def test_msgpack_nested_past_msgspecs_depth_is_an_unreadable_batch_not_a_crash() -> None:
    """msgspec raises RecursionError, not DecodeError, for msgpack nested past its limit: it
    ended the subscription (the supervisor restarted it, with a traceback, each time)."""
    for deep in (
        b"\x91" * 100_000 + b"\xc0",
        b"\x92\xcb" + b"\0" * 8 + b"\x91" * 100_000 + b"\xc0",
    ):
        with pytest.raises(ValueError, match="nested too deeply"):
            decode_batch(deep)
    seen = Recorder()
    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", seen.events, seen.reset)

    async def body() -> None:
        await sub._receive(0, _batch(1.0, 1))
        await sub._receive(1, b"\x91" * 100_000 + b"\xc0")
        await sub._receive(2, _batch(3.0, 3))

    asyncio.run(body())
    assert sub.bad_payloads == 1 and seen.resets == 1 and seen.removed == [1, 3]


def test_a_message_with_a_negative_or_odd_sized_sequence_number_is_dropped() -> None:
    """vLLM numbers its batches from 0 in 8 bytes (-1 only ends a replay). A message numbered
    -3 was taken as a stream's first, and the next batch's gap asked the replay socket for
    batches from -2, which cannot be sent: the subscription failed on every such message."""
    import zmq
    import zmq.asyncio

    async def body() -> None:
        pub_port, replay_port = free_ports(2)
        ctx = zmq.asyncio.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{pub_port}")
        replay = ctx.socket(zmq.ROUTER)
        replay.bind(f"tcp://127.0.0.1:{replay_port}")
        seen = Recorder()
        sub = KVEventSubscriber(
            "e0",
            f"tcp://127.0.0.1:{pub_port}",
            f"tcp://127.0.0.1:{replay_port}",
            "",
            seen.events,
            seen.reset,
            replay_timeout_s=0.2,  # the replay socket here answers nothing
        )
        task = asyncio.ensure_future(sub.run())
        try:
            for _ in range(100):  # the SUB socket connects asynchronously
                await pub.send_multipart(
                    [b"", (-3).to_bytes(8, "big", signed=True), _batch(1.0, 7)]
                )
                await pub.send_multipart([b"", (5).to_bytes(4, "big"), _batch(1.5, 8)])
                await pub.send_multipart([b"", (9).to_bytes(8, "big"), _batch(2.0, 9)])
                await asyncio.sleep(0.05)
                if seen.removed:
                    break
            assert not task.done()
            assert seen.removed[:1] == [9] and 7 not in seen.removed and 8 not in seen.removed
            assert sub.bad_payloads >= 2
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
            replay.close(linger=0)

    asyncio.run(body())


def test_a_batch_the_index_cannot_apply_resets_and_the_stream_goes_on() -> None:
    seen = Recorder()
    applied: list[int] = []

    def apply(events: list[object]) -> None:
        applied.append(len(applied))
        if len(applied) == 2:
            raise RuntimeError("index refused it")
        seen.events(events)  # type: ignore[arg-type]

    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", apply, seen.reset)

    async def body() -> None:
        for seq in range(3):
            await sub._receive(seq, _batch(1.0 + seq, 10 + seq))

    asyncio.run(body())
    assert seen.removed == [10, 12] and seen.resets == 1 and sub.bad_payloads == 1
    assert sub.next_seq == 3


def test_unreadable_batches_warn_once_a_minute_and_each_is_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine that sends unreadable batches sends them at its step rate: each is counted
    (``on_unreadable``, narwhal-serve's ``narwhal_kv_event_unreadable_batches_total``) and
    resets the entries, but the log gets one warning, then a count at most once a minute."""
    from narwhal.engines import kv_events

    now = [1000.0]
    monkeypatch.setattr(kv_events.time, "monotonic", lambda: now[0])
    seen = Recorder()
    counted: list[int] = []
    sub = KVEventSubscriber(
        "e0",
        "tcp://127.0.0.1:1",
        None,
        "",
        seen.events,
        seen.reset,
        on_unreadable=lambda: counted.append(1),
    )

    async def body() -> None:
        for seq in range(5):
            await sub._receive(seq, b"not msgpack \xc1")
        now[0] += kv_events.UNREADABLE_LOG_EVERY_S
        await sub._receive(5, b"\xc1")
        await sub._receive(6, _batch(7.0, 7))

    with caplog.at_level("WARNING", logger="narwhal.engines.kv_events"):
        asyncio.run(body())
    assert len(counted) == 6 == sub.bad_payloads == seen.resets
    assert seen.removed == [7]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "batch 0 unreadable" in warnings[0] and "more since" not in warnings[0]
    assert "batch 5 unreadable" in warnings[1] and "4 more since the last warning" in warnings[1]


def test_a_subscription_started_again_resets_the_engine_and_reads_its_history() -> None:
    """A run ended by a fault (narwhal-serve's supervisor starts it again) may have missed or
    half-applied batches: the next run resets the engine's entries and takes its first batch
    as a new stream's, reading what came before from the replay socket."""

    async def body(publisher: KVEventPublisher, endpoint: str, replay: str) -> None:
        seen = Recorder()
        sub = KVEventSubscriber("e0", endpoint, replay, "", seen.events, seen.reset)

        async def run_until(count: int) -> None:
            task = asyncio.ensure_future(sub.run())
            try:
                for _ in range(100):  # the SUB socket connects asynchronously
                    _publish(publisher, 50 + len(seen.removed))
                    await asyncio.sleep(0.02)
                    if len(seen.removed) >= count:
                        return
                raise AssertionError(f"no events: {seen.removed}")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        await run_until(1)
        assert seen.resets == 0
        before = list(seen.removed)
        seen.removed.clear()
        await run_until(len(before) + 1)
        assert seen.resets == 1
        # The whole history again, from the replay buffer, then the live batches.
        assert seen.removed[: len(before)] == before

    asyncio.run(_with_publisher(100, body))


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


def test_a_subscriber_started_after_an_idle_engine_reads_its_history_at_once() -> None:
    """A router started after an engine that then publishes nothing (idle, holding a cache)
    knew nothing of it until its next batch (a QA pass: a prompt the idle engine held went
    cold elsewhere): the replay buffer is read as the subscription starts."""

    async def body(publisher: KVEventPublisher, endpoint: str, replay: str) -> None:
        _publish(publisher, 1, 2, 3)
        seen = Recorder()
        sub = KVEventSubscriber("e0", endpoint, replay, "", seen.events, seen.reset, catch_up=True)
        task = asyncio.ensure_future(sub.run())
        try:
            for _ in range(100):
                await asyncio.sleep(0.02)
                if len(seen.removed) >= 3:
                    break
            assert seen.removed == [1, 2, 3] and sub.next_seq == 3 and seen.resets == 0
            # The live stream goes on from there: nothing twice, nothing lost (what the SUB
            # socket missed while it connected comes from the replay socket).
            for published in range(100):  # the SUB socket connects asynchronously
                _publish(publisher, 100 + published)
                await asyncio.sleep(0.02)
                if len(seen.removed) > 3:
                    break
            later = list(range(100, 100 + len(seen.removed) - 3))
            assert seen.removed == [1, 2, 3, *later] and sub.next_seq == len(seen.removed)
            assert seen.resets == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(_with_publisher(100, body))


def _stored_event(hashes: list[int], parent: int | None, tokens: Any, size: int) -> StoredBlocks:
    """A BlockStored as the router reads it off the wire (its token ids still packed)."""
    event = BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    _, events = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=[event])))
    assert isinstance(events[0], StoredBlocks)
    return events[0]


def test_blocks_of_an_expected_prompt_are_keyed_without_hashing() -> None:
    size = 4
    index = PrefixIndex(size)
    for engine in ("p", "d"):
        index.add_engine(engine, 64)
        index.set_precise(engine, True)
    shared = [7, 7, 7, 7, 8, 8, 8, 8]
    first = [*shared, 1, 2, 3, 4, 5, 6, 7, 8]
    second = [*shared, 9, 9, 9, 9, 300, 70000, 2**40, 5]
    assert apply_kv_events(index, "p", [_stored_event([1, 2, 3, 4], None, first, size)]) is None
    assert index.expected_hits == 0  # nothing was expected: hashed
    keys = chain_keys(second, size)
    prompt = token_prompt({"prompt": second})
    assert prompt is not None
    # The prefill engine holds the shared two blocks, the decode engine nothing.
    index.expect(prompt, keys, [2, 0])
    assert index.expected_runs == 2
    # The prefill engine stores the rest in two steps (a chunked prefill), the decode engine
    # all of it at once: each run is the expected prompt's, keyed from its keys.
    apply_kv_events(index, "p", [_stored_event([13], 2, second[8:12], size)])
    apply_kv_events(index, "p", [_stored_event([14], 13, second[12:], size)])
    apply_kv_events(index, "d", [_stored_event([21, 22, 23, 24], None, second, size)])
    assert index.expected_hits == 3 and index.expected_runs == 0  # all stored: none left
    assert index.match(keys, 0.0) == {"p": 4, "d": 4}
    # Both engines storing the same run (the decode engine pulled what the prefill engine
    # computed): the second is matched by the first one's bytes, with the same keys.
    third = [*shared, 4, 4, 4, 4]
    index.expect(token_prompt({"prompt": third}) or prompt, chain_keys(third, size), [2, 2])
    assert index.expected_runs == 2
    apply_kv_events(index, "p", [_stored_event([41], 2, third[8:], size)])
    apply_kv_events(index, "d", [_stored_event([51], 22, third[8:], size)])
    assert index.expected_hits == 5
    assert index.match(chain_keys(third, size), 0.0) == {"p": 3, "d": 3}
    # A run after the same parent with other tokens is not taken for the expected prompt's.
    other = [*shared, 5, 5, 5, 5]
    apply_kv_events(index, "d", [_stored_event([31], 22, other[8:], size)])
    assert index.expected_hits == 5
    assert index.match(chain_keys(other, size), 0.0) == {"p": 2, "d": 3}


def test_a_run_pulled_whole_is_matched_by_the_bytes_of_the_chunks_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM caches (and publishes) a prefill's blocks a scheduled chunk at a time; the decode
    engine stores all it pulled in one event: compared with the chunks' bytes, not by packing
    the prompt again."""
    size = 4
    index = PrefixIndex(size)
    for engine in ("p", "d"):
        index.add_engine(engine, 64)
        index.set_precise(engine, True)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 2**40, 7, 9, 3]
    prompt = token_prompt({"prompt": tokens})
    assert prompt is not None
    index.expect(prompt, chain_keys(tokens, size), [0, 0])
    apply_kv_events(index, "p", [_stored_event([1, 2], None, tokens[:8], size)])
    apply_kv_events(index, "p", [_stored_event([3, 4], 2, tokens[8:], size)])

    def packed_again(*args: object) -> bool:
        raise AssertionError("the prompt was packed again")

    monkeypatch.setattr(MsgpackTokenIds, "equals", packed_again)
    apply_kv_events(index, "d", [_stored_event([11, 12, 13, 14], None, tokens, size)])
    assert index.expected_hits == 3 and index.expected_runs == 0
    assert index.match(chain_keys(tokens, size), 0.0) == {"p": 4, "d": 4}
    # Joined by their items' bytes: the same ids in other parts join, other ids do not.
    whole = _stored_event([1, 2, 3, 4], None, tokens, size).token_ids
    parts = [_stored_event([1], None, t, size).token_ids for t in (tokens[:4], tokens[4:])]
    assert isinstance(whole, MsgpackTokenIds)
    assert whole.joins(parts) and not whole.joins(parts[:1]) and not whole.joins([tokens])
    assert not whole.joins(parts[::-1])


def test_a_run_nobody_expected_is_hashed_once_for_both_engines_that_store_it() -> None:
    size = 4
    index = PrefixIndex(size)
    for engine in ("p", "d", "x"):
        index.add_engine(engine, 64)
        index.set_precise(engine, True)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    keys = chain_keys(tokens, size)
    # Another replica's request: no prompt of this router's was expected. The prefill engine's
    # run is hashed; the decode engine's, the same ids after the same parent, is not.
    apply_kv_events(index, "p", [_stored_event([1, 2], None, tokens, size)])
    apply_kv_events(index, "d", [_stored_event([7, 8], None, tokens, size)])
    assert index.reused_runs == 1 and index.expected_hits == 0
    assert index.match(keys, 0.0) == {"p": 2, "d": 2}
    # The same ids after another parent are other blocks: hashed, with their own keys.
    apply_kv_events(index, "x", [_stored_event([5], None, tokens[:4], size)])
    apply_kv_events(index, "x", [_stored_event([6], 5, tokens[:4], size)])
    assert index.reused_runs == 1
    assert index.match(chain_keys(tokens[:4] * 2, size), 0.0) == {"p": 1, "d": 1, "x": 2}


def test_packed_ids_another_encoder_wrote_are_read_and_bad_ones_dropped() -> None:
    size = 2
    index = PrefixIndex(size)
    index.add_engine("e", 64)
    index.set_precise("e", True)
    tokens = [1, 2, 3, 4]
    keys = chain_keys(tokens, size)
    prompt = token_prompt({"prompt": tokens})
    assert prompt is not None
    index.expect(prompt, keys, [0])
    # The ids as uint32s (0xce) rather than msgpack's shortest form: no byte-for-byte match,
    # so they are read and hashed, with the same keys.
    wide = bytes([0x94]) + b"".join(b"\xce" + t.to_bytes(4, "big") for t in tokens)
    event = {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": 0, "block_size": size}
    packed = msgspec.msgpack.encode([1.0, [event]]).replace(
        b"\xa9token_ids\x00", b"\xa9token_ids" + wide
    )
    _, events = decode_batch(packed)
    assert events[0] == StoredBlocks([1, 2], None, tokens, size, None)
    assert apply_kv_events(index, "e", events) is None
    assert index.expected_hits == 0 and index.match(keys, 0.0) == {"e": 2}
    # Ids that are not ints are a malformed event: dropped whole, nothing placed.
    bad = _stored_event([5], 2, ["x", "y"], size)
    assert not index.stored("e", bad.block_hashes, 2, bad.token_ids, size)
    assert index.blocks_held("e") == 2


def test_expected_prompts_are_bounded_by_their_tokens() -> None:
    index = PrefixIndex(2, expected_tokens=8)
    index.add_engine("e", 64)
    index.set_precise("e", True)
    prompts = [[n, n, n, n] for n in range(1, 5)]
    for tokens in prompts:
        prompt = token_prompt({"prompt": tokens})
        assert prompt is not None
        index.expect(prompt, chain_keys(tokens, 2), [0])
    assert index.expected_runs == 2
    # Two of four prompts of 4 tokens fit in 8: the oldest two were forgotten (still keyed,
    # by hashing).
    for i, tokens in enumerate(prompts):
        apply_kv_events(index, "e", [_stored_event([10 * i, 10 * i + 1], None, tokens, 2)])
        assert index.match(chain_keys(tokens, 2), 0.0) == {"e": 2}
    assert index.expected_hits == 2


def test_a_restart_in_the_event_stream_drops_the_text_history_a_lost_stream_keeps_it() -> None:
    """The text prompts' routing history outlives a change of the engine's source (a lost
    stream, an unreadable batch) but not its restart, seen when its sequence begins again: a
    restarted engine holds nothing, and was credited with its chats' prefixes for the
    history's lifetime."""
    from narwhal.clock import VirtualClock
    from narwhal.contract import parse_fleet
    from narwhal.metrics import RouterMetrics
    from narwhal.routing.fleet_state import FleetState
    from narwhal.routing.prefix import text_keys
    from narwhal.serve.background import kv_event_subscribers
    from narwhal.simengine.fleet import local_fleet_document

    doc = local_fleet_document([9000, 9001], [9100, 9101], initial_roles=["prefill", "decode"])
    doc["engines"][0]["kv_events"] = {"endpoint": "tcp://127.0.0.1:9200"}
    doc["routing"] = {"prefix": {"enabled": True}}
    state = FleetState(parse_fleet(doc, "fleet.json").contract, VirtualClock(0.0))
    index = state.prefix_index
    assert index is not None
    (sub,) = kv_event_subscribers(state, RouterMetrics(["e0", "e1"], "test", "0" * 64, None))
    text = text_keys(
        ["a chat turn, long enough for several blocks of text " * 20], index.block_size
    )
    assert text

    async def body() -> None:
        await sub._receive(0, _batch(1.0, 1))
        index.record_routed("e0", text, now=0.0, exact=False)
        await sub._receive(5, _batch(2.0, 2))  # a gap nothing replays: a reset
        assert index.match(text, now=1.0) == {"e0": len(text)}
        await sub._receive(0, _batch(3.0, 3))  # the sequence begins again: a restart
        assert index.match(text, now=1.0) == {}

    asyncio.run(body())
