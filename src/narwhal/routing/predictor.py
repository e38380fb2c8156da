"""Latency predictions for routing: the profiled models, corrected online.

Per engine and phase (prefill, decode) the predictor keeps observed / predicted time (a ratio of
EWMAs, each sample weighed by its predicted time) and multiplies predictions by it, so a model
that drifted (a slower engine, a different load mix) is corrected from live traffic; a ratio
outside the drift band raises the drift flag operators alert on. Observations must compare like
with like: a prefill leg's duration (its wait behind the engine's queue, then its own prefill)
against the predicted queue plus the predicted prefill, both without the correction in force
when the leg was dispatched. The KV handoff (transfer plus first decode step) is learnt per
decode engine from observed first-token latencies. (Prompt lengths of text prompts are estimated
in ``narwhal.routing.prompt_length``.) Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from narwhal.profiles.models import Prediction
from narwhal.profiles.store import EngineModels

__all__ = ["Ewma", "LatencyPredictor", "RatioEwma"]

PHASES = ("prefill", "decode")


@dataclass
class Ewma:
    alpha: float
    value: float
    samples: int = 0

    def update(self, x: float) -> float:
        self.value = x if self.samples == 0 else self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1
        return self.value


@dataclass
class RatioEwma:
    """observed / predicted time as the ratio of two EWMAs (observed seconds, predicted
    seconds), not the EWMA of per-sample ratios: each sample weighs as much as the time it
    predicts. A latency measured on a real engine errs by up to a step (a leg that arrives
    mid-step waits for it), a large part of a short leg and a small part of a long one; the
    EWMA of ratios let one short leg swing the correction by most of its bounds."""

    alpha: float
    observed: float = 1.0
    predicted: float = 1.0
    samples: int = 0
    # EWMAs of predicted^2 and predicted x observed: with the two above, the moments of a
    # least-squares line observed = offset + scale x predicted (see ``line``).
    predicted_sq: float = 1.0
    product: float = 1.0
    # The line, refitted on every update: (offset seconds, scale); (0, value) until it fits.
    line: tuple[float, float] = (0.0, 1.0)

    @property
    def value(self) -> float:
        return self.observed / self.predicted

    def update(self, observed: float, predicted: float) -> float:
        if self.samples == 0:
            self.observed, self.predicted = observed, predicted
            self.predicted_sq, self.product = predicted * predicted, predicted * observed
        else:
            a, b = self.alpha, 1 - self.alpha
            self.observed = a * observed + b * self.observed
            self.predicted = a * predicted + b * self.predicted
            self.predicted_sq = a * predicted * predicted + b * self.predicted_sq
            self.product = a * predicted * observed + b * self.product
        self.samples += 1
        self.line = self._fit()
        return self.value

    def _fit(self) -> tuple[float, float]:
        """observed = offset + scale x predicted, by least squares over the EWMA moments, when
        the predictions spread enough to tell a slope from an offset (an offset of at least 0
        and a scale within a quarter and four times the ratio); else the ratio alone.

        A queue of prefill legs errs both ways at once: a leg on a busy engine waits for the
        step in progress and ends with the step its last chunk shares with the prompts behind
        it (a fixed part, large against a short leg), while a long queue packs prompts into
        full steps that share one step overhead (a fraction, below 1). One ratio learnt from
        both read short queues as long and long ones as short."""
        mean_x, mean_y = self.predicted, self.observed
        ratio = mean_y / mean_x
        variance = self.predicted_sq - mean_x * mean_x
        if self.samples < 5 or variance <= (0.25 * mean_x) ** 2:
            return 0.0, ratio
        scale = (self.product - mean_x * mean_y) / variance
        offset = mean_y - scale * mean_x
        if offset < 0 or not 0.25 * ratio <= scale <= 4 * ratio:
            return 0.0, ratio
        return offset, scale


@dataclass
class LatencyPredictor:
    models: dict[str, EngineModels]
    alpha: float = 0.2
    drift_band: tuple[float, float] = (0.67, 1.5)
    ratio_bounds: tuple[float, float] = (0.25, 8.0)
    default_transfer_s: float = 0.02
    ratios: dict[tuple[str, str], RatioEwma] = field(default_factory=dict)
    transfer: dict[str, Ewma] = field(default_factory=dict)

    def has(self, engine: str) -> bool:
        return engine in self.models

    def ratio(self, engine: str, phase: str) -> float:
        ewma = self.ratios.get((engine, phase))
        return ewma.value if ewma is not None else 1.0

    def line(self, engine: str, phase: str) -> tuple[float, float]:
        """(offset seconds, scale): the learnt line from a prediction to what is observed
        (``RatioEwma.line``); (0, 1) with no samples."""
        ewma = self.ratios.get((engine, phase))
        return ewma.line if ewma is not None else (0.0, 1.0)

    def drifted(self, engine: str, phase: str) -> bool:
        lo, hi = self.drift_band
        ewma = self.ratios.get((engine, phase))
        return ewma is not None and ewma.samples >= 3 and not lo <= ewma.value <= hi

    def prefill(self, engine: str, tokens: int) -> Prediction:
        raw = self.models[engine].prefill.predict(tokens)
        return Prediction(
            raw.seconds * self.ratio(engine, "prefill"), raw.extrapolated, raw.clamped
        )

    def decode(self, engine: str, batch: float, context: float) -> Prediction:
        raw = self.models[engine].decode.predict(batch, context)
        return Prediction(raw.seconds * self.ratio(engine, "decode"), raw.extrapolated, raw.clamped)

    def decode_floor(self, engine: str, context: float) -> float:
        """Seconds per token that no batch size saves: the decode model at batch 0 (its
        intercept and context term), corrected like every prediction."""
        model = self.models[engine].decode
        return model.seconds_per_token(0, context) * self.ratio(engine, "decode")

    def transfer_s(self, engine: str) -> float:
        ewma = self.transfer.get(engine)
        return ewma.value if ewma is not None else self.default_transfer_s

    def uncorrected(self, engine: str, phase: str, predicted_s: float) -> float:
        """A prediction made now with the correction in force now taken out: the raw model."""
        return predicted_s / self.ratio(engine, phase)

    def observe(
        self,
        engine: str,
        phase: str,
        predicted_s: float,
        observed_s: float,
        *,
        uncorrected: bool = False,
    ) -> float:
        """Fold one observation into the engine's correction; returns the new ratio.

        ``predicted_s`` carries the correction in force now, or none when ``uncorrected``
        (taken out when the prediction was made, see :meth:`uncorrected`). A prediction made
        long before it is observed, a prefill leg's, must come uncorrected: under load the
        ratio moves between its dispatch and its end, and dividing by the newer ratio would
        read that move as the engine's speed (a feedback loop that swung the ratio between
        its bounds).
        """
        if predicted_s <= 0 or observed_s <= 0 or engine not in self.models:
            return self.ratio(engine, phase)
        raw = predicted_s if uncorrected else predicted_s / self.ratio(engine, phase)
        lo, hi = self.ratio_bounds
        observed = min(max(observed_s, lo * raw), hi * raw)  # an absurd sample, bounded
        ewma = self.ratios.setdefault((engine, phase), RatioEwma(self.alpha))
        return ewma.update(observed, raw)  # within the bounds: every sample is

    def observe_handoff(
        self, decode_engine: str, first_token_s: float, first_step_s: float
    ) -> None:
        """A decode leg's first token came ``first_token_s`` after it started; what is left
        after the predicted first step is the KV transfer (and its setup)."""
        transfer = max(0.0, first_token_s - first_step_s)
        self.transfer.setdefault(decode_engine, Ewma(self.alpha, transfer)).update(transfer)
