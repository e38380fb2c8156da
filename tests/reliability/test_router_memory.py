"""The router's per-request state is bounded: found by ``bench/soak.py``, whose router grew by
about 3 MiB over 16,000 requests in 10 minutes, with or without faults.

Every request is recorded in the role controller's demand window (``DemandTracker``), but only
reading the window drops what has aged out, and only the role controller reads it. Without one
(no profile store, role control off) or while it is pinned, the window grew by one entry per
request for the life of the process. The router's role loop now trims it on every tick.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.metrics import RouterMetrics
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.roles import DemandTracker
from narwhal.serve.app import Runtime, ServeSettings, _run_role_loop
from narwhal.simengine.fleet import local_fleet_document


def test_the_demand_window_is_trimmed_without_a_role_controller(tmp_path: Path) -> None:
    loaded = parse_fleet(local_fleet_document([1, 2], [3, 4]), "fleet.json")
    clock = VirtualClock()
    rt = Runtime(
        settings=ServeSettings(fleet=loaded, journal_path=tmp_path / "j.jsonl"),
        metrics=RouterMetrics(["e0", "e1"], "local-sim", "0" * 64, None),
        state=FleetState(loaded.contract, clock),
    )
    rt.demand = DemandTracker(clock, window_s=10.0)
    assert rt.roles is None  # as without a profile store
    for _ in range(5000):
        rt.demand.record_start(0.1, 512, 16)
    clock.advance(5.0)
    for _ in range(10):
        rt.demand.record_start(0.1, 512, 16)
    clock.advance(6.0)  # the first 5000 are 11 s old, the last 10 are 6 s old

    async def a_few_ticks() -> None:
        loop = asyncio.create_task(_run_role_loop(rt, 0.01))
        await asyncio.sleep(0.1)
        loop.cancel()

    asyncio.run(a_few_ticks())
    assert len(rt.demand._starts) == 10
