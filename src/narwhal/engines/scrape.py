"""Reading what an engine reports on /metrics: its load (vLLM's gauge names) and the sum of
any metric's samples over its label sets."""

from __future__ import annotations

import math
import re

__all__ = ["metric_sum", "parse_engine_load"]

_LINE = re.compile(
    rb"^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc)(?:\{[^}]*\})?"
    rb" ([^ \n]+)",
    re.M,
)


_METRIC_LINE = re.compile(rb"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([^ \n]+)", re.M)


def metric_sum(text: bytes | str, name: str) -> float | None:
    """Sum of a metric's samples over its label sets (data-parallel ranks, label values add
    up); None if the page has no such sample."""
    page = text.encode() if isinstance(text, str) else text
    total: float | None = None
    wanted = name.encode()
    for match in _METRIC_LINE.finditer(page):
        if match.group(1) != wanted:
            continue
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        total = (total or 0.0) + value
    return total


def parse_engine_load(text: bytes) -> dict[str, float] | None:
    """The engine's load over its label sets (data-parallel ranks): requests running and
    waiting add up; KV cache usage is the ranks' mean (each rank holds a cache of its own, of
    one size, so a sum would read 2 for two full ranks).

    Returns None if the page carries none of the three gauges (not a vLLM engine's page).
    """
    found: dict[str, float] = {}
    samples: dict[str, int] = {}
    for match in _LINE.finditer(text):
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if math.isnan(value) or value < 0:
            continue
        key = match.group(1).decode()
        found[key] = found.get(key, 0.0) + value
        samples[key] = samples.get(key, 0) + 1
    if not found:
        return None
    usage = found.get("kv_cache_usage_perc", 0.0) / max(1, samples.get("kv_cache_usage_perc", 1))
    return {
        "running": found.get("num_requests_running", 0.0),
        "waiting": found.get("num_requests_waiting", 0.0),
        "kv_cache_usage": usage,
    }
