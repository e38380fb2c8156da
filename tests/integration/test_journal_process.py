"""The journal against real processes: a router killed mid-stream, a real full file, and a
process that exits without closing its journal.

A child Python process writes the journal; the parent kills it (SIGKILL, no chance to clean
up), limits its file size (RLIMIT_FSIZE, a real EFBIG from the kernel) or lets it exit with
records still queued, then checks the file and what recovery makes of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from narwhal.journal import OUTCOME_ROUTER_RESTART, Journal, journal_files, recover
from narwhal.testing import procs

KILL_CHILD = r"""
import sys, time
from narwhal.journal import Journal

path, limit = sys.argv[1], int(sys.argv[2])
j = Journal.open(path, max_bytes=64 * 1024, backups=50, fsync_interval_s=0.05)
j.router_start(fleet_sha256="f" * 64)
print("ready", flush=True)
for i in range(limit):  # bounded, but the parent kills it long before
    rid = f"r{i}"
    if j.request_start(rid, time.time(), model="m") and i % 2 == 0:
        j.request_end(rid, "ok", status=200, completion_tokens=i)
j.close()
print("finished", flush=True)
"""

FSIZE_CHILD = r"""
import json, resource, signal, sys
from narwhal.journal import Journal

path, policy, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
j = Journal.open(path, on_error=policy, max_bytes=0)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
admitted = refused = 0
for i in range(2000):
    if j.request_start(f"r{i}", float(i), model="m", pad="x" * 30):
        admitted += 1
        j.request_end(f"r{i}", "ok", status=200)
    else:
        refused += 1
    if i % 64 == 0:
        j.flush(10)  # let the writer meet the limit while requests keep coming
j.flush(10)
s = j.stats()
closed = j.close(10)
print(json.dumps({
    "admitted": admitted, "refused": refused, "closed": closed,
    "healthy": s.healthy, "accepting": s.accepting, "last_error": s.last_error,
    "records_written": s.records_written, "write_errors": s.write_errors,
    "dropped": s.dropped,
}))
"""


EXIT_CHILD = r"""
import sys, time
from narwhal.journal import Journal
from narwhal.journal.file import JournalFile

path, how = sys.argv[1], sys.argv[2]
write, fsync = JournalFile.write, JournalFile.fsync

def slow_write(self, data):
    time.sleep(0.05)  # a slow disk: the writer is still busy when the main thread ends
    write(self, data)

def loud_fsync(self):
    print("fsync", flush=True)
    fsync(self)

JournalFile.write, JournalFile.fsync = slow_write, loud_fsync
j = Journal.open(path, fsync_interval_s=3600)
j.router_start()
for i in range(100):
    j.request_start(f"r{i}", float(i))
    j.request_end(f"r{i}", "ok")
print("submitted", flush=True)
if how == "raise":
    raise RuntimeError("the owner dies without closing its journal")
"""

ATEXIT_CHILD = r"""
import atexit, json, sys

hooks = []
register = atexit.register

def recording_register(func, *args, **kwargs):
    hooks.append(getattr(func, "__module__", None) or "")
    return register(func, *args, **kwargs)

atexit.register = recording_register
from narwhal.journal import Journal

at_import = [m for m in hooks if m.startswith("narwhal")]
journal = Journal.open(sys.argv[1])
at_open = [m for m in hooks if m.startswith("narwhal")]
journal.close()
print(json.dumps({"at_import": at_import, "at_open": at_open}))
"""


def parse_lines(path: Path) -> tuple[list[dict[str, Any]], list[tuple[Path, int, bytes]]]:
    """All records of the journal files, oldest first, and the lines that do not parse."""
    recs: list[dict[str, Any]] = []
    bad: list[tuple[Path, int, bytes]] = []
    for f in journal_files(path):
        for i, line in enumerate(f.read_bytes().split(b"\n")):
            if not line:
                continue
            try:
                recs.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                bad.append((f, i, line))
    return recs, bad


def journal_size(path: Path) -> int:
    """Bytes in the journal's files; the child may rotate them while we look."""
    total = 0
    for f in journal_files(path):
        with contextlib.suppress(FileNotFoundError):
            total += f.stat().st_size
    return total


