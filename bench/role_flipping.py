"""Role flipping under a phase-shifting workload: flipping on against static prefill/decode splits.

Workload: a window of the Azure LLM inference **code** trace (long prompts, short answers)
followed by a window of the **conversation** trace (shorter prompts, long answers), each
``--phase-s`` seconds long. Traces: Azure Public Dataset, AzureLLMInferenceTrace_code.csv and
_conv.csv, 2023-11-16 (Patel et al., "Splitwise: Efficient generative LLM inference using phase
splitting", ISCA 2024; CC-BY 4.0). Each request keeps its trace row's ContextTokens (clipped to
8,192) and GeneratedTokens; arrivals keep the trace's TIMESTAMP pattern, compressed so that the
window's mean rate is the phase's rate (``poisson`` in ``--des8-arrivals`` instead draws the
arrival times uniformly over the phase: a Poisson process with the same count; des8 only).

Rates (the saturation computation, printed in the output): on the simulator's calibration
(``narwhal.simengine.timing.CALIBRATION``, model seconds: prefill of n tokens
a + b*n + c*n^2 = 0.02 + 1e-4*n + 1.2e-9*n^2, decode step 0.24 + 0.0015*batch + 1.3e-7*context)
and budgets TTFT 10 s, TPOT 0.3 s,

- a prefill engine serves 1 / mean(prefill_s(prompt)) requests/s;
- a decode engine meets the TPOT budget up to batch B* = floor((0.3 - 0.24 - 1.3e-7*ctx) /
  0.0015) (capped at max_num_seqs 64), i.e. B* / step(B*) tokens/s, ctx = mean prompt + half
  the mean output;
- the code phase's bottleneck under the 4/4 split is the prefill pool: rate =
  ``--load`` x 4 / mean prefill s; the conversation phase's is the decode pool: rate =
  ``--load`` x 4 x tokens/s per engine / mean output tokens. ``--load 1`` (default): each phase
  alone offers exactly the bottleneck pool's capacity. Fleets of N engines get N/8 times these
  rates (N/8 copies of the window, each from another start row, superposed).

Systems: (a) flipping on (narwhal-serve / the simulator with scheduler v1 and the role
controller, starting at 4/4), (b) the best static split in hindsight (the split with the highest
goodput in the simulator's sweep), (c) the 4/4 split, (d) vllm-router 0.1.17
``--vllm-pd-disaggregation --policy round_robin`` on 4/4 (live only). Static narwhal runs use
scheduler v1 with the role controller off (``roles.enabled: false``).

Settings:

- ``des8``: the virtual-time simulator (``narwhal.fleetsim``), 8 engines, real time; static
  splits 1..7 prefill engines, flipping with the fleet's default limits (cooldown 60 s, dwell
  120 s, tick 5 s). With ``--des8-arrivals trace,poisson`` both arrival models are run
  (``des8_poisson`` is a sensitivity row);
- ``des512``: the simulator, 512 engines, ``--des512-phase-s`` phases; static splits searched
  on a 32-engine grid (hill climbing from the 8-engine best scaled up, plus 256/256), flipping
  with the limits of ``--des512-roles`` (one flip per tick: the 8-engine cooldown moves 1/8 of
  the fleet a minute, this keeps a comparable pace at 512); scheduler v1 samples
  ``--des512-candidates`` engines per role (8 by default: 32, the simulator's default, is about
  four times slower per request on this 2-core machine);
- ``live8``: 8 simulated engines (``narwhal.simengine``) as processes at ``--time-scale`` S
  (budgets and the role controller's limits divided by S, rates multiplied by S), profiled once
  by narwhal-profile (decode concurrency 1,2,4 x 64 tokens, as bench/goodput.py); each system
  gets its own router in front of the same engines, in turn, on the same ``--live-phase-s``
  workload; the client sends each request at its arrival (streamed, ``ignore_eos``) and
  measures TTFT and TPOT itself. ``des8_livewindow`` replays that very workload in the
  simulator, for comparison.

Warm-up: in des8 and des512 the workload starts ``dwell_s`` after the fleet, so the initial
split may flip at once (a fleet that has run a while); live8 (and des8_livewindow, its replay)
start with the router, so no engine may flip in the first ``dwell_s`` (120 s real).

Scoring (all settings alike): the run is the offered window (2 x phase) plus ``--tail-s``; a
request is *scored* when it could finish inside the run at the budgets (arrival + TTFT budget +
(output - 1) x TPOT budget <= end of run); it *meets the SLO* when it answered, all its tokens
arrived by the end of the run, TTFT <= budget and TPOT <= budget (and, in the simulator, the
decode handoff met the first-token deadline). Rejected (429), failed and cut-off requests are
offered and missed. Attainment = met / scored; goodput = met / window seconds (real time).

    .venv/bin/python bench/role_flipping.py [--settings des8,des512,live8] [--load 1.0]
        [--phase-s 450] [--live-phase-s 100] [--time-scale 2] [--keep-dir]

Only 127.0.0.1 is contacted. Progress goes to stderr; ``name: value`` rows, a table and the
ratio lines ``ratio_goodput_flipping_over_4_4_<setting>`` and
``ratio_goodput_flipping_over_best_static_<setting>`` go to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from narwhal.fleetsim.simulator import (
    DesConfig,
    RequestSpec,
    _Simulation,  # run_des keeps no per-request outcomes; the per-phase split needs them
)
from narwhal.fleetsim.workloads import read_azure_trace, synthetic_fleet
from narwhal.serve.cli import serve_command
from narwhal.simengine.timing import CALIBRATION
from narwhal.testing import aio, procfs, procs
from narwhal.testing.fleet import SimFleet, fleet_load, start_local_fleet, wait_idle
from narwhal.testing.ports import free_ports
from narwhal.testing.profiling import profile_fleet
from narwhal.testing.rawhttp import TRANSPORT_ERRORS, StreamTimes, post_stream
from narwhal.testing.routers import peer_router_command, router_ready
from narwhal.testing.stats import median
from narwhal.testing.traces import trace_dir

MODEL = "moonshotai/Kimi-K3"
REAL_TTFT_S = 10.0
REAL_TPOT_S = 0.3
FIRST_TOKEN_FRACTION = 0.85  # first_token_timeout_s = 0.85 x TTFT budget, as in bench/goodput.py
MAX_MODEL_LEN = 16384
MAX_PROMPT = MAX_MODEL_LEN // 2
MAX_NUM_SEQS = 64
BASE_ENGINES = 8
DATA_DIR = trace_dir("azure-llm-2023", Path(__file__).resolve().parents[1])
TRACES = {"code": "AzureLLMInferenceTrace_code.csv", "conv": "AzureLLMInferenceTrace_conv.csv"}
ATTRIBUTION = (
    'Azure LLM inference traces 2023-11-16 (Patel et al., "Splitwise: Efficient generative LLM '
    'inference using phase splitting", ISCA 2024; CC-BY 4.0)'
)
# The fleet's default role-control limits (narwhal.contract RoleControl), real seconds.
ROLES_8 = {"min_prefill": 1, "min_decode": 1, "cooldown_s": 60.0, "dwell_s": 120.0, "tick_s": 5.0}
WORD_IDS = (256, 10256)  # the simulator's word tokens
PREFILL, DECODE = CALIBRATION.prefill, CALIBRATION.decode
SETTINGS = ("des8", "des512", "live8")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Workload and the saturation computation


def prefill_s(n: int) -> float:
    return PREFILL.chunk_seconds(0, n)  # as the engines compute it


def decode_capacity(context: float) -> tuple[int, float, float]:
    """(B*, step seconds at B*, tokens/s) of one decode engine within the TPOT budget."""
    i, s, k = DECODE.intercept, DECODE.slope, DECODE.ctx_coef
    b = max(1, min(MAX_NUM_SEQS, math.floor((REAL_TPOT_S - i - k * context) / s)))
    step = DECODE.seconds_per_token(b, context)
    return b, step, b / step


@dataclass
class Phase:
    name: str  # code | conv
    start_row: int
    n: int  # requests per copy
    rate: float  # requests/s per 8 engines
    mean_prompt: float
    mean_gen: float
    mean_prefill_s: float
    batch_star: int
    tokens_per_s: float  # one decode engine at B*
    prefill_load: float  # utilisation of the 4 prefill engines of the 4/4 split
    decode_load: float  # utilisation of the 4 decode engines of the 4/4 split (at B*)
    ideal_prefill: float  # engines of 8 that should prefill: share of engine-seconds


def plan_phase(
    name: str, rows: list[tuple[float, int, int]], start: int, phase_s: float, load: float
) -> Phase:
    """The phase's rate for 8 engines: its bottleneck pool of the 4/4 split at ``load``."""
    n = min(len(rows) - start - 1, 1000)
    rate = 0.0
    for _ in range(6):  # the window's statistics depend on its length, which depends on rate
        w = rows[start : start + n]
        mp = sum(prefill_s(p) for _, p, _ in w) / len(w)
        mg = sum(g for _, _, g in w) / len(w)
        prompt = sum(p for _, p, _ in w) / len(w)
        b, _, tps = decode_capacity(prompt + mg / 2)
        rate = load * 4 / mp if name == "code" else load * 4 * tps / mg
        new_n = max(2, round(rate * phase_s))
        if new_n > len(rows) - start - 1:
            raise SystemExit(
                f"{name}: a {phase_s:g} s phase at {rate:.2f} req/s needs {new_n} rows from row"
                f" {start}; the trace has {len(rows)}: shorten --phase-s or --trace-start"
            )
        if new_n == n:
            break
        n = new_n
    w = rows[start : start + n]
    mp = sum(prefill_s(p) for _, p, _ in w) / n
    mg = sum(g for _, _, g in w) / n
    prompt = sum(p for _, p, _ in w) / n
    b, _, tps = decode_capacity(prompt + mg / 2)
    prefill_work, decode_work = mp, mg / tps  # engine-seconds per request in each pool
    return Phase(
        name=name,
        start_row=start,
        n=n,
        rate=n / phase_s,
        mean_prompt=prompt,
        mean_gen=mg,
        mean_prefill_s=mp,
        batch_star=b,
        tokens_per_s=tps,
        prefill_load=(n / phase_s) * mp / 4,
        decode_load=(n / phase_s) * mg / (4 * tps),
        ideal_prefill=8 * prefill_work / (prefill_work + decode_work),
    )


