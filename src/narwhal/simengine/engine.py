"""The simulated engine's core: continuous batching over a fixed KV block pool, the
NixlConnector producer/consumer roles, and deterministic tokens, with no HTTP in sight.

Each step advances every running sequence by one token and prefills up to
``max_num_batched_tokens`` prompt tokens (chunked, first come first served), then sleeps for the
step's modelled duration. A prefill leg (``do_remote_decode``) keeps its prompt's blocks after
it finishes and hands out ``kv_transfer_params``; the blocks are freed when the reader's NIXL
notification arrives or, if nobody pulls them, when the lease expires. A decode leg
(``do_remote_prefill``) pulls those blocks over NIXL, verifies every byte against the prompt,
and only then decodes: it never emits a token from KV it could not verify.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from narwhal.profiles.models import EngineModels
from narwhal.routing.prefix import chain_keys, chain_root, extend_chain
from narwhal.simengine.faults import FaultSettings
from narwhal.simengine.generation import ContextChain, GenerationModel, KVLayout
from narwhal.simengine.kv_blocks import BlockPool
from narwhal.simengine.kv_events import KVEventPublisher
from narwhal.simengine.kv_transfer import KVPeerInfo, KVTransferAgent, KVTransferError
from narwhal.simengine.metrics import EngineMetrics
from narwhal.simengine.side_channel import PeerDirectory
from narwhal.simengine.timing import CALIBRATION

__all__ = [
    "EngineConfig",
    "EngineCore",
    "ErrorEvent",
    "RemoteKV",
    "RequestKind",
    "SimRequest",
    "TokenEvent",
    "parse_kv_transfer_params",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

CRASH_EXIT_CODE = 137


class RequestKind(enum.Enum):
    LOCAL = "local"
    PRODUCER = "producer"  # prefill leg: do_remote_decode
    CONSUMER = "consumer"  # decode leg: do_remote_prefill


@dataclass(frozen=True)
class RemoteKV:
    engine_id: str
    block_ids: tuple[int, ...]
    request_id: str
    host: str
    port: int


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; the last one also carries why the request finished. ``key``: the
    key of the context the token was generated at (:meth:`ContextChain.key`), what its
    logprobs are drawn from."""

    token: int
    t: float
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    key: bytes = b""
    stop_token: bool = False  # the token is one of the request's stop_token_ids


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    status: int = 500
    type: str = "InternalServerError"


Event = TokenEvent | ErrorEvent


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    kind: RequestKind = RequestKind.LOCAL
    remote: RemoteKV | None = None
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    # The prompt and the output so far as generation sees them (set by EngineCore.submit).
    context: ContextChain | None = None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    output: list[int] = field(default_factory=list)
    arrival: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    aborted: bool = False
    finished: bool = False
    cache_salt: str | None = None
    keys: list[int] = field(default_factory=list)  # the prompt's full blocks' chain keys
    num_cached_tokens: int = 0  # prompt tokens found in this engine's prefix cache
    # Prompt blocks whose KV a step already wrote (cached when their chunk was scheduled).
    written: set[int] = field(default_factory=set)
    # A decode leg's kv_transfer_params.remote_prefill_cached_tokens: its prefill engine's hits.
    remote_cached_tokens: int | None = None
    # Choice ``i`` of an ``n > 1`` request: its own sequence of the same prompt (choice 0 is
    # what an ``n = 1`` request generates).
    choice: int = 0
    # What guided decoding (a forced tool call, response_format) makes the model write; EOS
    # once it is written, as the grammar then allows nothing else.
    forced: list[int] | None = None

    @property
    def reported_cached_tokens(self) -> int:
        """What usage reports as cached: a decode leg reports its prefill engine's hits, as vLLM
        does (not its own near-total hit from the transfer)."""
        if self.remote_cached_tokens is not None:
            return self.remote_cached_tokens
        return self.num_cached_tokens


