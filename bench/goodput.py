"""Goodput: Narwhal v1 against Narwhal v0 and vllm-router on one simulated 8-engine fleet.

A local fleet of 8 simulated engines with the Kimi-K3 calibration (``narwhal.simengine.timing``
defaults: prefill 0.92 s at 8,192 tokens, decode step 0.24 s + 0.0015 s per sequence) runs
``--time-scale`` S times faster than the real fleet, with a static role split (``--prefill``
engines prefill, the rest decode; narwhal's role controller is off and each engine may only
play its role). Budgets are the qualification run's, scaled: TTFT 10/S s, TPOT 0.3/S s (the
fleet file carries them, and a first-token timeout of 0.85 x TTFT); attainment 95%.

Workloads:

- ``code`` and ``conv``: the Azure LLM inference traces of 2023-11-16 (Patel et al.,
  "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024; Azure
  Public Dataset, CC-BY 4.0). A trial at offered rate r sends the first r x D requests from
  ``--trace-start``, their TIMESTAMPs compressed or stretched so that they arrive within D
  model seconds (D per workload, ``--durations``): the recorded arrival pattern at mean rate
  r; each window starts ``--window-stride`` rows after the one before. Each sends
  ``ContextTokens`` token ids (clipped to max_model_len) and asks for exactly
  ``GeneratedTokens`` tokens (``ignore_eos``, streamed);
- ``fixed``: the qualification run's shape, 8,192 tokens in and 128 out, Poisson arrivals;
- ``mooncake_conv`` and ``mooncake_syn`` (not in the default set; ``bench/prefix_goodput.py
  --live`` runs them with ``--max-model-len 32768``): the Mooncake FAST'25 conversation and
  synthetic traces (``../shared/data/mooncake-fast25``), windowed and rescaled as the Azure
  ones; each request's prompt is built from its 512-token block hash ids, the same hash id
  the same 512 token ids within a trial (never across trials), so requests share exactly the
  prefixes the trace says; prompts clipped to ``--max-model-len`` less their output. The
  engines cache prefixes (as vLLM) and, with ``--kv-events`` (on by default with these
  workloads), publish KV events that narwhal-serve's prefix index follows. Each point also
  reports the prefill engines' prefix hit rate (``vllm:prefix_cache_hits / queries``) beside
  the window's ideal for one LRU cache of the prefill pool's capacity, and the KV tokens the
  decode engines pulled per request.

Systems (default: ``narwhal_v1`` and the three vllm-router policies): ``narwhal_v1``
(narwhal-serve with a profile store that narwhal-profile makes once on this fleet; admission
control as the fleet's routing policy says, ``reject`` by default),
``narwhal_v1_local`` ("narwhal v1 + local prefill": the same, on a copy of the fleet file with
``routing.local_prefill`` on for prompts of at most ``--local-max-prompt`` tokens, so a decode
engine may prefill a short prompt itself when that is predicted faster than a handoff),
``narwhal_v1_blind`` (v1 with ``routing.prefix`` off: cache-blind), ``narwhal_v0``
(``--scheduler v0``: least outstanding work), ``sglang_cache_aware`` (sglang-router 0.3.2,
``smg launch --pd-disaggregation --policy cache_aware``, sent each prompt as the words the
engines tokenize to the same ids: it refuses token-id prompts), and vllm-router 0.1.17
(``--vllm-pd-disaggregation``, every engine given as ``--prefill`` or ``--decode``) with
``--policy round_robin``, ``--policy power_of_two``, and no ``--policy`` (its default,
cache_aware; one ``--policy`` sets both the prefill and the decode policy).

Rates are requests per second of the real (unscaled) fleet; the client sends S times as many
per wall second. It measures TTFT (connect -> first token chunk) and TPOT (mean gap between
token chunks after the first). A request meets the SLO when it answers 200 with all its tokens,
TTFT <= budget and TPOT <= budget; rejected (429), failed and late requests are offered and
missed. A request with no first token within the TTFT budget has missed: the client abandons it
(as an interactive client would), so it stops loading the fleet. The trial ends once the last
arrival's TTFT budget and 8 decode-step budgets have passed; a stream still running then is
judged by projecting its remaining tokens at its recent pace (after the last arrival no
request joins a batch, so batches only shrink: the projection is the slowest it can get;
such verdicts are counted as ``ok_projected`` / ``tpot_projected``), and cancelled. This
keeps a trial to duration + TTFT budget instead of waiting for the longest outputs.

Goodput is where attainment (met / offered, over every window's requests at that rate) crosses
95%: from a start (a capacity estimate, or the goodput an earlier system reached on the
workload) up or down by ``--bracket-step`` until it is bracketed, then bisection to
``--precision``, at most ``--max-points`` rates, then linear interpolation between the rates
either side of the crossing. Every rate runs each of ``--windows`` windows once: trace
windows ``--window-stride`` rows apart from ``--trace-start`` (fixed: one seed each), so a
search sees several stretches of the trace and every rate is a new trial. Its 95% interval is
a block bootstrap of every request's verdict at every rate measured (each window's trial cut
into ``--blocks`` consecutive shares, the same stretch of the trace at every rate;
``narwhal.testing.goodput``); ratios are printed with a paired interval
(the same resample for both systems; the best other system on that resample) and called a
gain or a loss only when it excludes 1. For every rate: each kind of miss (``rejected`` 429,
``ttft`` late or abandoned, ``tpot`` over budget, ``error``/``short`` failed) and the prefill
and decode engines' utilisation (their working-step seconds over the trial's wall time),
summed over the rate's windows and, with several windows, for each window's trial alone
(``trial_<system>_<workload>_at_<rate>_window_<k>``). After ``--budget-s`` wall seconds
every remaining search stops at its bracket. ``--quick``: code and fixed, v1 and vllm-router
power_of_two, one window, three rates, shorter trials.

    .venv/bin/python bench/goodput.py [--time-scale 4] [--durations code=20,...] [--workloads ...]
        [--systems ...] [--windows 2] [--max-points 5] [--quick] [--keep-dir]

Only 127.0.0.1 is contacted. Progress goes to stderr; ``name: value`` rows, a table and the
ratio lines ``ratio_goodput_v1_over_best_other_<workload>`` (other: v0 and vllm-router) and
``ratio_goodput_v1_local_over_v1_<workload>`` go to stdout. Each trial's CPU
use of the whole machine and of processes outside this benchmark is reported: the simulated
engines' step times are only as faithful as the CPU they get.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import orjson

from narwhal.engines.scrape import metric_sum
from narwhal.fleetsim.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    ideal_hit_rate,
    read_azure_trace,
    read_mooncake_trace,
)
from narwhal.serve.cli import serve_command
from narwhal.simengine.timing import CALIBRATION
from narwhal.simengine.vocab import Vocabulary
from narwhal.testing import aio, procfs, procs
from narwhal.testing.fleet import SimFleet, fleet_load, start_local_fleet, wait_idle
from narwhal.testing.goodput import (
    RatePoint,
    bootstrap_draws,
    bound_error,
    crossing,
    crossing_of,
    interval,
    number_list,
    paired_ratio,
    precision_error,
    quick_defaults,
)
from narwhal.testing.ports import free_ports
from narwhal.testing.profiling import profile_fleet
from narwhal.testing.provenance import git
from narwhal.testing.rawhttp import TRANSPORT_ERRORS, post_stream
from narwhal.testing.routers import peer_router_command, router_ready
from narwhal.testing.stats import percentile
from narwhal.testing.traces import trace_dir

MODEL = "moonshotai/Kimi-K3"
REAL_TTFT_S = 10.0
REAL_TPOT_S = 0.3
ATTAINMENT = 0.95
DATA_DIR = trace_dir("azure-llm-2023", Path(__file__).resolve().parents[1])
TRACES = {
    "code": "AzureLLMInferenceTrace_code.csv",
    "conv": "AzureLLMInferenceTrace_conv.csv",
}
MOONCAKE_DIR = trace_dir("mooncake-fast25", Path(__file__).resolve().parents[1])
MOONCAKE = {"mooncake_conv": "conversation_trace.jsonl", "mooncake_syn": "synthetic_trace.jsonl"}
WORKLOADS = ("code", "conv", "fixed", *MOONCAKE)
DEFAULT_WORKLOADS = ("code", "conv", "fixed")
SYSTEMS = (
    "narwhal_v1",
    "narwhal_v1_local",
    "narwhal_v1_blind",
    "narwhal_v0",
    "vllm_round_robin",
    "vllm_power_of_two",
    "vllm_default",
    "sglang_cache_aware",
)
# The default set: Narwhal's scheduler and vllm-router's policies (about 15 minutes); v0 and
# local prefill on request.
DEFAULT_SYSTEMS = ("narwhal_v1", "vllm_round_robin", "vllm_power_of_two", "vllm_default")
V1_SYSTEMS = ("narwhal_v1", "narwhal_v1_local", "narwhal_v1_blind")  # with the profile store
VLLM_SYSTEMS = ("vllm_round_robin", "vllm_power_of_two", "vllm_default")
VLLM_POLICY = {"vllm_round_robin": "round_robin", "vllm_power_of_two": "power_of_two"}
FIXED_IN, FIXED_OUT = 8192, 128
WORD_IDS = (256, 10256)  # the simulator's word tokens (byte tokens below, specials above)
MAX_MODEL_LEN = 16384  # --max-model-len
VOCABULARY = Vocabulary(0)  # the simulated engines' (their default vocab_seed)
# The simulator's calibration (model seconds), for the starting guesses only.
PREFILL, DECODE = CALIBRATION.prefill, CALIBRATION.decode


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Workloads


@dataclass
class Workload:
    """An arrival pattern (offsets in seconds from the first row) with each request's shape."""

    name: str
    offsets: list[float]
    prompt_lens: list[int]
    gen_lens: list[int]
    index: int = 0
    clipped: int = 0
    start_row: int = 0
    # Mooncake: per request the chain keys of its prompt's 512-token blocks (equal keys, equal
    # prefixes); None: every prompt its own.
    keys: list[tuple[int, ...]] | None = None

    def trial(self, rate: float, duration: float) -> tuple[int, list[float]]:
        """The first ``n = rate * duration`` requests, their timeline compressed or stretched
        so that they arrive within ``duration`` model seconds (the next row would arrive at
        ``duration``): the recorded pattern at exactly ``rate`` requests/s on average."""
        n = max(2, round(rate * duration))
        if n >= len(self.offsets):
            raise SystemExit(f"{self.name}: {n} requests needed, only {len(self.offsets) - 1} rows")
        span = self.offsets[n] - self.offsets[0]
        k = duration / span if span > 0 else 0.0
        return n, [(o - self.offsets[0]) * k for o in self.offsets[:n]]


