"""One writer per journal, and only a journal written to.

A journal has one writer: two processes appending to one file interleave their records, and
the second one's recovery closes the first one's live requests as ``router_restart`` (a
request then has two terminal records). ``claim_journal`` takes an exclusive ``flock`` on
``<journal>.lock`` (a file beside it: rotation renames the journal, never the lock), held
until the process exits or the returned file is closed, and writes the holder's pid into it
for the next claimant's error. ``journal_problem`` refuses a file that is not a journal (a
mistyped ``--journal fleet.json`` would otherwise be appended to, its mode changed, and its
lines counted as a torn tail).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import BinaryIO

import orjson

from narwhal.journal.encoding import could_begin_record
from narwhal.journal.file import FILE_MODE, make_private_dirs

__all__ = ["JournalInUse", "claim_journal", "journal_problem"]

# How much of a file's first line is read to tell a journal from something else.
_FIRST_LINE_BYTES = 1 << 16


class JournalInUse(Exception):
    """Another live process holds the journal; ``holder`` is its pid as it wrote it."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"in use by process {holder}")
        self.holder = holder


def claim_journal(path: Path) -> BinaryIO:
    """Claim ``path`` for this process (creating its directory, 0700, and its lock file,
    0600): the open lock file, to keep while writing. Raises ``JournalInUse`` when another
    process holds it, ``OSError`` when the directory or the lock cannot be written, or the
    journal itself cannot be opened for appending."""
    make_private_dirs(path.parent)
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    lock = os.fdopen(fd, "r+b")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock.read(32).decode("ascii", "replace").strip() or "unknown"
            raise JournalInUse(holder) from None
        # Writable as the writer thread will open it (and created now if it is new).
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, FILE_MODE))
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n".encode())
        lock.flush()
    except BaseException:
        lock.close()
        raise
    return lock


def journal_problem(path: Path) -> str | None:
    """Why ``path`` is not a journal to append to, or None: empty, missing, or its first line
    a record (a JSON object with ``type`` and ``ts``). A first line without its newline that
    begins as a record does is a record torn by a crash (the router's very first), which
    recovery reports and ends; one that does not (a fleet file or a profile store, written
    without a final newline) is no journal."""
    try:
        with open(path, "rb") as f:
            head = f.read(_FIRST_LINE_BYTES)
    except FileNotFoundError:
        return None
    line, newline, rest = head.partition(b"\n")
    if not newline:
        if len(head) >= _FIRST_LINE_BYTES:
            return "its first line is not a record"
        if not could_begin_record(head):
            return "its only line, without a newline, does not begin as a journal record does"
        return None
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        if could_begin_record(line) and _is_record(rest.partition(b"\n")[0]):
            # A first record torn by a crash, which the next router's recovery ended with a
            # newline before writing its own: the journal it has been since (a JSON document
            # whose first line is "{" is followed by no record).
            return None
        return "its first line is not JSON"
    if not _is_record(record):
        return "its first line is not a journal record (a JSON object with type and ts)"
    return None


def _is_record(line: bytes | object) -> bool:
    """Whether ``line`` (bytes to parse, or what was parsed) is a journal record: a JSON
    object with ``type`` and ``ts``."""
    if isinstance(line, bytes):
        try:
            line = orjson.loads(line)
        except orjson.JSONDecodeError:
            return False
    return (
        isinstance(line, dict)
        and isinstance(line.get("type"), str)
        and isinstance(line.get("ts"), int | float)
    )