@dataclass(frozen=True)
class EngineConfig:
    engine_id: str
    served_model_name: str
    max_model_len: int = 16384
    block_size: int = 16
    num_blocks: int = 4096
    block_bytes: int = 16384
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    model_seed: int = 0
    eos_prob: float = 0.0
    enable_prefix_caching: bool = True
    kv_lease_s: float = 30.0
    kv_read_timeout_s: float = 10.0
    tp_size: int = 1
    nixl_host: str = "127.0.0.1"
    nixl_port: int = 5600
    # Model seconds at its time_scale; its slowdown stays 1, as the steps' slowdown is the
    # fault setting's (FaultSettings.slowdown, changeable at run time).
    timing: EngineModels = CALIBRATION


def parse_kv_transfer_params(params: Any) -> tuple[RemoteKV | None, str | None]:
    """Read a decode leg's kv_transfer_params: (remote KV, None) or (None, why it is unusable)."""
    if not isinstance(params, dict):
        return None, "kv_transfer_params is not an object"
    if params.get("do_remote_prefill") is not True:
        return None, "do_remote_prefill is not true"
    try:
        engine_id = params["remote_engine_id"]
        block_ids = params["remote_block_ids"]
        request_id = params["remote_request_id"]
        host = params["remote_host"]
        port = params["remote_port"]
    except KeyError as exc:
        return None, f"missing {exc.args[0]}"
    if (
        not isinstance(engine_id, str)
        or not isinstance(request_id, str)
        or not isinstance(host, str)
    ):
        return None, "remote_engine_id, remote_request_id and remote_host must be strings"
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None, "remote_port must be a TCP port"
    if isinstance(block_ids, list) and len(block_ids) == 1 and isinstance(block_ids[0], list):
        block_ids = block_ids[0]  # newer vLLM: one list per KV cache group; we have one group
    if not isinstance(block_ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids
    ):
        return None, "remote_block_ids must be a list of block ids"
    return RemoteKV(engine_id, tuple(block_ids), request_id, host, port), None


