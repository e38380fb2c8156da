"""The virtual-time simulator against the live simulated fleet, on the same workload.

Shared by the agreement test (``tests/integration/test_des_agreement.py``, small) and the
agreement benchmark (``bench/des_agreement.py``, larger): an open-loop client that replays a
list of ``RequestSpec`` through a running narwhal-serve and measures TTFT and TPOT itself, the
per-leg HTTP overhead of the live stack measured from the router's journal, the simulator run
on the same fleet, profiles and workload, and the comparison of attainment and TTFT/TPOT
medians against a relative tolerance (10% in the issue).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from narwhal.contract import Budgets, FleetContract
from narwhal.fleetsim.simulator import DesConfig, DesResult, RequestSpec, run_des
from narwhal.fleetsim.workloads import timings_of
from narwhal.profiles.store import EngineModels

__all__ = [
    "Agreement",
    "LiveOutcome",
    "compare",
    "leg_overhead_s",
    "replay",
    "run_des_like_live",
]


@dataclass(frozen=True)
class LiveOutcome:
    status: int
    ttft: float | None = None  # seconds from sending to the first token with text
    tpot: float | None = None  # mean seconds between text tokens after the first


async def replay(
    url: str,
    specs: list[RequestSpec],
    model: str,
    lead_s: float = 0.2,
    timeout_s: float = 120.0,
) -> list[LiveOutcome]:
    """Open loop: each request at its arrival time (streamed, ``ignore_eos``, token-id
    prompts), one outcome per spec in order."""

    async def one(client: httpx.AsyncClient, i: int, spec: RequestSpec) -> LiveOutcome:
        await asyncio.sleep(max(0.0, t0 + spec.arrival - time.monotonic()))
        sent = time.monotonic()
        prompt = [300 + (i * 131 + k) % 9000 for k in range(spec.prompt_tokens)]
        times: list[float] = []
        async with client.stream(
            "POST",
            url + "/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": spec.output_tokens,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            if r.status_code != 200:
                return LiveOutcome(r.status_code)
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = orjson.loads(line[6:])
                    if any(c.get("text") for c in chunk.get("choices") or ()):
                        times.append(time.monotonic())
        if not times:
            return LiveOutcome(200)
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return LiveOutcome(200, times[0] - sent, tpot)

    limits = httpx.Limits(max_connections=max(200, len(specs)))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic() + lead_s
        return list(await asyncio.gather(*(one(client, i, s) for i, s in enumerate(specs))))


def leg_overhead_s(
    ends: Iterable[dict[str, Any]], timings: dict[str, EngineModels], default_prompt: int
) -> float:
    """What one HTTP leg costs on the live stack (router, client and engine servers on
    loopback), from the router's journal: the median, over prefill legs that had their engine to
    themselves (no other prefill leg on it overlapped), of the leg's duration less the time the
    simulated engine takes to prefill its prompt (its step timing, which the simulator replays).

    Legs that shared their engine carry queueing, which the simulator produces itself (under a
    saturating load the median leg is mostly queue); all legs count only when fewer than five
    ran alone. Not less the *profiled* prefill time: a profile measured through HTTP has the
    overhead in its intercept already, and the difference would hide it."""
    legs: list[tuple[str, float, float, float]] = []  # engine, start, end, engine seconds
    for e in ends:
        start, end, arrival = e.get("t_prefill_start"), e.get("t_prefill_end"), e.get("arrival")
        engine = e.get("prefill_engine") or ""
        timing = timings.get(engine)
        if start is None or end is None or arrival is None or timing is None:
            continue
        tokens = e.get("prompt_tokens") or default_prompt
        engine_s = timing.wall(timing.prefill.chunk_seconds(0, tokens))
        legs.append((engine, arrival + start, arrival + end, engine_s))
    by_engine: dict[str, list[tuple[float, float]]] = {}
    for engine, start, end, _ in legs:
        by_engine.setdefault(engine, []).append((start, end))
    alone = [
        leg
        for leg in legs
        if sum(1 for s, e in by_engine[leg[0]] if s < leg[2] and e > leg[1]) == 1  # itself
    ]
    use = alone if len(alone) >= 5 else legs
    extra = [end - start - engine_s for _, start, end, engine_s in use]
    return max(0.0, statistics.median(extra)) if extra else 0.0


def run_des_like_live(
    fleet: FleetContract,
    models: dict[str, EngineModels],
    specs: list[RequestSpec],
    leg_overhead: float,
    transfer_s: float = 0.004,
) -> DesResult:
    """The simulator on the live run's fleet, profiles (the router's own models) and
    workload: scheduler v1 scoring every engine, as narwhal-serve does, flipping off."""
    return run_des(
        DesConfig(
            fleet,
            timings_of(fleet),
            scheduler="v1",
            flipping=False,
            transfer_s=transfer_s,
            leg_overhead_s=leg_overhead,
            candidates=None,
        ),
        specs,
        models,
    )


@dataclass(frozen=True)
class Agreement:
    offered: int
    live_attainment: float
    des_attainment: float
    live_ttft_p50: float
    des_ttft_p50: float
    live_tpot_p50: float
    des_tpot_p50: float
    live_failed: int
    leg_overhead_s: float

    @staticmethod
    def rel(des: float, live: float) -> float:
        """(des - live) / live; 0 when both are 0."""
        if live == 0:
            return 0.0 if des == 0 else float("inf")
        return (des - live) / live

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(quantity, live, des, relative difference)."""
        return [
            (
                "attainment",
                self.live_attainment,
                self.des_attainment,
                self.rel(self.des_attainment, self.live_attainment),
            ),
            (
                "ttft_p50_s",
                self.live_ttft_p50,
                self.des_ttft_p50,
                self.rel(self.des_ttft_p50, self.live_ttft_p50),
            ),
            (
                "tpot_p50_s",
                self.live_tpot_p50,
                self.des_tpot_p50,
                self.rel(self.des_tpot_p50, self.live_tpot_p50),
            ),
        ]

    def within(self, tolerance: float) -> bool:
        return all(abs(r) <= tolerance for _, _, _, r in self.rows())

    def report(self) -> str:
        parts = [f"leg overhead {self.leg_overhead_s:.4f} s"]
        for name, live, des, r in self.rows():
            parts.append(f"{name} live {live:.4f} des {des:.4f} ({r:+.1%})")
        return "; ".join(parts)


def compare(
    live: list[LiveOutcome], des: DesResult, budgets: Budgets, leg_overhead: float
) -> Agreement:
    """Attainment (met both budgets / offered) and medians of answered requests, both sides."""
    ttfts = [(o.ttft, o.tpot) for o in live if o.status == 200 and o.ttft is not None]
    met = sum(1 for t1, t2 in ttfts if t1 <= budgets.ttft_s and (t2 or 0.0) <= budgets.tpot_s)
    return Agreement(
        offered=len(live),
        live_attainment=met / len(live) if live else 0.0,
        des_attainment=des.attainment,
        live_ttft_p50=statistics.median(t1 for t1, _ in ttfts),
        des_ttft_p50=statistics.median(des.ttft),
        live_tpot_p50=statistics.median(t2 for _, t2 in ttfts if t2 is not None),
        des_tpot_p50=statistics.median(des.tpot),
        live_failed=len(live) - len(ttfts),
        leg_overhead_s=leg_overhead,
    )
