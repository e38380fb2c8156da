"""Per-engine circuit breaker: closed -> open after consecutive failures, half-open after a
cool-off (one probe at a time), closed again on a success. Pure; the clock is injected.

Two kinds of evidence feed it: request legs and ``/health`` probes. A passing probe is evidence
of recovery only if probes failed too while the breaker was not closed (the engine was down and
is back): an engine that answers ``/health`` while failing requests would otherwise have its
breaker closed by every probe after each cool-off, and cost ``failure_threshold`` failed legs
each time instead of the one half-open request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from narwhal.clock import Clock

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass
class CircuitBreaker:
    clock: Clock
    failure_threshold: int = 3
    open_seconds: float = 5.0
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    opened_at: float = field(default=0.0)
    probe_in_flight: bool = False
    # Did /health probes fail too (since they last passed with the breaker closed)?
    health_failed: bool = False
    successes: int = 0  # recorded so far: whether any came since a given moment
    # Times it has gone half-open: which cool-off a probe was taken in (a probe of an earlier
    # one, given back late, must not free this one's).
    half_opened: int = 0

    def allows_request(self) -> bool:
        """May a request go to this engine now? (Moves open -> half-open when the time comes.)"""
        if (
            self.state is BreakerState.OPEN
            and self.clock.now() - self.opened_at >= self.open_seconds
        ):
            self.state = BreakerState.HALF_OPEN
            self.probe_in_flight = False
            self.half_opened += 1
        if self.state is BreakerState.CLOSED:
            return True
        return self.state is BreakerState.HALF_OPEN and not self.probe_in_flight

    def on_dispatch(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = True

    def on_abandon(self) -> None:
        """A leg dispatched here ended with no verdict (its client left): if it was the
        half-open probe, the next request may probe instead, or the breaker would stay
        half-open with no probe for good."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = False

    def record_success(self) -> None:
        self.successes += 1
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.probe_in_flight = False
        self.health_failed = False

    def record_health(self, passed: bool) -> None:
        """A ``/health`` probe's verdict."""
        if not passed:
            self.health_failed = True
            self.record_failure()
            return
        ready = self.allows_request()  # also shows open -> half-open once the cool-off is over
        if self.state is BreakerState.CLOSED:
            self.health_failed = False  # a passing probe clears a blip while nothing was wrong
        elif self.health_failed and ready and self.state is BreakerState.HALF_OPEN:
            self.record_success()

    def trip(self) -> None:
        """The next failure opens the breaker, whatever the count: the request that closed it
        as the half-open probe failed after all."""
        self.consecutive_failures = max(self.consecutive_failures, self.failure_threshold - 1)

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if (
            self.state is BreakerState.HALF_OPEN
            or self.consecutive_failures >= self.failure_threshold
        ):
            self.state = BreakerState.OPEN
            self.opened_at = self.clock.now()
            self.probe_in_flight = False
