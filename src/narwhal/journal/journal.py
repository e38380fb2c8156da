"""The ``Journal`` callers use: the record methods, the set of open requests behind "exactly one
``request.end`` per request", and opening with recovery of what a previous process left open.

Wall-clock ``ts`` values come from an injected clock (for people and for tests); intervals and
latencies use a monotonic clock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from narwhal import __version__
from narwhal.journal.at_exit import close_at_exit, forget_at_exit
from narwhal.journal.encoding import (
    END_RESERVED,
    REQUEST_END,
    REQUEST_RESERVED,
    REQUEST_START,
    RESERVED,
    ROLE_FLIP,
    ROUTER_START,
    ROUTER_STOP,
    RecordEncoder,
)
from narwhal.journal.file import make_files_private, make_private_dirs
from narwhal.journal.recovery import RecoveryResult, log_recovery
from narwhal.journal.recovery import recover as _recover
from narwhal.journal.writer import (
    DEFAULT_BACKUPS,
    DEFAULT_FSYNC_INTERVAL_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_QUEUE,
    JournalWriter,
    OnError,
    WriteHook,
)

log = logging.getLogger("narwhal.journal")


@dataclass(frozen=True)
class JournalStats:
    """A consistent snapshot of the journal's counters (for metrics and health endpoints)."""

    records_written: int
    #: Records that will never reach the file: refused or dropped by ``submit`` (queue full,
    #: journal closed or failed closed) or lost to a failed write.
    dropped: int
    #: Failed I/O operations (write, fsync, rotation, reopen); one failed write may lose several
    #: records (counted in ``dropped``).
    write_errors: int
    backlog: int
    open_requests: int
    healthy: bool
    accepting: bool
    last_error: str | None
    rotations: int
    fsyncs: int
    secret_fields_dropped: int
    unmatched_ends: int
    duplicate_starts: int


