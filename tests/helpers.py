"""Shared test helpers: free ports, fleets of simulated engines, metric parsing."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from narwhal.sim.fleet import SimFleet, local_fleet_document

ADMIN_TOKEN = "test-admin-token"
MODEL = "moonshotai/Kimi-K3"
# Fast enough for tests, slow enough that steps are real (0.24 s decode step -> 4.8 ms).
TEST_TIME_SCALE = 50.0


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_fleet(directory: Path, num_engines: int, **kwargs: Any) -> Path:
    ports = free_ports(2 * num_engines)
    kwargs.setdefault("sim", {"time_scale": TEST_TIME_SCALE})
    doc = local_fleet_document(ports[:num_engines], ports[num_engines:], **kwargs)
    path = directory / "fleet.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


@contextlib.contextmanager
def running_fleet(directory: Path, num_engines: int = 2, **kwargs: Any) -> Iterator[SimFleet]:
    engine_args = kwargs.pop("engine_args", None)
    path = write_fleet(directory, num_engines, **kwargs)
    fleet = SimFleet(
        path, admin_token=ADMIN_TOKEN, log_dir=directory / "logs", engine_args=engine_args
    )
    try:
        fleet.start(timeout=60)
        yield fleet
    finally:
        fleet.stop()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def admin(
    url: str, method: str = "POST", body: dict[str, Any] | None = None, path: str = "/sim/faults"
) -> httpx.Response:
    return httpx.request(
        method,
        f"{url}{path}",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill leg as vLLM's proxy builds it."""
    out = {
        k: v
        for k, v in body.items()
        if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    out.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    if chat:
        out["max_completion_tokens"] = 1
    return out


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events
