"""Profiling live engines: prefill latency by prompt length, decode seconds per token by
concurrency and context, each engine in isolation (its probes never overlap each other) and
all engines in parallel, within the limits file's wall-time, token and per-probe bounds.

Prompts are token ids drawn from the engine's own tokenization of a seed text, with a fresh
random order and a ``cache_salt`` per probe, so no probe is served from the prefix cache.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import orjson

from narwhal.contract import EngineSpec, FleetContract
from narwhal.engines.probes import SEED_TEXT, check_idle
from narwhal.engines.sse import iter_sse_events
from narwhal.profiles.store import (
    DecodeSample,
    EngineProfile,
    PrefillSample,
    ProfilingLimits,
    ProfilingPlan,
    fit_engine,
)

__all__ = [
    "DECODE_PROBE_ATTEMPTS",
    "DecodeProbe",
    "EngineProfilingError",
    "NoDecodeOverlapError",
    "profile_engine",
    "profile_fleet",
    "sample_decode",
]

Progress = Callable[[str], None]


# A decode probe whose sequences never all decoded at once (one finished before another had
# its first token: a stalled host, or an API server that admitted them far apart) measures no
# batch; it runs again, up to this many times in all, before the engine's profile fails.
DECODE_PROBE_ATTEMPTS = 3


class EngineProfilingError(Exception):
    """An engine could not be profiled completely (the store would be partial)."""


class NoDecodeOverlapError(EngineProfilingError):
    """A decode probe's concurrent sequences had no stretch where all of them decoded."""


@dataclass
class DecodeProbe:
    """What one decode probe saw: each stream's token-chunk arrival times at the client, and the
    change of the engine's own inter-token latency histogram (sum of seconds, count) across
    the probe, None when the engine's /metrics does not carry it."""

    times: list[list[float]]
    engine_itl: tuple[float, float] | None = None
    sent: float = 0.0  # when the first of them was sent (the clock of ``times``)


_ITL_LINE = re.compile(
    rb"^vllm:inter_token_latency_seconds_(sum|count)(?:\{[^}]*\})? ([^\s]+)", re.MULTILINE
)
# The engine's inter-token latencies count for a probe when the histogram moved by this share of
# the probe's own token gaps, give or take: less means the metric lags or is not per token; more
# means other traffic shared the engine. Either way the client's timing is used instead.
ENGINE_ITL_COUNT_TOLERANCE = 0.1
# A stream counts in the window when its arrivals there span at least this share of it; a
# shorter span is a lump (many tokens at one moment), which says nothing about their rate.
STREAM_SPAN_SHARE = 0.5
# The client's window counts when it spans at least this share of the probe (from the first
# send to the last token); a shorter one is a lump's few microseconds, not a decode.
WINDOW_SHARE = 0.25


@dataclass
class _Budget:
    limits: ProfilingLimits
    started: float = field(default_factory=time.monotonic)
    tokens: int = 0

    def spend(self, tokens: int) -> None:
        if self.tokens + tokens > self.limits.max_tokens_per_engine:
            raise EngineProfilingError(
                f"token limit: {self.tokens + tokens} tokens would exceed "
                f"max_tokens_per_engine {self.limits.max_tokens_per_engine}"
            )
        if time.monotonic() - self.started > self.limits.max_wall_s_per_engine:
            raise EngineProfilingError(
                f"wall-time limit: exceeded max_wall_s_per_engine "
                f"{self.limits.max_wall_s_per_engine} s"
            )
        self.tokens += tokens


class _Prompts:
    def __init__(self, pool: list[int], seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)

    def make(self, n: int) -> list[int]:
        return [self.rng.choice(self.pool) for _ in range(n)]


async def _token_pool(client: httpx.AsyncClient, model: str) -> list[int]:
    r = await client.post("/tokenize", json={"model": model, "prompt": SEED_TEXT * 4})
    if r.status_code != 200:
        raise EngineProfilingError(f"/tokenize answered {r.status_code}")
    tokens = r.json().get("tokens")
    pool = sorted({t for t in tokens if isinstance(t, int)}) if isinstance(tokens, list) else []
    if len(pool) < 8:
        raise EngineProfilingError("/tokenize returned too few distinct token ids for prompts")
    return pool


