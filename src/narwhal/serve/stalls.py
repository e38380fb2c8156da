"""One timer for every decode stream's stall deadline (``serve.migration``).

A stream that can be migrated counts as stalled when no token arrived for its stall period
(``PDRouter.stall_s``). Every stream arming, re-arming and cancelling its own timer put a timer
handle per stream (and per period) on the event loop's heap, on the healthy path of every
request. Instead the router keeps one sweeper: a stream registers once, keeps its own
timestamps as it goes (one attribute write per read), and a single timer, armed only while a
stream is registered, asks each registered stream every ``period_s`` whether its quiet time has
passed its deadline. A stall is noticed between its deadline and one period after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

__all__ = ["StallDeadline", "StallSweeper", "Stallable"]

log = logging.getLogger(__name__)


class Stallable(Protocol):
    """A stream under a stall deadline: it decides, given the time, whether it has stalled
    (and acts on it)."""

    def sweep(self, now: float) -> None: ...


class StallSweeper:
    """The router's one stall timer (module docstring). ``period_s``: how often the registered
    streams are asked; a fraction of the smallest stall period the fleet allows."""

    __slots__ = ("_loop", "_period_s", "_timer", "_watched")

    def __init__(self, period_s: float) -> None:
        if period_s <= 0:
            raise ValueError(f"the stall sweep period must be positive, not {period_s}")
        self._period_s = period_s
        self._watched: dict[Stallable, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, stream: Stallable) -> None:
        """Ask ``stream`` every period from now on, until :meth:`unwatch`."""
        self._watched[stream] = None
        loop = asyncio.get_running_loop()
        if self._timer is None or self._loop is not loop:
            self._loop = loop
            self._timer = loop.call_later(self._period_s, self._sweep)

    def unwatch(self, stream: Stallable) -> None:
        """Stop asking ``stream`` (a no-op when it is not registered). The timer runs out on
        its own once nothing is registered."""
        self._watched.pop(stream, None)

    def _sweep(self) -> None:
        self._timer = None
        if not self._watched:
            return
        now = time.monotonic()
        for stream in list(self._watched):
            try:
                stream.sweep(now)
            except Exception:  # one stream's bug must not leave the others without a deadline
                log.exception("stall check failed")
        if self._watched and self._loop is not None and not self._loop.is_closed():
            self._timer = self._loop.call_later(self._period_s, self._sweep)


class StallDeadline(Protocol):
    """A stream's stall period and the sweeper that watches it. The period is asked for only
    once the stream has been quiet for a sweep (most streams end first): it comes from the
    stream's latency model (``serve.migration.Migrator``)."""

    @property
    def stall_s(self) -> float: ...

    @property
    def sweeper(self) -> StallSweeper: ...
