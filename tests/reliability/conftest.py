from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Everything here runs live processes under injected faults: a hung test must fail, not
    # stall the suite (the project default is 300 s per test).
    for item in items:
        if "reliability" in str(item.path) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(180))
