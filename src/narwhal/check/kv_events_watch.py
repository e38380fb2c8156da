"""Listening to the engines' KV event streams while the kv_transfer gate's handoffs run: each
engine the fleet says publishes (``kv_events``) is subscribed to exactly as narwhal-serve
subscribes (``narwhal.engines.kv_events.KVEventSubscriber``), and its replay socket is asked
for the last batch seen. The handoffs' prefills store blocks on the prefill engines and their
KV pulls on the decode engines, so every engine that ran a leg publishes something; one that
does not (a wrong endpoint, events off) leaves the router routing to it by its history only."""

from __future__ import annotations

import asyncio
import contextlib

from narwhal.check.evidence import KVEventsSeen
from narwhal.contract import FleetContract
from narwhal.engines.kv_events import (
    KVEventSubscriber,
    ReadEvent,
    RemovedBlocks,
    StoredBlocks,
    decode_batch,
)

__all__ = ["KVEventsWatch"]

# ZMQ subscriptions take effect a moment after connecting (the "slow joiner"): what an engine
# publishes earlier is fetched from its replay socket, but waiting this long first keeps the
# live stream the one observed.
SUBSCRIBE_SETTLE_S = 0.3
# Events of the last handoff's step reach the subscriber a moment after its answer.
DRAIN_S = 0.5


class _Tally:
    def __init__(self) -> None:
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.block_sizes: set[int] = set()

    def add(self, events: list[ReadEvent]) -> None:
        for event in events:
            if isinstance(event, StoredBlocks):
                self.stored += len(event.block_hashes)
                self.block_sizes.add(event.block_size)
            elif isinstance(event, RemovedBlocks):
                self.removed += len(event.block_hashes)
            else:
                self.cleared += 1


class KVEventsWatch:
    """Subscribed to every publishing engine from ``start`` to ``stop``."""

    def __init__(self, fleet: FleetContract, replay_timeout_s: float = 2.0) -> None:
        self._subscribers: list[tuple[KVEventSubscriber, _Tally]] = []
        self._tasks: list[asyncio.Task[None]] = []
        for spec in fleet.engines:
            if spec.kv_events is None:
                continue
            tally = _Tally()
            subscriber = KVEventSubscriber(
                spec.id,
                spec.kv_events.endpoint,
                spec.kv_events.replay_endpoint,
                spec.kv_events.topic,
                on_events=tally.add,
                on_reset=lambda: None,
                replay_timeout_s=replay_timeout_s,
            )
            self._subscribers.append((subscriber, tally))

    async def start(self) -> None:
        for subscriber, _ in self._subscribers:
            self._tasks.append(asyncio.ensure_future(subscriber.run()))
        if self._subscribers:
            await asyncio.sleep(SUBSCRIBE_SETTLE_S)

    async def stop(self) -> list[KVEventsSeen]:
        """Unsubscribe (after the last events had time to arrive) and ask each replay socket
        for the last batch delivered. Safe to call after a failed or cancelled ``start``."""
        # Stopped because the check is being cancelled: no drain, no replay question.
        current = asyncio.current_task()
        hurry = current is not None and current.cancelling() > 0
        try:
            if self._subscribers and not hurry:
                await asyncio.sleep(DRAIN_S)
                # A subscriber asking a replay socket holds its live batches until it answers
                # or times out: let it finish, or they would go uncounted.
                for subscriber, _ in self._subscribers:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(subscriber.replay_timeout_s + DRAIN_S):
                            while subscriber.replaying:
                                await asyncio.sleep(0.05)
        finally:
            for task in self._tasks:
                task.cancel()
            # Raises CancelledError only when this task itself is cancelled.
            ended = await asyncio.gather(*self._tasks, return_exceptions=True)
        seen = []
        for (subscriber, tally), end in zip(self._subscribers, ended, strict=True):
            seen.append(
                KVEventsSeen(
                    engine_id=subscriber.engine_id,
                    endpoint=subscriber.endpoint,
                    replay_endpoint=subscriber.replay_endpoint,
                    batches=subscriber.batches,
                    stored_blocks=tally.stored,
                    removed_blocks=tally.removed,
                    cleared=tally.cleared,
                    block_sizes=tuple(sorted(tally.block_sizes)),
                    bad_payloads=subscriber.bad_payloads,
                    resets=subscriber.resets,
                    replay=None if hurry else await self._replay(subscriber),
                    # A subscription that ended before it was cancelled stopped reading.
                    error=f"{type(end).__name__}: {end}" if isinstance(end, Exception) else None,
                )
            )
        return seen

    async def _replay(self, subscriber: KVEventSubscriber) -> str | None:
        # The last batch delivered: the newest the engine's replay buffer holds (an older one
        # may have left a bounded buffer already).
        if subscriber.replay_endpoint is None or subscriber.next_seq is None:
            return None
        last = subscriber.next_seq - 1
        got = await subscriber.fetch_replay(last)
        if got is None:
            return f"no answer within {subscriber.replay_timeout_s:g} s"
        for seq, payload in got:
            if seq == last:
                try:
                    decode_batch(payload)
                except ValueError as exc:
                    return f"batch {last} unreadable: {exc}"
                return "ok"
        if not got:
            return f"answered with no batch for sequence {last}"
        return f"answered sequences {got[0][0]}..{got[-1][0]}, not {last}"
