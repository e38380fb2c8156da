"""Reading a journal back after the previous process: which requests it left open, whether it
stopped cleanly, and the ``request.end`` (outcome ``router_restart``) that closes each open one.

Recovery is tolerant by design: an unparseable line (a torn tail after a crash, or a fragment
left by a failed write) is skipped and reported, never fatal. It only reads; the journal
writes the closing ends (``Journal.close_recovered``, done by ``Journal.open``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from narwhal.journal.encoding import REQUEST_END, REQUEST_START, ROUTER_START, ROUTER_STOP
from narwhal.journal.file import journal_files

log = logging.getLogger("narwhal.journal")

OUTCOME_ROUTER_RESTART: Final = "router_restart"

# Recovery keeps this many malformed lines in detail (the count is always exact).
_INVALID_DETAIL_MAX: Final = 100


@dataclass(frozen=True)
class InvalidLine:
    """A line recovery skipped. ``torn`` means it is the unterminated last line of its file:
    the signature of a process killed mid-write, expected after a crash and harmless."""

    path: Path
    lineno: int
    reason: str
    torn: bool


@dataclass
class RecoveryResult:
    """What the journal files say about the previous process."""

    path: Path
    files: list[Path] = field(default_factory=list)
    records_read: int = 0
    #: The first skipped lines in detail; ``invalid_line_count`` is the exact total.
    invalid_lines: list[InvalidLine] = field(default_factory=list)
    invalid_line_count: int = 0
    #: Requests with a ``request.start`` and no ``request.end``: id -> its start record.
    open_requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``request.end`` records with no open start (start rotated away, dropped, or a repeat).
    unmatched_ends: int = 0
    #: The last ``router.start`` record (the previous process), if any.
    previous_start: dict[str, Any] | None = None
    #: True if the previous process wrote ``router.stop``, False if it did not (a crash),
    #: None if the journal holds no ``router.start`` at all.
    clean_shutdown: bool | None = None
    #: Whether the newest file ends in a torn (unterminated, unparseable) line: the previous
    #: process was killed mid-write.
    torn_tail: bool = False

    @property
    def open_ids(self) -> list[str]:
        return list(self.open_requests)

    @property
    def previous_pid(self) -> object:
        """The previous process's pid, from its ``router.start`` (None if there is none)."""
        return self.previous_start.get("pid") if self.previous_start else None

    def restart_end(self, request_id: str) -> dict[str, object]:
        """The journal's fields of the ``request.end`` that closes open request
        ``request_id`` (outcome ``router_restart``)."""
        start = self.open_requests[request_id]
        # What the router knew when it wrote the request's start; the fields every
        # request.end carries besides (docs/router.md), null where nothing says them: the
        # client's status is unknown (it may have had its answer, or a broken connection).
        return {
            "id": request_id,
            "outcome": OUTCOME_ROUTER_RESTART,
            "arrival": start.get("arrival"),
            "endpoint": start.get("endpoint"),
            "client_request_id": start.get("client_request_id"),
            "status": None,
            "error": "router restarted before the request ended",
            "previous_pid": self.previous_pid,
            "attempts": [],
        }

    def summary(self) -> dict[str, Any]:
        """A small JSON-able summary, written into the next ``router.start``."""
        return {
            "files": len(self.files),
            "records_read": self.records_read,
            "invalid_lines": self.invalid_line_count,
            "torn_tail": self.torn_tail,
            "closed_requests": len(self.open_requests),
            "unmatched_ends": self.unmatched_ends,
            "previous_pid": self.previous_pid,
            "previous_clean_shutdown": self.clean_shutdown,
        }


def recover(path: str | os.PathLike[str]) -> RecoveryResult:
    """Read the journal (rotated files oldest first) and find the requests left open.

    Tolerant by design: an unparseable line (a torn tail after a crash, or a fragment left by a
    failed write) is skipped and reported, never fatal. Reads only; closing the open requests
    is :meth:`Journal.close_recovered` (done by ``Journal.open(..., recover=True)``).
    Blocking file I/O: call it before the event loop starts or in a thread.
    """
    result = RecoveryResult(path=Path(path))
    result.files = journal_files(path)
    for file_path in result.files:
        result.torn_tail = _scan_file(file_path, result)
    return result


def log_recovery(result: RecoveryResult, closed: int) -> None:
    """Warn about what the previous process left, if it left anything: ``closed`` requests
    ended as ``router_restart``, unreadable lines, or no ``router.stop``."""
    if closed or result.invalid_line_count or result.clean_shutdown is False:
        log.warning(
            "journal %s: previous process %s; closed %d open request(s) as %s; "
            "%d unreadable line(s)%s",
            result.path,
            "stopped cleanly" if result.clean_shutdown else "did not stop cleanly",
            closed,
            OUTCOME_ROUTER_RESTART,
            result.invalid_line_count,
            " (torn tail)" if result.torn_tail else "",
        )


def _scan_file(file_path: Path, result: RecoveryResult) -> bool:
    """Apply one file's records to ``result``; returns whether its last line is torn."""
    torn = False
    with open(file_path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            terminated = raw.endswith(b"\n")
            torn = False
            if not raw.strip():
                continue
            reason = None
            obj: Any = None
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                reason = f"not JSON: {exc}"
            if reason is None and not (isinstance(obj, dict) and isinstance(obj.get("type"), str)):
                reason = "not a journal record (no string 'type')"
            if reason is not None:
                result.invalid_line_count += 1
                if len(result.invalid_lines) < _INVALID_DETAIL_MAX:
                    result.invalid_lines.append(
                        InvalidLine(file_path, lineno, reason, torn=not terminated)
                    )
                torn = not terminated
                continue
            result.records_read += 1
            _apply(obj, result)
    return torn


def _apply(record: dict[str, Any], result: RecoveryResult) -> None:
    kind = record["type"]
    if kind == REQUEST_START:
        request_id = record.get("id")
        if isinstance(request_id, str):
            result.open_requests[request_id] = record
    elif kind == REQUEST_END:
        request_id = record.get("id")
        if not isinstance(request_id, str) or result.open_requests.pop(request_id, None) is None:
            result.unmatched_ends += 1
    elif kind == ROUTER_START:
        result.previous_start = record
        result.clean_shutdown = False
    elif kind == ROUTER_STOP:
        result.clean_shutdown = True
