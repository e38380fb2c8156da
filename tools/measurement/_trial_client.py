"""The open-loop load generator: requests leave on a schedule whatever the server does, each
one streamed with ``ignore_eos`` so its output length is the workload's, each timed chunk by
chunk. One warmup request goes first, alone, and is marked as such."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from tools.measurement._trial_stats import ClientRecord
from tools.measurement._trial_workload import WorkloadRequest

__all__ = ["DONE_GRACE_S", "TrialConfig", "TrialRun", "poisson_schedule", "run_trial"]

# How long a response may stay open after its [DONE] before the client stops reading it.
DONE_GRACE_S = 2.0


@dataclass(frozen=True)
class TrialConfig:
    base: str
    model: str
    run_id: str
    timeout_s: float
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrialRun:
    records: list[ClientRecord]
    t0_wall: float
    started_wall: float
    ended_wall: float


def poisson_schedule(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of a Poisson process: exponential gaps with mean 1/rate, the first
    request at 0 (as ``vllm bench serve`` sends its first request at once)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def _body(cfg: TrialConfig, req: WorkloadRequest) -> bytes:
    body: dict[str, Any] = {
        "model": cfg.model,
        "prompt": req.prompt,
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(cfg.extra_body)
    return orjson.dumps(body)


def _error_message(content: bytes) -> str:
    try:
        obj = orjson.loads(content)
        return str(obj["error"]["message"])[:300]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return content[:300].decode("utf-8", "replace")


async def _one(
    client: httpx.AsyncClient,
    cfg: TrialConfig,
    req: WorkloadRequest,
    index: int,
    scheduled: float | None,
    t0: float,
) -> ClientRecord:
    warmup = index < 0
    crid = f"{cfg.run_id}-warmup" if warmup else f"{cfg.run_id}-{index:06d}"
    headers = {"Content-Type": "application/json", "X-Request-Id": crid}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    rec: dict[str, Any] = {
        "index": index,
        "warmup": warmup,
        "client_request_id": crid,
        "scheduled_s": scheduled,
        "prompt_tokens": len(req.prompt),
        "expected_output_tokens": req.output_tokens,
    }
    itl: list[float] = []
    chunks = 0
    first = last = None
    usage: dict[str, Any] | None = None
    finish = None
    done = False
    content = _body(cfg, req)
    sent = time.perf_counter()
    rec["sent_s"] = sent - t0
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with client.stream(
                "POST", "/v1/completions", content=content, headers=headers
            ) as response:
                rec["status"] = response.status_code
                rec["router_request_id"] = response.headers.get("x-request-id")
                if response.status_code != 200:
                    body = await response.aread()
                    rec.update(outcome="http_error", error=_error_message(body))
                    return ClientRecord(**rec)
                error = None
                lines = response.aiter_lines()
                async for line in lines:
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    try:
                        obj = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        error = "malformed SSE data"
                        continue
                    if not isinstance(obj, dict):
                        continue
                    if "error" in obj:
                        err = obj["error"]
                        error = str(err.get("message") if isinstance(err, dict) else err)[:300]
                        continue
                    choices = obj.get("choices")
                    if choices:
                        chunks += 1
                        if first is None:
                            first = now
                        else:
                            itl.append(now - last)  # type: ignore[operator]
                        last = now
                        reason = choices[0].get("finish_reason")
                        finish = reason or finish
                    elif obj.get("usage"):
                        usage = obj["usage"]
                if done:
                    # Read on to the end of the response, as vllm bench serve does: a client
                    # that hangs up at [DONE] races the server's own clean-up. A server that
                    # keeps the response open after [DONE] is recorded, not waited for.
                    try:
                        async with asyncio.timeout(DONE_GRACE_S):
                            async for _ in lines:
                                pass
                        rec["closed_after_done"] = True
                    except TimeoutError:
                        rec["closed_after_done"] = False
    except TimeoutError:
        _fill_tokens(rec, first, last, t0, itl, chunks, usage, finish)
        # A request that timed out has no end: its last chunk is not an end.
        rec.update(outcome="timeout", error=f"no end within {cfg.timeout_s} s", end_s=None)
        return ClientRecord(**rec)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        rec.update(outcome="connect_error", error=f"{type(exc).__name__}: {exc}"[:300])
        return ClientRecord(**rec)
    except httpx.HTTPError as exc:
        rec.update(outcome="transport_error", error=f"{type(exc).__name__}: {exc}"[:300])
        _fill_tokens(rec, first, last, t0, itl, chunks, usage, finish)
        return ClientRecord(**rec)
    _fill_tokens(rec, first, last, t0, itl, chunks, usage, finish)
    if error is not None or not done or first is None:
        reason = error or ("stream ended without [DONE]" if not done else "no token chunk")
        rec.update(outcome="stream_error", error=reason)
    elif rec["output_tokens"] != req.output_tokens:
        rec.update(
            outcome="short_output",
            error=f"{rec['output_tokens']} output tokens, {req.output_tokens} requested",
        )
    else:
        rec["outcome"] = "ok"
    return ClientRecord(**rec)


def _fill_tokens(
    rec: dict[str, Any],
    first: float | None,
    last: float | None,
    t0: float,
    itl: list[float],
    chunks: int,
    usage: dict[str, Any] | None,
    finish: str | None,
) -> None:
    rec["first_token_s"] = None if first is None else first - t0
    rec["end_s"] = None if last is None else last - t0
    rec["itl"] = [round(g, 7) for g in itl]
    rec["chunks"] = chunks
    rec["finish_reason"] = finish
    if usage and isinstance(usage.get("completion_tokens"), int):
        rec["output_tokens"] = usage["completion_tokens"]
        rec["output_tokens_source"] = "usage"
        if isinstance(usage.get("prompt_tokens"), int):
            rec["usage_prompt_tokens"] = usage["prompt_tokens"]
    elif chunks:
        rec["output_tokens"] = chunks
        rec["output_tokens_source"] = "chunks"


async def run_trial(
    cfg: TrialConfig,
    warmup: WorkloadRequest,
    requests: Sequence[WorkloadRequest],
    schedule: Sequence[float],
) -> TrialRun:
    """Send the warmup and wait for it, then every request at ``t0 + schedule[i]``.

    Bounded: every request ends within ``timeout_s`` of being sent, and the last is sent at
    ``t0 + schedule[-1]``.
    """
    assert len(requests) == len(schedule)
    # No pool limit: an open-loop client must never queue a send behind a busy connection.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(10.0, cfg.timeout_s))
    started_wall = time.time()
    async with httpx.AsyncClient(base_url=cfg.base, limits=limits, timeout=timeout) as client:
        origin = time.perf_counter()
        warm = await _one(client, cfg, warmup, -1, None, origin)
        t0 = time.perf_counter()
        t0_wall = time.time()
        # Re-base the warmup on t0 so every record shares one origin.
        shift = t0 - origin
        warm = warm.model_copy(
            update={
                "sent_s": warm.sent_s - shift,
                "first_token_s": None if warm.first_token_s is None else warm.first_token_s - shift,
                "end_s": None if warm.end_s is None else warm.end_s - shift,
            }
        )
        tasks: list[asyncio.Task[ClientRecord]] = []
        for i, (req, offset) in enumerate(zip(requests, schedule, strict=True)):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, cfg, req, i, offset, t0)))
        records = [warm, *await asyncio.gather(*tasks)]
    return TrialRun(
        records=records, t0_wall=t0_wall, started_wall=started_wall, ended_wall=time.time()
    )
