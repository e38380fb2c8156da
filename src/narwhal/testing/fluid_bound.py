"""The fluid bound on goodput: what no router can beat on a given workload and fleet.

A fluid fleet has no queues and no bursts: each prefill engine prefills one request after
another without a gap, each decode engine holds as many sequences as the TPOT budget allows,
always. A request costs its prefill engine the calibration's time for its uncached tokens
(``prefill_seconds``) and its decode engine a slot for its output's length at the budget's
pace (about ``output x tpot / batch`` engine-seconds; "Decode" below).

A window of ``n`` requests offered at ``r`` requests/s arrives over ``n / r`` seconds (its
recorded pattern compressed or stretched, as the benchmarks replay it), and its last requests
are served after its last arrival: the engines work from the first arrival to the last, all
of them, and after it on what is still due, each request within its budgets (a prefill within
its TTFT budget of its arrival, at one engine's pace; a sequence's tokens by its arrival plus
the TTFT budget plus its output at the TPOT budget's pace, a token a step at most) and never
more at a time than the pool's engines. Benchmarks measure windows of a few hundred requests
per engine, so that drain is a tenth of the time and more at 512 engines: the bound counts
it. A rate is within the bound when the work kept fits what the pools can do at that rate;
the bound is the highest such rate (bisection: the time shrinks as the rate grows; ``inf``
for a burst the fleet absorbs at any rate).

Goodput counts requests met at an attainment target (95%): a router may miss the rest, and
one that chose which would miss the costliest. So the bound keeps the ``met_share`` of
requests that cost the fleet least: with ``P`` prefill and ``D`` decode engines, the least
``max(prefill work / P's capacity, decode work / D's)`` over the requests kept, a min-max
found exactly as the maximum over ``l`` in [0, 1] of the least sum of ``l x prefill / P's +
(1 - l) x decode / D's`` (concave in ``l``: a ternary search). The best split of whole
engines is searched over the splits; the best fractional split (what ideal role flipping
could reach) by golden section over ``P``. Requests are taken as divisible, the work after a
window's last arrival as limited by all its requests' budgets (not only those kept) and each
window's deadlines as one pool's time (relaxations: each can only raise the bound). With
``met_share`` 1 it is the bound of a router that meets every request.

Decode. A request's TPOT is its mean step after its first token, so it may ride batches above
the budget's for a while and below it after: the bound charges each such token ``tpot / B*``,
``B*`` the batch whose step takes exactly the budget (not rounded down), at the shortest
prompt's context (no batch's mean context is below it). A step's cost per token is convex and
falling in the batch, so a mean step within the budget costs each token at least that
(Jensen). A first token is bounded by the TTFT budget only: charged the least a token can cost
(the step's slope).

Searched, not proven: fitting a rate is not monotone everywhere (a window's drain grows with
the rate), so after bisecting, rates up to 10% above are probed at 1% steps and bisected on
from one that fits; a fitting island narrower than that, or further above, would be missed
(none was seen on the benchmarks' windows). The best split of whole engines beyond 64 engines,
and the best fractional split, assume the rate rises and then falls with the prefill share.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from narwhal.profiles.models import DecodeLatencyModel, PrefillLatencyModel

__all__ = ["FluidFleet", "Window", "decode_batch", "prefill_seconds"]

_SEARCH_STEPS = 40  # ternary steps on l: (2/3)^40 of the interval, far below any printed digit
_RATE_PRECISION = 1e-5  # relative width at which the rate's bisection stops
_PROBES, _PROBE_STEP = 10, 0.01  # rates probed above a bisection's: up to 10% above
_RATE_LIMIT = 1e9  # requests/s: a workload that fits above it fits at any rate (inf)


def prefill_seconds(model: PrefillLatencyModel, prompt: int, cached: int = 0) -> float:
    """The least time an engine spends prefilling ``prompt`` tokens after ``cached`` of them
    (the last token is always computed): each token's own cost, chunk by chunk, and the step's
    fixed cost as a share of a full step (an engine charges it once per step, shared by every
    prompt it packs into one; a bound takes every step full)."""
    offset, total = min(cached, prompt - 1), 0.0
    while offset < prompt:
        n = min(model.max_tokens, prompt - offset)
        total += model.chunk_seconds(offset, n) - model.a * (1 - n / model.max_tokens)
        offset += n
    return total


def decode_batch(model: DecodeLatencyModel, context: float, tpot_s: float) -> float:
    """The batch whose step, at ``context`` tokens of mean context, takes exactly ``tpot_s``
    (not rounded down: batches above and below it in turn average to it)."""
    return (tpot_s - model.seconds_per_token(0, context)) / model.slope


@dataclass(frozen=True)
class Window:
    """One window's requests as a benchmark offers them: ``(arrival, prompt, cached,
    output)``, arrivals in the window's own seconds (compressed or stretched to the offered
    rate as a whole, first arrival at 0)."""

    requests: Sequence[tuple[float, int, int, int]]


@dataclass(frozen=True)
class _Arrivals:
    """What the drain after each window's last arrival depends on."""

    unit: np.ndarray  # each request's arrival at an offered rate of 1 request/s (r: unit / r)
    windows: tuple[np.ndarray, ...]  # each window's requests (indices)
    outputs: np.ndarray
    ttft_s: float
    tpot_s: float
    step_s: float  # the shortest decode step: at most one token of a sequence per step
    token_s: float  # decode engine-seconds a token costs at the budget's batch


