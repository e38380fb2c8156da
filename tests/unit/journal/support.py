"""Helpers for the journal's unit tests: a ticking wall clock and readers of journal files."""

from __future__ import annotations

import stat
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from narwhal.journal import Journal, journal_files

OpenJournal = Callable[..., Journal]


class FakeWallClock:
    """Wall-clock seconds that tick by 1 on every read, so each record's ``ts`` is known."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def records(path: Path) -> list[dict[str, Any]]:
    """Every line of one file, parsed (fails the test on any invalid line)."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def all_records(path: Path) -> list[dict[str, Any]]:
    """Every record of the journal and its rotated files, oldest first."""
    return [r for f in journal_files(path) for r in records(f)]


def ends_per_id(path: Path) -> Counter[str]:
    return Counter(r["id"] for r in all_records(path) if r["type"] == "request.end")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)