def load_trace(name: str, start: int, max_model_len: int) -> Workload:
    """An Azure trace from row ``start`` (0: the first data row), read by narwhal-fleetsim's
    reader (its refusals and words), its times from that row's, prompts clipped so that
    prompt and output fit ``max_model_len``."""
    path = DATA_DIR / TRACES[name]
    try:
        rows = read_azure_trace(path)[start:]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: {exc}") from None
    offsets: list[float] = []
    prompts: list[int] = []
    gens: list[int] = []
    clipped = 0
    for t, ctx, gen in rows:
        if ctx + gen > max_model_len:
            clipped += 1
            ctx = max_model_len - gen
        offsets.append(t - rows[0][0])
        prompts.append(ctx)
        gens.append(gen)
    if len(offsets) < 100:
        raise SystemExit(f"{path}: fewer than 100 requests from row {start}")
    return Workload(name, offsets, prompts, gens, clipped=clipped, start_row=start)


def load_mooncake(name: str, start: int, max_model_len: int) -> Workload:
    """A Mooncake FAST'25 trace from row ``start``: its arrival pattern (ties spread over their
    second, ``read_mooncake_trace``), prompt and output lengths, prompts clipped to fit
    ``max_model_len``, and each prompt's block chain keys."""
    trace = read_mooncake_trace(MOONCAKE_DIR / MOONCAKE[name], max_model_len)
    rows = trace.rows[start:]
    if len(rows) < 100:
        raise SystemExit(f"{MOONCAKE[name]}: fewer than 100 requests from row {start}")
    t0 = rows[0][0]
    return Workload(
        name,
        [t - t0 for t, _, _, _ in rows],
        [p for _, p, _, _ in rows],
        [g for _, _, g, _ in rows],
        clipped=sum(
            1 for _, p, g, _ in rows if p + g == max_model_len
        ),  # (clipped ones fill it exactly)
        start_row=start,
        keys=[k for _, _, _, k in rows],
    )


def fixed_workload(seed: int, n: int = 20_000) -> Workload:
    """The fixed shape with Poisson arrivals (unit rate; trials rescale it)."""
    rng = random.Random(seed)
    offsets = [0.0]
    for _ in range(n - 1):
        offsets.append(offsets[-1] + rng.expovariate(1.0))
    return Workload("fixed", offsets, [FIXED_IN] * n, [FIXED_OUT] * n)


def build_prompts(w: Workload, n: int, seed: int) -> list[np.ndarray]:
    """Fresh prompts for a trial's ``n`` requests: no two trials on one router share a prompt
    (the cache-aware routers and the simulated engines' prefix caches would serve a repeated
    one). With the trace's block keys (Mooncake), within the trial the same key is always the
    same 512 token ids, so requests share exactly the prefixes the trace says they share; the
    rest of a prompt (its last, partial block) is its own."""
    rng = np.random.default_rng(seed)
    lo, hi = WORD_IDS
    if w.keys is None:
        return [rng.integers(lo, hi, size=p, dtype=np.int64) for p in w.prompt_lens[:n]]
    blocks: dict[int, np.ndarray] = {}
    prompts = []
    for p, keys in zip(w.prompt_lens[:n], w.keys[:n], strict=True):
        parts = []
        for key in keys:
            block = blocks.get(key)
            if block is None:
                block = np.random.default_rng((key % 2**64, seed)).integers(
                    lo, hi, size=MOONCAKE_BLOCK_TOKENS, dtype=np.int64
                )
                blocks[key] = block
            parts.append(block)
        parts.append(rng.integers(lo, hi, size=p - len(keys) * MOONCAKE_BLOCK_TOKENS))
        prompts.append(np.concatenate(parts))
    return prompts


