"""Detached engine processes: start with a log and a pid file, wait for health, stop safely.

A pid alone is not an identity (the kernel reuses them), so the run directory records each
process's start time from /proc and ``stop`` signals only a process whose start time still
matches: stopping a stale run directory must never kill an unrelated process. Starting,
waiting and stopping are ``narwhal.testing.procs``'s; this module keeps the run directory.

An answer on an engine's port is not proof that the engine answered: another process (an
earlier run's engine on the same port) may hold it while ours fails to bind and exits. An
engine counts as answering only while its own process is alive, before and after the answer,
and holds the listening socket of its URL's port (see ``answered_by``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from urllib.parse import urlsplit

from narwhal.testing import procs
from narwhal.testing.procfs import descendants, listening_pid, start_ticks

__all__ = [
    "RunRecord",
    "alive",
    "answered_by",
    "exited_line",
    "holds_its_port",
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


# Where the kernel lists listening TCP sockets; without it (a sandbox hiding /proc/net) who
# holds a port cannot be told, and liveness alone has to do.
_TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def holds_its_port(record: RunRecord) -> bool:
    """The listening socket on the port of ``record.url`` belongs to the recorded process or
    one of its children (True as well when /proc cannot say: no socket tables, or the
    process's descriptors hidden)."""
    port = urlsplit(record.url).port
    if port is None or not any(t.exists() for t in _TCP_TABLES):
        return True
    if not os.access(f"/proc/{record.pid}/fd", os.R_OK | os.X_OK):
        # Another user's process, or /proc mounted hidepid: its sockets cannot be seen, so
        # which process holds the port cannot be told (liveness alone has to do).
        return True
    return listening_pid(port, descendants(record.pid)) is not None


def answered_by(record: RunRecord, answers: Callable[[], bool]) -> bool:
    """``answers()`` holds and it was the recorded engine that answered: its process alive
    before and after the answer and holding the listening socket of its port."""
    return alive(record) and answers() and holds_its_port(record) and alive(record)


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
    not_one = f"{path}: not a launch_plan.py run state"
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise RunStateError(f"{not_one}: invalid JSON ({exc})") from None
    except OSError as exc:
        raise RunStateError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise RunStateError(f"{not_one}: not a JSON object")
    records: dict[str, RunRecord] = {}
    for key, value in data.items():
        problem = _record_problem(value)
        if problem is not None:
            raise RunStateError(f"{not_one}: {key}: {problem}")
        records[key] = RunRecord(**value)
    return records


# RunRecord's fields and their JSON types (the annotations are strings here: `from __future__`).
_RECORD_TYPES: dict[str, type] = {
    f.name: int if f.type == "int" else str for f in fields(RunRecord)
}


def _record_problem(value: object) -> str | None:
    """Why ``value`` is not a run record's fields (a hand-edited or truncated run.json), in
    words: the dataclass's own complaint names its constructor, not the file."""
    if not isinstance(value, dict):
        return "not a JSON object"
    missing = [k for k in _RECORD_TYPES if k not in value]
    if missing:
        return f"missing {', '.join(missing)}"
    unknown = sorted(k for k in value if k not in _RECORD_TYPES)
    if unknown:
        return f"unknown field {unknown[0]}"
    for key, kind in _RECORD_TYPES.items():
        if not isinstance(value[key], kind) or isinstance(value[key], bool):
            return f"{key}: expected {'an integer' if kind is int else 'a string'}"
    return None


def _tail(path: str, lines: int = 3) -> str:
    text = procs.log_tail(Path(path)).strip().splitlines()
    return " | ".join(text[-lines:])


def exited_line(record: RunRecord, when: str) -> str:
    return f"{record.engine_id}: exited {when} (log {record.log}: {_tail(record.log)})"


def wait_healthy(records: list[RunRecord], timeout_s: float) -> list[str]:
    """Poll each engine's /health until its own process answers 200 (``answered_by``); one
    problem line per engine that does not, or that exits before every engine is healthy."""
    by_id = {r.engine_id: r for r in sorted(records, key=lambda r: r.engine_id)}
    waited = procs.wait_all(
        {
            k: functools.partial(
                answered_by, r, functools.partial(procs.http_ok, f"{r.url}/health")
            )
            for k, r in by_id.items()
        },
        timeout_s,
        alive={k: functools.partial(alive, r) for k, r in by_id.items()},
        stop_on_exit=False,
    )
    problems = [exited_line(by_id[k], "before it was healthy") for k in waited.exited]
    problems += [
        f"{k}: not healthy within {timeout_s:g} s at {by_id[k].url} (log {by_id[k].log})"
        for k in sorted(waited.pending)
    ]
    # Healthy once is not healthy now: one that died while the others were awaited failed.
    problems += [
        exited_line(by_id[k], "after it was healthy") for k in waited.ready if not alive(by_id[k])
    ]
    return problems


def stop_record(record: RunRecord, timeout_s: float) -> str:
    """SIGTERM the engine's process group, SIGKILL it after ``timeout_s``; say what happened."""
    return procs.stop_pid(record.pid, lambda: alive(record), timeout_s)
