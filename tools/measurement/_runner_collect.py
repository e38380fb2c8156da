"""Prometheus evidence for a load point: periodic scrapes of the router and every engine, the
idle checks before and after, scrape coverage, and ``counter_missing`` diagnostics.

Scrapes run in threads (one per target, each with its own bounded HTTP timeout) so a slow or
hung endpoint delays only its own samples; a failed scrape is recorded as such, never skipped,
because the coverage check is about exactly those holes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.metrics import RouterMetrics

__all__ = [
    "ENGINE_EXPECTED_COUNTERS",
    "Collector",
    "Coverage",
    "IdleState",
    "Sample",
    "Target",
    "counter_missing",
    "coverage",
    "idle_state",
    "parse_metrics",
    "prefix_caching_state",
    "router_expected_counters",
    "scrape_once",
    "series_key",
]

# Engine counters a qualification relies on (vLLM creates them at start-up).
ENGINE_EXPECTED_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
)
# Histogram buckets and *_created timestamps would multiply the evidence for nothing.
_SKIP_SUFFIXES = ("_bucket", "_created")


@dataclass(frozen=True)
class Target:
    name: str  # "router" or an engine id
    url: str  # base URL; /metrics is appended
    kind: str  # "router" | "engine"


@dataclass
class Sample:
    target: str
    t: float  # monotonic, when the answer (or the failure) arrived
    wall: float
    ok: bool
    latency_s: float
    status: int | None = None
    error: str | None = None
    series: dict[str, float] = field(default_factory=dict)
    counters: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "t": round(self.t, 6),
            "wall": round(self.wall, 6),
            "ok": self.ok,
            "latency_s": round(self.latency_s, 6),
            "status": self.status,
            "error": self.error,
            "series": self.series,
        }


def series_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_metrics(text: str) -> tuple[dict[str, float], frozenset[str]]:
    """(every non-bucket series -> value, the keys of the counter samples)."""
    series: dict[str, float] = {}
    counters: set[str] = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(_SKIP_SUFFIXES):
                continue
            key = series_key(s.name, s.labels)
            series[key] = float(s.value)
            # Untyped *_total samples count too: exposition formats differ in where TYPE goes.
            if family.type in ("counter", "unknown") and s.name.endswith("_total"):
                counters.add(key)
    return series, frozenset(counters)


def scrape_once(client: httpx.Client, target: Target) -> Sample:
    start = time.monotonic()
    try:
        response = client.get(target.url + "/metrics")
    except httpx.HTTPError as exc:
        now = time.monotonic()
        return Sample(
            target.name, now, time.time(), False, now - start, error=f"{type(exc).__name__}"
        )
    now = time.monotonic()
    if response.status_code != 200:
        return Sample(
            target.name,
            now,
            time.time(),
            False,
            now - start,
            status=response.status_code,
            error=f"HTTP {response.status_code}",
        )
    try:
        series, counters = parse_metrics(response.text)
    except ValueError as exc:
        return Sample(
            target.name, now, time.time(), False, now - start, 200, f"unparsable: {exc}"[:200]
        )
    return Sample(target.name, now, time.time(), True, now - start, 200, None, series, counters)


class Collector:
    """Scrapes every target every ``interval_s`` until stopped. Bounded: each scrape has a
    timeout, each thread exits at the next tick after ``stop()``."""

    def __init__(self, targets: list[Target], interval_s: float, timeout_s: float) -> None:
        self.targets = targets
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(t,), daemon=True, name=f"scrape-{t.name}")
            for t in targets
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> list[Sample]:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + self.interval_s + 5)
        with self._lock:
            return sorted(self.samples, key=lambda s: s.t)

    def _loop(self, target: Target) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            next_at = time.monotonic()
            while not self._stop.is_set():
                sample = scrape_once(client, target)
                with self._lock:
                    self.samples.append(sample)
                next_at += self.interval_s
                # A scrape that overran its slot starts the next one at once, not a burst.
                next_at = max(next_at, time.monotonic())
                self._stop.wait(max(0.0, next_at - time.monotonic()))


@dataclass(frozen=True)
class IdleState:
    idle: bool
    reasons: list[str]
    values: dict[str, dict[str, float]]


def _sum(series: dict[str, float], name: str) -> float | None:
    found = [v for k, v in series.items() if k == name or k.startswith(name + "{")]
    return sum(found) if found else None


def idle_state(client: httpx.Client, router: Target, engines: list[Target]) -> IdleState:
    """Idle: every engine reports 0 running and 0 waiting requests, the router has nothing in
    flight and nothing queued. A target that cannot be read is not idle (not provably)."""
    reasons: list[str] = []
    values: dict[str, dict[str, float]] = {}
    checks = [(router, ("narwhal_in_flight", "narwhal_admission_queue"))] + [
        (e, ("vllm:num_requests_running", "vllm:num_requests_waiting")) for e in engines
    ]
    for target, names in checks:
        sample = scrape_once(client, target)
        if not sample.ok:
            reasons.append(f"{target.name}: /metrics unreadable ({sample.error})")
            continue
        values[target.name] = {}
        for name in names:
            value = _sum(sample.series, name)
            if value is None:
                if name != "narwhal_admission_queue":  # older routers lack it
                    reasons.append(f"{target.name}: {name} absent")
                continue
            values[target.name][name] = value
            if value != 0:
                reasons.append(f"{target.name}: {name} = {value:g}")
    return IdleState(not reasons, reasons, values)


@dataclass(frozen=True)
class Coverage:
    target: str
    complete: bool
    scrapes: int
    failed: int
    max_gap_s: float
    allowed_gap_s: float
    gaps: list[dict[str, float]]  # every gap above the allowance: start, end, seconds


def coverage(
    samples: Iterable[Sample], target: str, start: float, end: float, allowed_gap_s: float
) -> Coverage:
    """Complete when successful scrapes of ``target`` leave no hole longer than
    ``allowed_gap_s`` anywhere in [start, end], the window's edges included."""
    mine = [s for s in samples if s.target == target and start <= s.t <= end]
    ok_times = [s.t for s in mine if s.ok]
    points = [start, *ok_times, end]
    gaps = []
    max_gap = 0.0
    for a, b in itertools.pairwise(points):
        max_gap = max(max_gap, b - a)
        if b - a > allowed_gap_s:
            gaps.append({"from_s": round(a - start, 3), "to_s": round(b - start, 3), "s": b - a})
    return Coverage(
        target=target,
        complete=not gaps,
        scrapes=len(mine),
        failed=sum(1 for s in mine if not s.ok),
        max_gap_s=max_gap,
        allowed_gap_s=allowed_gap_s,
        gaps=gaps,
    )


