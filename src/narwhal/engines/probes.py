"""What timing probes of a live engine share (narwhal-profile and narwhal-check, so the check's
pace probe reads an engine the way its profile did): the seed text probe prompts draw their
token ids from, the test that an engine is idle enough to time, the streamed probe's arrival
times, seconds per token from a decode probe, and the turns that engines sharing a host take
for their timed prefills."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import httpx
import orjson

from narwhal.engines.scrape import metric_sum, parse_engine_load
from narwhal.engines.sse import iter_sse_events
from narwhal.profiles.store import DecodeSample

__all__ = [
    "DECODE_PROBE_ATTEMPTS",
    "SEED_TEXT",
    "DecodeProbe",
    "EngineNotIdle",
    "NoDecodeOverlapError",
    "PrefillTurns",
    "ProbeError",
    "check_idle",
    "engine_itl_totals",
    "error_message",
    "probe_decode",
    "sample_decode",
    "stream_arrivals",
]

Progress = Callable[[str], None]

# Tokenized by the engine itself (four times over) into the pool of token ids a probe's prompt
# is drawn from, in a fresh random order per probe so no probe is served from a prefix cache.
SEED_TEXT = (
    "Disaggregated serving splits the compute bound prefill of a prompt from the memory bound "
    "decode of its answer, so that each runs on hardware sized for it, and moves the key value "
    "cache between them over a fast fabric. Routers pick engines by predicted latency. "
)


class PrefillTurns:
    """Engines that share a host take turns for their timed prefill probes, and probe decode
    only once every engine on the host is done with its prefills; engines on different hosts
    never wait for each other.

    Engines on one host share its CPU and memory bandwidth: four simulated engines on two cores,
    probed at once, timed a 8,192-token prefill 20-40% slower than one alone, and the profile
    and the pace check, each timing a different overlap, disagreed by as much. A decode probe's
    per-token gaps are not disturbed that way, but its prompt is: it waits for the host's
    prefills.
    """

    def __init__(self, hosts: Mapping[str, str]) -> None:
        """``hosts``: each engine's host (engine id -> host)."""
        self._host = dict(hosts)
        self._locks = {host: asyncio.Lock() for host in self._host.values()}
        self._pending = {
            host: {e for e, h in self._host.items() if h == host} for host in self._locks
        }
        self._prefilled = {host: asyncio.Event() for host in self._locks}

    @contextlib.asynccontextmanager
    async def prefills(self, engine_id: str) -> AsyncIterator[float]:
        """Hold the host for ``engine_id``'s timed prefills (it counts as done after them);
        gives the seconds it waited for its turn."""
        asked = time.monotonic()
        async with self._locks[self._host[engine_id]]:
            try:
                yield time.monotonic() - asked
            finally:
                self.done(engine_id)

    def done(self, engine_id: str) -> None:
        """``engine_id`` times no more prefills (idempotent: also for an engine that failed)."""
        host = self._host[engine_id]
        self._pending[host].discard(engine_id)
        if not self._pending[host]:
            self._prefilled[host].set()

    async def host_prefilled(self, engine_id: str) -> float:
        """Until every engine on ``engine_id``'s host is done with its timed prefills; gives
        the seconds it waited."""
        asked = time.monotonic()
        await self._prefilled[self._host[engine_id]].wait()
        return time.monotonic() - asked


@dataclass(frozen=True)
class EngineNotIdle:
    """Why an engine is not known to be idle. ``kind``: its /metrics did not answer
    (``unreachable``; ``error`` names the exception), answered without vLLM's load gauges
    (``not_vllm``: an error status, or not a vLLM engine), or shows requests (``busy``).
    ``reason`` says so in a sentence."""

    kind: Literal["unreachable", "not_vllm", "busy"]
    reason: str
    error: str | None = None  # the exception's type name, when unreachable


async def check_idle(client: httpx.AsyncClient) -> EngineNotIdle | None:
    """None if the engine is idle; otherwise why not."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError as exc:
        name = type(exc).__name__
        return EngineNotIdle("unreachable", f"/metrics unreachable: {name}", error=name)
    load = parse_engine_load(r.content) if r.status_code == 200 else None
    if load is None:
        return EngineNotIdle("not_vllm", "its /metrics carries no vLLM load gauges")
    if load["running"] or load["waiting"]:
        return EngineNotIdle(
            "busy", f"not idle ({load['running']:g} running, {load['waiting']:g} waiting)"
        )
    return None


def error_message(response: httpx.Response) -> str:
    """An engine's error answer in one line: its status and OpenAI error message."""
    try:
        body = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body
    except (ValueError, KeyError, TypeError, AttributeError):
        message = response.text[:200]
    return f"HTTP {response.status_code}: {str(message)[:200]}"


