"""Load predictions for the slo gate: will a fleet meet its budgets at a planned load?

A plan point is judged by the **virtual-time fleet simulator** (``narwhal.fleetsim``): the
router's own scheduler v1, admission control and role controller on a virtual clock, over
engines stepped by the profiled latency models (a profile's fitted forms are the simulator's
step model), fed the point's Poisson arrivals (its rate and request count) with the KV transfer
the kv_transfer gate measured, replayed with several seeds and judged on the mean attainment.
``DES_METHOD`` says so in the report.

An **analytic** prediction is computed for every point as well (``METHOD``), reported beside the
simulation as a cross-check:

- **Prefill (TTFT)**: the prefill engines are an M/M/c queue (Poisson arrivals, ``c`` prefill
  engines, mean service time the profiled prefill at the workload's prompt length). The chance a
  request waits at most ``t`` is Erlang C's ``1 - C(c, a) * exp(-(c*mu - lambda) * t)``.
  Exponential service over-states the variance of a fixed-length prompt's prefill, so the
  waiting-time tail is pessimistic (M/D/c waits about half as long).
  TTFT = wait + prefill + handoff (the decode leg's first-token latency, measured by the
  kv_transfer gate when it ran, else one batch-1 decode step plus 20 ms of transfer).
- **Decode (TPOT)**: each decode engine is an infinite-server queue whose mean batch ``b``
  solves Little's law against the batch-dependent step time,
  ``b = (lambda/c_d) * out * (intercept + slope*b + ctx_coef*ctx)``; the batch a request sees is
  Poisson with that mean, and its TPOT is the step time at that batch. Using the instantaneous
  batch (a request's TPOT really averages its lifetime) makes the tail pessimistic.
- attainment = P(TTFT within budget) * P(TPOT within budget), zero when the mean end-to-end
  time exceeds the point's timeout or a queue is unstable (utilisation >= 1). It does not model
  the first-token deadline or admission control; the simulator does.

When the fleet's role controller is enabled, every split of role-flexible engines that respects
the role minimums is tried (small fleets) and the best is used: that is the allocation the
controller exists to reach; the initial allocation's prediction is reported next to it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from narwhal.contract import Budgets, FleetContract
from narwhal.fleetsim.simulator import DesConfig, run_des
from narwhal.fleetsim.workloads import poisson_requests
from narwhal.profiles.store import EngineModels

__all__ = [
    "DEFAULT_TRANSFER_S",
    "DES_METHOD",
    "DES_REPLAYS",
    "METHOD",
    "Allocation",
    "LoadPoint",
    "PointPrediction",
    "SimulatedPoint",
    "allocations",
    "best_prediction",
    "erlang_c",
    "poisson_cdf",
    "predict_point",
    "simulate_point",
]

METHOD = (
    "analytic: M/M/c Erlang-C prefill queue + Little's-law decode batch with a Poisson batch tail"
)
DES_METHOD = (
    "virtual-time simulator (narwhal.fleetsim): the router's scheduler v1, admission control and "
    "role controller over engines stepped by the profiled latency models, Poisson arrivals at "
    "the point's rate and request count, mean attainment over 5 seeded replays"
)
# What the router's predictor assumes for a KV transfer it has not observed yet.
DEFAULT_TRANSFER_S = 0.02
# Beyond this many role-flexible engines the split search would be exponential: initial roles.
MAX_SEARCH_ENGINES = 12


def erlang_c(servers: int, offered: float) -> float:
    """P(an arrival waits) in M/M/c with ``offered`` = lambda/mu < ``servers``."""
    if offered <= 0:
        return 0.0
    # Erlang B by its stable recurrence, then C from B.
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1 - rho + rho * b)


def poisson_cdf(k: float, mean: float) -> float:
    """P(N <= k) for N ~ Poisson(mean); k may be fractional (floored)."""
    if k < 0:
        return 0.0
    if mean <= 0:
        return 1.0
    n = math.floor(k)
    term = math.exp(-mean)
    total = term
    for i in range(1, n + 1):
        term *= mean / i
        total += term
        if total >= 1.0:
            return 1.0
    return min(total, 1.0)


@dataclass(frozen=True)
class Allocation:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]


@dataclass(frozen=True)
class LoadPoint:
    rate: float  # requests per second, Poisson
    input_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    timeout_s: float


@dataclass(frozen=True)
class PointPrediction:
    allocation: Allocation
    attainment: float
    p_ttft: float
    p_tpot: float
    prefill_utilisation: float
    prefill_s: float
    handoff_s: float
    mean_wait_s: float | None  # None when the prefill queue is unstable
    decode_batch: float | None  # None when decode is unstable
    tpot_s: float | None
    e2e_s: float | None
    limits: tuple[str, ...]  # what bounds the attainment, in words

    def document(self) -> dict[str, object]:
        return {
            "prefill_engines": list(self.allocation.prefill),
            "decode_engines": list(self.allocation.decode),
            "predicted_attainment": round(self.attainment, 6),
            "p_ttft_within_budget": round(self.p_ttft, 6),
            "p_tpot_within_budget": round(self.p_tpot, 6),
            "prefill_utilisation": round(self.prefill_utilisation, 6),
            "prefill_s": round(self.prefill_s, 6),
            "handoff_s": round(self.handoff_s, 6),
            "mean_prefill_wait_s": None if self.mean_wait_s is None else round(self.mean_wait_s, 6),
            "mean_decode_batch": None if self.decode_batch is None else round(self.decode_batch, 4),
            "mean_tpot_s": None if self.tpot_s is None else round(self.tpot_s, 6),
            "mean_e2e_s": None if self.e2e_s is None else round(self.e2e_s, 6),
            "limits": list(self.limits),
        }


def allocations(fleet: FleetContract) -> list[Allocation]:
    """The initial allocation first, then (role control on, small fleet) every other split of
    the engines into the two roles that the role minimums and KV pairs allow."""
    initial = Allocation(
        tuple(e.id for e in fleet.engines if e.initial_role == "prefill"),
        tuple(e.id for e in fleet.engines if e.initial_role == "decode"),
    )
    out = [initial]
    if not fleet.roles.enabled or len(fleet.engines) > MAX_SEARCH_ENGINES:
        return out
    choices = [list(e.roles) for e in fleet.engines]
    for roles in itertools.product(*choices):
        p = tuple(e.id for e, r in zip(fleet.engines, roles, strict=True) if r == "prefill")
        d = tuple(e.id for e, r in zip(fleet.engines, roles, strict=True) if r == "decode")
        candidate = Allocation(p, d)
        if candidate == initial:
            continue
        if len(p) < max(1, fleet.roles.min_prefill) or len(d) < max(1, fleet.roles.min_decode):
            continue
        if not any(fleet.is_permitted(a, b) for a in p for b in d):
            continue
        out.append(candidate)
    return out


def predict_point(
    allocation: Allocation,
    models: Mapping[str, EngineModels],
    point: LoadPoint,
    handoff_s: float | None,
) -> PointPrediction:
    """One allocation at one load point; see the module docstring for the method."""
    rate, input_tokens, output_tokens = point.rate, point.input_tokens, point.output_tokens
    ttft_s, tpot_s, timeout_s = point.ttft_s, point.tpot_s, point.timeout_s
    limits: list[str] = []
    prefill_times = [models[e].prefill.predict(input_tokens).seconds for e in allocation.prefill]
    prefill_s = sum(prefill_times) / len(prefill_times)
    c_p = len(allocation.prefill)
    offered = rate * prefill_s
    utilisation = offered / c_p
    context = input_tokens + output_tokens / 2
    decoders = [models[e].decode for e in allocation.decode]
    intercept = sum(d.intercept + d.ctx_coef * context for d in decoders) / len(decoders)
    slope = sum(d.slope for d in decoders) / len(decoders)
    step_1 = intercept + slope  # a batch of one
    handoff = handoff_s if handoff_s is not None else step_1 + DEFAULT_TRANSFER_S

    # Prefill queue.
    mean_wait: float | None = None
    if utilisation >= 1:
        p_ttft = 0.0
        limits.append(f"prefill utilisation {utilisation:.2f} >= 1 (unstable)")
    else:
        mu = 1 / prefill_s
        wait_prob = erlang_c(c_p, offered)
        mean_wait = wait_prob / (c_p * mu - rate)
        slack = ttft_s - prefill_s - handoff
        if slack < 0:
            p_ttft = 0.0
            limits.append(
                f"prefill {prefill_s:.3f} s + handoff {handoff:.3f} s exceed the TTFT budget "
                f"{ttft_s} s with no queueing at all"
            )
        else:
            p_ttft = 1 - wait_prob * math.exp(-(c_p * mu - rate) * slack)
            if p_ttft < 1 - 1e-9:
                limits.append(f"prefill queueing: P(TTFT <= {ttft_s} s) = {p_ttft:.4f}")

    # Decode batch.
    per_engine = rate / len(allocation.decode)
    denominator = 1 - per_engine * output_tokens * slope
    batch: float | None = None
    tpot: float | None = None
    if denominator <= 0:
        p_tpot = 0.0
        limits.append("decode batch grows without bound (step time rises faster than it drains)")
    else:
        batch = per_engine * output_tokens * intercept / denominator
        tpot = intercept + slope * max(1.0, batch)
        if slope > 0:
            # Largest batch whose step time is within budget; the batch is Poisson(batch).
            max_batch = (tpot_s - intercept) / slope
            # A request always decodes in a batch that includes itself: N = 1 + Poisson(b).
            p_tpot = poisson_cdf(max_batch - 1, batch)
        else:
            p_tpot = 1.0 if intercept <= tpot_s else 0.0
        if intercept + slope > tpot_s:
            p_tpot = 0.0
        if p_tpot < 1 - 1e-9:
            limits.append(f"decode batching: P(TPOT <= {tpot_s} s) = {p_tpot:.4f}")

    e2e: float | None = None
    attainment = p_ttft * p_tpot
    if mean_wait is not None and tpot is not None:
        e2e = mean_wait + prefill_s + handoff + (output_tokens - 1) * tpot
        if e2e > timeout_s:
            attainment = 0.0
            limits.append(f"mean end-to-end {e2e:.2f} s exceeds the timeout {timeout_s} s")
    return PointPrediction(
        allocation=allocation,
        attainment=attainment,
        p_ttft=p_ttft,
        p_tpot=p_tpot,
        prefill_utilisation=utilisation,
        prefill_s=prefill_s,
        handoff_s=handoff,
        mean_wait_s=mean_wait,
        decode_batch=batch,
        tpot_s=tpot,
        e2e_s=e2e,
        limits=tuple(limits),
    )


def best_prediction(
    models: Mapping[str, EngineModels],
    candidates: Sequence[Allocation],
    point: LoadPoint,
    handoff_s: float | None,
) -> tuple[PointPrediction, PointPrediction]:
    """(initial allocation's prediction, best allocation's prediction); ``candidates[0]`` is the
    initial allocation."""
    predictions = [predict_point(a, models, point, handoff_s) for a in candidates]
    best = max(predictions, key=lambda p: p.attainment)  # first (initial) wins ties
    return predictions[0], best


@dataclass(frozen=True)
class SimulatedPoint:
    attainment: float  # mean over the replays
    per_seed: tuple[float, ...]
    summary: dict[str, object]  # pooled over the replays
    transfer_s: float
    timed_out: int  # requests within both budgets whose end-to-end time passed the timeout


# Replays per point: one finite Poisson sample can start with a burst the role controller has
# not reacted to yet; the mean over a few seeds is the expectation the verdict needs.
DES_REPLAYS = 5


def simulate_point(
    fleet: FleetContract,
    models: Mapping[str, EngineModels],
    point: LoadPoint,
    requests: int,
    seed: int,
    handoff_s: float | None,
) -> SimulatedPoint:
    """The point replayed ``DES_REPLAYS`` times (seeds ``seed`` onwards) through the
    virtual-time simulator."""
    timings = dict(models)  # the simulated engines step as the profiled models say
    context = point.input_tokens + point.output_tokens / 2
    step_1 = sum(m.decode.seconds_per_token(1, context) for m in models.values()) / len(models)
    # The measured first-token latency is the KV pull plus about one decode step.
    transfer = max(0.0, handoff_s - step_1) if handoff_s is not None else DEFAULT_TRANSFER_S
    sims = [e.sim for e in fleet.engines if e.sim is not None]
    # The point's own budgets drive admission and the SLO count; the fleet's deadline stays.
    budgets = Budgets(ttft_s=point.ttft_s, tpot_s=point.tpot_s, attainment=fleet.budgets.attainment)
    n = point.output_tokens
    # The simulator has no client timeout. A request inside both budgets can only time out if
    # the budgets themselves allow it; such requests are counted (conservatively) as misses.
    timeout_binds = n > 1 and point.ttft_s + (n - 1) * point.tpot_s > point.timeout_s
    attainments: list[float] = []
    totals = {"offered": 0, "completed": 0, "rejected": 0, "met_slo": 0, "deadline_missed": 0}
    ttft: list[float] = []
    tpot: list[float] = []
    flips = 0
    timed_out = 0
    for replay in range(DES_REPLAYS):
        config = DesConfig(
            fleet=fleet.model_copy(update={"budgets": budgets}),
            timings=timings,
            scheduler="v1",
            flipping=fleet.roles.enabled,
            transfer_s=transfer,
            max_num_seqs=min((s.max_num_seqs for s in sims), default=64),
            max_num_batched_tokens=min((s.max_num_batched_tokens for s in sims), default=8192),
            seed=seed + replay,
        )
        specs = poisson_requests(
            point.rate, requests, point.input_tokens, point.output_tokens, seed=seed + replay
        )
        result = run_des(config, specs, models=dict(models))
        late = 0
        if timeout_binds:
            late = sum(
                1
                for t1, t2 in zip(result.ttft, result.tpot, strict=False)
                if t1 <= point.ttft_s and t2 <= point.tpot_s and t1 + (n - 1) * t2 > point.timeout_s
            )
        met = max(0, result.met_slo - late)
        attainments.append(met / result.offered if result.offered else 0.0)
        totals["offered"] += result.offered
        totals["completed"] += result.completed
        totals["rejected"] += result.rejected
        totals["met_slo"] += met
        totals["deadline_missed"] += result.deadline_missed
        ttft += result.ttft
        tpot += result.tpot
        flips += len(result.flips)
        timed_out += late

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 6)

    summary: dict[str, object] = {
        **totals,
        "replays": DES_REPLAYS,
        "flips": flips,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p95_s": pct(ttft, 0.95),
        "tpot_p50_s": pct(tpot, 0.5),
        "tpot_p95_s": pct(tpot, 0.95),
    }
    return SimulatedPoint(
        attainment=sum(attainments) / len(attainments),
        per_seed=tuple(round(a, 4) for a in attainments),
        summary=summary,
        transfer_s=transfer,
        timed_out=timed_out,
    )
