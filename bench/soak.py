"""Soak: a long mixed run of narwhal-serve on a simulated fleet, with faults on a schedule,
role flips, and clients that hang up, checking that the router loses nothing.

A fleet of 4 simulated engines (2 prefill, 2 decode to start with; every engine may play
either role) runs ``--time-scale`` times faster than the calibrated fleet. ``--clients``
threads send a seeded mix of requests for ``--minutes``: completions and chat, streamed and
not, 2 to 60 tokens, some hanging up after the first chunk, some with a client timeout shorter
than their generation; a client told 429 or 503 waits its Retry-After (at most 2 s).
Meanwhile:

- faults, every ``--fault-every`` seconds on a random engine, each cleared after a few
  seconds: 5xx bursts, a first token held past the deadline, a stalled KV READ, a 3-10x
  slowdown, streams dropped mid-way, /metrics lying or down, and crashes (on prefill, on the
  KV READ, mid-stream, at once), after which the engine is restarted;
- forced role flips through ``POST /admin/roles/flip`` every ``--flip-every`` seconds;
- samplers: the router's VmRSS every 2 s, and an event-loop lag probe: the latency of
  ``GET /health`` every 0.5 s (the handler does no work, so its latency is the loop's delay
  plus one loopback round trip).

At the end the router is drained (SIGTERM) and its journal, rotated files included, is read:

- lost journal records: ``request.start`` without its ``request.end``, ends without a start,
  duplicates, and client requests (each sends a unique ``X-Request-Id``) that reached the
  router but have no journal record. Must all be 0: the exit code is 1 otherwise;
- requests served, outcomes, client-side results, stranded handoffs (metric and journal),
  RSS over time (first, peak, last, slope after warm-up), lag percentiles.

    .venv/bin/python bench/soak.py --minutes 10 [--clients 12] [--seed 1] [--out soak.json]
    .venv/bin/python bench/soak.py --minutes 5 --compare   # migration and hedging on vs off
    .venv/bin/python bench/soak.py --minutes 5 --compare --single-engine-faults --flip-every 0

Only 127.0.0.1 is contacted. Progress goes to stderr; the report to stdout (and ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from narwhal.contract.flags import number_type, positive
from narwhal.engines.scrape import metric_sum
from narwhal.journal import journal_files
from narwhal.serve.cli import serve_command
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing import procs
from narwhal.testing.fleet import SimFleet, loopback_only
from narwhal.testing.ports import free_ports
from narwhal.testing.procfs import cpu_seconds, rss_kib
from narwhal.testing.routers import router_ready
from narwhal.testing.stats import rank_percentile

# Only 127.0.0.1 is contacted: NIXL on loopback, no proxy (every process started inherits this).
loopback_only()

MODEL = "moonshotai/Kimi-K3"
ADMIN_TOKEN = "soak-admin-token"
FIRST_TOKEN_TIMEOUT_S = 1.5
PROMPT = [300 + (i * 7) % 9000 for i in range(120)]
CHAT = " ".join(f"word{i}" for i in range(60))


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_percent(cpu: list[tuple[float, float]]) -> float | None:
    if len(cpu) < 2 or cpu[-1][0] <= cpu[0][0]:
        return None
    return round(100 * (cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]), 1)


# --------------------------------------------------------------------------------------------
# The stack


class Stack:
    def __init__(
        self, directory: Path, time_scale: float, journal_max_bytes: int, resilience: bool
    ) -> None:
        self.directory = directory
        n = 4
        ports = free_ports(2 * n + 1)
        # Migration and hedging on (the fleet's defaults) or both off (the comparison run).
        routing: dict[str, Any] = (
            {}
            if resilience
            else {
                "migration": {"limit": 0},
                "hedge": {"enabled": False},
            }
        )
        doc = local_fleet_document(
            ports[:n],
            ports[n : 2 * n],
            sim={"time_scale": time_scale, "kv_read_timeout_s": 4.0},
            first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S,
            role_control={"enabled": False, "min_prefill": 1, "min_decode": 1},
            routing=routing,
        )
        self.fleet_path = directory / "fleet.json"
        self.fleet_path.write_text(json.dumps(doc, indent=2))
        self.fleet = SimFleet(self.fleet_path, admin_token=ADMIN_TOKEN, log_dir=directory / "logs")
        self.port = ports[-1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.journal = directory / "journal" / "router.jsonl"
        self.journal_max_bytes = journal_max_bytes
        self.router: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.fleet.start(timeout=120)
        token = self.directory / "admin-token"
        token.write_text(ADMIN_TOKEN + "\n")
        log_path = self.directory / "router.log"
        self.router = procs.start(
            serve_command(
                self.fleet_path,
                self.port,
                self.journal,
                "--journal-max-bytes",
                str(self.journal_max_bytes),
                "--skip-qualification",
                "--admin-token-file",
                str(token),
                "--breaker-open-seconds",
                "1",
                "--health-interval",
                "0.5",
                "--scrape-interval",
                "0.5",
            ),
            log_path,
        )
        procs.wait_ready(
            functools.partial(router_ready, self.url),
            60,
            process=self.router,
            name="router",
            log=log_path,
        )

    def admin(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return httpx.request(
            method,
            self.url + path,
            json=body,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        )

    def engine_admin(self, engine_id: str, method: str, body: Any = None) -> None:
        url = self.fleet.engines[engine_id].url
        with contextlib.suppress(httpx.HTTPError):
            httpx.request(
                method,
                url + "/sim/faults",
                json=body,
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=5,
            )

    def stop_router(self) -> int | None:
        if self.router is None:
            return None
        return procs.stop(self.router, 60)

    def stop(self) -> None:
        self.stop_router()
        self.fleet.stop()


# --------------------------------------------------------------------------------------------
# Clients


@dataclass
class Sent:
    cid: str
    kind: str  # plain, hangup (after the first chunk), timeout (client gives up early)
    chat: bool
    stream: bool
    status: int | None = None
    router_id: str | None = None
    result: str = ""  # what the client saw
    seconds: float = 0.0
    retry_after: float = 0.0


def one_request(client: httpx.Client, url: str, rng: random.Random, cid: str) -> Sent:
    chat = rng.random() < 0.35
    stream = rng.random() < 0.6
    roll = rng.random()
    if roll < 0.08 and stream:
        kind, max_tokens, timeout = "hangup", rng.randint(100, 200), 30.0
    elif roll < 0.15:
        kind, max_tokens, timeout = "timeout", rng.randint(150, 250), rng.uniform(0.2, 0.6)
    else:
        kind, max_tokens, timeout = "plain", rng.randint(2, 60), 30.0
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": CHAT}]
    else:
        body["prompt"] = PROMPT
    if stream:
        body["stream"] = True
    sent = Sent(cid, kind, chat, stream)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.monotonic()
    try:
        with client.stream(
            "POST",
            url + path,
            json=body,
            headers={"X-Request-Id": cid},
            timeout=httpx.Timeout(timeout, connect=10.0),
        ) as r:
            sent.status = r.status_code
            sent.router_id = r.headers.get("x-request-id")
            if r.status_code != 200 or not stream:
                r.read()
                sent.result = f"http_{r.status_code}"
                if r.status_code in (429, 503):
                    # As a well-behaved client does (bounded: the soak must keep going).
                    with contextlib.suppress(ValueError):
                        sent.retry_after = min(2.0, float(r.headers.get("retry-after", 0)))
            else:
                done = error = False
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    if '"error"' in data[:20]:
                        error = True
                        continue
                    if kind == "hangup":
                        sent.result = "hung_up"
                        break
                if not sent.result:
                    sent.result = "stream_error_event" if error else "ok" if done else "truncated"
    except httpx.TimeoutException:
        sent.result = "client_timeout" if kind == "timeout" else "unexpected_timeout"
    except httpx.HTTPError as exc:
        sent.result = f"transport_error:{type(exc).__name__}"
    sent.seconds = time.monotonic() - t0
    return sent


def client_loop(
    worker: int, url: str, seed: int, stop: threading.Event, out: list[Sent], lock: threading.Lock
) -> None:
    rng = random.Random(seed * 1000 + worker)
    # Idle connections are closed before the router's 5 s keep-alive timeout, so a request is
    # never written onto a connection the router is closing (a client-side race, not ours).
    limits = httpx.Limits(max_keepalive_connections=2, keepalive_expiry=2.0)
    n = 0
    with httpx.Client(limits=limits) as client:
        while not stop.is_set():
            sent = one_request(client, url, rng, f"soak-{worker:02d}-{n:06d}")
            n += 1
            with lock:
                out.append(sent)
            stop.wait(sent.retry_after + rng.uniform(0.0, 0.1))


# --------------------------------------------------------------------------------------------
# Faults, flips, samplers

FAULTS: list[tuple[str, float]] = [
    ("fail_next", 3),
    ("stall_first_token", 2),
    ("hang_kv_read", 2),
    ("slowdown", 2),
    ("drop_stream", 2),
    ("error_mid_stream", 2),
    ("metrics", 1),
    ("crash", 1.5),
    ("sigstop", 1.5),  # a hung process: stopped for a few seconds, then continued
]
# --single-engine-faults: what request migration and hedging answer for (issue 23's faults),
# one engine at a time: kill -9 (at once, on prefill, on the KV READ, mid-stream), SIGSTOP, and
# an error event mid-stream (vLLM's 500 mid-generation).
SINGLE_ENGINE_FAULTS: list[tuple[str, float]] = [
    ("crash", 1),
    ("sigstop", 1),
    ("error_mid_stream", 1),
]


@dataclass
class Chaos:
    t0: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str]] = field(default_factory=list)  # (seconds, what)
    faults: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    flips_ok: int = 0
    flips_refused: int = 0
    errors: list[str] = field(default_factory=list)

    def event(self, what: str) -> None:
        self.events.append((time.monotonic() - self.t0, what))


def chaos_loop(
    stack: Stack,
    rng: random.Random,
    stop: threading.Event,
    every_s: float,
    chaos: Chaos,
    single: bool = False,
) -> None:
    engines = list(stack.fleet.engines)
    active: dict[str, float] = {}  # engine -> when to clear its fault
    down: dict[str, float] = {}  # crashed or stopped engine -> when to restart or continue it
    next_fault = time.monotonic() + every_s
    while not stop.wait(0.2):
        now = time.monotonic()
        try:
            for engine_id, at in list(down.items()):
                proc = stack.fleet.engines[engine_id]
                if now >= at or (not proc.alive and now >= at - 2):
                    if proc.alive and proc.process is not None:
                        os.kill(proc.process.pid, signal.SIGCONT)  # a stopped one, or a no-op
                    if not proc.alive:
                        stack.fleet.restart(engine_id, timeout=60)
                        chaos.restarts += 1
                        chaos.event(f"restarted {engine_id}")
                        log(f"restarted {engine_id}")
                    else:
                        stack.engine_admin(engine_id, "DELETE")
                    del down[engine_id]
                    if single:  # back in the router's rotation before the next fault
                        next_fault = max(next_fault, time.monotonic() + every_s)
            for engine_id, at in list(active.items()):
                if now >= at:
                    stack.engine_admin(engine_id, "DELETE")
                    del active[engine_id]
                    if single:
                        next_fault = max(next_fault, time.monotonic() + every_s)
            if now < next_fault:
                continue
            next_fault = now + every_s
            candidates = [e for e in engines if e not in active and e not in down]
            if not candidates or (single and (active or down)):
                continue
            engine_id = rng.choice(candidates)
            names, weights = zip(*(SINGLE_ENGINE_FAULTS if single else FAULTS), strict=True)
            fault = rng.choices(names, weights)[0]
            if fault in ("crash", "sigstop") and down:
                fault = "fail_next"  # one engine down at a time: the fleet keeps a pair
            body: dict[str, Any]
            if fault == "fail_next":
                body = {"fail_next": rng.randint(1, 6)}
            elif fault == "stall_first_token":
                body = {"stall_first_token_s": FIRST_TOKEN_TIMEOUT_S + 0.5}
            elif fault == "hang_kv_read":
                body = {"hang_kv_read_s": rng.choice([0.5, FIRST_TOKEN_TIMEOUT_S + 0.5])}
            elif fault == "slowdown":
                body = {"slowdown": rng.uniform(3.0, 10.0)}
            elif fault == "drop_stream":
                body = {"drop_stream_after_tokens": rng.randint(1, 8)}
            elif fault == "error_mid_stream":
                body = {"error_after_tokens": rng.randint(1, 8)}
            elif fault == "sigstop":
                process = stack.fleet.engines[engine_id].process
                if process is not None and process.poll() is None:
                    os.kill(process.pid, signal.SIGSTOP)
                down[engine_id] = now + rng.uniform(2.0, 5.0)
                chaos.faults[fault] += 1
                chaos.event(f"{fault} on {engine_id}")
                continue
            elif fault == "metrics":
                body = {"metrics": rng.choice(["lie", "stop"])}
            else:
                body = rng.choice(
                    [
                        {"crash_on_prefill": True},
                        {"crash_on_kv_read": True},
                        {"crash_after_tokens": rng.randint(2, 10)},
                        {"crash_now": True},
                    ]
                )
                fault = "crash:" + next(iter(body))
                down[engine_id] = now + rng.uniform(3.0, 6.0)
            stack.engine_admin(engine_id, "POST", body)
            if not fault.startswith("crash"):
                active[engine_id] = now + rng.uniform(2.0, 6.0)
            chaos.faults[fault] += 1
            chaos.event(f"{fault} on {engine_id}")
        except Exception as exc:  # the soak goes on; the report lists what went wrong
            chaos.errors.append(f"{type(exc).__name__}: {exc}")
            log(f"chaos error: {exc}")
    for engine_id in engines:
        proc = stack.fleet.engines[engine_id]
        if proc.alive and proc.process is not None:
            os.kill(proc.process.pid, signal.SIGCONT)
        if not stack.fleet.engines[engine_id].alive:
            stack.fleet.restart(engine_id, timeout=60)
            chaos.restarts += 1
        stack.engine_admin(engine_id, "DELETE")


def flip_loop(
    stack: Stack, rng: random.Random, stop: threading.Event, every_s: float, chaos: Chaos
) -> None:
    while not stop.wait(every_s):
        try:
            state = stack.admin("GET", "/admin/state").json()
            engine = rng.choice(state["engines"])
            to = "decode" if engine["role"] == "prefill" else "prefill"
            r = stack.admin("POST", "/admin/roles/flip", {"engine": engine["id"], "to": to})
            if r.status_code == 200:
                chaos.flips_ok += 1
                chaos.event(f"flipped {engine['id']} to {to}")
                log(f"flipped {engine['id']} to {to}")
            else:
                chaos.flips_refused += 1
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            chaos.errors.append(f"flip: {type(exc).__name__}: {exc}")


@dataclass
class Samples:
    cpu: list[tuple[float, float]] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    lag: list[tuple[float, float]] = field(default_factory=list)
    lag_failures: int = 0


def sample_loop(stack: Stack, stop: threading.Event, t0: float, samples: Samples) -> None:
    assert stack.router is not None
    pid = stack.router.pid
    next_rss = 0.0
    with httpx.Client(timeout=5) as client:
        while not stop.wait(0.5):
            now = time.monotonic() - t0
            if now >= next_rss:
                kib = rss_kib(pid)
                if kib is not None:
                    samples.rss.append((now, kib))
                cpu = cpu_seconds(pid)
                if cpu is not None:
                    samples.cpu.append((now, cpu))
                samples.load.append(os.getloadavg()[0])
                next_rss = now + 2.0
            start = time.monotonic()
            try:
                client.get(stack.url + "/health")
                samples.lag.append((now, time.monotonic() - start))
            except httpx.HTTPError:
                samples.lag_failures += 1


# --------------------------------------------------------------------------------------------
# The report


def journal_report(path: Path, sent: list[Sent]) -> dict[str, Any]:
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    duplicate_starts = duplicate_ends = unreadable = 0
    files = journal_files(path)
    for f in files:
        for line in f.read_bytes().splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                unreadable += 1
                continue
            if rec.get("type") == "request.start":
                duplicate_starts += rec["id"] in starts
                starts[rec["id"]] = rec
            elif rec.get("type") == "request.end":
                duplicate_ends += rec["id"] in ends
                ends[rec["id"]] = rec
    by_cid = {s.get("client_request_id"): rid for rid, s in starts.items()}
    reached = [s for s in sent if s.status is not None or s.cid in by_cid]
    not_journaled = [s.cid for s in reached if s.cid not in by_cid]
    never_reached = [s for s in sent if s.status is None and s.cid not in by_cid]
    mismatched_ids = [
        s.cid for s in sent if s.router_id is not None and by_cid.get(s.cid) != s.router_id
    ]
    errors: dict[str, Counter[str]] = {}
    for e in ends.values():
        if e["outcome"] not in ("ok", "client_abort"):
            # The message without ids and numbers, so that like failures count together.
            text = "".join(c if not c.isdigit() else "#" for c in str(e.get("error"))[:90])
            errors.setdefault(e["outcome"], Counter())[text] += 1
    # Seconds (by arrival) in which every request was refused as unavailable, and the
    # longest run of them: a fleet that lost a role for a while, or a breaker stuck open.
    by_second: dict[int, Counter[str]] = {}
    for e in ends.values():
        arrival = e.get("arrival")
        if isinstance(arrival, int | float):
            by_second.setdefault(int(arrival), Counter())[e["outcome"]] += 1
    dark = sorted(s for s, c in by_second.items() if c["unavailable"] == sum(c.values()))
    longest = run = 0
    for i, second in enumerate(dark):
        run = run + 1 if i and second == dark[i - 1] + 1 else 1
        longest = max(longest, run)
    stranded = sum(
        1 for e in ends.values() for a in e.get("attempts", ()) if a.get("outcome") == "stranded"
    )
    ok = [e for e in ends.values() if e["outcome"] == "ok"]
    ttft = [e["t_first_token"] for e in ok if e.get("t_first_token") is not None]
    tpot = [
        (e["t_last_token"] - e["t_first_token"]) / (e["completion_tokens"] - 1)
        for e in ok
        if e.get("t_last_token") is not None
        and e.get("t_first_token") is not None
        and (e.get("completion_tokens") or 0) > 1
    ]
    return {
        "files": len(files),
        "request_starts": len(starts),
        "request_ends": len(ends),
        "open_requests": len(set(starts) - set(ends)),
        "ends_without_start": len(set(ends) - set(starts)),
        "duplicate_starts": duplicate_starts,
        "duplicate_ends": duplicate_ends,
        "unreadable_lines": unreadable,
        "client_requests_not_journaled": len(not_journaled),
        "client_requests_that_never_reached_the_router": len(never_reached),
        "never_reached_results": dict(Counter(s.result for s in never_reached)),
        "router_id_mismatches": len(mismatched_ids),
        "outcomes": dict(Counter(e["outcome"] for e in ends.values()).most_common()),
        "top_errors": {o: dict(c.most_common(4)) for o, c in sorted(errors.items())},
        "seconds_all_unavailable": len(dark),
        "longest_all_unavailable_s": longest,
        "seconds_with_requests": len(by_second),
        "stranded_handoffs_in_attempts": stranded,
        "migrated_requests": sum(1 for e in ends.values() if e.get("migrations")),
        "hedged_requests": sum(
            1
            for e in ends.values()
            if any(a.get("outcome") == "hedged" for a in e.get("attempts", ()))
        ),
        "ttft_p99_s": round(rank_percentile(ttft, 99), 4) if ttft else None,
        "tpot_p99_s": round(rank_percentile(tpot, 99), 4) if tpot else None,
        "lost_records": len(set(starts) - set(ends))
        + len(set(ends) - set(starts))
        + duplicate_starts
        + duplicate_ends
        + len(not_journaled),
    }


# What a client counts as answered: a whole stream, a 200, or an admission refusal (429, a
# load decision it was told to retry later). Everything else a plain request saw is a failure
# the fleet's faults made visible.
ANSWERED = ("ok", "http_200", "http_429")


def client_failures(sent: list[Sent]) -> dict[str, Any]:
    plain = [s for s in sent if s.kind == "plain"]
    failed = Counter(s.result for s in plain if s.result not in ANSWERED)
    return {"plain_requests": len(plain), "failed": sum(failed.values()), "by_result": dict(failed)}


def rss_report(rss: list[tuple[float, int]], warmup_s: float) -> dict[str, Any]:
    if not rss:
        return {}
    values = [kib for _, kib in rss]
    after = [(t, kib) for t, kib in rss if t >= warmup_s] or rss
    # Least-squares slope of RSS over time after the warm-up: flat memory is ~0 KiB/min.
    n = len(after)
    mean_t = sum(t for t, _ in after) / n
    mean_k = sum(k for _, k in after) / n
    var = sum((t - mean_t) ** 2 for t, _ in after)
    slope = sum((t - mean_t) * (k - mean_k) for t, k in after) / var * 60 if var else 0.0
    by_minute: dict[int, int] = {}
    for t, kib in rss:
        by_minute[int(t // 60)] = max(by_minute.get(int(t // 60), 0), kib)
    return {
        "first_mib": round(values[0] / 1024, 1),
        "peak_mib": round(max(values) / 1024, 1),
        "last_mib": round(values[-1] / 1024, 1),
        "after_warmup_min_mib": round(min(k for _, k in after) / 1024, 1),
        "after_warmup_max_mib": round(max(k for _, k in after) / 1024, 1),
        "slope_after_warmup_kib_per_min": round(slope, 1),
        "peak_by_minute_mib": {m: round(k / 1024, 1) for m, k in sorted(by_minute.items())},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--minutes",
        type=positive(float),
        default=10.0,
        help="wall minutes of load (default %(default)s)",
    )
    p.add_argument(
        "--clients",
        type=positive(int),
        default=12,
        help="client threads sending (default %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of the request mix, the faults and the flips (default %(default)s)",
    )
    p.add_argument(
        "--time-scale",
        type=positive(float),
        default=50.0,
        help="engines run this many times faster than the calibrated fleet (default %(default)s)",
    )
    p.add_argument(
        "--fault-every",
        type=number_type(float, 0),
        default=4.0,
        help="seconds between faults (0: none)",
    )
    p.add_argument(
        "--flip-every",
        type=number_type(float, 0),
        default=20.0,
        help="seconds between flips (0: none)",
    )
    p.add_argument(
        "--journal-max-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="the router's --journal-max-bytes: rotation size in bytes (default %(default)s)",
    )
    p.add_argument(
        "--single-engine-faults",
        action="store_true",
        help="only kill -9, SIGSTOP and errors mid-stream, on one engine at a time, the next"
        " --fault-every seconds after the last was cleared (a restarted engine is back in the"
        " router's rotation): the faults request migration and hedging must hide from clients;"
        " with --flip-every 0, nothing else moves",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="run twice with the same seed: migration and hedging on (the fleet's defaults), "
        "then both off; report client-visible failures, TTFT p99 and TPOT p99 side by side",
    )
    p.add_argument("--out", help="also write the report here (JSON)")
    p.add_argument("--keep-dir", action="store_true", help="keep the logs and the journal")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.clients <= 0:
        p.error("--minutes and --clients must be positive")
    runs = [True, False] if args.compare else [True]
    reports = {("on" if r else "off"): soak(args, r) for r in runs}
    if args.compare:
        report: dict[str, Any] = {
            "comparison": {
                name: {
                    "client_visible_failures": r.get("client_failures", {}).get("failed"),
                    "plain_requests": r.get("client_failures", {}).get("plain_requests"),
                    "ttft_p99_s": r.get("journal", {}).get("ttft_p99_s"),
                    "tpot_p99_s": r.get("journal", {}).get("tpot_p99_s"),
                    "migrated_requests": r.get("journal", {}).get("migrated_requests"),
                    "hedged_requests": r.get("journal", {}).get("hedged_requests"),
                    "faults": r.get("faults"),
                }
                for name, r in reports.items()
            },
            "migration_and_hedging_on": reports["on"],
            "migration_and_hedging_off": reports["off"],
        }
    else:
        report = reports["on"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = True
    for name, r in reports.items():
        lost = r.get("lost_journal_records")
        code = r.get("router_exit_code")
        log(f"{name}: lost journal records: {lost}; router exit code {code}")
        ok = ok and lost == 0 and code == 0
    return 0 if ok else 1


def soak(args: argparse.Namespace, resilience: bool) -> dict[str, Any]:
    """One soak run; its report."""
    directory = Path(tempfile.mkdtemp(prefix="narwhal-soak-"))
    stack = Stack(directory, args.time_scale, args.journal_max_bytes, resilience)
    sent: list[Sent] = []
    lock = threading.Lock()
    chaos = Chaos()
    samples = Samples()
    stop_clients, stop_chaos, stop_samples = threading.Event(), threading.Event(), threading.Event()
    load = os.getloadavg()
    log(f"working in {directory}; load average {load[0]:.1f} on {os.cpu_count()} CPUs")
    report: dict[str, Any] = {}
    try:
        stack.start()
        assert stack.router is not None
        t0 = time.monotonic()
        chaos.t0 = t0
        threads = [
            threading.Thread(
                target=client_loop, args=(i, stack.url, args.seed, stop_clients, sent, lock)
            )
            for i in range(args.clients)
        ]
        chaos_thread = threading.Thread(
            target=chaos_loop,
            args=(
                stack,
                random.Random(args.seed + 1),
                stop_chaos,
                args.fault_every,
                chaos,
                args.single_engine_faults,
            ),
        )
        flip_thread = threading.Thread(
            target=flip_loop,
            args=(stack, random.Random(args.seed + 2), stop_chaos, args.flip_every, chaos),
        )
        sampler = threading.Thread(target=sample_loop, args=(stack, stop_samples, t0, samples))
        background = [*threads, sampler]
        if args.fault_every > 0:
            background.append(chaos_thread)
        if args.flip_every > 0:
            background.append(flip_thread)
        for t in background:
            t.daemon = True
            t.start()
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(min(30.0, max(0.0, end - time.monotonic())))
            with lock:
                n = len(sent)
            rss = samples.rss[-1][1] / 1024 if samples.rss else float("nan")
            log(
                f"{(time.monotonic() - t0) / 60:.1f} min: {n} requests, RSS {rss:.1f} MiB, "
                f"{sum(chaos.faults.values())} faults, {chaos.restarts} restarts, "
                f"{chaos.flips_ok} flips"
            )
            if stack.router.poll() is not None:
                raise RuntimeError("the router died")
        stop_chaos.set()
        if chaos_thread.is_alive():
            chaos_thread.join(120)
        if flip_thread.is_alive():
            flip_thread.join(30)
        stop_clients.set()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - t0
        # Drained: nothing in flight, then the final figures, then SIGTERM.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = stack.admin("GET", "/admin/state").json()
            if state["in_flight_requests"] == 0:
                break
            time.sleep(0.2)
        metrics = httpx.get(stack.url + "/metrics", timeout=10).content

        def counter(name: str) -> float:
            return metric_sum(metrics, name) or 0.0

        stop_samples.set()
        sampler.join(10)
        code = stack.stop_router()
        with lock:
            sent_copy = list(sent)
        journal = journal_report(stack.journal, sent_copy)
        lags = [s for _, s in samples.lag]
        report = {
            "minutes": round(elapsed / 60, 2),
            "clients": args.clients,
            "seed": args.seed,
            "time_scale": args.time_scale,
            "load_average_at_start": round(load[0], 1),
            "load_average_at_end": round(os.getloadavg()[0], 1),
            "requests_sent": len(sent_copy),
            "requests_per_second": round(len(sent_copy) / elapsed, 1),
            "migration_and_hedging": resilience,
            "client_results": dict(Counter(s.result for s in sent_copy).most_common()),
            "client_failures": client_failures(sent_copy),
            "client_kinds": dict(Counter(s.kind for s in sent_copy)),
            "journal": journal,
            "lost_journal_records": journal["lost_records"],
            "stranded_handoffs_metric": counter("narwhal_stranded_handoffs_total"),
            "retries_metric": counter("narwhal_retries_total"),
            "migrations_metric": counter("narwhal_migrations_total"),
            "hedges_metric": counter("narwhal_hedges_total"),
            "journal_dropped_metric": counter("narwhal_journal_dropped_total"),
            "journal_write_errors_metric": counter("narwhal_journal_write_errors_total"),
            "faults": dict(chaos.faults.most_common()),
            "engine_restarts": chaos.restarts,
            "flips": {"done": chaos.flips_ok, "refused": chaos.flips_refused},
            "chaos_errors": chaos.errors[:20],
            "router_rss": rss_report(samples.rss, warmup_s=min(60.0, elapsed / 5)),
            "event_loop_lag_probe_ms": {
                "samples": len(lags),
                "failures": samples.lag_failures,
                "p50": round(rank_percentile(lags, 50) * 1000, 2),
                "p99": round(rank_percentile(lags, 99) * 1000, 2),
                "max": round(max(lags) * 1000, 2) if lags else None,
                "over_100ms": sum(1 for x in lags if x > 0.1),
                # The worst probes, each with the chaos events of the 3 s before it: a stall
                # that follows an engine restart or a flip points at the router; one that
                # follows nothing points at a starved machine.
                "worst": [
                    {
                        "t_s": round(t, 1),
                        "ms": round(x * 1000, 1),
                        "after": [w for te, w in chaos.events if t - 3 <= te <= t],
                    }
                    for t, x in sorted(samples.lag, key=lambda s: -s[1])[:5]
                ],
            },
            "router_cpu_percent": cpu_percent(samples.cpu),
            "machine_load_average": {
                "mean": round(statistics.fmean(samples.load), 1) if samples.load else None,
                "max": round(max(samples.load), 1) if samples.load else None,
                "cpus": os.cpu_count(),
            },
            "router_exit_code": code,
        }
    finally:
        stop_chaos.set()
        stop_clients.set()
        stop_samples.set()
        stack.stop()
        if args.keep_dir:
            log(f"kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return report


if __name__ == "__main__":
    sys.exit(main())