@dataclass
class Workload:
    specs: list[RequestSpec]
    phase_s: float
    copies: int

    @property
    def window_s(self) -> float:
        return 2 * self.phase_s

    def phase_of(self, spec: RequestSpec) -> int:
        return 0 if spec.arrival < self.phase_s else 1


def phase_specs(
    rows: list[tuple[float, int, int]],
    ph: Phase,
    start_row: int,
    offset: float,
    phase_s: float,
    arrivals: str,
    rng: random.Random,
) -> list[RequestSpec]:
    w = rows[start_row : start_row + ph.n + 1]  # one extra row: the window's end
    if arrivals == "poisson":
        times = sorted(rng.uniform(0, phase_s) for _ in range(ph.n))
    else:
        t0, span = w[0][0], w[-1][0] - w[0][0]
        k = phase_s / span if span > 0 else 0.0
        times = [(t - t0) * k for t, _, _ in w[: ph.n]]
    return [RequestSpec(offset + t, p, g) for t, (_, p, g) in zip(times, w[: ph.n], strict=True)]


def build_workload(
    traces: dict[str, list[tuple[float, int, int]]],
    phases: dict[str, Phase],
    phase_s: float,
    copies: int,
    arrivals: str,
    seed: int,
) -> Workload:
    """``copies`` superposed windows per phase, copy j starting ``j`` strides further on."""
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    for i, name in enumerate(("code", "conv")):
        rows, ph = traces[name], phases[name]
        room = len(rows) - ph.start_row - ph.n - 1
        for j in range(copies):
            start = ph.start_row + (round(j * room / copies) if copies > 1 else 0)
            specs += phase_specs(rows, ph, start, i * phase_s, phase_s, arrivals, rng)
    specs.sort(key=lambda s: s.arrival)
    return Workload(specs, phase_s, copies)


