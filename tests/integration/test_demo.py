"""``make demo`` end to end (DEMO_ONCE=1), on free ports so it runs beside anything."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.testing.ports import free_ports
from tests.helpers import write_fleet

pytestmark = pytest.mark.slow


def test_demo_runs_a_handoff_through_the_router(tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path, 4)
    env = {**os.environ, "DEMO_ONCE": "1", "DEMO_PORT": str(free_ports(1)[0])}
    result = subprocess.run(
        [sys.executable, "-m", "narwhal.demo", "--fleet", str(fleet)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The qualified path: narwhal-check's verdict, then the router serving on its report.
    assert "overall: PASS" in result.stdout
    assert "qualified in " in result.stdout
    work = Path(result.stdout.split("logs and journal in ", 1)[1].split()[0])
    head = next(
        json.loads(line)
        for line in (work / "journal.jsonl").read_text().splitlines()
        if '"router.start"' in line
    )
    assert head["qualification"]["status"] == "qualified"
    assert head["qualification"]["report"] == str(work / "check-report.json")
    assert f"--check-report {work / 'check-report.json'}" in head["command"]
    assert "every pulled block verified" in result.stdout
    assert result.stdout.count(" ok ") >= 2
    assert "NIXL moved" in result.stdout


def test_demo_refuses_ports_another_fleet_holds(tmp_path: Path) -> None:
    """A fleet (or router) already on the demo's ports would answer in its place: the demo
    named none of it, talked to the other fleet, and ended in a traceback. Now it refuses in
    a few lines naming each address, before starting anything."""
    fleet = write_fleet(tmp_path, 2)
    doc = json.loads(fleet.read_text())
    engine_port = int(doc["engines"][1]["url"].rsplit(":", 1)[1])
    router_port = free_ports(1)[0]
    with (
        socket.create_server(("127.0.0.1", engine_port)),
        socket.create_server(("127.0.0.1", router_port)),
    ):
        env = {**os.environ, "DEMO_ONCE": "1", "DEMO_PORT": str(router_port)}
        result = subprocess.run(
            [sys.executable, "-m", "narwhal.demo", "--fleet", str(fleet)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "logs and journal" not in result.stdout
    assert f"the router (set DEMO_PORT): 127.0.0.1:{router_port}" in result.stderr
    assert f"engine e1: 127.0.0.1:{engine_port}" in result.stderr