def build_bodies(w: Workload, n: int, seed: int, text: bool = False) -> list[bytes]:
    """Streamed completion bodies for a trial (``build_prompts``), asking for exactly each
    request's output length. ``text``: each prompt as the text the engines tokenize to the same
    ids (their words), for a router that refuses token-id prompts (sglang-router 0.3.2: 422)."""
    prompts: list[np.ndarray] | list[str] = build_prompts(w, n, seed)
    if text:
        prompts = [VOCABULARY.decode(p.tolist()) for p in prompts]
    return [
        orjson.dumps(
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": g,
                "ignore_eos": True,
                "stream": True,
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        for prompt, g in zip(prompts, w.gen_lens[:n], strict=True)
    ]


def capacity_estimate(w: Workload, prefill_engines: int, decode_engines: int, seqs: int) -> float:
    """Rough requests/s the split can carry within budgets (model time), from the first
    thousand requests' shapes: the search's starting guess, nothing more."""
    prompts, gens = w.prompt_lens[:1000], w.gen_lens[:1000]
    mean_prefill = sum(PREFILL.seconds(n) for n in prompts) / len(prompts)
    i, s, k = DECODE.intercept, DECODE.slope, DECODE.ctx_coef
    ctx = sum(prompts) / len(prompts)
    batch = max(1, min(seqs, int((REAL_TPOT_S - i - k * ctx) / s)))
    step = DECODE.seconds_per_token(batch, ctx)
    mean_gen = sum(gens) / len(gens)
    return min(prefill_engines / mean_prefill, decode_engines * batch / step / mean_gen)


# --------------------------------------------------------------------------------------------
# The client: raw asyncio HTTP/1.1, one connection per request, SSE token timing.

RECENT_GAPS = 8
MET = ("ok", "ok_projected")


@dataclass
class Outcome:
    """One request, filled in as its stream arrives (perf_counter seconds)."""

    expected: int
    status: int = 0
    start: float | None = None
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_GAPS))
    done: bool = False
    stream_error: bool = False
    # ok | ok_projected | rejected | error | ttft | tpot | tpot_projected | short | pending
    kind: str = "pending"

    @property
    def ttft(self) -> float | None:
        if self.first is None or self.start is None:
            return None
        return self.first - self.start

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)

    # The StreamSink that post_stream fills in.
    def on_tokens(self, n: int, now: float) -> None:
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append((now - self.last) / n)
        self.last = now
        self.tokens += n

    def on_done(self) -> None:
        self.done = True

    def on_error(self) -> None:
        self.stream_error = True

    def judge(self, now: float, budgets: tuple[float, float]) -> None:
        """Settle ``kind``. A stream still running when the trial ends is judged by
        projection: its remaining tokens at its recent pace (no new request joins a batch
        after the trial ends, so that pace is the slowest it can get)."""
        if self.kind != "pending":
            return
        ttft_b, tpot_b = budgets
        ttft = self.ttft
        if ttft is None or ttft > ttft_b:
            self.kind = "ttft"
        elif self.done:
            if self.stream_error:
                self.kind = "error"
            elif self.tokens < self.expected:
                self.kind = "short"
            else:
                tpot = self.tpot
                self.kind = "tpot" if tpot is not None and tpot > tpot_b else "ok"
        elif self.stream_error:
            self.kind = "error"
        else:
            assert self.first is not None and self.last is not None
            pace = max(sum(self.gaps) / len(self.gaps) if self.gaps else 0.0, now - self.last)
            remaining = max(0, self.expected - self.tokens)
            last = max(self.last + pace, now) + (remaining - 1) * pace if remaining else self.last
            projected = (last - self.first) / max(1, self.expected - 1)
            self.kind = "tpot_projected" if projected > tpot_b else "ok_projected"


async def send(port: int, body: bytes, request_id: str, out: Outcome) -> None:
    """POST one streamed completion and record its token times into ``out``."""
    out.start = time.perf_counter()  # TTFT counts the connection too
    try:
        if not await post_stream(port, body, request_id, out):
            out.kind = "rejected" if out.status == 429 else "error"
            return
        if not out.done:
            out.stream_error = True
            out.done = True
    except TRANSPORT_ERRORS:
        out.kind = "error"


async def run_trial(
    port: int,
    bodies: list[bytes],
    gens: list[int],
    offsets: list[float],
    duration: float,
    scale: float,
    budgets: tuple[float, float],
    tag: str,
) -> list[Outcome]:
    """Offer the requests at ``offsets`` (model seconds); judge each against the budgets.

    A request with no first token by its TTFT budget has missed: the client gives up on it
    (as an interactive client would) and it no longer loads the fleet. The trial ends once
    the last arrival's TTFT budget and a few decode steps have passed; streams still running
    then are judged by projection (``Outcome.judge``) and cancelled."""
    ttft_b, tpot_b = budgets
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.05
    outcomes = [Outcome(expected=g) for g in gens]

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + offsets[i] / scale - loop.time()))
        out = outcomes[i]
        task = asyncio.ensure_future(send(port, bodies[i], f"{tag}-{i}", out))
        try:
            await asyncio.wait({task}, timeout=ttft_b)
            if not task.done() and out.first is None:
                task.cancel()
                out.kind = "ttft"
            await asyncio.gather(task, return_exceptions=True)
        finally:
            task.cancel()

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(offsets))]
    end = t0 + duration / scale + ttft_b + RECENT_GAPS * tpot_b + 0.1
    try:
        await asyncio.wait(tasks, timeout=max(0.0, end - loop.time()))
    finally:
        now = time.perf_counter()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for out in outcomes:
        out.judge(now, budgets)
    return outcomes


def own_cpu_seconds() -> float:
    """CPU seconds of this benchmark: this process, the engines, routers and profiler."""
    return procfs.tree_cpu_seconds(os.getpid())


class Router:
    """One system under test: a router process in front of the fleet."""

    def __init__(
        self,
        system: str,
        directory: Path,
        fleet_path: Path,
        store: Path | None,
        prefill_urls: list[str],
        decode_urls: list[str],
        router_bin: Path,
        sglang_bin: Path | None = None,
    ) -> None:
        self.system = system
        ports = free_ports(2)
        self.port = ports[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / f"{system}.log"
        if system.startswith("narwhal"):
            args = serve_command(
                fleet_path,
                self.port,
                directory / f"{system}-journal.jsonl",
                "--skip-qualification",
                "--log-level",
                "warning",
            )
            if system in V1_SYSTEMS:
                assert store is not None
                args += ["--profiles", str(store), "--scheduler", "v1"]
            else:
                args += ["--scheduler", "v0"]
        elif system == "sglang_cache_aware":
            assert sglang_bin is not None
            args = peer_router_command(
                sglang_bin,
                prefill_urls,
                decode_urls,
                self.port,
                ports[1],
                policy="cache_aware",
                sglang=True,
                log_level="warn",  # (smg's name for it)
            )
        else:
            args = peer_router_command(
                router_bin,
                prefill_urls,
                decode_urls,
                self.port,
                ports[1],
                policy=VLLM_POLICY.get(system),
            )
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.prefill_ids = {f"e{i}" for i in range(len(prefill_urls))}

    def start(self) -> None:
        self.proc = procs.start(self.args, self.log_path)
        procs.wait_ready(
            lambda: router_ready(self.url, peer=not self.system.startswith("narwhal")),
            60,
            process=self.proc,
            name=self.url,
            log=self.log_path,
        )

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc)

    def narwhal_metrics(self, before: dict[str, float] | None = None) -> dict[str, float]:
        """narwhal-serve's admission rejections (since ``before``) and, for v1, the online
        correction ratios (observed / predicted) of each engine in its role."""
        if not self.system.startswith("narwhal"):
            return {}
        try:
            text = httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text
        except httpx.HTTPError:
            return {}
        out: dict[str, float] = {}
        for m in re.finditer(
            r'^narwhal_admission_rejections_total\{reason="([^"]+)"\} (\S+)$', text, re.M
        ):
            key = f"admission_rejections_{m.group(1)}"
            value = float(m.group(2)) - (before or {}).get(key, 0.0)
            if before is None or value:
                out[key] = value
        if self.system == "narwhal_v1_local":
            local = sum(
                float(m.group(1))
                for m in re.finditer(r"^narwhal_local_prefills_total\{[^}]*\} (\S+)$", text, re.M)
            )
            out["local_prefills"] = local - (before or {}).get("local_prefills", 0.0)
        if self.system in V1_SYSTEMS:
            for m in re.finditer(
                r'^narwhal_latency_ratio\{engine="([^"]+)",phase="([^"]+)"\} (\S+)$', text, re.M
            ):
                engine, phase = m.group(1), m.group(2)
                if (engine in self.prefill_ids) == (phase == "prefill"):
                    out[f"latency_ratio_{engine}_{phase}"] = float(m.group(3))
        return out