class Journal:
    """The durable JSONL journal of one router process.

    Thread-safe; every recording method is non-blocking and may be called from the event
    loop. ``flush`` and ``close`` block (call them via ``asyncio.to_thread`` from async code).
    Build it with :meth:`Journal.open`. One left open is closed at interpreter exit
    (``narwhal.journal.at_exit``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        fsync_interval_s: float = DEFAULT_FSYNC_INTERVAL_S,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_error: OnError = "fail_closed",
        on_write: WriteHook | None = None,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        stamp: Mapping[str, Any] | None = None,
    ) -> None:
        """Open (creating, mode 0600) the journal file and start the writer thread.

        ``max_bytes`` 0 disables rotation. ``on_write(latency_s, backlog)`` is called from the
        writer thread after each record reaches the file, with the time from submission to
        written and the records still waiting; it must be quick and thread-safe (a Prometheus
        histogram and gauge are). Raises ``OSError`` if the file cannot be opened.
        """
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.fsync_interval_s = fsync_interval_s
        self.max_queue = max_queue
        self.on_error: OnError = on_error
        self.recovery: RecoveryResult | None = None
        self.recovered_closed = 0  # requests the recovery closed here as router_restart
        # Guarded by the writer's lock, so a request's state and its record change together:
        self._encoder = RecordEncoder(wall_clock, stamp)
        self._open: dict[str, Any] = {}  # request id -> arrival
        self._recovered_ids: set[str] = set()
        self._unmatched_ends = 0
        self._duplicate_starts = 0
        self._warned: set[str] = set()

        self._writer = JournalWriter(
            self.path,
            max_bytes=max_bytes,
            backups=backups,
            fsync_interval_s=fsync_interval_s,
            max_queue=max_queue,
            on_error=on_error,
            on_write=on_write,
            monotonic=monotonic,
        )
        self._lock = self._writer.lock
        close_at_exit(self)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        recover: bool = True,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        fsync_interval_s: float = DEFAULT_FSYNC_INTERVAL_S,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_error: OnError = "fail_closed",
        on_write: WriteHook | None = None,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        stamp: Mapping[str, Any] | None = None,
    ) -> Journal:
        """Create parent directories (0700), recover, open and start the writer.

        With ``recover`` the requests a previous process left open are closed here, each with
        one ``request.end`` (outcome ``router_restart``), queued before anything the caller
        writes next (so before its ``router.start``). The result is kept in ``.recovery``.
        Blocking (reads the whole journal): call it before serving, or in a thread.
        """
        path = Path(path)
        make_private_dirs(path.parent)
        result = _recover(path) if recover else None
        make_files_private(path)
        journal = cls(
            path,
            max_bytes=max_bytes,
            backups=backups,
            fsync_interval_s=fsync_interval_s,
            max_queue=max_queue,
            on_error=on_error,
            on_write=on_write,
            wall_clock=wall_clock,
            monotonic=monotonic,
            stamp=stamp,
        )
        if result is not None:
            journal.recovery = result
            closed = journal.recovered_closed = journal.close_recovered(result)
            log_recovery(result, closed)
        return journal

    # ---------------------------------------------------------------- state

    @property
    def healthy(self) -> bool:
        """No I/O error so far and the writer is running (sticky: see the writer module)."""
        with self._lock:
            return self._writer.healthy_locked()

    @property
    def accepting(self) -> bool:
        """Whether ``request_start`` would admit a new request now.

        ``fail_closed``: open, healthy, and room in the queue for the start and for the end of
        every open request. ``best_effort``: open.
        """
        with self._lock:
            return self._accepting_locked()

    @property
    def last_error(self) -> str | None:
        with self._lock:
            return self._writer.error

    @property
    def backlog(self) -> int:
        """Records submitted and not yet processed (queued plus being written)."""
        with self._lock:
            return self._writer.backlog_locked()

    @property
    def records_written(self) -> int:
        with self._lock:
            return self._writer.written

    @property
    def write_errors(self) -> int:
        with self._lock:
            return self._writer.write_errors

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._writer.dropped

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._writer.closing

    def open_requests(self) -> list[str]:
        """Ids started and not yet ended, oldest first."""
        with self._lock:
            return list(self._open)

    def stats(self) -> JournalStats:
        with self._lock:
            writer = self._writer
            return JournalStats(
                records_written=writer.written,
                dropped=writer.dropped,
                write_errors=writer.write_errors,
                backlog=writer.backlog_locked(),
                open_requests=len(self._open),
                healthy=writer.healthy_locked(),
                accepting=self._accepting_locked(),
                last_error=writer.error,
                rotations=writer.rotations,
                fsyncs=writer.fsyncs,
                secret_fields_dropped=self._encoder.secret_fields_dropped,
                unmatched_ends=self._unmatched_ends,
                duplicate_starts=self._duplicate_starts,
            )

    # ---------------------------------------------------------------- recording

    def submit(self, record_type: str, fields: Mapping[str, Any] | None = None) -> bool:
        """Queue one record of any type except ``request.start``/``request.end`` (which go
        through :meth:`request_start`/:meth:`request_end`, to keep the open set right).

        Never blocks on I/O. True if queued; False if refused (closed, queue full, or failed
        closed), which is counted in ``dropped``. Raises ``ValueError`` for a reserved key
        (``type``, ``ts``) or a request record type: those are bugs in the caller.
        """
        if record_type in (REQUEST_START, REQUEST_END):
            raise ValueError(f"use request_start()/request_end() for {record_type!r} records")
        with self._lock:
            data = self._encoder.encode(record_type, {}, fields or {}, RESERVED)
            # Under fail_closed, leave room for the end of every open request.
            reserve = len(self._open) if self.on_error == "fail_closed" else 0
            return self._writer.push_locked(data, reserve=reserve)

    def record(self, record_type: str, /, **fields: Any) -> bool:
        """``submit`` with keyword fields: ``journal.record("role.flip", engine="e1", ...)``."""
        return self.submit(record_type, fields)

    def router_start(
        self,
        *,
        fleet_sha256: str | None = None,
        profile_sha256: str | None = None,
        **fields: Any,
    ) -> bool:
        """``router.start``: pid, narwhal version, journal path, the fleet and profile hashes,
        a summary of the recovery (if this journal ran one), and whatever else is passed."""
        head: dict[str, Any] = {
            "pid": os.getpid(),
            "version": __version__,
            "fleet_sha256": fleet_sha256,
            "profile_sha256": profile_sha256,
            "journal": str(self.path),
        }
        if self.recovery is not None:
            head["recovery"] = self.recovery.summary()
        head.update(fields)
        return self.submit(ROUTER_START, head)

    def router_stop(self, **fields: Any) -> bool:
        """``router.stop``: marks a clean shutdown for the next process's recovery."""
        head: dict[str, Any] = {"pid": os.getpid(), "open_requests": len(self.open_requests())}
        head.update(fields)
        return self.submit(ROUTER_STOP, head)

    def role_flip(self, **fields: Any) -> bool:
        """``role.flip``: an engine changing role (fields are the role controller's)."""
        return self.submit(ROLE_FLIP, fields)

    def request_start(self, request_id: str, arrival: float, **fields: Any) -> bool:
        """Open ``request_id`` and queue its ``request.start``.

        Returns whether the request may be served (the id is now open, so its one
        ``request.end`` will be accepted). ``fail_closed``: False if the journal failed or the
        queue has no room (refuse the request). ``best_effort``: True even when the record
        itself had to be dropped (counted). False, writing nothing, if the id is already open.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, not {type(request_id).__name__}")
        with self._lock:
            data = self._encoder.encode(
                REQUEST_START, {"id": request_id, "arrival": arrival}, fields, REQUEST_RESERVED
            )
            if request_id in self._open:
                self._duplicate_starts += 1
                self._warn_once_locked(
                    "duplicate-start",
                    "journal: request.start for already open id %r refused",
                    request_id,
                )
                return False
            if self.on_error == "fail_closed":
                # Room for this start, and for the end of every open request plus this one.
                if not self._accepting_locked():
                    self._writer.dropped += 1
                    return False
                self._open[request_id] = arrival
                return self._writer.push_locked(data, reserve=len(self._open))
            self._open[request_id] = arrival
            self._writer.push_locked(data, reserve=0)
            return True

    def request_end(self, request_id: str, outcome: str, **fields: Any) -> bool:
        """Close ``request_id`` with its one ``request.end``.

        ``arrival`` is filled in from the start unless given. False, writing nothing, if the id
        is not open (never started here, or already ended): the double-end guard. True means
        the id was closed and its record queued, or (``best_effort`` only, queue full) dropped
        and counted.
        """
        with self._lock:
            if request_id not in self._open:
                self._unmatched_ends += 1
                self._warn_once_locked(
                    "unmatched-end",
                    "journal: request.end for id %r that is not open (double end?) refused",
                    request_id,
                )
                return False
            head: dict[str, Any] = {"id": request_id, "outcome": outcome}
            if "arrival" not in fields:
                head["arrival"] = self._open[request_id]
            data = self._encoder.encode(REQUEST_END, head, fields, END_RESERVED)
            del self._open[request_id]
            if not self._writer.push_locked(data, reserve=0):
                self._warn_once_locked(
                    "end-dropped",
                    "journal: request.end dropped (%s)",
                    self._writer.error or "queue full",
                )
            return True

    def close_recovered(self, result: RecoveryResult, *, block: bool = True) -> int:
        """Write one ``request.end`` (outcome ``router_restart``) for each request ``result``
        found open. Returns how many were queued.

        Ids this journal already closed from a recovery, or that are open in this journal,
        are skipped, so calling it twice never ends a request twice. With ``block`` (the
        default, used at start-up) it waits for queue room instead of dropping an end.
        """
        closed = 0
        with self._lock:
            for request_id in result.open_requests:
                if request_id in self._recovered_ids or request_id in self._open:
                    continue
                self._recovered_ids.add(request_id)
                data = self._encoder.encode(
                    REQUEST_END, result.restart_end(request_id), {}, END_RESERVED
                )
                if block:
                    self._writer.wait_for_room_locked()
                if self._writer.push_locked(data, reserve=0):
                    closed += 1
        return closed

    # ---------------------------------------------------------------- flush and close

    def flush(self, timeout: float | None = 5.0, *, fsync: bool = False) -> bool:
        """Wait until every record submitted before the call has been processed (and, with
        ``fsync``, synced to disk). Returns False on timeout.

        "Processed" means written or lost: check ``healthy``/``write_errors`` for which.
        Blocking: from async code use ``await asyncio.to_thread(journal.flush)``.
        """
        return self._writer.flush(timeout, fsync=fsync)

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop accepting records, write what is queued, fsync and close the file.

        Idempotent. Returns False if the writer did not finish within ``timeout`` (a stuck
        disk); it is a daemon thread and will not keep the process alive. Does not write
        ``router.stop``: call :meth:`router_stop` first on a clean shutdown.
        """
        with self._lock:
            first = self._writer.stop_locked()
            open_count = len(self._open)
        if first and open_count:
            log.info("journal %s: closing with %d open request(s)", self.path, open_count)
        finished = self._writer.join(timeout)
        forget_at_exit(self)
        return finished

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _accepting_locked(self) -> bool:
        if self._writer.closing:
            return False
        if self.on_error == "best_effort":
            return True
        # One slot for the start, one for each open request's end, one for the new one's.
        return self._writer.healthy_locked() and self._writer.has_room_locked(
            1 + len(self._open) + 1
        )

    def _warn_once_locked(self, key: str, message: str, *args: object) -> None:
        """Log a misuse by the caller once per kind, not once per request."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)
