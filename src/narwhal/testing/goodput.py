"""Goodput and its uncertainty, one definition for the live and the virtual benchmarks.

Goodput is the highest offered rate at which at least ``target`` of the requests meet both
budgets. Every request's verdict is kept at every rate measured, cut into blocks of
consecutive arrivals (``RatePoint``); a point's attainment is met over offered. Goodput is
where attainment, read upwards over the rates measured, first falls below the target,
interpolated linearly between that rate and the one before (``crossing``, ``crossing_of``).

Its uncertainty is a block bootstrap: a resample draws blocks with replacement (the same draw
at every rate, so a resample is one alternative workload measured at every rate), and its
goodput is the crossing of its attainment. Blocks of consecutive arrivals keep the queues a
burst builds inside a block; what is left between blocks is why the blocks should not be
small. A ratio between two systems is paired: both on the same resample.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from narwhal.contract.flags import NumberT, out_of_range

__all__ = [
    "PairedRatio",
    "RatePoint",
    "add_patience_argument",
    "bootstrap_draws",
    "bound_error",
    "clients_line",
    "crossing",
    "crossing_of",
    "interval",
    "number_list",
    "paired_ratio",
    "patience_of",
    "precision_error",
    "quick_defaults",
    "search_crossing",
    "to_blocks",
    "verdict",
]


@dataclass(frozen=True)
class RatePoint:
    """Every request at one offered rate: met requests and requests per block."""

    rate: float
    met: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def attainment(self) -> float:
        return sum(self.met) / sum(self.sizes)


def to_blocks(met: Sequence[bool], size: int) -> tuple[list[int], list[int]]:
    """Per-request verdicts in arrival order as (met per block, requests per block)."""
    counts, sizes = [], []
    for i in range(0, len(met), size):
        part = met[i : i + size]
        counts.append(sum(part))
        sizes.append(len(part))
    return counts, sizes


def crossing_of(points: Iterable[tuple[float, float]], target: float) -> tuple[float, str]:
    """Goodput from (rate, attainment) points: where attainment, read upwards over the rates,
    first falls below ``target``, interpolated linearly between that rate and the one before;
    and how it was found: ``bracketed``, or ``above`` (every rate passed: at least the
    highest, returned) or ``below`` (every rate missed: at most the lowest, returned)."""
    ordered = sorted(points)
    if not ordered:
        raise ValueError("no points")
    if ordered[0][1] < target:
        return ordered[0][0], "below"
    for (r0, a0), (r1, a1) in itertools.pairwise(ordered):
        if a1 < target:
            return r0 + (a0 - target) / (a0 - a1) * (r1 - r0), "bracketed"
    return ordered[-1][0], "above"


def crossing(
    points: Sequence[RatePoint], target: float, weights: Sequence[int] | None = None
) -> float:
    """``crossing_of`` the points' attainments; with ``weights``, each block counted that
    many times (a bootstrap resample)."""

    def attainment(point: RatePoint) -> float:
        if weights is None:
            return point.attainment
        met = sum(w * m for w, m in zip(weights, point.met, strict=True))
        offered = sum(w * n for w, n in zip(weights, point.sizes, strict=True))
        return met / offered if offered else 0.0

    return crossing_of(((p.rate, attainment(p)) for p in points), target)[0]


P = TypeVar("P", bound=RatePoint)


def search_crossing(
    measure: Callable[[float], P], start: float, precision: float, target: float
) -> tuple[float, list[P]]:
    """Goodput by search: from ``start``, doubling or halving until ``target`` attainment is
    bracketed, bisection (geometric) to ``precision`` (relative), then ``crossing``; then four
    more rates around it (0.8, 0.9, 1.1, 1.25 times) as support for bootstrap resamples, whose
    goodput lies near it, and the goodput read again over every rate, as each resample reads
    it. Returns (goodput, every point measured, by rate); ``measure`` runs once per rate."""
    points: dict[float, P] = {}

    def at(rate: float) -> P:
        if rate not in points:
            points[rate] = measure(rate)
        return points[rate]

    first = at(start)
    low: P | None = None
    high: P | None = None
    if first.attainment >= target:
        low = first
        while high is None and low.rate < start * 1e3:
            point = at(low.rate * 2)
            if point.attainment >= target:
                low = point
            else:
                high = point
    else:
        high = first
        # Not below a hundredth of the start: a workload that misses the target at every rate
        # (a burst no rate absorbs) would otherwise run ever longer at ever lower rates.
        while low is None and high.rate > start * 1e-2:
            point = at(high.rate / 2)
            if point.attainment >= target:
                low = point
            else:
                high = point
    if low is not None and high is not None:
        while high.rate / low.rate > 1 + precision:
            point = at(math.sqrt(low.rate * high.rate))
            if point.attainment >= target:
                low = point
            else:
                high = point
    ordered = sorted(points.values(), key=lambda p: p.rate)
    found = crossing(ordered, target)
    if found > 0:
        for factor in (0.8, 0.9, 1.1, 1.25):
            at(found * factor)
        ordered = sorted(points.values(), key=lambda p: p.rate)
        # Read again over every rate, as each resample is: with a bracket wider than the
        # support's 10%, a support rate inside it moves the crossing, and a goodput read
        # before it could fall outside its own interval.
        found = crossing(ordered, target)
    return found, ordered


def bootstrap_draws(blocks: int, resamples: int, rng: random.Random) -> list[list[int]]:
    """``resamples`` draws of ``blocks`` blocks with replacement, as counts per block."""
    draws = []
    for _ in range(resamples):
        weights = [0] * blocks
        for _ in range(blocks):
            weights[rng.randrange(blocks)] += 1
        draws.append(weights)
    return draws


def interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` of ``values`` (percentiles at the nearest ranks)."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - level) / 2
    return ordered[int(tail * (n - 1))], ordered[math.ceil((1 - tail) * (n - 1))]


def verdict(low: float, high: float) -> str:
    """A ratio's interval read against 1: a gain or a loss only when it excludes 1."""
    if low > 1:
        return "gain"
    if high < 1:
        return "loss"
    return "within the uncertainty"


