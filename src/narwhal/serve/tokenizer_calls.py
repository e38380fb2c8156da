"""Calls to an engine's tokenizer routes (``/tokenize``, ``/detokenize``): which engines to ask,
in what order, and the asking. Any role will do (every engine serves the same model). Engines
the router's health probes call down are skipped; among the rest, one whose breaker is closed
and which is not draining is preferred, taken in turn so the work spreads. A transport failure
or a 5xx moves on to the next engine, at most ``MAX_ATTEMPTS`` in all."""

from __future__ import annotations

import asyncio

from narwhal.engines.client import EnginePool
from narwhal.engines.transport import EngineTransportError
from narwhal.routing.breaker import BreakerState
from narwhal.routing.fleet_state import FleetState

__all__ = ["ATTEMPT_TIMEOUT_S", "MAX_ATTEMPTS", "ask_tokenizer", "tokenize_candidates"]

# Engines tried per call: a fleet-wide outage should not cost the caller a full sweep.
MAX_ATTEMPTS = 3
# Per attempt. Tokenizing runs in vLLM's API server process, not its engine loop, so it does
# not queue behind generations; an engine this slow to tokenize is better skipped.
ATTEMPT_TIMEOUT_S = 30.0
_HEADERS = {"Content-Type": "application/json"}


def tokenize_candidates(state: FleetState, turn: int) -> list[str]:
    """Engine ids in the order to try them, starting each preference tier at ``turn``:
    first breaker closed and not draining, then draining, then breaker open or half-open (a
    failing generation leg says little about the engine's tokenizer); never an engine whose
    last health probe failed."""
    tiers: tuple[list[str], list[str], list[str]] = ([], [], [])
    for engine in state.engines.values():
        if engine.healthy is False:
            continue
        if engine.breaker.state is not BreakerState.CLOSED:
            tiers[2].append(engine.id)
        elif engine.draining_from is not None:
            tiers[1].append(engine.id)
        else:
            tiers[0].append(engine.id)
    ordered: list[str] = []
    for tier in tiers:
        if tier:
            start = turn % len(tier)
            ordered += tier[start:] + tier[:start]
    return ordered


async def ask_tokenizer(
    engines: EnginePool,
    state: FleetState,
    path: str,
    body: bytes,
    turn: int,
    avoid: str | None = None,
    attempts: int = MAX_ATTEMPTS,
    attempt_timeout_s: float = ATTEMPT_TIMEOUT_S,
) -> tuple[tuple[int, bytes] | None, list[str]]:
    """The first answer below 500 to ``body`` on ``path`` (status, content) from the engines
    in :func:`tokenize_candidates` order, but ``avoid``, at most ``attempts`` of them; and each
    failed attempt's engine and reason (the answer is None when every attempt failed, or no
    engine was left to ask)."""
    failures: list[str] = []
    candidates = [e for e in tokenize_candidates(state, turn) if e != avoid]
    for engine_id in candidates[:attempts]:
        try:
            async with asyncio.timeout(attempt_timeout_s):
                response = await engines.client(engine_id).post(path, body, _HEADERS)
                try:
                    content = await response.read()
                finally:
                    await response.aclose()
        except (EngineTransportError, TimeoutError) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            failures.append(f"{engine_id}: {why}")
            continue
        if response.status >= 500:
            failures.append(f"{engine_id}: HTTP {response.status}")
            continue
        return (response.status, content), failures
    return None, failures
