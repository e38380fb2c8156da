"""Closing journals at interpreter exit: one hook, registered only while a journal is open.

The interpreter's own exit is in tests/integration/test_journal_process.py; here ``atexit`` is
replaced by a recorder and the hook is called by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from narwhal.journal import Journal, at_exit
from tests.unit.journal.support import records


class RecordingAtexit:
    """Stands in for the ``atexit`` module: keeps the registered hooks."""

    def __init__(self) -> None:
        self.hooks: list[Callable[[], None]] = []

    def register(self, func: Callable[[], None]) -> Callable[[], None]:
        self.hooks.append(func)
        return func

    def unregister(self, func: Callable[[], None]) -> None:
        self.hooks = [hook for hook in self.hooks if hook is not func]


@pytest.fixture
def fake_atexit(monkeypatch: pytest.MonkeyPatch) -> RecordingAtexit:
    """A fresh registry of open journals and a recording ``atexit`` (both restored after)."""
    fake = RecordingAtexit()
    monkeypatch.setattr(at_exit, "atexit", fake)
    monkeypatch.setattr(at_exit, "_open", {})
    monkeypatch.setattr(at_exit, "_exiting", False)
    return fake


def test_the_hook_is_registered_only_while_a_journal_is_open(
    tmp_path: Path, fake_atexit: RecordingAtexit
) -> None:
    a = Journal.open(tmp_path / "a.jsonl")
    assert len(fake_atexit.hooks) == 1
    b = Journal.open(tmp_path / "b.jsonl")
    assert len(fake_atexit.hooks) == 1  # one hook for every open journal
    assert a.close()
    assert len(fake_atexit.hooks) == 1  # b is still open
    assert b.close()
    assert fake_atexit.hooks == []
    assert b.close()  # idempotent
    assert fake_atexit.hooks == []


def test_the_hook_drains_fsyncs_and_closes_journals_left_open(
    tmp_path: Path, fake_atexit: RecordingAtexit
) -> None:
    path = tmp_path / "j.jsonl"
    j = Journal.open(path, recover=False, fsync_interval_s=3600)
    for i in range(100):
        assert j.request_start(f"r{i}", float(i))
    (hook,) = fake_atexit.hooks
    hook()  # what the interpreter does at exit
    assert j.closed
    assert j.stats().fsyncs == 1  # the interval never came: the close synced
    assert [r["id"] for r in records(path)] == [f"r{i}" for i in range(100)]
    assert at_exit._open == {}
