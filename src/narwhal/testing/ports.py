"""Free TCP ports on 127.0.0.1 for processes started later (engines, routers, sidecars)."""

from __future__ import annotations

import os
import random
import socket

__all__ = ["ephemeral_range_start", "free_ports"]

# Ports handed out below the kernel's ephemeral range start here.
_FIXED_PORTS_FROM = 10_000
# Never handed out: the shipped local-sim configuration's own fixed ports (router 18080,
# engines 181xx, NIXL side channels 182xx, sidecars 183xx), which `make demo`, `make qualify`
# and tests/qualify/test_chain.py bind while tests in another worker draw ports.
_SHIPPED_PORTS = range(18_000, 18_400)


def ephemeral_range_start() -> int:
    """The first port of the kernel's ephemeral range (the ports a bind to port 0 gets)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _share(start: int, stop: int) -> range:
    """This test worker's part of the ports ``start..stop``: the whole of it, or under
    pytest-xdist (``make test`` runs tests in two workers) one slice per worker, so that a port
    one worker promised a process that has not bound it yet is never promised by another."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return range(start, stop)
    index, workers = int(worker[2:]), max(int(count), 1)
    size = (stop - start) // workers
    return range(start + index % workers * size, start + (index % workers + 1) * size)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now, for engines and routers started later.

    Taken below the kernel's ephemeral range: a port the kernel picks for a bind to port 0 is an
    ephemeral one, which any outgoing connection may take as its source port before the
    process it was promised to binds it ("address already in use" at an engine's start, seen in
    the test suite). Below that range only an explicit bind takes a port.
    """
    ports = _share(_FIXED_PORTS_FROM, ephemeral_range_start())
    if len(ports) < 100 * n:
        return _kernel_ports(n)  # an unusual port range: fall back to the kernel's choice
    chosen: list[int] = []
    for port in random.SystemRandom().sample(ports, min(50 * n, 2000)):
        if port in _SHIPPED_PORTS:
            continue
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
