"""The injected clock: ``VirtualClock.sleep`` wakes sleepers only as the clock is moved.

No real time passes here: every sleeper is on a ``VirtualClock``, and the tests step the event
loop with ``asyncio.sleep(0)`` (tasks run in the order they were made ready).
"""

from __future__ import annotations

import asyncio

import pytest

from narwhal.clock import Clock, MonotonicClock, VirtualClock


async def _sleepers(
    clock: VirtualClock, delays: dict[str, float]
) -> tuple[list[asyncio.Task[None]], list[str]]:
    woke: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(name)

    tasks = [asyncio.create_task(sleeper(name, s)) for name, s in delays.items()]
    await asyncio.sleep(0)  # every task runs up to its sleep
    return tasks, woke


async def test_sleepers_wake_in_deadline_order_only_once_the_clock_reaches_them() -> None:
    clock = VirtualClock(100.0)
    # Made in this order; equal deadlines wake in the order they went to sleep.
    tasks, woke = await _sleepers(clock, {"c": 3.0, "a": 1.0, "b1": 2.0, "b2": 2.0, "d": 9.0})
    assert clock.next_deadline() == 101.0

    clock.advance(0.5)
    await asyncio.sleep(0)
    assert woke == []

    clock.advance(2.5)  # past a, b1, b2 and exactly to c: all four wake, earliest first
    assert woke == []  # woken, not yet run: they run when we yield to the loop
    await asyncio.sleep(0)
    assert woke == ["a", "b1", "b2", "c"]
    assert clock.next_deadline() == 109.0

    clock.set(108.999)
    await asyncio.sleep(0)
    assert woke == ["a", "b1", "b2", "c"]
    clock.set(109.0)
    await asyncio.sleep(0)
    assert woke == ["a", "b1", "b2", "c", "d"]
    assert clock.next_deadline() is None
    await asyncio.gather(*tasks)


async def test_a_woken_sleeper_sees_the_time_the_clock_was_moved_to() -> None:
    clock = VirtualClock()
    seen: list[float] = []

    async def sleeper() -> None:
        await clock.sleep(1.0)
        seen.append(clock.now())

    task = asyncio.create_task(sleeper())
    await asyncio.sleep(0)
    clock.advance(5.0)
    await task
    assert seen == [5.0]


@pytest.mark.parametrize("seconds", [0.0, -1.0], ids=["zero", "negative"])
async def test_a_sleep_that_is_already_due_yields_once_without_moving_the_clock(
    seconds: float,
) -> None:
    clock = VirtualClock(7.0)
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    task = asyncio.create_task(other())
    await clock.sleep(seconds)  # lets the ready task run, as asyncio.sleep(0) does
    order.append("after sleep")
    assert order == ["other", "after sleep"]
    assert clock.now() == 7.0 and clock.next_deadline() is None
    await task


async def test_a_cancelled_sleeper_is_dropped_and_never_woken() -> None:
    clock = VirtualClock()
    tasks, woke = await _sleepers(clock, {"early": 1.0, "late": 2.0})
    tasks[0].cancel()
    await asyncio.sleep(0)
    assert tasks[0].cancelled()
    assert clock.next_deadline() == 2.0  # the cancelled sleeper no longer counts

    clock.advance(2.0)
    await asyncio.sleep(0)
    assert woke == ["late"]
    await tasks[1]


def test_one_clock_serves_successive_event_loops() -> None:
    clock = VirtualClock()

    async def main() -> list[str]:
        tasks, woke = await _sleepers(clock, {"x": 1.0})
        clock.advance(1.0)
        await asyncio.gather(*tasks)
        return woke

    assert asyncio.run(main()) == ["x"]
    assert asyncio.run(main()) == ["x"]
    assert clock.now() == 2.0


@pytest.mark.parametrize("move", ["advance", "set"])
def test_the_clock_never_moves_backwards(move: str) -> None:
    clock = VirtualClock(10.0)
    with pytest.raises(ValueError, match="backwards"):
        if move == "advance":
            clock.advance(-0.1)
        else:
            clock.set(9.9)
    assert clock.now() == 10.0


async def test_both_clocks_are_clocks() -> None:
    clocks: list[Clock] = [MonotonicClock(), VirtualClock()]
    for clock in clocks:
        before = clock.now()
        await clock.sleep(0)  # yields once; the monotonic clock does not go back
        assert clock.now() >= before


async def test_advance_to_moves_only_forward_and_wakes_sleepers() -> None:
    clock = VirtualClock(10.0)
    clock.advance_to(9.0)  # an event scheduled in the past: the clock stays
    assert clock.now() == 10.0
    tasks, woke = await _sleepers(clock, {"soon": 1.0, "later": 3.0})
    clock.advance_to(11.5)
    await asyncio.sleep(0)
    assert clock.now() == 11.5 and woke == ["soon"]
    clock.advance_to(13.0)
    await asyncio.gather(*tasks)
    assert woke == ["soon", "later"]
