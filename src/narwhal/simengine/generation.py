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

__all__ = ["GenerationModel", "KVLayout", "choice_digest", "prompt_digest"]

_FILL_UNIT = 64  # bytes of one blake2b-512 digest; blocks are tiled with it


def prompt_digest(model_seed: int, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=32, person=b"narwhal-prompt")
    h.update(model_seed.to_bytes(8, "little", signed=True))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def choice_digest(digest: bytes, choice: int) -> bytes:
    """The digest choice ``choice`` (> 0) of an ``n > 1`` request generates from: its own
    deterministic sequence of the same prompt (choice 0 keeps the prompt's digest, so its text
    is what the request with ``n = 1`` gets)."""
    h = hashlib.blake2b(digest_size=32, person=b"narwhal-choice")
    h.update(digest + choice.to_bytes(8, "little"))
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

    def logprobs(self, digest: bytes, position: int, token: int, k: int) -> list[tuple[int, float]]:
        """The sampled ``token`` and the model's ``k - 1`` next likeliest tokens at
        ``position``, best first, as (id, logprob): what vLLM's logprobs dict holds when the
        sampled token is the top-1 (a greedy-like simulated model's always is), so the sampled
        token's logprob is the maximum. Deterministic in (digest, position, token); values are
        rounded to 4 decimals so every serialization of them is the same text."""
        h = hashlib.blake2b(
            digest + position.to_bytes(8, "little") + token.to_bytes(8, "little", signed=True),
            digest_size=32,
            person=b"narwhal-logprob",
        ).digest()
        logprob = -round(0.001 + int.from_bytes(h[:4], "little") / 2.0**32 * 1.5, 4)
        out = [(token, logprob)]
        words = self.vocab.num_words
        start = int.from_bytes(h[4:8], "little")
        step = 0
        while len(out) < max(k, 1):
            step += 1
            alt = self.vocab.first_word_id + (start + step) % words
            if alt == token:
                continue
            gap = 0.05 + h[8 + len(out) % 24] / 255.0 * 2.0
            out.append((alt, round(out[-1][1] - gap, 4)))
        return out


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
        return self.contents(self.chains(tokens))

    def contents(self, chains: Sequence[bytes]) -> np.ndarray:
        """The KV of the blocks whose content chains are ``chains`` (:meth:`chains`), as
        :meth:`block_contents` gives it."""
        out = np.empty((len(chains), self.block_bytes), dtype=np.uint8)
        self.write(out, range(len(chains)), chains)
        return out

    def chains(
        self,
        tokens: Sequence[int],
        start: int = 0,
        stop: int | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """The content chains of blocks ``start`` to ``stop - 1`` (default: the last, partial
        or not) of ``tokens``' KV: block i's chain is a hash of block i-1's and block i's
        tokens, and its content a function of its chain alone (:meth:`write`). ``parent``:
        block ``start - 1``'s chain, to extend it without hashing the blocks before (None:
        from block 0)."""
        arr = np.asarray(tokens, dtype=np.int64)
        if stop is None:
            stop = self.num_blocks(len(arr))
        if parent is None:
            chain = self.model_seed.to_bytes(8, "little", signed=True)
            first = 0
        else:
            chain, first = parent, start
        data = arr.tobytes()
        step = 8 * self.block_size
        out: list[bytes] = []
        for i in range(first, stop):
            chain = hashlib.blake2b(
                chain + data[i * step : (i + 1) * step], digest_size=32, person=b"narwhal-kv"
            ).digest()
            if i >= start:
                out.append(chain)
        return out

    def write(self, pool: np.ndarray, rows: Sequence[int], chains: Sequence[bytes]) -> None:
        """Write into ``pool`` (C-contiguous uint8, ``block_bytes`` per row) at ``rows[i]``
        the content of the block whose chain is ``chains[i]``: its blake2b-512 digest, tiled
        (in place, in one assignment)."""
        if not chains:
            return
        if not pool.flags.c_contiguous:
            raise ValueError("pool must be C-contiguous (written through a reshaped view)")
        units = b"".join(hashlib.blake2b(c, digest_size=_FILL_UNIT).digest() for c in chains)
        tiled = pool.reshape(pool.shape[0], self.block_bytes // _FILL_UNIT, _FILL_UNIT)
        tiled[rows] = np.frombuffer(units, np.uint8).reshape(len(chains), 1, _FILL_UNIT)
