"""Streams memory: 10,000 concurrent streaming requests held open through narwhal-serve.

A fleet of simulated engines (1 prefill, ``--decode-engines`` decode; roles pinned, the role
controller off) answers prefill at once and decodes slowly: one decode step, hence one token per
stream, every ``--token-interval`` seconds, with ``max_tokens`` large enough that no stream ends
while it is measured. The engines' ``max_num_seqs`` and KV pools are raised so that every stream
is admitted, and ``first_token_timeout_s`` is raised so that no decode leg is aborted while the
ramp queues KV pulls. The router runs with its defaults (scheduler v0, no admission limit; its
per-engine connection pool holds 2,048 connections, which is why the streams are spread over
several decode engines).

The client (this process, raw asyncio streams on uvloop, one connection per stream, bodies only
counted, never parsed) opens the streams with at most ``--window`` of them waiting for their
response head at any time (each bounded by ``--open-timeout`` s); the ramp stops after
``--max-failures`` failed streams or ``--ramp-timeout`` s. With every stream open it holds them for
``--hold`` s, then hangs up on all of them and waits (bounded) for the router to let go.

Reported:

- router RSS (``VmRSS`` of the narwhal-serve process, sampled every 0.25 s): baseline after a
  warm-up, peak while the streams are open, and (peak - baseline) / streams in KB. Kernel
  socket buffers are not in RSS;
- streams concurrently open, three ways: response heads the client holds, the router's own
  ``in_flight_requests`` from ``GET /admin/state``, and the sum of ``narwhal_in_flight``
  (role decode) from ``GET /metrics``;
- event-loop lag. The router exports no loop-lag metric, so it is measured from outside: a
  separate process (its own interpreter, blocking socket, one keep-alive connection) sends
  ``GET /health`` every ``--probe-interval`` s and records each round trip. The handler does
  no work, so a round trip is the router loop's delay plus the loopback trip plus the probe's
  own scheduling on a shared CPU. Percentiles are given idle (before the ramp), during the ramp
  and during the hold; the target applies to the hold.

Unless ``--no-gc-trace``, the router runs under a ``gc.callbacks`` hook (the same code, started
through ``runpy``) that times its garbage collections: the oldest generation's and any other of
5 ms or more are reported per phase, with how many slow probes overlap a long collection.

Targets (printed as PASS or MISS): < 50 KB of router RSS per stream, lag p99 < 50 ms.

    .venv/bin/python bench/streams_memory.py [--streams 10000] [--decode-engines 6]

Only 127.0.0.1 is contacted. Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from narwhal.serve.cli import serve_arguments
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing import aio, procfs, procs
from narwhal.testing.fleet import SimFleet, loopback_only
from narwhal.testing.ports import free_ports
from narwhal.testing.procfs import fd_count, rss_kib, thread_count
from narwhal.testing.provenance import source_state
from narwhal.testing.rawhttp import connect
from narwhal.testing.routers import router_ready
from narwhal.testing.stats import percentile

# Only 127.0.0.1 is contacted: NIXL on loopback, no proxy (every process started inherits this).
loopback_only()

MODEL = "moonshotai/Kimi-K3"
ADMIN_TOKEN = "streams-memory-admin-token"
PROMPT = "narwhals dive deep under the arctic ice for halibut and squid"
BLOCK_BYTES = 64  # the smallest KV block the simulator allows: the KV pools stay small
TARGET_KB_PER_STREAM = 50.0
TARGET_LAG_P99_MS = 50.0
NOFILE = 65536


def log(message: str) -> None:
    print(f"[streams-memory {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    return procfs.cpu_seconds(pid) or 0.0


# --------------------------------------------------------------------------------------------
# The lag probe: a separate process, so that the client's 10,000 sockets do not delay it.


def run_probe(port: int, out: str, interval: float, max_s: float) -> int:
    stop = {"now": False}

    def on_term(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    deadline = time.monotonic() + max_s
    sock: socket.socket | None = None
    with open(out, "w") as f:
        while not stop["now"] and time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t0 = time.monotonic()
                sock.sendall(request)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise OSError("closed")
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                while len(body) < length:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise OSError("closed")
                    body += chunk
                status = int(head.split(b" ", 2)[1])
                f.write(f"{t0:.6f} {time.monotonic() - t0:.6f} {status}\n")
            except OSError as exc:
                f.write(f"{t0:.6f} {time.monotonic() - t0:.6f} error:{type(exc).__name__}\n")
                if sock is not None:
                    sock.close()
                sock = None
            f.flush()
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    return 0


# Runs narwhal-serve unchanged in this interpreter, recording every garbage collection of the
# oldest generation, and any other taking 5 ms or more, with its start and duration.
GC_TRACE = """
import gc, runpy, sys, time
out = open(sys.argv[1], "a", buffering=1)
start = [0.0]
def trace(phase, info):
    if phase == "start":
        start[0] = time.monotonic()
        return
    took = time.monotonic() - start[0]
    if info["generation"] == 2 or took >= 0.005:
        out.write(f"{start[0]:.6f} {took:.6f} {info['generation']} {info['collected']}\\n")