@dataclass
class _Hold:
    blocks: list[int]
    expires_at: float


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        generation: GenerationModel,
        metrics: EngineMetrics,
        faults: FaultSettings,
        kv_agent: KVTransferAgent,
        peers: PeerDirectory,
        publisher: KVEventPublisher | None = None,
    ) -> None:
        self.config = config
        self.generation = generation
        self.metrics = metrics
        self.faults = faults
        self.kv_agent = kv_agent
        self.pool = kv_agent.pool
        self.peers = peers
        self.layout = KVLayout(generation.model_seed, config.block_size, config.block_bytes)
        self.publisher = publisher
        self.allocator = BlockPool(
            config.num_blocks,
            caching=config.enable_prefix_caching,
            record_events=publisher is not None,
        )
        self.waiting: deque[SimRequest] = deque()
        self.loading: set[SimRequest] = set()
        self.prefilling: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.holds: dict[str, _Hold] = {}
        # Each block's content chain (KVLayout.chains) while its bytes are the KV the chain
        # stands for, else None: a prompt's blocks are written on from the chain of the block
        # before, a block it hit included, instead of hashing the prompt from block 0.
        self._chains: list[bytes | None] = [None] * config.num_blocks
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    # --- public --------------------------------------------------------------------

    def new_request_id(self, base: str) -> str:
        # Unique per engine even when the router reuses one X-Request-Id for a retry.
        return f"{base}-{next(self._ids)}"

    def blocks_needed(self, request: SimRequest) -> int:
        if request.kind is RequestKind.PRODUCER:
            return self.layout.num_blocks(len(request.prompt))
        return self.layout.num_blocks(len(request.prompt) + request.max_tokens)

    def submit(self, request: SimRequest) -> None:
        request.arrival = time.monotonic()
        request.context = self.generation.context(request.prompt, request.choice)
        if self.allocator.caching:
            request.keys = chain_keys(request.prompt, self.config.block_size, request.cache_salt)
        self.waiting.append(request)
        self._refresh_gauges()
        self._wake.set()

    def abort(self, request: SimRequest) -> None:
        """The client went away: stop work and free blocks (a KV read in flight frees its own)."""
        if request.finished or request.aborted:
            return
        request.aborted = True
        if request in self.loading:
            return  # the READ may still be writing into these blocks; _load_remote frees them
        if request in self.waiting:
            # Off the queue now: an idle step loop (KV full of holds) may not admit for long.
            self.waiting.remove(request)
            if request.remote is not None and not self._closed:
                # Its KV is still held on the prefill engine: as vLLM's NixlConnector, the
                # notification a pull would send, without the pull, frees it there at once.
                self._spawn(self._decline_remote(request.remote))
        for queue in (self.prefilling, self.running):
            if request in queue:
                queue.remove(request)
        self._free(request)
        self.metrics.finished("abort").inc()
        self._refresh_gauges()

    def stop(self, request: SimRequest) -> None:
        """The frontend matched a stop string in the request's text (vLLM's output processor
        does, then has the engine core end it): it ends as finished, reason ``stop``."""
        if request.finished or request.aborted or request not in self.running:
            self.abort(request)  # not running (a no-op once finished): as an abort
            return
        self._finish(request, "stop")
        self._refresh_gauges()

    def on_notification(self, message: bytes) -> None:
        """A reader finished pulling a hold: free its blocks."""
        request_id = message.decode("utf-8", errors="replace")
        hold = self.holds.pop(request_id, None)
        if hold is None:
            log.debug("notification for unknown hold %s", request_id)
            return
        self.allocator.free(hold.blocks)
        self._holds_changed()
        self._wake.set()

    def start(self) -> None:
        self._spawn(self._step_loop())
        self._spawn(self._lease_loop())

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    # --- the step loop ---------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("engine task failed", exc_info=task.exception())

    async def _step_loop(self) -> None:
        timing = self.config.timing
        while not self._closed:
            started = time.monotonic()
            decodes = list(self.running)
            chunks, scheduled = self._schedule(self.config.max_num_batched_tokens - len(decodes))
            self._publish_events()
            if not decodes and not chunks:
                self._wake.clear()
                await self._wake.wait()
                continue
            if chunks and self.faults.crash_on_prefill:
                log.warning("fault injection: crashing on prefill")
                os._exit(CRASH_EXIT_CODE)
            model_s = 0.0
            if decodes:
                context = sum(len(r.prompt) + len(r.output) for r in decodes) / len(decodes)
                model_s += timing.decode.seconds_per_token(len(decodes), context)
            if chunks:
                model_s += timing.prefill.a + sum(
                    timing.prefill.chunk_seconds(r.computed, n) - timing.prefill.a
                    for r, n in chunks
                )
            planned = timing.wall(model_s) * self.faults.slowdown
            await asyncio.sleep(planned)
            now = time.monotonic()
            # The step ran: the scheduled blocks' KV is computed, even of a request aborted
            # meanwhile (its blocks stay cached, as vLLM's do; none was handed out again yet).
            for blocks, request_prompt, rows in scheduled:
                self._write_kv(blocks, request_prompt, rows)
            for request in decodes:
                if not request.aborted and not request.finished:
                    self._emit_token(request, now)
            for request, n in chunks:
                if request.aborted:
                    continue
                request.computed += n
                self.metrics.get(self.metrics.prompt_tokens).inc(n)
                if request.computed >= len(request.prompt):
                    self.prefilling.remove(request)
                    self._prefill_done(request, now)
            self._refresh_gauges()
            self.metrics.get(self.metrics.step_planned_seconds).inc(planned)
            self.metrics.get(self.metrics.step_seconds).inc(time.monotonic() - started)

    def _schedule(
        self, budget: int
    ) -> tuple[list[tuple[SimRequest, int]], list[tuple[list[int], list[int], list[int]]]]:
        """A step's prefill chunks within ``budget`` tokens, as vLLM's ``schedule()``: the
        prompts in progress first, then waiting requests in order while tokens remain, each
        looked up in the prefix cache when it is scheduled, after the chunks before it were
        cached (``allocate_slots``): a prompt scheduled in the same step as another sharing
        its prefix hits the blocks that one's chunk fills, and one left waiting for tokens is
        looked up later, against more. Returns the chunks and, per chunk, what
        ``_cache_scheduled`` cached (whose KV the step's end writes)."""
        chunks: list[tuple[SimRequest, int]] = []
        scheduled: list[tuple[list[int], list[int], list[int]]] = []

        def take(request: SimRequest) -> int:
            n = min(len(request.prompt) - request.computed, budget)
            chunks.append((request, n))
            scheduled.append(self._cache_scheduled(request, n))
            return n

        for request in self.prefilling:
            if budget <= 0:
                break
            budget -= take(request)
        while budget > 0:
            admitted = self._admit_next()
            if admitted is None:
                break
            if admitted.kind is not RequestKind.CONSUMER:
                budget -= take(admitted)
        self._refresh_gauges()
        return chunks, scheduled

    def _admit_next(self) -> SimRequest | None:
        """Admit the first waiting request (its prefix looked up, its blocks allocated), or
        None when none waits, ``max_num_seqs`` are active or its blocks do not fit."""
        while self.waiting:
            request = self.waiting[0]
            if request.aborted:
                self.waiting.popleft()
                continue
            active = len(self.running) + len(self.prefilling) + len(self.loading)
            if active >= self.config.max_num_seqs:
                return None
            # vLLM leaves at least the prompt's last token to compute (it needs its logits).
            hit = self.allocator.cached_prefix(
                request.keys[: (len(request.prompt) - 1) // self.config.block_size]
            )
            blocks = self.allocator.allocate(self.blocks_needed(request) - len(hit), hit)
            if blocks is None:
                return None
            self.waiting.popleft()
            request.blocks = blocks
            for block in blocks[len(hit) :]:
                self._chains[block] = None  # what it held is not this prompt's
            cached = len(hit) * self.config.block_size
            request.num_cached_tokens = request.computed = cached
            if self.allocator.caching:
                self.allocator.record_lookup(len(request.prompt), cached)
                self.metrics.get(self.metrics.prefix_cache_queries).inc(len(request.prompt))
                self.metrics.get(self.metrics.prefix_cache_hits).inc(cached)
            if request.kind is RequestKind.CONSUMER:
                self.loading.add(request)
                self._spawn(self._load_remote(request))
            else:
                self.prefilling.append(request)
            return request
        return None

    def _prefill_done(self, request: SimRequest, now: float) -> None:
        if request.kind is RequestKind.PRODUCER or self.allocator.caching:
            # The prompt's KV where it is read: every block of a prefill leg's (a reader pulls
            # them all), else the blocks cached now (a later request hits them). The blocks
            # it hit hold it already (a cached block's bytes are always its prefix's KV).
            rows = self._cache_blocks(request, request.prompt, request.keys)
            if request.kind is RequestKind.PRODUCER:
                hit = request.num_cached_tokens // self.config.block_size
                count = self.layout.num_blocks(len(request.prompt))
                rows = [i for i in range(hit, count) if i not in request.written]
            self._write_kv(request.blocks, request.prompt, rows)
        self.running.append(request)
        self._emit_token(request, now)

    def _emit_token(self, request: SimRequest, now: float) -> None:
        context = request.context
        assert context is not None
        position = len(request.output)
        generation = self.generation
        key = context.key()  # prompt + output so far: what the next token depends on
        if request.forced is not None:
            forced = request.forced
            token = forced[position] if position < len(forced) else generation.vocab.eos_id
        else:
            token = generation.token_at(key)
        eos = token == generation.vocab.eos_id
        if eos and request.forced is None and (request.ignore_eos or position < request.min_tokens):
            # As vLLM masks EOS below min_tokens (and ignore_eos never stops): the model's word.
            token = generation.word_at(key)
            eos = False
        # vLLM's scheduler stops on a stop token id (check_stop), not below min_tokens (there
        # it masks them; the simulated model, whose word is its hash's, emits it and goes on).
        stop_token = (
            token in request.stop_token_ids
            and request.forced is None
            and position >= request.min_tokens
        )
        request.output.append(token)
        context.append(token)
        metrics = self.metrics
        metrics.get(metrics.generation_tokens).inc()
        if request.first_token_at is None:
            request.first_token_at = now
            metrics.get(metrics.ttft).observe(now - request.arrival)
        elif request.last_token_at is not None:
            metrics.get(metrics.itl).observe(now - request.last_token_at)
        request.last_token_at = now
        reason = (
            "stop"
            if eos or stop_token
            else "length"
            if len(request.output) >= request.max_tokens
            else None
        )
        params = self._finish(request, reason) if reason is not None else None
        request.events.put_nowait(TokenEvent(token, now, reason, params, key, stop_token))

    def _finish(self, request: SimRequest, reason: str) -> dict[str, Any] | None:
        request.finished = True
        if request in self.running:
            self.running.remove(request)
        params = None
        self._cache_output(request)
        if request.kind is RequestKind.PRODUCER and reason == "length" and request.blocks:
            n = self.layout.num_blocks(len(request.prompt))
            held, rest = request.blocks[:n], request.blocks[n:]
            self.allocator.free(rest)
            request.blocks = []
            self.holds[request.request_id] = _Hold(held, time.monotonic() + self.config.kv_lease_s)
            self._holds_changed()
            # The fields and shapes vLLM 0.32's NixlConnector returns (docs/vllm-interop.md):
            # one list of block ids per KV cache group (the simulator has one group), its
            # parallel sizes, and no expiry or P-side prefix-cache hit to report.
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [held],
                "remote_engine_id": self.config.engine_id,
                "remote_request_id": request.request_id,
                "remote_host": self.config.nixl_host,
                "remote_port": self.config.nixl_port,
                "tp_size": self.config.tp_size,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": len(request.prompt),
                "remote_blocks_expiry_time": None,
                "remote_prefill_cached_tokens": request.num_cached_tokens,
                "transfer_mode": "pull",
            }
        else:
            self._free(request)
        self.metrics.finished(reason).inc()
        self.metrics.get(self.metrics.e2e).observe(time.monotonic() - request.arrival)
        self._wake.set()
        return params

    def _cache_scheduled(
        self, request: SimRequest, n: int
    ) -> tuple[list[int], list[int], list[int]]:
        """Cache the full prompt blocks a chunk of ``n`` tokens completes: (the request's
        blocks, its prompt, the indices newly cached, whose KV the step's end writes)."""
        full = min((request.computed + n) // self.config.block_size, len(request.keys))
        if not self.allocator.caching or full <= 0:
            return request.blocks, request.prompt, []
        rows = self._cache_blocks(request, request.prompt, request.keys[:full])
        request.written.update(rows)
        return request.blocks, request.prompt, rows

    def _cache_blocks(self, request: SimRequest, tokens: list[int], keys: list[int]) -> list[int]:
        """Key the request's full blocks; the indices of those newly cached, whose KV the
        caller writes."""
        return self.allocator.cache(
            request.blocks, keys, tokens, self.config.block_size, request.cache_salt
        )

    def _write_kv(self, blocks: list[int], tokens: list[int], rows: list[int]) -> None:
        """Write the KV of ``tokens``' blocks ``rows`` (ascending indices) into ``blocks``,
        extending the content chain of the block before the first when it is known (a block
        the prompt hit, or one written for it) instead of hashing from block 0."""
        if not rows:
            return
        first = rows[0]
        parent = self._chains[blocks[first - 1]] if first > 0 else None
        chains = self.layout.chains(tokens, first, rows[-1] + 1, parent)
        if len(rows) < len(chains):
            chains = [chains[i - first] for i in rows]
        targets = [blocks[i] for i in rows]
        self.layout.write(self.pool, targets, chains)
        full = len(tokens) // self.config.block_size
        for i, block, chain in zip(rows, targets, chains, strict=True):
            # A partial block's chain is not the one its full content will have: a later write
            # that extended it (the answer's blocks) would key right and hold the wrong KV.
            self._chains[block] = chain if i < full else None

    def _cache_output(self, request: SimRequest) -> None:
        """Cache the full blocks the answer completed (vLLM caches every full block of
        computed tokens: the last sampled token has no KV yet)."""
        if (
            not self.allocator.caching
            or not request.blocks
            or request.computed < len(request.prompt)
        ):
            return
        tokens = request.prompt + request.output[:-1]
        size = self.config.block_size
        full = len(tokens) // size
        if full <= len(request.keys):
            return
        keys = list(request.keys)
        key = keys[-1] if keys else chain_root(request.cache_salt)
        for i in range(len(keys), full):
            key = extend_chain(key, tokens[i * size : (i + 1) * size])
            keys.append(key)
        # The blocks newly cached (the answer's, mostly): written on from the prompt's last.
        self._write_kv(request.blocks, tokens, self._cache_blocks(request, tokens, keys))

    def _free(self, request: SimRequest) -> None:
        if request.blocks:
            self.allocator.free(request.blocks)
            request.blocks = []
            self._wake.set()

    # --- the decode leg's KV pull -------------------------------------------------------

    async def _load_remote(self, request: SimRequest) -> None:
        remote = request.remote
        assert remote is not None
        metrics = self.metrics
        try:
            result_bytes, seconds, descriptors = await self._pull(request, remote)
        except KVTransferError as exc:
            metrics.get(metrics.nixl_failed_transfers).inc()
            self.peers.invalidate(remote.host, remote.port)
            log.warning("request %s: %s", request.request_id, exc)
            self.loading.discard(request)
            self._free(request)
            if not request.aborted:
                request.finished = True
                metrics.finished("error").inc()
                request.events.put_nowait(ErrorEvent(f"KV transfer failed: {exc}"))
            self._refresh_gauges()
            return
        metrics.get(metrics.nixl_xfer_time).observe(seconds)
        metrics.get(metrics.nixl_bytes).observe(result_bytes)
        metrics.get(metrics.nixl_descriptors).observe(descriptors)
        self.loading.discard(request)
        if request.aborted:
            self._free(request)
            self._refresh_gauges()
            return
        request.computed = len(request.prompt)
        self._cache_blocks(request, request.prompt, request.keys)
        self.running.append(request)
        self._refresh_gauges()
        self._wake.set()

    async def _decline_remote(self, remote: RemoteKV) -> None:
        timeout = self.config.kv_read_timeout_s
        notif = remote.request_id.encode()
        try:
            await self._with_peer(remote, lambda peer: self.kv_agent.notify(peer, notif, timeout))
        except (OSError, TimeoutError, ValueError, KVTransferError) as exc:
            # The prefill engine frees the blocks when their lease expires.
            self.peers.invalidate(remote.host, remote.port)
            log.warning(
                "KV of %s on %s left to its lease: %s",
                remote.request_id,
                remote.engine_id,
                str(exc) or type(exc).__name__,
            )

    async def _remote_peer(self, remote: RemoteKV) -> KVPeerInfo:
        """The prefill engine that holds ``remote``'s KV, found through its NIXL side channel
        (within ``kv_read_timeout_s``) and checked to be the engine the handoff names."""
        try:
            peer = await asyncio.wait_for(
                self.peers.lookup(remote.host, remote.port), self.config.kv_read_timeout_s
            )
        except (OSError, TimeoutError, ValueError) as exc:
            why = str(exc) or type(exc).__name__
            raise KVTransferError(
                f"NIXL side channel {remote.host}:{remote.port} unreachable: {why}"
            ) from exc
        if peer.engine_id != remote.engine_id:
            raise KVTransferError(
                f"side channel {remote.host}:{remote.port} is engine {peer.engine_id!r},"
                f" not {remote.engine_id!r}"
            )
        return peer

    async def _with_peer(
        self, remote: RemoteKV, transfer: Callable[[KVPeerInfo], Awaitable[_T]]
    ) -> _T:
        """``transfer`` with the prefill engine that holds ``remote``'s KV. One that fails on
        the agent the side channel named before (cached) is tried once more when another
        process answers there now (a restarted engine): vLLM gives every engine process a
        NIXL engine id of its own, so its decode engines handshake anew with a restarted
        prefill engine; the simulated engines keep their fleet ids, so a decode engine finds
        the new process here instead of failing the request on the old one's agent."""
        known = await self._remote_peer(remote)
        try:
            return await transfer(known)
        except KVTransferError:
            self.peers.invalidate(remote.host, remote.port)
            try:
                peer = await self._remote_peer(remote)
            except KVTransferError:
                peer = known
            if peer.agent_name == known.agent_name:
                raise
            return await transfer(peer)

    async def _pull(self, request: SimRequest, remote: RemoteKV) -> tuple[int, float, int]:
        """Pull the prompt's blocks this engine lacks: (bytes, seconds, blocks moved)."""
        timeout = self.config.kv_read_timeout_s
        if self.faults.crash_on_kv_read:
            log.warning("fault injection: crashing on KV read")
            os._exit(CRASH_EXIT_CODE)
        stall_from = self.faults.hang_kv_read_from
        if self.faults.hang_kv_read_s > 0 and (not stall_from or remote.engine_id in stall_from):
            stall = self.faults.hang_kv_read_s
            await asyncio.sleep(min(stall, timeout))
            if stall >= timeout:
                raise KVTransferError(f"READ from {remote.engine_id} stalled past {timeout} s")
        n = self.layout.num_blocks(len(request.prompt))
        if len(remote.block_ids) != n:
            raise KVTransferError(
                f"{len(remote.block_ids)} remote blocks for a {len(request.prompt)}-token prompt"
                f" (expected {n})"
            )
        # As vLLM's NixlConnector: blocks this engine already had cached are not pulled again;
        # the remote list is end-trimmed to the blocks still missing.
        hit = request.num_cached_tokens // self.config.block_size
        local = request.blocks[:n]
        remote_blocks, notif = list(remote.block_ids[hit:]), remote.request_id.encode()
        result = await self._with_peer(
            remote,
            lambda peer: self.kv_agent.read(peer, remote_blocks, local[hit:], notif, timeout),
        )
        chains = self.layout.chains(request.prompt)
        expected = self.layout.contents(chains)
        if not np.array_equal(self.pool[local], expected):
            self.metrics.get(self.metrics.kv_verify_failures).inc()
            wrong = [i for i in range(n) if not np.array_equal(self.pool[local[i]], expected[i])]
            raise KVTransferError(
                f"pulled KV from {remote.engine_id} does not match the prompt"
                " (blocks freed or overwritten before the read; wrong blocks"
                f" {wrong} of {n}, the first {hit} from this engine's prefix cache)"
            )
        full = len(request.prompt) // self.config.block_size
        for i, (block, chain) in enumerate(zip(local, chains, strict=True)):
            self._chains[block] = chain if i < full else None  # as in _write_kv
        return result.num_bytes, result.seconds, n - hit

    # --- holds -------------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        period = min(1.0, self.config.kv_lease_s / 4)
        while not self._closed:
            await asyncio.sleep(period)
            now = time.monotonic()
            expired = [rid for rid, hold in self.holds.items() if hold.expires_at <= now]
            for rid in expired:
                hold = self.holds.pop(rid)
                self.allocator.free(hold.blocks)
                # Zero them: a reader that comes late must fail verification, not decode garbage.
                # Blocks another request also holds (a prefix it hit) keep their content.
                unused = [b for b in hold.blocks if self.allocator.refs(b) == 0]
                self.allocator.uncache(unused)
                self.pool[unused] = 0
                for block in unused:
                    self._chains[block] = None
                self.metrics.get(self.metrics.nixl_kv_expired).inc()
                log.warning("KV hold %s expired after %.1f s unpulled", rid, self.config.kv_lease_s)
            if expired:
                self._publish_events()
                self._holds_changed()
                self._refresh_gauges()
                self._wake.set()

    def _publish_events(self) -> None:
        """Publish what the prefix cache stored and evicted since the last batch (one batch
        per step, as vLLM)."""
        if self.publisher is not None and self.allocator.events:
            self.publisher.publish(self.allocator.take_events())

    def reset_prefix_cache(self) -> bool:
        cleared = self.allocator.clear()
        self._publish_events()
        return cleared

    def _holds_changed(self) -> None:
        self.kv_agent.set_outstanding_holds(len(self.holds))
        self.metrics.get(self.metrics.kv_holds).set(len(self.holds))

    def _refresh_gauges(self) -> None:
        m = self.metrics
        m.get(m.num_requests_running).set(self.num_running)
        m.get(m.num_requests_waiting).set(self.num_waiting)
        m.get(m.kv_cache_usage_perc).set(self.allocator.usage)
