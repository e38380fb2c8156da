"""The benchmarks' event loop: uvloop when it is installed (a load client must not be the
bottleneck it measures), asyncio's own otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["UVLOOP", "run"]

T = TypeVar("T")

try:
    import uvloop

    UVLOOP = True
except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
    UVLOOP = False


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop when ``UVLOOP``."""
    if UVLOOP:
        return uvloop.run(main)
    return asyncio.run(main)
