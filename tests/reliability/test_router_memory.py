"""The router's per-request state is bounded: found by ``bench/soak.py``, whose router grew by
about 3 MiB over 16,000 requests in 10 minutes, with or without faults.

Every request is recorded in the role controller's demand window (``DemandTracker``), but only
reading the window drops what has aged out, and only the role controller reads it. Without one
(no profile store, role control off) or while it is pinned, the window grew by one entry per
request for the life of the process. The router's role loop now trims it on every tick.
"""

from __future__ import annotations

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.metrics import RouterMetrics
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.roles import DemandTracker
from narwhal.serve.roles import RoleService
from narwhal.simengine.fleet import local_fleet_document


class _NoJournal:
    """The role service writes to the journal only when a flip or a pin happens: none here."""


def test_the_demand_window_is_trimmed_without_a_role_controller() -> None:
    loaded = parse_fleet(local_fleet_document([1, 2], [3, 4]), "fleet.json")
    clock = VirtualClock()
    demand = DemandTracker(clock, window_s=10.0)
    roles = RoleService(
        loaded.contract,
        FleetState(loaded.contract, clock),
        RouterMetrics(["e0", "e1"], "local-sim", "0" * 64, None),
        _NoJournal(),  # type: ignore[arg-type]
        demand,
        None,  # as without a profile store
    )
    for _ in range(5000):
        demand.record_start(0.1, 512, 16)
    clock.advance(5.0)
    for _ in range(10):
        demand.record_start(0.1, 512, 16)
    clock.advance(6.0)  # the first 5000 are 11 s old, the last 10 are 6 s old
    roles.tick()  # one round of the router's role loop
    assert len(demand._starts) == 10