def _drain_capacity(ends: np.ndarray, engines: float, pace: float) -> float:
    """Work a pool of ``engines`` can do after a window's last arrival when request ``i`` may
    still run for ``ends[i]`` seconds at ``pace`` engine-seconds a second at most: at each
    moment, the lesser of the pool and the requests still running."""
    ends = np.sort(ends[ends > 0])[::-1]
    if not len(ends):
        return 0.0
    spans = ends - np.append(ends[1:], 0.0)  # while exactly k = 1, 2, ... still run
    running = np.minimum(engines, pace * np.arange(1, len(ends) + 1))
    return float((spans * running).sum())


class FluidFleet:
    """Per-request costs in engine-seconds, the time each offered rate gives the pools, and
    the share of requests to be met. Built from windows by ``of``; built from costs alone, a
    steady state (``n / r`` seconds for both pools, no drain)."""

    def __init__(
        self,
        prefill_s: Sequence[float] | np.ndarray,
        decode_s: Sequence[float] | np.ndarray,
        met_share: float = 1.0,
        arrivals: _Arrivals | None = None,
    ) -> None:
        if len(prefill_s) != len(decode_s) or not len(prefill_s):
            raise ValueError("prefill_s and decode_s: one cost each per request, at least one")
        if not 0 < met_share <= 1:
            raise ValueError(f"met_share: a share above 0 and at most 1, got {met_share}")
        self.prefill_s = np.asarray(prefill_s, dtype=float)
        self.decode_s = np.asarray(decode_s, dtype=float)
        self.met_share = met_share
        self.kept = math.ceil(met_share * len(self.prefill_s) - 1e-9)
        self._arrivals = arrivals
        # Seconds from each window's first arrival to its last, summed, at 1 request/s.
        self._span = float(len(self.prefill_s))
        if arrivals is not None:
            self._span = float(sum(arrivals.unit[w].max() for w in arrivals.windows))

    def with_met_share(self, met_share: float) -> FluidFleet:
        """The same requests and windows, with another share of them to be met."""
        return FluidFleet(self.prefill_s, self.decode_s, met_share, self._arrivals)

    @classmethod
    def of(
        cls,
        windows: Sequence[Window],
        prefill: PrefillLatencyModel,
        decode: DecodeLatencyModel,
        ttft_s: float,
        tpot_s: float,
        met_share: float = 1.0,
    ) -> tuple[FluidFleet, float]:
        """The windows' fleet, and the decode batch it charges."""
        rows = [r for w in windows for r in w.requests]
        if not rows or any(not w.requests for w in windows):
            raise ValueError("windows: at least one, none empty")
        # No batch's mean context is below the shortest prompt: the cheapest step there is.
        context = min(p for _, p, _, _ in rows)
        batch = decode_batch(decode, context, tpot_s)
        if batch < 1:
            raise ValueError(f"no decode batch fits {tpot_s} s at a context of {context}")
        unit: list[float] = []
        members: list[np.ndarray] = []
        for w in windows:
            first, end = w.requests[0][0], w.requests[-1][0]
            if end <= first:
                # Offered at any rate, it arrives at one instant: no rate to bound.
                raise ValueError("windows: each one's arrivals must span some time")
            scale = len(w.requests) / (end - first)
            members.append(np.arange(len(unit), len(unit) + len(w.requests)))
            unit += [(t - first) * scale for t, *_ in w.requests]
        token_s = tpot_s / batch
        arrivals = _Arrivals(
            np.array(unit),
            tuple(members),
            np.array([float(r[3]) for r in rows]),
            ttft_s,
            tpot_s,
            decode.seconds_per_token(1, 0),
            token_s,
        )
        return cls(
            [prefill_seconds(prefill, p, c) for _, p, c, _ in rows],
            # A first token is bounded by the TTFT budget only: its step's least share.
            [(o - 1) * token_s + decode.slope for *_, o in rows],
            met_share,
            arrivals,
        ), batch

    def _budget(
        self, rate: float, prefill_engines: float, decode_engines: float
    ) -> tuple[float, float]:
        """Engine-seconds of work each pool can do at ``rate``, all windows together: from each
        window's first arrival to its last, and after it what its requests still allow: a
        prefill within its TTFT budget of its arrival, one engine's pace at most; a
        sequence's tokens within its budgets, a token a step at most; never more at a time
        than the pool's engines."""
        seconds = self._span / rate
        a = self._arrivals
        if a is None:
            return prefill_engines * seconds, decode_engines * seconds
        prefill_after = decode_after = 0.0
        pace = a.token_s / a.step_s
        for members in a.windows:
            unit = a.unit[members]
            left = (unit - unit.max()) / rate  # arrival less the window's last: at most 0
            prefill_end = left + a.ttft_s
            decode_end = prefill_end + a.outputs[members] * a.tpot_s
            prefill_after += min(
                _drain_capacity(prefill_end, prefill_engines, 1.0),
                float(np.clip(prefill_end, 0.0, self.prefill_s[members]).sum()),
            )
            decode_after += min(
                _drain_capacity(decode_end, decode_engines, pace),
                float(np.clip(decode_end / a.step_s, 0.0, a.outputs[members]).sum()) * a.token_s,
            )
        return (
            prefill_engines * seconds + prefill_after,
            decode_engines * seconds + decode_after,
        )

    def _least_sum(self, costs: np.ndarray) -> float:
        if self.kept == len(costs):
            return float(costs.sum())
        return float(np.partition(costs, self.kept - 1)[: self.kept].sum())

    def _fits(self, rate: float, prefill_engines: float, decode_engines: float) -> bool:
        prefill_budget, decode_budget = self._budget(rate, prefill_engines, decode_engines)
        p = self.prefill_s / prefill_budget
        d = self.decode_s / decode_budget

        def least(share: float) -> float:
            return self._least_sum(share * p + (1 - share) * d)

        lo, hi = 0.0, 1.0
        for _ in range(_SEARCH_STEPS):
            left, right = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            if least(left) < least(right):
                lo = left
            else:
                hi = right
        # The least sum at any l is at most the min-max: the largest found is the tightest.
        return max(least(lo), least(hi), least((lo + hi) / 2)) <= 1.0

    def _highest(self, fits: Callable[[float], bool]) -> float:
        lo, hi = 0.0, 1.0
        while fits(hi):
            lo, hi = hi, hi * 2
            if hi > _RATE_LIMIT:
                # A burst the fleet absorbs at any rate: all of it fits the drain.
                return math.inf
        while True:
            while hi - lo > _RATE_PRECISION * hi:
                mid = (lo + hi) / 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
            # Fitting is not monotone in the rate everywhere (a window's drain grows with it):
            # a rate a little above may fit again. Looked for, and bisected on from there.
            above = next(
                (r for k in range(1, _PROBES + 1) if fits(r := lo * (1 + k * _PROBE_STEP))),
                None,
            )
            if above is None:
                return lo
            lo, hi = above, above * (1 + _PROBE_STEP)
            while fits(hi):
                lo, hi = hi, hi * (1 + _PROBE_STEP)

    def at_split(self, prefill_engines: float, decode_engines: float) -> float:
        """Requests/s with ``prefill_engines`` prefilling and ``decode_engines`` decoding
        (fractions of an engine allowed: a fluid split)."""
        if prefill_engines <= 0 or decode_engines <= 0:
            raise ValueError("a split needs engines of each role")
        return self._highest(lambda r: self._fits(r, prefill_engines, decode_engines))

    def fractional(self, engines: int) -> tuple[float, float]:
        """(requests/s, prefill engines) at the best fractional split of ``engines`` found by
        a golden-section search (the rate rises, then falls, with the prefill share)."""
        lo, hi = 0.0, float(engines)
        ratio = (math.sqrt(5) - 1) / 2
        rates: dict[float, float] = {}

        def rate(p: float) -> float:
            if p not in rates:
                rates[p] = self.at_split(p, engines - p)
            return rates[p]

        while hi - lo > 1e-4 * engines:
            left, right = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
            if rate(left) < rate(right):
                lo = left
            else:
                hi = right
        best = max(rates, key=rates.__getitem__)
        return rates[best], best

    def static(self, engines: int) -> tuple[float, int]:
        """(requests/s, prefill engines) at the best split of whole engines: every split up
        to 64 engines; beyond, outwards from the fractional optimum while the bound rises."""
        if engines <= 64:
            return max((self.at_split(n, engines - n), n) for n in range(1, engines))
        _, frac = self.fractional(engines)
        first = min(engines - 1, max(1, round(frac)))
        best = (self.at_split(first, engines - first), first)
        for step in (-1, 1):
            n, previous = first + step, best[0]
            while 1 <= n <= engines - 1:
                rate = self.at_split(n, engines - n)
                best = max(best, (rate, n))
                if rate < previous:
                    break
                previous, n = rate, n + step
        return best
