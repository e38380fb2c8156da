"""The journal's files: private modes, torn tails, rotation, truncation of a partial write."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from narwhal.journal import journal_files, recover
from narwhal.journal.file import JournalFile
from tests.unit.journal.support import OpenJournal, all_records, mode, records


def test_existing_files_are_made_private(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b"")
    path.chmod(0o644)
    backup = tmp_path / "journal.jsonl.1"
    backup.write_bytes(b"")
    backup.chmod(0o644)
    open_journal(path)
    assert mode(path) == 0o600
    assert mode(backup) == 0o600


def test_torn_tail_without_newline_gets_isolated(tmp_path: Path, open_journal: OpenJournal) -> None:
    """A complete record missing only its newline is read; the next record is not glued on."""
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"type":"request.start","ts":1.0,"id":"a","arrival":1.0}')
    j = open_journal(path)
    assert j.recovery is not None and j.recovery.open_ids == ["a"]
    assert not j.recovery.torn_tail and j.recovery.invalid_line_count == 0
    j.close()
    assert [(r["type"], r["id"]) for r in records(path)] == [
        ("request.start", "a"),
        ("request.end", "a"),
    ]


def test_rotation_keeps_backups_private_and_ordered(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, max_bytes=1000, backups=2, recover=False)
    for seq in range(200):
        assert j.record("filler", seq=seq, pad="x" * 40)
    assert j.close()
    files = journal_files(path)
    assert [f.name for f in files] == ["j.jsonl.2", "j.jsonl.1", "j.jsonl"]
    assert not (tmp_path / "j.jsonl.3").exists()
    for f in files:
        assert mode(f) == 0o600
        assert f.stat().st_size <= 1000
    seqs = [r["seq"] for r in all_records(path)]
    assert seqs == list(range(seqs[0], 200))  # oldest first, contiguous, newest kept
    assert seqs[0] > 0  # the oldest were dropped with the third backup
    assert j.stats().rotations >= 3


def test_partial_write_is_truncated_away(
    tmp_path: Path, open_journal: OpenJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    j.request_start("a", 1.0)
    assert j.flush()
    before = path.read_bytes()
    original = JournalFile.write

    def half_then_eio(self: JournalFile, data: bytes) -> None:
        original(self, data[: len(data) // 2])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(JournalFile, "write", half_then_eio)
    j.request_start("b", 2.0)
    assert j.flush()
    assert path.read_bytes() == before  # no fragment left behind
    monkeypatch.undo()
    j.request_end("a", "ok")
    assert j.close()
    assert [(r["type"], r["id"]) for r in records(path)] == [
        ("request.start", "a"),
        ("request.end", "a"),
    ]
    assert j.records_written == 2 and j.dropped == 1


def test_fragment_that_cannot_be_truncated_stays_on_its_own_line(
    tmp_path: Path, open_journal: OpenJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False, on_error="best_effort")
    original = JournalFile.write

    def half_then_eio(self: JournalFile, data: bytes) -> None:
        original(self, data[: len(data) // 2])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    def no_truncate(self: JournalFile, size: int) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(JournalFile, "write", half_then_eio)
    monkeypatch.setattr(JournalFile, "truncate", no_truncate)
    j.request_start("lost", 1.0)
    assert j.flush()
    monkeypatch.undo()
    j.request_start("kept", 2.0)
    assert j.close()
    result = recover(path)
    assert result.invalid_line_count == 1 and not result.torn_tail
    assert result.open_ids == ["kept"]
    assert j.write_errors == 2  # the write and the truncate
