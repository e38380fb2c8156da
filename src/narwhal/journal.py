"""The router's durable JSONL request journal, and its recovery after a crash.

Why it exists: metrics say how the fleet is doing, the journal says what happened to each
request. Every request gets a ``request.start`` before any engine is contacted and exactly
one ``request.end`` when it is over, so after a crash the next router can tell which requests
were cut off (started, never ended) and close each of them once, with outcome
``router_restart``. People and tools read the file; nothing in the router reads it back
except recovery at start.

How it is built, and why:

- The router is asyncio. File I/O can stall for seconds (a slow disk, a full one, NFS), and
  the event loop must never wait on it. Callers only serialise the record (microseconds) and
  append it to a bounded in-memory queue under a lock that is never held across I/O; a single
  writer **thread** drains the queue, writes, rotates and fsyncs.
- The file is a raw ``O_APPEND`` descriptor with no user-space buffer: when ``os.write``
  returns, the record is in the kernel and survives a crash of the process (that is the
  per-record "flush"). ``fsync`` (survive a crash of the machine) runs every
  ``fsync_interval_s``, when ``flush(fsync=True)`` asks, before a rotation and at close.
- A write that fails is never reported as written. If it failed half way, the file is
  truncated back to the last complete record, so a later record never lands glued to a
  fragment. The error is counted and the configured policy applies: ``fail_closed`` (stop
  admitting requests: a router that cannot journal should not serve) or ``best_effort``
  (keep serving, count what was lost). Errors are sticky: a journal that lost a record can no
  longer vouch for "exactly one end per request", so it stays unhealthy until the router is
  restarted, whose recovery repairs the file.
- Under ``fail_closed`` the queue keeps one slot reserved for the ``request.end`` of every
  open request, so backpressure can refuse a new request but never drop the end of an
  admitted one.
- The journal knows the record *types*, not their fields: callers pass metadata as keyword
  arguments. As a defence against a careless caller it drops any key that names request
  content or credentials (``prompt``, ``messages``, ``text``, ``content``,
  ``authorization``, ``api_key``), at any depth, and warns once per key.

Wall-clock ``ts`` values come from an injected clock (for people and for tests); intervals
and latencies use a monotonic clock.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import orjson

from narwhal import __version__

__all__ = [
    "OUTCOME_ROUTER_RESTART",
    "RECORD_TYPES",
    "REQUEST_END",
    "REQUEST_START",
    "ROLE_FLIP",
    "ROUTER_START",
    "ROUTER_STOP",
    "SECRET_KEYS",
    "InvalidLine",
    "Journal",
    "JournalStats",
    "OnError",
    "RecoveryResult",
    "WriteHook",
    "journal_files",
    "recover",
]

log = logging.getLogger(__name__)

ROUTER_START: Final = "router.start"
REQUEST_START: Final = "request.start"
REQUEST_END: Final = "request.end"
ROLE_FLIP: Final = "role.flip"
ROUTER_STOP: Final = "router.stop"
RECORD_TYPES: Final = frozenset({ROUTER_START, REQUEST_START, REQUEST_END, ROLE_FLIP, ROUTER_STOP})

OUTCOME_ROUTER_RESTART: Final = "router_restart"

#: Keys never written, at any depth (matched case-insensitively, ``-`` read as ``_``; any key
#: ending in ``_api_key``, such as an ``X-Api-Key`` header, counts as ``api_key``).
SECRET_KEYS: Final = frozenset(
    {"prompt", "messages", "text", "content", "authorization", "api_key"}
)

OnError = Literal["fail_closed", "best_effort"]
WriteHook = Callable[[float, int], None]

DEFAULT_MAX_BYTES: Final = 256 * 1024 * 1024
DEFAULT_BACKUPS: Final = 5
DEFAULT_MAX_QUEUE: Final = 65536
DEFAULT_FSYNC_INTERVAL_S: Final = 1.0

_FILE_MODE: Final = 0o600
_DIR_MODE: Final = 0o700
_OPEN_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
_DUMPS_OPTIONS: Final = orjson.OPT_APPEND_NEWLINE
_RESERVED: Final = frozenset({"type", "ts"})
_REQUEST_RESERVED: Final = _RESERVED | {"id"}
_END_RESERVED: Final = _REQUEST_RESERVED | {"outcome"}
# Records the writer takes from the queue at once: one write(2) for a burst, bounded so the
# latency hook and flush() waiters hear of progress regularly.
_BATCH_MAX: Final = 512
# How long the writer lets records gather after a write that did not fill a batch: bounds its
# wake-ups to 50/s. Each wake-up costs the event loop's thread a GIL hand-off; at 2 ms (a wake-up
# per record at low rates) it cost the router about 7% of its CPU per request
# (docs/performance.md). A record reaches the file at most this much later; fsync runs every
# second anyway.
_COALESCE_S: Final = 0.02
# Recovery keeps this many malformed lines in detail (the count is always exact).
_INVALID_DETAIL_MAX: Final = 100
_ERROR_LOG_INTERVAL_S: Final = 60.0


# --------------------------------------------------------------------------------------------
# Records: validation, scrubbing, serialisation (run in the caller's thread)


# Types written as they are, with nothing inside to scrub (checked by exact type: fast).
_SCALARS: Final = frozenset({str, int, float, bool, type(None)})
# Key -> whether it is secret. Keys repeat (the router sends the same few dozen), so this stays
# small; it is capped in case a caller uses data as keys.
_SECRET_CACHE: dict[str, bool] = {}
_SECRET_CACHE_MAX: Final = 4096


def _is_secret(key: str) -> bool:
    hit = _SECRET_CACHE.get(key)
    if hit is None:
        normal = key.lower().replace("-", "_")
        hit = normal in SECRET_KEYS or normal.endswith("_api_key")
        if len(_SECRET_CACHE) < _SECRET_CACHE_MAX:
            _SECRET_CACHE[key] = hit
    return hit


def _scrub(value: Any, dropped: set[str]) -> Any:
    """A copy of ``value`` without secret-named keys; the names dropped go to ``dropped``.

    Copying also snapshots the caller's dicts and lists, so a caller that mutates them after
    the call cannot change what is written. Dataclasses and pydantic models are opened up
    here (orjson would otherwise serialise them whole, past the filter). This runs on the
    event loop for every record, hence the exact-type fast paths.
    """
    if type(value) in _SCALARS:
        return value
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if type(key) is str and _is_secret(key):
                dropped.add(key)
                continue
            out[key] = item if type(item) in _SCALARS else _scrub(item, dropped)
        return out
    if isinstance(value, list | tuple | set | frozenset):
        return [item if type(item) in _SCALARS else _scrub(item, dropped) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _scrub(dataclasses.asdict(value), dropped)
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump) and not isinstance(value, type):
        with contextlib.suppress(Exception):
            return _scrub(model_dump(mode="json"), dropped)
    return value


def _default(obj: Any) -> Any:
    """orjson fallback: paths as strings, anything else as ``str(obj)``: a record is never
    lost because one field had an unexpected type."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, bytes | bytearray):
        return f"<{len(obj)} bytes>"
    return str(obj)


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)[:200]
    except Exception:
        return f"<unrepresentable {type(value).__name__}>"


