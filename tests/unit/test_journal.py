"""The request journal: records, exactly-one end, recovery, rotation, failures, backpressure.

Real files in ``tmp_path``; failures are injected by patching the journal's file object.
Nothing sleeps to wait: tests use ``flush()``/``close()`` or poll with a bound.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from narwhal import __version__
from narwhal import journal as journal_mod
from narwhal.journal import (
    OUTCOME_ROUTER_RESTART,
    Journal,
    journal_files,
    recover,
)

OpenJournal = Callable[..., Journal]


class FakeWallClock:
    """Wall-clock seconds that tick by 1 on every read, so each record's ``ts`` is known."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


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
    original = journal_mod._JournalFile.write

    def slow_write(self: journal_mod._JournalFile, data: bytes) -> None:
        entered.set()
        gate.wait(10)
        original(self, data)

    monkeypatch.setattr(journal_mod._JournalFile, "write", slow_write)
    yield gate, entered
    gate.set()


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


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


# ------------------------------------------------------------------------------ records


def test_records_round_trip_one_json_object_per_line(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    path = tmp_path / "state" / "journal" / "router.jsonl"
    clock = FakeWallClock()
    j = open_journal(path, wall_clock=clock)
    assert j.router_start(fleet_sha256="f" * 64, profile_sha256="p" * 64, listen="127.0.0.1:8000")
    assert j.request_start("r1", 12.5, model="kimi", stream=True)
    assert j.role_flip(engine="e1", old="prefill", new="decode", generation=3)
    assert j.request_end(
        "r1",
        "ok",
        status=200,
        prompt_tokens=333,
        completion_tokens=16,
        prefill_engine="e0",
        decode_engine="e1",
        role_generation=3,
        t_prefill_start=12.6,
        t_first_token=12.9,
        error=None,
        attempts=1,
    )
    assert j.record("custom.event", detail={"nested": [1, 2]})
    assert j.router_stop(reason="sigterm")
    assert j.close()

    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # every record ends its line
    recs = [orjson.loads(line) for line in lines[:-1]]
    assert [r["type"] for r in recs] == [
        "router.start",
        "request.start",
        "role.flip",
        "request.end",
        "custom.event",
        "router.stop",
    ]
    # ts from the injected clock, one tick per record, in file order
    assert [r["ts"] for r in recs] == [1_700_000_001.0 + i for i in range(6)]
    start, req, flip, end, custom, stop = recs
    assert start["pid"] == os.getpid()
    assert start["version"] == __version__
    assert start["fleet_sha256"] == "f" * 64
    assert start["profile_sha256"] == "p" * 64
    assert start["journal"] == str(path)
    assert start["listen"] == "127.0.0.1:8000"
    assert "recovery" in start  # Journal.open recovers by default: the summary is recorded
    assert req == {
        "type": "request.start",
        "ts": 1_700_000_002.0,
        "id": "r1",
        "arrival": 12.5,
        "model": "kimi",
        "stream": True,
    }
    assert flip["engine"] == "e1" and flip["new"] == "decode"
    assert end["id"] == "r1" and end["outcome"] == "ok" and end["status"] == 200
    assert end["arrival"] == 12.5  # filled in from the start
    assert end["prompt_tokens"] == 333 and end["decode_engine"] == "e1"
    assert end["error"] is None and end["attempts"] == 1
    assert custom["detail"] == {"nested": [1, 2]}
    assert stop["reason"] == "sigterm" and stop["open_requests"] == 0

    assert j.records_written == 6 and j.dropped == 0 and j.write_errors == 0
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700


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


def test_extra_fields_of_any_type_are_written(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    j.record("x", where=Path("/a/b"), tags={"b"}, pair=(1, 2), big=2**70, ok=1.5)
    j.close()
    (rec,) = records(path)
    assert rec["where"] == "/a/b"
    assert rec["tags"] == ["b"]
    assert rec["pair"] == [1, 2]
    assert rec["big"] == repr(2**70)  # orjson refuses it: the repr keeps the record
    assert rec["unserializable"] == ["big"]
    assert rec["ok"] == 1.5


def test_reserved_keys_and_request_types_are_refused(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    j = open_journal(tmp_path / "j.jsonl", recover=False)
    with pytest.raises(ValueError, match="reserved"):
        j.record("x", ts=1.0)
    with pytest.raises(ValueError, match="reserved"):
        j.request_start("r1", 1.0, id="other")
    with pytest.raises(ValueError, match="request_start"):
        j.record("request.end", id="r1")
    with pytest.raises(ValueError, match="request_start"):
        j.submit("request.start", {"id": "r1"})
    with pytest.raises(TypeError):
        j.request_start(17, 1.0)  # type: ignore[arg-type]
    assert j.open_requests() == []


def test_secret_fields_are_never_written(
    tmp_path: Path, open_journal: OpenJournal, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    with caplog.at_level(logging.WARNING, logger="narwhal.journal"):
        j.request_start("r1", 1.0, prompt="SECRET-PROMPT", model="m")
        j.request_end(
            "r1",
            "ok",
            messages=[{"role": "user", "content": "SECRET-MESSAGE"}],
            headers={"Authorization": "Bearer SECRET-TOKEN", "X-Api-Key": "SECRET-KEY"},
            body={"text": "SECRET-TEXT", "max_tokens": 5, "Api-Key": "SECRET-KEY2"},
            choices=[{"content": "SECRET-CONTENT", "index": 0}],
        )
        j.request_start("r2", 2.0, prompt="SECRET-AGAIN")
    j.close()
    raw = path.read_bytes()
    assert b"SECRET" not in raw
    start1, end, start2 = records(path)
    assert start1["model"] == "m" and "prompt" not in start1
    assert end["headers"] == {}
    assert end["body"] == {"max_tokens": 5}
    assert end["choices"] == [{"index": 0}]
    assert "messages" not in end and "prompt" not in start2
    warned = [r.getMessage() for r in caplog.records if "dropped field" in r.getMessage()]
    # once per key name, not once per record
    assert sum("'prompt'" in m for m in warned) == 1
    assert any("'Authorization'" in m for m in warned)
    assert j.stats().secret_fields_dropped >= 7


# ------------------------------------------------------------------------------ exactly one end


def test_exactly_one_end_per_request(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    assert j.request_start("a", 1.0)
    assert j.request_start("b", 2.0)
    assert not j.request_start("a", 3.0)  # already open: refused, nothing written
    assert j.open_requests() == ["a", "b"]
    assert j.request_end("a", "ok")
    assert not j.request_end("a", "ok")  # double end
    assert not j.request_end("never-started", "ok")
    assert j.open_requests() == ["b"]
    assert j.request_end("b", "error", error="boom")
    assert j.open_requests() == []
    assert j.request_start("a", 4.0)  # an id may be reused once its request has ended
    j.close()
    recs = records(path)
    assert [(r["type"], r["id"]) for r in recs] == [
        ("request.start", "a"),
        ("request.start", "b"),
        ("request.end", "a"),
        ("request.end", "b"),
        ("request.start", "a"),
    ]
    stats = j.stats()
    assert stats.unmatched_ends == 2 and stats.duplicate_starts == 1


def test_concurrent_ends_write_exactly_one(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    ids = [f"r{i}" for i in range(2000)]
    for i, request_id in enumerate(ids):
        assert j.request_start(request_id, float(i))
    wins: list[int] = []

    def ender() -> None:
        wins.append(sum(j.request_end(request_id, "ok") for request_id in ids))

    threads = [threading.Thread(target=ender) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(wins) == len(ids)
    assert j.open_requests() == []
    assert j.close()
    assert set(ends_per_id(path).values()) == {1}
    assert len(ends_per_id(path)) == len(ids)


# ------------------------------------------------------------------------------ recovery


def test_recover_missing_journal(tmp_path: Path) -> None:
    result = recover(tmp_path / "none.jsonl")
    assert result.files == [] and result.records_read == 0
    assert result.open_requests == {} and result.clean_shutdown is None
    assert not result.torn_tail


def test_recovery_closes_each_open_request_once(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    first = Journal.open(path)
    first.router_start(fleet_sha256="f" * 64)
    for i, request_id in enumerate(["a", "b", "c"]):
        first.request_start(request_id, 100.0 + i)
    first.request_end("b", "ok")
    # A crash: no router.stop, and the process died in the middle of the next record.
    assert first.close()
    with open(path, "ab") as f:
        f.write(b'{"type":"request.start","ts":1.0,"id":"d","arri')

    second = open_journal(path)
    result = second.recovery
    assert result is not None
    assert result.open_ids == ["a", "c"]
    assert result.open_requests["a"]["arrival"] == 100.0
    assert result.records_read == 5
    assert result.torn_tail and result.invalid_line_count == 1
    assert result.invalid_lines[0].torn and result.invalid_lines[0].lineno == 6
    assert result.clean_shutdown is False
    assert result.previous_start is not None and result.previous_start["pid"] == os.getpid()
    assert second.open_requests() == []  # recovered ids are closed, not adopted
    second.router_start(fleet_sha256="f" * 64)
    second.router_stop()
    assert second.close()

    lines = path.read_bytes().splitlines()
    assert lines[5].startswith(b'{"type":"request.start","ts":1.0,"id":"d"')
    recs = [orjson.loads(line) for i, line in enumerate(lines) if i != 5]
    restart_ends = [r for r in recs if r.get("outcome") == OUTCOME_ROUTER_RESTART]
    assert [(r["id"], r["arrival"]) for r in restart_ends] == [("a", 100.0), ("c", 102.0)]
    assert all(r["previous_pid"] == os.getpid() for r in restart_ends)
    # the closing ends come before the new process's router.start, which records the recovery
    types = [r["type"] for r in recs]
    new_start = types.index("router.start", 1)
    assert types[new_start - 2 : new_start] == ["request.end", "request.end"]
    summary = recs[new_start]["recovery"]
    assert summary["closed_requests"] == 2 and summary["torn_tail"] is True
    assert summary["previous_clean_shutdown"] is False
    assert ends_per_id_lines(recs) == {"a": 1, "b": 1, "c": 1}

    # Recovering again finds nothing open and writes nothing.
    size = path.stat().st_size
    third = open_journal(path)
    assert third.recovery is not None
    assert third.recovery.open_requests == {}
    assert third.recovery.clean_shutdown is True
    assert not third.recovery.torn_tail  # the fragment is no longer the last line
    assert third.recovery.invalid_line_count == 1
    assert third.close()
    assert path.stat().st_size == size


def ends_per_id_lines(recs: list[dict[str, Any]]) -> dict[str, int]:
    return dict(Counter(r["id"] for r in recs if r["type"] == "request.end"))


def test_close_recovered_twice_does_not_double_close(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    path = tmp_path / "j.jsonl"
    first = open_journal(path, recover=False)
    first.request_start("a", 1.0)
    first.request_start("b", 2.0)
    first.close()
    result = recover(path)
    second = open_journal(path, recover=False)
    assert second.close_recovered(result) == 2
    assert second.close_recovered(result) == 0
    assert second.close_recovered(recover(path)) == 0  # ends may still be queued
    second.close()
    assert ends_per_id(path) == {"a": 1, "b": 1}
    assert recover(path).open_requests == {}


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


def test_recovery_skips_garbage_lines(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_bytes(
        b'{"type":"request.start","id":"a","arrival":1}\n'
        b"not json\n"
        b"[1, 2]\n"
        b"\n"
        b'{"type":"request.end","id":["odd"]}\n'
        b'{"type":"request.end","id":"zzz"}\n'
    )
    result = recover(path)
    assert result.records_read == 3
    assert result.invalid_line_count == 2
    assert [line.lineno for line in result.invalid_lines] == [2, 3]
    assert not any(line.torn for line in result.invalid_lines)
    assert result.open_ids == ["a"]
    assert result.unmatched_ends == 2


# ------------------------------------------------------------------------------ rotation


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


def test_recovery_spans_rotated_files(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    first = open_journal(path, max_bytes=1000, backups=3, recover=False)
    first.request_start("old", 1.0)
    first.request_start("ended", 2.0)
    seq = 0
    while first.stats().rotations < 1:
        first.record("filler", seq=seq, pad="x" * 40)
        assert first.flush()
        seq += 1
    first.request_end("ended", "ok")
    first.close()
    assert b'"id":"old"' in (tmp_path / "j.jsonl.1").read_bytes()
    assert b'"id":"old"' not in path.read_bytes()

    second = open_journal(path, max_bytes=1000, backups=3)
    assert second.recovery is not None
    assert second.recovery.open_ids == ["old"]
    assert [f.name for f in second.recovery.files] == ["j.jsonl.1", "j.jsonl"]
    second.close()
    assert ends_per_id(path) == {"old": 1, "ended": 1}
    assert [r["outcome"] for r in records(path) if r["type"] == "request.end"][-1] == (
        OUTCOME_ROUTER_RESTART
    )


# ------------------------------------------------------------------------------ write failures


def _enospc(self: journal_mod._JournalFile, data: bytes) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_write_failure_fail_closed(
    tmp_path: Path, open_journal: OpenJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    assert j.healthy and j.accepting
    monkeypatch.setattr(journal_mod._JournalFile, "write", _enospc)
    assert j.request_start("r1", 1.0)  # queued: the failure is not known yet
    assert j.flush()
    assert not j.healthy
    assert not j.accepting
    assert j.write_errors >= 1
    assert j.records_written == 0  # never pretends it wrote
    assert j.dropped == 1
    assert j.last_error is not None and "No space left" in j.last_error
    assert not j.request_start("r2", 2.0)  # refuse new requests
    assert j.open_requests() == ["r1"]
    assert j.request_end("r1", "ok")  # the admitted request is still closed exactly once
    assert not j.request_end("r1", "ok")
    assert j.flush()
    assert j.records_written == 0 and j.dropped == 3
    assert path.read_bytes() == b""

    monkeypatch.undo()  # the disk has room again: still failed closed (sticky), still writes
    assert j.record("after", n=1)
    assert j.flush()
    assert j.records_written == 1 and not j.healthy and not j.accepting
    assert j.close()
    assert [r["type"] for r in records(path)] == ["after"]


def test_write_failure_best_effort(
    tmp_path: Path, open_journal: OpenJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False, on_error="best_effort")
    monkeypatch.setattr(journal_mod._JournalFile, "write", _enospc)
    for i in range(10):
        assert j.request_start(f"r{i}", float(i))
    assert j.flush()
    assert not j.healthy
    assert j.accepting  # keeps serving
    assert j.request_start("r10", 10.0)
    for i in range(11):
        assert j.request_end(f"r{i}", "ok")
    assert j.flush()
    stats = j.stats()
    assert stats.records_written == 0
    assert stats.dropped == 22
    assert stats.write_errors >= 1
    assert path.read_bytes() == b""
    monkeypatch.undo()
    assert j.request_start("r11", 11.0)
    assert j.close()
    assert j.records_written == 1 and [r["id"] for r in records(path)] == ["r11"]


def test_partial_write_is_truncated_away(
    tmp_path: Path, open_journal: OpenJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    j.request_start("a", 1.0)
    assert j.flush()
    before = path.read_bytes()
    original = journal_mod._JournalFile.write

    def half_then_eio(self: journal_mod._JournalFile, data: bytes) -> None:
        original(self, data[: len(data) // 2])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(journal_mod._JournalFile, "write", half_then_eio)
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
    original = journal_mod._JournalFile.write

    def half_then_eio(self: journal_mod._JournalFile, data: bytes) -> None:
        original(self, data[: len(data) // 2])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    def no_truncate(self: journal_mod._JournalFile, size: int) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(journal_mod._JournalFile, "write", half_then_eio)
    monkeypatch.setattr(journal_mod._JournalFile, "truncate", no_truncate)
    j.request_start("lost", 1.0)
    assert j.flush()
    monkeypatch.undo()
    j.request_start("kept", 2.0)
    assert j.close()
    result = recover(path)
    assert result.invalid_line_count == 1 and not result.torn_tail
    assert result.open_ids == ["kept"]
    assert j.write_errors == 2  # the write and the truncate


# ------------------------------------------------------------------------------ backpressure


def test_backpressure_fail_closed_never_blocks_and_keeps_room_for_ends(
    tmp_path: Path,
    open_journal: OpenJournal,
    blocked_writes: tuple[threading.Event, threading.Event],
) -> None:
    gate, entered = blocked_writes
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False, max_queue=4)
    durations: list[float] = []

    def timed(call: Callable[[], bool]) -> bool:
        t0 = time.perf_counter()
        result = call()
        durations.append(time.perf_counter() - t0)
        return result

    try:
        assert timed(lambda: j.request_start("a", 1.0))
        assert entered.wait(5)  # the writer is stuck inside write()
        assert timed(lambda: j.request_start("b", 2.0))
        # 2 queued + 2 ends reserved = 4: no room for another request
        assert not j.accepting
        assert not timed(lambda: j.request_start("c", 3.0))
        refused = [timed(lambda i=i: j.request_start(f"x{i}", 0.0)) for i in range(1000)]
        assert not any(refused)
        assert not timed(lambda: j.record("role.flip", engine="e1"))
        # the ends of admitted requests always fit
        assert timed(lambda: j.request_end("a", "ok"))
        assert timed(lambda: j.request_end("b", "ok"))
        assert j.backlog == 4
        assert j.dropped == 1002
        # The writer is gated until the finally: a submit that blocked would never return.
        # The bound only keeps a regression from hanging the suite (no absolute timing).
        assert max(durations) < 2.0, max(durations)
    finally:
        gate.set()
    assert j.close()
    assert [(r["type"], r["id"]) for r in records(path)] == [
        ("request.start", "a"),
        ("request.start", "b"),
        ("request.end", "a"),
        ("request.end", "b"),
    ]
    assert j.records_written == 4 and j.healthy


def test_backpressure_best_effort_drops_and_counts(
    tmp_path: Path,
    open_journal: OpenJournal,
    blocked_writes: tuple[threading.Event, threading.Event],
) -> None:
    gate, entered = blocked_writes
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False, max_queue=3, on_error="best_effort")
    durations: list[float] = []
    try:
        for i in range(500):
            t0 = time.perf_counter()
            assert j.request_start(f"r{i}", float(i))  # always admitted
            assert j.request_end(f"r{i}", "ok")
            durations.append(time.perf_counter() - t0)
            if i == 0:
                assert entered.wait(5)
        assert j.accepting
        assert j.backlog == 3
        assert j.dropped == 1000 - 3
        # The writer is gated until the finally: a submit that blocked would never return.
        # The bound only keeps a regression from hanging the suite (no absolute timing).
        assert max(durations) < 2.0, max(durations)
    finally:
        gate.set()
    assert j.close()
    assert j.records_written == 3
    assert j.records_written + j.dropped == 1000
    assert len(records(path)) == 3


def test_close_gives_up_on_a_stuck_disk(
    tmp_path: Path,
    open_journal: OpenJournal,
    blocked_writes: tuple[threading.Event, threading.Event],
) -> None:
    gate, entered = blocked_writes
    j = open_journal(tmp_path / "j.jsonl", recover=False)
    j.record("x")
    assert entered.wait(5)
    t0 = time.monotonic()
    assert not j.flush(timeout=0.05)
    assert not j.close(timeout=0.05)
    assert time.monotonic() - t0 < 2
    gate.set()
    assert j.close(timeout=5)
    assert j.records_written == 1


# ------------------------------------------------------------------------------ hooks, fsync, close


def test_on_write_hook_gets_latency_and_backlog(tmp_path: Path, open_journal: OpenJournal) -> None:
    calls: list[tuple[float, int]] = []
    j = open_journal(
        tmp_path / "j.jsonl", recover=False, on_write=lambda s, b: calls.append((s, b))
    )
    for i in range(50):
        j.request_start(f"r{i}", float(i))
    assert j.close()
    assert len(calls) == 50 == j.records_written
    assert all(latency >= 0 and backlog >= 0 for latency, backlog in calls)
    assert calls[-1][1] == 0


def test_a_failing_hook_does_not_stop_the_writer(tmp_path: Path, open_journal: OpenJournal) -> None:
    def hook(latency_s: float, backlog: int) -> None:
        raise RuntimeError("metrics are broken")

    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False, on_write=hook)
    for i in range(5):
        j.record("x", i=i)
    assert j.close()
    assert j.healthy and len(records(path)) == 5


def test_fsync_on_interval_on_request_and_at_close(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    j = open_journal(tmp_path / "j.jsonl", recover=False, fsync_interval_s=3600)
    j.record("x")
    assert j.flush()
    assert j.stats().fsyncs == 0
    assert j.flush(fsync=True)
    assert j.stats().fsyncs == 1
    assert j.flush(fsync=True)  # nothing new: no needless fsync
    assert j.stats().fsyncs == 1
    j.record("y")
    assert j.close()
    assert j.stats().fsyncs == 2  # at close

    k = open_journal(tmp_path / "k.jsonl", recover=False, fsync_interval_s=0.02)
    k.record("x")
    assert wait_for(lambda: k.stats().fsyncs >= 1)  # nobody asked: the interval did it


def test_close_is_idempotent_and_refuses_later_records(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    j.request_start("a", 1.0)
    assert j.close()
    assert j.close()
    assert j.closed and not j.accepting
    assert not j.request_start("b", 2.0)
    assert not j.record("x")
    assert j.request_end("a", "ok")  # closed in memory, record dropped and counted
    assert j.dropped == 3
    assert [r["id"] for r in records(path)] == ["a"]
    assert j.flush()


def test_invalid_configuration(tmp_path: Path) -> None:
    for kwargs in (
        {"on_error": "ignore"},
        {"backups": 0},
        {"max_queue": 1},
        {"max_bytes": -1},
        {"fsync_interval_s": -1.0},
    ):
        with pytest.raises(ValueError):
            Journal.open(tmp_path / "j.jsonl", **kwargs)


async def test_usable_from_the_event_loop(tmp_path: Path) -> None:
    """The router's pattern: record on the loop, flush and close in a thread."""
    path = tmp_path / "j.jsonl"
    j = await asyncio.to_thread(Journal.open, path)
    j.router_start()
    assert j.request_start("r1", 1.0)
    await asyncio.sleep(0)
    assert j.request_end("r1", "ok")
    j.router_stop()
    assert await asyncio.to_thread(j.flush)
    assert await asyncio.to_thread(j.close)
    assert [r["type"] for r in records(path)] == [
        "router.start",
        "request.start",
        "request.end",
        "router.stop",
    ]
