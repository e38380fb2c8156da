"""Prompt prefixes as KV block chains, and the router's index of which engine holds which.

A prompt's full blocks of ``block_size`` tokens are keyed as vLLM keys its prefix cache: block
i's key is a hash of block i-1's key and block i's token ids (block 0's parent is the root,
which ``cache_salt`` changes), so equal keys mean equal prefixes and a request's cached prefix
on an engine is the run of its leading keys that engine holds. The keys are Narwhal's own (a
64-bit blake2b chain): vLLM's block hashes depend on its hash algorithm and seed, so the index
rebuilds each engine's chain from the token ids its KV events carry (``BlockStored``) and keeps
the engine's own hashes only to apply its later ``BlockRemoved``.

``PrefixIndex`` holds, per engine, either what the engine published (precise: stored, removed,
cleared) or, for an engine that publishes nothing, what the router itself sent there
(approximate: each entry lives ``history_ttl_s`` and the engine's entries are bounded by its KV
capacity in blocks, least recently used first out). Pure: times are passed in.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TEXT_BYTES_PER_TOKEN",
    "EngineHash",
    "PrefixIndex",
    "chain_keys",
    "chain_root",
    "extend_chain",
    "prompt_keys",
    "text_keys",
]

# vLLM's ExternalBlockHash: sha256 bytes by default, a 64-bit int with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
EngineHash = bytes | int

_PERSON = b"narwhal-prefix"
# A text prompt's blocks are keyed by its UTF-8 bytes, this many per token (a typical BPE
# average) times the block size: the router has no tokenizer on its hot path.
TEXT_BYTES_PER_TOKEN = 4


def chain_root(salt: str | None = None) -> int:
    """The parent key of a prompt's first block: one root per ``cache_salt`` (vLLM puts the salt
    in block 0's hash, so salted prompts share nothing with unsalted ones)."""
    if not salt:
        return 0
    return int.from_bytes(
        hashlib.blake2b(salt.encode(), digest_size=8, person=_PERSON).digest(), "little"
    )


def extend_chain(parent: int, block_tokens: Sequence[int]) -> int:
    """The key of a block whose parent block has key ``parent``: Python's hash of the pair,
    which for ints and tuples of ints is the same in every process (only str and bytes hashes
    are salted by PYTHONHASHSEED) and a few times faster than a digest: a 12,000-token prompt
    is keyed in well under a millisecond on the router's hot path."""
    return hash((parent, tuple(int(t) for t in block_tokens)))


def chain_keys(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The keys of the prompt's full blocks (a partial last block is never cached)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    ids = tuple(tokens)
    keys: list[int] = []
    key = chain_root(salt)
    for start in range(0, len(ids) - block_size + 1, block_size):
        key = hash((key, ids[start : start + block_size]))
        keys.append(key)
    return keys


def text_keys(parts: Iterable[str], block_size: int, salt: str | None = None) -> list[int]:
    """Keys of a text prompt's full blocks of ``block_size * TEXT_BYTES_PER_TOKEN`` UTF-8 bytes
    (``parts`` in order, each ended by a NUL so that part boundaries count). Their root is not
    any token prompt's: they match only text keys, which only routing history records."""
    data = b"".join(part.encode("utf-8", "surrogatepass") + b"\0" for part in parts)
    size = block_size * TEXT_BYTES_PER_TOKEN
    key = chain_root("text\0" + (salt or ""))
    keys = []
    for start in range(0, len(data) - size + 1, size):
        h = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8, person=_PERSON)
        h.update(data[start : start + size])
        key = int.from_bytes(h.digest(), "little")
        keys.append(key)
    return keys


def prompt_keys(body: Mapping[str, Any], chat: bool, block_size: int) -> tuple[int, ...]:
    """A client request's prefix keys: exact for a prompt of token ids, by its text otherwise
    (a chat's roles and contents in order); () when the prompt is neither (a batch, images)."""
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) else None
    if chat:
        parts: list[str] = []
        for message in body.get("messages") or ():
            if not isinstance(message, Mapping):
                return ()
            parts.append(str(message.get("role")))
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, Mapping) else None
                    if not isinstance(text, str):
                        return tuple(text_keys(parts, block_size, salt))  # up to the image
                    parts.append(text)
        return tuple(text_keys(parts, block_size, salt))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tuple(text_keys([prompt], block_size, salt))
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        # Not every element checked (a loop per token on the hot path): the router keys only
        # prompts its validation passed, and an element that is no int gives keys no engine's
        # blocks have, or (unhashable) none.
        try:
            return tuple(chain_keys(prompt, block_size, salt))
        except TypeError:
            return ()
    return ()


