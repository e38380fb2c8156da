"""The injected clock.

Pure logic (scheduler, latency models, role controller) never calls ``time``: it is handed a
``Clock``. The router passes ``MonotonicClock``; tests and the virtual-time simulator pass
``VirtualClock`` and move time themselves, so the same code is deterministic under test.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock", "VirtualClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling task until ``seconds`` (>= 0; less counts as 0) have passed on
        this clock. ``sleep(0)`` yields to the event loop once, as ``asyncio.sleep(0)`` does.
        Cancelling the task cancels the sleep (``asyncio.CancelledError``)."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class VirtualClock:
    """A clock that moves only when told to.

    ``sleep(s)`` suspends the task until the clock reaches ``now() + s``; nothing else moves
    it. ``advance`` and ``set`` move the clock to its new time and then wake every sleeper whose
    deadline has been reached, in deadline order (sleepers with the same deadline in the order
    they went to sleep). Waking is resolving the sleeper's future: the woken tasks run, in that
    order, once the caller next yields to the event loop, and all of them see the clock where
    ``advance``/``set`` left it, not at their own deadlines (advance in steps to see each one).
    ``next_deadline()`` tells a driver when the earliest sleeper is due, and whether anyone is
    sleeping at all. Not thread-safe: use it from the thread of the loop its sleepers run on.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._t = start
        # (deadline, sequence, future): the sequence keeps equal deadlines in call order and
        # keeps the heap from ever comparing two futures.
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._t

    async def sleep(self, seconds: float) -> None:
        deadline = self._t + seconds
        if deadline <= self._t:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (deadline, next(self._seq), future))
        # A cancelled sleeper's entry stays in the heap, done, and is dropped when reached.
        await future

    def next_deadline(self) -> float | None:
        """The earliest deadline of a task sleeping on this clock, or None if none is."""
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds}")
        self._t += seconds
        self._wake_due()

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"cannot move a clock backwards from {self._t} to {t}")
        self._t = t
        self._wake_due()

    def advance_to(self, t: float) -> None:
        """Move to ``t`` if that is later; stay otherwise. One call per event of a
        discrete-event loop, which runs millions of them."""
        if t > self._t:
            self._t = t
            if self._sleepers:
                self._wake_due()

    def _wake_due(self) -> None:
        while self._sleepers and self._sleepers[0][0] <= self._t:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)
