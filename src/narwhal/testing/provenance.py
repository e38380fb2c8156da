"""What a benchmark or a measurement ran: the checkout's commit and whether the code under test
differs from it (others edit the tree while benchmarks run)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["git", "source_state"]


def git(root: Path, *args: str) -> str | None:
    """``git -C root ARGS``'s output, stripped; None if git cannot answer (no git, no checkout,
    an error)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def source_state(root: Path) -> str:
    """``HEAD <short sha>`` and how many files under ``src/`` differ from it (or ``clean``)."""
    head = git(root, "rev-parse", "--short", "HEAD")
    changed = git(root, "status", "--porcelain", "--", "src")
    if head is None or changed is None:
        return "unknown (no git)"
    files = len(changed.splitlines())
    return f"HEAD {head}" + (f", {files} files under src/ modified" if files else ", clean")
