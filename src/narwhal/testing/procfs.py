"""Readings from Linux's /proc: a process's CPU time, resident memory, threads and file
descriptors, over one process or a process tree, and the machine's CPU time and free memory.

Every reading of a process that is gone answers None (or 0 for counts) rather than raising:
the processes measured come and go while they are read.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = [
    "CLK_TCK",
    "available_memory_bytes",
    "busy_threads",
    "cpu_seconds",
    "descendants",
    "fd_count",
    "listening_pid",
    "machine_cpu_seconds",
    "process_name",
    "rss_kib",
    "run_time_seconds",
    "start_ticks",
    "stat_fields",
    "thread_count",
    "total_cpu_seconds",
    "tree_cpu_seconds",
    "tree_rss_bytes",
    "voluntary_switches",
]

CLK_TCK = os.sysconf("SC_CLK_TCK")
# A process tree larger than this is not walked further (a fork bomb must not hang a reading).
_MAX_TREE = 10_000


def stat_fields(pid: int, tid: int | None = None) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` (or of thread TID's) after the command name: index 0 is
    the state, 1 the parent's pid, 11 and 12 utime and stime, 13 and 14 cutime and cstime (reaped
    children), 19 the start time in clock ticks since boot. None if it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path, "rb") as f:
            raw = f.read().decode()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot: with the pid, its identity (pids are
    reused). None if it is gone or a zombie."""
    fields = stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process so far (every thread of it); None if gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def total_cpu_seconds(pids: Iterable[int]) -> float:
    """utime + stime (every thread) + cutime + cstime (reaped children) of these processes,
    summed; a process that is gone counts 0."""
    ticks = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is not None:
            ticks += sum(int(x) for x in fields[11:15])
    return ticks / CLK_TCK


def _thread_files(pids: Iterable[int], name: str) -> Iterator[bytes]:
    """The contents of ``/proc/PID/task/TID/<name>`` of every live thread of these processes
    (a thread or process gone while read is skipped)."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/{name}", "rb") as f:
                    yield f.read()
            except OSError:
                continue


def run_time_seconds(pids: Iterable[int]) -> float:
    """CPU time of these processes' live threads, summed, from the scheduler's own count
    (``/proc/PID/task/TID/schedstat``, nanoseconds). Unlike ``total_cpu_seconds``, whose
    utime and stime move in clock ticks (10 ms at 100 Hz: a block of a few dozen requests is
    read to within a sixth of itself), this resolves a single request; but a thread that has
    exited no longer counts (no reaped children either): for long-lived processes with a
    fixed set of threads, such as a router under a benchmark."""
    ns = 0
    for text in _thread_files(pids, "schedstat"):
        with contextlib.suppress(ValueError, IndexError):
            ns += int(text.split()[0])
    return ns / 1e9


def voluntary_switches(pids: Iterable[int]) -> int:
    """Voluntary context switches of these processes' live threads, summed: how often they
    went to sleep waiting (an event loop's waits for its sockets), so per request how many
    times a process was woken to serve it."""
    total = 0
    for text in _thread_files(pids, "status"):
        for line in text.splitlines():
            if line.startswith(b"voluntary_ctxt_switches:"):
                with contextlib.suppress(ValueError, IndexError):
                    total += int(line.split()[1])
                break
    return total


def tree_cpu_seconds(root: int) -> float:
    """``total_cpu_seconds`` of ``root`` and every process below it."""
    return total_cpu_seconds(descendants(root))


def machine_cpu_seconds() -> float:
    """User + nice + system CPU seconds of the whole machine since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    return (int(parts[1]) + int(parts[2]) + int(parts[3])) / CLK_TCK


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, parents before their children."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = stat_fields(int(name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = [root]
    while todo and len(out) < _MAX_TREE:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss_kib(pid: int) -> int | None:
    """Resident memory of a process (``VmRSS``), KiB; None if gone (or a zombie: no VmRSS)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def tree_rss_bytes(root: int) -> int:
    """Resident memory of ``root`` and every process below it, bytes."""
    return sum((rss_kib(pid) or 0) * 1024 for pid in descendants(root))


def thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def listening_pid(port: int, candidates: Iterable[int]) -> int | None:
    """The process among ``candidates`` holding the socket listening on port ``port``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) > 9 and parts[3] == "0A" and int(parts[1].split(":")[1], 16) == port:
                    inodes.add(f"socket:[{parts[9]}]")
    for pid in candidates:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return pid
    return None


def _thread_ticks(pid: int, tid: int) -> int | None:
    fields = stat_fields(pid, tid)
    return None if fields is None else int(fields[11]) + int(fields[12])


def busy_threads(root: int, sample_s: float = 1.0, busy_share: float = 0.5) -> list[int]:
    """Thread ids of ``root``'s tree, main threads excepted, that kept at least ``busy_share``
    of a core busy over ``sample_s`` seconds (busy-polling threads of an idle process)."""
    threads: list[tuple[int, int]] = []
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            threads += [(pid, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]
    before = {key: _thread_ticks(*key) for key in threads}
    time.sleep(sample_s)  # the sampling window itself, not a wait for something to happen
    threshold = busy_share * sample_s * CLK_TCK
    busy: list[int] = []
    for (pid, tid), ticks in before.items():
        after = _thread_ticks(pid, tid)
        if tid == pid or ticks is None or after is None or after - ticks < threshold:
            continue
        busy.append(tid)
    return busy


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo, bytes; None if it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