@dataclass(frozen=True)
class PairedRatio:
    """One system's goodput over the best of others: the point ratio (over the others' best
    point estimate, ``best``) and its paired interval (on each resample, over the best of the
    others on that resample)."""

    ratio: float
    low: float
    high: float
    best: str
    best_goodput: float

    @property
    def verdict(self) -> str:
        return verdict(self.low, self.high)


def paired_ratio(
    goodputs: Mapping[str, float],
    resampled: Mapping[str, Sequence[float]],
    name: str,
    others: Iterable[str],
) -> PairedRatio | None:
    """``name``'s goodput over the best of ``others`` (those measured), paired on the same
    bootstrap resamples (``resampled``: each system's goodput per resample, in the same draw
    order); None when ``name`` or every other is unmeasured."""
    measured = [o for o in others if o in goodputs and o in resampled and o != name]
    if name not in goodputs or name not in resampled or not measured:
        return None
    best = max(measured, key=lambda s: goodputs[s])
    top = goodputs[best]
    ratio = goodputs[name] / top if top else math.inf
    paired = [
        mine / peak if (peak := max(resampled[s][i] for s in measured)) else math.inf
        for i, mine in enumerate(resampled[name])
    ]
    low, high = interval(paired)
    return PairedRatio(ratio, low, high, best, top)


# --- the benchmarks' command lines --------------------------------------------------------------


def bound_error(args: Any, bounds: Iterable[tuple[str, float, bool]]) -> str | None:
    """The first of ``args``' numbers out of its bound, worded as a usage error naming its
    flag, or None. Each bound is (attribute, lowest allowed, whether that lowest itself is)."""
    for name, low, inclusive in bounds:
        reason = out_of_range(getattr(args, name), low, low_allowed=inclusive)
        if reason is not None:
            return f"--{name.replace('_', '-')}: {reason}"
    return None


def precision_error(precision: float) -> str | None:
    """``--precision``'s upper bound, worded as a usage error, or None: a search bisects until
    its bracket's high over low is at most 1 + it, so 1 or more leaves a bracket of a factor of
    two or wider."""
    if precision >= 1:
        return f"--precision: a relative width below 1, got {precision:g}"
    return None


def number_list(
    text: str,
    flag: str,
    kind: type[NumberT],
    low: float,
    high: float | None = None,
    low_allowed: bool = True,
) -> list[NumberT]:
    """Comma-separated numbers of ``kind``, each at least ``low`` (above it, without
    ``low_allowed``) and below ``high``; else ``ValueError`` worded as a usage error naming
    ``flag``."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: expected at least one number, got {text!r}")
    for v in values:
        reason = out_of_range(v, low, high, low_allowed=low_allowed, high_allowed=False)
        if reason is not None:
            raise ValueError(f"{flag}: each {reason}")
    return values


def quick_defaults(
    args: argparse.Namespace, argv: Sequence[str], defaults: Mapping[str, Any]
) -> None:
    """``--quick``'s settings (attribute -> value) for the options the command line left out:
    one it names, as ``--flag value`` or ``--flag=value``, keeps what it says."""
    for name, value in defaults.items():
        flag = "--" + name.replace("_", "-")
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            setattr(args, name, value)


def add_patience_argument(parser: argparse.ArgumentParser, default: float) -> None:
    """``--abandon-after-s``: the virtual clients' patience for a first token (0: they wait)."""
    parser.add_argument(
        "--abandon-after-s",
        type=float,
        default=default,
        help="clients give up on a first token after this long, as the live benchmark's do"
        " (0: they wait; default %(default)g)",
    )


def patience_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> float | None:
    """``--abandon-after-s`` as ``DesConfig.abandon_after_s`` takes it (None: clients wait);
    a negative one is a usage error."""
    if not args.abandon_after_s >= 0:
        parser.error(
            f"--abandon-after-s: must be 0 (clients wait) or more, got {args.abandon_after_s:g}"
        )
    return float(args.abandon_after_s) or None


def clients_line(patience: float | None) -> str:
    """The benchmark header's word on the clients' patience."""
    if patience:
        return f"give up on a request with no first token after {patience:g} s (counted TTFT late)"
    return "wait for every answer"
