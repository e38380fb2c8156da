"""Workloads for the virtual-time simulator: Azure-format traces, the Mooncake traces (with
their prompts' shared prefixes), Poisson arrivals, synthetic fleets of any size, and the timing
(latency model) of a fleet file's simulated engines."""

from __future__ import annotations

import csv
import io
import json
import random
import re
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from narwhal.contract import FleetContract, parse_fleet
from narwhal.fleetsim.simulator import KVBlocks, RequestSpec
from narwhal.profiles.models import EngineModels
from narwhal.routing.prefix import chain_root, extend_chain
from narwhal.simengine.fleet import local_fleet_document
from narwhal.simengine.timing import sim_models

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "PrefixTrace",
    "back_to_back",
    "ideal_cached_tokens",
    "ideal_hit_rate",
    "kv_blocks_of",
    "mooncake_requests",
    "poisson_requests",
    "read_azure_trace",
    "read_mooncake_trace",
    "synthetic_fleet",
    "timings_of",
    "trace_requests",
]


# The columns of the Azure LLM inference traces (2023) that a replay reads.
AZURE_TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_azure_trace(
    path: str | Path,
    limit: int | None = None,
    max_prompt: int | None = None,
    data: bytes | None = None,
) -> list[tuple[float, int, int]]:
    """(seconds since the first request, context tokens, generated tokens) from an Azure
    LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens). A file that is not one
    raises ``ValueError`` naming the path, the row and what is wrong (``OSError`` when it
    cannot be read). ``data``: the file's bytes, when the caller has read them already (to
    hash what is parsed, not a second read of a file that may have changed or a pipe)."""
    try:
        return _read_azure_rows(path, limit, max_prompt, data)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: not a readable CSV file: {exc}") from None


def _read_azure_rows(
    path: str | Path, limit: int | None, max_prompt: int | None, data: bytes | None
) -> list[tuple[float, int, int]]:
    rows: list[tuple[float, int, int]] = []
    if data is None:
        data = Path(path).read_bytes()  # a trace is a few MB
    # utf-8-sig: a header some editors mark with a byte order mark still names its columns.
    with io.StringIO(data.decode("utf-8-sig"), newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_TRACE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(
                f"{path}: not an Azure LLM inference trace: no {', '.join(missing)}"
                f" column{'s' if len(missing) > 1 else ''}"
                f" (columns: {', '.join(reader.fieldnames or ()) or 'none'})"
            )
        t0 = None
        for row in reader:
            try:
                stamp = (row["TIMESTAMP"] or "").strip()
                t = _trace_time(stamp)
                context = _token_count(row, "ContextTokens")
                output = _token_count(row, "GeneratedTokens")
                # A zero the traces do hold (an answer cut at once) is one token.
                prompt, generated = max(1, context), max(1, output)
            except ValueError as exc:
                raise ValueError(f"{path}: line {reader.line_num}: {exc}") from None
            if t0 is not None and rows and t - t0 < rows[-1][0]:
                # Replayed in file order, a row out of order would arrive before its time.
                raise ValueError(
                    f"{path}: line {reader.line_num}: TIMESTAMP {stamp} is before the row above"
                    " (a trace lists its requests in time order)"
                )
            t0 = t if t0 is None else t0
            if max_prompt is not None:
                prompt = min(prompt, max_prompt)
            rows.append((t - t0, prompt, generated))
            if limit is not None and len(rows) >= limit:
                break
    return rows


# YYYY-MM-DD HH:MM:SS, a fraction of any length, an offset (the 2024 traces write +00:00).
_TRACE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:?\d\d)?$")


def _trace_time(stamp: str) -> float:
    """A TIMESTAMP as seconds since the epoch: its offset applied, a time without one read as
    UTC (not the host's zone, whose daylight-saving change would put an hour into a trace that
    crosses it), its fraction kept to the microsecond (what datetime holds)."""
    match = _TRACE_TIME.match(stamp)
    try:
        if match is None:
            raise ValueError("not in that form")
        head, frac, zone = match.groups()
        moment = datetime.fromisoformat(f"{head}.{((frac or '') + '000000')[:6]}{zone or ''}")
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()
    except (ValueError, OverflowError, OSError) as exc:
        # Python's own words ("year 0 is out of range") do not say which field.
        raise ValueError(
            f"TIMESTAMP {stamp!r} is not a date and time"
            f" (YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]): {exc}"
        ) from None


def _token_count(row: dict[str, str | None], column: str) -> int:
    value = row.get(column)
    if value is None:
        raise ValueError(f"no {column} (the row has fewer fields than the header)")
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{column} {value!r} is not a whole number of tokens") from None
    if count < 0:
        raise ValueError(f"{column} {count} is negative")
    return count


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


# The Mooncake traces key prompts by blocks of this many tokens.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class PrefixTrace:
    """A trace whose prompts share prefixes: per request (seconds since the first, prompt
    tokens, output tokens, the chain keys of its prompt's full blocks), and how many prompts
    were clipped to fit the model's context."""

    rows: list[tuple[float, int, int, tuple[int, ...]]]
    clipped: int
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


