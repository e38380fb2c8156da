"""Fixtures for the journal's unit tests: journals closed at teardown, and a stuck disk.

Real files in ``tmp_path``; failures are injected by patching the journal's file object.
Nothing sleeps to wait: tests use ``flush()``/``close()`` or poll with a bound.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narwhal.journal import Journal
from narwhal.journal.file import JournalFile
from tests.unit.journal.support import OpenJournal


@pytest.fixture
def open_journal() -> Iterator[OpenJournal]:
    """``Journal.open`` that closes every journal at teardown."""
    opened: list[Journal] = []

    def factory(path: Path, **kwargs: Any) -> Journal:
        journal = Journal.open(path, **kwargs)
        opened.append(journal)
        return journal

    yield factory
    for journal in opened:
        journal.close(timeout=10)


@pytest.fixture
def blocked_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Make every journal write wait for ``gate`` (a stuck disk); ``entered`` is set once the
    writer is inside a write."""
    gate, entered = threading.Event(), threading.Event()
    original = JournalFile.write

    def slow_write(self: JournalFile, data: bytes) -> None:
        entered.set()
        gate.wait(10)
        original(self, data)

    monkeypatch.setattr(JournalFile, "write", slow_write)
    yield gate, entered
    gate.set()
