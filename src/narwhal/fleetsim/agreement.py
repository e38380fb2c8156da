"""The virtual-time simulator against the live simulated fleet, on the same workload.

Shared by the agreement test (``tests/integration/test_des_agreement.py``, small) and the
agreement benchmark (``bench/des_agreement.py``, larger): an open-loop client that replays a
list of ``RequestSpec`` through a running narwhal-serve; a calibration of the live stack that
does not depend on the workload that follows it; the simulator run on the same fleet,
profiles, calibration and workload; and the comparison of attainment and TTFT/TPOT p50 and
p90 against a relative tolerance (10% in the issue).

The live side of the comparison is what the router measured (``router_outcomes``: its
journal's timestamps, from each request's arrival to its first and last token), as the
simulator's figures are. The client measures too (``replay``), but it shares the two cores
with the router and eight engine processes: in a burst of the Azure trace its own event loop
fell behind by a quarter of a second at the median, which the router never saw (client TTFT
p50 1.576 s against the router's 1.314 s for the same run); its figures are reported beside
the router's, with that lag.

What the calibration measures, each once per fleet and whatever workload follows:

- **leg overhead**: what one HTTP leg costs beyond the engine's own steps (router, client and
  engine servers on loopback): requests sent one at a time, each prefill leg's duration less
  the wall seconds its prefill engine spent in steps meanwhile (the engine's
  ``narwhal_sim:step_seconds_total``); the median, with its spread over those legs;
- **host work per prefill**: what a prefill engine's host adds to its modelled steps for each
  prompt (taking the request, writing the prompt's KV, serving its pull; late wake-ups while
  other engine processes hold the two cores): the engine's measured step seconds less the
  seconds its model planned for them (``narwhal_sim:step_seconds_total`` less
  ``narwhal_sim:step_planned_seconds_total``), per prompt, under a steady open-loop load that
  keeps the prefill pool ``load`` busy (Poisson; 90% by default: host work grows with the
  contention, and it matters where queueing multiplies it, in a prefill pool near saturation),
  at two prompt lengths: a line over prompt length. It is work per prompt, not a factor on
  the step (the same load measured 1.05-1.07 times the planned step seconds with 1,024-token
  prompts, 1.03-1.06 with 2,048 and 1.04-1.06 with 4,096), and it is larger under load than
  alone (contention for the cores);
- **KV transfer**: each isolated request's pull time (``vllm:nixl_xfer_time_seconds``) against
  its prompt length, fitted as a line: the transfer grows with the KV's bytes.

For a router without a journal (vllm-router, against the simulator's baseline policies:
``bench/baselines_agreement.py``, ``tests/integration/test_baselines_agreement.py``) the live
side is the client's own timing (``narwhal.testing.replay.replay_streams``), and goodput is
compared: attainment at a few rates (``attainment``; ``des_attainment`` without Narwhal's
first-token deadline), and the rate where it crosses the target interpolated between them
(``narwhal.testing.goodput.crossing_of``).

The simulator also holds each engine's KV cache to its blocks (``KVBlocks``) as the live
engines do: under saturation a decode engine full of long prompts makes the next decode leg
wait for blocks, which is most of the live TTFT tail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from narwhal.contract import Budgets, FleetContract
from narwhal.engines.scrape import metric_sum
from narwhal.fleetsim.simulator import DesConfig, DesResult, RequestSpec, run_des
from narwhal.fleetsim.workloads import kv_blocks_of, timings_of
from narwhal.profiles.store import EngineModels

__all__ = [
    "Agreement",
    "Calibration",
    "LiveOutcome",
    "attainment",
    "calibrate",
    "compare",
    "des_attainment",
    "engine_counters",
    "host_seconds",
    "live_hit_rate",
    "replay",
    "router_outcomes",
    "run_des_like_live",
    "step_inflation",
]

_COUNTERS = (
    "narwhal_sim:step_seconds_total",
    "narwhal_sim:step_planned_seconds_total",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
)


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
    id_prefix: str | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
) -> list[LiveOutcome]:
    """Open loop: each request at its arrival time (streamed, ``ignore_eos``, token-id
    prompts: ``prompts[i]`` when given, else ids of its own), one outcome per spec in order.
    With ``id_prefix``, request i is sent with ``X-Request-Id: <id_prefix>-<i>`` (the
    journal's ``client_request_id``)."""

    async def one(client: httpx.AsyncClient, i: int, spec: RequestSpec) -> LiveOutcome:
        try:
            return await send(client, i, spec)
        except httpx.HTTPError:
            return LiveOutcome(0)  # no answer (connection lost, timed out): failed

    async def send(client: httpx.AsyncClient, i: int, spec: RequestSpec) -> LiveOutcome:
        await asyncio.sleep(max(0.0, t0 + spec.arrival - time.monotonic()))
        sent = time.monotonic()
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": spec.output_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        if prompts is not None:
            body["prompt"] = list(prompts[i])
        else:
            body["prompt"] = [300 + (i * 131 + k) % 9000 for k in range(spec.prompt_tokens)]
            # Requests of their own: without a salt, every call's request 0 (each calibration
            # probe among them) sent the same ids, and the engines' prefix caches served them.
            body["cache_salt"] = f"{id_prefix or 'replay'}-{i}-{salt}"
        times: list[float] = []
        headers = {"X-Request-Id": f"{id_prefix}-{i}"} if id_prefix else None
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
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

    salt = uuid.uuid4().hex[:12]  # one per call: calls reuse request numbers and prefixes
    limits = httpx.Limits(max_connections=max(200, len(specs)))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:
        t0 = time.monotonic() + lead_s
        return list(await asyncio.gather(*(one(client, i, s) for i, s in enumerate(specs))))


def live_hit_rate(records: Iterable[dict[str, Any]], id_prefix: str) -> float:
    """Prompt tokens the engines reported cached (``cached_tokens_reported``: engines with
    prompt-tokens details) over prompt tokens, of the answered requests sent as ``id_prefix``."""
    cached = total = 0
    for r in records:
        if str(r.get("client_request_id", "")).startswith(f"{id_prefix}-") and (
            r.get("outcome") == "ok"
        ):
            cached += int(r.get("cached_tokens_reported") or 0)
            total += int(r.get("prompt_tokens") or 0)
    return cached / total if total else 0.0


def router_outcomes(
    records: Iterable[dict[str, Any]], count: int, id_prefix: str
) -> list[LiveOutcome]:
    """Request i's outcome as the router measured it, from its journal's request.end record
    (``client_request_id`` ``<id_prefix>-<i>``, as ``replay`` sends it): TTFT from its
    arrival to its first token, TPOT over the tokens after the first. A request the journal
    does not hold is failed with status 0."""
    by_id = {r.get("client_request_id"): r for r in records}
    out: list[LiveOutcome] = []
    for i in range(count):
        record = by_id.get(f"{id_prefix}-{i}")
        if record is None:
            out.append(LiveOutcome(0))
            continue
        status = int(record.get("status") or 0)
        first, last = record.get("t_first_token"), record.get("t_last_token")
        if record.get("outcome") != "ok" or first is None:
            out.append(LiveOutcome(status if status != 200 else 0))
            continue
        tokens = int(record.get("completion_tokens") or 0)
        tpot = (last - first) / (tokens - 1) if last is not None and tokens > 1 else None
        out.append(LiveOutcome(200, first, tpot))
    return out


async def engine_counters(engines: dict[str, str]) -> dict[str, dict[str, float]]:
    """The step and KV-transfer counters of each engine (id -> URL), read from its /metrics."""

    async def one(client: httpx.AsyncClient, url: str) -> dict[str, float]:
        page = (await client.get(url + "/metrics")).content
        return {name: metric_sum(page, name) or 0.0 for name in _COUNTERS}

    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        values = await asyncio.gather(*(one(client, u) for u in engines.values()))
    return dict(zip(engines, values, strict=True))


def _delta(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]], name: str
) -> dict[str, float]:
    return {e: after[e][name] - before[e][name] for e in after}


