"""Profiling live engines: prefill latency by prompt length, decode seconds per token by
concurrency and context, each engine in isolation (its probes never overlap each other) and
all engines in parallel, except that engines sharing a host take turns for their timed prefills
(``PrefillTurns``), within the limits file's wall-time, token and per-probe bounds.

Prompts are token ids drawn from the engine's own tokenization of a seed text, with a fresh
random order and a ``cache_salt`` per probe, so no probe is served from the prefix cache.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from narwhal.contract import EngineSpec, FleetContract
from narwhal.engines.probes import (
    SEED_TEXT,
    DecodeProbe,
    EngineNotIdle,
    PrefillTurns,
    ProbeError,
    check_idle,
    probe_decode,
    sample_decode,
    stream_arrivals,
)
from narwhal.profiles.store import (
    DecodeSample,
    EngineProfile,
    PrefillSample,
    ProfilingLimits,
    ProfilingPlan,
    fit_engine,
)

__all__ = ["EngineProfilingError", "profile_engine", "profile_fleet"]

Progress = Callable[[str], None]
# How long a profile run waits for an attestation sidecar still hashing the engine's files (a
# run started with the fleet's launch), and how often it asks.
ATTESTATION_WAIT_S = 120.0
ATTESTATION_POLL_S = 0.5


class EngineProfilingError(Exception):
    """An engine could not be profiled completely (the store would be partial)."""


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
        if self.elapsed_s() > self.limits.max_wall_s_per_engine:
            raise EngineProfilingError(
                f"wall-time limit: exceeded max_wall_s_per_engine "
                f"{self.limits.max_wall_s_per_engine} s"
            )
        self.tokens += tokens

    def elapsed_s(self) -> float:
        """The engine's profiling time so far, not counting its waits for a host's turn."""
        return time.monotonic() - self.started

    def exclude(self, seconds: float) -> None:
        """Take ``seconds`` (a wait for another engine's turn on this host) off the clock."""
        self.started += seconds


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


def _hashing(r: httpx.Response) -> tuple[int, int] | None:
    """(hashed, total) bytes when an attestation sidecar answers that it is still hashing
    the engine's files (503, ``state`` "hashing"), else None."""
    if r.status_code != 503:
        return None
    try:
        doc = r.json()
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("state") != "hashing":
        return None
    hashed, total = doc.get("hashed_bytes"), doc.get("total_bytes")
    return (
        hashed if isinstance(hashed, int) else 0,
        total if isinstance(total, int) else 0,
    )


async def _generation(
    spec: EngineSpec,
    progress: Progress,
    wait_s: float = ATTESTATION_WAIT_S,
    poll_s: float = ATTESTATION_POLL_S,
) -> str | None:
    """The engine's attested generation. A sidecar started with its engine hashes the model's
    files first (503 "hashing"): waited for, up to ``wait_s``, as a profile run started right
    after a launch would otherwise fail on it."""
    if not spec.attestation_url:
        return spec.generation
    deadline = time.monotonic() + wait_s
    said = False
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while True:
            try:
                r = await client.get(spec.attestation_url)
            except httpx.HTTPError as exc:
                raise EngineProfilingError(f"attestation unreachable: {exc}") from None
            hashing = _hashing(r)
            if hashing is None:
                break
            hashed, total = hashing
            share = f" ({hashed / total:.0%} of {total:,} bytes)" if total > 0 else ""
            if time.monotonic() >= deadline:
                raise EngineProfilingError(
                    f"attestation at {spec.attestation_url} still hashing the engine's files"
                    f" after {wait_s:g} s{share}: profile it once the sidecar answers ready"
                )
            if not said:
                progress(f"{spec.id}: waiting for its attestation sidecar to hash its files{share}")
                said = True
            await asyncio.sleep(poll_s)
        try:
            r.raise_for_status()
            return str(r.json()["generation"])
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
            raise EngineProfilingError(f"attestation unreachable: {exc}") from None


def _refusal(spec: EngineSpec, not_idle: EngineNotIdle) -> str:
    """Why an engine that is not known idle is not profiled. ``--force`` profiles one that
    answers but is busy (or reports no load); one that does not answer fails with or without
    it, so it is told to be checked instead."""
    if not_idle.kind == "unreachable":
        return (
            f"unreachable at {spec.url} (/metrics: {not_idle.error}): check that the "
            "engine is running and that the fleet's url for it is right"
        )
    return f"refusing to profile: {not_idle.reason} (use --force)"


async def profile_engine(
    spec: EngineSpec,
    model: str,
    plan: ProfilingPlan,
    limits: ProfilingLimits,
    force: bool,
    progress: Progress,
    seed: int = 0,
    engine_api_key: str | None = None,
    turns: PrefillTurns | None = None,
) -> EngineProfile:
    """Profile one engine; ``turns``: the fleet's, when other engines are profiled at once."""
    turns = turns or PrefillTurns({spec.id: spec.host})
    budget = _Budget(limits)
    if plan.tokens_needed() > limits.max_tokens_per_engine:
        raise EngineProfilingError(
            f"the plan needs {plan.tokens_needed()} tokens, over max_tokens_per_engine "
            f"{limits.max_tokens_per_engine}"
        )
    timeout = httpx.Timeout(limits.probe_timeout_s, connect=5.0)
    # The engines' API key (the fleet's engine.api_key_file) on every request to the engine.
    auth = {"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}
    async with httpx.AsyncClient(
        base_url=spec.url, timeout=timeout, trust_env=False, headers=auth
    ) as client:
        if not force and (not_idle := await check_idle(client)) is not None:
            raise EngineProfilingError(_refusal(spec, not_idle))
        generation = await _generation(spec, progress)
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
        async with turns.prefills(spec.id) as waited_s:
            budget.exclude(waited_s)
            for repeat in range(plan.prefill_repeats):
                for n in plan.prefill_lens:
                    budget.spend(n + 1)
                    sent, times = await stream_arrivals(client, body(n, 1), limits.probe_timeout_s)
                    if not times:
                        raise EngineProfilingError(f"prefill probe of {n} tokens produced no token")
                    prefill.append(
                        PrefillSample(input_tokens=n, repeat=repeat, seconds=times[0] - sent)
                    )
                    progress(
                        f"{spec.id}: prefill {n} tokens (repeat {repeat + 1}/"
                        f"{plan.prefill_repeats}): {times[0] - sent:.4f} s"
                    )
        budget.exclude(await turns.host_prefilled(spec.id))
        decode: list[DecodeSample] = []
        for n in plan.decode_input_lens:
            for c in plan.decode_concurrency:

                async def run(n: int = n, c: int = c) -> DecodeProbe:
                    budget.spend((n + plan.decode_tokens) * c)
                    bodies = [body(n, plan.decode_tokens) for _ in range(c)]
                    return await probe_decode(client, bodies, limits.probe_timeout_s)

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
        wall_s=round(budget.elapsed_s(), 3),
        tokens_used=budget.tokens,
        prefill_samples=prefill,
        decode_samples=decode,
        prefill_fit=prefill_fit,
        decode_fit=decode_fit,
    )


async def profile_fleet(
    fleet: FleetContract,
    engine_ids: list[str],
    plan: ProfilingPlan,
    limits: ProfilingLimits,
    force: bool,
    progress: Progress,
    engine_api_key: str | None = None,
) -> tuple[dict[str, EngineProfile], dict[str, str]]:
    """Profile engines in parallel (taking turns for timed prefills on a shared host); returns
    (profiles, failures by engine)."""
    turns = PrefillTurns({e: fleet.engine_by_id(e).host for e in engine_ids})

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
                engine_api_key=engine_api_key,
                turns=turns,
            )
        except (EngineProfilingError, ProbeError) as exc:
            return engine_id, str(exc)
        except httpx.HTTPError as exc:
            return engine_id, f"unreachable: {type(exc).__name__}: {exc}"
        finally:
            turns.done(engine_id)  # one that failed before its prefills holds up no other

    results = await asyncio.gather(*(one(e) for e in engine_ids))
    profiles = {e: r for e, r in results if isinstance(r, EngineProfile)}
    failures = {e: r for e, r in results if isinstance(r, str)}
    return profiles, failures
