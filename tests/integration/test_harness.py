"""The shared harness (``narwhal.testing``) on real processes: start, bounded waits, stop with
SIGTERM then SIGKILL (process groups included), /proc readings, and the statistics' definitions."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from narwhal.testing import procfs, procs
from narwhal.testing.stats import median, percentile, rank_percentile

# A child that ignores SIGTERM and starts a grandchild in its own process group.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    return procfs.start_ticks(pid) is None


def test_start_logs_and_wait_ready_sees_the_process_exit(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = procs.start([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], log)
    with pytest.raises(procs.ProcessExited, match="exited with 3") as info:
        procs.wait_ready(lambda: False, 30, process=proc, name="child", log=log)
    assert "hello" in str(info.value)  # the log's tail says why
    assert procs.log_tail(log).strip() == "hello"


def test_wait_ready_is_bounded() -> None:
    t0 = time.monotonic()
    with pytest.raises(procs.NotReady, match=r"not ready within 0\.3 s"):
        procs.wait_ready(lambda: False, 0.3, name="nothing", interval=0.05)
    assert time.monotonic() - t0 < 5
    assert procs.wait_until(lambda: True, 0)


def test_wait_all_reports_ready_exited_and_pending() -> None:
    waited = procs.wait_all(
        {"up": lambda: True, "dead": lambda: False, "slow": lambda: False},
        0.2,
        alive={"dead": lambda: False},
        stop_on_exit=False,
        interval=0.05,
    )
    assert (waited.ready, waited.exited, waited.pending) == (("up",), ("dead",), ("slow",))
    assert not waited.ok


def test_stop_escalates_to_sigkill_and_takes_the_group(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    proc = procs.start([sys.executable, "-c", STUBBORN], log)
    assert procs.wait_until(lambda: procs.log_tail(log).strip().isdigit(), 30)
    grandchild = int(procs.log_tail(log).strip())
    assert grandchild in procfs.descendants(proc.pid)
    t0 = time.monotonic()
    code = procs.stop(proc, 0.5, group=True)
    assert code == -9  # SIGTERM was ignored: SIGKILL after the bound
    assert time.monotonic() - t0 < 10
    assert procs.wait_until(lambda: _gone(grandchild), 10), "the grandchild outlived the stop"


def test_stop_pid_checks_identity(tmp_path: Path) -> None:
    proc = procs.start([sys.executable, "-c", "import time; time.sleep(120)"], None)
    ticks = procfs.start_ticks(proc.pid)
    assert ticks is not None
    assert procs.stop_pid(proc.pid, lambda: False, 1) == "not running"  # not the same process
    assert proc.poll() is None
    alive = lambda: procfs.start_ticks(proc.pid) == ticks  # noqa: E731
    assert procs.stop_pid(proc.pid, alive, 10) == "stopped"
    assert proc.wait(10) == -15


def test_procfs_readings_of_this_process() -> None:
    pid = os.getpid()
    cpu = procfs.cpu_seconds(pid)
    assert cpu is not None and cpu > 0
    assert procfs.total_cpu_seconds([pid]) >= cpu
    # The scheduler's count moves with a millisecond's work, where ticks move by 10 ms.
    before = procfs.run_time_seconds([pid])
    spin_until = time.process_time() + 0.002
    while time.process_time() < spin_until:
        pass
    assert procfs.run_time_seconds([pid]) - before >= 0.0015
    assert procfs.run_time_seconds([2**22 + 7]) == 0.0
    switches = procfs.voluntary_switches([pid])
    time.sleep(0.01)  # a sleep is a voluntary switch: the count it is read for
    assert procfs.voluntary_switches([pid]) > switches
    assert (procfs.rss_kib(pid) or 0) > 1000
    assert procfs.thread_count(pid) >= 1 and procfs.fd_count(pid) >= 3
    assert procfs.descendants(pid)[0] == pid
    assert procfs.machine_cpu_seconds() > 0
    assert procfs.rss_kib(2**22 + 7) is None and procfs.cpu_seconds(2**22 + 7) is None


@pytest.mark.parametrize("n", [1, 2, 5, 100, 101])
def test_percentile_is_numpys_linear_and_rank_percentile_an_observation(n: int) -> None:
    values = [((i * 7919) % 1013) / 7.0 for i in range(n)]
    for q in (0, 50, 90, 95, 99, 100):
        assert percentile(values, q) == float(np.percentile(values, q))
        assert rank_percentile(values, q) == sorted(values)[min(n - 1, int(q / 100 * n))]
        assert rank_percentile(values, q) in values
    assert median(values) == float(np.median(values))


def test_statistics_of_nothing() -> None:
    assert math.isnan(percentile([], 50)) and math.isnan(rank_percentile([], 50))
    assert median([]) is None
