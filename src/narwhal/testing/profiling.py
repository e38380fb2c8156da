"""narwhal-profile as the tests and benchmarks run it against a local fleet: a limits file and
one bounded subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

__all__ = ["LIMITS_SCHEMA", "profile", "profile_fleet", "write_limits"]

LIMITS_SCHEMA = "narwhal.profiling-limits/v1"


def write_limits(
    path: Path,
    *,
    max_tokens_per_engine: int,
    probe_timeout_s: float,
    max_wall_s_per_engine: float = 300,
) -> Path:
    """A profiling-limits file at ``path``."""
    doc = {
        "schema": LIMITS_SCHEMA,
        "max_wall_s_per_engine": max_wall_s_per_engine,
        "max_tokens_per_engine": max_tokens_per_engine,
        "probe_timeout_s": probe_timeout_s,
    }
    path.write_text(json.dumps(doc))
    return path


def profile(
    fleet: Path, limits: Path, out: Path, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``narwhal-profile --fleet FLEET --limits LIMITS --out OUT --quiet ARGS`` in this
    interpreter, its output captured; killed after ``timeout`` seconds."""
    return subprocess.run(
        [
            sys.executable, "-m", "narwhal.profiler.cli",
            "--fleet", str(fleet),
            "--limits", str(limits),
            *args,
            "--out", str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip


def profile_fleet(
    directory: Path,
    fleet: Path,
    *args: str,
    store: str = "profile-store.json",
    max_tokens_per_engine: int = 5_000_000,
    probe_timeout_s: float = 120,
    timeout: float = 600,
) -> Path:
    """Profile a benchmark's fleet: limits in ``directory/limits.json``, the store in
    ``directory/STORE`` (returned), the report in ``directory/profile.txt``. RuntimeError with
    the end of narwhal-profile's stderr if it fails."""
    limits = write_limits(
        directory / "limits.json",
        max_tokens_per_engine=max_tokens_per_engine,
        probe_timeout_s=probe_timeout_s,
    )
    out = directory / store
    done = profile(fleet, limits, out, *args, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"narwhal-profile failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (directory / "profile.txt").write_text(done.stdout)
    return out