async def _stream_times(
    client: httpx.AsyncClient, body: dict, timeout: float
) -> tuple[float, list[float]]:
    """Send a streamed completion; return (send time, arrival time of each token chunk)."""
    sent = time.monotonic()
    times: list[float] = []

    async def run() -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise EngineProfilingError(f"probe answered HTTP {r.status_code}")
            async for data in iter_sse_events(r.aiter_bytes()):
                if data == b"[DONE]":
                    return
                obj = orjson.loads(data)
                if "error" in obj:
                    raise EngineProfilingError(f"probe failed: {obj['error']}")
                if any(c.get("text") for c in obj.get("choices") or ()):
                    times.append(time.monotonic())

    try:
        await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        raise EngineProfilingError(f"probe exceeded probe_timeout_s {timeout}") from None
    except httpx.HTTPError as exc:
        raise EngineProfilingError(f"probe failed: {type(exc).__name__}: {exc}") from None
    return sent, times


async def engine_itl_totals(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """The engine's ``vllm:inter_token_latency_seconds`` sum and count (over its label sets),
    None if its /metrics does not answer or carries no such histogram."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    totals = {b"sum": 0.0, b"count": 0.0}
    found = False
    for match in _ITL_LINE.finditer(r.content):
        try:
            totals[match.group(1)] += float(match.group(2))
        except ValueError:
            continue
        found = True
    return (totals[b"sum"], totals[b"count"]) if found else None


async def _generation(spec: EngineSpec) -> str | None:
    if not spec.attestation_url:
        return spec.generation
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        try:
            r = await client.get(spec.attestation_url)
            r.raise_for_status()
            return str(r.json()["generation"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise EngineProfilingError(f"attestation unreachable: {exc}") from None


async def profile_engine(
    spec: EngineSpec,
    model: str,
    plan: ProfilingPlan,
    limits: ProfilingLimits,
    force: bool,
    progress: Progress,
    seed: int = 0,
) -> EngineProfile:
    started = time.monotonic()
    budget = _Budget(limits)
    if plan.tokens_needed() > limits.max_tokens_per_engine:
        raise EngineProfilingError(
            f"the plan needs {plan.tokens_needed()} tokens, over max_tokens_per_engine "
            f"{limits.max_tokens_per_engine}"
        )
    timeout = httpx.Timeout(limits.probe_timeout_s, connect=5.0)
    async with httpx.AsyncClient(base_url=spec.url, timeout=timeout, trust_env=False) as client:
        if not force and (why := await check_idle(client)) is not None:
            raise EngineProfilingError(f"refusing to profile: {why} (use --force)")
        generation = await _generation(spec)
        prompts = _Prompts(await _token_pool(client, model), seed)
        salt = f"narwhal-profile-{spec.id}-{random.Random(seed).getrandbits(64):x}"
        probe = 0

        def body(n: int, max_tokens: int) -> dict:
            nonlocal probe
            probe += 1
            return {
                "model": model,
                "prompt": prompts.make(n),
                "max_tokens": max_tokens,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
                "cache_salt": f"{salt}-{probe}",
            }

        prefill: list[PrefillSample] = []
        for repeat in range(plan.prefill_repeats):
            for n in plan.prefill_lens:
                budget.spend(n + 1)
                sent, times = await _stream_times(client, body(n, 1), limits.probe_timeout_s)
                if not times:
                    raise EngineProfilingError(f"prefill probe of {n} tokens produced no token")
                prefill.append(
                    PrefillSample(input_tokens=n, repeat=repeat, seconds=times[0] - sent)
                )
                progress(
                    f"{spec.id}: prefill {n} tokens (repeat {repeat + 1}/"
                    f"{plan.prefill_repeats}): {times[0] - sent:.4f} s"
                )
        decode: list[DecodeSample] = []
        for n in plan.decode_input_lens:
            for c in plan.decode_concurrency:

                async def run(n: int = n, c: int = c) -> DecodeProbe:
                    budget.spend((n + plan.decode_tokens) * c)
                    before = await engine_itl_totals(client)
                    sent = time.monotonic()
                    runs = await asyncio.gather(
                        *(
                            _stream_times(
                                client, body(n, plan.decode_tokens), limits.probe_timeout_s
                            )
                            for _ in range(c)
                        )
                    )
                    after = await engine_itl_totals(client) if before is not None else None
                    itl = None
                    if before is not None and after is not None:
                        itl = (after[0] - before[0], after[1] - before[1])
                    return DecodeProbe([times for _, times in runs], itl, sent)

                decode.append(
                    await sample_decode(
                        run,
                        n,
                        c,
                        plan.decode_tokens,
                        on_retry=lambda why: progress(f"{spec.id}: {why}"),
                    )
                )
                progress(
                    f"{spec.id}: decode {n} tokens x {c} concurrent: "
                    f"{decode[-1].seconds_per_token:.5f} s/token"
                )
    prefill_fit, decode_fit = fit_engine(prefill, decode)
    return EngineProfile(
        engine_id=spec.id,
        url=spec.url,
        generation=generation,
        wall_s=round(time.monotonic() - started, 3),
        tokens_used=budget.tokens,
        prefill_samples=prefill,
        decode_samples=decode,
        prefill_fit=prefill_fit,
        decode_fit=decode_fit,
    )


async def sample_decode(
    run: Callable[[], Awaitable[DecodeProbe]],
    n: int,
    concurrency: int,
    tokens: int,
    *,
    attempts: int = DECODE_PROBE_ATTEMPTS,
    on_retry: Progress = lambda why: None,
) -> DecodeSample:
    """One decode sample from ``run`` (which sends ``concurrency`` probes of ``n`` prompt tokens
    at once and returns what they saw), running it again while its sequences never all decoded
    together, ``attempts`` times in all."""
    for attempt in range(1, attempts):
        try:
            return _decode_sample(n, concurrency, tokens, await run())
        except NoDecodeOverlapError as exc:
            on_retry(f"{exc}; probing again ({attempt + 1}/{attempts})")
    return _decode_sample(n, concurrency, tokens, await run())


# The sequences of one decode probe generate the same number of tokens (``ignore_eos``), so if
# they all finished within this share of their decode time they ran in one batch (nearly) from
# start to end, even when one of them reached the client in a lump: an API server that falls
# behind makes vLLM merge a stream's waiting outputs into a few chunks that arrive at once, and
# late. Sequences that ran one after the other finish a whole decode time apart.
ALIGNED_ENDS_SHARE = 0.3


def _ends_aligned(runs: list[list[float]], decode_s: float | None = None) -> bool:
    """Whether the streams' last tokens arrived within ``ALIGNED_ENDS_SHARE`` of ``decode_s``
    (default: from the first arrival to the last) of each other."""
    ends = [times[-1] for times in runs]
    if decode_s is None:
        decode_s = max(ends) - min(times[0] for times in runs)
    return max(ends) - min(ends) <= ALIGNED_ENDS_SHARE * decode_s


def _decode_sample(n: int, concurrency: int, tokens: int, probe: DecodeProbe) -> DecodeSample:
    """Seconds per token while all ``concurrency`` sequences decode together.

    From the client's arrival times across the window that opens when the last sequence has
    its first token (before that, prefills share the steps) and closes when the first one
    finishes (after that, the batch shrinks). A window shorter than ``WINDOW_SHARE`` of the
    probe, or a stream whose arrivals span less than ``STREAM_SPAN_SHARE`` of it, is lumps, not
    a decode: an API server that falls behind makes vLLM merge a stream's waiting outputs into
    a few chunks that arrive at once. When no stream arrived smoothly and the sequences
    finished together: the engine's own inter-token latencies if its histogram moved by the
    probe's token gaps (vLLM stamps them in the engine core; their mean also counts the steps
    that later sequences' prefills shared), else the stream that arrived over the longest time
    (lumps only shorten the others), ``tokens`` over that time.
    """
    runs = probe.times
    if all(len(times) < 3 for times in runs):
        raise EngineProfilingError(
            f"decode probe ({n} tokens x {concurrency}) returned too few tokens"
        )
    if any(not times for times in runs):
        raise EngineProfilingError(f"decode probe ({n} tokens x {concurrency}) produced no token")
    start = max(times[0] for times in runs)
    end = min(times[-1] for times in runs)
    # Each stream's rate across the window (tokens inside it over the time they span): the
    # median of single gaps reads chunks that arrive coalesced on a busy host as 0 s/token.
    rates: list[float] = []
    positions: list[float] = []
    gaps_used = 0
    window_counts = end - start >= WINDOW_SHARE * (max(t[-1] for t in runs) - probe.sent)
    for times in runs if window_counts else ():
        inside = [(i, t) for i, t in enumerate(times) if start <= t <= end]
        if len(inside) < 3:
            continue
        span = inside[-1][1] - inside[0][1]
        if span <= 0 or span < STREAM_SPAN_SHARE * (end - start):
            continue
        rates.append(span / (len(inside) - 1))
        positions.extend(i for i, _ in inside)
        gaps_used += len(inside) - 1
    # Seconds per token, mean context position and token gaps behind them, from the first
    # source that holds: the client's window, the engine's own latencies, the longest stream.
    spt: float | None = None
    position, gaps = (tokens - 1) / 2, tokens - 1
    engine_gaps = concurrency * (tokens - 1)
    if rates:
        spt, position, gaps = statistics.median(rates), statistics.fmean(positions), gaps_used
    elif probe.engine_itl is not None:
        itl_sum, itl_count = probe.engine_itl
        close = abs(itl_count - engine_gaps) <= ENGINE_ITL_COUNT_TOLERANCE * engine_gaps
        if close and itl_sum > 0 and _ends_aligned(runs, itl_sum / itl_count * (tokens - 1)):
            spt, gaps = itl_sum / itl_count, round(itl_count)
    if spt is None:
        longest = max((t for t in runs if len(t) >= 3), key=lambda t: t[-1] - t[0])
        span = longest[-1] - longest[0]
        if span <= 0 or not _ends_aligned(runs):
            raise NoDecodeOverlapError(
                f"decode probe ({n} tokens x {concurrency}) had no window where all "
                f"{concurrency} sequences decoded together: raise --decode-tokens"
            )
        spt = span / (tokens - 1)
    return DecodeSample(
        input_tokens=n,
        concurrency=concurrency,
        tokens=tokens,
        mean_context=n + position,
        seconds_per_token=spt,
        itl_samples=gaps,
    )


async def profile_fleet(
    fleet: FleetContract,
    engine_ids: list[str],
    plan: ProfilingPlan,
    limits: ProfilingLimits,
    force: bool,
    progress: Progress,
) -> tuple[dict[str, EngineProfile], dict[str, str]]:
    """Profile engines in parallel; returns (profiles, failures by engine)."""

    async def one(engine_id: str) -> tuple[str, EngineProfile | str]:
        spec = fleet.engine_by_id(engine_id)
        try:
            return engine_id, await profile_engine(
                spec,
                fleet.model.id,
                plan,
                limits,
                force,
                progress,
                seed=zlib.crc32(engine_id.encode()),
            )
        except EngineProfilingError as exc:
            return engine_id, str(exc)
        except httpx.HTTPError as exc:
            return engine_id, f"unreachable: {type(exc).__name__}: {exc}"

    results = await asyncio.gather(*(one(e) for e in engine_ids))
    profiles = {e: r for e, r in results if isinstance(r, EngineProfile)}
    failures = {e: r for e, r in results if isinstance(r, str)}
    return profiles, failures
