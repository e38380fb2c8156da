"""The simulated engine's KV block pool and prefix cache, after vLLM's ``BlockPool``.

Blocks are reference counted. A block whose count drops to zero joins the free queue's tail but
keeps its content and, if it was full and cached, its key: a later request whose prompt chain
reaches that key takes it back (a prefix hit) instead of computing it. Allocation takes free
blocks from the head (least recently freed first; a request's blocks are freed last block
first, so a prompt's tail is evicted before its head) and evicts the keys they held. Every
store and eviction of a key is recorded as a KV event for the engine's publisher, in vLLM's
shapes (``BlockStored`` with the blocks' token ids and parent, ``BlockRemoved``,
``AllBlocksCleared``); the engine's block hash is the chain key itself (an int, as vLLM
publishes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "KVEvent"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    # vLLM's extra keys per block: block 0 of a salted prompt carries its cache_salt.
    extra_keys: list[tuple[str, ...] | None] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """``num_blocks`` blocks; with ``caching`` off, a plain allocator that never hits."""

    def __init__(self, num_blocks: int, caching: bool = True, record_events: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.caching = caching
        # Events are kept only for a publisher that takes them (else they would pile up).
        self.record_events = record_events
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, int] = {}  # block -> chain key (cached blocks only)
        self._block_of: dict[int, int] = {}  # chain key -> block
        self.events: list[KVEvent] = []  # pending, for the publisher to take each step
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        # As vLLM: cached blocks nobody references count as free.
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def cached_prefix(self, keys: Sequence[int]) -> list[int]:
        """The blocks holding the longest run of ``keys`` from the first."""
        if not self.caching:
            return []
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def refs(self, block: int) -> int:
        return self._refs[block]

    def record_lookup(self, tokens: int, hit_tokens: int) -> None:
        self.queries += tokens
        self.hits += hit_tokens

    def can_allocate(self, count: int, hit: Sequence[int]) -> bool:
        """Whether ``count`` new blocks fit once the ``hit`` blocks are taken back."""
        reclaimed = sum(1 for b in hit if self._refs[b] == 0)
        return count <= len(self._free) - reclaimed

    def allocate(self, count: int, hit: Sequence[int] = ()) -> list[int] | None:
        """Take the ``hit`` blocks (a cached prefix) and ``count`` new ones, or None (and take
        nothing) if they do not fit."""
        if not self.can_allocate(count, hit):
            return None
        for block in hit:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        fresh = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            fresh.append(block)
        return [*hit, *fresh]

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; the last block first joins the queue first."""
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs < 0:
                raise ValueError(f"block {block} freed more often than taken")
            self._refs[block] = refs
            if refs == 0:
                self._free[block] = None

    def cache(
        self,
        blocks: Sequence[int],
        keys: Sequence[int],
        tokens: Sequence[int],
        block_size: int,
        salt: str | None = None,
    ) -> list[int]:
        """Key the request's full blocks ``blocks[i]`` with ``keys[i]`` (``tokens`` are the
        request's tokens, ``block_size`` per block). Blocks already keyed are left; a key some
        other block already holds leaves this block uncached (vLLM keeps the first). Returns
        the indices of the blocks newly cached (their content must be written)."""
        if not self.caching:
            return []
        new: list[int] = []
        run_start: int | None = None
        for i, (block, key) in enumerate(zip(blocks, keys, strict=False)):
            if self._key_of.get(block) == key or key in self._block_of:
                self._flush(run_start, i, keys, tokens, block_size, salt)
                run_start = None
                continue
            self._evict(block)
            self._key_of[block] = key
            self._block_of[key] = block
            new.append(i)
            if run_start is None:
                run_start = i
        self._flush(run_start, min(len(blocks), len(keys)), keys, tokens, block_size, salt)
        return new

    def uncache(self, blocks: Sequence[int]) -> None:
        """Forget the keys these blocks hold (their content is about to be destroyed)."""
        for block in blocks:
            self._evict(block)

    def clear(self) -> bool:
        """vLLM's reset_prefix_cache: only when no block is in use; True if it cleared."""
        if len(self._free) != self.num_blocks:
            return False
        if self._block_of:
            self._key_of.clear()
            self._block_of.clear()
            if self.record_events:
                self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    # --- internals -------------------------------------------------------------------------

    def _evict(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            if self.record_events:
                self.events.append(BlockRemoved([key]))

    def _flush(
        self,
        start: int | None,
        end: int,
        keys: Sequence[int],
        tokens: Sequence[int],
        block_size: int,
        salt: str | None,
    ) -> None:
        """One BlockStored for the run of newly cached blocks ``start..end-1``."""
        if start is None or end <= start or not self.record_events:
            return
        extra: list[tuple[str, ...] | None] | None = None
        if salt and start == 0:
            extra = [(salt,)] + [None] * (end - start - 1)
        self.events.append(
            BlockStored(
                block_hashes=list(keys[start:end]),
                parent_block_hash=keys[start - 1] if start > 0 else None,
                token_ids=list(tokens[start * block_size : end * block_size]),
                block_size=block_size,
                extra_keys=extra,
            )
        )
