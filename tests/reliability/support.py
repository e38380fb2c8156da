"""Helpers shared by the reliability suites: requests through the router, engine state and
metrics, journal views, RSS sampling, and a router started under resource limits."""

from __future__ import annotations

import contextlib
import json
import re
import resource
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procfs import rss_kib
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, RouterProcess, admin, journal_contents, metric, start_router

# 120 token ids: 8 KV blocks of 16. Deterministic, in vocabulary.
PROMPT = [300 + (i * 7) % 9000 for i in range(120)]
ROUTER_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def body(max_tokens: int = 4, stream: bool = False, prompt: Any = None, **extra: Any) -> dict:
    out: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT if prompt is None else prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    if stream:
        out["stream"] = True
    return out


def post(
    router: RouterProcess,
    payload: dict[str, Any],
    timeout: float = 30.0,
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> httpx.Response:
    return httpx.post(router.url + path, json=payload, timeout=timeout, headers=headers)


def timed_post(
    router: RouterProcess, payload: dict[str, Any], timeout: float = 30.0
) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = post(router, payload, timeout)
    return r, time.monotonic() - t0


def end_of(router: RouterProcess, rid: str, timeout: float = 5.0) -> dict[str, Any]:
    assert wait_until(lambda: rid in router.ends(), timeout), f"no request.end for {rid}"
    return router.ends()[rid]


def sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_text(events: list[Any]) -> str:
    return "".join(
        e["choices"][0].get("text") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def sim_state(url: str) -> dict[str, Any]:
    r = admin(url, "GET", path="/sim/state")
    assert r.status_code == 200, r.text
    return r.json()


def engine_metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=5).text


def engine_metric(url: str, name: str, **labels: str) -> float:
    return metric(engine_metrics(url), name, **labels)


def metric_delta(before: str, after: str, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def engine_idle(url: str) -> bool:
    s = sim_state(url)
    return s["running"] == 0 and s["waiting"] == 0


def router_idle(router: RouterProcess) -> bool:
    state = router.admin_state()
    return state["in_flight_requests"] == 0 and all(
        e["in_flight"] == {"prefill": 0, "decode": 0} for e in state["engines"]
    )


def engine_view(router: RouterProcess, engine_id: str) -> dict[str, Any]:
    return next(e for e in router.admin_state()["engines"] if e["id"] == engine_id)


def all_healthy_and_closed(router: RouterProcess) -> bool:
    return all(
        e["healthy"] is True and e["breaker"] == "closed" for e in router.admin_state()["engines"]
    )


def close_breakers(router: RouterProcess, timeout: float = 10.0) -> bool:
    """Every engine healthy with a closed breaker. A breaker that failing requests opened, on
    an engine whose /health kept passing, closes only on a half-open request's success, not on
    a probe: send small requests until each has had one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if wait_until(lambda: all_healthy_and_closed(router), 1.0):
            return True
        if all(e["healthy"] is True for e in router.admin_state()["engines"]):
            post(router, body(1), timeout=10)
    return all_healthy_and_closed(router)


def reference_text(url: str, prompt: list[int], max_tokens: int) -> str:
    """What an engine generates for ``prompt`` on its own (no P/D): the simulator's tokens
    are a pure function of the prompt, so a correct P/D answer must equal this."""
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def attempts(end: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(a["leg"], a["engine"], a["outcome"]) for a in end.get("attempts", [])]


# --------------------------------------------------------------------------------------------
# The journal across rotated files


def journal_records(path: Path) -> list[dict[str, Any]]:
    """Every complete record of the journal's files (rotated ones first), skipping a last
    line the writer has not finished yet."""
    out: list[dict[str, Any]] = []
    for _, data in journal_contents(path):
        for line in data.split(b"\n")[:-1]:
            if line.strip():
                out.append(json.loads(line))
    return out


@dataclass
class JournalCount:
    starts: dict[str, dict[str, Any]] = field(default_factory=dict)
    ends: dict[str, dict[str, Any]] = field(default_factory=dict)
    duplicate_starts: int = 0
    duplicate_ends: int = 0

    @property
    def open_ids(self) -> set[str]:
        return set(self.starts) - set(self.ends)

    @property
    def orphan_ends(self) -> set[str]:
        return set(self.ends) - set(self.starts)


def count_journal(path: Path) -> JournalCount:
    out = JournalCount()
    for rec in journal_records(path):
        if rec["type"] == "request.start":
            if rec["id"] in out.starts:
                out.duplicate_starts += 1
            out.starts[rec["id"]] = rec
        elif rec["type"] == "request.end":
            if rec["id"] in out.ends:
                out.duplicate_ends += 1
            out.ends[rec["id"]] = rec
    return out


# --------------------------------------------------------------------------------------------
# Processes


class RssSampler:
    """Samples a process's VmRSS every ``interval`` seconds in a thread, until stopped."""

    def __init__(self, pid: int, interval: float = 0.5, max_samples: int = 10_000) -> None:
        self.pid = pid
        self.interval = interval
        self.max_samples = max_samples
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set() and len(self.samples) < self.max_samples:
            kib = rss_kib(self.pid)
            if kib is not None:
                self.samples.append((time.monotonic() - t0, kib))
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        # Ignored SIGXFSZ survives exec: a write past the limit fails with EFBIG instead of
        # killing the router, which is what a full disk looks like to it.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def start_router_limited(
    directory: Path,
    fleet_path: Path,
    *extra: str,
    journal: Path,
    fsize_limit: int | None = None,
    wait_ready: bool = True,
) -> RouterProcess:
    """``tests.helpers.start_router``, optionally under RLIMIT_FSIZE. Its output goes through a
    pipe (pipes have no file size) to the log file, so only the journal meets the limit."""
    return start_router(
        directory,
        fleet_path,
        *extra,
        journal=journal,
        wait_ready=wait_ready,
        preexec_fn=_limit_file_size(fsize_limit) if fsize_limit else None,
        log_via_pipe=True,
    )


def restart_dead_engines(fleet: SimFleet) -> list[str]:
    restarted = []
    for engine_id, engine in fleet.engines.items():
        if not engine.alive:
            fleet.restart(engine_id)
            restarted.append(engine_id)
    return restarted


@contextlib.contextmanager
def background(fn: Callable[[], Any]) -> Iterator[Callable[[float], Any]]:
    """Run ``fn`` in a thread; yields ``result(timeout)``, which re-raises its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout: float) -> Any:
        thread.join(timeout)
        assert not thread.is_alive(), f"background call still running after {timeout} s"
        if "error" in box:
            raise box["error"]
        return box.get("value")

    try:
        yield result
    finally:
        thread.join(60)
