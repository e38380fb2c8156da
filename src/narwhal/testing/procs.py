"""Processes of the tests, benchmarks, demo and tools: start one with its output in a log file,
wait (bounded: a deadline, never a bare sleep) until it is ready, stop it with SIGTERM and then
SIGKILL.

A process starts in a session of its own unless told otherwise: a terminal's Ctrl-C reaches only
the caller, and ``stop(..., group=True)`` ends the process together with whatever it started.
Stopping signals only processes this harness holds by their ``Popen`` object (or a pid whose
identity the caller checks, ``stop_pid``), never processes found by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

__all__ = [
    "NotReady",
    "ProcessError",
    "ProcessExited",
    "Waited",
    "async_wait_until",
    "http_ok",
    "is_running",
    "kill",
    "log_tail",
    "running",
    "start",
    "stop",
    "stop_pid",
    "wait_all",
    "wait_ready",
    "wait_until",
]

# How long a process may take to go once SIGKILLed before the harness gives up on it.
KILL_WAIT_S = 10.0


class ProcessError(RuntimeError):
    """A process the harness started did not come up."""


class ProcessExited(ProcessError):
    """It exited before it was ready."""


class NotReady(ProcessError):
    """It was not ready within its bound."""


# --------------------------------------------------------------------------------------------
# Start


def start(
    argv: Sequence[str],
    log: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    append: bool = True,
    new_session: bool = True,
    new_group: bool = False,
    preexec_fn: Callable[[], None] | None = None,
    log_via_pipe: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdin from /dev/null and stdout and stderr into ``log`` (appended to,
    or truncated with ``append=False``; None: discarded).

    ``new_session=True`` makes the child a session leader, ``new_group=True`` (with
    ``new_session=False``) the leader of a new process group in the caller's session: either
    way ``stop(..., group=True)`` reaches all it started. They differ in scheduling: Linux's
    autogroup gives every session an equal share of the CPU whatever the nice values inside
    it, so a thread lowered to nice 19 in a session of its own still takes half a busy core
    from the caller's session; in the caller's session its nice value holds. With neither, the
    child stays in the caller's group (a Ctrl-C reaches both).

    ``env`` is the child's whole environment (None: this process's). ``log_via_pipe`` copies
    the output to the log through a pipe (in a thread of this process), so that resource limits
    set by ``preexec_fn`` (RLIMIT_FSIZE) apply only to the files the child writes itself.
    """
    out: IO[bytes] | int = subprocess.DEVNULL
    if log is not None and not log_via_pipe:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab" if append else "wb")  # noqa: SIM115 - closed below: the child has its copy
    try:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if log_via_pipe else out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=new_session,
            process_group=0 if new_group and not new_session else None,
            preexec_fn=preexec_fn,
        )
    finally:
        if not isinstance(out, int):
            out.close()
    if log_via_pipe:
        threading.Thread(target=_pump, args=(process, log, append), daemon=True).start()
    return process


def _pump(process: subprocess.Popen[bytes], log: Path | None, append: bool) -> None:
    assert process.stdout is not None
    fd = process.stdout.fileno()
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(log, "ab" if append else "wb")) if log else None
        for chunk in iter(lambda: os.read(fd, 65536), b""):  # until the child's output closes
            if sink is not None:
                sink.write(chunk)
                sink.flush()
    process.stdout.close()


def is_running(process: subprocess.Popen[Any]) -> bool:
    """``process`` has not exited (yet)."""
    return process.poll() is None


def log_tail(log: Path | None, chars: int = 3000) -> str:
    """The last ``chars`` characters of a log ("" if there is none)."""
    if log is None:
        return ""
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# Wait


@dataclass(frozen=True)
class Waited:
    """What ``wait_all`` saw: the names that became ready (in that order), those whose process
    exited first, those still pending when the bound passed, and the seconds it took."""

    ready: tuple[str, ...]
    exited: tuple[str, ...]
    pending: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.exited and not self.pending


def wait_all(
    ready: Mapping[str, Callable[[], bool]],
    timeout: float,
    *,
    alive: Mapping[str, Callable[[], bool]] | None = None,
    interval: float = 0.1,
    stop_on_exit: bool = True,
    on_ready: Callable[[str], None] | None = None,
) -> Waited:
    """Poll each name's ``ready`` every ``interval`` seconds until all are ready or ``timeout``
    seconds have passed. A name whose ``alive`` turns false is given up on (and, with
    ``stop_on_exit``, so is the wait). ``on_ready(name)`` runs as each becomes ready."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    pending = list(ready)
    done: list[str] = []
    exited: list[str] = []
    while True:
        for name in list(pending):
            if alive is not None and name in alive and not alive[name]():
                pending.remove(name)
                exited.append(name)
                if stop_on_exit:
                    return Waited(tuple(done), tuple(exited), tuple(pending), time.monotonic() - t0)
                continue
            if ready[name]():
                pending.remove(name)
                done.append(name)
                if on_ready is not None:
                    on_ready(name)
        if not pending or time.monotonic() >= deadline:
            return Waited(tuple(done), tuple(exited), tuple(pending), time.monotonic() - t0)
        time.sleep(interval)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    return wait_all({"predicate": predicate}, timeout, interval=interval).ok


async def async_wait_until(
    predicate: Callable[[], bool], timeout: float, interval: float = 0.01
) -> bool:
    """``wait_until`` for a caller on the event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True


