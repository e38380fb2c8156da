"""Reading a router's request journal from the outside, as benchmarks and tests do."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["journal_ends"]


def journal_ends(journal: Path, expected: int, timeout: float = 15.0) -> list[dict[str, Any]]:
    """The journal's ``request.end`` records, once there are ``expected`` of them or after
    ``timeout`` seconds, whichever comes first (a record still being written is skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        ends = []
        if journal.exists():
            for line in journal.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if rec.get("type") == "request.end":
                        ends.append(rec)
        if len(ends) >= expected or time.monotonic() > deadline:
            return ends
        time.sleep(0.2)
