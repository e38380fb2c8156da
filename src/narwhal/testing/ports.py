"""Free TCP ports on 127.0.0.1 for processes started later (engines, routers, sidecars)."""

from __future__ import annotations

import random
import socket

__all__ = ["ephemeral_range_start", "free_ports"]

# Ports handed out below the kernel's ephemeral range start here.
_FIXED_PORTS_FROM = 10_000


def ephemeral_range_start() -> int:
    """The first port of the kernel's ephemeral range (the ports a bind to port 0 gets)."""
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
    low = ephemeral_range_start()
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