def wait_ready(
    ready: Callable[[], bool],
    timeout: float,
    *,
    process: subprocess.Popen[Any] | None = None,
    name: str = "process",
    log: Path | None = None,
    interval: float = 0.1,
) -> float:
    """Poll ``ready`` until it holds; the seconds it took. Raises ``ProcessExited`` if
    ``process`` exits first and ``NotReady`` after ``timeout`` seconds, with the log's tail."""
    alive = {name: functools.partial(is_running, process)} if process is not None else None
    waited = wait_all({name: ready}, timeout, alive=alive, interval=interval)
    tail = log_tail(log)
    if waited.exited:
        assert process is not None
        raise ProcessExited(
            f"{name} exited with {process.returncode} before it was ready"
            + (f":\n{tail}" if tail else "")
        )
    if waited.pending:
        raise NotReady(f"{name} not ready within {timeout:g} s" + (f":\n{tail}" if tail else ""))
    return waited.seconds


def http_ok(url: str, *, json_status: str | None = None, timeout: float = 2.0) -> bool:
    """``GET url`` answers 200 (and, with ``json_status``, a JSON body whose ``status`` is that:
    vllm-router's and sglang-router's ``/readiness``); False when it cannot be reached."""
    try:
        response = httpx.get(url, timeout=timeout, trust_env=False)
        if response.status_code != 200:
            return False
        return json_status is None or response.json().get("status") == json_status
    except (httpx.HTTPError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# Stop


def stop(
    process: subprocess.Popen[Any], timeout: float = 15.0, *, group: bool = False
) -> int | None:
    """SIGTERM ``process``, SIGKILL it if it is still there after ``timeout`` seconds; its exit
    code (None if even SIGKILL did not end it).

    ``group=True`` signals the process group it leads (``start(new_session=True)``), and once
    the leader has exited SIGKILLs whatever is left of the group: children that outlive it. The
    leader is not reaped before that, so its id (the group's) cannot have been reused.
    """
    if group:
        if process.returncode is None:
            _escalate(lambda sig: _killpg(process.pid, sig), lambda t: _exited(process, t), timeout)
        _killpg(process.pid, signal.SIGKILL)  # what is left of the group
    elif process.poll() is None:
        _escalate(process.send_signal, lambda t: _waited(process, t), timeout)
    try:
        return process.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        return None


def kill(process: subprocess.Popen[Any], *, group: bool = False) -> int | None:
    """SIGKILL ``process`` (its whole group with ``group``) at once: a crash, not a shutdown."""
    if group:
        _killpg(process.pid, signal.SIGKILL)
    elif process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    try:
        return process.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        return None


def stop_pid(pid: int, alive: Callable[[], bool], timeout: float, *, group: bool = True) -> str:
    """Stop a process this harness does not hold (a detached one, known by its pid file): SIGTERM
    (its group), SIGKILL after ``timeout``. ``alive`` must check the process's identity, not
    just its pid (pids are reused). Says what happened."""
    if not alive():
        return "not running"

    def send(sig: signal.Signals) -> None:
        if group:
            _killpg(pid, sig)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def gone(within: float) -> bool:
        return wait_until(lambda: not alive(), within)

    return _escalate(send, gone, timeout)


def _escalate(
    send: Callable[[signal.Signals], None], gone: Callable[[float], bool], timeout: float
) -> str:
    send(signal.SIGTERM)
    if gone(timeout):
        return "stopped"
    send(signal.SIGKILL)
    if gone(KILL_WAIT_S):
        return "killed after SIGTERM timed out"
    return "still running after SIGKILL"


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _waited(process: subprocess.Popen[Any], timeout: float) -> bool:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _exited(process: subprocess.Popen[Any], timeout: float) -> bool:
    """Has ``process`` exited (within ``timeout``)? Leaves it unreaped, a zombie holding its pid."""

    def exited() -> bool:
        try:
            return (
                os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
            )
        except ChildProcessError:  # reaped already
            return True

    return wait_until(exited, timeout, interval=0.02)


# --------------------------------------------------------------------------------------------
# Together


@contextlib.contextmanager
def running(
    argv: Sequence[str],
    log: Path | None = None,
    *,
    ready: Callable[[], bool] | None = None,
    ready_timeout: float = 60.0,
    name: str | None = None,
    stop_timeout: float = 15.0,
    group: bool = False,
    **start_kwargs: Any,
) -> Iterator[subprocess.Popen[bytes]]:
    """``start`` a process, ``wait_ready`` for it (when given ``ready``), and ``stop`` it when
    the block ends, however it ends."""
    process = start(argv, log, **start_kwargs)
    try:
        if ready is not None:
            wait_ready(
                ready, ready_timeout, process=process, name=name or Path(argv[0]).name, log=log
            )
        yield process
    finally:
        stop(process, stop_timeout, group=group)
