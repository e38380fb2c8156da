"""Start and stop a simulated fleet: one ``narwhal-sim engine`` process per engine of a fleet
file. Used by ``narwhal-sim fleet``, ``make demo``, the tests and the benchmarks."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from narwhal.contract import load_fleet
from narwhal.engines.scrape import parse_engine_load
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing import procs
from narwhal.testing.ports import free_ports

__all__ = [
    "EngineProcess",
    "SimFleet",
    "SimFleetError",
    "fleet_load",
    "loopback_only",
    "sim_env",
    "start_local_fleet",
    "wait_idle",
    "write_local_fleet",
]


class SimFleetError(procs.ProcessError):
    """An engine of the fleet did not come up."""


@dataclass
class EngineProcess:
    engine_id: str
    url: str
    args: list[str]
    log_path: Path | None
    process: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def loopback_only(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set up ``environ`` (this process's, by default, which every child inherits) for a run
    that only talks to 127.0.0.1: NIXL on loopback and quiet unless set otherwise, and never
    through an HTTP proxy."""
    environ.setdefault("UCX_NET_DEVICES", "lo")
    environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    for var in _PROXY_VARS:
        environ.pop(var, None)
    environ["NO_PROXY"] = "127.0.0.1,localhost"


def _alive(engine: EngineProcess) -> bool:
    return engine.alive


def sim_env() -> dict[str, str]:
    """This process's environment, with NIXL kept on loopback and quiet unless set otherwise."""
    env = dict(os.environ)
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class SimFleet:
    """The engines of one fleet file, each in its own process."""

    def __init__(
        self,
        fleet_path: str | Path,
        admin_token: str | None = None,
        log_dir: str | Path | None = None,
        engine_args: dict[str, list[str]] | None = None,
        engine_ids: list[str] | None = None,
        engine_api_key: str | None = None,
    ) -> None:
        """``engine_api_key`` starts every engine with ``--api-key`` (as vLLM's: its /v1
        routes then require it; /health stays open, so readiness polling needs no key)."""
        self.fleet_path = Path(fleet_path)
        self.fleet = load_fleet(self.fleet_path).contract
        self.admin_token = admin_token
        self.log_dir = Path(log_dir) if log_dir else None
        ids = engine_ids or [e.id for e in self.fleet.engines]
        self.engines: dict[str, EngineProcess] = {}
        for engine_id in ids:
            spec = self.fleet.engine_by_id(engine_id)
            args = [
                sys.executable,
                "-m",
                "narwhal.simengine.cli",
                "engine",
                "--fleet",
                str(self.fleet_path),
                "--engine-id",
                engine_id,
            ]
            if admin_token:
                args += ["--admin-token", admin_token]
            if engine_api_key:
                args += ["--api-key", engine_api_key]
            args += (engine_args or {}).get(engine_id, [])
            log_path = self.log_dir / f"engine-{engine_id}.log" if self.log_dir else None
            self.engines[engine_id] = EngineProcess(engine_id, spec.url, args, log_path)

    def __enter__(self) -> SimFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        for engine in self.engines.values():
            self._spawn(engine)
        self.wait_healthy(list(self.engines), timeout)

    def _spawn(self, engine: EngineProcess, extra: list[str] | None = None) -> None:
        engine.process = procs.start(engine.args + (extra or []), engine.log_path, env=sim_env())

    def wait_healthy(self, engine_ids: list[str], timeout: float = 60.0) -> None:
        engines = [self.engines[engine_id] for engine_id in sorted(set(engine_ids))]
        waited = procs.wait_all(
            {e.engine_id: functools.partial(procs.http_ok, f"{e.url}/health") for e in engines},
            timeout,
            alive={e.engine_id: functools.partial(_alive, e) for e in engines},
            interval=0.05,
        )
        for engine_id in waited.exited:
            engine = self.engines[engine_id]
            code = engine.process.returncode if engine.process else None
            raise SimFleetError(
                f"engine {engine_id} exited with code {code} before it was healthy"
                + (f" (log: {engine.log_path})" if engine.log_path else "")
            )
        if waited.pending:
            raise SimFleetError(f"engines not healthy within {timeout} s: {sorted(waited.pending)}")

    def restart(
        self, engine_id: str, extra: list[str] | None = None, timeout: float = 60.0
    ) -> None:
        engine = self.engines[engine_id]
        if engine.process is not None:
            procs.stop(engine.process, 10.0)
        self._spawn(engine, extra)
        self.wait_healthy([engine_id], timeout)

    def kill(self, engine_id: str) -> None:
        """SIGKILL one engine (a crash, not a shutdown)."""
        engine = self.engines[engine_id]
        if engine.process is not None and engine.alive:
            procs.kill(engine.process)

    def stop(self, timeout: float = 10.0) -> None:
        # SIGTERM every engine first, so that they drain in parallel, then wait for each.
        running = [e.process for e in self.engines.values() if e.process is not None and e.alive]
        for process in running:
            process.terminate()
        for process in running:
            procs.stop(process, timeout)


def write_local_fleet(path: Path, engines: int, **document: Any) -> dict[str, Any]:
    """``local_fleet_document`` for ``engines`` engines on free ports, written to ``path``."""
    kv_events = document.pop("kv_events", False)
    ports = free_ports(4 * engines if kv_events else 2 * engines)
    if kv_events:
        events = ports[2 * engines :]
        document["kv_event_ports"] = list(zip(events[::2], events[1::2], strict=True))
    doc = local_fleet_document(ports[:engines], ports[engines : 2 * engines], **document)
    path.write_text(json.dumps(doc, indent=2))
    return doc


def start_local_fleet(
    path: Path,
    engines: int,
    *,
    log_dir: Path,
    timeout: float = 120.0,
    attempts: int = 3,
    on_retry: Callable[[SimFleetError], None] | None = None,
    admin_token: str | None = None,
    engine_api_key: str | None = None,
    **document: Any,
) -> tuple[SimFleet, dict[str, Any]]:
    """``write_local_fleet`` and start it; the fleet and its document. Engine logs go to
    ``log_dir/logs-ATTEMPT``. A free port can be taken by another process before its engine
    binds it: the fleet is then stopped and started again on new ports, ``attempts`` times in
    all (``on_retry`` hears why)."""
    for attempt in range(attempts):
        doc = write_local_fleet(path, engines, **document)
        fleet = SimFleet(
            path,
            admin_token=admin_token,
            log_dir=log_dir / f"logs-{attempt}",
            engine_api_key=engine_api_key,
        )
        try:
            fleet.start(timeout=timeout)
        except SimFleetError as exc:
            fleet.stop()
            if attempt == attempts - 1:
                raise
            if on_retry is not None:
                on_retry(exc)
            continue
        return fleet, doc
    raise ValueError("attempts must be at least 1")


def fleet_load(urls: list[str]) -> float:
    """Running + waiting requests over these engines (inf if one does not answer)."""
    total = 0.0
    with httpx.Client(timeout=2, trust_env=False) as client:
        for url in urls:
            try:
                load = parse_engine_load(client.get(url + "/metrics").content)
            except httpx.HTTPError:
                return math.inf
            if load is None:
                return math.inf
            total += load["running"] + load["waiting"]
    return total


def wait_idle(urls: list[str], timeout: float, interval: float = 0.1) -> bool:
    """Poll until no engine has a request running or waiting (True), at most ``timeout`` s."""
    return procs.wait_until(lambda: fleet_load(urls) == 0, timeout, interval)
