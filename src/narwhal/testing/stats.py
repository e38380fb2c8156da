"""Order statistics of measured samples, one definition per meaning, so that every benchmark,
test and tool reporting a "p99" means the same thing by it.

- ``percentile``: linear interpolation between the two nearest ranks (numpy's default method,
  which ``vllm bench serve`` also uses); the benchmarks' latency and lag percentiles and the
  load-trial summary.
- ``rank_percentile``: the sample at rank ``floor(q / 100 * n)`` (clamped to the last), an
  actual observation, never an interpolation; the soak's lag percentiles.
- ``median``: the middle sample, or the mean of the two middle ones.

Empty samples have no percentile (``nan``) and no median (``None``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

__all__ = ["median", "percentile", "rank_percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100), linearly interpolated; ``nan`` for no values."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q))


def rank_percentile(values: Sequence[float], q: float) -> float:
    """The sample at rank ``floor(q / 100 * n)`` of the sorted values; ``nan`` for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def median(values: Sequence[float]) -> float | None:
    """The median; None for no values."""
    return statistics.median(values) if values else None
