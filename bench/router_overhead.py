"""Router overhead: narwhal-serve, vllm-router and sglang-router against the client doing P/D.

Two simulated engines with zero step latency (every step sleeps 0 s): e0 prefills, e1 decodes.
First the load client alone is measured against one engine (plain completions on e1, no P/D, no
router), at concurrency 1 and ``--concurrency``: its requests/s and CPU per request bound what
the client can show of any router. Then, in one run, for streamed (16 tokens, ``ignore_eos``,
``stream_options.include_usage``) and non-streamed (16 tokens) completions, four targets:

- ``direct``: the client runs the P/D protocol itself (prefill leg on e0 with ``max_tokens: 1``
  and ``kv_transfer_params.do_remote_decode``, then the decode leg on e1 with the
  ``kv_transfer_params`` e0 returned, streamed or not as the client asked). This is the latency
  of the two legs without a router;
- ``narwhal``: ``narwhal-serve`` as a subprocess;
- ``vllm_router``: ``vllm-router --vllm-pd-disaggregation --policy round_robin`` as a
  subprocess (the Rust router runs inside the Python launcher's process; the process tree is
  measured and the process that listens on the port is named in the output);
- ``sglang_router``: ``smg launch --pd-disaggregation --policy round_robin`` (sglang-router,
  Rust, inside its Python launcher's process, measured the same way). It speaks SGLang's P/D
  protocol: it sends the whole request to the prefill and the decode engine at once, with
  ``bootstrap_*`` fields the simulated engines ignore, and relays the decode engine's answer.
  Without ``kv_transfer_params`` the decode engine prefills the prompt itself (at zero cost
  here), so the engines' work differs from the other targets; the router's does not: two
  upstream requests per client request and one relayed response.

Router CPU is read from ``/proc/<pid>/stat`` (utime + stime, which covers every thread of the
process) summed over the router's whole process tree, before and after the measured requests.
Each block is read once the routers and the engines are idle again (``Meter.settle``, at most
five seconds; the median and longest wait are printed): a narwhal-serve whose index follows the
engines' KV events applies a block's last events after its last answer, and those belong to that
block, not to the next (another target's, or its own). What a router spends during the other
targets' blocks, net of its idle rate, is printed per request as
``*_cpu_ms_per_request_routed_by_others``: for narwhal-serve with ``--kv-events``, the events of
requests it did not route, which each replica of a fleet of several applies for every other
replica's requests. In the A/B mode (``--ab-routing``: two narwhal-serve processes), CPU is read
from the scheduler's nanosecond run time of each router's threads
(``/proc/<pid>/task/<tid>/schedstat``) instead, with both routers pinned to one CPU and the
engines and the client to the others, over ``--rounds`` pairs of fresh router processes (two
processes of the same code differ by a few percent: the interval resamples rounds as well as
blocks; each process's environment is padded by a random length and the start order alternates,
so that layout differences between A's and B's command lines fall at random rather than the same
way every round). With ``--instructions`` (A/B mode) the routers run under valgrind's callgrind
and a block's cost is the instructions the router executed in it (``callgrind_control -d``): a
count the machine's load does not move, of user space only, about 50 times slower (a few hundred
requests; the routers' periodic probes are set to an hour).
Latency is measured end to end by the client at concurrency 1 (after a warmup), in blocks that
rotate over the three targets so drift hits all of them alike; "added" latency is the router's
percentile minus direct's percentile. Requests/s is measured at concurrency 1 and at
``--concurrency`` (32 by default). Every ratio is narwhal / the peer: router CPU per request,
added p50 and p99 latency, and requests/s. ``*_share_c1_over_35ms`` is the share of concurrency-1
requests slower than 35 ms: a router that leaves Nagle on would show there the 40 ms delayed-ACK
stall per streamed response. The client is raw asyncio streams (uvloop when available) over
pooled keep-alive HTTP/1.1 connections with ``TCP_NODELAY``; its own CPU per request is printed
(against direct it pays for both legs). Only 127.0.0.1 is contacted.

    .venv/bin/python bench/router_overhead.py [--requests N] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from narwhal.engines.legs import prefill_leg_body
from narwhal.serve.cli import serve_command
from narwhal.simengine.fleet import local_fleet_document
from narwhal.simengine.vocab import Vocabulary
from narwhal.testing import aio, procfs, procs
from narwhal.testing.fleet import SimFleet
from narwhal.testing.ports import free_ports
from narwhal.testing.procfs import total_cpu_seconds
from narwhal.testing.provenance import source_state
from narwhal.testing.rawhttp import connect, read_head
from narwhal.testing.routers import peer_router_command, router_ready
from narwhal.testing.stats import percentile

MODEL = "moonshotai/Kimi-K3"
TOKENS = 16
ZERO_LATENCY = {
    "time_scale": 1,
    "prefill_a": 0,
    "prefill_b": 0,
    "prefill_c": 0,
    "decode_intercept": 0,
    "decode_slope": 0,
    "decode_ctx_coef": 0,
}
PROMPT = (
    "Summarise the following notes about narwhals in one paragraph: they live in Arctic waters, "
    "the males grow a long spiral tusk, they dive deep for halibut and squid, and they travel in "
    "pods that may number in the hundreds during the summer migration."
)
TARGETS = ("direct", "narwhal", "vllm_router", "sglang_router")
VOCABULARY = Vocabulary(0)  # the simulated engines' (their default vocab_seed)
ROUTERS = ("narwhal", "vllm_router", "sglang_router")
PEERS = ("vllm_router", "sglang_router")
STALL_MS = 35.0
# Meter.settle: a router is idle when it used under this share of a core over a window.
SETTLE_WINDOW_S = 0.05
SETTLE_IDLE_SHARE = 0.04
SETTLE_MAX_S = 5.0
MODES = ("streamed", "nonstreamed")
REQUEST_TIMEOUT_S = 30.0
LATENCY_BLOCK = 25


# --------------------------------------------------------------------------------------------
# A small HTTP/1.1 client on asyncio streams: keep-alive pool, Content-Length and chunked bodies.


class HTTPError(Exception):
    pass


class _StaleConnection(Exception):
    """A pooled connection the server had closed: nothing of the request was answered."""


class Pool:
    def __init__(self) -> None:
        self._idle: dict[int, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._all: list[asyncio.StreamWriter] = []

    async def _get(
        self, port: int, fresh: bool = False
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """A connection to ``port`` and whether it was idle in the pool (not ``fresh``)."""
        idle = self._idle.setdefault(port, [])
        while idle and not fresh:
            reader, writer = idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer, True
        reader, writer = await connect(port)
        self._all.append(writer)
        return reader, writer, False

    async def post(
        self, port: int, path: str, body: bytes, request_id: str, stream: bool
    ) -> tuple[int, bytes]:
        try:
            return await self._post(port, path, body, request_id, stream, False)
        except _StaleConnection:
            # The server closed the idle connection as the request went out (its keep-alive
            # timeout: a router under callgrind waits out the other's blocks): once more, on
            # a new connection, as HTTP clients retry a request nothing was answered to.
            return await self._post(port, path, body, request_id, stream, True)

    async def _post(
        self, port: int, path: str, body: bytes, request_id: str, stream: bool, fresh: bool
    ) -> tuple[int, bytes]:
        reader, writer, reused = await self._get(port, fresh)
        reusable = False
        try:
            writer.write(
                (
                    f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Accept: {'text/event-stream' if stream else 'application/json'}\r\n"
                    f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode()
                + body
            )
            try:
                status, headers = await read_head(reader)
            except (ConnectionResetError, asyncio.IncompleteReadError) as exc:
                if not reused:
                    raise
                raise _StaleConnection from exc
            if headers.get(b"transfer-encoding") == b"chunked":
                parts = []
                for _ in range(1_000_000):
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        for _ in range(100):  # trailers, then the empty line
                            if await reader.readuntil(b"\r\n") == b"\r\n":
                                break
                        break
                    parts.append((await reader.readexactly(size + 2))[:-2])
                else:
                    raise HTTPError("too many chunks")
                content = b"".join(parts)
            elif b"content-length" in headers:
                content = await reader.readexactly(int(headers[b"content-length"]))
            else:
                raise HTTPError(f"unframed response from :{port} ({status})")
            reusable = headers.get(b"connection") != b"close"
            return status, content
        finally:
            if reusable:
                self._idle.setdefault(port, []).append((reader, writer))
            else:
                writer.close()

    async def aclose(self) -> None:
        for writer in self._all:
            writer.close()
        for writer in self._all:
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def client_body(
    index: int, stream: bool, prompt_tokens: int = 0, shared_fraction: float = 0.9
) -> dict[str, Any]:
    """The request: the short text prompt, or (``prompt_tokens``) token ids whose first
    ``shared_fraction`` every request shares (a long common prefix, as agentic traffic has: the
    router's prefix index finds it on the engines) and whose tail is the request's own."""
    prompt: str | list[int] = f"[{index}] {PROMPT}"
    if prompt_tokens:
        shared = int(prompt_tokens * shared_fraction)
        prompt = [300 + (k * 37) % 9000 for k in range(shared)] + [
            300 + (index * 7919 + k * 13) % 9000 for k in range(prompt_tokens - shared)
        ]
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def check_completion(content: bytes, stream: bool, where: str) -> None:
    if stream:
        events = [ln[6:] for ln in content.split(b"\n") if ln.startswith(b"data: ")]
        if not events or events[-1] != b"[DONE]":
            raise HTTPError(f"{where}: stream did not end with [DONE]: {content[-300:]!r}")
        usage = None
        for data in events[:-1]:
            obj = orjson.loads(data)
            if "error" in obj:
                raise HTTPError(f"{where}: error event {obj}")
            if obj.get("usage"):
                usage = obj["usage"]
        if not usage or usage.get("completion_tokens") != TOKENS:
            raise HTTPError(f"{where}: usage {usage}")
    else:
        obj = orjson.loads(content)
        usage = obj.get("usage") or {}
        if usage.get("completion_tokens") != TOKENS or not obj.get("choices"):
            raise HTTPError(f"{where}: bad completion {content[:300]!r}")


@dataclass
class Endpoints:
    prefill_port: int
    decode_port: int
    ports: dict[str, int]  # router target -> port
    prompt_tokens: int = 0  # > 0: token-id prompts of this many tokens (--prompt-tokens)
    shared_fraction: float = 0.9  # of each prompt, the prefix every request shares


async def one_request(pool: Pool, ep: Endpoints, target: str, stream: bool, index: int) -> float:
    """One client request end to end; returns its latency in seconds."""
    body = client_body(index, stream, ep.prompt_tokens, ep.shared_fraction)
    if target == "sglang_router" and ep.prompt_tokens:
        # sglang-router 0.3.2 refuses token-id prompts (422: "prompt: data did not match any
        # variant of untagged enum StringOrArray"): the same ids as the engines' words.
        body["prompt"] = VOCABULARY.decode(body["prompt"])
    rid = f"bench-{target}-{index}"
    t0 = time.perf_counter()
    if target == "direct":
        prefill = prefill_leg_body(body, chat=False)
        status, content = await pool.post(
            ep.prefill_port, "/v1/completions", orjson.dumps(prefill), rid, False
        )
        if status != 200:
            raise HTTPError(f"direct prefill: HTTP {status}: {content[:300]!r}")
        params = orjson.loads(content).get("kv_transfer_params")
        if not params:
            raise HTTPError("direct prefill: no kv_transfer_params")
        decode = dict(body)
        decode["kv_transfer_params"] = params
        status, content = await pool.post(
            ep.decode_port, "/v1/completions", orjson.dumps(decode), rid, stream
        )
    elif target == "engine_alone":
        # The client alone against one engine: a plain completion, no P/D, no router.
        status, content = await pool.post(
            ep.decode_port, "/v1/completions", orjson.dumps(body), rid, stream
        )
    else:
        status, content = await pool.post(
            ep.ports[target], "/v1/completions", orjson.dumps(body), rid, stream
        )
    latency = time.perf_counter() - t0
    if status != 200:
        raise HTTPError(f"{target}: HTTP {status}: {content[:300]!r}")
    check_completion(content, stream, target)
    return latency


_counter = itertools.count()


async def run_load(
    pool: Pool, ep: Endpoints, target: str, stream: bool, n: int, concurrency: int
) -> list[float]:
    latencies: list[float] = []
    remaining = [n]

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            latencies.append(
                await asyncio.wait_for(
                    one_request(pool, ep, target, stream, next(_counter)), REQUEST_TIMEOUT_S
                )
            )

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return latencies


# --------------------------------------------------------------------------------------------
# Measurement


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    requests: int = 0
    router_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    router_wakeups: int = 0  # the router's voluntary context switches
    # Per measured block, in order: (router CPU seconds, requests), for paired comparisons.
    blocks: list[tuple[float, int]] = field(default_factory=list)
    # The A/B mode's rounds (fresh router processes each): the blocks of each.
    rounds: list[list[tuple[float, int]]] = field(default_factory=list)

    def merge(self, other: Tally) -> None:
        """``other``, a round of its own, added to this one."""
        self.latencies += other.latencies
        self.wall_s += other.wall_s
        self.requests += other.requests
        self.router_cpu_s += other.router_cpu_s
        self.engine_cpu_s += other.engine_cpu_s
        self.client_cpu_s += other.client_cpu_s
        self.router_wakeups += other.router_wakeups
        self.rounds.append(other.blocks)


class CallgrindCounter:
    """The instructions a router under callgrind (``--instructions``) has executed, in
    billions, as a running total: each read dumps the counts since the last dump
    (``callgrind_control -d``: a dump zeroes them) and adds the dump's ``summary``. A count of
    instructions does not move with the machine's load, its frequency or a neighbour's cache
    traffic, which make two runs of the same code differ by several percent in CPU time; it
    leaves out the kernel's share (the same system calls on both sides of an A/B pair)."""

    def __init__(self, directory: Path, keep: bool = False) -> None:
        self.directory = directory
        self.keep = keep  # the dumps, for callgrind_annotate (--keep-dir)
        self.totals: dict[int, float] = {}

    @staticmethod
    def command(directory: Path, target: str) -> list[str]:
        return [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={directory}/{target}.callgrind.%p",
            "--dump-line=no",
        ]

    def read(self, pids: list[int]) -> float:
        for pid in pids:
            self.totals[pid] = self.totals.get(pid, 0.0) + self._dump(pid) / 1e9
        return sum(self.totals.get(pid, 0.0) for pid in pids)

    def _dump(self, pid: int) -> int:
        try:
            if "callgrind" not in os.readlink(f"/proc/{pid}/exe"):
                return 0  # a process of the tree that valgrind does not run (none expected)
        except OSError:
            return 0  # gone
        files = list(self.directory.glob(f"*.callgrind.{pid}.*"))
        done = subprocess.run(
            ["callgrind_control", "-d", str(pid)], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0 or "OK" not in done.stdout:
            raise RuntimeError(f"callgrind_control -d {pid}: {done.stdout}{done.stderr}")
        dumps = sorted(self.directory.glob(f"*.callgrind.{pid}.*"), key=lambda f: int(f.suffix[1:]))
        if len(dumps) != len(files) + 1:
            raise RuntimeError(f"callgrind wrote {len(dumps) - len(files)} dumps for {pid}")
        for line in dumps[-1].read_text().splitlines():
            if line.startswith("summary:"):
                if not self.keep:
                    dumps[-1].write_bytes(b"")  # read: its name is kept, to number the next
                return int(line.split()[1])
        raise RuntimeError(f"no summary in {dumps[-1]}")


class Meter:
    """CPU readings around a block. ``run_time``: the routers' CPU from the scheduler's
    nanosecond count of their live threads (``procfs.run_time_seconds``), for the A/B mode's
    single-process routers, where the 10 ms ticks of ``/proc/<pid>/stat`` would blur a block
    of a few dozen requests by a sixth."""

    def __init__(
        self,
        router_pids: dict[str, list[int]],
        engine_pids: list[int],
        run_time: bool = False,
        instructions: CallgrindCounter | None = None,
    ) -> None:
        self.router_pids = router_pids
        self.engine_pids = engine_pids
        self.router_cpu: Any = procfs.run_time_seconds if run_time else total_cpu_seconds
        if instructions is not None:
            self.router_cpu = instructions.read
        # Per router: (CPU seconds, wall seconds, requests) over the blocks of the other
        # targets: what it spends on requests it did not route (the KV events of the engines
        # it follows), its idle loops included.
        self.foreign: dict[str, list[float]] = {t: [0.0, 0.0, 0] for t in router_pids}
        self._read_foreign = instructions is None
        self.settle_s: list[float] = []  # how long each block took to settle (inf: never)

    async def settle(self) -> None:
        """Wait (at most ``SETTLE_MAX_S``) until every router is idle: a router that follows
        the engines' KV events applies those of a block's last requests after the load ends,
        which belong to that block, and would otherwise land in the next block, another
        target's or its own. Each block is read after it settles and starts settled: its CPU is
        its own requests' work (the events of requests routed by another target, which a
        narwhal-serve replica also applies in a fleet of several, are reported apart)."""
        # The engines too: one still publishing the block's last events is not done with it.
        pids = [pid for group in self.router_pids.values() for pid in group]
        pids += self.engine_pids
        last = procfs.run_time_seconds(pids)
        started = time.perf_counter()
        while time.perf_counter() - started < SETTLE_MAX_S:
            await asyncio.sleep(SETTLE_WINDOW_S)
            now = procfs.run_time_seconds(pids)
            if now - last < SETTLE_IDLE_SHARE * SETTLE_WINDOW_S:
                self.settle_s.append(time.perf_counter() - started)
                return
            last = now
        self.settle_s.append(math.inf)

    def snapshot(self, target: str) -> tuple[float, float, float, float, float]:
        pids = self.router_pids.get(target, [])
        router = self.router_cpu(pids)
        engines = total_cpu_seconds(self.engine_pids)
        wakeups = procfs.voluntary_switches(pids)
        return (time.perf_counter(), router, engines, time.process_time(), wakeups)

    async def block(self, tally: Tally, target: str, load: Awaitable[list[float]], n: int) -> None:
        """One block of ``n`` requests against ``target`` (``load``), read settled: its wall
        time ends with its last answer, its CPU once the routers are idle again."""
        others = [t for t, pids in self.router_pids.items() if t != target and pids]
        if not self._read_foreign:
            others = []
        others_before = [self.router_cpu(self.router_pids[t]) for t in others]
        before = self.snapshot(target)
        tally.latencies += await load
        ended = time.perf_counter()
        await self.settle()
        after = self.snapshot(target)
        Meter.add(tally, before, (ended, *after[1:]), n)
        for t, cpu in zip(others, others_before, strict=True):
            sums = self.foreign[t]
            sums[0] += self.router_cpu(self.router_pids[t]) - cpu
            sums[1] += after[0] - before[0]
            sums[2] += n

    @staticmethod
    def add(tally: Tally, before: tuple[float, ...], after: tuple[float, ...], n: int) -> None:
        tally.wall_s += after[0] - before[0]
        tally.router_cpu_s += after[1] - before[1]
        tally.engine_cpu_s += after[2] - before[2]
        tally.client_cpu_s += after[3] - before[3]
        tally.router_wakeups += int(after[4] - before[4])
        tally.requests += n
        tally.blocks.append((after[1] - before[1], n))


async def measure(
    ep: Endpoints,
    meter: Meter,
    requests: int,
    concurrency: int,
    warmup: int,
    targets: tuple[str, ...] = TARGETS,
    throughput_block: int | None = None,
    throughput_requests: int | None = None,
) -> dict[tuple[str, str, str], Tally]:
    """(mode, target, phase) -> Tally, phase "c1" (latency) or "cN" (throughput). The
    throughput phase runs each target's requests (``throughput_requests``, default
    ``requests``) in one go, or (``throughput_block``) in blocks of that many rotating over the
    targets like the latency phase."""
    out: dict[tuple[str, str, str], Tally] = {}
    pool = Pool()
    try:
        # The load client alone against one engine, before anything else.
        for mode in MODES if "direct" in targets else ():
            stream = mode == "streamed"
            await run_load(pool, ep, "engine_alone", stream, warmup, 1)
            for phase, conc in (("c1", 1), ("cN", concurrency)):
                tally = out.setdefault((mode, "engine_alone", phase), Tally())
                load = run_load(pool, ep, "engine_alone", stream, requests, conc)
                await meter.block(tally, "engine_alone", load, requests)
        for mode in MODES:
            stream = mode == "streamed"
            for target in targets:
                await run_load(pool, ep, target, stream, warmup, 1)
                await run_load(pool, ep, target, stream, 2 * concurrency, concurrency)
            # Concurrency 1 in blocks rotating over the targets (so drift hits all alike), then
            # throughput at --concurrency.
            for phase, conc, size, total in (
                ("c1", 1, LATENCY_BLOCK, requests),
                (
                    "cN",
                    concurrency,
                    throughput_block or throughput_requests or requests,
                    throughput_requests or requests,
                ),
            ):
                for b in range(math.ceil(total / size)):
                    n = min(size, total - b * size)
                    for k in range(len(targets)):
                        target = targets[(b + k) % len(targets)]
                        tally = out.setdefault((mode, target, phase), Tally())
                        load = run_load(pool, ep, target, stream, n, conc)
                        await meter.block(tally, target, load, n)
    finally:
        await pool.aclose()
    return out


def versions() -> str:
    out = []
    for dist in ("narwhal", "vllm-router", "sglang-router", "httpx", "uvicorn", "uvloop"):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} absent")
    return ", ".join(out)


def describe(pid: int) -> str:
    return f"{pid} ({procfs.process_name(pid)}, {procfs.thread_count(pid)} threads)"


def per_req_ms(seconds: float, tally: Tally) -> float:
    return seconds / tally.requests * 1000


def report(
    results: dict[tuple[str, str, str], Tally], args: argparse.Namespace, info: dict[str, Any]
) -> list[tuple[str, str]]:
    c = args.concurrency
    rows: list[tuple[str, str]] = []

    def add(name: str, value: str | float) -> None:
        rows.append((name, value if isinstance(value, str) else fmt(value)))

    def pct(mode: str, target: str, q: float, phase: str = "c1") -> float:
        return percentile(results[(mode, target, phase)].latencies, q) * 1000

    def added(mode: str, target: str, q: float) -> float:
        return pct(mode, target, q) - pct(mode, "direct", q)

    def cpu(mode: str, target: str, phase: str) -> float:
        tally = results[(mode, target, phase)]
        return per_req_ms(tally.router_cpu_s, tally)

    def rps(mode: str, target: str, phase: str) -> float:
        tally = results[(mode, target, phase)]
        return tally.requests / tally.wall_s

    def ratio(a: float, b: float) -> str:
        # An added latency at or below 0 (noise around direct's) has no meaningful ratio.
        return f"{a / b:.2f}" if b > 0 else f"n/a (peer {fmt(b)})"

    argv = " ".join(sys.argv[1:])
    add("command", f".venv/bin/python bench/router_overhead.py {argv}".rstrip())
    add("cpus", str(os.cpu_count()))
    add("load_average_at_start", info["loadavg"])
    add("requests_per_target_mode_phase", str(args.requests))
    add("warmup_per_target_mode", f"{args.warmup} at c1 + {2 * c} at c{c}")
    add("throughput_concurrency", str(c))
    prompt = (
        f"{args.prompt_tokens} token ids, {args.shared_fraction:.0%} shared (to sglang_router as"
        " words: it refuses ids)"
        if args.prompt_tokens
        else "short text"
    )
    add("prompt", prompt)
    add(
        "narwhal_prefix_index",
        "fed by the engines' KV events" if args.kv_events else "fed by its routing history",
    )
    add("engines", f"e0 prefill {info['prefill_url']}, e1 decode {info['decode_url']}, steps 0 s")
    client = "raw asyncio streams" + (" + uvloop" if aio.UVLOOP else "")
    add("client", f"{client}, keep-alive HTTP/1.1, TCP_NODELAY, orjson")
    add("cpu_source", f"/proc/<pid>/stat utime+stime+cutime+cstime, {procfs.CLK_TCK} ticks/s")
    add("versions", info["versions"])
    add("source", info["source"])
    for target in ROUTERS:
        add(f"{target}_pids", info["pids"][target])
    if any(info["late"].values()):
        add("processes_started_during_run_not_measured", str(info["late"]))
    for target in ROUTERS:
        add(f"{target}_idle_cpu_ms_per_s", info["idle"][target])
    # A router's CPU per request routed by the others (net of its idle rate): what following
    # the engines' KV events costs it for requests it did not route (each replica of a fleet
    # of several pays it for every other replica's requests). Not in its own figures: each
    # block is read once every router is idle again (Meter.settle).
    for target in ROUTERS:
        cpu_s, wall_s, n = info["foreign"].get(target, (0.0, 0.0, 0))
        if n:
            net_ms = cpu_s * 1000 - info["idle"][target] * wall_s
            add(f"{target}_cpu_ms_per_request_routed_by_others", net_ms / n)
    settled = sorted(info["settles"])
    if settled:
        add(
            "blocks_settled_s_median_max",
            f"{percentile(settled, 50):.3f} / {settled[-1]:.3f} ({len(settled)} blocks)",
        )
    add("bench_wall_s", info["elapsed"])
    # The load client alone against the decode engine (plain completions, no P/D).
    for mode in MODES:
        p = f"client_alone_engine_{mode}"
        for phase, label in (("c1", "c1"), ("cN", f"c{c}")):
            tally = results[(mode, "engine_alone", phase)]
            add(f"{p}_rps_{label}", rps(mode, "engine_alone", phase))
            add(f"{p}_p50_ms_{label}", pct(mode, "engine_alone", 50, phase))
            add(f"{p}_client_cpu_ms_per_req_{label}", per_req_ms(tally.client_cpu_s, tally))
            add(f"{p}_engine_cpu_ms_per_req_{label}", per_req_ms(tally.engine_cpu_s, tally))
    for mode in MODES:
        for target in TARGETS:
            t1, tn = results[(mode, target, "c1")], results[(mode, target, "cN")]
            p = f"{mode}_{target}"
            add(f"{p}_p50_ms", pct(mode, target, 50))
            add(f"{p}_p99_ms", pct(mode, target, 99))
            stalled = sum(1 for x in t1.latencies if x * 1000 > STALL_MS) / len(t1.latencies)
            add(f"{p}_share_c1_over_35ms", f"{stalled:.3f}")
            if target != "direct":
                add(f"{p}_added_p50_ms", added(mode, target, 50))
                add(f"{p}_added_p99_ms", added(mode, target, 99))
                add(f"{p}_router_cpu_ms_per_req_c1", cpu(mode, target, "c1"))
                add(f"{p}_router_cpu_ms_per_req_c{c}", cpu(mode, target, "cN"))
            add(f"{p}_rps_c1", rps(mode, target, "c1"))
            add(f"{p}_rps_c{c}", rps(mode, target, "cN"))
            add(f"{p}_p50_ms_c{c}", pct(mode, target, 50, "cN"))
            add(f"{p}_p99_ms_c{c}", pct(mode, target, 99, "cN"))
            add(f"{p}_engines_cpu_ms_per_req_c1", per_req_ms(t1.engine_cpu_s, t1))
            add(f"{p}_client_cpu_ms_per_req_c1", per_req_ms(t1.client_cpu_s, t1))
            add(f"{p}_client_cpu_ms_per_req_c{c}", per_req_ms(tn.client_cpu_s, tn))
    for mode in MODES:
        direct = results[(mode, "direct", "c1")]
        add(
            f"client_cpu_ms_per_req_against_direct_{mode}",
            f"{fmt(per_req_ms(direct.client_cpu_s, direct))} (c1, both legs)",
        )
    # Ratios, narwhal / each peer. The c1 CPU ratio (each request alone on the machine) is the
    # headline; it comes last.
    for mode in MODES:
        for peer in ("direct", *PEERS):
            for phase, label in (("c1", "c1"), ("cN", f"c{c}")):
                add(
                    f"ratio_rps_narwhal_over_{peer}_{mode}_{label}",
                    ratio(rps(mode, "narwhal", phase), rps(mode, peer, phase)),
                )
    for mode in MODES:
        for peer in PEERS:
            for q in (50, 99):
                add(
                    f"ratio_added_p{q}_narwhal_over_{peer}_{mode}",
                    ratio(added(mode, "narwhal", q), added(mode, peer, q)),
                )
    for phase, label in (("cN", f"_c{c}"), ("c1", "")):
        for mode in MODES:
            for peer in PEERS:
                add(
                    f"ratio_cpu_narwhal_over_{peer}_{mode}{label}",
                    ratio(cpu(mode, "narwhal", phase), cpu(mode, peer, phase)),
                )
    return rows


AB_TARGETS = ("narwhal", "narwhal_b")
AB_RESAMPLES = 4000
# The A/B mode pads each router's environment by a random length (see start_routers).
LAYOUT_PAD = "NARWHAL_BENCH_LAYOUT_PAD"
# The A/B mode's throughput phase runs this many times --requests: its blocks vary more than
# the latency phase's (how the chunks of concurrent streams fall into reads), and it is fast.
AB_THROUGHPUT_FACTOR = 4


def paired_ratio_interval(
    a: list[list[tuple[float, int]]], b: list[list[tuple[float, int]]], seed: int = 0
) -> tuple[float, float, float]:
    """CPU per request of ``a`` over ``b`` (sums over all blocks) and its 95% bootstrap
    interval. Each is a list of rounds, each round a list of blocks; block i of a round ran
    back to back in both (a pair shares the machine's state of the moment: its drift cancels
    in the pair), and each round ran on fresh router processes. The resampling is in two
    stages, rounds and then the block pairs within each: what differs between two processes
    of the same code (up to a few percent, steadily through a round) widens the interval
    instead of passing for an effect."""
    rounds = [list(zip(x, y, strict=True)) for x, y in zip(a, b, strict=True)]

    def ratio(sample: list[tuple[tuple[float, int], tuple[float, int]]]) -> float:
        return cpu_ratio([x for x, _ in sample], [y for _, y in sample])

    rng = random.Random(seed)
    draws = []
    for _ in range(AB_RESAMPLES):
        sample = []
        for pairs in rng.choices(rounds, k=len(rounds)):
            sample += rng.choices(pairs, k=len(pairs))
        draws.append(ratio(sample))
    draws.sort()
    whole = [pair for pairs in rounds for pair in pairs]
    return ratio(whole), draws[int(0.025 * AB_RESAMPLES)], draws[int(0.975 * AB_RESAMPLES) - 1]


def cpu_ratio(a: list[tuple[float, int]], b: list[tuple[float, int]]) -> float:
    """CPU per request over blocks ``a`` (CPU seconds, requests) over that of blocks ``b``."""
    cpu_a = sum(c for c, _ in a) / sum(n for _, n in a)
    cpu_b = sum(c for c, _ in b) / sum(n for _, n in b)
    return cpu_a / cpu_b if cpu_b > 0 else math.inf


def round_ratios(a: Tally, b: Tally) -> str:
    """A over B in each round, the spread the interval accounts for."""
    return " ".join(f"{cpu_ratio(x, y):.3f}" for x, y in zip(a.rounds, b.rounds, strict=True))


def report_ab(
    results: dict[tuple[str, str, str], Tally], args: argparse.Namespace, info: dict[str, Any]
) -> list[tuple[str, str]]:
    """narwhal-serve with the fleet's routing (``--fleet-routing``, A) against itself with
    ``--ab-routing`` (B): router CPU per request, A over B, with its interval."""
    c = args.concurrency
    rows: list[tuple[str, str]] = []

    def add(name: str, value: str | float) -> None:
        rows.append((name, value if isinstance(value, str) else fmt(value)))

    add("command", f".venv/bin/python bench/router_overhead.py {' '.join(sys.argv[1:])}")
    add("cpus", str(os.cpu_count()))
    add("load_average_at_start", info["loadavg"])
    add("a_routing", json.dumps(args.fleet_routing))
    add("b_routing", json.dumps(args.ab_routing))
    if args.a_arg:
        add("a_args", " ".join(args.a_arg))
    c1_requests = args.rounds * math.ceil(args.requests / args.rounds)
    add(
        "requests_per_target_and_mode",
        f"c1: {c1_requests}, c{c}: {AB_THROUGHPUT_FACTOR * c1_requests}",
    )
    add("blocks", f"c1: {LATENCY_BLOCK} requests, c{c}: {4 * c} requests, rotating A/B")
    cost = "router_cpu_ms"
    if args.instructions:
        cost = "router_minstr"
        add("cost_source", "callgrind's instruction count (Ir) of each router, user space only")
    else:
        add("cpu_source", "/proc/<pid>/task/<tid>/schedstat run time (ns) of the routers' threads")
    add("router_cpus", info["router_cpus"])
    add(
        "interval",
        f"95% bootstrap over rounds, then block pairs within them ({AB_RESAMPLES} resamples)",
    )
    add("rounds", f"{args.rounds} (fresh router processes each, one PYTHONHASHSEED per pair)")
    add("source", info["source"])
    for target in AB_TARGETS:
        add(f"{target}_pids", info["pids"][target])
        add(f"{target}_idle_cpu_ms_per_s", info["idle"][target])
    add("bench_wall_s", info["elapsed"])
    for mode in MODES:
        for phase, label in (("c1", "c1"), ("cN", f"c{c}")):
            a, b = results[(mode, "narwhal", phase)], results[(mode, "narwhal_b", phase)]
            p = f"{mode}_{label}"
            # In --instructions mode router_cpu_s holds billions of instructions.
            add(f"{p}_a_{cost}_per_req", per_req_ms(a.router_cpu_s, a))
            add(f"{p}_b_{cost}_per_req", per_req_ms(b.router_cpu_s, b))
            add(f"{p}_a_router_wakeups_per_req", a.router_wakeups / a.requests)
            add(f"{p}_b_router_wakeups_per_req", b.router_wakeups / b.requests)
            add(f"{p}_a_engine_cpu_ms_per_req", per_req_ms(a.engine_cpu_s, a))
            add(f"{p}_b_engine_cpu_ms_per_req", per_req_ms(b.engine_cpu_s, b))
            add(f"{p}_a_p50_ms", percentile(a.latencies, 50) * 1000)
            add(f"{p}_b_p50_ms", percentile(b.latencies, 50) * 1000)
            ratio, low, high = paired_ratio_interval(a.rounds, b.rounds)
            what = "instructions" if args.instructions else "cpu"
            add(f"ratio_{what}_a_over_b_{p}", f"{ratio:.3f} [{low:.3f}, {high:.3f}]")
            add(f"ratio_per_round_{p}", round_ratios(a, b))
    return rows


def ab_cpus(ab: bool) -> set[int] | None:
    """The CPU both routers of the A/B mode run on, alone (the engines and the client get the
    others), or None (not the A/B mode, or one CPU). Unpinned, two identical routers differ by
    up to 7% in CPU per request, steadily through a run (an A/A run, ``--ab-routing '{}'``,
    showed 0.93 and 1.06 with intervals that exclude 1): where the scheduler happens to place a
    router against the engines it waits on is a property of the process, not of its code."""
    cpus = sorted(os.sched_getaffinity(0))
    return {cpus[0]} if ab and len(cpus) > 1 else None


def fmt(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 1000 else f"{x:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=1000, help="measured requests per target, mode and phase"
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="concurrency of the throughput phase"
    )
    parser.add_argument(
        "--warmup", type=int, default=30, help="warmup requests per target and mode"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="token-id prompts of this many tokens (default: a short text prompt)",
    )
    parser.add_argument(
        "--shared-fraction",
        type=float,
        default=0.9,
        help="of each token-id prompt, the prefix every request shares (the rest is its own:"
        " new KV blocks, and with --kv-events new events, per request)",
    )
    parser.add_argument("--keep-dir", action="store_true", help="keep the logs and journal")
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="the engines publish KV events (vLLM's --kv-events-config) and narwhal-serve's"
        " prefix index follows them (otherwise it learns from its routing history)",
    )
    parser.add_argument(
        "--fleet-routing",
        type=json.loads,
        default={},
        help='the fleet\'s "routing" section (JSON), e.g. migration and hedging off: '
        '\'{"migration": {"limit": 0}, "hedge": {"enabled": false}}\'',
    )
    parser.add_argument(
        "--ab-routing",
        type=json.loads,
        default=None,
        help="A/B mode: narwhal-serve with --fleet-routing (A) against a second narwhal-serve"
        " whose fleet's routing is this JSON (B), in blocks rotating between them at c1 and"
        " at --concurrency, and nothing else; prints A's router CPU per request over B's with"
        " a 95%% interval. Migration and hedging's cost:"
        ' --ab-routing \'{"migration": {"limit": 0}, "hedge": {"enabled": false}}\'',
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="A/B mode: fresh router processes this many times, --requests split over them",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="A/B mode: the routers run under valgrind's callgrind and their cost is the"
        " instructions they execute per request (deterministic, but the kernel's share left"
        " out) instead of their CPU time; about 50 times slower: a few hundred --requests",
    )
    parser.add_argument(
        "--narwhal-arg",
        action="append",
        default=[],
        help="extra narwhal-serve argument (repeatable): --narwhal-arg=--engine-transport=httpx",
    )
    parser.add_argument(
        "--a-arg",
        action="append",
        default=[],
        help="A/B mode: extra narwhal-serve argument for A only (repeatable), e.g. replica"
        " coordination on against off: --a-arg=--coordination=etcd://127.0.0.1:2379"
        " --a-arg=--replica-id=a (bench/replicas.py does this)",
    )
    args = parser.parse_args()
    if args.a_arg and args.ab_routing is None:
        parser.error("--a-arg needs --ab-routing")
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--requests, --concurrency and --rounds must be positive")
    ab = args.ab_routing is not None
    if args.instructions and not ab:
        parser.error("--instructions needs --ab-routing")
    if args.instructions and not shutil.which("callgrind_control"):
        print("valgrind is not installed (make bench-deps-valgrind)", file=sys.stderr)
        return 2
    bins: dict[str, Path] = {}
    for name in () if ab else ("vllm-router", "smg"):
        path = Path(sys.executable).parent / name
        if not path.exists():
            found = shutil.which(name)
            if not found:
                print(f"{name} is not installed (pip install -e '.[dev]')", file=sys.stderr)
                return 2
            path = Path(found)
        bins[name] = path

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    directory = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    fleet: SimFleet | None = None
    started: dict[str, subprocess.Popen[bytes]] = {}
    loadavg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        ports = free_ports(14)
        doc = local_fleet_document(
            ports[0:2],
            ports[2:4],
            sim=dict(ZERO_LATENCY),
            # Both engines publish their KV events and narwhal-serve's index follows them.
            kv_event_ports=[(ports[10], ports[11]), (ports[12], ports[13])]
            if args.kv_events
            else None,
            routing=args.fleet_routing,
        )
        fleet_path = directory / "fleet.json"
        fleet_path.write_text(json.dumps(doc, indent=2))
        router_cpus = ab_cpus(ab)
        if router_cpus is not None:
            # The engines (started below) and the client inherit the other CPUs.
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - router_cpus)
        fleet = SimFleet(fleet_path, log_dir=directory / "logs")
        fleet.start(timeout=90)
        prefill_url, decode_url = fleet.engines["e0"].url, fleet.engines["e1"].url
        engine_pids = [e.process.pid for e in fleet.engines.values() if e.process]

        ports_of = {
            "narwhal": ports[4],
            "vllm_router": ports[5],
            "sglang_router": ports[7],
            "narwhal_b": ports[9],
        }
        logs = {t: directory / f"{t}.log" for t in ports_of}

        def start_narwhal(target: str, fleet_file: Path, env: dict[str, str] | None) -> None:
            under: list[str] = []
            quiet: tuple[str, ...] = ()
            if args.instructions:
                under = CallgrindCounter.command(directory, target)
                # The periodic probes and scrapes run on the clock, not per request: under
                # callgrind a block lasts ~50 times longer, and their instructions would land
                # in whichever router's block they fall in.
                quiet = ("--health-interval", "3600", "--scrape-interval", "3600")
            started[target] = procs.start(
                under
                + serve_command(
                    fleet_file,
                    ports_of[target],
                    directory / f"{target}-journal.jsonl",
                    "--skip-qualification",
                    "--log-level",
                    "info",
                    *quiet,
                    *args.narwhal_arg,
                    *(args.a_arg if target == "narwhal" else ()),
                ),
                logs[target],
                env=env,
                append=False,
                preexec_fn=None
                if router_cpus is None
                else functools.partial(os.sched_setaffinity, 0, router_cpus),
            )

        # The A/B mode's B: the same fleet (same engines) but for its routing section.
        b_path = directory / "fleet-b.json"
        if ab:
            b_path.write_text(json.dumps({**doc, "routing": args.ab_routing}, indent=2))

        def start_routers(round_index: int) -> None:
            if ab:
                # One hash seed for both routers of a round, a new one each round: the layout of
                # their dicts and sets is shared within a pair, and varied across rounds.
                seed = str(random.Random(round_index).randrange(2**32))
                # Each router's environment is padded by a length drawn anew for every process:
                # the environment's size sets where the C stack starts within its page, and a
                # fixed difference between A's and B's (A's longer --a-arg command line) would
                # shift their alignment the same way in every round: a bias of a few percent
                # that no number of rounds would average out. The start order alternates for
                # the same reason.
                order = [("narwhal", fleet_path), ("narwhal_b", b_path)]
                for target, fleet_file in order if round_index % 2 == 0 else order[::-1]:
                    pad = random.Random(f"{round_index}:{target}").randrange(4096)
                    env = {**os.environ, "PYTHONHASHSEED": seed, LAYOUT_PAD: "x" * pad}
                    start_narwhal(target, fleet_file, env)
            else:
                start_narwhal("narwhal", fleet_path, None)
                started["vllm_router"] = procs.start(
                    peer_router_command(
                        bins["vllm-router"], [prefill_url], [decode_url], ports_of["vllm_router"],
                        ports[6], log_level="info",
                    ),
                    logs["vllm_router"],
                    append=False,
                )  # fmt: skip
                started["sglang_router"] = procs.start(
                    peer_router_command(
                        bins["smg"], [prefill_url], [decode_url], ports_of["sglang_router"],
                        ports[8], log_level="info", sglang=True,
                    ),
                    logs["sglang_router"],
                    append=False,
                )  # fmt: skip
            for target, proc in started.items():
                url = f"http://127.0.0.1:{ports_of[target]}"
                procs.wait_ready(
                    functools.partial(router_ready, url, peer=target in PEERS),
                    600 if args.instructions else 60,
                    process=proc,
                    name=url,
                    log=logs[target],
                )

        ep = Endpoints(
            int(prefill_url.rsplit(":", 1)[1]),
            int(decode_url.rsplit(":", 1)[1]),
            ports_of,
            args.prompt_tokens,
            args.shared_fraction,
        )
        rounds = args.rounds if ab else 1
        per_round = math.ceil(args.requests / rounds)
        results: dict[tuple[str, str, str], Tally] = {}
        late: dict[str, list[int]] = {}
        pids_info: dict[str, str] = {}
        idle: dict[str, float] = {}
        elapsed = 0.0
        foreign: dict[str, list[float]] = {}
        settles: list[float] = []
        for round_index in range(rounds):
            start_routers(round_index)
            router_pids = {t: procfs.descendants(p.pid) for t, p in started.items()}
            for target in started:
                listener = procfs.listening_pid(ports_of[target], router_pids[target])
                if listener is None:
                    raise RuntimeError(f"could not find the process listening for {target}")
                pids_info[target] = f"{router_pids[target]} listener {describe(listener)}"
            counter = CallgrindCounter(directory, args.keep_dir) if args.instructions else None
            meter = Meter(router_pids, engine_pids, run_time=ab, instructions=counter)
            if round_index == 0:
                # Idle cost of each router (health probes, scrapes, timers) with no requests.
                idle_s = 3.0
                idle_before = {t: total_cpu_seconds(p) for t, p in router_pids.items()}
                time.sleep(idle_s)  # the idle window measured, not a wait
                idle = {
                    t: (total_cpu_seconds(p) - idle_before[t]) / idle_s * 1000
                    for t, p in router_pids.items()
                }
            t_start = time.perf_counter()
            coro = (
                measure(
                    ep,
                    meter,
                    per_round,
                    args.concurrency,
                    args.warmup,
                    AB_TARGETS,
                    4 * args.concurrency,
                    AB_THROUGHPUT_FACTOR * per_round,
                )
                if ab
                else measure(ep, meter, per_round, args.concurrency, args.warmup)
            )
            for key, tally in aio.run(coro).items():
                results.setdefault(key, Tally()).merge(tally)
            settles += meter.settle_s
            for t, sums in meter.foreign.items():
                acc = foreign.setdefault(t, [0.0, 0.0, 0])
                acc[:] = [a + b for a, b in zip(acc, sums, strict=True)]
            elapsed += time.perf_counter() - t_start
            # Processes started during the run (none expected) are reported, not silently
            # missed.
            for t, proc in started.items():
                late.setdefault(t, []).extend(
                    sorted(set(procfs.descendants(proc.pid)) - set(router_pids[t]))
                )
            if round_index + 1 < rounds:
                for proc in started.values():
                    procs.stop(proc)
                started.clear()

        info = {
            "prefill_url": prefill_url,
            "decode_url": decode_url,
            "loadavg": loadavg,
            "versions": versions(),
            "source": source_state(Path(__file__).resolve().parent.parent),
            "pids": pids_info,
            "late": late,
            "idle": idle,
            "foreign": foreign,
            "settles": settles,
            "elapsed": elapsed,
            "router_cpus": "unpinned" if router_cpus is None else str(sorted(router_cpus)),
        }
        rows = report_ab(results, args, info) if ab else report(results, args, info)
        for name, value in rows:
            print(f"{name}: {value}")
        if args.keep_dir:
            print(f"kept: {directory}")
        return 0
    finally:
        for proc in started.values():
            procs.stop(proc)
        if fleet is not None:
            fleet.stop()
        if not args.keep_dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