# --------------------------------------------------------------------------------------------
# Goodput search


@dataclass
class Trial:
    """One window's requests at one rate."""

    requests: int
    met: list[bool]  # per request, in arrival order
    counts: dict[str, int]
    ttfts: list[float]  # real seconds
    tpots: list[float]
    wall_s: float
    cpu_util: float
    foreign_util: float
    router_cpu_ms: float  # the router's process tree, per request
    utilisation: tuple[float, float]  # the prefill and the decode engines' busy fraction
    # The prefill engines' prefix caches: tokens found cached and tokens looked up
    # (vllm:prefix_cache_hits / _queries); tokens the decode engines pulled over NIXL.
    cached_tokens: float = 0.0
    queried_tokens: float = 0.0
    pulled_tokens: float = 0.0
    ideal_hit_rate: float | None = None  # the trace's, for the prefill pool's capacity


@dataclass
class Point:
    """Every window's trial at one offered rate."""

    rate: float
    trials: list[Trial]
    blocks: int  # per window

    @property
    def rate_point(self) -> RatePoint:
        """Each window's requests cut into ``blocks`` consecutive parts: a trial at a higher
        rate sends more of the trace's rows in the same time, so blocks are shares of a
        trial (the same stretch of its time at every rate), not counts of requests."""
        met: list[int] = []
        sizes: list[int] = []
        for t in self.trials:
            n = len(t.met)
            for k in range(self.blocks):
                part = t.met[k * n // self.blocks : (k + 1) * n // self.blocks]
                met.append(sum(part))
                sizes.append(len(part))
        return RatePoint(self.rate, tuple(met), tuple(sizes))

    @property
    def attainment(self) -> float:
        return self.rate_point.attainment

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            for kind, n in t.counts.items():
                out[kind] = out.get(kind, 0) + n
        return out

    @property
    def requests(self) -> int:
        return sum(t.requests for t in self.trials)

    @property
    def hit_rate(self) -> float | None:
        queried = sum(t.queried_tokens for t in self.trials)
        return sum(t.cached_tokens for t in self.trials) / queried if queried else None

    @property
    def ideal_hit_rate(self) -> float | None:
        ideals = [t.ideal_hit_rate for t in self.trials if t.ideal_hit_rate is not None]
        return statistics.fmean(ideals) if ideals else None

    @property
    def pulled_per_request(self) -> float:
        return sum(t.pulled_tokens for t in self.trials) / max(1, self.requests)


@dataclass
class Search:
    points: dict[float, Point] = field(default_factory=dict)
    truncated: bool = False  # stopped early by the run's time budget

    def ordered(self) -> list[Point]:
        return [self.points[r] for r in sorted(self.points)]

    def goodput(self) -> float:
        return crossing([p.rate_point for p in self.ordered()], ATTAINMENT)

    def found(self) -> str:
        """``bracketed``, or ``above`` (every rate met the target: the goodput is a lower
        bound) or ``below`` (none did: an upper bound)."""
        return crossing_of(((p.rate, p.attainment) for p in self.ordered()), ATTAINMENT)[1]


ENGINE_COUNTERS = (
    "narwhal_sim:step_seconds_total",  # wall seconds of working steps
    "vllm:prefix_cache_hits_total",  # tokens found in the prefix cache
    "vllm:prefix_cache_queries_total",  # tokens looked up there
    "vllm:nixl_bytes_transferred_sum",  # KV bytes pulled (decode side)
)


def engine_counters(urls: list[str]) -> list[dict[str, float]]:
    """Each engine's ``ENGINE_COUNTERS`` so far (0 where its page lacks one or it is down)."""
    out = []
    for url in urls:
        try:
            page = httpx.get(url + "/metrics", timeout=5, trust_env=False).content
        except httpx.HTTPError:
            page = b""
        out.append({name: metric_sum(page, name) or 0.0 for name in ENGINE_COUNTERS})
    return out


def run_point(
    router: Router,
    w: Workload,
    rate: float,
    args: argparse.Namespace,
    budgets: tuple[float, float],
    engine_urls: list[str],
    tag: str,
    seed: int,
) -> Trial:
    if not wait_idle(engine_urls, 60):
        log(f"warning: fleet not idle before {tag} (load {fleet_load(engine_urls)})")
    # Let the routers' load scrapes (every second) catch up with the idle fleet.
    time.sleep(args.settle_s)
    duration = args.durations[w.name]
    n, offsets = w.trial(rate, duration)
    bodies = build_bodies(w, n, seed, text=router.system == "sglang_cache_aware")
    coro = run_trial(
        router.port, bodies, w.gen_lens[:n], offsets, duration, args.time_scale, budgets, tag
    )
    assert router.proc is not None
    router0 = procfs.tree_cpu_seconds(router.proc.pid)
    before = engine_counters(engine_urls)
    cpu0, own0, t0 = procfs.machine_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    outcomes = aio.run(coro)
    wall = time.perf_counter() - t0
    total, own = procfs.machine_cpu_seconds() - cpu0, own_cpu_seconds() - own0
    router_cpu = procfs.tree_cpu_seconds(router.proc.pid) - router0
    counted = [
        {k: after[k] - earlier[k] for k in ENGINE_COUNTERS}
        for earlier, after in zip(before, engine_counters(engine_urls), strict=True)
    ]
    busy = [c["narwhal_sim:step_seconds_total"] for c in counted]
    p = args.prefill
    prefill_side, decode_side = counted[:p], counted[p:]
    ideal = None
    if w.keys is not None:
        rows = [
            (0.0, pl, g, k)
            for pl, g, k in zip(w.prompt_lens[:n], w.gen_lens[:n], w.keys[:n], strict=True)
        ]
        ideal = ideal_hit_rate(rows, p * args.num_blocks * args.block_size)
    if args.keep_dir:  # the client's view of every request, for analysis next to the journals
        with open(args.directory / "client.jsonl", "ab") as f:
            for i, o in enumerate(outcomes):
                f.write(
                    orjson.dumps(
                        {
                            "id": f"{tag}-{i}",
                            "offset_s": offsets[i] / args.time_scale,
                            "start": o.start,
                            "first": o.first,
                            "last": o.last,
                            "tokens": o.tokens,
                            "expected": o.expected,
                            "status": o.status,
                            "kind": o.kind,
                        }
                    )
                    + b"\n"
                )
    cpus = os.cpu_count() or 1
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    scale = args.time_scale
    return Trial(
        requests=n,
        met=[o.kind in MET for o in outcomes],
        counts=counts,
        ttfts=[o.ttft * scale for o in outcomes if o.ttft is not None],
        tpots=[o.tpot * scale for o in outcomes if o.tpot is not None],
        wall_s=wall,
        cpu_util=total / wall / cpus,
        foreign_util=max(0.0, total - own) / wall / cpus,
        router_cpu_ms=router_cpu / n * 1000,
        utilisation=(sum(busy[:p]) / p / wall, sum(busy[p:]) / max(1, len(busy) - p) / wall),
        cached_tokens=sum(c["vllm:prefix_cache_hits_total"] for c in prefill_side),
        queried_tokens=sum(c["vllm:prefix_cache_queries_total"] for c in prefill_side),
        pulled_tokens=sum(c["vllm:nixl_bytes_transferred_sum"] for c in decode_side)
        / args.block_bytes
        * args.block_size,
        ideal_hit_rate=ideal,
    )


def search_goodput(
    router: Router,
    windows: list[Workload],
    start: float,
    args: argparse.Namespace,
    budgets: tuple[float, float],
    engine_urls: list[str],
    deadline: float,
) -> Search:
    """From ``start``, up (or down) by ``--bracket-step`` until attainment crosses the target,
    then bisection (geometric) to ``--precision``, at most ``--max-points`` rates; every rate
    runs every window once."""
    s = Search()
    name = windows[0].name

    def test(rate: float) -> Point:
        point = Point(rate, [], args.blocks)
        for k, w in enumerate(windows):
            tag = f"{router.system}-{name}-w{k}-r{rate:.4f}"
            # Every trial of the run its own prompts (the tag names system, workload, window
            # and rate): a trial that repeated an earlier one's would find them cached.
            seed = args.seed * 100_003 + zlib.crc32(tag.encode())
            point.trials.append(run_point(router, w, rate, args, budgets, engine_urls, tag, seed))
        s.points[rate] = point
        c = " ".join(f"{kind}={v}" for kind, v in sorted(point.counts.items()))
        t = point.trials
        log(
            f"{router.system} {name} rate {rate:.3f}/s ({point.requests} requests in"
            f" {len(t)} windows): attainment {point.attainment:.3f} [{c}]"
            f" util prefill {statistics.fmean(x.utilisation[0] for x in t):.0%}"
            f" decode {statistics.fmean(x.utilisation[1] for x in t):.0%}"
            f" cpu {statistics.fmean(x.cpu_util for x in t):.0%}"
            f" (other processes {statistics.fmean(x.foreign_util for x in t):.0%})"
        )
        return point

    def more() -> bool:
        """Another rate? Always a second one; beyond that within --max-points and the run's
        time budget (after which a search stops at its bracket)."""
        if len(s.points) < 2:
            return True
        if len(s.points) >= args.max_points:
            return False
        if time.perf_counter() > deadline:
            s.truncated = True
            return False
        return True

    step = args.bracket_step
    low: Point | None = None
    high: Point | None = None
    first = test(start)
    if first.attainment >= ATTAINMENT:
        low = first
        while high is None and more():
            point = test(low.rate * step)
            if point.attainment >= ATTAINMENT:
                low = point
            else:
                high = point
    else:
        high = first
        while low is None and more() and high.rate > start * 1e-2:
            point = test(high.rate / step)
            if point.attainment >= ATTAINMENT:
                low = point
            else:
                high = point
    while low is not None and high is not None and high.rate / low.rate > 1 + args.precision:
        if not more():
            break
        point = test(math.sqrt(low.rate * high.rate))
        if point.attainment >= ATTAINMENT:
            low = point
        else:
            high = point
    return s


# --------------------------------------------------------------------------------------------
# Main


def cache_note(point: Point) -> str:
    """The prefill pool's prefix-cache hit rate beside the trace's ideal, and what the
    decode engines pulled (tokens per request; Kimi's MLA KV is 70,272 bytes a
    token)."""
    if point.hit_rate is None:
        return ""
    ideal = point.ideal_hit_rate
    return (
        f"; prefix hit rate {point.hit_rate:.3f}"
        + (f" (ideal {ideal:.3f})" if ideal is not None else "")
        + f", KV pulled {point.pulled_per_request:.0f} tokens/request"
    )


def profile(directory: Path, fleet_path: Path, args: argparse.Namespace) -> Path:
    return profile_fleet(
        directory,
        fleet_path,
        "--prefill-lens", "256,1024,4096,8192",
        "--decode-input-lens", "512,4096,8192",
        "--decode-concurrency", args.profile_concurrency,
        "--decode-tokens", str(args.profile_decode_tokens),
        "--prefill-repeats", "3",
    )  # fmt: skip


def git_state() -> str:
    """The commit the narwhal code under test is at, and whether src/ differs from it."""
    root = Path(__file__).resolve().parents[1]
    head = git(root, "rev-parse", "--short", "HEAD")
    dirty = git(root, "status", "--porcelain", "--", "src")
    return f"{head or 'unknown'}{' + uncommitted changes in src/' if dirty else ''}"


def fmt(x: float) -> str:
    return f"{x:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="engines run this many times faster than the real fleet (default %(default)s)",
    )
    parser.add_argument(
        "--durations",
        default="code=20,conv=70,fixed=45,mooncake_conv=300,mooncake_syn=150",
        help="model seconds of arrivals per trial, per workload (about one request's service"
        " time at capacity or more, so decode batches fill as in steady state)",
    )
    parser.add_argument("--trace-start", type=int, default=0, help="first trace row used")
    parser.add_argument(
        "--windows",
        type=int,
        default=2,
        help="trace windows (fixed: seeds) per rate, each one trial, from --trace-start on",
    )
    parser.add_argument(
        "--window-stride", type=int, default=2000, help="trace rows between windows' starts"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=900.0,
        help="wall seconds after which searches stop at their bracket",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"of {', '.join(WORKLOADS)} (mooncake_*: bench/prefix_goodput.py --live)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated, of {', '.join(SYSTEMS)} (default %(default)s)",
    )
    parser.add_argument("--prefill", type=int, default=4, help="engines in the prefill role")
    parser.add_argument(
        "--engines", type=int, default=8, help="simulated engines in all (default %(default)s)"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="each engine's most sequences in a batch (default %(default)s)",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=65536,
        help="KV cache blocks per engine (default %(default)s)",
    )
    parser.add_argument(
        "--block-bytes",
        type=int,
        default=1024,
        help="bytes of one KV block in the simulated engines (default %(default)s)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=MAX_MODEL_LEN,
        help="the engines' context length in tokens; trace prompts are clipped to it (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engines publish KV events (vLLM's --kv-events-config) and narwhal-serve's prefix"
        " index follows them; default: on with a mooncake workload",
    )
    parser.add_argument(
        "--bracket-step",
        type=float,
        default=1.25,
        help="factor between rates while the crossing is not yet bracketed (default %(default)s)",
    )
    parser.add_argument("--precision", type=float, default=0.06, help="bisection's relative end")
    parser.add_argument(
        "--start-fraction",
        type=float,
        default=0.8,
        help="first search's starting rate, as a fraction of the capacity estimate (default "
        "%(default)s)",
    )
    parser.add_argument("--max-points", type=int, default=5, help="rates per search at most")
    parser.add_argument(
        "--blocks",
        type=int,
        default=10,
        help="bootstrap blocks per window's trial (consecutive shares of its requests)",
    )
    parser.add_argument(
        "--resamples",
        type=int,
        default=1000,
        help="bootstrap resamples for the goodput intervals (default %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="iteration: code and fixed, v1 and vllm-router power_of_two, one window, three"
        " rates, shorter trials (each of them as the command line names it, if it does)",
    )
    parser.add_argument(
        "--profile-concurrency", default="1,2,4", help="as the qualification run profiles"
    )
    parser.add_argument(
        "--profile-decode-tokens",
        type=int,
        default=64,
        help="narwhal-profile's --decode-tokens for the v1 profile store (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=7,
        help="seed of the fixed workload's arrivals, the prompts and the bootstrap (default "
        "%(default)s)",
    )
    parser.add_argument("--settle-s", type=float, default=1.0, help="idle pause before a trial")
    parser.add_argument(
        "--local-max-prompt",
        type=int,
        default=1024,
        help="narwhal_v1_local: routing.local_prefill.max_prompt_tokens",
    )
    parser.add_argument(
        "--keep-dir",
        action="store_true",
        help="keep the run's temporary directory (logs, journals, client.jsonl); its path is "
        "printed",
    )
    args = parser.parse_args()
    if args.quick:
        quick_defaults(
            args,
            sys.argv[1:],
            {
                "workloads": "code,fixed",
                "systems": "narwhal_v1,vllm_power_of_two",
                "windows": 1,
                "max_points": 3,
                "durations": "code=12,conv=40,fixed=30",
            },
        )
    workloads = [x for x in args.workloads.split(",") if x]
    systems = [x for x in args.systems.split(",") if x]
    for x in workloads:
        if x not in WORKLOADS:
            parser.error(f"unknown workload {x}")
    for x in systems:
        if x not in SYSTEMS:
            parser.error(f"unknown system {x}")
    try:
        args.durations = {
            k.strip(): float(v) for k, _, v in (x.partition("=") for x in args.durations.split(","))
        }
    except ValueError:
        parser.error("--durations: expected name=seconds,...")
    for x in workloads:
        if args.durations.get(x, 0) <= 0:
            parser.error(f"--durations: no positive duration for {x}")
    if args.prefill < 1:
        parser.error(f"--prefill: at least one prefill engine, got {args.prefill}")
    if args.prefill >= args.engines:
        parser.error(
            f"--prefill {args.prefill} of --engines {args.engines} leaves no decode engine"
        )
    problem = bound_error(
        args,
        [
            ("time_scale", 0, False), ("trace_start", 0, True), ("windows", 1, True),
            ("window_stride", 1, True), ("budget_s", 0, False), ("max_num_seqs", 1, True),
            ("num_blocks", 1, True), ("block_bytes", 1, True), ("block_size", 1, True),
            ("max_model_len", 1, True), ("bracket_step", 1, False), ("precision", 0, False),
            ("start_fraction", 0, False), ("max_points", 1, True), ("blocks", 2, True),
            ("resamples", 1, True), ("profile_decode_tokens", 4, True), ("settle_s", 0, True),
            ("local_max_prompt", 1, True),
        ],
    )  # fmt: skip
    if problem:
        parser.error(problem)
    try:
        number_list(args.profile_concurrency, "--profile-concurrency", int, 1)
    except ValueError as exc:
        parser.error(str(exc))
    if problem := precision_error(args.precision):
        parser.error(problem)
    bins: dict[str, Path] = {}
    for binary, needed in (
        ("vllm-router", any(s in VLLM_SYSTEMS for s in systems)),
        ("smg", "sglang_cache_aware" in systems),
    ):
        path = Path(sys.executable).parent / binary
        if not path.exists():
            found = shutil.which(binary)
            if not found and needed:
                print(f"{binary} is not installed (pip install -e '.[dev]')", file=sys.stderr)
                return 2
            path = Path(found or binary)
        bins[binary] = path
    if args.kv_events is None:
        args.kv_events = any(x in MOONCAKE for x in workloads)

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    started = time.perf_counter()
    scale = args.time_scale
    budgets = (REAL_TTFT_S / scale, REAL_TPOT_S / scale)
    rows: list[tuple[str, str]] = []

    def add(name: str, value: str | float) -> None:
        rows.append((name, value if isinstance(value, str) else fmt(value)))

    # Workloads first: a bad trace path fails before any process starts.
    loaded: dict[str, list[Workload]] = {}
    for i, name in enumerate(workloads):
        loaded[name] = []
        for k in range(args.windows):
            start = args.trace_start + k * args.window_stride
            if name == "fixed":
                w = fixed_workload(args.seed + k)
            elif name in MOONCAKE:
                w = load_mooncake(name, start, args.max_model_len)
            else:
                w = load_trace(name, start, args.max_model_len)
            w.index = i
            loaded[name].append(w)
    decode_n = args.engines - args.prefill

    directory = Path(tempfile.mkdtemp(prefix="goodput-"))
    args.directory = directory
    fleet: SimFleet | None = None
    routers: dict[str, Router] = {}
    try:
        sim = {
            "time_scale": scale,
            "num_blocks": args.num_blocks,
            "block_bytes": args.block_bytes,
            "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
        }
        n = args.engines
        fleet_path = directory / "fleet.json"
        log(f"starting {n} simulated engines (time scale {scale:g}) in {directory}")
        fleet, doc = start_local_fleet(
            fleet_path,
            n,
            log_dir=directory,
            on_retry=lambda exc: log(f"fleet did not start ({exc}); retrying on new ports"),
            initial_roles=["prefill"] * args.prefill + ["decode"] * decode_n,
            roles=[["prefill"]] * args.prefill + [["decode"]] * decode_n,
            sim=sim,
            ttft_s=budgets[0],
            tpot_s=budgets[1],
            first_token_timeout_s=0.85 * budgets[0],
            max_model_len=args.max_model_len,
            name="goodput-sim",
            role_control={"enabled": False},  # static split: no role controller
            kv_events=args.kv_events,
        )
        # The router's prefix index holds each engine to its KV capacity, in its blocks.
        doc["engine"]["prefix_caching"] = {
            "block_size": args.block_size,
            "capacity_blocks": args.num_blocks,
        }
        fleet_path.write_text(json.dumps(doc, indent=2))
        ids = [e["id"] for e in doc["engines"]]
        urls = [fleet.engines[i].url for i in ids]
        prefill_urls, decode_urls = urls[: args.prefill], urls[args.prefill :]

        local_fleet_path = directory / "fleet-local.json"
        local_doc = {
            **doc,
            "routing": {
                "local_prefill": {"enabled": True, "max_prompt_tokens": args.local_max_prompt}
            },
        }
        local_fleet_path.write_text(json.dumps(local_doc, indent=2))
        blind_fleet_path = directory / "fleet-blind.json"  # today's cache-blind v1
        blind_doc = {**doc, "routing": {"prefix": {"enabled": False}}}
        blind_fleet_path.write_text(json.dumps(blind_doc, indent=2))
        fleet_paths = {"narwhal_v1_local": local_fleet_path, "narwhal_v1_blind": blind_fleet_path}
        store = None
        if any(s in V1_SYSTEMS for s in systems):
            log(f"profiling the fleet (decode concurrency {args.profile_concurrency})")
            t = time.perf_counter()
            store = profile(directory, fleet_path, args)
            add("profile_wall_s", time.perf_counter() - t)
            raw = json.loads(store.read_text())
            i0, s0, k0 = DECODE.intercept, DECODE.slope, DECODE.ctx_coef
            for eid in ids:
                p = raw["engines"][eid]
                pf, df = p["prefill_fit"], p["decode_fit"]
                fit_8k = (pf["a"] + pf["b"] * 8192 + pf["c"] * 8192**2) * scale
                add(
                    f"profile_{eid}",
                    f"prefill@8192 {fit_8k:.3f} s (calibration {PREFILL.seconds(8192):.3f});"
                    f" decode intercept {df['intercept'] * scale:.4f} ({i0}),"
                    f" slope {df['slope'] * scale:.5f} ({s0}),"
                    f" ctx {df['ctx_coef'] * scale:.2e} ({k0}) (model s)",
                )
                bad = [
                    (d["input_tokens"], d["concurrency"], round(d["seconds_per_token"] * scale, 3))
                    for d in p["decode_samples"]
                    if not 0.5 * i0 < d["seconds_per_token"] * scale < 2 * (i0 + s0 * 64)
                ]
                if bad:
                    add(
                        f"profile_{eid}_implausible_decode_samples",
                        f"{bad} (input tokens, concurrency, s/token; calibration says"
                        f" {i0}-{i0 + s0 * 4:.3f})",
                    )

        bases = {
            name: args.start_fraction
            * capacity_estimate(ws[0], args.prefill, decode_n, args.max_num_seqs)
            for name, ws in loaded.items()
        }
        results: dict[tuple[str, str], Search] = {}
        metrics: dict[tuple[str, str], dict[str, float]] = {}
        # Every router runs for the whole benchmark (idle ones only probe the engines), so the
        # systems take turns on each workload close together in time.
        for system in systems:
            routers[system] = Router(
                system,
                directory,
                fleet_paths.get(system, fleet_path),
                store,
                prefill_urls,
                decode_urls,
                bins["vllm-router"],
                bins["smg"],
            )
            log(f"starting {system}")
            routers[system].start()
        own0, all0, t_idle = own_cpu_seconds(), procfs.machine_cpu_seconds(), time.perf_counter()
        time.sleep(3.0)
        idle_wall = time.perf_counter() - t_idle
        cpus = os.cpu_count() or 1
        add(
            "idle_cpu",
            f"this benchmark's processes {(own_cpu_seconds() - own0) / idle_wall / cpus:.0%},"
            f" whole machine {(procfs.machine_cpu_seconds() - all0) / idle_wall / cpus:.0%}"
            f" of {cpus} cpus (fleet and routers idle)",
        )
        for name, ws in loaded.items():
            for system in systems:
                router = routers[system]
                # Start at the best an earlier system reached on this workload.
                prior = [s.goodput() for (sy, wl), s in results.items() if wl == name]
                start = max([g for g in prior if g > 0], default=bases[name])
                metrics_before = router.narwhal_metrics()
                results[(system, name)] = search_goodput(
                    router, ws, start, args, budgets, urls, started + args.budget_s
                )
                metrics[(system, name)] = router.narwhal_metrics(metrics_before)
                log(
                    f"{system} {name}: goodput {results[(system, name)].goodput():.3f} req/s"
                    f" ({time.perf_counter() - started:.0f}s elapsed)"
                )
        elapsed = time.perf_counter() - started

        # ---- report
        add(
            "command",
            f".venv/bin/python bench/goodput.py {' '.join(sys.argv[1:])}".rstrip(),
        )
        add("cpus", str(os.cpu_count()))
        add("source", git_state())
        add(
            "fleet",
            f"{n} simulated engines, {args.prefill} prefill + {decode_n} decode (static;"
            f" role controller off), Kimi-K3 calibration, time_scale {scale:g},"
            f" max_num_seqs {args.max_num_seqs}, {args.num_blocks} KV blocks x"
            f" {args.block_size} tokens, prefix caching on (as vLLM), KV events"
            f" {'published and followed by narwhal-serve' if args.kv_events else 'off'}",
        )
        add(
            "budgets",
            f"TTFT {REAL_TTFT_S:g} s, TPOT {REAL_TPOT_S:g} s real"
            f" ({budgets[0]:.3f} s, {budgets[1]:.4f} s wall), attainment {ATTAINMENT}",
        )
        add("rates", "offered requests/s of the real fleet (wall rate = rate x time_scale)")
        add(
            "vllm_router",
            "0.1.17 --vllm-pd-disaggregation; vllm_default = no --policy (cache_aware)",
        )
        if "narwhal_v1_blind" in systems:
            add("narwhal_v1_blind", "narwhal v1 with routing.prefix disabled (cache-blind)")
        if "sglang_cache_aware" in systems:
            add("sglang_cache_aware", "sglang-router 0.3.2 (smg launch --pd-disaggregation)")
        if "narwhal_v1_local" in systems:
            add(
                "narwhal_v1_local",
                "narwhal v1 + local prefill: routing.local_prefill enabled,"
                f" max_prompt_tokens {args.local_max_prompt}",
            )
        add(
            "trials",
            ", ".join(f"{w} {args.durations[w]:g}" for w in loaded)
            + f" model s of arrivals per trial, {args.windows} windows per rate (one trial"
            f" each), at most {args.max_points} rates per search (bracketing by"
            f" x{args.bracket_step:g}, then bisection to {args.precision:.0%}; goodput"
            f" interpolated where attainment crosses {ATTAINMENT});"
            f" 95% intervals from a block bootstrap ({args.blocks} blocks of consecutive requests"
            " a window,"
            f" {args.resamples} resamples, paired for ratios)" + "; a request"
            " with no first token within the TTFT budget is abandoned by the client; streams"
            " still running when the trial ends (last arrival + TTFT budget + 8 steps) are"
            " judged by projecting their remaining tokens at their recent pace (*_projected)",
        )
        for name, ws in loaded.items():
            w = ws[0]
            m = min(1000, len(w.offsets))
            desc = (
                f"first {m} requests: prompt mean {sum(w.prompt_lens[:m]) / m:.0f}"
                f" max {max(w.prompt_lens[:m])}, output mean {sum(w.gen_lens[:m]) / m:.1f}"
                f" max {max(w.gen_lens[:m])}"
            )
            if name == "fixed":
                desc += f"; Poisson arrivals, seeds {args.seed}..{args.seed + len(ws) - 1}"
            else:
                starts = ", ".join(str(x.start_row) for x in ws)
                desc += f"; windows from trace rows {starts}, timestamps rescaled to the rate"
            if any(x.clipped for x in ws):
                desc += f"; {sum(x.clipped for x in ws)} prompts clipped to max_model_len"
            add(f"workload_{name}", desc)
        for (system, name), s in results.items():
            for point in s.ordered():
                kinds = " ".join(f"{kind}={v}" for kind, v in sorted(point.counts.items()))
                trials = point.trials
                ttfts = [x for trial in trials for x in trial.ttfts]
                tpots = [x for trial in trials for x in trial.tpots]
                add(
                    f"attainment_{system}_{name}_at_{point.rate:.3f}",
                    f"{point.attainment:.3f} of {point.requests}"
                    f" (windows {' '.join(f'{sum(x.met) / x.requests:.3f}' for x in trials)})"
                    f" [{kinds}] ttft_p50 {percentile(ttfts, 50):.2f}s"
                    f" tpot_p50 {percentile(tpots, 50):.3f}s (real);"
                    f" utilisation prefill {statistics.fmean(x.utilisation[0] for x in trials):.0%}"
                    f" decode {statistics.fmean(x.utilisation[1] for x in trials):.0%};"
                    f" cpu {statistics.fmean(x.cpu_util for x in trials):.0%}, other processes"
                    f" {statistics.fmean(x.foreign_util for x in trials):.0%}, router"
                    f" {statistics.fmean(x.router_cpu_ms for x in trials):.1f} ms cpu/request"
                    + cache_note(point),
                )
                if len(trials) > 1:  # each window's trial on its own: where the misses were
                    for k, trial in enumerate(trials):
                        misses = " ".join(f"{kind}={v}" for kind, v in sorted(trial.counts.items()))
                        add(
                            f"trial_{system}_{name}_at_{point.rate:.3f}_window_{k}",
                            f"{sum(trial.met) / trial.requests:.3f} of {trial.requests}"
                            f" [{misses}] utilisation prefill {trial.utilisation[0]:.0%}"
                            f" decode {trial.utilisation[1]:.0%}",
                        )

        for (system, name), found in metrics.items():
            for key, value in sorted(found.items()):
                add(f"{system}_{name}_{key}", f"{value:.3f}")
        # The uncertainty: a block bootstrap over every request's verdict at every rate
        # (narwhal.testing.goodput), the same draws for every system on a workload.
        rng = random.Random(args.seed)
        resampled: dict[tuple[str, str], list[float]] = {}
        for name in loaded:
            searches = {sy: results[(sy, name)] for sy in systems}
            blocks = {len(s.ordered()[0].rate_point.met) for s in searches.values()}
            if len(blocks) != 1:
                continue  # (trials of different lengths: no shared draws)
            draws = bootstrap_draws(blocks.pop(), args.resamples, rng)
            for sy, s in searches.items():
                points = [p.rate_point for p in s.ordered()]
                resampled[(sy, name)] = [crossing(points, ATTAINMENT, d) for d in draws]
        for (system, name), s in results.items():
            note = " (search cut short by --budget-s)" if s.truncated else ""
            found = s.found()
            if found != "bracketed":
                bound = "at least" if found == "above" else "at most"
                note += f" ({bound}: not bracketed)"
            spread = ""
            if (system, name) in resampled:
                lo, hi = interval(resampled[(system, name)])
                spread = f" [{lo:.3f}, {hi:.3f}]"
            add(f"goodput_{system}_{name}", f"{s.goodput():.3f}{spread}{note}")
        add("bench_wall_s", elapsed)
        for row_name, value in rows:
            print(f"{row_name}: {value}")

        # Table: per workload and system, goodput with its 95% interval, and the misses and
        # utilisation at the highest rate measured at or below it.
        print()
        table = [["workload", "system", "goodput_rps", "95%_interval", "rates", "at_rate",
                  "attainment", "rejected", "ttft", "tpot", "failed", "util_prefill",
                  "util_decode", "ttft_p50", "ttft_p90", "hit_rate", "ideal_hit",
                  "kv_pulled_tok"]]  # fmt: skip
        for name in loaded:
            for system in systems:
                s = results[(system, name)]
                g = s.goodput()
                pts = s.ordered()
                point = ([p for p in pts if p.rate <= g] or pts[:1])[-1]
                misses = point.counts
                lo_hi = "-"
                if (system, name) in resampled:
                    lo, hi = interval(resampled[(system, name)])
                    lo_hi = f"{lo:.3f}-{hi:.3f}"
                table.append([
                    name, system, f"{g:.3f}", lo_hi, str(len(pts)), f"{point.rate:.3f}",
                    f"{point.attainment:.3f}", str(misses.get("rejected", 0)),
                    str(misses.get("ttft", 0)),
                    str(misses.get("tpot", 0) + misses.get("tpot_projected", 0)),
                    str(misses.get("error", 0) + misses.get("short", 0)),
                    f"{statistics.fmean(x.utilisation[0] for x in point.trials):.2f}",
                    f"{statistics.fmean(x.utilisation[1] for x in point.trials):.2f}",
                    f"{percentile(ttfts, 50):.2f}" if (ttfts := [
                        x for t in point.trials for x in t.ttfts]) else "-",
                    f"{percentile(ttfts, 90):.2f}" if ttfts else "-",
                    "-" if point.hit_rate is None else f"{point.hit_rate:.3f}",
                    "-" if point.ideal_hit_rate is None else f"{point.ideal_hit_rate:.3f}",
                    f"{point.pulled_per_request:.0f}",
                ])  # fmt: skip
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for r in table:
            print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        print()

        def ratio_line(name: str, others: list[str], label: str, workload: str) -> None:
            """``name``'s goodput over the best of ``others`` on ``workload``, with its paired
            interval and verdict (a search that ended on the target's side bounds it)."""
            others = [sy for sy in others if sy in systems and sy != name]
            if name not in systems or not others:
                return
            goodputs = {sy: results[(sy, workload)].goodput() for sy in (name, *others)}
            best_sys = max(others, key=lambda sy: goodputs[sy])
            mine, best = goodputs[name], goodputs[best_sys]
            ratio = f"{mine / best:.2f}" if best > 0 else ("inf" if mine > 0 else "n/a")
            spread = ""
            draws = {
                sy: resampled[(sy, workload)] for sy in goodputs if (sy, workload) in resampled
            }
            r = paired_ratio(goodputs, draws, name, others) if len(draws) == len(goodputs) else None
            if r is not None:
                called = r.verdict
                # A search that ended on the target's side gives a bound, not a value: the
                # ratio is bounded the same way, and only the verdict that bound allows.
                mine_found = results[(name, workload)].found()
                best_found = results[(r.best, workload)].found()
                # Mine above its target (a lower bound) or the best below its (an upper
                # bound) cannot show a loss; the converse cannot show a gain.
                bounded_up = mine_found == "above" or best_found == "below"
                bounded_down = mine_found == "below" or best_found == "above"
                if (called == "loss" and bounded_up) or (called == "gain" and bounded_down):
                    called = "undecided (a search not bracketed)"
                elif mine_found != "bracketed" or best_found != "bracketed":
                    called += " (a search not bracketed: a bound)"
                spread = f" [{r.low:.2f}, {r.high:.2f}] {called}"
            short = name.removeprefix("narwhal_")
            print(
                f"ratio_goodput_{short}_over_{label}_{workload}: {ratio}{spread}"
                f" ({short} {mine:.3f} vs {best_sys} {best:.3f})"
            )

        for name in loaded:
            others = [sy for sy in systems if sy not in V1_SYSTEMS]
            ratio_line("narwhal_v1", others, "best_other", name)
            if name in MOONCAKE:
                ratio_line("narwhal_v1", list(VLLM_SYSTEMS), "best_vllm_router", name)
                ratio_line("narwhal_v1", ["vllm_round_robin"], "round_robin", name)
                ratio_line("narwhal_v1", ["narwhal_v1_blind"], "blind", name)
                ratio_line("narwhal_v1", ["sglang_cache_aware"], "sglang_cache_aware", name)
        if "narwhal_v1" in systems and "narwhal_v1_local" in systems:
            for name in loaded:
                v1 = results[("narwhal_v1", name)].goodput()
                lp = results[("narwhal_v1_local", name)].goodput()
                ratio = f"{lp / v1:.2f}" if v1 > 0 else ("inf" if lp > 0 else "n/a")
                print(
                    f"ratio_goodput_v1_local_over_v1_{name}: {ratio}"
                    f" (v1 + local prefill {lp:.3f} vs v1 {v1:.3f})"
                )
        if args.keep_dir:
            print(f"kept: {directory}")
        return 0
    finally:
        for r in routers.values():
            r.stop()
        if fleet is not None:
            fleet.stop()
        if not args.keep_dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
