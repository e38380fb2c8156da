"""The runner finds the router's journal when it is not told (``--journal``): from the
``--journal`` argument of the process listening on the router's port, on the router host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from narwhal.testing.ports import free_ports
from tests.helpers import running_fleet, running_router, start_router, stop_router
from tests.measurement.support import TOOLS
from tools.measurement._router_journal import (
    JournalNotFound,
    find_router_journal,
    journal_argument,
)


def test_a_command_lines_journal_argument_resolves_against_its_directory() -> None:
    cwd = Path("/srv/run")
    assert journal_argument(["narwhal-serve", "--journal", "j.jsonl"], cwd) == cwd / "j.jsonl"
    assert journal_argument(["x", "--journal=/var/j.jsonl"], cwd) == Path("/var/j.jsonl")
    assert journal_argument(["x", "--journal"], cwd) is None
    assert journal_argument(["x", "--fleet", "f.json"], cwd) is None


def test_the_router_listening_on_the_port_names_its_journal(tmp_path: Path) -> None:
    with (
        running_fleet(tmp_path, 2) as fleet,
        running_router(tmp_path, fleet.fleet_path) as router,
    ):
        path, how = find_router_journal(router.url, None)
        assert path == router.journal.resolve() or path == router.journal
        assert how == "the router process's --journal"
    # Nothing listens any more: every way tried is named, in one line.
    try:
        find_router_journal(router.url, None)
    except JournalNotFound as exc:
        assert "no process of this user listens on port" in str(exc)
    else:
        raise AssertionError("found a journal with no router")


def test_a_router_given_a_relative_journal_names_it_absolutely_in_its_admin_state(
    tmp_path: Path,
) -> None:
    """A runner working in another directory reads /admin/state's journal path: the router
    started with ``--journal runs/j.jsonl`` names the file it writes, not one relative to
    whoever reads (a runner whose directory held a runs/ of its own read that one)."""
    elsewhere = tmp_path / "router-cwd"
    (elsewhere / "runs").mkdir(parents=True)
    with running_fleet(tmp_path, 2) as fleet:
        router = start_router(
            tmp_path, fleet.fleet_path, journal=Path("runs/j.jsonl"), cwd=elsewhere
        )
        try:
            path, how = find_router_journal(router.url, tmp_path / "admin-token")
        finally:
            stop_router(router)
    assert how == "the router's /admin/state"
    assert path == elsewhere / "runs" / "j.jsonl" and path.is_file()


def test_the_runner_without_journal_and_without_router_refuses_in_one_line(
    tmp_path: Path,
) -> None:
    base = f"http://127.0.0.1:{free_ports(1)[0]}"
    r = subprocess.run(
        [
            sys.executable,
            str(TOOLS / "benchmark_runner.py"),
            "--base",
            base,
            "--model",
            "m",
            "--plan",
            str(tmp_path / "plan.json"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--journal not given and the router's journal was not found" in lines[0]
    assert lines[0].endswith("pass --journal")