def router_expected_counters(engine_ids: list[str]) -> frozenset[str]:
    """Every counter series the router must export from start-up: taken from the router's own
    metric definitions (narwhal/metrics.py), so a counter added there is expected here too."""
    metrics = RouterMetrics(engine_ids, "expected", "0" * 64, None)
    _, counters = parse_metrics(generate_latest(metrics.registry).decode())
    return counters


def counter_missing(
    samples: Iterable[Sample],
    target: str,
    expected_series: frozenset[str] = frozenset(),
    expected_names: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """One diagnostic per expected counter series (exact) or counter name (any label set) that
    is absent from at least one successful scrape of ``target``."""
    ok = [s for s in samples if s.target == target and s.ok]
    out: list[dict[str, Any]] = []
    for key in sorted(expected_series):
        missing = [s for s in ok if key not in s.series]
        if missing:
            seen = [s.t for s in ok if key in s.series]
            out.append(
                {
                    "kind": "counter_missing",
                    "target": target,
                    "series": key,
                    "missing_in_scrapes": len(missing),
                    "of_scrapes": len(ok),
                    "first_seen_t": min(seen) if seen else None,
                }
            )
    for name in expected_names:
        missing = [
            s for s in ok if not any(k == name or k.startswith(name + "{") for k in s.counters)
        ]
        if missing:
            out.append(
                {
                    "kind": "counter_missing",
                    "target": target,
                    "series": name,
                    "missing_in_scrapes": len(missing),
                    "of_scrapes": len(ok),
                    "first_seen_t": None,
                }
            )
    return out


_CACHE_INFO = "vllm:cache_config_info{"
_HITS = "vllm:prefix_cache_hits_total"


def prefix_caching_state(samples: list[Sample], engine: str) -> tuple[str, str]:
    """Whether ``engine`` served the window with prefix caching off, from its scrapes in it:
    (verdict, why); verdict "off", "on" or "unknown". vLLM publishes its cache config as the
    labels of ``vllm:cache_config_info`` (``enable_prefix_caching="True"``/``"False"``) and
    counts hits in ``vllm:prefix_cache_hits``; a hit in the window means caching served a
    prompt, whatever the config says."""
    ok = [s for s in samples if s.target == engine and s.ok]
    if not ok:
        return "unknown", f"{engine}: no scrape in the window"
    configs = {
        key.split('enable_prefix_caching="', 1)[1].split('"', 1)[0]
        for s in ok
        for key in s.series
        if key.startswith(_CACHE_INFO) and 'enable_prefix_caching="' in key
    }
    hits = [_sum(s.series, _HITS) for s in ok]
    counted = [h for h in hits if h is not None]
    gained = counted[-1] - counted[0] if len(counted) >= 2 else None
    if gained:
        return "on", f"{engine}: {gained:g} prompt tokens hit the prefix cache in the window"
    if "True" in configs:
        return "on", f"{engine}: vllm:cache_config_info says enable_prefix_caching=True"
    if configs == {"False"}:
        return "off", f"{engine}: enable_prefix_caching=False, no hit in the window"
    if gained == 0:
        return "unknown", f"{engine}: no hit in the window, but no cache config published"
    return "unknown", f"{engine}: neither a cache config nor prefix-cache hits published"
