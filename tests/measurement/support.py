"""Helpers for the measurement integration tests: plans, workloads and the runner as a process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from narwhal.contract import load_fleet
from narwhal.testing import procs
from narwhal.testing.fleet import fleet_load

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "measurement"
MODEL = "moonshotai/Kimi-K3"
# The simulated fleet for measurement tests: 20x faster than the MI355X fleet, a KV pool big
# enough for dozens of 8k-token sequences, and small KV blocks so that moving and verifying KV
# bytes (real NIXL transfers) does not eat the two CPUs the client and router also need.
SIM = {"time_scale": 20.0, "num_blocks": 40000, "block_bytes": 256}


def write_plan(
    path: Path,
    fleet_path: Path,
    points: list[dict[str, Any]],
    input_tokens: int,
    output_tokens: int,
    **extra: Any,
) -> Path:
    doc = {
        "schema": "narwhal.benchmark-plan/v1",
        "fleet": {"path": str(fleet_path), "sha256": load_fleet(fleet_path).sha256},
        "client_revision": "test-client",
        "workload": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        "points": points,
        **extra,
    }
    path.write_text(json.dumps(doc, indent=2))
    return path


def point(name: str, rate: float, requests: int, scale: float = 20.0, **over: Any) -> dict:
    """A point with the qualification run's budgets (10 s TTFT, 0.3 s TPOT, 180 s timeout)
    divided by the simulator's time scale."""
    doc = {
        "name": name,
        "rate": rate,
        "requests": requests,
        "ttft_s": 10.0 / scale,
        "tpot_s": 0.3 / scale,
        "attainment": 0.95,
        "timeout_s": 180.0 / scale,
    }
    doc.update(over)
    return doc


def load_trial(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOLS / "load_trial.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def runner_cmd(
    base: str, plan: Path, out: Path, journal: Path | None, workload: Path | None, *extra: str
) -> list[str]:
    """The runner's command line; without ``journal`` (None) it finds the router's itself."""
    cmd = [
        sys.executable,
        str(TOOLS / "benchmark_runner.py"),
        "--base",
        base,
        "--model",
        MODEL,
        "--plan",
        str(plan),
        "--out",
        str(out),
        *(["--journal", str(journal)] if journal is not None else []),
        # Scrape twice a second; allow a 4 s hole (the runner's default is 1 s and 2.5 s): on
        # two CPUs shared by the fleet, the router and the client, a loaded router's /metrics
        # can answer a second late, and the gate would rightly fail the point.
        "--scrape-interval",
        "0.5",
        "--max-gap",
        "4.0",
        # Bounded waits: a stuck fleet fails the test in seconds, with its evidence.
        "--drain-timeout",
        "30",
        "--idle-timeout",
        "30",
        "--ready-timeout",
        "30",
    ]
    if workload is not None:
        cmd += ["--workload", str(workload)]
    return cmd + list(extra)


def run_runner(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


def gate(point_doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in point_doc["gates"] if g["name"] == name)


def journal_has(journal: Path, needle: str, count: int) -> bool:
    try:
        return journal.read_text().count(needle) >= count
    except OSError:
        return False


def when(
    condition: Callable[[], bool], action: Callable[[], None], timeout: float
) -> threading.Thread:
    """Run ``action`` once ``condition`` holds (polled, bounded by ``timeout``)."""

    def body() -> None:
        if procs.wait_until(condition, timeout):
            action()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def engines_idle(urls: list[str]) -> bool:
    """No request running or waiting on any of these engines (False if one does not answer)."""
    return fleet_load(urls) == 0
