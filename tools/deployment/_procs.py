"""Detached engine processes: start with a log and a pid file, wait for health, stop safely.

A pid alone is not an identity (the kernel reuses them), so the run directory records each
process's start time from /proc and ``stop`` signals only a process whose start time still
matches: stopping a stale run directory must never kill an unrelated process. Starting,
waiting and stopping are ``narwhal.testing.procs``'s; this module keeps the run directory.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from narwhal.testing import procs
from narwhal.testing.procfs import start_ticks

__all__ = [
    "RunRecord",
    "alive",
    "load_run",
    "save_run",
    "start_detached",
    "stop_record",
    "wait_healthy",
]

STATE_FILE = "run.json"


@dataclass(frozen=True)
class RunRecord:
    engine_id: str
    pid: int
    start_ticks: int
    url: str
    log: str
    pidfile: str


def alive(record: RunRecord) -> bool:
    return start_ticks(record.pid) == record.start_ticks


def start_detached(
    engine_id: str, url: str, argv: list[str], env: dict[str, str], run_dir: Path
) -> RunRecord:
    log_path = run_dir / f"engine-{engine_id}.log"
    pid_path = run_dir / f"engine-{engine_id}.pid"
    # A new session: the engine outlives this command, and stop can signal its group.
    proc = procs.start(argv, log_path, env={**os.environ, **env})
    ticks = start_ticks(proc.pid)
    pid_path.write_text(f"{proc.pid}\n")
    return RunRecord(engine_id, proc.pid, ticks or -1, url, str(log_path), str(pid_path))


def save_run(run_dir: Path, records: dict[str, RunRecord]) -> None:
    tmp = run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps({k: asdict(v) for k, v in records.items()}, indent=2) + "\n")
    tmp.replace(run_dir / STATE_FILE)


class RunStateError(Exception):
    """A run directory's state file that cannot be read as one."""


def load_run(run_dir: Path) -> dict[str, RunRecord]:
    """The engines a start recorded in ``run_dir`` ({} when none); RunStateError when its
    state file is not one (hand-edited, truncated, another file's)."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        return {k: RunRecord(**v) for k, v in data.items()}
    except (ValueError, TypeError) as exc:  # JSONDecodeError, a record of other fields
        raise RunStateError(f"{path}: not a launch_plan.py run state ({exc})") from None


def _tail(path: str, lines: int = 3) -> str:
    text = procs.log_tail(Path(path)).strip().splitlines()
    return " | ".join(text[-lines:])


def wait_healthy(records: list[RunRecord], timeout_s: float) -> list[str]:
    """Poll each engine's /health until 200; one problem line per engine that is not."""
    by_id = {r.engine_id: r for r in sorted(records, key=lambda r: r.engine_id)}
    waited = procs.wait_all(
        {k: functools.partial(procs.http_ok, f"{r.url}/health") for k, r in by_id.items()},
        timeout_s,
        alive={k: functools.partial(alive, r) for k, r in by_id.items()},
        stop_on_exit=False,
    )
    problems = [
        f"{k}: exited before it was healthy (log {by_id[k].log}: {_tail(by_id[k].log)})"
        for k in waited.exited
    ]
    problems += [
        f"{k}: not healthy within {timeout_s:g} s at {by_id[k].url} (log {by_id[k].log})"
        for k in sorted(waited.pending)
    ]
    return problems


def stop_record(record: RunRecord, timeout_s: float) -> str:
    """SIGTERM the engine's process group, SIGKILL it after ``timeout_s``; say what happened."""
    return procs.stop_pid(record.pid, lambda: alive(record), timeout_s)
