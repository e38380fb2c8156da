"""What ran: the checkout's commit, package versions, the command line (MAD records the same)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from narwhal.testing.provenance import git

__all__ = ["git_commit", "versions"]

HERE = Path(__file__).resolve().parent


def git_commit(path: Path = HERE) -> dict[str, Any]:
    """The commit of the checkout holding ``path`` and whether the tree differs from it."""
    sha = git(path, "rev-parse", "HEAD")
    status = git(path, "status", "--porcelain", "--untracked-files=no")
    if sha is None or status is None:
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
