"""Closing the journals still open when the interpreter exits, so that what they queued reaches
the file and is fsynced. Nothing is registered until a journal opens.

Why: the writer is a daemon thread (a stuck disk must never keep the process alive), and the
interpreter stops daemon threads wherever they are once its exit hooks have run. A process that
exits without closing its journal (an uncaught exception, a script's ``sys.exit``, a tool)
would lose every record still queued (up to 20 ms' worth at low rates, the whole backlog under
load) and never fsync the rest. So while any journal is open, one ``atexit`` hook closes each
(drain, fsync, close; at most ``_EXIT_TIMEOUT_S`` each, for a stuck disk). It is registered
when the first journal opens and removed when the last one closes. ``SIGKILL`` and
``os._exit`` skip it; recovery at the next start handles those.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Final, Protocol


class _Closable(Protocol):
    def close(self, timeout: float | None = ...) -> bool: ...


_EXIT_TIMEOUT_S: Final = 2.0

_lock = threading.Lock()
# id -> journal, in opening order. Strong references: an open journal lives until it is closed
# (or the process exits), whether or not its owner still holds it.
_open: dict[int, _Closable] = {}
_exiting = False  # the hook is running: leave the atexit registry alone


def close_at_exit(journal: _Closable) -> None:
    """Close ``journal`` at interpreter exit unless :func:`forget_at_exit` is called first."""
    with _lock:
        if not _open and not _exiting:
            atexit.register(_close_open_journals)
        _open[id(journal)] = journal


def forget_at_exit(journal: _Closable) -> None:
    """``journal`` has been closed: nothing to do for it at exit (idempotent)."""
    with _lock:
        if _open.pop(id(journal), None) is not None and not _open and not _exiting:
            atexit.unregister(_close_open_journals)


def _close_open_journals() -> None:
    global _exiting
    with _lock:
        _exiting = True
        journals = list(_open.values())
    for journal in journals:
        with contextlib.suppress(Exception):
            journal.close(timeout=_EXIT_TIMEOUT_S)
