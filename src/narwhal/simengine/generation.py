"""Deterministic generation and KV contents.

Generation is autoregressive: output token ``k`` of a request (and its logprobs) depends only
on the model seed and its context, the prompt's tokens followed by the ``k`` output tokens
before it, never on where the prompt ends. So a request whose prompt is ``P + G[:m]``, where
``G`` is what the engine generated for the prompt ``P``, generates exactly ``G[m:]``: a request
broken off mid-answer can be continued (migrated) from the tokens it had sent, on any engine
with the same model seed. And a request split across a prefill engine and a decode engine
returns exactly what one engine returns for it whole.

The context is hashed as a chain over fixed chunks of :data:`CONTEXT_CHUNK` tokens
(:class:`ContextChain`): ``state[i + 1] = blake2b(state[i] + chunk i)``, ``state[0]`` from the
model seed, and the next token's key hashes the state over the context's full chunks with the
partial tail chunk and the context's length. A prompt costs one hash per chunk, each generated
token one hash for its key (and one more every chunk). Choice ``j > 0`` of an ``n > 1`` request
starts its chain from a perturbed state (:func:`choice_digest`): its own sequence of the same
prompt, which a continuation (a choice 0) does not reproduce; choice 0 is the ``n = 1`` request.

KV block ``i`` of a prompt is a deterministic function of the model seed and the prompt's
first ``(i + 1) * block_size`` tokens (a hash chain, as prefix caching keys blocks), so a decode
engine can verify every byte it pulled: a wrong, stale or partial transfer cannot pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from narwhal.simengine.vocab import Vocabulary

__all__ = ["CONTEXT_CHUNK", "ContextChain", "GenerationModel", "KVLayout", "choice_digest"]

_FILL_UNIT = 64  # bytes of one blake2b-512 digest; blocks are tiled with it
CONTEXT_CHUNK = 16  # tokens per link of a ContextChain
_TOKEN_BYTES = 8  # a token in the chain: int64, little-endian
_CHUNK_BYTES = CONTEXT_CHUNK * _TOKEN_BYTES
# Unkeyed prototypes, copied for each hash (cheaper than constructing one with a person).
_LINK = hashlib.blake2b(digest_size=32, person=b"narwhal-context")
_KEY = hashlib.blake2b(digest_size=32, person=b"narwhal-next")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def choice_digest(digest: bytes, choice: int) -> bytes:
    """The chain start choice ``choice`` (> 0) of an ``n > 1`` request generates from, given
    the model's (``digest``): its own deterministic sequence of the same prompt (choice 0 keeps
    the model's start, so its text is what the request with ``n = 1`` gets)."""
    h = hashlib.blake2b(digest_size=32, person=b"narwhal-choice")
    h.update(digest + choice.to_bytes(8, "little"))
    return h.digest()


def _chain_start(model_seed: int, choice: int) -> bytes:
    start = hashlib.blake2b(
        model_seed.to_bytes(8, "little", signed=True), digest_size=32, person=b"narwhal-model"
    ).digest()
    return choice_digest(start, choice) if choice else start


class ContextChain:
    """A request's context as generation sees it (prompt, then each token generated), hashed
    incrementally: :meth:`key` is what the next token and its logprobs are drawn from,
    :meth:`append` adds the token generated. Two chains of the same model seed, choice and
    context give the same keys, however the context was split between prompt and output."""

    __slots__ = ("_length", "_state", "_tail")

    def __init__(self, model_seed: int, tokens: Sequence[int] = (), choice: int = 0) -> None:
        self._state = _chain_start(model_seed, choice)
        self._tail = b""  # the bytes of the tokens after the last full chunk
        self._length = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._length

    def extend(self, tokens: Sequence[int]) -> None:
        if not len(tokens):
            return
        data = self._tail + _token_bytes(tokens)
        full = len(data) - len(data) % _CHUNK_BYTES
        state = self._state
        view = memoryview(data)
        for start in range(0, full, _CHUNK_BYTES):
            h = _LINK.copy()
            h.update(state)
            h.update(view[start : start + _CHUNK_BYTES])
            state = h.digest()
        self._state = state
        self._tail = data[full:]
        self._length += len(tokens)

    def append(self, token: int) -> None:
        tail = self._tail + token.to_bytes(_TOKEN_BYTES, "little", signed=True)
        self._length += 1
        if len(tail) == _CHUNK_BYTES:
            h = _LINK.copy()
            h.update(self._state)
            h.update(tail)
            self._state = h.digest()
            tail = b""
        self._tail = tail

    def key(self) -> bytes:
        """The 32-byte key of the context as it is now: what the next token is drawn from."""
        h = _KEY.copy()
        h.update(self._state + self._tail + self._length.to_bytes(8, "little"))
        return h.digest()


@dataclass(frozen=True)
class GenerationModel:
    vocab: Vocabulary
    model_seed: int = 0
    eos_prob: float = 0.0

    def context(self, tokens: Sequence[int], choice: int = 0) -> ContextChain:
        """The context chain of a request whose prompt is ``tokens`` (its choice ``choice``)."""
        return ContextChain(self.model_seed, tokens, choice)

    def word_at(self, key: bytes) -> int:
        """The word the model writes at ``key`` (a :meth:`ContextChain.key`) when EOS is not
        allowed there (``min_tokens``, ``ignore_eos``): the token it writes unless it ends."""
        return self.vocab.first_word_id + int.from_bytes(key[:8], "little") % self.vocab.num_words

    def token_at(self, key: bytes) -> int:
        """The token the model writes at ``key``: EOS with probability ``eos_prob``, else
        :meth:`word_at`."""
        if self.eos_prob > 0.0 and int.from_bytes(key[8:16], "little") / 2.0**64 < self.eos_prob:
            return self.vocab.eos_id
        return self.word_at(key)

    def generate(self, prompt: Sequence[int], max_tokens: int, choice: int = 0) -> list[int]:
        """What a request for ``prompt`` answers (EOS allowed; the EOS it ends on included)."""
        chain = self.context(prompt, choice)
        out: list[int] = []
        while len(out) < max_tokens:
            token = self.token_at(chain.key())
            out.append(token)
            if token == self.vocab.eos_id:
                break
            chain.append(token)
        return out

    def logprobs(self, key: bytes, token: int, k: int) -> list[tuple[int, float]]:
        """The sampled ``token`` and the model's ``k - 1`` next likeliest tokens at ``key``
        (the context before it), best first, as (id, logprob): what vLLM's logprobs dict holds
        when the sampled token is the top-1 (a greedy-like simulated model's always is), so the
        sampled token's logprob is the maximum. Deterministic in (key, token); values are
        rounded to 4 decimals so every serialization of them is the same text."""
        h = hashlib.blake2b(
            key + token.to_bytes(8, "little", signed=True),
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