def test_sigkill_mid_stream_then_recovery_closes_each_open_request_once(tmp_path: Path) -> None:
    path = tmp_path / "journal" / "router.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, str(path), "5000000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while journal_size(path) < 300 * 1024:
            assert time.monotonic() < deadline, "the child wrote too little"
            assert child.poll() is None, "the child stopped before it was killed"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        procs.kill(child)
        if child.stdout is not None:
            child.stdout.close()

    files = journal_files(path)
    assert len(files) >= 4  # it rotated while writing
    recs, bad = parse_lines(path)
    # Every line is a valid record, except at most one torn line at the very end.
    assert len(bad) <= 1, bad
    if bad:
        torn_file, _, torn = bad[0]
        assert torn_file == files[-1] and not files[-1].read_bytes().endswith(b"\n")
        assert files[-1].read_bytes().endswith(torn)
    started = [r["id"] for r in recs if r["type"] == "request.start"]
    ended = Counter(r["id"] for r in recs if r["type"] == "request.end")
    assert len(started) > 1000 and max(ended.values()) == 1
    left_open = [i for i in started if i not in ended]
    # The file is a prefix of what was submitted (start, end, start, start, end, ...): only
    # odd ids are left open, plus the last even one if the kill fell between its two records.
    assert left_open
    assert all(int(i[1:]) % 2 == 1 or i == started[-1] for i in left_open)

    result = recover(path)
    assert result.open_ids == left_open
    assert result.clean_shutdown is False
    assert result.torn_tail == bool(bad)
    assert result.invalid_line_count == len(bad)

    journal = Journal.open(path, max_bytes=64 * 1024, backups=50)
    journal.router_start(fleet_sha256="f" * 64)
    journal.router_stop()
    assert journal.close()

    recs, bad_after = parse_lines(path)
    assert len(bad_after) == len(bad)  # the torn line stays, on a line of its own
    ends = Counter(r["id"] for r in recs if r["type"] == "request.end")
    assert set(ends) == set(started) and set(ends.values()) == {1}
    restarted = [r["id"] for r in recs if r.get("outcome") == OUTCOME_ROUTER_RESTART]
    assert restarted == left_open
    again = recover(path)
    assert again.open_requests == {} and again.clean_shutdown is True


@pytest.mark.parametrize("policy", ["fail_closed", "best_effort"])
def test_real_file_size_limit(tmp_path: Path, policy: str) -> None:
    """A real write error (EFBIG from RLIMIT_FSIZE, with partial writes at the limit)."""
    path = tmp_path / "j.jsonl"
    limit = 20_000
    out = subprocess.run(
        [sys.executable, "-c", FSIZE_CHILD, str(path), policy, str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    stats = json.loads(out.stdout)
    assert stats["closed"]
    assert not stats["healthy"]
    assert stats["write_errors"] >= 1
    assert "File too large" in stats["last_error"]
    assert stats["dropped"] >= 1
    if policy == "fail_closed":
        assert not stats["accepting"]
        assert stats["refused"] > 0  # new requests refused once the journal failed
    else:
        assert stats["accepting"]
        assert stats["refused"] == 0 and stats["admitted"] == 2000

    # What the journal says it wrote is exactly what is in the file, with no fragment.
    data = path.read_bytes()
    assert len(data) <= limit
    assert data.endswith(b"\n")
    lines = data.splitlines()
    assert len(lines) == stats["records_written"]
    for line in lines:
        orjson.loads(line)

    # The next process repairs "exactly one end" for the ends that could not be written.
    journal = Journal.open(path)
    assert journal.close()
    ends = Counter(r["id"] for r in parse_lines(path)[0] if r["type"] == "request.end")
    starts = {r["id"] for r in parse_lines(path)[0] if r["type"] == "request.start"}
    assert starts <= set(ends) and set(ends.values()) == {1}


@pytest.mark.parametrize("how", ["return", "raise"])
def test_exit_without_close_writes_and_fsyncs_what_was_queued(tmp_path: Path, how: str) -> None:
    """The writer is a daemon thread, which the interpreter stops wherever it is at exit: a
    process that never closes its journal (here on a slow disk) must still get every queued
    record into the file, fsynced."""
    path = tmp_path / "j.jsonl"
    out = subprocess.run(
        [sys.executable, "-c", EXIT_CHILD, str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == (1 if how == "raise" else 0), out.stderr
    assert out.stdout.split() == ["submitted", "fsync"]  # one fsync: at the exit-time close
    recs, bad = parse_lines(path)
    assert not bad
    assert [r["type"] for r in recs] == ["router.start"] + ["request.start", "request.end"] * 100
    assert recover(path).open_requests == {}


def test_importing_the_journal_registers_no_exit_hook(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", ATEXIT_CHILD, str(tmp_path / "j.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout) == {
        "at_import": [],
        "at_open": ["narwhal.journal.at_exit"],  # the recorder does see the journal's hook
    }