def _dumps(record: dict[str, Any]) -> tuple[bytes, list[str]]:
    """Serialise one record; returns the line and the keys that could not be serialised.

    orjson refuses a few values even with ``default`` (integers beyond 64 bits, non-string
    keys, cycles). Rather than lose the record (an end, say), such fields are replaced by a
    short repr and listed under ``unserializable``.
    """
    try:
        return orjson.dumps(record, default=_default, option=_DUMPS_OPTIONS), []
    except TypeError:
        pass
    bad: list[str] = []
    for key, value in list(record.items()):
        try:
            orjson.dumps(value, default=_default)
        except TypeError:
            record[key] = _safe_repr(value)
            bad.append(key)
    record["unserializable"] = bad
    return orjson.dumps(record, default=_default, option=_DUMPS_OPTIONS), bad


# --------------------------------------------------------------------------------------------
# Files


def journal_files(path: str | os.PathLike[str]) -> list[Path]:
    """The journal's existing files, oldest first: ``<path>.N`` ... ``<path>.1``, ``<path>``.

    Every numeric suffix is listed, also beyond the current ``backups`` (left by an earlier
    configuration), so recovery never misses a start.
    """
    path = Path(path)
    prefix = path.name + "."
    backups: list[tuple[int, Path]] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in path.parent.iterdir():
            suffix = entry.name[len(prefix) :]
            if entry.name.startswith(prefix) and suffix.isdigit() and entry.is_file():
                backups.append((int(suffix), entry))
    files = [p for _, p in sorted(backups, reverse=True)]
    if path.is_file():
        files.append(path)
    return files


