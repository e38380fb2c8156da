"""The journal's bounded queue and the writer thread that drains it into the file: backpressure
and reserved slots on the callers' side; writing, rotation, fsync and the failure policy on
the thread's.

- The router is asyncio. File I/O can stall for seconds (a slow disk, a full one, NFS), and
  the event loop must never wait on it. Callers only serialise the record (microseconds) and
  append it to a bounded in-memory queue under a lock that is never held across I/O; a single
  writer **thread** drains the queue, writes, rotates and fsyncs.
- A write that fails is never reported as written. If it failed half way, the file is
  truncated back to the last complete record, so a later record never lands glued to a
  fragment. The error is counted and the configured policy applies: ``fail_closed`` (stop
  admitting requests: a router that cannot journal should not serve) or ``best_effort``
  (keep serving, count what was lost). Errors are sticky: a journal that lost a record can no
  longer vouch for "exactly one end per request", so it stays unhealthy until the router is
  restarted, whose recovery repairs the file.
- Under ``fail_closed`` the queue keeps one slot reserved for the ``request.end`` of every
  open request, so backpressure can refuse a new request but never drop the end of an
  admitted one. The journal knows the open requests and says how many slots to keep
  (``reserve``); the queue enforces it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal

from narwhal.journal.file import JournalFile, rotate_files

log = logging.getLogger("narwhal.journal")

OnError = Literal["fail_closed", "best_effort"]
WriteHook = Callable[[float, int], None]

DEFAULT_MAX_BYTES: Final = 256 * 1024 * 1024
DEFAULT_BACKUPS: Final = 5
DEFAULT_MAX_QUEUE: Final = 65536
DEFAULT_FSYNC_INTERVAL_S: Final = 1.0

# Records the writer takes from the queue at once: one write(2) for a burst, bounded so the
# latency hook and flush() waiters hear of progress regularly.
_BATCH_MAX: Final = 512
# How long the writer lets records gather after a write that did not fill a batch: bounds its
# wake-ups to 50/s. Each wake-up costs the event loop's thread a GIL hand-off; at 2 ms (a wake-up
# per record at low rates) it cost the router about 7% of its CPU per request
# (docs/performance.md). A record reaches the file at most this much later; fsync runs every
# second anyway.
_COALESCE_S: Final = 0.02
_ERROR_LOG_INTERVAL_S: Final = 60.0


class JournalWriter:
    """The queue of one journal file and the daemon thread that writes it.

    Producers hold ``lock`` around the ``*_locked`` methods, so the journal can check its own
    state (the open requests) and queue a record in one step; the counters below are guarded
    by it too. The thread is a daemon so a stuck disk never keeps the process alive; the
    journal is closed at interpreter exit (``narwhal.journal.at_exit``).
    """

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int,
        backups: int,
        fsync_interval_s: float,
        max_queue: int,
        on_error: OnError,
        on_write: WriteHook | None,
        monotonic: Callable[[], float],
    ) -> None:
        """Open (creating, mode 0600) the file at ``path`` and start the writer thread.

        Raises ``ValueError`` for a bad setting and ``OSError`` if the file cannot be opened.
        """
        if on_error not in ("fail_closed", "best_effort"):
            raise ValueError(f"on_error must be 'fail_closed' or 'best_effort', not {on_error!r}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no rotation), not {max_bytes}")
        if backups < 1:
            raise ValueError(f"backups must be >= 1, not {backups}")
        if max_queue < 2:
            raise ValueError(f"max_queue must be >= 2, not {max_queue}")
        if fsync_interval_s < 0:
            raise ValueError(f"fsync_interval_s must be >= 0, not {fsync_interval_s}")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.fsync_interval_s = fsync_interval_s
        self.max_queue = max_queue
        self.on_error: OnError = on_error
        self._on_write = on_write
        self._monotonic = monotonic

        self.lock = threading.Lock()
        self._wake_writer = threading.Condition(self.lock)  # producers -> writer
        self._progress = threading.Condition(self.lock)  # writer -> flush(), blocked producers
        # Guarded by lock:
        self._pending: deque[tuple[bytes, float]] = deque()
        self._inflight = 0
        self.closing = False
        self._seq = 0  # records accepted into the queue
        self._done = 0  # of those, processed (written or lost)
        self._synced = 0  # _done at the last fsync
        self._sync_wanted = 0  # flush(fsync=True) asks for _synced >= this
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self.rotations = 0
        self.fsyncs = 0
        self.error: str | None = None
        # Writer-thread only:
        self._file: JournalFile | None = JournalFile.open(path)
        self._file.end_torn_line(path)
        self._dirty = False
        self._last_sync = monotonic()
        self._needs_newline = False
        self._last_error_log = float("-inf")
        self._hook_failed = False

        self._thread = threading.Thread(
            target=self._run, name=f"narwhal-journal:{path.name}", daemon=True
        )
        self._thread.start()

    # ---------------------------------------------------------------- producers (hold lock)

    def backlog_locked(self) -> int:
        """Records submitted and not yet processed (queued plus being written)."""
        return len(self._pending) + self._inflight

    def healthy_locked(self) -> bool:
        return self.error is None and (self._thread.is_alive() or self.closing)

    def has_room_locked(self, slots: int) -> bool:
        """Whether ``slots`` more records fit in the queue."""
        return self.backlog_locked() + slots <= self.max_queue

    def push_locked(self, data: bytes, *, reserve: int) -> bool:
        """Queue ``data`` if the queue has room for it plus ``reserve`` slots; else count it
        dropped."""
        if self.closing or not self.has_room_locked(1 + reserve):
            self.dropped += 1
            return False
        self._pending.append((data, self._monotonic()))
        self._seq += 1
        self._wake_writer.notify()
        return True

    def wait_for_room_locked(self) -> None:
        """Block until the queue has a free slot or the writer is closing."""
        while self.backlog_locked() >= self.max_queue and not self.closing:
            self._progress.wait()

    def stop_locked(self) -> bool:
        """Stop accepting records and let the thread finish; returns whether this call did."""
        first = not self.closing
        self.closing = True
        self._wake_writer.notify()
        self._progress.notify_all()  # a blocked wait_for_room_locked() gives up
        return first

    # ---------------------------------------------------------------- waiting (no lock held)

    def flush(self, timeout: float | None, *, fsync: bool) -> bool:
        """Wait until every record queued before the call is processed (and, with ``fsync``,
        synced). Returns False on timeout."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("flush() called from the journal's writer thread")
        with self.lock:
            target = self._seq
            if fsync:
                self._sync_wanted = max(self._sync_wanted, target)
                self._wake_writer.notify()

            def caught_up() -> bool:
                if not self._thread.is_alive():
                    return True
                return self._done >= target and (not fsync or self._synced >= target)

            self._progress.wait_for(caught_up, timeout)
            return self._done >= target and (not fsync or self._synced >= target)

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread to finish (not from the thread itself); False if it has not."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    while not (
                        self._pending
                        or self.closing
                        or self._sync_wanted > self._synced
                        or self._sync_due()
                    ):
                        self._wake_writer.wait(self._sync_wait())
                    take = min(_BATCH_MAX, len(self._pending))
                    batch = [self._pending.popleft() for _ in range(take)]
                    self._inflight = len(batch)
                    sync_wanted = self._sync_wanted > self._synced
                    finishing = self.closing and not self._pending
                try:
                    if batch:
                        self._write_batch(batch)
                    if self._dirty and (sync_wanted or finishing or self._sync_due()):
                        self._fsync()
                    with self.lock:
                        if not self._dirty:
                            self._synced = self._done
                        self._progress.notify_all()
                except Exception as exc:  # never let the writer die: that would hang the queue
                    log.exception("journal %s: unexpected writer error", self.path)
                    with self.lock:
                        unprocessed = self._inflight
                    self._fail("writer", exc, lost=unprocessed)
                if finishing:
                    break
                if 0 < len(batch) < _BATCH_MAX:
                    # Let records gather before the next wake-up: under load a wake-up per
                    # record costs the event loop's thread a GIL hand-off for each one. A full
                    # batch means a backlog: write on at once.
                    time.sleep(_COALESCE_S)
        except BaseException as exc:
            with self.lock:
                self.error = self.error or f"writer thread died: {exc!r}"
            log.exception("journal %s: writer thread died", self.path)
            raise
        finally:
            self._close_file()
            with self.lock:
                # Anything still queued (only if the thread died) will never be written.
                self.dropped += len(self._pending) + self._inflight
                self._done += len(self._pending) + self._inflight
                self._pending.clear()
                self._inflight = 0
                self._synced = self._done
                self._progress.notify_all()

    def _sync_due(self) -> bool:
        return self._dirty and self._monotonic() - self._last_sync >= self.fsync_interval_s

    def _sync_wait(self) -> float | None:
        if not self._dirty:
            return None
        return max(0.0, self._last_sync + self.fsync_interval_s - self._monotonic())

    def _write_batch(self, batch: list[tuple[bytes, float]]) -> None:
        """Write records in order, rotating between records when the file would exceed
        ``max_bytes``; consecutive records are coalesced into one write."""
        group: list[tuple[bytes, float]] = []
        group_bytes = 0
        for item in batch:
            if self._should_rotate(group_bytes, len(item[0])):
                self._write_group(group)
                group, group_bytes = [], 0
                self._rotate()
            group.append(item)
            group_bytes += len(item[0])
        self._write_group(group)

    def _should_rotate(self, unwritten: int, incoming: int) -> bool:
        """Whether ``incoming`` bytes, after ``unwritten`` bytes not yet written, would take a
        non-empty file past ``max_bytes`` (a record larger than that gets a file of its own)."""
        if not self.max_bytes or self._file is None:
            return False
        size = self._file.size + unwritten
        return size > 0 and size + incoming > self.max_bytes

    def _write_group(self, group: list[tuple[bytes, float]]) -> None:
        if not group:
            return
        data = b"".join(item[0] for item in group)
        if self._needs_newline:
            data = b"\n" + data
        try:
            if self._file is None:
                self._file = JournalFile.open(self.path)
            file = self._file
        except OSError as exc:
            self._fail("open", exc, lost=len(group))
            return
        good_size = file.size
        try:
            file.write(data)
        except OSError as exc:
            self._undo_partial(file, good_size)
            self._fail("write", exc, lost=len(group))
            return
        self._needs_newline = False
        self._dirty = True
        now = self._monotonic()
        with self.lock:
            self.written += len(group)
            self._done += len(group)
            self._inflight -= len(group)
            backlog = self.backlog_locked()
            self._progress.notify_all()
        if self._on_write is not None:
            for _, submitted in group:
                try:
                    self._on_write(max(0.0, now - submitted), backlog)
                except Exception:
                    if not self._hook_failed:
                        self._hook_failed = True
                        log.exception("journal: on_write hook failed (further failures silent)")

    def _undo_partial(self, file: JournalFile, good_size: int) -> None:
        """Remove a half-written record so the next one does not land glued to it; if even
        that fails, start the next write with a newline so the fragment stays on its own
        line (recovery skips and reports it)."""
        if file.size == good_size:
            return
        try:
            file.truncate(good_size)
        except OSError as exc:
            self._needs_newline = True
            self._fail("truncate", exc, lost=0)

    def _rotate(self) -> None:
        """Move the file to the first backup and open a new one. The old file is fsynced
        first: after rotation it is never written again."""
        self._close_file()
        try:
            rotate_files(self.path, self.backups)
            rotated = True
        except OSError as exc:
            # Keep appending to whatever file is there; the next record retries the rotation.
            self._fail("rotate", exc, lost=0)
            rotated = False
        try:
            self._file = JournalFile.open(self.path)
        except OSError as exc:
            self._fail("open", exc, lost=0)  # the next write retries the open
        if rotated:
            with self.lock:
                self.rotations += 1

    def _fsync(self) -> None:
        if self._file is None:
            self._dirty = False  # nothing open to sync (_close_file syncs before detaching)
            return
        try:
            self._file.fsync()
        except OSError as exc:
            self._fail("fsync", exc, lost=0)
        else:
            with self.lock:
                self.fsyncs += 1
        finally:
            # A failed fsync is not retried for the same data: after an fsync error, Linux may
            # already have dropped the dirty pages, so a retry would report false success.
            self._dirty = False
            self._last_sync = self._monotonic()
            with self.lock:
                self._synced = self._done

    def _close_file(self) -> None:
        if self._file is None:
            return
        if self._dirty:
            self._fsync()
        file, self._file = self._file, None
        try:
            file.close()
        except OSError as exc:
            self._fail("close", exc, lost=0)

    def _fail(self, operation: str, exc: BaseException, *, lost: int) -> None:
        """Record an I/O failure; ``lost`` records will never be written. Never raises."""
        message = f"{operation}: {exc}"
        with self.lock:
            first = self.error is None
            self.error = message
            self.write_errors += 1
            self.dropped += lost
            self._done += lost
            self._inflight -= lost
            self._progress.notify_all()
        now = self._monotonic()
        if first or now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            policy = (
                "refusing new requests (fail_closed)"
                if self.on_error == "fail_closed"
                else "dropping records (best_effort)"
            )
            log.error("journal %s: %s; %d record(s) lost; %s", self.path, message, lost, policy)
