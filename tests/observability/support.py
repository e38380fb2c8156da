"""Paths and expositions shared by the observability tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from narwhal.metrics import RouterMetrics
from narwhal.simengine.metrics import EngineMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "configs" / "grafana" / "dashboards"
PROVISIONING = ROOT / "configs" / "grafana" / "provisioning"
PROMETHEUS_DIR = ROOT / "configs" / "prometheus"
RULES = PROMETHEUS_DIR / "rules" / "narwhal.yml"
RULE_TESTS = PROMETHEUS_DIR / "tests" / "narwhal_test.yml"
SCRAPE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DOCS = ROOT / "docs"
INSTALL_HINT = "`make test-deps` installs Debian's prometheus package"


def binary(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``, or skip the test saying why."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: {INSTALL_HINT}")
    return path


def expositions(engines: tuple[str, ...] = ("e0", "e1")) -> list[str]:
    """What a fresh router and a fresh simulated engine export, before any event: every
    series they know of exists from the start."""
    router = RouterMetrics(engines, "fleet", "0" * 64, None)
    engine = EngineMetrics("model", "0")
    engine.cache_config(16, 1024, True)  # as the server sets it at start (its info gauge)
    return [
        generate_latest(router.registry).decode(),
        generate_latest(engine.registry).decode(),
    ]