gc.callbacks.append(trace)
sys.argv = ["narwhal-serve", *sys.argv[2:]]
runpy.run_module("narwhal.serve.cli", run_name="__main__", alter_sys=True)
"""


def gc_report(
    path: Path, probes: list[tuple[float, float, str]], phases: Phases, report: dict[str, Any]
) -> None:
    rows = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                rows.append((float(parts[0]), float(parts[1]), int(parts[2])))
    for name, (a, b) in (("ramp", phases.ramp), ("hold", phases.hold)):
        for gen in (0, 1, 2):
            took = [d * 1000 for t, d, g in rows if a <= t < b and g == gen]
            if gen == 2 or took:
                report[f"router_gc_gen{gen}_{name}"] = (
                    f"n={len(took)} total_ms={sum(took):.0f} max_ms={max(took, default=0):.0f}"
                    + ("" if gen == 2 else " (only those >= 5 ms)")
                )
        # Slow probes (> 100 ms) whose round trip overlaps a collection of 100 ms or more.
        pauses = [(t, t + d) for t, d, _ in rows if d >= 0.1]
        slow = [(t, t + lat) for t, lat, status in probes if a <= t < b and lat > 0.1]
        hit = sum(1 for p0, p1 in slow if any(g0 < p1 and p0 < g1 for g0, g1 in pauses))
        report[f"lag_probes_over_100ms_{name}_overlapping_a_gc_pause_over_100ms"] = (
            f"{hit} of {len(slow)}"
        )


def read_probe(path: Path) -> list[tuple[float, float, str]]:
    rows = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows.append((float(parts[0]), float(parts[1]), parts[2]))
    return rows


# --------------------------------------------------------------------------------------------
# The streaming client


@dataclass
class Stream:
    index: int
    writer: asyncio.StreamWriter | None = None
    status: int | None = None
    error: str | None = None
    opened_at: float | None = None
    first_data_at: float | None = None
    closed_at: float | None = None  # the router ended the stream (EOF) before we hung up
    events: int = 0
    tail: bytes = b""


@dataclass
class Client:
    port: int
    max_tokens: int
    streams: list[Stream] = field(default_factory=list)
    readers: set[asyncio.Task[None]] = field(default_factory=set)

    def request(self, index: int) -> bytes:
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": f"{index} {PROMPT}",
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        return (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"X-Request-Id: streams-memory-{index}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def open(self, stream: Stream) -> None:
        """Send the request and read the response head; then keep reading in the background."""
        try:
            reader, writer = await connect(self.port)
            stream.writer = writer
            writer.write(self.request(stream.index))
            head = await reader.readuntil(b"\r\n\r\n")
            stream.status = int(head.split(b" ", 2)[1])
            if stream.status != 200:
                with contextlib.suppress(Exception):
                    stream.tail = await asyncio.wait_for(reader.read(400), 2)
                stream.error = f"HTTP {stream.status}"
                writer.close()
                return
            stream.opened_at = time.monotonic()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            stream.error = f"{type(exc).__name__}: {exc}"[:200]
            if stream.writer is not None:
                stream.writer.close()
            return
        except asyncio.CancelledError:
            stream.error = stream.error or "cancelled: no response head in time"
            if stream.writer is not None:
                stream.writer.transport.abort()
            raise
        task = asyncio.ensure_future(self.drain(stream, reader))
        self.readers.add(task)
        task.add_done_callback(self.readers.discard)

    async def drain(self, stream: Stream, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while True:
                data = await reader.read(65536)
                if not data:
                    stream.closed_at = time.monotonic()
                    return
                if stream.first_data_at is None:
                    stream.first_data_at = time.monotonic()
                stream.events += data.count(b"data: ")
                stream.tail = (stream.tail + data)[-300:]
                if stream.tail.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
                    stream.closed_at = time.monotonic()
                    return

    def open_now(self) -> int:
        return sum(1 for s in self.streams if s.opened_at is not None and s.closed_at is None)

    def hang_up(self) -> None:
        for stream in self.streams:
            if stream.writer is not None and not stream.writer.is_closing():
                stream.writer.transport.abort()
        for task in list(self.readers):
            task.cancel()


# --------------------------------------------------------------------------------------------
# Router observation


def admin_state(url: str) -> dict[str, Any] | None:
    try:
        r = httpx.get(
            url + "/admin/state",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
            trust_env=False,
        )
        state = r.json()
        return state if isinstance(state, dict) else None
    except (httpx.HTTPError, ValueError):
        return None


def admin_in_flight(url: str) -> int | None:
    state = admin_state(url)
    try:
        return int(state["in_flight_requests"]) if state is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def metric_in_flight(url: str) -> dict[str, float] | None:
    try:
        text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    except httpx.HTTPError:
        return None
    out = {"prefill": 0.0, "decode": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "narwhal_in_flight":
                out[sample.labels["role"]] = out.get(sample.labels["role"], 0.0) + sample.value
    return out


@dataclass
class Samples:
    rss: list[tuple[float, int]] = field(default_factory=list)
    in_flight: list[tuple[float, int, int]] = field(default_factory=list)  # (t, admin, client)


async def sample_rss(pid: int, samples: Samples, stop: asyncio.Event) -> None:
    while not stop.is_set():
        kib = rss_kib(pid)
        if kib is not None:
            samples.rss.append((time.monotonic(), kib))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class Phases:
    idle: tuple[float, float] = (0.0, 0.0)
    ramp: tuple[float, float] = (0.0, 0.0)
    hold: tuple[float, float] = (0.0, 0.0)
    teardown: tuple[float, float] = (0.0, 0.0)


async def drive(
    args: argparse.Namespace, url: str, port: int, pid: int, report: dict[str, Any]
) -> Phases:
    phases = Phases()
    samples = Samples()
    stop_sampling = asyncio.Event()
    client = Client(port, args.max_tokens)

    # Warm-up: a few whole streams (2 tokens) so lazily built state exists before the baseline.
    warm = Client(port, 2)
    warm.streams = [Stream(-1 - i) for i in range(args.warmup)]
    await asyncio.gather(*(warm.open(s) for s in warm.streams))
    deadline = time.monotonic() + 10 * args.token_interval + 30
    while warm.readers and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    warm_ok = sum(1 for s in warm.streams if s.closed_at is not None and b"[DONE]" in s.tail)
    report["warmup_streams_completed"] = f"{warm_ok}/{args.warmup}"
    warm.hang_up()

    t = time.monotonic()
    await asyncio.sleep(args.idle)
    phases.idle = (t, time.monotonic())
    baseline = rss_kib(pid) or 0
    report["router_rss_baseline_kib"] = baseline
    report["router_threads_baseline"] = thread_count(pid)
    fds = fd_count(pid)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    # Each stream holds two router sockets: the client's and the decode engine's.
    report["router_fds_baseline"] = (
        f"{fds} of RLIMIT_NOFILE {nofile}: room for about {(nofile - fds) // 2} streams"
    )
    sampler = asyncio.ensure_future(sample_rss(pid, samples, stop_sampling))
    cpu0 = cpu_seconds(pid)

    # Ramp: at most --window streams waiting for their response head at any time.
    t_ramp = time.monotonic()
    ramp_deadline = t_ramp + args.ramp_timeout
    stopped_why = ""
    window = asyncio.Semaphore(args.window)
    opening: set[asyncio.Task[None]] = set()

    async def open_one(stream: Stream) -> None:
        try:
            await asyncio.wait_for(client.open(stream), args.open_timeout)
        except TimeoutError:
            stream.error = f"no response head within {args.open_timeout:.0f} s"
        finally:
            window.release()

    for i in range(args.streams):
        await window.acquire()
        failures = sum(1 for s in client.streams if s.error is not None)
        if failures >= args.max_failures:
            window.release()
            stopped_why = f"{failures} streams failed by stream {i} (--max-failures)"
            break
        if time.monotonic() > ramp_deadline:
            window.release()
            stopped_why = f"ramp timeout ({args.ramp_timeout} s) before stream {i}"
            break
        stream = Stream(i)
        client.streams.append(stream)
        task = asyncio.ensure_future(open_one(stream))
        opening.add(task)
        task.add_done_callback(opening.discard)
        if (i + 1) % 1000 == 0:
            log(
                f"ramp: {i + 1} sent, {client.open_now()} open, {failures} failed, "
                f"router RSS {rss_kib(pid)} KiB, {fd_count(pid)} router fds"
            )
    if opening:
        await asyncio.wait(opening, timeout=args.open_timeout + 5)
    phases.ramp = (t_ramp, time.monotonic())
    report["ramp_s"] = round(phases.ramp[1] - phases.ramp[0], 1)
    if stopped_why:
        report["ramp_stopped"] = stopped_why
        log(f"ramp stopped: {stopped_why}")

    # Hold: every stream open, sample.
    t_hold = time.monotonic()
    cpu_hold0 = cpu_seconds(pid)
    events_hold0 = sum(s.events for s in client.streams)
    admin_seen: list[int] = []
    open_seen: list[int] = []
    while time.monotonic() < t_hold + args.hold:
        n_admin = await asyncio.to_thread(admin_in_flight, url)
        n_open = client.open_now()
        if n_admin is not None:
            admin_seen.append(n_admin)
            samples.in_flight.append((time.monotonic(), n_admin, n_open))
        open_seen.append(n_open)
        await asyncio.sleep(2.0)
    metric = await asyncio.to_thread(metric_in_flight, url)
    end_state = await asyncio.to_thread(admin_state, url)
    phases.hold = (t_hold, time.monotonic())
    hold_s = phases.hold[1] - phases.hold[0]
    cpu_hold = cpu_seconds(pid) - cpu_hold0
    events_hold = sum(s.events for s in client.streams) - events_hold0
    peak_rss_hold = max((k for t, k in samples.rss if t >= t_hold), default=0)
    peak_rss = max((k for _, k in samples.rss), default=0)
    open_at_peak = client.open_now()

    # Teardown: hang up on everything and wait (bounded) for the router to let go.
    t_down = time.monotonic()
    client.hang_up()
    n_after = None
    deadline = t_down + args.teardown_timeout
    while time.monotonic() < deadline:
        n_after = await asyncio.to_thread(admin_in_flight, url)
        if n_after == 0:
            break
        await asyncio.sleep(1.0)
    phases.teardown = (t_down, time.monotonic())
    await asyncio.sleep(2.0)
    stop_sampling.set()
    await sampler
    cpu_total = cpu_seconds(pid) - cpu0

    statuses: dict[str, int] = {}
    for s in client.streams:
        if s.error is not None:
            statuses[s.error.split(":")[0][:60]] = statuses.get(s.error.split(":")[0][:60], 0) + 1
    ended_early = [s for s in client.streams if s.closed_at is not None]
    report["streams_requested"] = args.streams
    report["streams_sent"] = len(client.streams)
    report["streams_opened"] = sum(1 for s in client.streams if s.opened_at is not None)
    report["streams_failed"] = statuses or 0
    if ended_early:
        report["streams_ended_by_router_before_hangup"] = len(ended_early)
        report["example_ended_stream_tail"] = ended_early[0].tail.decode(errors="replace")[-200:]
    examples: dict[str, Stream] = {}
    for s in client.streams:
        if s.error is not None:
            examples.setdefault(s.error.split(":")[0][:60], s)
    for kind, s in examples.items():
        report[f"first_failure_{kind.replace(' ', '_')}"] = (
            f"stream {s.index}: {s.error} {s.tail[:240]!r}"
        )
    if end_state is not None:
        report["router_engines_end_of_hold"] = "; ".join(
            f"{e['id']} {e['role']} healthy={e['healthy']} breaker={e['breaker']} "
            f"in_flight={e['in_flight']['prefill']}/{e['in_flight']['decode']}"
            for e in end_state.get("engines", [])
        )
    first_data = sum(1 for s in client.streams if s.first_data_at is not None)
    report["streams_with_a_token"] = first_data
    report["open_streams_client_min_max_during_hold"] = (
        f"{min(open_seen, default=0)}..{max(open_seen, default=0)}"
    )
    report["open_streams_router_admin_state_min_max_during_hold"] = (
        f"{min(admin_seen, default=0)}..{max(admin_seen, default=0)}"
        if admin_seen
        else "unavailable"
    )
    if metric is not None:
        report["router_metric_narwhal_in_flight_end_of_hold"] = (
            f"decode {metric['decode']:.0f}, prefill {metric['prefill']:.0f}"
        )
    report["open_streams_at_peak"] = open_at_peak
    report["router_rss_peak_kib"] = peak_rss
    report["router_rss_peak_during_hold_kib"] = peak_rss_hold
    if samples.rss:
        report["router_rss_after_teardown_kib"] = samples.rss[-1][1]
        report["router_rss_max_whole_run_kib"] = max(k for _, k in samples.rss)
    report["router_fds_threads_at_end"] = f"{fd_count(pid)} fds, {thread_count(pid)} threads"
    streams = max(open_at_peak, 1)
    per_stream = (peak_rss - baseline) / streams
    report["router_kb_per_stream"] = round(per_stream, 2)
    report["router_in_flight_after_hangup"] = n_after
    report["router_cpu_s_ramp_hold_teardown"] = round(cpu_total, 1)
    report["router_cpu_percent_during_hold"] = round(100 * cpu_hold / hold_s, 1)
    report["tokens_relayed_per_s_during_hold"] = round(events_hold / hold_s, 1)
    report["_per_stream"] = per_stream
    return phases


def lag_report(
    rows: list[tuple[float, float, str]], phases: Phases, report: dict[str, Any]
) -> float:
    hold_p99 = float("nan")
    for name, (a, b) in (("idle", phases.idle), ("ramp", phases.ramp), ("hold", phases.hold)):
        ok = [lat * 1000 for t, lat, status in rows if a <= t < b and status == "200"]
        bad = sum(1 for t, _, status in rows if a <= t < b and status != "200")
        p99 = percentile(ok, 99)
        if name == "hold":
            hold_p99 = p99
        report[f"lag_probe_{name}_ms"] = (
            f"n={len(ok)} p50={percentile(ok, 50):.2f} p90={percentile(ok, 90):.2f} "
            f"p99={p99:.2f} max={max(ok, default=float('nan')):.2f}"
            + (f" failed={bad}" if bad else "")
        )
    return hold_p99


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--streams",
        type=int,
        default=10_000,
        help="concurrent streams to open and hold (default %(default)s)",
    )
    parser.add_argument(
        "--decode-engines",
        type=int,
        default=6,
        help="decode engines the streams are spread over (default %(default)s)",
    )
    parser.add_argument(
        "--token-interval", type=float, default=5.0, help="seconds per decode step (per token)"
    )
    parser.add_argument(
        "--window", type=int, default=1000, help="streams waiting for a response head at most"
    )
    parser.add_argument("--open-timeout", type=float, default=60.0, help="bound per stream head")
    parser.add_argument("--max-failures", type=int, default=1000, help="stop the ramp after these")
    parser.add_argument(
        "--ramp-timeout",
        type=float,
        default=300.0,
        help="seconds after which the ramp stops opening streams (default %(default)s)",
    )
    parser.add_argument("--hold", type=float, default=15.0, help="seconds all streams stay open")
    parser.add_argument("--idle", type=float, default=3.0, help="idle probe seconds before ramp")
    parser.add_argument(
        "--teardown-timeout",
        type=float,
        default=60.0,
        help="seconds to wait, after hanging up, for the router to have nothing in flight "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="whole 2-token streams run before the baseline RSS (default %(default)s)",
    )
    parser.add_argument(
        "--probe-interval",
        type=float,
        default=0.05,
        help="seconds between the lag probe's GET /health requests (default %(default)s)",
    )
    parser.add_argument(
        "--no-gc-trace",
        dest="gc_trace",
        action="store_false",
        help="run the router without the gc.callbacks hook that times its collections",
    )
    parser.add_argument(
        "--keep-dir",
        action="store_true",
        help="keep the run's temporary directory instead of deleting it (its path is printed)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="extra narwhal-serve argument (repeatable), e.g. --router-arg=--gc=default",
    )
    parser.add_argument("--lag-probe", nargs=2, metavar=("PORT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lag_probe:
        return run_probe(int(args.lag_probe[0]), args.lag_probe[1], args.probe_interval, 900)
    if args.streams < 1 or args.decode_engines < 1 or args.window < 1:
        parser.error("--streams, --decode-engines and --window must be positive")

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    # Every process started below inherits this: router (2 sockets per stream), engines, client.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(NOFILE, 3 * args.streams + 1024)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError) as exc:
        log(f"could not raise RLIMIT_NOFILE from {soft}/{hard} to {want}: {exc}")
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)

    # Each decode stream holds ceil((prompt + max_tokens) / block_size) blocks; the streams must
    # outlive the ramp and the hold by a margin.
    lifetime_s = args.ramp_timeout + args.hold + args.teardown_timeout + 60
    max_tokens = max(16, math.ceil(lifetime_s / args.token_interval))
    args.max_tokens = max_tokens
    per_engine = math.ceil(args.streams / args.decode_engines)
    blocks_per_stream = math.ceil((64 + max_tokens) / 16)
    num_blocks = int(per_engine * blocks_per_stream * 1.25) + 4096
    max_num_seqs = per_engine + 1024
    n = 1 + args.decode_engines
    sim = {
        "time_scale": 1,
        "prefill_a": 0,
        "prefill_b": 0,
        "prefill_c": 0,
        "decode_intercept": args.token_interval,
        "decode_slope": 0,
        "decode_ctx_coef": 0,
        "max_num_seqs": max(max_num_seqs, args.window * 2),
        "num_blocks": num_blocks,
        "block_bytes": BLOCK_BYTES,
        "kv_lease_s": 300.0,
        "kv_read_timeout_s": 60.0,
    }
    directory = Path(tempfile.mkdtemp(prefix="streams-memory-"))
    report: dict[str, Any] = {}
    fleet: SimFleet | None = None
    router: subprocess.Popen[bytes] | None = None
    probe: subprocess.Popen[bytes] | None = None
    t_start = time.monotonic()
    try:
        ports = free_ports(2 * n + 1)
        doc = local_fleet_document(
            ports[:n],
            ports[n : 2 * n],
            initial_roles=["prefill"] + ["decode"] * args.decode_engines,
            roles=[["prefill"]] + [["decode"]] * args.decode_engines,
            sim=sim,
            first_token_timeout_s=max(60.0, 10 * args.token_interval),
            ttft_s=max(120.0, 20 * args.token_interval),
            tpot_s=max(1.0, 2 * args.token_interval),
            role_control={"enabled": False, "min_prefill": 1, "min_decode": 1},
        )
        fleet_path = directory / "fleet.json"
        fleet_path.write_text(json.dumps(doc, indent=2))
        log(f"starting {n} simulated engines")
        fleet = SimFleet(fleet_path, log_dir=directory / "logs")
        fleet.start(timeout=120)
        port = ports[-1]
        url = f"http://127.0.0.1:{port}"
        token = directory / "admin-token"
        token.write_text(ADMIN_TOKEN + "\n")
        router_log = directory / "router.log"
        router = procs.start(
            [
                sys.executable,
                *(
                    ("-c", GC_TRACE, str(directory / "gc.txt"))
                    if args.gc_trace
                    else ("-m", "narwhal.serve.cli")
                ),
                *serve_arguments(
                    fleet_path,
                    port,
                    directory / "journal.jsonl",
                    "--skip-qualification",
                    "--admin-token-file",
                    str(token),
                    "--log-level",
                    "warning",
                    *args.router_arg,
                ),
            ],
            router_log,
            append=False,
        )
        procs.wait_ready(
            functools.partial(router_ready, url), 60, process=router, name="router", log=router_log
        )
        probe_out = directory / "lag.txt"
        probe = procs.start(
            [
                sys.executable,
                __file__,
                *("--lag-probe", str(port), str(probe_out)),
                *("--probe-interval", str(args.probe_interval)),
            ],
            directory / "lag-probe.log",
        )
        report["command"] = "python bench/streams_memory.py " + " ".join(sys.argv[1:])
        report["cpus"] = os.cpu_count()
        report["load_average_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        report["source"] = source_state(Path(__file__).resolve().parent.parent)
        report["rlimit_nofile"] = f"{nofile[0]}/{nofile[1]}" + (
            "" if nofile[1] >= want else f" (hard limit; raising it to {want} was refused)"
        )
        report["engines"] = (
            f"1 prefill (0 s) + {args.decode_engines} decode, one token per stream every "
            f"{args.token_interval} s, max_tokens {max_tokens}, "
            f"max_num_seqs {sim['max_num_seqs']}, "
            f"num_blocks {num_blocks} x {BLOCK_BYTES} B"
        )
        report["client"] = "raw asyncio streams" + (" + uvloop" if aio.UVLOOP else "")
        report["router_pid"] = router.pid
        log(f"router pid {router.pid} ready; ramping {args.streams} streams")
        coro = drive(args, url, port, router.pid, report)
        phases = aio.run(coro)
        probe.send_signal(signal.SIGTERM)
        probe.wait(10)
        probes = read_probe(probe_out)
        hold_p99 = lag_report(probes, phases, report)
        if args.gc_trace:
            gc_report(directory / "gc.txt", probes, phases, report)
        per_stream = report.pop("_per_stream")
        opened = report["open_streams_at_peak"]
        report["bench_wall_s"] = round(time.monotonic() - t_start, 1)
        report["target_streams_open"] = (
            f"{'PASS' if opened >= args.streams else 'MISS'} "
            f"({opened} of {args.streams} open at the peak)"
        )
        report["target_kb_per_stream"] = (
            f"{'PASS' if per_stream < TARGET_KB_PER_STREAM else 'MISS'} "
            f"({per_stream:.2f} KB < {TARGET_KB_PER_STREAM:.0f} KB)"
        )
        report["target_lag_p99_hold"] = (
            f"{'PASS' if hold_p99 < TARGET_LAG_P99_MS else 'MISS'} "
            f"({hold_p99:.2f} ms < {TARGET_LAG_P99_MS:.0f} ms)"
        )
        for key, value in report.items():
            print(f"{key}: {value}")
        if args.keep_dir:
            print(f"kept: {directory}")
        return 0
    finally:
        if probe is not None:
            procs.kill(probe)
        if router is not None:
            procs.stop(router, 30)
        if fleet is not None:
            fleet.stop()
        if not args.keep_dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
