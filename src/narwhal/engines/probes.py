"""What timing probes of a live engine share (narwhal-profile and narwhal-check): the seed text
probe prompts draw their token ids from, and the test that an engine is idle enough to time."""

from __future__ import annotations

import httpx

from narwhal.engines.scrape import parse_engine_load

__all__ = ["SEED_TEXT", "check_idle"]

# Tokenized by the engine itself (four times over) into the pool of token ids a probe's prompt
# is drawn from, in a fresh random order per probe so no probe is served from a prefix cache.
SEED_TEXT = (
    "Disaggregated serving splits the compute bound prefill of a prompt from the memory bound "
    "decode of its answer, so that each runs on hardware sized for it, and moves the key value "
    "cache between them over a fast fabric. Routers pick engines by predicted latency. "
)


async def check_idle(client: httpx.AsyncClient) -> str | None:
    """None if the engine is idle; otherwise why not."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError as exc:
        return f"/metrics unreachable: {type(exc).__name__}"
    load = parse_engine_load(r.content) if r.status_code == 200 else None
    if load is None:
        return "its /metrics carries no vLLM load gauges"
    if load["running"] or load["waiting"]:
        return f"not idle ({load['running']:g} running, {load['waiting']:g} waiting)"
    return None