async def stream_arrivals(
    client: httpx.AsyncClient,
    body: dict,
    timeout_s: float,
    now: Callable[[], float] = time.monotonic,
) -> tuple[float, list[float]]:
    """Send ``body`` as a streamed completion; return (send time, arrival time of each chunk
    carrying text), both on ``now``."""
    sent = now()
    times: list[float] = []

    async def run() -> None:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                raise ProbeError(f"probe answered {error_message(r)}")
            async for data in iter_sse_events(r.aiter_bytes()):
                if data == b"[DONE]":
                    return
                obj = orjson.loads(data)
                if "error" in obj:
                    raise ProbeError(f"probe failed: engine error: {obj['error']}")
                if any(c.get("text") for c in obj.get("choices") or ()):
                    times.append(now())

    try:
        async with asyncio.timeout(timeout_s):
            await run()
    except TimeoutError:
        raise ProbeError(f"probe exceeded probe_timeout_s {timeout_s}") from None
    except httpx.HTTPError as exc:
        raise ProbeError(f"probe failed: {type(exc).__name__}: {exc}") from None
    except orjson.JSONDecodeError:
        raise ProbeError("probe failed: the engine streamed an event that is not JSON") from None
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
    total = metric_sum(r.content, "vllm:inter_token_latency_seconds_sum")
    count = metric_sum(r.content, "vllm:inter_token_latency_seconds_count")
    if total is None and count is None:
        return None
    return (total or 0.0, count or 0.0)


async def probe_decode(
    client: httpx.AsyncClient,
    bodies: list[dict],
    timeout_s: float,
    now: Callable[[], float] = time.monotonic,
) -> DecodeProbe:
    """Send ``bodies`` as streamed completions at once; what they saw, with the engine's own
    inter-token latency totals across them (the raw material of ``sample_decode``)."""
    before = await engine_itl_totals(client)
    sent = now()
    runs = await asyncio.gather(*(stream_arrivals(client, b, timeout_s, now) for b in bodies))
    after = await engine_itl_totals(client) if before is not None else None
    itl = None
    if before is not None and after is not None:
        itl = (after[0] - before[0], after[1] - before[1])
    return DecodeProbe([times for _, times in runs], itl, sent)


# A decode probe whose sequences never all decoded at once (one finished before another had
# its first token: a stalled host, or an API server that admitted them far apart) measures no
# batch; it runs again, up to this many times in all, before the engine's profile fails.
DECODE_PROBE_ATTEMPTS = 3


class ProbeError(Exception):
    """A timing probe of a live engine failed (refused, timed out, too few tokens)."""


class NoDecodeOverlapError(ProbeError):
    """A decode probe's concurrent sequences had no stretch where all of them decoded."""


@dataclass
class DecodeProbe:
    """What one decode probe saw: each stream's token-chunk arrival times at the client, and the
    change of the engine's own inter-token latency histogram (sum of seconds, count) across
    the probe, None when the engine's /metrics does not carry it."""

    times: list[list[float]]
    engine_itl: tuple[float, float] | None = None
    sent: float = 0.0  # when the first of them was sent (the clock of ``times``)


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
# Without that window, the engine's inter-token latencies and the longest stream span each
# sequence's whole decode, the steps it shared with the later sequences' prefills too (before
# the last one's first token), which are slower by a prefill each. Past this share of the
# streams' decode time they measure the prefills: 32 concurrent 8,192-token prompts with 64
# output tokens read 0.125 s/token on an engine that decodes 32 sequences at 0.073, and the
# fit through that sample put the slope at twice the engine's. The probe is refused instead.
PREFILL_SHARED_SHARE = 0.1
# A stream counts in that share when it arrived token by token (at least this share of its
# tokens as separate arrivals): a lump's late first arrival says when the API server caught
# up, not when the engine prefilled it.
SMOOTH_STREAM_SHARE = 0.5


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


def _prefill_shared_share(runs: list[list[float]], tokens: int) -> float:
    """The share of the smooth streams' decode time (first arrival to last) before the last
    of them had its first token: steps shared with the others' prefills. 0 when they never
    decoded together (one ended before another began: a busy host kept them apart, which a
    probe run again may not)."""
    smooth = [t for t in runs if len(t) >= SMOOTH_STREAM_SHARE * tokens and t[-1] > t[0]]
    if len(smooth) < 2:
        return 0.0
    start = max(t[0] for t in smooth)
    if start >= min(t[-1] for t in smooth):
        return 0.0
    shared = sum(min(start, t[-1]) - t[0] for t in smooth)
    return shared / sum(t[-1] - t[0] for t in smooth)


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
        raise ProbeError(f"decode probe ({n} tokens x {concurrency}) returned too few tokens")
    if any(not times for times in runs):
        raise ProbeError(f"decode probe ({n} tokens x {concurrency}) produced no token")
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
    if not rates:
        # A fallback timed it (the sequences decoded together, ending together): refused if
        # it spans the later prompts' prefills. Sequences kept apart by a busy host were
        # probed again above, as before.
        shared = _prefill_shared_share(runs, tokens)
        if shared > PREFILL_SHARED_SHARE:
            raise ProbeError(
                f"decode probe ({n} tokens x {concurrency}): {shared:.0%} of its sequences'"
                " decode time shared steps with the others' prefills, and no window where all"
                f" {concurrency} decoded together measured the decode alone: raise"
                " --decode-tokens (or probe fewer or shorter prompts at once)"
            )
    return DecodeSample(
        input_tokens=n,
        concurrency=concurrency,
        tokens=tokens,
        mean_context=n + position,
        seconds_per_token=spt,
        itl_samples=gaps,
    )
