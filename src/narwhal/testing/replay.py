"""Open-loop replay through any router, timed by the client: the live side of the agreement
between the simulator's baseline policies and a router without a journal to read
(vllm-router; ``bench/baselines_agreement.py``, ``tests/integration/test_baselines_agreement.py``).
"""

from __future__ import annotations

import asyncio
import random
import time

import orjson

from narwhal.fleetsim.agreement import LiveOutcome
from narwhal.fleetsim.simulator import RequestSpec
from narwhal.testing.rawhttp import TRANSPORT_ERRORS, StreamTimes, post_stream

__all__ = ["replay_streams"]


async def replay_streams(
    port: int,
    specs: list[RequestSpec],
    model: str,
    salt: int,
    lead_s: float = 0.2,
    timeout_s: float = 120.0,
) -> list[LiveOutcome]:
    """Open loop through the router on 127.0.0.1:``port``, for a router without a journal to
    read (vllm-router): each request at its arrival time, streamed, ``ignore_eos``, asking for
    exactly its output (as ``bench/goodput.py`` sends them), timed by the raw client of
    ``narwhal.testing.rawhttp`` (no HTTP library between the router and the clock: on two
    cores the httpx client of ``replay`` lagged the router by a quarter of a second in bursts).

    Each prompt opens with two tokens drawn from ``salt`` (a run's own): no two prompts of a
    run, or of two runs with different salts, share a KV block, so the engines' prefix caches
    and cache_aware's trees match nothing, as the simulator assumes of a prompt without a
    ``prefix``."""
    rng = random.Random(salt)

    def body(spec: RequestSpec) -> bytes:
        a, b = rng.randrange(256, 10256), rng.randrange(256, 10256)
        prompt = [a, b] + [256 + (a + 7 * k) % 10000 for k in range(spec.prompt_tokens - 2)]
        return orjson.dumps(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": spec.output_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        )

    bodies = [body(spec) for spec in specs]

    async def one(i: int, spec: RequestSpec) -> LiveOutcome:
        await asyncio.sleep(max(0.0, t0 + spec.arrival - time.perf_counter()))
        sink = StreamTimes()
        sent = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                await post_stream(port, bodies[i], f"s{salt}-{i}", sink)
        except (TimeoutError, *TRANSPORT_ERRORS):
            return LiveOutcome(0)
        if sink.status != 200 or sink.first is None or sink.error:
            return LiveOutcome(sink.status if sink.status != 200 else 0)
        last = sink.last if sink.last is not None else sink.first
        tpot = (last - sink.first) / (sink.tokens - 1) if sink.tokens > 1 else None
        return LiveOutcome(200, sink.first - sent, tpot)

    t0 = time.perf_counter() + lead_s
    return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(specs))))
