"""Tokens in a text prompt, estimated from its size in bytes before any engine has counted them.

The one place that knows how many bytes a token takes: the router's scheduling estimate (and its
online correction from the counts engines report), the bound the router uses to refuse prompts
that cannot fit, and the tokenization gate of narwhal-check, which checks both on the fleet's
own tokenizer. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COLD_BYTES_PER_TOKEN", "MAX_BYTES_PER_TOKEN", "PromptLengthEstimator"]

# The scheduling estimate for text prompts until an engine reports the real count.
COLD_BYTES_PER_TOKEN = 4.0
# A bound on bytes per token used to refuse text prompts that cannot fit before any engine is
# asked: no tokenizer we serve has tokens longer than this many bytes on average.
MAX_BYTES_PER_TOKEN = 16.0


@dataclass
class PromptLengthEstimator:
    """Tokens in a text prompt from its UTF-8 size, learning bytes per token online."""

    bytes_per_token: float = COLD_BYTES_PER_TOKEN
    alpha: float = 0.1
    min_ratio: float = 1.0
    max_ratio: float = MAX_BYTES_PER_TOKEN
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
