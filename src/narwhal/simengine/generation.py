"""Deterministic generation and KV contents.

Output token ``k`` of a request depends only on (model seed, prompt tokens, k), so a request
split across a prefill engine and a decode engine returns exactly what one engine returns for it
whole. KV block ``i`` of a prompt is a deterministic function of the model seed and the prompt's
first ``(i + 1) * block_size`` tokens (a hash chain, as prefix caching keys blocks), so a decode
engine can verify every byte it pulled: a wrong, stale or partial transfer cannot pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from narwhal.simengine.vocab import Vocabulary

__all__ = ["GenerationModel", "KVLayout", "prompt_digest"]

_FILL_UNIT = 64  # bytes of one blake2b-512 digest; blocks are tiled with it


def prompt_digest(model_seed: int, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=32, person=b"narwhal-prompt")
    h.update(model_seed.to_bytes(8, "little", signed=True))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass(frozen=True)
class GenerationModel:
    vocab: Vocabulary
    model_seed: int = 0
    eos_prob: float = 0.0

    def token_at(self, digest: bytes, position: int) -> int:
        h = hashlib.blake2b(digest + position.to_bytes(8, "little"), digest_size=16).digest()
        value = int.from_bytes(h[:8], "little")
        if self.eos_prob > 0.0 and int.from_bytes(h[8:], "little") / 2.0**64 < self.eos_prob:
            return self.vocab.eos_id
        return self.vocab.first_word_id + value % self.vocab.num_words


@dataclass(frozen=True)
class KVLayout:
    """How a prompt's KV maps onto fixed-size blocks of ``block_bytes`` bytes."""

    model_seed: int
    block_size: int
    block_bytes: int

    def __post_init__(self) -> None:
        if self.block_bytes % _FILL_UNIT:
            raise ValueError(f"block_bytes must be a multiple of {_FILL_UNIT}")

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_contents(self, tokens: Sequence[int]) -> np.ndarray:
        """The prompt's KV as an array of shape (num_blocks, block_bytes), dtype uint8."""
        arr = np.asarray(tokens, dtype=np.int64)
        n = self.num_blocks(len(arr))
        out = np.empty((n, self.block_bytes), dtype=np.uint8)
        chain = self.model_seed.to_bytes(8, "little", signed=True)
        reps = self.block_bytes // _FILL_UNIT
        for i in range(n):
            chunk = arr[i * self.block_size : (i + 1) * self.block_size].tobytes()
            chain = hashlib.blake2b(chain + chunk, digest_size=32, person=b"narwhal-kv").digest()
            unit = np.frombuffer(hashlib.blake2b(chain, digest_size=_FILL_UNIT).digest(), np.uint8)
            out[i] = np.tile(unit, reps)
        return out
