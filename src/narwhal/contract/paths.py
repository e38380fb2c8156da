"""Where the tools write their output files (a profile store, a check report): checked before
the work that produces them, which takes minutes, so that a path that cannot be written fails
at once and says why, not after the work is done."""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["why_unwritable"]


def why_unwritable(out: Path) -> str | None:
    """Why a file cannot be written at ``out`` (its missing directories created), or None."""
    if out.is_dir():
        return f"{out} is a directory; name the file to write"
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is not a directory"
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".narwhal-"):
            pass
    except OSError as exc:
        return f"cannot write in {out.parent}: {exc.strerror or exc}"
    return None
