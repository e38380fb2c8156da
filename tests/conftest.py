from __future__ import annotations

from pathlib import Path

import pytest

from narwhal.testing.fleet import loopback_only

# NIXL must never probe real interfaces or log to stdout during tests, and tests only ever talk
# to 127.0.0.1: never through a proxy.
loopback_only()

# `make test` runs the suite in two pytest-xdist workers, except these: their assertions
# compare latencies, goodput or memory measured on this machine against a model of it, which
# another test sharing the two cores would skew. They run after, alone (`-m solo`).
SOLO_MODULES = {
    # live against virtual time, within 10%
    "tests/integration/test_des_agreement.py",
    "tests/integration/test_baselines_agreement.py",
    # the profiler recovers the simulator's step-time parameters
    "tests/integration/test_profile_v1.py",
    # five times capacity, the router's resident memory bounded
    "tests/reliability/test_overload.py",
    # aiperf's, load_trial's and the journal's latencies agree
    "tests/measurement/test_aiperf_xcheck.py",
    # real vLLM CPU engines: torch takes every core, and memory is checked before they start
    "tests/interop/",
}

_ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(_ROOT):
            continue
        where = path.relative_to(_ROOT).as_posix()
        if any(where == m or (m.endswith("/") and where.startswith(m)) for m in SOLO_MODULES):
            item.add_marker(pytest.mark.solo)
