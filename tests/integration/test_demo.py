"""``make demo`` end to end (DEMO_ONCE=1), on free ports so it runs beside anything."""

from __future__ import annotations

import os
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
    assert "every pulled block verified" in result.stdout
    assert result.stdout.count(" ok ") >= 2
    assert "NIXL moved" in result.stdout
