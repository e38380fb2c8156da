"""Collecting evidence from live engines: every socket call narwhal-check makes is here.

Each call is bounded (an httpx timeout and an overall ``asyncio.timeout``), engines are probed
in parallel where the measurement allows it (identity gates; pace as the profiler does it, with
engines that share a host taking turns for their timed prefills) and one handoff at a time
where it does not (kv_transfer: a pair's first-token latency must not include another pair's
traffic). Prompts for timing probes are token ids drawn from the
engine's own tokenization with a fresh order and ``cache_salt`` per probe, as the profiler
makes them, so no probe is served from a prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import httpx
import orjson

from narwhal.check.evidence import (
    Call,
    EngineHealth,
    GenerationResult,
    HandoffProbe,
    ModelsResult,
    PaceResult,
    PairResult,
    TokenizeResult,
)
from narwhal.check.gates.pace import PaceProbePlan
from narwhal.check.kv_events_watch import KVEventsWatch
from narwhal.check.settings import GENERATION_TEXT, CheckSettings
from narwhal.clock import Clock
from narwhal.contract import EngineSpec, FleetContract
from narwhal.engines.legs import decode_leg_body, prefill_leg_body
from narwhal.engines.probes import (
    SEED_TEXT,
    DecodeProbe,
    PrefillTurns,
    ProbeError,
    check_idle,
    error_message,
    probe_decode,
    sample_decode,
    stream_arrivals,
)
from narwhal.engines.scrape import metric_sum
from narwhal.engines.sse import iter_sse_events

__all__ = ["PACE_WARMUP_PROBES", "Collector"]

T = TypeVar("T")
Progress = Callable[[str], None]


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# Prefill probes sent to each engine before the pace gate times any.
PACE_WARMUP_PROBES = 1


class Collector:
    """Per-engine HTTP clients and the evidence-gathering calls of every live gate."""

    def __init__(
        self,
        fleet: FleetContract,
        settings: CheckSettings,
        clock: Clock,
        engine_api_key: str | None = None,
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self.clock = clock
        timeout = httpx.Timeout(
            settings.probe_timeout_s, connect=min(5.0, settings.probe_timeout_s)
        )
        # The engines' API key (the fleet's engine.api_key_file) goes to the engines only, not
        # to an attestation service elsewhere.
        self._auth = {"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}
        self._engine_urls = {e.url for e in fleet.engines}
        # Engines are only ever the fleet's URLs: no proxies from the environment.
        self._clients = {
            e.id: httpx.AsyncClient(
                base_url=e.url, timeout=timeout, trust_env=False, headers=self._auth
            )
            for e in fleet.engines
        }
        self._short = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.health_timeout_s), trust_env=False
        )
        self.attestations: dict[str, dict[str, Any] | None] = {}
        self.attestation_errors: dict[str, str] = {}
        # A per-run salt: no probe of this run can hit a prefix cached by another run.
        self._salt = secrets.token_hex(6)
        self._probe = 0
        self._rng = random.Random(self._salt)
        self._pools: dict[str, list[int]] = {}

    async def aclose(self) -> None:
        for client in (*self._clients.values(), self._short):
            await client.aclose()

    def _next_id(self) -> str:
        self._probe += 1
        return f"narwhal-check-{self._salt}-{self._probe}"

    async def _bounded(self, work: Awaitable[T], seconds: float) -> T:
        async with asyncio.timeout(seconds):
            return await work

    # --- health and attestations -----------------------------------------------------------

    async def _get(self, url: str) -> tuple[Call, httpx.Response | None]:
        start = self.clock.now()
        try:
            on_engine = any(url.startswith(base + "/") for base in self._engine_urls)
            headers = self._auth if on_engine else None
            r = await self._bounded(
                self._short.get(url, headers=headers), self.settings.health_timeout_s
            )
        except (httpx.HTTPError, TimeoutError) as exc:
            why = _why(exc)
            if why == "timed out":
                why = f"no answer within {self.settings.health_timeout_s:g} s"
            return Call(None, self.clock.now() - start, why), None
        return Call(r.status_code, self.clock.now() - start), r

    async def _attestation(self, spec: EngineSpec) -> tuple[Call | None, dict[str, Any] | None]:
        if not spec.attestation_url:
            self.attestations[spec.id] = None
            return None, None
        call, response = await self._get(spec.attestation_url)
        doc: dict[str, Any] | None = None
        if response is not None and call.ok:
            try:
                parsed = response.json()
                doc = parsed if isinstance(parsed, dict) else None
            except ValueError:
                doc = None
        self.attestations[spec.id] = doc
        if doc is None:
            self.attestation_errors[spec.id] = f"attestation at {spec.attestation_url}: " + (
                call.describe() if not call.ok else "not a JSON object"
            )
        else:
            self.attestation_errors.pop(spec.id, None)
        return call, doc

    async def fetch_attestations(self) -> None:
        await asyncio.gather(*(self._attestation(e) for e in self.fleet.engines))

    def generation_of(self, spec: EngineSpec) -> str | None:
        """The engine's generation as attested (the fleet's value when it has no endpoint)."""
        if not spec.attestation_url:
            return spec.generation
        doc = self.attestations.get(spec.id)
        value = doc.get("generation") if doc else None
        return str(value) if value is not None else None

    async def health(self) -> list[EngineHealth]:
        async def one(spec: EngineSpec) -> EngineHealth:
            call, _ = await self._get(f"{spec.url}/health")
            attestation, doc = await self._attestation(spec)
            return EngineHealth(spec.id, call, attestation, doc)

        return list(await asyncio.gather(*(one(e) for e in self.fleet.engines)))

    # --- identity gates ---------------------------------------------------------------------

    async def generation_prompt(self) -> list[int] | None:
        """GENERATION_TEXT as token ids, from the first engine that tokenizes it."""
        for spec in self.fleet.engines:
            try:
                tokens = await self._tokenize(spec.id, GENERATION_TEXT)
            except ProbeError:
                continue
            if tokens:
                return tokens
        return None

    async def generation(self, prompt: list[int]) -> list[GenerationResult]:
        n = self.settings.generation_tokens

        async def one(spec: EngineSpec) -> GenerationResult:
            body = {
                "model": self.fleet.model.id,
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": False,
            }
            start = self.clock.now()
            try:
                r = await self._bounded(
                    self._clients[spec.id].post("/v1/completions", json=body),
                    self.settings.probe_timeout_s,
                )
                if r.status_code != 200:
                    raise ProbeError(error_message(r))
                data = r.json()
                choice = data["choices"][0]
                ids = choice.get("token_ids")
                usage = data.get("usage") or {}
                return GenerationResult(
                    spec.id,
                    n,
                    tokens=list(ids) if isinstance(ids, list) else None,
                    text=choice.get("text"),
                    completion_tokens=usage.get("completion_tokens"),
                    finish_reason=choice.get("finish_reason"),
                    latency_s=self.clock.now() - start,
                )
            except ProbeError as exc:
                return GenerationResult(spec.id, n, error=str(exc))
            except (httpx.HTTPError, TimeoutError, ValueError, LookupError, TypeError) as exc:
                return GenerationResult(spec.id, n, error=_why(exc))

        return list(await asyncio.gather(*(one(e) for e in self.fleet.engines)))

    async def models(self) -> list[ModelsResult]:
        async def one(spec: EngineSpec) -> ModelsResult:
            try:
                r = await self._bounded(
                    self._clients[spec.id].get("/v1/models"), self.settings.health_timeout_s
                )
                if r.status_code != 200:
                    return ModelsResult(spec.id, error=error_message(r))
                data = r.json()["data"]
                ids = [str(m["id"]) for m in data]
                lens = [m.get("max_model_len") for m in data if m["id"] == self.fleet.model.id]
                if not lens and data:
                    lens = [data[0].get("max_model_len")]
                length = lens[0] if lens and isinstance(lens[0], int) else None
                return ModelsResult(spec.id, ids=ids, max_model_len=length)
            except (httpx.HTTPError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                return ModelsResult(spec.id, error=_why(exc))

        return list(await asyncio.gather(*(one(e) for e in self.fleet.engines)))

    async def _tokenize(self, engine_id: str, text: str) -> list[int]:
        try:
            r = await self._bounded(
                self._clients[engine_id].post(
                    "/tokenize", json={"model": self.fleet.model.id, "prompt": text}
                ),
                self.settings.probe_timeout_s,
            )
        except (httpx.HTTPError, TimeoutError) as exc:
            raise ProbeError(_why(exc)) from None
        if r.status_code != 200:
            raise ProbeError(error_message(r))
        try:
            tokens = r.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            raise ProbeError("/tokenize answered without a token list") from None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ProbeError("/tokenize answered without a token list")
        return tokens

    async def tokenize(self, prompts: Sequence[str]) -> list[TokenizeResult]:
        async def one(spec: EngineSpec) -> TokenizeResult:
            try:
                return TokenizeResult(
                    spec.id, tokens=[await self._tokenize(spec.id, p) for p in prompts]
                )
            except ProbeError as exc:
                return TokenizeResult(spec.id, error=str(exc))

        return list(await asyncio.gather(*(one(e) for e in self.fleet.engines)))

    # --- timing probes ----------------------------------------------------------------------

    async def _pool(self, engine_id: str) -> list[int]:
        if engine_id not in self._pools:
            tokens = await self._tokenize(engine_id, SEED_TEXT * 4)
            pool = sorted(set(tokens))
            if len(pool) < 8:
                raise ProbeError("/tokenize returned too few distinct token ids for prompts")
            self._pools[engine_id] = pool
        return self._pools[engine_id]

    def _body(self, pool: list[int], n: int, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.fleet.model.id,
            "prompt": [self._rng.choice(pool) for _ in range(n)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "cache_salt": self._next_id(),
        }

    async def _stream_times(
        self, engine_id: str, body: dict[str, Any]
    ) -> tuple[float, list[float]]:
        """A streamed completion: (send time, arrival time of each chunk with text)."""
        return await stream_arrivals(
            self._clients[engine_id], body, self.settings.probe_timeout_s, self.clock.now
        )

    async def pace(self, plan: PaceProbePlan, live: dict[str, str | None]) -> list[PaceResult]:
        repeats = self.settings.pace_repeats
        turns = PrefillTurns({e.id: e.host for e in self.fleet.engines})

        async def one(spec: EngineSpec) -> PaceResult:
            base = PaceResult(
                engine_id=spec.id,
                live_generation=live.get(spec.id),
                prefill_tokens=plan.prefill_tokens,
                decode_input_tokens=plan.decode_input_tokens,
                decode_tokens=plan.decode_tokens,
            )
            try:
                not_idle = await check_idle(self._clients[spec.id])
                if not_idle is not None:
                    return dataclasses.replace(base, idle_problem=not_idle.reason)
                pool = await self._pool(spec.id)
                prefill: list[float] = []
                # Timed as the profiler timed them: one engine of a host at a time.
                async with turns.prefills(spec.id):
                    # Unmeasured: an engine's first prefill after a pause ran 1.8 s where the
                    # next ran 0.08 s (a CPU engine here); the profile's probes had no pause.
                    for _ in range(PACE_WARMUP_PROBES):
                        await self._stream_times(spec.id, self._body(pool, plan.prefill_tokens, 1))
                    for _ in range(repeats):
                        sent, times = await self._stream_times(
                            spec.id, self._body(pool, plan.prefill_tokens, 1)
                        )
                        if not times:
                            raise ProbeError("the prefill probe produced no token")
                        prefill.append(times[0] - sent)
                await turns.host_prefilled(spec.id)
                client = self._clients[spec.id]

                async def decode_probe() -> DecodeProbe:
                    body = self._body(pool, plan.decode_input_tokens, plan.decode_tokens)
                    return await probe_decode(
                        client, [body], self.settings.probe_timeout_s, self.clock.now
                    )

                # Read as the profiler read its own decode samples (a median of single token
                # gaps reads chunks that arrive coalesced as 0 s/token).
                sample = await sample_decode(
                    decode_probe, plan.decode_input_tokens, 1, plan.decode_tokens
                )
                return dataclasses.replace(
                    base, prefill_s=prefill, decode_s_per_token=sample.seconds_per_token
                )
            except ProbeError as exc:
                return dataclasses.replace(base, error=str(exc))
            finally:
                turns.done(spec.id)  # one that failed before its prefills holds up no other

        return list(await asyncio.gather(*(one(e) for e in self.fleet.engines)))

    # --- KV handoffs ------------------------------------------------------------------------

    async def _scrape_kv(self, engine_id: str) -> tuple[float | None, float | None, float | None]:
        try:
            r = await self._bounded(
                self._clients[engine_id].get("/metrics"), self.settings.health_timeout_s
            )
        except (httpx.HTTPError, TimeoutError):
            return None, None, None
        if r.status_code != 200:
            return None, None, None
        return (
            metric_sum(r.content, "vllm:nixl_bytes_transferred_count"),
            metric_sum(r.content, "vllm:nixl_bytes_transferred_sum"),
            metric_sum(r.content, "vllm:nixl_num_failed_transfers_total"),
        )

    async def _handoff(
        self, prefill: str, decode: str, body: dict[str, Any], window_s: float, tokens: int
    ) -> HandoffProbe:
        request_id = str(body["cache_salt"])
        headers = {"X-Request-Id": request_id}
        start = self.clock.now()
        try:
            r = await self._bounded(
                self._clients[prefill].post(
                    "/v1/completions", json=prefill_leg_body(body, chat=False), headers=headers
                ),
                window_s,
            )
        except (httpx.HTTPError, TimeoutError) as exc:
            return HandoffProbe(error=f"prefill leg on {prefill}: {_why(exc)}")
        prefill_s = self.clock.now() - start
        if r.status_code != 200:
            return HandoffProbe(prefill_s, error=f"prefill leg on {prefill}: {error_message(r)}")
        try:
            answer = r.json()
            params = answer.get("kv_transfer_params")
        except (ValueError, AttributeError):
            return HandoffProbe(prefill_s, error=f"prefill leg on {prefill}: not JSON")
        usage = answer.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        reports = isinstance(details, dict) and isinstance(details.get("cached_tokens"), int)

        def probe(first: float | None, tokens: int, error: str | None = None) -> HandoffProbe:
            return HandoffProbe(prefill_s, first, tokens, error, reports)

        if not isinstance(params, dict):
            return probe(
                None, 0, f"{prefill} returned no kv_transfer_params (is its KV connector on?)"
            )
        first: float | None = None
        streamed = 0
        usage_tokens: int | None = None
        decode_start = self.clock.now()

        async def run() -> None:
            nonlocal first, streamed, usage_tokens
            async with self._clients[decode].stream(
                "POST",
                "/v1/completions",
                json=decode_leg_body(body, params),
                headers={**headers, "Accept": "text/event-stream"},
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise ProbeError(f"decode leg on {decode}: {error_message(resp)}")
                async for data in iter_sse_events(resp.aiter_bytes()):
                    if data == b"[DONE]":
                        return
                    obj = orjson.loads(data)
                    if isinstance(obj, dict) and "error" in obj:
                        err = obj["error"]
                        message = err.get("message", err) if isinstance(err, dict) else err
                        raise ProbeError(f"decode leg on {decode}: {message}")
                    if isinstance(obj, dict) and obj.get("choices"):
                        # The router's deadline clock: the first event with output.
                        if first is None:
                            first = self.clock.now() - decode_start
                        streamed += 1
                    usage = obj.get("usage") if isinstance(obj, dict) else None
                    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                        usage_tokens = usage["completion_tokens"]

        try:
            await self._bounded(run(), window_s)
        except ProbeError as exc:
            return probe(first, streamed, str(exc))
        except TimeoutError:
            if first is None:
                why = f"no first token within the {window_s:g} s observation window"
            else:
                why = f"the decode stream did not finish within the {window_s:g} s window"
            return probe(first, streamed, why)
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            return probe(first, streamed, f"decode leg on {decode}: {_why(exc)}")
        count = usage_tokens if usage_tokens is not None else streamed
        if first is None:
            return probe(None, count, "the decode stream ended without a token")
        if count != tokens:
            return probe(first, count, f"decode leg streamed {count} tokens, {tokens} requested")
        return probe(first, count)

    def watch_kv_events(self) -> KVEventsWatch:
        """A subscription to every engine's KV events (the fleet's ``kv_events``), to hold
        around the handoffs (``kv_pairs``)."""
        return KVEventsWatch(self.fleet)

    async def kv_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        prompt_tokens: int,
        window_s: float,
        progress: Progress,
    ) -> list[PairResult]:
        """``kv_probes`` handoffs per pair, one at a time, with the decode engine's NIXL
        counters scraped around each pair's handoffs."""
        out: list[PairResult] = []
        tokens = self.settings.kv_output_tokens
        for prefill, decode in pairs:
            try:
                pool = await self._pool(prefill)
            except ProbeError as exc:
                out.append(PairResult(prefill, decode, [HandoffProbe(error=str(exc))]))
                continue
            before = await self._scrape_kv(decode)
            probes = []
            for _ in range(self.settings.kv_probes):
                body = self._body(pool, prompt_tokens, tokens)
                probes.append(await self._handoff(prefill, decode, body, window_s, tokens))
            after = await self._scrape_kv(decode)
            deltas = [
                None if a is None or b is None else a - b
                for a, b in zip(after, before, strict=True)
            ]
            out.append(PairResult(prefill, decode, probes, deltas[0], deltas[1], deltas[2]))
            firsts = [f"{p.first_token_s:.3f}" for p in probes if p.first_token_s is not None]
            progress(f"kv_transfer {prefill}->{decode}: first token {', '.join(firsts) or '-'} s")
        return out