def read_mooncake_trace(
    path: str | Path, max_model_len: int | None = None, limit: int | None = None
) -> PrefixTrace:
    """A Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of
    its 512-token prompt blocks). Each prompt's full blocks become chain keys (block i's key
    stands for hash ids 0..i: equal keys, equal prefixes); a prompt that with its output would
    exceed ``max_model_len`` is clipped to fit (its blocks past the cut dropped).

    The conversation trace's timestamps are whole seconds (12,031 requests on 1,180 distinct
    stamps, up to 28 on one): replayed as recorded, each second's requests would arrive at one
    instant, a burst no rate could absorb (compressing or stretching the trace keeps it one
    instant). The requests sharing a stamp are spread evenly over the stamp's resolution (the
    gap to the next distinct stamp, at most a second), in their recorded order."""
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    clipped = 0
    root = chain_root()
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            raw = json.loads(line)
            prompt = max(1, int(raw["input_length"]))
            output = max(1, int(raw["output_length"]))
            if max_model_len is not None and prompt + output > max_model_len:
                prompt = max(1, max_model_len - output)
                clipped += 1
            keys: list[int] = []
            key = root
            for h in raw["hash_ids"][: prompt // MOONCAKE_BLOCK_TOKENS]:
                key = extend_chain(key, (int(h),))
                keys.append(key)
            rows.append((float(raw["timestamp"]) / 1000.0, prompt, output, tuple(keys)))
            if limit is not None and len(rows) >= limit:
                break
    return PrefixTrace(_spread_ties(rows), clipped)


def _spread_ties(
    rows: list[tuple[float, int, int, tuple[int, ...]]],
) -> list[tuple[float, int, int, tuple[int, ...]]]:
    out = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][0] == rows[i][0]:
            j += 1
        span = min(1.0, rows[j][0] - rows[i][0]) if j < len(rows) else 1.0
        for k in range(i, j):
            t, p, g, keys = rows[k]
            out.append((t + span * (k - i) / (j - i), p, g, keys))
        i = j
    return out


def back_to_back(trace: PrefixTrace, copies: int) -> PrefixTrace:
    """The trace played ``copies`` times one after another, each copy starting a mean gap after
    the one before, for a fleet one copy cannot fill (at 512 engines the conversation trace's
    hour compresses to little more than one request's lifetime). Each copy's prompts are its
    own: its chain keys are re-keyed by the copy's number, so prompts share prefixes within a
    copy exactly as in the trace and never across copies (a later copy is more traffic of the
    same shape, not the same traffic again)."""
    if copies <= 1:
        return trace
    rows = trace.rows
    t0 = rows[0][0]
    span = rows[-1][0] - t0
    gap = span / (len(rows) - 1) if len(rows) > 1 else 1.0
    out = list(rows)
    for copy in range(1, copies):
        shift = copy * (span + gap)
        # The copy's number as a block of its own keeps equal keys equal within the copy; two
        # values, as no trace block has (and not -copy: hash(-1) == hash(-2) in CPython).
        tag = (copy, copy)
        out += [
            (t + shift, p, g, tuple(extend_chain(k, tag) for k in keys)) for t, p, g, keys in rows
        ]
    return PrefixTrace(out, trace.clipped * copies, trace.block_tokens)


def mooncake_requests(
    rows: list[tuple[float, int, int, tuple[int, ...]]], rate: float
) -> list[RequestSpec]:
    """The rows' recorded arrival pattern compressed (or stretched) to a mean of ``rate``
    requests/s, from time 0; each client asks for exactly its output's length."""
    t0 = rows[0][0]
    span = (rows[-1][0] - t0) or 1.0
    scale = (len(rows) / span) / rate
    return [RequestSpec((t - t0) * scale, p, g, None, keys) for t, p, g, keys in rows]


def ideal_hit_rate(
    rows: list[tuple[float, int, int, tuple[int, ...]]],
    capacity_tokens: int | None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> float:
    """The share of prompt tokens an earlier request already computed, as one prefix cache of
    ``capacity_tokens`` (None: unbounded) would find them, least recently used out: what a
    fleet whose caches added up to one could at best reach (vLLM's rule kept: the prompt's
    last token is always computed)."""
    total = sum(prompt for _, prompt, _, _ in rows)
    hit = sum(ideal_cached_tokens(rows, capacity_tokens, block_tokens))
    return hit / total if total else 0.0


def ideal_cached_tokens(
    rows: list[tuple[float, int, int, tuple[int, ...]]],
    capacity_tokens: int | None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[int]:
    """Each request's prompt tokens that one prefix cache of ``capacity_tokens`` (None:
    unbounded) holds when it arrives (``ideal_hit_rate``'s cache), in whole blocks."""
    cache: OrderedDict[int, None] = OrderedDict()
    limit = None if capacity_tokens is None else capacity_tokens // block_tokens
    out = []
    for _, prompt, _, keys in rows:
        usable = keys[: (prompt - 1) // block_tokens]
        n = 0
        for key in usable:
            if key not in cache:
                break
            n += 1
        out.append(n * block_tokens)
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        if limit is not None:
            while len(cache) > limit:
                cache.popitem(last=False)
    return out
