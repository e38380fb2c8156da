"""The simulated engine's log for a stream its fault injection cut: one warning line, not the
server's traceback per dropped stream (a QA pass found one per drop in the engine's log)."""

from __future__ import annotations

import logging
import sys

from narwhal.simengine.server import DroppedStreamLogFilter, _DroppedStream


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord(
        "uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", (), info
    )


def test_a_dropped_stream_is_one_warning_line_also_inside_an_exception_group() -> None:
    cut = _DroppedStream("fault injection: dropping the connection mid-stream")
    for exc in (cut, BaseExceptionGroup("task group", [ValueError("x"), cut])):
        record = _record(exc)
        assert DroppedStreamLogFilter().filter(record)
        assert record.levelname == "WARNING" and record.exc_info is None
        assert record.getMessage() == "fault injection: dropping the connection mid-stream"


def test_any_other_error_keeps_its_traceback() -> None:
    record = _record(RuntimeError("a real bug"))
    assert DroppedStreamLogFilter().filter(record)
    assert record.levelname == "ERROR" and record.exc_info is not None
