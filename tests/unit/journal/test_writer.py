"""The writer: write failures under both policies, backpressure, a stuck disk, the on_write
hook, fsync."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from narwhal.journal.file import JournalFile
from narwhal.testing.procs import wait_until
from tests.unit.journal.support import OpenJournal, records


def _enospc(self: JournalFile, data: bytes) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_write_failure_fail_closed(
    tmp_path: Path, open_journal: OpenJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    assert j.healthy and j.accepting
    monkeypatch.setattr(JournalFile, "write", _enospc)
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
    monkeypatch.setattr(JournalFile, "write", _enospc)
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
    # Nobody asked: the interval did it.
    assert wait_until(lambda: k.stats().fsyncs >= 1, 5.0, 0.005)