def _backup_path(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def _make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and missing parents with mode 0700 (existing ones are untouched).

    ``os.makedirs(mode=...)`` applies the mode to the leaf only, so each level is made here.
    """
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory_to_make in reversed(missing):
        try:
            os.mkdir(directory_to_make, _DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(directory_to_make, _DIR_MODE)  # the umask may have narrowed it, never widened


def _fsync_dir(directory: Path) -> None:
    """Make a create or rename durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


class _JournalFile:
    """The active journal file: a raw ``O_APPEND`` descriptor and the size of its complete
    records.

    No user-space buffer, so there is nothing to flush and nothing half-written left in memory
    after an error. The writer thread owns it exclusively.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    @classmethod
    def open(cls, path: Path) -> _JournalFile:
        fd = os.open(path, _OPEN_FLAGS, _FILE_MODE)
        try:
            os.fchmod(fd, _FILE_MODE)  # an existing file keeps its mode through os.open
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        _fsync_dir(path.parent)
        return cls(fd, size)

    def ends_with_newline(self, path: Path) -> bool:
        """Whether the file is empty or its last byte ends a line (a crash can tear the last
        record; the next one must not be glued onto it)."""
        if self.size == 0:
            return True
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def write(self, data: bytes) -> None:
        """Write all of ``data`` or raise; ``size`` follows what reached the file."""
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            self.size += n
            view = view[n:]

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        self.size = size

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


# --------------------------------------------------------------------------------------------
# Recovery


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

    def summary(self) -> dict[str, Any]:
        """A small JSON-able summary, written into the next ``router.start``."""
        previous_pid = self.previous_start.get("pid") if self.previous_start else None
        return {
            "files": len(self.files),
            "records_read": self.records_read,
            "invalid_lines": self.invalid_line_count,
            "torn_tail": self.torn_tail,
            "closed_requests": len(self.open_requests),
            "unmatched_ends": self.unmatched_ends,
            "previous_pid": previous_pid,
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


# --------------------------------------------------------------------------------------------
# The journal


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
    Build it with :meth:`Journal.open`.
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
    ) -> None:
        """Open (creating, mode 0600) the journal file and start the writer thread.

        ``max_bytes`` 0 disables rotation. ``on_write(latency_s, backlog)`` is called from the
        writer thread after each record reaches the file, with the time from submission to
        written and the records still waiting; it must be quick and thread-safe (a Prometheus
        histogram and gauge are). Raises ``OSError`` if the file cannot be opened.
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
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.fsync_interval_s = fsync_interval_s
        self.max_queue = max_queue
        self.on_error: OnError = on_error
        self.recovery: RecoveryResult | None = None
        self._on_write = on_write
        self._wall_clock = wall_clock
        self._monotonic = monotonic

        self._lock = threading.Lock()
        self._wake_writer = threading.Condition(self._lock)  # producers -> writer
        self._progress = threading.Condition(self._lock)  # writer -> flush(), blocked producers
        # Guarded by _lock:
        self._pending: deque[tuple[bytes, float]] = deque()
        self._inflight = 0
        self._open: dict[str, Any] = {}  # request id -> arrival
        self._recovered_ids: set[str] = set()
        self._closing = False
        self._seq = 0  # records accepted into the queue
        self._done = 0  # of those, processed (written or lost)
        self._synced = 0  # _done at the last fsync
        self._sync_wanted = 0  # flush(fsync=True) asks for _synced >= this
        self._written = 0
        self._dropped = 0
        self._write_errors = 0
        self._rotations = 0
        self._fsyncs = 0
        self._error: str | None = None
        self._secret_fields_dropped = 0
        self._unmatched_ends = 0
        self._duplicate_starts = 0
        self._warned: set[str] = set()
        # Writer-thread only:
        self._dirty = False
        self._last_sync = monotonic()
        self._needs_newline = False
        self._last_error_log = float("-inf")

        self._file: _JournalFile | None = _JournalFile.open(self.path)
        if not self._file.ends_with_newline(self.path):
            # A torn tail from a crash: end its line so our first record starts on a new one.
            # Recovery reports the fragment; it is never removed (evidence, not garbage).
            try:
                self._file.write(b"\n")
            except BaseException:
                self._file.close()
                raise
        self._thread = threading.Thread(
            target=self._run, name=f"narwhal-journal:{self.path.name}", daemon=True
        )
        self._thread.start()
        _LIVE.add(self)

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
    ) -> Journal:
        """Create parent directories (0700), recover, open and start the writer.

        With ``recover`` the requests a previous process left open are closed here, each with
        one ``request.end`` (outcome ``router_restart``), queued before anything the caller
        writes next (so before its ``router.start``). The result is kept in ``.recovery``.
        Blocking (reads the whole journal): call it before serving, or in a thread.
        """
        path = Path(path)
        _make_private_dirs(path.parent)
        result = _recover(path) if recover else None
        for existing in journal_files(path):
            try:
                os.chmod(existing, _FILE_MODE)
            except OSError as exc:
                log.warning("journal: cannot chmod %s to 0600: %s", existing, exc)
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
        )
        if result is not None:
            journal.recovery = result
            closed = journal.close_recovered(result)
            if closed or result.invalid_line_count or result.clean_shutdown is False:
                log.warning(
                    "journal %s: previous process %s; closed %d open request(s) as %s; "
                    "%d unreadable line(s)%s",
                    path,
                    "stopped cleanly" if result.clean_shutdown else "did not stop cleanly",
                    closed,
                    OUTCOME_ROUTER_RESTART,
                    result.invalid_line_count,
                    " (torn tail)" if result.torn_tail else "",
                )
        return journal

    # ---------------------------------------------------------------- state

    @property
    def healthy(self) -> bool:
        """No I/O error so far and the writer is running (sticky: see the module docstring)."""
        with self._lock:
            return self._healthy_locked()

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
            return self._error

    @property
    def backlog(self) -> int:
        """Records submitted and not yet processed (queued plus being written)."""
        with self._lock:
            return len(self._pending) + self._inflight

    @property
    def records_written(self) -> int:
        with self._lock:
            return self._written

    @property
    def write_errors(self) -> int:
        with self._lock:
            return self._write_errors

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closing

    def open_requests(self) -> list[str]:
        """Ids started and not yet ended, oldest first."""
        with self._lock:
            return list(self._open)

    def stats(self) -> JournalStats:
        with self._lock:
            return JournalStats(
                records_written=self._written,
                dropped=self._dropped,
                write_errors=self._write_errors,
                backlog=len(self._pending) + self._inflight,
                open_requests=len(self._open),
                healthy=self._healthy_locked(),
                accepting=self._accepting_locked(),
                last_error=self._error,
                rotations=self._rotations,
                fsyncs=self._fsyncs,
                secret_fields_dropped=self._secret_fields_dropped,
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
            data = self._encode(record_type, {}, fields or {}, _RESERVED)
            # Under fail_closed, leave room for the end of every open request.
            reserve = len(self._open) if self.on_error == "fail_closed" else 0
            return self._push_locked(data, reserve=reserve)

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
            data = self._encode(
                REQUEST_START, {"id": request_id, "arrival": arrival}, fields, _REQUEST_RESERVED
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
                    self._dropped += 1
                    return False
                self._open[request_id] = arrival
                return self._push_locked(data, reserve=len(self._open))
            self._open[request_id] = arrival
            self._push_locked(data, reserve=0)
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
            data = self._encode(REQUEST_END, head, fields, _END_RESERVED)
            del self._open[request_id]
            if not self._push_locked(data, reserve=0):
                self._warn_once_locked(
                    "end-dropped", "journal: request.end dropped (%s)", self._error or "queue full"
                )
            return True

    def close_recovered(self, result: RecoveryResult, *, block: bool = True) -> int:
        """Write one ``request.end`` (outcome ``router_restart``) for each request ``result``
        found open. Returns how many were queued.

        Ids this journal already closed from a recovery, or that are open in this journal,
        are skipped, so calling it twice never ends a request twice. With ``block`` (the
        default, used at start-up) it waits for queue room instead of dropping an end.
        """
        previous_pid = result.previous_start.get("pid") if result.previous_start else None
        closed = 0
        with self._lock:
            for request_id, start in result.open_requests.items():
                if request_id in self._recovered_ids or request_id in self._open:
                    continue
                self._recovered_ids.add(request_id)
                data = self._encode(
                    REQUEST_END,
                    {
                        "id": request_id,
                        "outcome": OUTCOME_ROUTER_RESTART,
                        "arrival": start.get("arrival"),
                        "error": "router restarted before the request ended",
                        "previous_pid": previous_pid,
                    },
                    {},
                    _END_RESERVED,
                )
                if block:
                    while (
                        len(self._pending) + self._inflight >= self.max_queue and not self._closing
                    ):
                        self._progress.wait()
                if self._push_locked(data, reserve=0):
                    closed += 1
        return closed

    # ---------------------------------------------------------------- flush and close

    def flush(self, timeout: float | None = 5.0, *, fsync: bool = False) -> bool:
        """Wait until every record submitted before the call has been processed (and, with
        ``fsync``, synced to disk). Returns False on timeout.

        "Processed" means written or lost: check ``healthy``/``write_errors`` for which.
        Blocking: from async code use ``await asyncio.to_thread(journal.flush)``.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("flush() called from the journal's writer thread")
        with self._lock:
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

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop accepting records, write what is queued, fsync and close the file.

        Idempotent. Returns False if the writer did not finish within ``timeout`` (a stuck
        disk); it is a daemon thread and will not keep the process alive. Does not write
        ``router.stop``: call :meth:`router_stop` first on a clean shutdown.
        """
        with self._lock:
            first = not self._closing
            self._closing = True
            self._wake_writer.notify()
            self._progress.notify_all()  # a blocked close_recovered() gives up
            open_count = len(self._open)
        if first and open_count:
            log.info("journal %s: closing with %d open request(s)", self.path, open_count)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        _LIVE.discard(self)
        return not self._thread.is_alive()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals (callers)

    def _healthy_locked(self) -> bool:
        return self._error is None and (self._thread.is_alive() or self._closing)

    def _accepting_locked(self) -> bool:
        if self._closing:
            return False
        if self.on_error == "best_effort":
            return True
        backlog = len(self._pending) + self._inflight
        # One slot for the start, one for each open request's end, one for the new one's.
        return self._healthy_locked() and backlog + 1 + len(self._open) + 1 <= self.max_queue

    def _encode(
        self,
        record_type: str,
        head: dict[str, Any],
        fields: Mapping[str, Any],
        reserved: frozenset[str],
    ) -> bytes:
        clash = reserved.intersection(fields)
        if clash:
            raise ValueError(f"journal fields {sorted(clash)} are reserved")
        dropped: set[str] = set()
        record: dict[str, Any] = {"type": record_type, "ts": self._wall_clock()}
        record.update(_scrub(head, dropped))
        record.update(_scrub(fields, dropped))
        if dropped:
            self._secret_fields_dropped += len(dropped)
            for key in sorted(dropped):
                self._warn_once_locked(
                    f"secret:{key}",
                    "journal: dropped field %r from a %s record: the journal never stores "
                    "request content or credentials",
                    key,
                    record_type,
                )
        data, bad = _dumps(record)
        if bad:
            self._warn_once_locked(
                f"unserializable:{record_type}",
                "journal: fields %s of a %s record are not JSON-serialisable; wrote their repr",
                bad,
                record_type,
            )
        return data

    def _push_locked(self, data: bytes, *, reserve: int) -> bool:
        """Queue ``data`` if the queue has room for it plus ``reserve`` slots; else count it
        dropped. Caller holds the lock."""
        if self._closing or len(self._pending) + self._inflight + 1 + reserve > self.max_queue:
            self._dropped += 1
            return False
        self._pending.append((data, self._monotonic()))
        self._seq += 1
        self._wake_writer.notify()
        return True

    def _warn_once_locked(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # ---------------------------------------------------------------- internals (writer)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (
                        self._pending
                        or self._closing
                        or self._sync_wanted > self._synced
                        or self._sync_due()
                    ):
                        self._wake_writer.wait(self._sync_wait())
                    take = min(_BATCH_MAX, len(self._pending))
                    batch = [self._pending.popleft() for _ in range(take)]
                    self._inflight = len(batch)
                    sync_wanted = self._sync_wanted > self._synced
                    finishing = self._closing and not self._pending
                try:
                    if batch:
                        self._write_batch(batch)
                    if self._dirty and (sync_wanted or finishing or self._sync_due()):
                        self._fsync()
                    with self._lock:
                        if not self._dirty:
                            self._synced = self._done
                        self._progress.notify_all()
                except Exception as exc:  # never let the writer die: that would hang the queue
                    log.exception("journal %s: unexpected writer error", self.path)
                    with self._lock:
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
            with self._lock:
                self._error = self._error or f"writer thread died: {exc!r}"
            log.exception("journal %s: writer thread died", self.path)
            raise
        finally:
            self._close_file()
            with self._lock:
                # Anything still queued (only if the thread died) will never be written.
                self._dropped += len(self._pending) + self._inflight
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
                self._file = _JournalFile.open(self.path)
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
        with self._lock:
            self._written += len(group)
            self._done += len(group)
            self._inflight -= len(group)
            backlog = len(self._pending) + self._inflight
            self._progress.notify_all()
        if self._on_write is not None:
            for _, submitted in group:
                try:
                    self._on_write(max(0.0, now - submitted), backlog)
                except Exception:
                    if "on_write" not in self._warned:
                        self._warned.add("on_write")
                        log.exception("journal: on_write hook failed (further failures silent)")

    def _undo_partial(self, file: _JournalFile, good_size: int) -> None:
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
        """``<path>`` -> ``<path>.1`` -> ... -> ``<path>.<backups>`` (the oldest dropped), like
        logging's RotatingFileHandler. The old file is fsynced first: after rotation it is
        never written again."""
        self._close_file()
        try:
            for index in range(self.backups - 1, 0, -1):
                source = _backup_path(self.path, index)
                if source.exists():
                    os.replace(source, _backup_path(self.path, index + 1))
            if self.path.exists():
                os.replace(self.path, _backup_path(self.path, 1))
            _fsync_dir(self.path.parent)
            rotated = True
        except OSError as exc:
            # Keep appending to whatever file is there; the next record retries the rotation.
            self._fail("rotate", exc, lost=0)
            rotated = False
        try:
            self._file = _JournalFile.open(self.path)
        except OSError as exc:
            self._fail("open", exc, lost=0)  # the next write retries the open
        if rotated:
            with self._lock:
                self._rotations += 1

    def _fsync(self) -> None:
        if self._file is None:
            self._dirty = False  # nothing open to sync (_close_file syncs before detaching)
            return
        try:
            self._file.fsync()
        except OSError as exc:
            self._fail("fsync", exc, lost=0)
        else:
            with self._lock:
                self._fsyncs += 1
        finally:
            # A failed fsync is not retried for the same data: after an fsync error, Linux may
            # already have dropped the dirty pages, so a retry would report false success.
            self._dirty = False
            self._last_sync = self._monotonic()
            with self._lock:
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
        with self._lock:
            first = self._error is None
            self._error = message
            self._write_errors += 1
            self._dropped += lost
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


_recover = recover  # Journal.open's ``recover`` flag shadows the function inside it

# Journals not closed by their owner are drained and fsynced at interpreter exit.
_LIVE: weakref.WeakSet[Journal] = weakref.WeakSet()


@atexit.register
def _close_live_journals() -> None:
    for journal in list(_LIVE):
        with contextlib.suppress(Exception):
            journal.close(timeout=2.0)