# --------------------------------------------------------------------------------------------
# Scoring


@dataclass
class Result:
    setting: str
    system: str  # flipping | static | vllm_router
    n_prefill: int
    n_engines: int
    kinds: list[str]  # one per request of the workload: ok, rejected, ttft, tpot, ...
    phases: list[int]
    scored: list[bool]
    window_s: float
    flips: list[dict[str, Any]] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # real seconds, answered requests
    tpot: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        split = f"{self.n_prefill}/{self.n_engines - self.n_prefill}"
        return f"{self.system} {split}" + (" start" if self.system == "flipping" else "")

    def met(self, phase: int | None = None) -> int:
        return sum(
            1
            for k, p, s in zip(self.kinds, self.phases, self.scored, strict=True)
            if s and k == "ok" and (phase is None or p == phase)
        )

    def n_scored(self, phase: int | None = None) -> int:
        return sum(
            1
            for p, s in zip(self.phases, self.scored, strict=True)
            if s and (phase is None or p == phase)
        )

    def attainment(self, phase: int | None = None) -> float:
        n = self.n_scored(phase)
        return self.met(phase) / n if n else 0.0

    @property
    def goodput(self) -> float:
        return self.met() / self.window_s

    def counts(self, phase: int | None = None) -> dict[str, int]:
        c: Counter[str] = Counter()
        for k, p, s in zip(self.kinds, self.phases, self.scored, strict=True):
            if s and (phase is None or p == phase):
                c[k] += 1
        return dict(sorted(c.items()))


def scored_mask(w: Workload, tail_s: float) -> list[bool]:
    end = w.window_s + tail_s
    return [
        s.arrival + REAL_TTFT_S + max(0, s.output_tokens - 1) * REAL_TPOT_S <= end for s in w.specs
    ]


# --------------------------------------------------------------------------------------------
# The simulator


def run_des_setting(
    setting: str,
    w: Workload,
    n_engines: int,
    n_prefill: int,
    flipping: bool,
    roles: dict[str, float],
    candidates: int | None,
    tail_s: float,
    lead_s: float = 0.0,
) -> Result:
    """One simulation; the workload starts ``lead_s`` after the fleet (a warm-up in which the
    initial split serves its dwell, as in a fleet that has run a while)."""
    budgets = {"ttft_s": REAL_TTFT_S, "tpot_s": REAL_TPOT_S}
    fleet, timings = synthetic_fleet(
        n_prefill,
        n_engines - n_prefill,
        budgets,
        time_scale=1.0,
        roles={"enabled": flipping, **roles},
        first_token_timeout_s=FIRST_TOKEN_FRACTION * REAL_TTFT_S,
    )
    shared = next(iter(timings.values())).in_wall_seconds()
    config = DesConfig(
        fleet,
        timings,
        scheduler="v1",
        flipping=flipping,
        max_num_seqs=MAX_NUM_SEQS,
        candidates=candidates,
    )
    started = time.monotonic()
    sim = _Simulation(config, {e: shared for e in timings})
    sim.run(
        [RequestSpec(s.arrival + lead_s, s.prompt_tokens, s.output_tokens) for s in w.specs]
        if lead_s
        else w.specs
    )
    horizon = lead_s + w.window_s + tail_s
    kinds = ["cut"] * len(w.specs)
    ttft, tpot = [], []
    for r in sim.requests:
        if r.outcome == "rejected":
            kinds[r.index] = "rejected"
            continue
        if r.outcome != "ok" or r.first_token is None or r.last_token is None:
            continue
        t1 = r.first_token - r.spec.arrival
        n = r.spec.output_tokens
        t2 = (r.last_token - r.first_token) / (n - 1) if n > 1 else 0.0
        ttft.append(t1)
        if n > 1:
            tpot.append(t2)
        if r.last_token > horizon:
            kinds[r.index] = "cut"
        elif t1 > REAL_TTFT_S:
            kinds[r.index] = "ttft"
        elif t2 > REAL_TPOT_S:
            kinds[r.index] = "tpot"
        elif r.deadline_missed:
            kinds[r.index] = "deadline"
        else:
            kinds[r.index] = "ok"
    return Result(
        setting=setting,
        system="flipping" if flipping else "static",
        n_prefill=n_prefill,
        n_engines=n_engines,
        kinds=kinds,
        phases=[w.phase_of(s) for s in w.specs],
        scored=scored_mask(w, tail_s),
        window_s=w.window_s,
        flips=[{**f, "t": f["t"] - lead_s} for f in sim.flips],
        ttft=ttft,
        tpot=tpot,
        wall_s=time.monotonic() - started,
    )


