"""Latency predictions for routing: the profiled models, corrected online.

Per engine and phase (prefill, decode) the predictor keeps an EWMA of observed / predicted
time and multiplies predictions by it, so a model that drifted (a slower engine, a different
load mix) is corrected from live traffic; a ratio outside the drift band raises the drift flag
operators alert on. The KV handoff (transfer plus first decode step) is learnt per decode
engine from observed first-token latencies. Prompt lengths of text prompts are estimated from
their size in bytes, with the bytes-per-token ratio corrected from what engines report.
Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from narwhal.profiles.models import Prediction
from narwhal.profiles.store import EngineModels

__all__ = ["Ewma", "LatencyPredictor", "PromptLengthEstimator"]

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
class LatencyPredictor:
    models: dict[str, EngineModels]
    alpha: float = 0.2
    drift_band: tuple[float, float] = (0.67, 1.5)
    ratio_bounds: tuple[float, float] = (0.25, 8.0)
    default_transfer_s: float = 0.02
    ratios: dict[tuple[str, str], Ewma] = field(default_factory=dict)
    transfer: dict[str, Ewma] = field(default_factory=dict)

    def has(self, engine: str) -> bool:
        return engine in self.models

    def ratio(self, engine: str, phase: str) -> float:
        ewma = self.ratios.get((engine, phase))
        return ewma.value if ewma is not None else 1.0

    def drifted(self, engine: str, phase: str) -> bool:
        lo, hi = self.drift_band
        ewma = self.ratios.get((engine, phase))
        return ewma is not None and ewma.samples >= 3 and not lo <= ewma.value <= hi

    def prefill(self, engine: str, tokens: int) -> Prediction:
        raw = self.models[engine].prefill.predict(tokens)
        return Prediction(
            raw.seconds * self.ratio(engine, "prefill"), raw.extrapolated, raw.clamped
        )

    def decode(self, engine: str, batch: int, context: float) -> Prediction:
        raw = self.models[engine].decode.predict(batch, context)
        return Prediction(raw.seconds * self.ratio(engine, "decode"), raw.extrapolated, raw.clamped)

    def transfer_s(self, engine: str) -> float:
        ewma = self.transfer.get(engine)
        return ewma.value if ewma is not None else self.default_transfer_s

    def observe(self, engine: str, phase: str, predicted_s: float, observed_s: float) -> float:
        """Fold one observation into the engine's correction; returns the new ratio."""
        if predicted_s <= 0 or observed_s <= 0 or engine not in self.models:
            return self.ratio(engine, phase)
        # The prediction already carried the old ratio: compare against the raw model.
        raw = predicted_s / self.ratio(engine, phase)
        lo, hi = self.ratio_bounds
        sample = min(max(observed_s / raw, lo), hi)
        ewma = self.ratios.setdefault((engine, phase), Ewma(self.alpha, 1.0))
        return ewma.update(sample)

    def observe_handoff(
        self, decode_engine: str, first_token_s: float, first_step_s: float
    ) -> None:
        """A decode leg's first token came ``first_token_s`` after it started; what is left
        after the predicted first step is the KV transfer (and its setup)."""
        transfer = max(0.0, first_token_s - first_step_s)
        self.transfer.setdefault(decode_engine, Ewma(self.alpha, transfer)).update(transfer)


@dataclass
class PromptLengthEstimator:
    """Tokens in a text prompt from its UTF-8 size, learning bytes per token online."""

    bytes_per_token: float = 4.0
    alpha: float = 0.1
    min_ratio: float = 1.0
    max_ratio: float = 16.0
    samples: int = 0

    def estimate(self, size_bytes: int) -> int:
        return max(1, round(size_bytes / self.bytes_per_token))

    def observe(self, size_bytes: int, tokens: int) -> None:
        if tokens <= 0 or size_bytes <= 0:
            return
        ratio = min(max(size_bytes / tokens, self.min_ratio), self.max_ratio)
        self.bytes_per_token = (
            ratio
            if self.samples == 0
            else self.alpha * ratio + (1 - self.alpha) * self.bytes_per_token
        )
        self.samples += 1
