"""The latency model: one engine's prefill and decode times, fitted from profiles.

``PrefillLatencyModel``: seconds to prefill ``n`` prompt tokens, ``a + b*n + c*n^2``; a chunk of
``n`` tokens at offset ``o`` costs ``a + b*n + c*((o+n)^2 - o^2)``, so a prompt's chunks add up to
the whole, and a prompt whose first ``k`` tokens are in the prefix cache costs the chunk after
them (``predict_cached``).
``DecodeLatencyModel``: seconds per output token for a batch of ``batch`` sequences whose mean
context is ``context`` tokens, ``intercept + slope*batch + ctx_coef*context``.
``EngineModels``: one engine's pair of them, the generation they describe and the scaling from
their seconds to wall seconds (a simulated engine runs ``time_scale`` times faster than the
fleet it models, and ``slowdown`` times slower). Everything that predicts and the simulated
engines use this one type: a profile's models are in wall seconds; the simulators' are in the
modelled fleet's seconds (``narwhal.simengine.timing``).

The prefill and decode models are fitted by least squares with every coefficient constrained
non-negative, which keeps prefill time non-decreasing in ``n`` and decode time non-decreasing in
batch and context, as the physics says. Predictions inside the profiled range are plain; outside
it they are flagged ``extrapolated``; far outside it (beyond ``max_extrapolation`` times the
profiled maximum) the curve is clamped to its tangent at that limit, so no higher-order term
fitted on the profiled range is trusted there, and the prediction is flagged ``clamped``. A
model never extrapolates silently, and clamping never hides growth: the tangent keeps rising as
the load does (clamping the input instead would tell admission control that a batch of 100 costs
what a batch of 8 does). The simulated engines use the plain formulas (``chunk_seconds``,
``seconds_per_token``), never ``predict``: what an engine takes does not depend on how far a
profile reached.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "DecodeLatencyModel",
    "EngineModels",
    "FitQuality",
    "Prediction",
    "PrefillLatencyModel",
    "fit_decode",
    "fit_prefill",
    "nonnegative_least_squares",
]

DEFAULT_MAX_EXTRAPOLATION = 2.0


@dataclass(frozen=True)
class Prediction:
    seconds: float
    extrapolated: bool = False  # outside the profiled range
    clamped: bool = False  # so far outside that the input was clamped


@dataclass(frozen=True)
class FitQuality:
    r2: float
    max_rel_residual: float
    samples: int


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, by trying each active set (few columns).

    Exact for the small problems here (three columns, eight subsets), with no solver to
    depend on.
    """
    n_cols = x.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for k in range(n_cols, 0, -1):
        for cols in itertools.combinations(range(n_cols), k):
            sub = x[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(n_cols)
            full[list(cols)] = coef
            err = float(np.sum((x @ full - y) ** 2))
            if best is None or err < best[0] - 1e-18:
                best = (err, full)
    if best is None:
        return np.zeros(n_cols)
    return best[1]


def _quality(predicted: np.ndarray, observed: np.ndarray) -> FitQuality:
    residual = observed - predicted
    total = float(np.sum((observed - observed.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residual**2)) / total if total > 0 else 1.0
    rel = np.abs(residual) / np.maximum(np.abs(observed), 1e-12)
    return FitQuality(
        r2=r2, max_rel_residual=float(rel.max()) if len(rel) else 0.0, samples=len(observed)
    )


@dataclass(frozen=True)
class PrefillLatencyModel:
    a: float
    b: float
    c: float
    min_tokens: int
    max_tokens: int
    quality: FitQuality | None = None
    max_extrapolation: float = DEFAULT_MAX_EXTRAPOLATION

    def seconds(self, n: float) -> float:
        return self.a + self.b * n + self.c * n * n

    def chunk_seconds(self, offset: int, n: int) -> float:
        """Seconds to prefill ``n`` tokens after ``offset`` tokens of the same prompt: ``a +
        b*n + c*((offset+n)^2 - offset^2)``, 0 for no tokens. A simulated engine's cost of one
        chunk, never flagged or clamped; ``chunk_seconds(0, n)`` is ``seconds(n)`` up to
        rounding (the engines' own order of operations, which their results depend on)."""
        if n <= 0:
            return 0.0
        end = offset + n
        return self.a + self.b * n + self.c * (end * end - offset * offset)

    def predict(self, n: int) -> Prediction:
        limit = self.max_tokens * self.max_extrapolation
        if n > limit:
            tangent = self.b + 2 * self.c * limit
            return Prediction(
                self.seconds(limit) + tangent * (n - limit), extrapolated=True, clamped=True
            )
        outside = n > self.max_tokens or n < self.min_tokens
        return Prediction(self.seconds(max(n, 0)), extrapolated=outside)

    def predict_cached(self, n: int, cached: int) -> Prediction:
        """An ``n``-token prompt whose first ``cached`` tokens are in the engine's prefix cache:
        only the rest is computed, attending to the whole prefix (``predict(n)`` less what the
        cached tokens would have cost, plus the per-request overhead ``a``)."""
        if cached <= 0:
            return self.predict(n)
        cached = min(cached, n)
        whole = self.predict(n)
        seconds = whole.seconds - self.predict(cached).seconds + self.a
        return Prediction(max(seconds, self.a), whole.extrapolated, whole.clamped)


@dataclass(frozen=True)
class DecodeLatencyModel:
    intercept: float
    slope: float
    ctx_coef: float
    max_batch: int
    max_context: int
    quality: FitQuality | None = None
    max_extrapolation: float = DEFAULT_MAX_EXTRAPOLATION

    def seconds_per_token(self, batch: float, context: float) -> float:
        return self.intercept + self.slope * batch + self.ctx_coef * context

    def predict(self, batch: float, context: float) -> Prediction:
        # Linear in both inputs, so its tangent is itself: far outside the range the value is
        # the same, only the flags say how little the profile covers it.
        clamped = (
            batch > self.max_batch * self.max_extrapolation
            or context > self.max_context * self.max_extrapolation
        )
        outside = batch > self.max_batch or context > self.max_context
        return Prediction(
            self.seconds_per_token(batch, context), extrapolated=outside, clamped=clamped
        )


@dataclass(frozen=True)
class EngineModels:
    """One engine's latency model. Its seconds are wall seconds times ``time_scale`` /
    ``slowdown`` (both 1 for a profile, which measures wall seconds): ``wall`` converts.

    ``in_wall_seconds()`` folds the scaling into the coefficients: what a perfect profile of the
    engine would find, and what predictions need (the predictor reads the coefficients as wall
    seconds).
    """

    prefill: PrefillLatencyModel
    decode: DecodeLatencyModel
    generation: str | None = None
    time_scale: float = 1.0
    slowdown: float = 1.0

    def wall(self, model_seconds: float) -> float:
        return model_seconds * self.slowdown / self.time_scale

    def in_wall_seconds(self) -> EngineModels:
        s = self.slowdown / self.time_scale
        p, d = self.prefill, self.decode
        return EngineModels(
            prefill=replace(p, a=p.a * s, b=p.b * s, c=p.c * s),
            decode=replace(
                d, intercept=d.intercept * s, slope=d.slope * s, ctx_coef=d.ctx_coef * s
            ),
            generation=self.generation,
        )


def fit_prefill(
    lengths: Sequence[int],
    seconds: Sequence[float],
    max_extrapolation: float = DEFAULT_MAX_EXTRAPOLATION,
) -> PrefillLatencyModel:
    if len(lengths) != len(seconds) or not lengths:
        raise ValueError("prefill fit needs matching, non-empty samples")
    n = np.asarray(lengths, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(set(lengths)) < 2:
        raise ValueError("prefill fit needs at least two distinct prompt lengths")
    # Scale columns so the n^2 term does not drown the others numerically.
    scale = float(n.max())
    x = np.stack([np.ones_like(n), n / scale, (n / scale) ** 2], axis=1)
    coef = nonnegative_least_squares(x, y)
    a, b, c = coef[0], coef[1] / scale, coef[2] / scale**2
    model = PrefillLatencyModel(
        float(a),
        float(b),
        float(c),
        int(n.min()),
        int(n.max()),
        max_extrapolation=max_extrapolation,
    )
    quality = _quality(np.array([model.seconds(v) for v in n]), y)
    return PrefillLatencyModel(
        model.a, model.b, model.c, model.min_tokens, model.max_tokens, quality, max_extrapolation
    )


def fit_decode(
    batches: Sequence[int],
    contexts: Sequence[float],
    seconds: Sequence[float],
    max_extrapolation: float = DEFAULT_MAX_EXTRAPOLATION,
) -> DecodeLatencyModel:
    if not (len(batches) == len(contexts) == len(seconds)) or not batches:
        raise ValueError("decode fit needs matching, non-empty samples")
    b = np.asarray(batches, dtype=float)
    c = np.asarray(contexts, dtype=float)
    y = np.asarray(seconds, dtype=float)
    b_scale, c_scale = max(float(b.max()), 1.0), max(float(c.max()), 1.0)
    x = np.stack([np.ones_like(b), b / b_scale, c / c_scale], axis=1)
    coef = nonnegative_least_squares(x, y)
    model = DecodeLatencyModel(
        float(coef[0]),
        float(coef[1] / b_scale),
        float(coef[2] / c_scale),
        int(b.max()),
        int(c.max()),
        max_extrapolation=max_extrapolation,
    )
    predicted = np.array([model.seconds_per_token(bi, ci) for bi, ci in zip(b, c, strict=True)])
    return DecodeLatencyModel(
        model.intercept,
        model.slope,
        model.ctx_coef,
        model.max_batch,
        model.max_context,
        _quality(predicted, y),
        max_extrapolation,
    )