def describe_flips(flips: list[dict[str, Any]], limit: int = 12) -> str:
    if not flips:
        return "none"
    moves = Counter(f"{f['from_role'][0]}->{f['to_role'][0]}" for f in flips)
    head = ", ".join(
        f"t={float(f['t']):.0f}s {f['engine']} {f['from_role'][0]}->{f['to_role'][0]}"
        for f in flips[:limit]
    )
    more = f", ... ({len(flips) - limit} more)" if len(flips) > limit else ""
    return f"{len(flips)} ({dict(moves)}): {head}{more}"


# --------------------------------------------------------------------------------------------
# Live: the client


def own_cpu_seconds() -> float:
    """CPU seconds of this process and every process below it."""
    return procfs.tree_cpu_seconds(os.getpid())


@dataclass
class Outcome:
    status: int = 0
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    kind: str = "cut"  # ok | rejected | error | ttft | tpot | short | cut


async def send(
    port: int, body: bytes, request_id: str, expected: int, budgets: tuple[float, float]
) -> Outcome:
    out = Outcome()
    stream = StreamTimes()
    t0 = time.perf_counter()
    try:
        ok = await post_stream(port, body, request_id, stream)
    except TRANSPORT_ERRORS:
        out.status, out.kind = stream.status, "error"
        return out
    out.status = stream.status
    if not ok:
        out.kind = "rejected" if out.status == 429 else "error"
        return out
    out.tokens = stream.tokens
    if stream.first is not None and stream.last is not None:
        out.ttft = stream.first - t0
        if out.tokens > 1:
            out.tpot = (stream.last - stream.first) / (out.tokens - 1)
    ttft_b, tpot_b = budgets
    if stream.error or not stream.done:
        out.kind = "error"
    elif out.tokens < expected:
        out.kind = "short"
    elif out.ttft is None or out.ttft > ttft_b:
        out.kind = "ttft"
    elif out.tpot is not None and out.tpot > tpot_b:
        out.kind = "tpot"
    else:
        out.kind = "ok"
    return out


def build_bodies(w: Workload, seed: int) -> list[bytes]:
    """Fresh random prompts (no shared prefixes between systems or requests)."""
    rng = np.random.default_rng(seed)
    lo, hi = WORD_IDS
    return [
        orjson.dumps(
            {
                "model": MODEL,
                "prompt": rng.integers(lo, hi, size=s.prompt_tokens, dtype=np.int64),
                "max_tokens": s.output_tokens,
                "ignore_eos": True,
                "stream": True,
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        for s in w.specs
    ]


async def run_trial(
    port: int, w: Workload, bodies: list[bytes], scale: float, tail_s: float, tag: str
) -> tuple[list[Outcome], float]:
    """Each request at its arrival (wall = real / scale); stop at the end of the run."""
    budgets = (REAL_TTFT_S / scale, REAL_TPOT_S / scale)
    offsets = [s.arrival / scale for s in w.specs]
    outcomes = [Outcome() for _ in w.specs]
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.1
    wall0 = time.time() + 0.1

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - loop.time()))
        outcomes[i] = await send(port, bodies[i], f"{tag}-{i}", w.specs[i].output_tokens, budgets)

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(offsets))]
    horizon = (w.window_s + tail_s) / scale
    try:
        await asyncio.wait(tasks, timeout=max(0.0, t0 + horizon - loop.time()))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for i, task in enumerate(tasks):
        if not task.done() or task.cancelled():
            outcomes[i] = Outcome(kind="cut")
    return outcomes, wall0


@dataclass
class LiveSystem:
    key: str  # flipping | static_<p> | vllm_router
    system: str
    n_prefill: int


def router_fleet_doc(
    engine_doc: dict[str, Any], n_prefill: int, roles: dict[str, Any], name: str
) -> dict[str, Any]:
    doc = json.loads(json.dumps(engine_doc))
    for i, e in enumerate(doc["engines"]):
        e["initial_role"] = "prefill" if i < n_prefill else "decode"
    doc["roles"] = roles
    doc["name"] = name
    return doc


