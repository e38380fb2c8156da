"""Tokens a request will generate, before it has: what the scheduler foresees a decode batch by.

A client's ``max_tokens`` is a bound, often far above what the model says before it stops (and
often the model's context limit when the client names none). Predicting each decoding
sequence's end from ``max_tokens`` alone keeps short answers in the batch long after they are
gone. The estimate is a high quantile of the lengths of the answers recently completed, never
above the request's own ``max_tokens``: a sequence that runs past it stays counted (the
scheduler counts a sequence past its predicted end as still decoding), so erring short costs a
little TPOT headroom for a few steps, not a wrong count for the rest of its answer. Pure.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field

__all__ = ["OutputLengthEstimator"]


@dataclass
class OutputLengthEstimator:
    """Output tokens from the last ``window`` completed answers' lengths: their ``quantile``
    once there are ``min_samples`` of them, capped by each request's ``max_tokens``."""

    window: int = 512
    quantile: float = 0.9
    min_samples: int = 32
    _recent: deque[int] = field(default_factory=deque)
    _sorted: list[int] = field(default_factory=list)
    _value: int | None = None
    _total: int = 0  # the sum of _recent

    def mean(self, max_tokens: int) -> float:
        """The mean of the recent answers' lengths (``max_tokens`` until there are
        ``min_samples``), capped by ``max_tokens``: a request's expected share of a batch over
        time, where ``expected`` is what its end is foreseen by."""
        n = len(self._recent)
        if n < self.min_samples:
            return max_tokens
        value = self._total / n
        return value if value < max_tokens else max_tokens

    def observe(self, tokens: int) -> None:
        """An answer completed with ``tokens`` output tokens."""
        if tokens <= 0:
            return
        self._recent.append(tokens)
        self._total += tokens
        insort(self._sorted, tokens)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            self._total -= old
            del self._sorted[bisect_left(self._sorted, old)]
        self._value = None

    def expected(self, max_tokens: int) -> int:
        """The tokens a request asking for at most ``max_tokens`` is expected to generate."""
        ordered = self._sorted
        if len(ordered) < self.min_samples:
            return max_tokens
        value = self._value
        if value is None:
            # The nearest rank: the smallest length at least ``quantile`` of them reach.
            rank = max(1, math.ceil(self.quantile * len(ordered)))
            value = self._value = ordered[rank - 1]
        return value if value < max_tokens else max_tokens
