"""The P/D routers the benchmarks and tests run in front of a simulated fleet besides
narwhal-serve: vllm-router (``--vllm-pd-disaggregation``) and sglang's ``smg launch
--pd-disaggregation``; their command lines, and how each router says it is ready."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from narwhal.testing.procs import http_ok

__all__ = ["peer_router_command", "router_ready"]


def router_ready(url: str, *, peer: bool = False) -> bool:
    """narwhal-serve answers ``GET /ready`` 200; vllm-router and smg (``peer``) answer
    ``GET /readiness`` 200 with ``{"status": "ready"}``."""
    if peer:
        return http_ok(url + "/readiness", json_status="ready")
    return http_ok(url + "/ready")


def peer_router_command(
    binary: Path | str,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    port: int,
    prometheus_port: int,
    *,
    policy: str | None = "round_robin",
    log_level: str | None = "warning",
    sglang: bool = False,
) -> list[str]:
    """vllm-router (or, with ``sglang``, smg) in P/D mode on 127.0.0.1:``port``: every engine
    given as ``--prefill`` or ``--decode``, one ``--policy`` for both (None: the router's
    default, cache_aware), workers checked every second at start."""
    if sglang:
        argv = [str(binary), "launch", "--pd-disaggregation"]
    else:
        argv = [str(binary), "--vllm-pd-disaggregation"]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    if policy is not None:
        argv += ["--policy", policy]
    argv += [
        "--host", "127.0.0.1",
        "--port", str(port),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(prometheus_port),
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    if log_level is not None:
        argv += ["--log-level", log_level]
    return argv