def run_live(
    args: argparse.Namespace,
    w: Workload,
    systems: list[LiveSystem],
    directory: Path,
    rows: list[tuple[str, str]],
    router_bin: Path,
) -> dict[str, Result]:
    scale = args.time_scale
    n = BASE_ENGINES
    sim = {
        "time_scale": scale,
        "num_blocks": 65536,
        "block_bytes": 1024,
        "max_num_seqs": MAX_NUM_SEQS,
    }
    engine_path = directory / "fleet-engines.json"
    fleet: SimFleet | None = None
    proc: subprocess.Popen[bytes] | None = None
    results: dict[str, Result] = {}
    try:
        log(f"live8: starting {n} simulated engines (time scale {scale:g}) in {directory}")
        fleet, doc = start_local_fleet(
            engine_path,
            n,
            log_dir=directory,
            on_retry=lambda exc: log(f"fleet did not start ({exc}); retrying on new ports"),
            initial_roles=["prefill"] * 4 + ["decode"] * 4,
            sim=sim,
            ttft_s=REAL_TTFT_S / scale,
            tpot_s=REAL_TPOT_S / scale,
            first_token_timeout_s=FIRST_TOKEN_FRACTION * REAL_TTFT_S / scale,
            max_model_len=MAX_MODEL_LEN,
            name="role-flipping-engines",
            role_control={"enabled": False},
        )
        urls = [fleet.engines[f"e{i}"].url for i in range(n)]
        log("live8: profiling the fleet (narwhal-profile)")
        t = time.perf_counter()
        store = profile_fleet(
            directory,
            engine_path,
            "--prefill-lens", "256,1024,4096,8192",
            "--decode-input-lens", "512,4096,8192",
            "--decode-concurrency", "1,2,4",
            "--decode-tokens", "64",
            "--prefill-repeats", "3",
            timeout=900,
        )  # fmt: skip
        rows.append(("live8_profile_wall_s", f"{time.perf_counter() - t:.1f}"))
        raw = json.loads(store.read_text())
        pf, df = raw["engines"]["e0"]["prefill_fit"], raw["engines"]["e0"]["decode_fit"]
        rows.append(
            (
                "live8_profile_e0",
                f"prefill a={pf['a'] * scale:.4f} b={pf['b'] * scale:.3e} c={pf['c'] * scale:.3e};"
                f" decode intercept={df['intercept'] * scale:.4f} slope={df['slope'] * scale:.5f}"
                f" ctx={df['ctx_coef'] * scale:.2e} (model s; calibration 0.02 1e-4 1.2e-9;"
                " 0.24 0.0015 1.3e-7)",
            )
        )
        log("live8: building request bodies")
        bodies = build_bodies(w, args.seed)
        scored = scored_mask(w, args.tail_s)
        phases = [w.phase_of(s) for s in w.specs]
        live_roles = {
            "enabled": True,
            **{k: (v / scale if k.endswith("_s") else v) for k, v in ROLES_8.items()},
        }
        for si, sys_ in enumerate(systems):
            if not wait_idle(urls, 120, 0.2):
                log(f"warning: fleet not idle before {sys_.key} (load {fleet_load(urls)})")
            port, prom = free_ports(2)
            journal = directory / f"{sys_.key}-journal.jsonl"
            log_path = directory / f"{sys_.key}.log"
            if sys_.system == "vllm_router":
                cmd = peer_router_command(
                    router_bin, urls[: sys_.n_prefill], urls[sys_.n_prefill :], port, prom
                )
            else:
                roles = live_roles if sys_.system == "flipping" else {"enabled": False}
                rdoc = router_fleet_doc(doc, sys_.n_prefill, roles, f"role-flipping-{sys_.key}")
                rpath = directory / f"fleet-{sys_.key}.json"
                rpath.write_text(json.dumps(rdoc, indent=2))
                cmd = serve_command(
                    rpath, port, journal,
                    "--skip-qualification",
                    "--profiles", str(store), "--scheduler", "v1",
                    "--log-level", "warning",
                )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            log(
                f"live8: starting {sys_.key} ({sys_.system}, {sys_.n_prefill}/{n - sys_.n_prefill})"
            )
            proc = procs.start(cmd, log_path)
            try:
                ready = functools.partial(router_ready, url, peer=sys_.system == "vllm_router")
                procs.wait_ready(ready, 60, process=proc, name=url, log=log_path)
                time.sleep(args.settle_s)  # load scrapes catch up with the idle fleet
                cpu0, own0 = procfs.machine_cpu_seconds(), own_cpu_seconds()
                t0 = time.perf_counter()
                coro = run_trial(port, w, bodies, scale, args.tail_s, f"{sys_.key}")
                outcomes, wall0 = aio.run(coro)
                wall = time.perf_counter() - t0
                cpus = os.cpu_count() or 1
                total, own = procfs.machine_cpu_seconds() - cpu0, own_cpu_seconds() - own0
            finally:
                procs.stop(proc)
                proc = None
            flips = []
            if journal.exists():
                for line in journal.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        rec = json.loads(line)
                        if rec.get("type") == "role.flip":
                            flips.append({**rec, "t": (float(rec["t"]) - wall0) * scale})
            res = Result(
                setting="live8",
                system=sys_.system,
                n_prefill=sys_.n_prefill,
                n_engines=n,
                kinds=[o.kind for o in outcomes],
                phases=phases,
                scored=scored,
                window_s=w.window_s,
                flips=flips,
                ttft=[o.ttft * scale for o in outcomes if o.ttft is not None],
                tpot=[o.tpot * scale for o in outcomes if o.tpot is not None],
                wall_s=wall,
                extra={
                    "cpu_util": f"{total / wall / cpus:.0%}",
                    "other_processes_cpu_util": f"{max(0.0, total - own) / wall / cpus:.0%}",
                    "load_average_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                },
            )
            results[sys_.key] = res
            log(
                f"live8 {sys_.key}: attainment {res.attainment():.3f} (code"
                f" {res.attainment(0):.3f}, conv {res.attainment(1):.3f}) goodput"
                f" {res.goodput:.3f} req/s, {len(flips)} flips, wall {wall:.0f}s, cpu"
                f" {res.extra['cpu_util']} (other processes"
                f" {res.extra['other_processes_cpu_util']})"
            )
            if si + 1 < len(systems) and not wait_idle(urls, 120, 0.2):
                log("warning: fleet still busy after the trial")
    finally:
        if proc is not None:
            procs.stop(proc)
        if fleet is not None:
            fleet.stop()
    return results


# --------------------------------------------------------------------------------------------
# Report


def src_state() -> str:
    """The commit and a digest of uncommitted changes under src/ (others edit it in parallel)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "diff", "HEAD", "--", "src"], cwd=root, capture_output=True
        ).stdout
    except OSError:
        return "unknown"
    dirty = f", uncommitted src diff sha256 {hashlib.sha256(diff).hexdigest()[:12]}" if diff else ""
    return f"commit {head}{dirty}"


def fmt_opt(x: float | None, digits: int = 2) -> str:
    return "nan" if x is None else f"{x:.{digits}f}"


def result_rows(r: Result) -> list[tuple[str, str]]:
    key = f"{r.setting}_{r.system}_{r.n_prefill}p{r.n_engines - r.n_prefill}d"
    out = [
        (
            key,
            f"goodput {r.goodput:.3f} req/s, attainment {r.attainment():.3f} (code"
            f" {r.attainment(0):.3f}, conv {r.attainment(1):.3f}), met {r.met()} of"
            f" {r.n_scored()} scored [{' '.join(f'{k}={v}' for k, v in r.counts().items())}],"
            f" ttft_p50 {fmt_opt(median(r.ttft))}s tpot_p50 {fmt_opt(median(r.tpot), 3)}s"
            f" (real), wall {r.wall_s:.1f}s",
        )
    ]
    for ph, name in ((0, "code"), (1, "conv")):
        c = r.counts(ph)
        out.append((f"{key}_{name}", " ".join(f"{k}={v}" for k, v in c.items())))
    if r.system == "flipping":
        out.append((f"{key}_flips", describe_flips(r.flips)))
    for k, v in r.extra.items():
        out.append((f"{key}_{k}", v))
    return out


def best_static(results: list[Result]) -> Result:
    statics = [r for r in results if r.system == "static"]
    half = statics[0].n_engines // 2
    return max(statics, key=lambda r: (round(r.goodput, 9), -abs(r.n_prefill - half)))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else ("inf" if a > 0 else "n/a")


# --------------------------------------------------------------------------------------------
# Main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help="comma-separated settings to run (default %(default)s)",
    )
    parser.add_argument(
        "--load",
        type=float,
        default=1.0,
        help="offered work / bottleneck pool capacity of the 4/4 split",
    )
    parser.add_argument("--phase-s", type=float, default=450.0, help="des8 phase (real s)")
    parser.add_argument(
        "--des8-arrivals",
        default="trace,poisson",
        help="comma-separated arrival models des8 runs, of trace, poisson (default %(default)s)",
    )
    parser.add_argument(
        "--des512-phase-s",
        type=float,
        default=40.0,
        help="des512 phase (real s) (default %(default)s)",
    )
    parser.add_argument(
        "--des512-candidates",
        type=int,
        default=8,
        help="engines per role scheduler v1 samples at 512 (default %(default)s)",
    )
    parser.add_argument(
        "--des512-roles",
        default="cooldown_s=1,dwell_s=120,tick_s=1",
        help="role-control limits at 512 engines (real s)",
    )
    parser.add_argument(
        "--des512-max-static",
        type=int,
        default=5,
        help="static splits simulated at 512 (hill climbing bound)",
    )
    parser.add_argument(
        "--live-phase-s",
        type=float,
        default=100.0,
        help="live8 phase (real s) (default %(default)s)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=2.0,
        help="live8 engines run this many times faster than real time (default %(default)s)",
    )
    parser.add_argument(
        "--tail-s",
        type=float,
        default=30.0,
        help="the run lasts this long (real s) after the window",
    )
    parser.add_argument(
        "--trace-start",
        type=int,
        default=0,
        help="first trace row of each phase's window (default %(default)s)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="idle pause (wall s) after a live8 router is ready, before its run (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=7,
        help="seed of the poisson arrival times and the live prompts' token ids (default "
        "%(default)s)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip (d) vllm-router live")
    parser.add_argument(
        "--keep-dir",
        action="store_true",
        help="keep the run's temporary directory instead of deleting it (its path is printed)",
    )
    args = parser.parse_args()
    settings = [s for s in args.settings.split(",") if s]
    for s in settings:
        if s not in SETTINGS:
            parser.error(f"unknown setting {s}")
    arrivals8 = [a for a in args.des8_arrivals.split(",") if a]
    for a in arrivals8:
        if a not in ("trace", "poisson"):
            parser.error(f"unknown arrivals {a}")
    if "des8" in settings and not arrivals8:
        parser.error("--des8-arrivals is empty")
    roles512 = dict(ROLES_8)
    for item in args.des512_roles.split(","):
        k, _, v = item.partition("=")
        if k not in roles512:
            parser.error(f"--des512-roles: unknown limit {k}")
        roles512[k] = float(v)

    router_bin = Path(sys.executable).parent / "vllm-router"
    if not router_bin.exists():
        router_bin = Path(shutil.which("vllm-router") or "vllm-router")

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    started = time.perf_counter()
    rows: list[tuple[str, str]] = []

    def add(name: str, value: str) -> None:
        rows.append((name, value))

    traces = {name: read_azure_trace(DATA_DIR / f, None, MAX_PROMPT) for name, f in TRACES.items()}
    add("command", f".venv/bin/python bench/role_flipping.py {' '.join(sys.argv[1:])}".rstrip())
    add("src", src_state())
    add("cpus", str(os.cpu_count()))
    add("load_average_at_start", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    add("data", ATTRIBUTION)
    add(
        "calibration",
        f"prefill {PREFILL.a} + {PREFILL.b:g}*n + {PREFILL.c:g}*n^2 s; decode step"
        f" {DECODE.intercept} + {DECODE.slope}*batch + {DECODE.ctx_coef:g}*ctx s;"
        f" budgets TTFT {REAL_TTFT_S:g} s, TPOT {REAL_TPOT_S:g} s (real), max_num_seqs"
        f" {MAX_NUM_SEQS}, prompts clipped to {MAX_PROMPT}",
    )
    add(
        "warm_up",
        "des8 and des512: the workload starts dwell_s after the fleet (the initial split may"
        " flip at once, as in a fleet that has run a while); live8 and des8_livewindow: no"
        " warm-up (the router starts with the trial, so no engine may flip before dwell_s)",
    )
    add(
        "scoring",
        f"attainment = met / scored; goodput = met / window (2 x phase) seconds, real; run ="
        f" window + {args.tail_s:g} s tail",
    )

    def plans(phase_s: float) -> dict[str, Phase]:
        return {
            name: plan_phase(name, traces[name], args.trace_start, phase_s, args.load)
            for name in ("code", "conv")
        }

    def describe_plan(tag: str, ps: dict[str, Phase], phase_s: float, copies: int) -> None:
        c, v = ps["code"], ps["conv"]
        add(
            f"{tag}_phase_code",
            f"rows {c.start_row}..{c.start_row + c.n - 1} x {copies}, {phase_s:g} s; prompt mean"
            f" {c.mean_prompt:.0f}, output mean {c.mean_gen:.1f}; mean prefill"
            f" {c.mean_prefill_s:.4f} s -> rate = {args.load:g} x 4 / {c.mean_prefill_s:.4f}"
            f" = {c.rate:.3f} req/s per 8 engines (prefill pool load {c.prefill_load:.2f} at"
            f" 4/4; its decode load {c.decode_load:.2f}); ideal split"
            f" {c.ideal_prefill:.2f}/{8 - c.ideal_prefill:.2f}",
        )
        add(
            f"{tag}_phase_conv",
            f"rows {v.start_row}..{v.start_row + v.n - 1} x {copies}, {phase_s:g} s; prompt mean"
            f" {v.mean_prompt:.0f}, output mean {v.mean_gen:.1f}; decode B* = {v.batch_star},"
            f" {v.tokens_per_s:.1f} tokens/s per engine -> rate = {args.load:g} x 4 x"
            f" {v.tokens_per_s:.1f} / {v.mean_gen:.1f} = {v.rate:.3f} req/s per 8 engines"
            f" (decode pool load {v.decode_load:.2f} at 4/4; its prefill load"
            f" {v.prefill_load:.2f}); ideal split {v.ideal_prefill:.2f}/{8 - v.ideal_prefill:.2f}",
        )

    all_results: dict[str, list[Result]] = {}
    live_results: dict[str, Result] = {}
    best8: int | None = None
    directory = Path(tempfile.mkdtemp(prefix="role-flipping-"))
    try:
        # ---- des8
        if "des8" in settings or "live8" in settings or "des512" in settings:
            ps8 = plans(args.phase_s)
            describe_plan("des8", ps8, args.phase_s, 1)
            for arrivals in arrivals8 if "des8" in settings else ["trace"]:
                setting = "des8" if arrivals == "trace" else f"des8_{arrivals}"
                w8 = build_workload(traces, ps8, args.phase_s, 1, arrivals, args.seed)
                res = []
                for p in range(1, BASE_ENGINES):
                    r = run_des_setting(
                        setting, w8, 8, p, False, ROLES_8, None, args.tail_s, ROLES_8["dwell_s"]
                    )
                    log(
                        f"{setting} static {p}/{8 - p}: goodput {r.goodput:.3f} attainment"
                        f" {r.attainment():.3f} ({r.wall_s:.1f}s)"
                    )
                    res.append(r)
                r = run_des_setting(
                    setting, w8, 8, 4, True, ROLES_8, None, args.tail_s, ROLES_8["dwell_s"]
                )
                log(
                    f"{setting} flipping: goodput {r.goodput:.3f} attainment"
                    f" {r.attainment():.3f}, {len(r.flips)} flips ({r.wall_s:.1f}s)"
                )
                res.append(r)
                all_results[setting] = res
                if arrivals == "trace":
                    best8 = best_static(res).n_prefill
            add(
                "des8_roles",
                "flipping: " + ", ".join(f"{k} {v:g}" for k, v in ROLES_8.items()),
            )

        # ---- des512
        if "des512" in settings:
            n512 = 512
            copies = n512 // BASE_ENGINES
            ps512 = plans(args.des512_phase_s)
            describe_plan("des512", ps512, args.des512_phase_s, copies)
            w512 = build_workload(traces, ps512, args.des512_phase_s, copies, "trace", args.seed)
            add("des512_requests", str(len(w512.specs)))
            add(
                "des512_roles",
                "flipping: "
                + ", ".join(f"{k} {v:g}" for k, v in roles512.items())
                + f"; scheduler v1 candidates {args.des512_candidates}",
            )
            cache: dict[int, Result] = {}

            def ev(p: int) -> float:
                if p not in cache:
                    r = run_des_setting(
                        "des512",
                        w512,
                        n512,
                        p,
                        False,
                        roles512,
                        args.des512_candidates,
                        args.tail_s,
                        roles512["dwell_s"],
                    )
                    log(
                        f"des512 static {p}/{n512 - p}: goodput {r.goodput:.3f} attainment"
                        f" {r.attainment():.3f} ({r.wall_s:.1f}s)"
                    )
                    cache[p] = r
                return cache[p].goodput

            grid = 32
            start = min(n512 - grid, max(grid, round((best8 or 4) * copies / grid) * grid))
            ev(n512 // 2)
            ev(start)
            # Hill climbing on the grid, bounded by --des512-max-static simulations.
            for _ in range(args.des512_max_static):
                best_p = max(cache, key=lambda p: cache[p].goodput)
                nbrs = [q for q in (best_p - grid, best_p + grid) if grid <= q <= n512 - grid]
                todo = [q for q in nbrs if q not in cache]
                if not todo or len(cache) >= args.des512_max_static:
                    break
                ev(todo[0])
            r = run_des_setting(
                "des512",
                w512,
                n512,
                n512 // 2,
                True,
                roles512,
                args.des512_candidates,
                args.tail_s,
                roles512["dwell_s"],
            )
            log(
                f"des512 flipping: goodput {r.goodput:.3f} attainment {r.attainment():.3f},"
                f" {len(r.flips)} flips ({r.wall_s:.1f}s)"
            )
            all_results["des512"] = [*sorted(cache.values(), key=lambda x: x.n_prefill), r]
            add("des512_static_splits_simulated", " ".join(str(p) for p in sorted(cache)))

        # ---- live8
        if "live8" in settings:
            psl = plans(args.live_phase_s)
            describe_plan("live8", psl, args.live_phase_s, 1)
            wl = build_workload(traces, psl, args.live_phase_s, 1, "trace", args.seed)
            best = best8 if best8 is not None else 4
            systems = [LiveSystem("flipping", "flipping", 4)]
            if best != 4:
                systems.append(LiveSystem(f"static_{best}", "static", best))
            systems.append(LiveSystem("static_4", "static", 4))
            if not args.no_vllm:
                systems.append(LiveSystem("vllm_router", "vllm_router", 4))
            add(
                "live8_setup",
                f"time scale {args.time_scale:g}: wall = real / {args.time_scale:g}; budgets"
                f" {REAL_TTFT_S / args.time_scale:.3f} s / {REAL_TPOT_S / args.time_scale:.4f} s"
                f" wall; {len(wl.specs)} requests; best static split from des8 (trace):"
                f" {best}/{8 - best}; flipping limits real s: "
                + ", ".join(f"{k} {v:g}" for k, v in ROLES_8.items()),
            )
            live_results = run_live(args, wl, systems, directory, rows, router_bin)
            all_results["live8"] = list(live_results.values())
            # The simulator on the very same workload.
            dres = [
                run_des_setting("des8_livewindow", wl, 8, p, p_flip, ROLES_8, None, args.tail_s)
                for p, p_flip in sorted({(4, True), (best, False), (4, False)})
            ]
            all_results["des8_livewindow"] = dres

        elapsed = time.perf_counter() - started

        # ---- report
        for res in all_results.values():
            for r in res:
                rows.extend(result_rows(r))
        add("load_average_at_end", " ".join(f"{x:.2f}" for x in os.getloadavg()))
        add("bench_wall_s", f"{elapsed:.0f}")
        for name, value in rows:
            print(f"{name}: {value}")
        print()
        head = [
            "setting",
            "system",
            "split P/D",
            "goodput/s",
            "attain",
            "code",
            "conv",
            "rejected",
            "flips",
        ]
        table = [head]
        for setting, res in all_results.items():
            for r in res:
                table.append(
                    [
                        setting,
                        r.system,
                        f"{r.n_prefill}/{r.n_engines - r.n_prefill}"
                        + (" start" if r.system == "flipping" else ""),
                        f"{r.goodput:.3f}",
                        f"{r.attainment():.3f}",
                        f"{r.attainment(0):.3f}",
                        f"{r.attainment(1):.3f}",
                        str(r.counts().get("rejected", 0)),
                        str(len(r.flips)) if r.system == "flipping" else "-",
                    ]
                )
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
        print()
        for setting, res in all_results.items():
            flip = next((r for r in res if r.system == "flipping"), None)
            half = next(
                (r for r in res if r.system == "static" and 2 * r.n_prefill == r.n_engines), None
            )
            statics = [r for r in res if r.system == "static"]
            if flip is None or half is None or not statics:
                continue
            if setting in ("live8", "des8_livewindow"):
                b = next((r for r in statics if r.n_prefill == (best8 or 4)), half)
                how = "des8's best static split"
            else:
                b = best_static(res)
                how = "best static split in hindsight"
            r1 = ratio(flip.goodput, half.goodput)
            r2 = ratio(flip.goodput, b.goodput)
            print(
                f"ratio_goodput_flipping_over_4_4_{setting}: {r1} (flipping {flip.goodput:.3f}"
                f" vs {half.n_prefill}/{half.n_engines - half.n_prefill}"
                f" {half.goodput:.3f} req/s; goal >= 1.5:"
                f" {'met' if half.goodput and flip.goodput / half.goodput >= 1.5 else 'NOT met'})"
            )
            print(
                f"ratio_goodput_flipping_over_best_static_{setting}: {r2} (flipping"
                f" {flip.goodput:.3f} vs {how} {b.n_prefill}/{b.n_engines - b.n_prefill}"
                f" {b.goodput:.3f} req/s; goal >= 1.1:"
                f" {'met' if b.goodput and flip.goodput / b.goodput >= 1.1 else 'NOT met'})"
            )
            if setting not in ("live8", "des8_livewindow") and len(statics) >= 3:
                # A perfect flipper that switches instantly to each phase's best static split
                # (carry-over between the phases ignored): the headroom flipping has.
                oracle = (max(r.met(0) for r in statics) + max(r.met(1) for r in statics)) / (
                    flip.window_s
                )
                print(
                    f"bound_goodput_per_phase_best_static_{setting}: {oracle:.3f} req/s"
                    f" (= {ratio(oracle, half.goodput)} x 4/4, {ratio(oracle, b.goodput)} x best"
                    " static; each phase on its own best static split)"
                )
            vr = next((r for r in res if r.system == "vllm_router"), None)
            if vr is not None:
                print(
                    f"ratio_goodput_flipping_over_vllm_router_{setting}:"
                    f" {ratio(flip.goodput, vr.goodput)} (flipping {flip.goodput:.3f} vs"
                    f" vllm-router 4/4 round_robin {vr.goodput:.3f} req/s)"
                )
        if args.keep_dir:
            print(f"kept: {directory}")
        return 0
    finally:
        if not args.keep_dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
