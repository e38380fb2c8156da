"""The injected clock.

Pure logic (scheduler, latency models, role controller) never calls ``time``: it is handed a
``Clock``. The router passes ``MonotonicClock``; tests and the virtual-time simulator pass
``VirtualClock`` and move time themselves, so the same code is deterministic under test.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock", "VirtualClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds}")
        self._t += seconds

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"cannot move a clock backwards from {self._t} to {t}")
        self._t = t
