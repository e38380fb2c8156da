"""The simulated engine's step-time model, calibrated to the qualification fleet.

Prefill of ``n`` tokens costs ``a + b*n + c*n^2`` seconds; a chunk of ``n`` tokens starting at
offset ``o`` costs ``a + b*n + c*((o+n)^2 - o^2)`` so that chunks add up to the whole. A decode
step for a batch of ``batch`` sequences whose mean context is ``context`` tokens costs
``intercept + slope*batch + ctx_coef*context``. These are the forms narwhal-profile fits, so a
profile of the simulator should recover these very parameters.

Defaults: 8,192-token prefill = 0.02 + 0.8192 + 0.0805 = 0.92 s; decode at batch 1 with 512 to
8,192 tokens of context = 0.2416 to 0.2426 s per token, as measured on the MI355X fleet.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepTiming"]


@dataclass(frozen=True)
class StepTiming:
    prefill_a: float = 0.02
    prefill_b: float = 1.0e-4
    prefill_c: float = 1.2e-9
    decode_intercept: float = 0.2400
    decode_slope: float = 0.0015
    decode_ctx_coef: float = 1.3e-7
    # Wall seconds = model seconds * slowdown / time_scale.
    time_scale: float = 1.0
    slowdown: float = 1.0

    def prefill_s(self, num_tokens: int) -> float:
        return self.prefill_chunk_s(0, num_tokens)

    def prefill_chunk_s(self, offset: int, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        end = offset + num_tokens
        return (
            self.prefill_a
            + self.prefill_b * num_tokens
            + self.prefill_c * (end * end - offset * offset)
        )

    def decode_step_s(self, batch: int, mean_context: float) -> float:
        if batch <= 0:
            return 0.0
        return (
            self.decode_intercept + self.decode_slope * batch + self.decode_ctx_coef * mean_context
        )

    def wall(self, model_seconds: float) -> float:
        return model_seconds * self.slowdown / self.time_scale
