"""Fixed-capacity KV block accounting for the simulated engine."""

from __future__ import annotations

from collections import deque

__all__ = ["BlockAllocator"]


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[int] | None:
        """Take ``count`` blocks, or None (and take nothing) if there are not enough."""
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
