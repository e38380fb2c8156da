"""A fleet document for simulated engines on 127.0.0.1: what the tests, the benchmarks and the
virtual-time simulator's workloads describe a local fleet with. Starting its engines is
``narwhal.testing.fleet.SimFleet``'s job."""

from __future__ import annotations

from typing import Any

__all__ = ["local_fleet_document"]


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
    kv_event_ports: list[tuple[int, int]] | None = None,
    prefix_caching: dict[str, Any] | None = None,
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
        if kv_event_ports is not None:
            pub, replay = kv_event_ports[i]
            engines[-1]["kv_events"] = {
                "endpoint": f"tcp://127.0.0.1:{pub}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            }
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
    if prefix_caching is not None:
        doc["engine"]["prefix_caching"] = prefix_caching  # e.g. {"enabled": False}
    if role_control is not None:
        doc["roles"] = role_control  # the fleet's role controller limits (``roles`` above is
        # each engine's permitted roles)
    doc.update(extra)
    return doc
