"""What ran: the checkout's commit, package versions, the command line (MAD records the same)."""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["git_commit", "versions"]

HERE = Path(__file__).resolve().parent


def git_commit(path: Path = HERE) -> dict[str, Any]:
    """The commit of the checkout holding ``path`` and whether the tree differs from it."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha or None, "dirty": bool(status)}


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    for dist in ("narwhal", "httpx", "numpy", "pydantic", "prometheus-client"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["checkout"] = git_commit()
    return out