@dataclass
class _EngineEntries:
    # key -> expiry (approximate entries; inf for published ones), least recently used first.
    keys: OrderedDict[int, float] = field(default_factory=OrderedDict)
    capacity_blocks: int = 0
    precise: bool = False
    # Published entries: the engine's hash -> Narwhal's key, to apply BlockRemoved, and back.
    by_engine_hash: dict[EngineHash, int] = field(default_factory=dict)
    engine_hash_of: dict[int, EngineHash] = field(default_factory=dict)


class PrefixIndex:
    """Which engine holds which block chain, for ``match``ing a prompt's keys against all."""

    def __init__(self, block_size: int, history_ttl_s: float = 1800.0) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if history_ttl_s <= 0:
            raise ValueError("history_ttl_s must be positive")
        self.block_size = block_size
        self.history_ttl_s = history_ttl_s
        self._engines: dict[str, _EngineEntries] = {}
        self._holders: dict[int, set[str]] = {}

    # --- membership --------------------------------------------------------------------------

    def add_engine(self, engine_id: str, capacity_blocks: int) -> None:
        """Track an engine whose prefix cache holds at most ``capacity_blocks`` blocks."""
        entries = self._engines.setdefault(engine_id, _EngineEntries())
        entries.capacity_blocks = max(1, capacity_blocks)
        self._trim(engine_id, entries)

    def set_precise(self, engine_id: str, precise: bool) -> None:
        """Whether the engine's entries come from its KV events (True) or from routing history.
        A change of source starts the engine's entries afresh: neither source's entries say
        anything about the other's."""
        entries = self._entry(engine_id)
        if entries.precise != precise:
            self.clear(engine_id)
            entries.precise = precise

    def is_precise(self, engine_id: str) -> bool:
        entries = self._engines.get(engine_id)
        return entries is not None and entries.precise

    def engines(self) -> list[str]:
        return list(self._engines)

    def blocks_held(self, engine_id: str) -> int:
        entries = self._engines.get(engine_id)
        return 0 if entries is None else len(entries.keys)

    # --- lookups -------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Per engine holding at least the first block: how many leading blocks it holds."""
        holders = self._holders
        first = holders.get(keys[0]) if keys else None
        if not first:
            return {}
        depth: dict[str, int] = {}
        alive = list(first)
        d = 1
        for key in itertools.islice(keys, 1, None):
            engines = holders.get(key)
            if not engines:
                break
            if len(alive) == 1:
                if alive[0] not in engines:
                    break
            else:
                kept = [e for e in alive if e in engines]
                if len(kept) < len(alive):
                    for e in alive:
                        if e not in engines:
                            depth[e] = d
                    if not kept:
                        alive = kept
                        break
                    alive = kept
            d += 1
        for e in alive:
            depth[e] = d
        # Expiry, checked once per engine: a prompt's keys are refreshed together with all
        # their ancestors, so a block's entry never outlives its parent's: walk back from the
        # deepest held to the deepest still alive.
        held: dict[str, int] = {}
        for e, n in depth.items():
            entries = self._engines[e].keys
            while n and not entries.get(keys[n - 1], 0.0) > now:
                n -= 1
            if n:
                held[e] = n
        return held

    # --- routing history (engines without events) ----------------------------------------------

    def record_routed(
        self, engine_id: str, keys: Iterable[int], now: float, exact: bool = True
    ) -> None:
        """The router sent a prompt with these keys to the engine: it will hold them. Token
        keys (``exact``) are ignored for an engine that publishes its events (they say what it
        holds); text keys, which no event carries, are recorded for every engine."""
        entries = self._entry(engine_id)
        if entries.precise and exact:
            return
        self._expire(engine_id, entries, now)
        expiry = now + self.history_ttl_s
        for key in keys:
            self._put(engine_id, entries, key, expiry)
        self._trim(engine_id, entries)

    # --- KV events (precise) ----------------------------------------------------------------------

    def stored(
        self,
        engine_id: str,
        block_hashes: Sequence[EngineHash],
        parent_hash: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        salt: str | None = None,
    ) -> bool:
        """A ``BlockStored`` event. False (nothing applied) when it cannot be placed: a parent
        the index never saw stored (an event was lost: resynchronise) or a block size other
        than the index's."""
        entries = self._entry(engine_id)
        if block_size != self.block_size or len(token_ids) != block_size * len(block_hashes):
            return False
        if parent_hash is None:
            key = chain_root(salt)
        else:
            parent = entries.by_engine_hash.get(parent_hash)
            if parent is None:
                return False
            key = parent
        # The event's token ids are ints already (msgpack); anything unhashable in them is a
        # malformed event, dropped whole.
        ids = tuple(token_ids)
        try:
            chain = []
            for start in range(0, len(ids), block_size):
                key = hash((key, ids[start : start + block_size]))
                chain.append(key)
        except TypeError:
            return False
        # Hot with long prompts (every engine's every new block): the loop body is _put's,
        # inlined.
        by_engine_hash, engine_hash_of = entries.by_engine_hash, entries.engine_hash_of
        held, holders, inf = entries.keys, self._holders, float("inf")
        for engine_hash, key in zip(block_hashes, chain, strict=True):
            by_engine_hash[engine_hash] = key
            engine_hash_of[key] = engine_hash
            if key in held:
                held.move_to_end(key)
            else:
                engines = holders.get(key)
                if engines is None:
                    holders[key] = {engine_id}
                else:
                    engines.add(engine_id)
            held[key] = inf
        self._trim(engine_id, entries)
        return True

    def removed(self, engine_id: str, block_hashes: Sequence[EngineHash]) -> None:
        """A ``BlockRemoved`` event (hashes the index does not know are ignored)."""
        entries = self._entry(engine_id)
        by_engine_hash, engine_hash_of, held, holders = (
            entries.by_engine_hash,
            entries.engine_hash_of,
            entries.keys,
            self._holders,
        )
        # Hot: a full cache evicts a block for every one it stores. The loop body is _unhold's,
        # inlined.
        for engine_hash in block_hashes:
            key = by_engine_hash.pop(engine_hash, None)
            if key is not None:
                engine_hash_of.pop(key, None)
                if held.pop(key, None) is not None:
                    engines = holders.get(key)
                    if engines is not None:
                        engines.discard(engine_id)
                        if not engines:
                            del holders[key]

    def clear(self, engine_id: str) -> None:
        """``AllBlocksCleared``, an engine restart, or a lost event stream: forget the engine's
        entries."""
        entries = self._engines.get(engine_id)
        if entries is None:
            return
        for key in entries.keys:
            self._unhold(engine_id, key)
        entries.keys.clear()
        entries.by_engine_hash.clear()
        entries.engine_hash_of.clear()

    # --- internals -------------------------------------------------------------------------------

    def _entry(self, engine_id: str) -> _EngineEntries:
        entries = self._engines.get(engine_id)
        if entries is None:
            raise KeyError(f"engine {engine_id!r} is not in the prefix index")
        return entries

    def _put(self, engine_id: str, entries: _EngineEntries, key: int, expiry: float) -> None:
        if key in entries.keys:
            entries.keys.move_to_end(key)
        else:
            self._holders.setdefault(key, set()).add(engine_id)
        entries.keys[key] = expiry

    def _drop(self, engine_id: str, entries: _EngineEntries, key: int) -> None:
        """Forget an entry the engine's capacity or its lifetime pushed out."""
        engine_hash = entries.engine_hash_of.pop(key, None)
        if engine_hash is not None:
            entries.by_engine_hash.pop(engine_hash, None)
        self._unhold(engine_id, key)

    def _unhold(self, engine_id: str, key: int) -> None:
        engines = self._holders.get(key)
        if engines is not None:
            engines.discard(engine_id)
            if not engines:
                del self._holders[key]

    def _trim(self, engine_id: str, entries: _EngineEntries) -> None:
        held = entries.keys
        excess = len(held) - entries.capacity_blocks
        if excess <= 0:
            return
        engine_hash_of, by_engine_hash, holders = (
            entries.engine_hash_of,
            entries.by_engine_hash,
            self._holders,
        )
        for _ in range(excess):
            key, _ = held.popitem(last=False)
            engine_hash = engine_hash_of.pop(key, None)
            if engine_hash is not None:
                by_engine_hash.pop(engine_hash, None)
            engines = holders.get(key)
            if engines is not None:
                engines.discard(engine_id)
                if not engines:
                    del holders[key]

    def _expire(self, engine_id: str, entries: _EngineEntries, now: float) -> None:
        # Approximate entries are refreshed in time order with one TTL: the oldest are first.
        while entries.keys:
            key, expiry = next(iter(entries.keys.items()))
            if expiry > now:
                break
            entries.keys.popitem(last=False)
            self._drop(engine_id, entries, key)
