"""Detached engine processes: start with a log and a pid file, wait for health, stop safely.

A pid alone is not an identity (the kernel reuses them), so the run directory records each
process's start time from /proc and ``stop`` signals only a process whose start time still
matches: stopping a stale run directory must never kill an unrelated process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

__all__ = [
    "RunRecord",
    "alive",
    "load_run",
    "proc_start_ticks",
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


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/PID/stat field 22); None if gone
    or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def alive(record: RunRecord) -> bool:
    return proc_start_ticks(record.pid) == record.start_ticks


def start_detached(
    engine_id: str, url: str, argv: list[str], env: dict[str, str], run_dir: Path
) -> RunRecord:
    log_path = run_dir / f"engine-{engine_id}.log"
    pid_path = run_dir / f"engine-{engine_id}.pid"
    with open(log_path, "ab") as log:
        # A new session: the engine outlives this command, and stop can signal its group.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    ticks = proc_start_ticks(proc.pid)
    pid_path.write_text(f"{proc.pid}\n")
    return RunRecord(engine_id, proc.pid, ticks or -1, url, str(log_path), str(pid_path))


def save_run(run_dir: Path, records: dict[str, RunRecord]) -> None:
    tmp = run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps({k: asdict(v) for k, v in records.items()}, indent=2) + "\n")
    tmp.replace(run_dir / STATE_FILE)


def load_run(run_dir: Path) -> dict[str, RunRecord]:
    path = run_dir / STATE_FILE
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {k: RunRecord(**v) for k, v in data.items()}


def _tail(path: str, lines: int = 3) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def wait_healthy(records: list[RunRecord], timeout_s: float) -> list[str]:
    """Poll each engine's /health until 200; one problem line per engine that is not."""
    deadline = time.monotonic() + timeout_s
    pending = {r.engine_id: r for r in records}
    problems: list[str] = []
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            for engine_id, rec in sorted(pending.items()):
                if not alive(rec):
                    problems.append(
                        f"{engine_id}: exited before it was healthy (log {rec.log}: "
                        f"{_tail(rec.log)})"
                    )
                    del pending[engine_id]
                    continue
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{rec.url}/health").status_code == 200:
                        del pending[engine_id]
            if pending and time.monotonic() > deadline:
                for engine_id, rec in sorted(pending.items()):
                    problems.append(
                        f"{engine_id}: not healthy within {timeout_s:g} s at {rec.url} "
                        f"(log {rec.log})"
                    )
                break
            if pending:
                time.sleep(0.1)
    return problems


def stop_record(record: RunRecord, timeout_s: float) -> str:
    """SIGTERM the engine's process group, SIGKILL it after ``timeout_s``; say what happened."""
    if not alive(record):
        return "not running"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(record):
            return "stopped"
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while alive(record) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "killed after SIGTERM timed out" if not alive(record) else "still running after SIGKILL"
