"""The stall deadline of a pulled decode stream (``serve.relay.StallWatch``, asked by the
router's ``serve.stalls.StallSweeper``): a wait for the
engine that lasts the stall period interrupts a stream its trace can continue, and nothing else
does: not a slow client between waits, not a stream that cannot be continued, not a cancellation
from outside (which still cancels). Real time, in tenths of a second."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import orjson
import pytest

from narwhal.contract import Migration
from narwhal.serve.migration import MigrationTrace, new_trace
from narwhal.serve.relay import EventRenderer, StallWatch, StreamTally
from narwhal.serve.stalls import StallSweeper
from narwhal.serve.validation import parse_client_request

STALL_S = 0.15


@dataclass(frozen=True, slots=True)
class FixedStallDeadline:
    """A stall period known up front (``serve.stalls.StallDeadline``; the router's is the
    migrator's, from the predicted TPOT)."""

    stall_s: float
    sweeper: StallSweeper


class _Events:
    """An engine stream whose batches arrive when the test says (None: a wait forever)."""

    def __init__(self, delays: list[float | None]) -> None:
        self.delays = delays
        self.reads = 0

    async def next_batch(self) -> list[bytes]:
        delay = self.delays[self.reads]
        self.reads += 1
        await asyncio.sleep(3600 if delay is None else delay)
        return [b'{"choices": [{"index": 0, "text": "x", "token_ids": [7]}]}']


def _trace(**settings: object) -> MigrationTrace:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 50}
    request = parse_client_request(orjson.dumps(body), False, "m", 1000)
    trace = new_trace(request, Migration(**settings), 1000)  # type: ignore[arg-type]
    assert trace is not None
    chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
    choice = {"index": 0, "prompt_token_ids": [1, 2], "token_ids": [5]}
    trace.observe({**chunk, "choices": [choice]})
    return trace


def _watch(trace: MigrationTrace | None, stall_s: float | None = STALL_S):
    renderer = EventRenderer(StreamTally(), False, None, trace)
    renderer.tally.token_events = 1
    deadline = None if stall_s is None else FixedStallDeadline(stall_s, StallSweeper(STALL_S / 4))
    return renderer, StallWatch(renderer, deadline)


async def _read(watch: StallWatch, events: _Events, client_pause_s: float = 0.0) -> list:
    stream = SimpleNamespace(events=events)
    got: list = []
    try:
        for _ in events.delays:
            batch = await watch.next_batch(stream)  # type: ignore[arg-type]
            got.append(batch)
            if batch is None:
                break
            await asyncio.sleep(client_pause_s)  # the client takes its time between waits
    finally:
        watch.close()
    return got


def test_a_wait_past_the_deadline_interrupts_a_stream_that_can_be_continued() -> None:
    renderer, watch = _watch(_trace())
    events = _Events([0.0, 0.05, None])
    got = asyncio.run(_read(watch, events))
    assert [b is not None for b in got] == [True, True, False]
    assert renderer.interrupted is not None and renderer.interrupted[0] == "stall"


def test_a_slow_client_between_waits_is_not_a_stall() -> None:
    renderer, watch = _watch(_trace())
    # Each wait is short; the pauses between them are twice the stall period.
    got = asyncio.run(_read(watch, _Events([0.02] * 4), client_pause_s=2 * STALL_S))
    assert all(b is not None for b in got) and len(got) == 4
    assert renderer.interrupted is None


@pytest.mark.parametrize("why", ["no trace", "migration off", "answer complete", "no deadline"])
def test_a_stream_that_cannot_be_continued_is_waited_for(why: str) -> None:
    trace: MigrationTrace | None = _trace()
    stall_s: float | None = STALL_S
    if why == "no trace":
        trace = None
    elif why == "migration off":
        trace = _trace()
        trace.settings = Migration(limit=0)
    elif why == "answer complete":
        assert trace is not None
        trace.finished = True
    else:
        stall_s = None
    renderer, watch = _watch(trace, stall_s)
    got = asyncio.run(_read(watch, _Events([3 * STALL_S])))
    assert got[0] is not None and renderer.interrupted is None


def test_a_cancellation_from_outside_still_cancels() -> None:
    _, watch = _watch(_trace())

    async def main() -> None:
        task = asyncio.ensure_future(_read(watch, _Events([None])))
        await asyncio.sleep(STALL_S / 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_one_sweeper_watches_many_streams_and_stops_when_none_is_left() -> None:
    """Two streams on one sweeper: the stalled one is interrupted, the live one is not; once
    both are closed the sweeper holds nothing and its timer has run out."""
    sweeper = StallSweeper(STALL_S / 4)
    stalled = EventRenderer(StreamTally(), False, None, _trace())
    live = EventRenderer(StreamTally(), False, None, _trace())
    for renderer in (stalled, live):
        renderer.tally.token_events = 1
    watches = [StallWatch(r, FixedStallDeadline(STALL_S, sweeper)) for r in (stalled, live)]

    async def main() -> tuple[list, list]:
        got = await asyncio.gather(
            _read(watches[0], _Events([0.0, None])),
            _read(watches[1], _Events([0.05] * 8)),
        )
        assert len(sweeper) == 0
        await asyncio.sleep(STALL_S / 2)  # the timer's last round finds nothing and stops
        assert sweeper._timer is None
        return got[0], got[1]

    first, second = asyncio.run(main())
    assert first == [first[0], None] and stalled.interrupted is not None
    assert all(b is not None for b in second) and live.interrupted is None