def step_inflation(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, float]:
    """Each engine's measured step seconds over its planned ones between two readings (engines
    that stepped for less than 50 ms of planned time are left out: too little to tell)."""
    wall = _delta(after, before, "narwhal_sim:step_seconds_total")
    planned = _delta(after, before, "narwhal_sim:step_planned_seconds_total")
    return {e: wall[e] / planned[e] for e in wall if planned[e] >= 0.05}


def host_seconds(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    engine_ids: Iterable[str],
) -> float:
    """Measured less planned step seconds between two readings, summed over ``engine_ids``."""
    wall = _delta(after, before, "narwhal_sim:step_seconds_total")
    planned = _delta(after, before, "narwhal_sim:step_planned_seconds_total")
    return sum(wall[e] - planned[e] for e in engine_ids)


def _spread(values: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[0], ordered[-1]


@dataclass(frozen=True)
class Calibration:
    """What the live stack adds to the engines' modelled steps, measured apart from any
    workload (see the module docstring)."""

    leg_overhead_s: float  # median over isolated prefill legs
    leg_overhead_range_s: tuple[float, float]  # their min and max
    legs: int
    prefill_host_s: float  # host work per prompt under load ...
    prefill_host_s_per_token: float  # ... and per prompt token
    isolated_host: list[tuple[int, float]]  # (prompt tokens, host seconds) of isolated prompts
    loaded_host: list[tuple[int, float]]  # (prompt tokens, host seconds per prompt) under load
    transfer_s: float  # KV pull: intercept ...
    transfer_s_per_token: float  # ... and seconds per prompt token
    transfers: list[tuple[int, float]]  # (prompt tokens, pull seconds) of the isolated requests

    def host_s(self, tokens: float) -> float:
        """The host work the simulator adds for one prompt of ``tokens`` tokens."""
        return self.prefill_host_s + self.prefill_host_s_per_token * tokens

    def with_host_s(self, host_s: float, tokens: float) -> Calibration:
        """This calibration with its host work per prompt moved (same slope) to ``host_s`` for
        prompts of ``tokens`` tokens: how a run's own measurement is given to the simulator."""
        base = max(0.0, host_s - self.prefill_host_s_per_token * tokens)
        return dataclasses.replace(self, prefill_host_s=base)

    def report(self) -> str:
        lo, hi = self.leg_overhead_range_s
        loaded = ", ".join(f"{n} tokens {h * 1000:.1f} ms" for n, h in self.loaded_host)
        return (
            f"leg overhead {self.leg_overhead_s * 1000:.1f} ms (median of {self.legs} isolated "
            f"legs, range {lo * 1000:.1f}..{hi * 1000:.1f} ms); host work per prefill "
            f"{self.prefill_host_s * 1000:.2f} ms + {self.prefill_host_s_per_token * 1e6:.3f} "
            f"us/token (under load: {loaded}); KV transfer {self.transfer_s * 1000:.2f} ms + "
            f"{self.transfer_s_per_token * 1e6:.3f} us/token ({len(self.transfers)} pulls)"
        )


def _fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both at least 0; (median, 0) when x does not vary or
    the fitted slope is negative (a first pull to a new peer sets up its side channel: on
    loopback that, not the bytes, is what varies)."""
    xs = [float(x) for x, _ in points]
    ys = [y for _, y in points]
    if not ys:
        return 0.0, 0.0
    if len(set(xs)) >= 2:
        slope, intercept = statistics.linear_regression(xs, ys)
        if slope >= 0:
            return max(0.0, intercept), slope
    return max(0.0, statistics.median(ys)), 0.0


async def calibrate(
    url: str,
    engines: dict[str, str],
    timings: dict[str, EngineModels],
    prefill_ids: Sequence[str],
    model: str,
    ends: Callable[[int], list[dict[str, Any]]],
    sizes: Sequence[int] = (512, 2048, 4096),
    isolated: int = 12,
    load: float = 0.9,
    loaded_sizes: Sequence[int] = (1024, 4096),
    loaded_per_engine: int = 20,
    seed: int = 0,
) -> Calibration:
    """Calibrate the live stack behind the router at ``url`` (its engines: id -> URL, their
    step timings, and which of them prefill).

    ``ends(n)`` returns the router journal's request.end records once it holds ``n`` of them
    (every request the router saw so far, calibration included). Isolated requests go one at
    a time, cycling through ``sizes`` (2 output tokens); then, for each of ``loaded_sizes``,
    ``loaded_per_engine`` requests per prefill engine (16 output tokens) arrive as a Poisson
    stream that keeps the prefill pool ``load`` busy."""
    transfers: list[tuple[int, float]] = []
    # Request id -> (prompt tokens, each engine's step seconds and host seconds while it ran).
    alone: dict[str, tuple[int, dict[str, float], dict[str, float]]] = {}
    for i in range(isolated):
        n = sizes[i % len(sizes)]
        before = await engine_counters(engines)
        out = await replay(url, [RequestSpec(0.0, n, 2)], model, lead_s=0.0, id_prefix=f"cal{i}")
        if out[0].status != 200:
            raise RuntimeError(f"calibration request answered HTTP {out[0].status}")
        after = await engine_counters(engines)
        alone[f"cal{i}-0"] = (
            n,
            _delta(after, before, "narwhal_sim:step_seconds_total"),
            {e: host_seconds(before, after, [e]) for e in engines},
        )
        pulls = sum(_delta(after, before, "vllm:nixl_xfer_time_seconds_count").values())
        seconds = sum(_delta(after, before, "vllm:nixl_xfer_time_seconds_sum").values())
        if round(pulls) == 1:
            transfers.append((n, seconds))
    records = {r.get("client_request_id"): r for r in ends(isolated)}
    overheads: list[float] = []
    isolated_host: list[tuple[int, float]] = []
    for rid, (n, steps, host) in alone.items():
        record = records.get(rid)
        if record is None or record.get("t_prefill_end") is None:
            continue
        engine = str(record.get("prefill_engine"))
        leg = record["t_prefill_end"] - record["t_prefill_start"]
        overheads.append(leg - steps.get(engine, 0.0))
        isolated_host.append((n, host.get(engine, 0.0)))
    if not overheads:
        raise RuntimeError("no isolated calibration leg reached the journal")
    rng = random.Random(seed)
    loaded_host: list[tuple[int, float]] = []
    for size in loaded_sizes:
        engine_s = statistics.fmean(
            t.wall(t.prefill.chunk_seconds(0, size)) for t in timings.values()
        )
        rate = load * len(prefill_ids) / engine_s
        arrivals = itertools.accumulate(
            rng.expovariate(rate) for _ in range(loaded_per_engine * len(prefill_ids))
        )
        loaded = [RequestSpec(t, size, 16) for t in arrivals]
        before = await engine_counters(engines)
        out = await replay(url, loaded, model, id_prefix=f"calload{size}")
        after = await engine_counters(engines)
        if any(o.status != 200 for o in out):
            raise RuntimeError("a calibration request under load failed")
        spent = host_seconds(before, after, prefill_ids)
        loaded_host.append((size, spent / len(loaded)))
    prefill_host, per_token_host = _fit_line(loaded_host)
    transfer_s, per_token = _fit_line(transfers)
    return Calibration(
        leg_overhead_s=max(0.0, statistics.median(overheads)),
        leg_overhead_range_s=_spread(overheads),
        legs=len(overheads),
        prefill_host_s=prefill_host,
        prefill_host_s_per_token=per_token_host,
        isolated_host=isolated_host,
        loaded_host=loaded_host,
        transfer_s=transfer_s,
        transfer_s_per_token=per_token,
        transfers=transfers,
    )


def run_des_like_live(
    fleet: FleetContract,
    models: dict[str, EngineModels] | None,
    specs: list[RequestSpec],
    calibration: Calibration,
    scheduler: str = "v1",
    seed: int = 0,
    prefix_cache_tokens: int = 0,
) -> DesResult:
    """The simulator on the live run's fleet, profiles (the router's own models; None for a
    baseline, which predicts nothing), calibration and workload: scheduler v1 scoring every
    engine, as narwhal-serve does (or ``scheduler``, a baseline policy standing for another
    router; ``seed`` its random generator), flipping off, each engine's KV cache held to its
    blocks."""
    return run_des(
        DesConfig(
            fleet,
            timings_of(fleet),
            scheduler=scheduler,
            flipping=False,
            transfer_s=calibration.transfer_s,
            transfer_s_per_token=calibration.transfer_s_per_token,
            leg_overhead_s=calibration.leg_overhead_s,
            prefill_host_s=calibration.prefill_host_s,
            prefill_host_s_per_token=calibration.prefill_host_s_per_token,
            candidates=None,
            kv_blocks=kv_blocks_of(fleet),
            seed=seed,
            prefix_cache_tokens=prefix_cache_tokens,
        ),
        specs,
        models,
    )


def _quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile, interpolated between the two nearest values (as
    ``statistics.quantiles(method="inclusive")``), where a value may be infinite: a request
    that never got a first token."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    fraction = position - low
    if fraction == 0 or low + 1 >= len(ordered):
        return ordered[low]
    a, b = ordered[low], ordered[low + 1]
    if math.isinf(b):
        return b
    return a + (b - a) * fraction


@dataclass(frozen=True)
class Agreement:
    offered: int
    live_attainment: float
    des_attainment: float
    live_ttft: tuple[float, float]  # p50, p90
    des_ttft: tuple[float, float]
    live_tpot: tuple[float, float]
    des_tpot: tuple[float, float]
    live_failed: int
    # Why: the HTTP status of each failed live request (0: no answer) -> how many; and how
    # many the simulator rejected at admission or aborted at the first-token deadline.
    live_failures: dict[int, int] = field(default_factory=dict)
    des_rejected: int = 0
    des_deadline_missed: int = 0

    def failures(self) -> str:
        """The live failures by status and the simulator's rejections, for a report."""
        names = {0: "no answer", 200: "no token"}
        live = ", ".join(
            f"{n} x {names.get(status, status)}" for status, n in sorted(self.live_failures.items())
        )
        return (
            f"live failed {self.live_failed}{f' ({live})' if live else ''},"
            f" simulator rejected {self.des_rejected},"
            f" first-token deadline missed {self.des_deadline_missed}"
        )

    @staticmethod
    def rel(des: float, live: float) -> float:
        """(des - live) / live; 0 when both are equal (0 or infinite), infinite when only
        one is."""
        if des == live:
            return 0.0
        if live == 0 or math.isinf(live) or math.isinf(des):
            return float("inf")
        return (des - live) / live

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(quantity, live, des, relative difference)."""
        pairs = [
            ("attainment", self.live_attainment, self.des_attainment),
            ("ttft_p50_s", self.live_ttft[0], self.des_ttft[0]),
            ("ttft_p90_s", self.live_ttft[1], self.des_ttft[1]),
            ("tpot_p50_s", self.live_tpot[0], self.des_tpot[0]),
            ("tpot_p90_s", self.live_tpot[1], self.des_tpot[1]),
        ]
        return [(name, live, des, self.rel(des, live)) for name, live, des in pairs]

    def within(self, tolerance: float) -> bool:
        return all(abs(r) <= tolerance for _, _, _, r in self.rows())

    def report(self) -> str:
        return "; ".join(
            f"{name} live {live:.4f} des {des:.4f} ({r:+.1%})" for name, live, des, r in self.rows()
        )


def compare(live: list[LiveOutcome], des: DesResult, budgets: Budgets) -> Agreement:
    """Attainment (met both budgets / offered) and p50/p90 of TTFT over the offered requests
    (one never answered has an infinite TTFT) and of TPOT over the answered ones, both sides.

    TTFT over the answered requests alone rewards rejecting: the requests admission turns away
    in a burst are those that would have waited longest, so a side that rejected a few more
    showed a shorter tail (the Azure workload's first slice: 19 rejections live against 12
    simulated gave a TTFT p90 12% apart, over answered requests)."""
    answered = [(o.ttft, o.tpot) for o in live if o.status == 200 and o.ttft is not None]
    met = sum(1 for t1, t2 in answered if t1 <= budgets.ttft_s and (t2 or 0.0) <= budgets.tpot_s)
    never = float("inf")
    ttft = [t1 for t1, _ in answered] + [never] * (len(live) - len(answered))
    des_ttft = list(des.ttft) + [never] * (des.offered - len(des.ttft))
    tpot = [t2 for _, t2 in answered if t2 is not None]
    return Agreement(
        offered=len(live),
        live_attainment=met / len(live) if live else 0.0,
        des_attainment=des.attainment,
        live_ttft=(_quantile(ttft, 0.5), _quantile(ttft, 0.9)),
        des_ttft=(_quantile(des_ttft, 0.5), _quantile(des_ttft, 0.9)),
        live_tpot=(_quantile(tpot, 0.5), _quantile(tpot, 0.9)),
        des_tpot=(_quantile(des.tpot, 0.5), _quantile(des.tpot, 0.9)),
        live_failed=len(live) - len(answered),
        live_failures=dict(
            Counter(o.status for o in live if not (o.status == 200 and o.ttft is not None))
        ),
        des_rejected=des.rejected,
        des_deadline_missed=des.deadline_missed,
    )


# --- Any router in front of the fleet: the client's own timing, attainment and goodput -------


def attainment(outcomes: Sequence[LiveOutcome], budgets: Budgets) -> float:
    """Met both budgets / offered."""
    met = sum(
        1
        for o in outcomes
        if o.status == 200
        and o.ttft is not None
        and o.ttft <= budgets.ttft_s
        and (o.tpot or 0.0) <= budgets.tpot_s
    )
    return met / len(outcomes) if outcomes else 0.0


def des_attainment(result: DesResult, specs: Sequence[RequestSpec], budgets: Budgets) -> float:
    """The simulator's attainment without Narwhal's first-token deadline (which the simulator
    counts against a request, as narwhal-serve would abort its decode leg): vllm-router has
    none, it waits. Needs every request to ask for at least 2 tokens (then the simulator's
    TTFT and TPOT lists are both one entry per answered request, in order)."""
    if any(s.output_tokens < 2 for s in specs):
        raise ValueError("des_attainment needs every request to generate at least 2 tokens")
    met = sum(
        1
        for t1, t2 in zip(result.ttft, result.tpot, strict=True)
        if t1 <= budgets.ttft_s and t2 <= budgets.tpot_s
    )
    return met / result.offered if result.offered else 0.0
