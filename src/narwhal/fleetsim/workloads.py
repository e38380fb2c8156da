"""Workloads for the virtual-time simulator: Azure-format traces, Poisson arrivals, synthetic
fleets of any size, and the timing (latency model) of a fleet file's simulated engines."""

from __future__ import annotations

import csv
import random
from datetime import datetime
from pathlib import Path
from typing import Any

from narwhal.contract import FleetContract, parse_fleet
from narwhal.fleetsim.simulator import KVBlocks, RequestSpec
from narwhal.profiles.models import EngineModels
from narwhal.simengine.fleet import local_fleet_document
from narwhal.simengine.timing import sim_models

__all__ = [
    "kv_blocks_of",
    "poisson_requests",
    "read_azure_trace",
    "synthetic_fleet",
    "timings_of",
    "trace_requests",
]


def read_azure_trace(
    path: str | Path,
    limit: int | None = None,
    max_prompt: int | None = None,
) -> list[tuple[float, int, int]]:
    """(seconds since the first request, context tokens, generated tokens) from an Azure
    LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        t0 = None
        for row in reader:
            stamp = row["TIMESTAMP"].strip()
            # Nanosecond fractions: keep microseconds for datetime.
            head, _, frac = stamp.partition(".")
            frac = (frac.split("+")[0] + "000000")[:6]
            t = datetime.fromisoformat(f"{head}.{frac}").timestamp()
            t0 = t if t0 is None else t0
            prompt = max(1, int(row["ContextTokens"]))
            if max_prompt is not None:
                prompt = min(prompt, max_prompt)
            rows.append((t - t0, prompt, max(1, int(row["GeneratedTokens"]))))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def trace_requests(
    rows: list[tuple[float, int, int]],
    rate_scale: float = 1.0,
) -> list[RequestSpec]:
    """Replay a trace with its inter-arrival times divided by ``rate_scale``."""
    return [RequestSpec(t / rate_scale, p, g) for t, p, g in rows]


def poisson_requests(
    rate: float,
    count: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int = 0,
    start: float = 0.0,
) -> list[RequestSpec]:
    rng = random.Random(seed)
    t, out = start, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(RequestSpec(t, prompt_tokens, output_tokens))
    return out


def synthetic_fleet(
    n_prefill: int,
    n_decode: int,
    budgets: dict[str, float],
    time_scale: float = 1.0,
    roles: dict[str, Any] | None = None,
    first_token_timeout_s: float | None = None,
) -> tuple[FleetContract, dict[str, EngineModels]]:
    """A fleet of any size on the default calibration (no processes: ports are nominal)."""
    n = n_prefill + n_decode
    doc = local_fleet_document(
        [20000 + i for i in range(n)],
        [40000 + i for i in range(n)],
        initial_roles=["prefill"] * n_prefill + ["decode"] * n_decode,
        sim={"time_scale": time_scale},
        ttft_s=budgets["ttft_s"],
        tpot_s=budgets["tpot_s"],
        first_token_timeout_s=first_token_timeout_s or 0.85 * budgets["ttft_s"],
        role_control=roles,
        name=f"des-{n_prefill}p{n_decode}d",
    )
    fleet = parse_fleet(doc, "<synthetic>").contract
    return fleet, timings_of(fleet)


def timings_of(fleet: FleetContract) -> dict[str, EngineModels]:
    """Each engine's step timing, from its ``sim`` block (the calibration without one)."""
    return {e.id: sim_models(e.sim) for e in fleet.engines}


def kv_blocks_of(fleet: FleetContract) -> dict[str, KVBlocks]:
    """Each simulated engine's KV cache, from its ``sim`` block (engines without one: none)."""
    return {e.id: KVBlocks(e.sim.num_blocks, e.sim.block_size) for e in fleet.engines if e.sim}
