"""Start and stop a simulated fleet: one ``narwhal-sim engine`` process per engine of a fleet
file. Used by ``narwhal-sim fleet``, ``make demo``, the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from narwhal.contract import load_fleet

__all__ = ["EngineProcess", "SimFleet", "SimFleetError", "free_ports", "local_fleet_document"]

# Ports handed out below the kernel's ephemeral range start here.
_FIXED_PORTS_FROM = 10_000


def _ephemeral_range_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now, for engines and routers started later.

    Taken below the kernel's ephemeral range: a port the kernel picks for a bind to port 0 is an
    ephemeral one, which any outgoing connection may take as its source port before the
    process it was promised to binds it ("address already in use" at an engine's start, seen in
    the test suite). Below that range only an explicit bind takes a port.
    """
    low = _ephemeral_range_start()
    if low - _FIXED_PORTS_FROM < 100 * n:
        return _kernel_ports(n)  # an unusual port range: fall back to the kernel's choice
    chosen: list[int] = []
    for port in random.SystemRandom().sample(range(_FIXED_PORTS_FROM, low), min(50 * n, 2000)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == n:
            return chosen
    return _kernel_ports(n)


def _kernel_ports(n: int) -> list[int]:
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


class SimFleetError(Exception):
    pass


@dataclass
class EngineProcess:
    engine_id: str
    url: str
    args: list[str]
    log_path: Path | None
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def sim_env() -> dict[str, str]:
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
    ) -> None:
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
        if engine.log_path is not None:
            engine.log_path.parent.mkdir(parents=True, exist_ok=True)
            engine._log = open(engine.log_path, "ab")  # noqa: SIM115 - closed in stop()
            out: Any = engine._log
        else:
            out = subprocess.DEVNULL
        engine.process = subprocess.Popen(
            engine.args + (extra or []),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=sim_env(),
            start_new_session=True,
        )

    def wait_healthy(self, engine_ids: list[str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        pending = set(engine_ids)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for engine_id in sorted(pending):
                    engine = self.engines[engine_id]
                    if not engine.alive:
                        code = engine.process.returncode if engine.process else None
                        raise SimFleetError(
                            f"engine {engine_id} exited with code {code} before it was healthy"
                            + (f" (log: {engine.log_path})" if engine.log_path else "")
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(f"{engine.url}/health").status_code == 200:
                            pending.discard(engine_id)
                if pending and time.monotonic() > deadline:
                    raise SimFleetError(
                        f"engines not healthy within {timeout} s: {sorted(pending)}"
                    )
                if pending:
                    time.sleep(0.05)

    def restart(
        self, engine_id: str, extra: list[str] | None = None, timeout: float = 60.0
    ) -> None:
        engine = self.engines[engine_id]
        self._terminate(engine, timeout=10.0)
        self._spawn(engine, extra)
        self.wait_healthy([engine_id], timeout)

    def kill(self, engine_id: str) -> None:
        """SIGKILL one engine (a crash, not a shutdown)."""
        engine = self.engines[engine_id]
        if engine.process is not None and engine.alive:
            engine.process.kill()
            engine.process.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        for engine in self.engines.values():
            if engine.alive:
                assert engine.process is not None
                with contextlib.suppress(ProcessLookupError):
                    engine.process.send_signal(signal.SIGTERM)
        for engine in self.engines.values():
            self._terminate(engine, timeout)

    @staticmethod
    def _terminate(engine: EngineProcess, timeout: float) -> None:
        proc = engine.process
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if engine._log is not None:
            engine._log.close()
            engine._log = None


def local_fleet_document(
    http_ports: list[int],
    nixl_ports: list[int],
    *,
    initial_roles: list[str] | None = None,
    roles: list[list[str]] | None = None,
    sim: dict[str, Any] | list[dict[str, Any]] | None = None,
    first_token_timeout_s: float = 2.5,
    ttft_s: float = 10.0,
    tpot_s: float = 0.3,
    max_model_len: int = 16384,
    name: str = "local-sim",
    model_id: str = "moonshotai/Kimi-K3",
    role_control: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A fleet document for simulated engines on 127.0.0.1 (tests and benchmarks use free ports)."""
    n = len(http_ports)
    if initial_roles is None:
        half = max(1, n // 2)
        initial_roles = ["prefill"] * half + ["decode"] * (n - half)
    sims = sim if isinstance(sim, list) else [dict(sim or {}) for _ in range(n)]
    engines = []
    for i in range(n):
        engines.append(
            {
                "id": f"e{i}",
                "url": f"http://127.0.0.1:{http_ports[i]}",
                "roles": (roles[i] if roles else ["prefill", "decode"]),
                "initial_role": initial_roles[i],
                "nixl": {"host": "127.0.0.1", "port": nixl_ports[i]},
                "attestation_url": f"http://127.0.0.1:{http_ports[i]}/attestation",
                "sim": sims[i],
            }
        )
    doc: dict[str, Any] = {
        "schema": "narwhal.fleet/v1",
        "name": name,
        "model": {"id": model_id, "revision": "sim", "max_model_len": max_model_len},
        "budgets": {"ttft_s": ttft_s, "tpot_s": tpot_s, "attainment": 0.95},
        "engine": {
            "first_token_timeout_s": first_token_timeout_s,
            "tp": 8,
            "accelerator": "simulated",
            "gpu_arch": "sim",
            "kv_buffer_device": "cpu",
        },
        "engines": engines,
    }
    if role_control is not None:
        doc["roles"] = role_control  # the fleet's role controller limits (``roles`` above is
        # each engine's permitted roles)
    doc.update(extra)
    return doc
