"""The router's durable JSONL request journal, and its recovery after a crash.

Why it exists: metrics say how the fleet is doing, the journal says what happened to each
request. Every request gets a ``request.start`` before any engine is contacted and exactly
one ``request.end`` when it is over, so after a crash the next router can tell which requests
were cut off (started, never ended) and close each of them once, with outcome
``router_restart``. People and tools read the file; nothing in the router reads it back
except recovery at start.

The rooms, each with its own "why": ``journal`` (the ``Journal`` class: record methods, open
requests, opening with recovery), ``encoding`` (record types, secret-key scrubbing,
serialisation), ``writer`` (the bounded queue, backpressure, the writer thread, the failure
policy), ``file`` (the ``O_APPEND`` file, truncation, rotation, fsync), ``recovery`` (reading
a journal back) and ``at_exit`` (closing journals left open when the interpreter exits).
"""

from __future__ import annotations

from narwhal.journal.encoding import (
    RECORD_TYPES,
    REQUEST_END,
    REQUEST_START,
    ROLE_FLIP,
    ROUTER_START,
    ROUTER_STOP,
    SECRET_KEYS,
)
from narwhal.journal.file import journal_files
from narwhal.journal.journal import Journal, JournalStats
from narwhal.journal.recovery import OUTCOME_ROUTER_RESTART, InvalidLine, RecoveryResult, recover
from narwhal.journal.writer import DEFAULT_BACKUPS as DEFAULT_BACKUPS
from narwhal.journal.writer import DEFAULT_FSYNC_INTERVAL_S as DEFAULT_FSYNC_INTERVAL_S
from narwhal.journal.writer import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES
from narwhal.journal.writer import DEFAULT_MAX_QUEUE as DEFAULT_MAX_QUEUE
from narwhal.journal.writer import OnError, WriteHook

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
