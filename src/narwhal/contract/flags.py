"""Numbers and URLs a person types on a command line, checked as the fleet file's are: a value
out of range is refused with the reason, never passed on to fail later as a traceback, a hang or
a run that measures nothing. NaN is out of every range (each comparison with it is false)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

NumberT = TypeVar("NumberT", int, float)


def _shown(value: float) -> str:
    """A number as typed: whole numbers in full (``1234567``, not ``1.23457e+06``)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def span(
    low: float, high: float | None = None, *, low_allowed: bool = True, high_allowed: bool = True
) -> str:
    """The range in words: "at least 1", "greater than 0", "from 1 to 65535", ..."""
    floor = f"at least {_shown(low)}" if low_allowed else f"greater than {_shown(low)}"
    if high is None:
        return floor
    if low_allowed and high_allowed:
        return f"from {_shown(low)} to {_shown(high)}"
    return f"{floor} and {'at most' if high_allowed else 'below'} {_shown(high)}"


def out_of_range(
    value: float,
    low: float,
    high: float | None = None,
    *,
    low_allowed: bool = True,
    high_allowed: bool = True,
) -> str | None:
    """Why ``value`` is out of the range (``must be ..., got ...``), or None when it is in."""
    if isinstance(value, float) and math.isinf(value):  # (an int past a float's range too)
        # No flag means "without bound" by infinity: it reached subprocess and socket timeouts
        # as an OverflowError, asyncio.sleep as a loop that never runs again, reports as null.
        return f"must be a finite number, got {_shown(value)}"
    above = value >= low if low_allowed else value > low
    below = high is None or (value <= high if high_allowed else value < high)
    if above and below:
        return None
    where = span(low, high, low_allowed=low_allowed, high_allowed=high_allowed)
    return f"must be {where}, got {_shown(value)}"


def number_type(
    kind: type[NumberT],
    low: float,
    high: float | None = None,
    *,
    low_allowed: bool = True,
    high_allowed: bool = True,
) -> Callable[[str], NumberT]:
    """An argparse ``type``: a number of ``kind`` in the range, else a usage error naming the
    flag and the reason (argparse adds the flag)."""

    def parse(text: str) -> NumberT:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        reason = out_of_range(value, low, high, low_allowed=low_allowed, high_allowed=high_allowed)
        if reason is not None:
            raise argparse.ArgumentTypeError(reason)
        return value

    return parse


def positive(kind: type[NumberT]) -> Callable[[str], NumberT]:
    """An argparse ``type``: a number of ``kind`` greater than 0."""
    return number_type(kind, 0, low_allowed=False)


def http_url_problem(text: str) -> str | None:
    """Why ``text`` is not an http(s) URL naming a host, its port (if any) a number from 1 to
    65535 (a port of letters was a traceback where the URL was first used), or None."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return f"not a URL with a port from 1 to 65535: {text!r}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"expected an http(s) URL naming a host, got {text!r}"
    if port is not None and not 1 <= port <= 65535:
        return f"not a URL with a port from 1 to 65535: {text!r}"
    return None


def base_url(text: str) -> str:
    """An argparse ``type``: :func:`http_url_problem` as a usage error."""
    problem = http_url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text
