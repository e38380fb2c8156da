"""A virtual-time fleet simulator: the router's own scheduler, admission control and role
controller, driven by a discrete-event simulation of engines, with no processes and no sleeping.

Engines follow the live simulator's step model (``narwhal.simengine.timing`` and the step
loop of ``narwhal.simengine.engine``): each step advances every decoding sequence by one token and
prefills up to ``max_num_batched_tokens`` prompt tokens, first come first served; a prompt's
first token comes at the end of the step that finishes its prefill; a decode leg joins its
engine's batch after the KV transfer and emits its first token at the end of the next step.
While an engine only decodes and nothing joins, its steps are uniform, so the simulator jumps
from event to event (the next sequence to finish, the next join) instead of stepping: a fleet
of a thousand engines replays a million requests in minutes. Given ``KVBlocks`` per engine,
prompts and decode legs wait at a step boundary until their KV blocks fit, as in the live
engine; given measured costs, legs cross a per-leg overhead, KV pulls take a time that grows
with the prompt, and prefill steps carry the host's work per prompt.

The routing side is the router's code, unchanged: ``FleetState``, ``SchedulerV0``/``V1``,
``admit``, ``LatencyPredictor`` with its online correction, ``DemandTracker`` and
``RoleController``, all on a ``VirtualClock``. What the live router does that this does not:
HTTP, retries after failed legs (nothing fails here), the first-token deadline (a handoff that
would have missed it is counted, not retried), and scrape lag (engines report at once).
Clients wait for their answers unless ``DesConfig.abandon_after_s`` says when they give up on
a first token, as ``bench/goodput.py``'s clients do at the TTFT budget.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from narwhal.clock import VirtualClock
from narwhal.contract import Budgets, FleetContract
from narwhal.profiles.store import EngineModels
from narwhal.routing.admission import Admit, Queue, Verdict
from narwhal.routing.baselines import BASELINES
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.lifecycle import QUEUE_RECHECK_S, Lifecycle, Ticket
from narwhal.routing.output_length import OutputLengthEstimator
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.roles import DemandTracker, RoleController
from narwhal.routing.scheduler import Scheduler, SchedulerV0, SchedulerV1

__all__ = ["DesConfig", "DesResult", "KVBlocks", "RequestSpec", "run_des"]


@dataclass(frozen=True)
class RequestSpec:
    arrival: float
    prompt_tokens: int
    output_tokens: int  # what the request generates
    # What its client asks for (the router's only knowledge of the output's length; the
    # request still ends after ``output_tokens``): None asks for exactly ``output_tokens``.
    max_tokens: int | None = None
    # The prompt's full KV blocks as chain keys (``narwhal.routing.prefix``; block i's key
    # stands for blocks 0..i) of the fleet's ``engine.prefix_caching.block_size`` tokens: what
    # the engines' prefix caches hold and prefix-aware routing matches. Empty: unknown, no
    # prefix shared with any other.
    prefix: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVBlocks:
    """An engine's KV cache: ``num_blocks`` blocks of ``block_size`` tokens each. A prefill leg
    holds its prompt's blocks from the step that starts it until its decode engine has pulled
    them; a decode leg (or a local prefill) holds its prompt's and output's blocks from its
    admission to its last token, as vLLM and the live simulated engine allocate them."""

    num_blocks: int
    block_size: int

    def blocks(self, tokens: int) -> int:
        # A request larger than the whole cache would wait forever: it takes all of it.
        return min(self.num_blocks, -(-tokens // self.block_size))


@dataclass
class _Request:
    spec: RequestSpec
    index: int
    ticket: Ticket
    first_token: float | None = None
    last_token: float | None = None
    outcome: str = "pending"
    deadline_missed: bool = False
    prefill_blocks: int = 0  # held on its prefill engine until its KV is pulled
    decode_blocks: int = 0  # held on its decode engine until its last token
    cached_tokens: int = 0  # of its prompt, found in its prefill (or local) engine's cache
    pulled_tokens: int = 0  # of its prompt, whose KV its decode engine pulled
    joined: bool = False  # its decode sequence is in a batch: its first token is being made

    @property
    def prefill(self) -> str:
        return self.ticket.pair.prefill if self.ticket.pair is not None else ""

    @property
    def decode(self) -> str:
        return self.ticket.pair.decode if self.ticket.pair is not None else ""

    @property
    def local(self) -> bool:
        """Prefilled by its decode engine (routing.local_prefill)."""
        return self.ticket.local


@dataclass
class _Sequence:
    request: _Request
    end_step: int  # the engine step count at which its last token is emitted
    joined_step: int


@dataclass
class _Engine:
    id: str
    timing: EngineModels
    max_num_seqs: int
    max_num_batched_tokens: int
    kv: KVBlocks | None = None  # None: KV capacity never binds
    free_blocks: int = 0
    # The engine's prefix cache: chain keys it holds, least recently used first (None: it
    # caches nothing), at most ``cache_blocks`` of them.
    cache: OrderedDict[int, None] | None = None
    cache_blocks: int = 0
    kv_waiting: deque[_Request] = field(default_factory=deque)  # prefills waiting for blocks
    kv_blocked: int = 0  # decode legs the last step boundary left waiting for blocks
    prefill_queue: deque[list[Any]] = field(default_factory=deque)  # [request, done tokens]
    decoding: list[tuple[int, int, _Sequence]] = field(default_factory=list)  # heap by end_step
    # A decode leg waits for a step boundary to be admitted (as in vLLM and the live
    # simulator's step loop), pulls its KV while the engine steps on, then waits for the next
    # boundary to join the batch: pending -> loading -> joining -> decoding.
    pending: list[_Sequence] = field(default_factory=list)
    loading: int = 0
    joining: list[_Sequence] = field(default_factory=list)
    steps: int = 0  # decode steps completed
    context_sum: float = 0.0  # sum over decoding sequences of prompt + generated tokens
    busy_until: float | None = None  # end of the segment in flight
    segment: tuple[float, int, float, list[tuple[_Request, int]]] | None = None
    new_joins: list[_Sequence] = field(default_factory=list)  # joined at this segment's start
    busy_time: float = 0.0
    epoch: int = 0  # bumps when a scheduled segment end becomes stale

    @property
    def batch(self) -> int:
        return len(self.decoding)


@dataclass(frozen=True)
class DesConfig:
    fleet: FleetContract
    timings: dict[str, EngineModels]  # each engine's step timing (narwhal.simengine.timing)
    # "v1", "v0", or a baseline policy (``narwhal.routing.baselines.BASELINES``)
    scheduler: str = "v1"
    flipping: bool = True
    transfer_s: float = 0.002  # KV pull, wall seconds (measured on loopback: a few ms)
    transfer_s_per_token: float = 0.0  # and this much more per prompt token (its KV's bytes)
    # Host work a prefill engine does per prompt beyond its modelled steps (taking the request,
    # writing its KV, serving the pull; longer while other engine processes hold the cores),
    # wall seconds: added to the step that prefills it.
    prefill_host_s: float = 0.0
    prefill_host_s_per_token: float = 0.0
    leg_overhead_s: float = 0.0  # router and HTTP time added to each leg
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    scrape_interval_s: float = 1.0
    seed: int = 0
    candidates: int | None = 32  # scheduler v1 samples this many engines per role in big pools
    # Each engine's KV cache (``narwhal.fleetsim.workloads.kv_blocks_of``); engines not in it
    # (and all of them when None) have room for every request they admit.
    kv_blocks: dict[str, KVBlocks] | None = None
    # An oracle for the output's length: the router expects each request to generate its
    # whole max_tokens (the exact length when clients ask for exactly what they get) instead
    # of estimating it from the answers completed (narwhal.routing.output_length).
    output_oracle: bool = False
    # Each engine's prefix cache, in prompt tokens (0: the engines cache no prefixes; also
    # when the fleet's engine.prefix_caching is off). Requests' ``prefix`` keys are matched in
    # blocks of engine.prefix_caching.block_size tokens.
    prefix_cache_tokens: int = 0
    # The client gives up on a request with no first token this many seconds after it
    # arrived (None: it waits): the router cancels its leg and the engine drops it, so it
    # stops loading the fleet, as a client with a first-token timeout (``bench/goodput.py``'s,
    # at the TTFT budget) makes a live fleet do. Counted TTFT late. Without it an overloaded
    # fleet serves every late request to its end, and a policy that admits everything
    # collapses further than it would live.
    abandon_after_s: float | None = None

    def __post_init__(self) -> None:
        if self.abandon_after_s is not None and not self.abandon_after_s > 0:
            raise ValueError(
                f"abandon_after_s must be greater than 0 or None, got {self.abandon_after_s}"
            )


@dataclass
class DesResult:
    offered: int
    completed: int
    rejected: int
    met_slo: int
    deadline_missed: int
    duration_s: float
    flips: list[dict[str, Any]]
    ttft: list[float]
    tpot: list[float]
    utilisation: dict[str, float]
    wall_s: float
    # Each request's outcome, in arrival order: "met" (both budgets), "rejected", "ttft_late"
    # (answered, first token after the TTFT budget), "tpot_late" (answered in time, but its
    # TPOT over budget or its first-token deadline missed) or "failed" (no answer).
    outcomes: list[str] = field(default_factory=list)
    # Prompt tokens prefilled (by answered requests' prefill or local engines), the share of
    # them found in that engine's prefix cache, and the prompt tokens whose KV was pulled.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pulled_tokens: int = 0
    abandoned: int = 0  # given up by their clients (DesConfig.abandon_after_s), in ttft_late

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def attainment(self) -> float:
        return self.met_slo / self.offered if self.offered else 0.0

    @property
    def goodput(self) -> float:
        return self.met_slo / self.duration_s if self.duration_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {
            "offered": self.offered,
            "completed": self.completed,
            "rejected": self.rejected,
            "met_slo": self.met_slo,
            "attainment": round(self.attainment, 4),
            "goodput_rps": round(self.goodput, 4),
            "deadline_missed": self.deadline_missed,
            "abandoned": self.abandoned,
            "duration_s": round(self.duration_s, 3),
            "flips": len(self.flips),
            "ttft_p50": pct(self.ttft, 0.5),
            "ttft_p95": pct(self.ttft, 0.95),
            "tpot_p50": pct(self.tpot, 0.5),
            "tpot_p95": pct(self.tpot, 0.95),
            "mean_utilisation": round(statistics.fmean(self.utilisation.values()), 4)
            if self.utilisation
            else None,
            "hit_rate": round(self.hit_rate, 4),
            "wall_s": round(self.wall_s, 2),
        }


_TRACED = frozenset({"arrive", "prefill_done", "first_token", "finished"})
# A prefill job's tokens done before its engine first schedules it (and looks it up).
_NOT_LOOKED_UP = -1


def _traced(kind: str, payload: Any) -> Any:
    return payload.arrival if kind == "arrive" else payload.index


class _Simulation:
    def __init__(self, config: DesConfig, models: dict[str, EngineModels]) -> None:
        self.config = config
        fleet = config.fleet
        self.clock = VirtualClock(0.0)
        self.state = FleetState(fleet, self.clock)
        for engine in self.state.engines.values():
            engine.healthy = True
        self.predictor = LatencyPredictor(models)
        v1 = config.scheduler == "v1"
        self.scheduler: Scheduler
        if v1:
            self.scheduler = SchedulerV1(
                self.predictor, fleet.budgets, config.candidates, random.Random(config.seed)
            )
        elif config.scheduler == "v0":
            self.scheduler = SchedulerV0()
        elif config.scheduler in BASELINES:
            self.scheduler = BASELINES[config.scheduler](random.Random(config.seed))
        else:
            raise ValueError(
                f"unknown scheduler {config.scheduler!r}: v1, v0 or one of {', '.join(BASELINES)}"
            )
        self.demand = DemandTracker(self.clock, window_s=max(10.0, 6 * fleet.roles.tick_s))
        # As the router builds it: scheduler v0 predicts nothing, so nothing is corrected.
        self.lifecycle = Lifecycle(
            self.state, self.scheduler, predictor=self.predictor if v1 else None, demand=self.demand
        )
        if config.output_oracle:
            self.lifecycle.outputs = OutputLengthEstimator(min_samples=sys.maxsize)
        self.by_ticket: dict[Ticket, _Request] = {}  # the requests in the admission queue
        self.queue_timer: int | None = None  # the pending queue recheck's id
        # When set, every event that moves a request or the fleet's scraped load is appended
        # as (time, kind, request index or the scraped loads): what a replay of this run
        # through the router needs (tests/unit/test_lifecycle_replay.py).
        self.trace: list[tuple[float, str, Any]] | None = None
        self.roles = (
            RoleController(self.predictor, fleet.budgets, fleet.roles, self.clock)
            if config.flipping and fleet.roles.enabled and config.scheduler == "v1"
            else None
        )
        kv = config.kv_blocks or {}
        self.engines = {
            e.id: _Engine(
                e.id,
                config.timings[e.id],
                config.max_num_seqs,
                config.max_num_batched_tokens,
                kv.get(e.id),
                kv[e.id].num_blocks if e.id in kv else 0,
            )
            for e in fleet.engines
        }
        caching = fleet.engine.prefix_caching
        self.block = caching.block_size
        if caching.enabled and config.prefix_cache_tokens > 0:
            for simulated in self.engines.values():
                simulated.cache = OrderedDict()
                simulated.cache_blocks = config.prefix_cache_tokens // self.block
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.flips: list[dict[str, Any]] = []
        self.requests: list[_Request] = []
        self.deadline = fleet.engine.first_token_timeout_s

    # --- events --------------------------------------------------------------------------

    def at(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def run(self, specs: Iterable[RequestSpec]) -> None:
        # The run makes no reference cycles to speak of (a few dozen objects in a run of
        # 20,000 requests), but it keeps every request, and the cyclic collector's passes
        # over that growing heap took about a tenth of the run: off while it runs.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._run(specs)
        finally:
            if collecting:
                gc.enable()

    def _run(self, specs: Iterable[RequestSpec]) -> None:
        arrivals: Iterator[RequestSpec] = iter(specs)
        index = itertools.count()
        nxt = next(arrivals, None)
        if nxt is not None:
            self.at(nxt.arrival, "arrive", nxt)
        tick = self.config.fleet.roles.tick_s
        self.at(tick, "roles", None)
        self.at(self.config.scrape_interval_s, "scrape", None)
        pending = 1 if nxt is not None else 0
        events, advance_to, pop, trace = (
            self.events,
            self.clock.advance_to,
            heapq.heappop,
            self.trace,
        )
        while events:
            t, _, kind, payload = pop(events)
            advance_to(t)
            if trace is not None and kind in _TRACED:
                trace.append((self.clock.now(), kind, _traced(kind, payload)))
            if kind == "arrive":
                i = next(index)
                ticket = self.lifecycle.arrive(
                    str(i),
                    max_tokens=payload.max_tokens or payload.output_tokens,
                    prompt_tokens=payload.prompt_tokens,
                    arrival=payload.arrival,
                    prefix=payload.prefix,
                )
                request = _Request(payload, i, ticket)
                self.requests.append(request)
                if self.config.abandon_after_s is not None:
                    self.at(payload.arrival + self.config.abandon_after_s, "abandon", request)
                self.route(request)
                nxt = next(arrivals, None)
                if nxt is not None:
                    self.at(nxt.arrival, "arrive", nxt)
                else:
                    pending = 0
            elif kind == "segment_end":
                engine_id, epoch = payload
                engine = self.engines[engine_id]
                if epoch == engine.epoch:
                    self.finish_segment(engine)
            elif kind == "prefill_done":
                if payload.outcome == "abandoned":
                    self.free_prompt_kv(payload)
                else:
                    self.prefill_done(payload)
            elif kind == "first_token":
                self.decode_first_token(payload)
            elif kind == "finished":
                self.decode_finished(payload)
            elif kind == "local_leg":
                if payload.outcome != "abandoned":
                    self.enqueue_prefill(self.engines[payload.decode], payload)
            elif kind == "decode_leg":
                if payload.outcome == "abandoned":
                    self.free_prompt_kv(payload)
                    continue
                engine = self.engines[payload.decode]
                engine.pending.append(_Sequence(payload, 0, 0))
                self.new_work(engine)
            elif kind == "loaded":
                engine = self.engines[payload.request.decode]
                engine.loading -= 1
                if payload.request.outcome == "abandoned":
                    # The pull ran to its end (a READ is not cut short): both copies go.
                    self.free_decode_kv(engine, payload.request)
                    self.free_prompt_kv(payload.request)
                    continue
                self.store(engine, payload.request, payload.request.spec.prompt_tokens)
                engine.joining.append(payload)
                self.new_work(engine)
                # The prefill engine frees the pulled blocks when the reader says it is done.
                self.free_prompt_kv(payload.request)
            elif kind == "roles":
                self.tick_roles()
                if pending or self.busy():
                    self.at(self.clock.now() + tick, "roles", None)
            elif kind == "scrape":
                self.scrape()
                if pending or self.busy():
                    self.at(self.clock.now() + self.config.scrape_interval_s, "scrape", None)
            elif kind == "retry_queue" and payload == self.queue_timer:
                self.drain_queue()  # (a stale recheck: a later drain moved it)
            elif kind == "abandon":
                self.abandon(payload)

    def busy(self) -> bool:
        return any(
            e.busy_until is not None
            or e.joining
            or e.pending
            or e.loading
            or e.prefill_queue
            or e.kv_waiting
            for e in self.engines.values()
        ) or bool(self.lifecycle.queued)

    # --- routing: the router's lifecycle, driven by simulated legs ----------------------

    def route(self, request: _Request) -> None:
        verdict = self.lifecycle.admit(request.ticket)
        if not isinstance(verdict, Queue):
            self.admitted(request, verdict)
            return
        self.by_ticket[request.ticket] = request
        if self.queue_timer is None:
            self.recheck_queue_later()

    def recheck_queue_later(self) -> None:
        """As the router's queue does: the queue is decided on again when a leg ends, and
        ``QUEUE_RECHECK_S`` after it was last decided on, while anyone waits."""
        self.queue_timer = next(self.seq)
        self.at(self.clock.now() + QUEUE_RECHECK_S, "retry_queue", self.queue_timer)

    def admitted(self, request: _Request, verdict: Verdict) -> None:
        if not isinstance(verdict, Admit):
            request.outcome = "rejected"
            return
        now = self.clock.now()
        if verdict.pair.local:
            # The decode engine prefills the prompt itself: one leg, no transfer. The prompt
            # queues for that engine's prefill budget like any other, stalling its decode steps.
            self.at(now + self.config.leg_overhead_s, "local_leg", request)
            return
        self.enqueue_prefill(self.engines[verdict.pair.prefill], request)

    def drain_queue(self) -> None:
        for ticket, verdict in self.lifecycle.drain():
            self.admitted(self.by_ticket.pop(ticket), verdict)
        if self.lifecycle.queued:
            self.recheck_queue_later()
        else:
            self.queue_timer = None

    def abandon(self, request: _Request) -> None:
        """The client gave up waiting for the first token: the router cancels the request
        (``Lifecycle.cancel``, as on a client disconnect) and its engine drops what it holds
        of it, now where it waits (the router's queue, a KV or decode admission queue), at
        the end of the step in progress for a prompt being prefilled, and when its KV pull
        ends for one loading. A sequence already in a batch is left to send the token it is
        making."""
        if request.outcome != "pending" or request.first_token is not None or request.joined:
            return
        request.outcome = "abandoned"
        ticket = request.ticket
        self.by_ticket.pop(ticket, None)
        self.lifecycle.cancel(ticket)
        if ticket.pair is None:
            return  # still in the router's queue
        prefill = self.engines[request.prefill]  # the decode engine's own, for a local leg
        if request in prefill.kv_waiting:
            prefill.kv_waiting.remove(request)
        for job in prefill.prefill_queue:
            if job[0] is request:
                # A chunk of it in the step in progress: that step ends first (finish_segment).
                if prefill.segment is None or all(r is not request for r, _ in prefill.segment[3]):
                    prefill.prefill_queue.remove(job)
                    self.free_leg(prefill, request)
                break
        decode = self.engines[request.decode]
        for queue in (decode.pending, decode.joining):
            for sequence in queue:
                if sequence.request is request:
                    queue.remove(sequence)
                    self.free_decode_kv(decode, request)
                    self.free_prompt_kv(request)
                    break
        if self.lifecycle.queued:
            self.drain_queue()

    def free_leg(self, engine: _Engine, request: _Request) -> None:
        """Free the blocks a prompt held on the engine prefilling it (a local prompt's are
        its decode's)."""
        if request.local:
            self.free_decode_kv(engine, request)
        else:
            self.free_prompt_kv(request)

    def free_prompt_kv(self, request: _Request) -> None:
        """The prompt KV its prefill engine held for the decode engine's pull is freed: pulled,
        or given up on (no one will pull it)."""
        self.release(self.engines[request.prefill], request.prefill_blocks)
        request.prefill_blocks = 0

    def free_decode_kv(self, engine: _Engine, request: _Request) -> None:
        """The blocks the request's decode leg (or local prefill) held on ``engine`` are freed."""
        self.release(engine, request.decode_blocks)
        request.decode_blocks = 0

    def local_prefilled(self, engine: _Engine, request: _Request, step_end: float) -> None:
        """A local prompt's prefill ended with this step, which also sampled its first token:
        it decodes from the next step on, in the same engine's batch."""
        hop = self.config.leg_overhead_s
        self.at(step_end + hop, "first_token", request)
        request.joined = True
        n = request.spec.output_tokens
        if n <= 1:
            self.at(step_end + hop, "finished", request)
            self.free_decode_kv(engine, request)
            return
        sequence = _Sequence(request, engine.steps + n - 1, engine.steps)
        heapq.heappush(engine.decoding, (sequence.end_step, request.index, sequence))
        engine.context_sum += request.spec.prompt_tokens + 1

    def prefill_done(self, request: _Request) -> None:
        self.lifecycle.prefill_done(request.ticket, "ok")
        self.at(self.clock.now() + self.config.leg_overhead_s, "decode_leg", request)
        if self.lifecycle.queued:
            self.drain_queue()

    def decode_first_token(self, request: _Request) -> None:
        now = self.clock.now()
        ticket = request.ticket
        self.lifecycle.first_token(ticket)
        request.first_token = now
        # The live router would have aborted the leg at its first-token deadline: counted.
        if now - ticket.decode_started > self.deadline:
            request.deadline_missed = True

    def decode_finished(self, request: _Request) -> None:
        now = self.clock.now()
        request.last_token = now
        request.outcome = "ok"
        self.lifecycle.finished(
            request.ticket, completion_tokens=request.spec.output_tokens, complete=True
        )
        if self.lifecycle.queued:
            self.drain_queue()

    def scrape(self) -> None:
        """What the router's scrape loop reads from each engine's /metrics, at once."""
        now = self.clock.now()
        loads = {
            engine_id: (
                engine.batch + len(engine.prefill_queue),
                len(engine.joining) + len(engine.kv_waiting) + engine.kv_blocked,
            )
            for engine_id, engine in self.engines.items()
        }
        if self.trace is not None:
            self.trace.append((now, "scrape", loads))
        for engine_id, (running, waiting) in loads.items():
            scraped = self.state.engines[engine_id].scraped
            scraped.running = running
            scraped.waiting = waiting
            scraped.at = now

    def tick_roles(self) -> None:
        for engine in self.state.engines.values():
            engine.settle_drain()
        if self.roles is None:
            return
        decision = self.roles.tick(self.state, self.demand)
        if decision is None:
            return
        self.state.set_role(decision.engine, decision.to_role)
        self.roles.applied(decision)
        self.flips.append(
            {
                "t": round(self.clock.now(), 4),
                "engine": decision.engine,
                "from_role": decision.from_role,
                "to_role": decision.to_role,
                "pressures": decision.pressures.as_dict(),
            }
        )

    # --- engines ------------------------------------------------------------------------

    def cached(self, engine: _Engine, request: _Request) -> int:
        """Prompt tokens the engine finds in its prefix cache for ``request`` (all but the last
        token at most, as vLLM), those blocks touched as vLLM touches them: the prompt's head
        last, so that its tail is evicted first."""
        cache = engine.cache
        keys = request.spec.prefix
        if cache is None or not keys:
            return 0
        limit = (request.spec.prompt_tokens - 1) // self.block
        hit = 0
        for key in keys[:limit]:
            if key not in cache:
                break
            hit += 1
        for key in reversed(keys[:hit]):
            cache.move_to_end(key)
        return hit * self.block

    def store(self, engine: _Engine, request: _Request, tokens: int) -> None:
        """The engine's prefix cache now holds the full blocks of the prompt's first ``tokens``
        (least recent out)."""
        cache = engine.cache
        if cache is None or not request.spec.prefix:
            return
        full = min(tokens, request.spec.prompt_tokens) // self.block
        for key in reversed(request.spec.prefix[:full]):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > engine.cache_blocks:
            cache.popitem(last=False)

    def kick(self, engine: _Engine) -> None:
        """Start a segment if the engine is idle and has work."""
        if engine.busy_until is None and (
            engine.prefill_queue
            or engine.joining
            or engine.pending
            or engine.decoding
            or engine.kv_waiting
        ):
            self.start_segment(engine)

    def enqueue_prefill(self, engine: _Engine, request: _Request) -> None:
        if engine.kv is None:
            engine.prefill_queue.append([request, _NOT_LOOKED_UP])
        else:
            engine.kv_waiting.append(request)
        self.new_work(engine)

    def release(self, engine: _Engine, blocks: int) -> None:
        """``blocks`` of the engine's KV cache are free again: what waited for them may start."""
        if not blocks:
            return
        engine.free_blocks += blocks
        self.kick(engine)

    def admit_kv(self, engine: _Engine) -> None:
        """At a step boundary, as the engine's scheduler admits its waiting queue: prompts in
        arrival order while their blocks fit (the first that does not fit holds the rest)."""
        kv = engine.kv
        assert kv is not None
        while engine.kv_waiting:
            request = engine.kv_waiting[0]
            # A local prefill is also its own decode: it holds its output's blocks too.
            tokens = request.spec.prompt_tokens + (
                request.spec.output_tokens if request.local else 0
            )
            need = kv.blocks(tokens)
            if need > engine.free_blocks:
                break
            engine.free_blocks -= need
            engine.kv_waiting.popleft()
            if request.local:
                request.decode_blocks = need
            else:
                request.prefill_blocks = need
            engine.prefill_queue.append([request, _NOT_LOOKED_UP])

    def admit_decode_legs(self, engine: _Engine, room: int) -> list[_Sequence]:
        """The decode legs admitted at this boundary: up to ``room``, in arrival order, while
        their prompt's and output's blocks fit."""
        kv = engine.kv
        if kv is None:
            admitted, engine.pending = engine.pending[:room], engine.pending[room:]
            return admitted
        taken = 0
        for sequence in engine.pending[:room]:
            spec = sequence.request.spec
            need = kv.blocks(spec.prompt_tokens + spec.output_tokens)
            if need > engine.free_blocks:
                break
            engine.free_blocks -= need
            sequence.request.decode_blocks = need
            taken += 1
        admitted, engine.pending = engine.pending[:taken], engine.pending[taken:]
        engine.kv_blocked = len(engine.pending)
        return admitted

    def new_work(self, engine: _Engine) -> None:
        if engine.busy_until is not None:
            self.interrupt(engine)  # end a long jump at the next step boundary
        else:
            self.kick(engine)

    def start_segment(self, engine: _Engine) -> None:
        now = self.clock.now()
        decoding = engine.decoding
        # Admit decode legs at the boundary: their KV pull runs while the engine steps on.
        if engine.pending:
            room = max(
                0, engine.max_num_seqs - len(decoding) - engine.loading - len(engine.joining)
            )
            for sequence in self.admit_decode_legs(engine, room):
                engine.loading += 1
                # Blocks the decode engine holds are not pulled again (vLLM's NixlConnector).
                request = sequence.request
                tokens = request.spec.prompt_tokens - self.cached(engine, request)
                request.pulled_tokens = tokens
                transfer = self.config.transfer_s + self.config.transfer_s_per_token * tokens
                self.at(now + transfer, "loaded", sequence)
        if engine.kv_waiting:
            self.admit_kv(engine)
        if not (engine.prefill_queue or engine.joining or decoding):
            engine.segment = None
            engine.busy_until = None
            return
        # Joins take effect at a step boundary, as in the live engine's step loop.
        if engine.joining:
            room = max(0, engine.max_num_seqs - len(decoding))
            engine.new_joins, engine.joining = engine.joining[:room], engine.joining[room:]
            for sequence in engine.new_joins:
                sequence.request.joined = True
                sequence.joined_step = engine.steps
                sequence.end_step = engine.steps + sequence.request.spec.output_tokens
                heapq.heappush(decoding, (sequence.end_step, sequence.request.index, sequence))
                engine.context_sum += sequence.request.spec.prompt_tokens
        else:
            engine.new_joins = []
        batch = len(decoding)
        timing = engine.timing
        budget = engine.max_num_batched_tokens - batch
        chunks: list[tuple[_Request, int]] = []
        model_s = 0.0
        host_s = 0.0
        for job in engine.prefill_queue:
            if budget <= 0:
                break
            request, done = job
            if done == _NOT_LOOKED_UP:
                # As vLLM's scheduler: the prompt is looked up when it is first scheduled, and
                # each chunk's full blocks are cached as it is scheduled (``allocate_slots``),
                # so a prompt scheduled after it (even in this step) hits them.
                request.cached_tokens = done = job[1] = self.cached(engine, request)
            n = min(request.spec.prompt_tokens - done, budget)
            self.store(engine, request, done + n)
            chunks.append((request, n))
            model_s += timing.prefill.chunk_seconds(done, n) - timing.prefill.a
            host_s += self.config.prefill_host_s_per_token * n
            if done + n >= request.spec.prompt_tokens:
                host_s += self.config.prefill_host_s
            budget -= n
        if chunks:
            model_s += timing.prefill.a
        steps = 1
        if decoding:
            mean_ctx = engine.context_sum / batch
            step_s = timing.decode.seconds_per_token(batch, mean_ctx)
            if not chunks and not engine.joining and not engine.pending:
                # Only decoding, nothing waiting to join: jump to the next sequence to finish.
                steps = max(1, decoding[0][0] - engine.steps)
            model_s += step_s
        wall = timing.wall(model_s)
        if host_s:
            wall += host_s  # (a prefill step: segments with chunks are one step long)
        duration = wall * steps
        # Sequences join only at a segment's start, so their first tokens come with its first
        # step (which an interrupted segment still completes), plus the hop to the router.
        for sequence in engine.new_joins:
            self.at(now + wall + self.config.leg_overhead_s, "first_token", sequence.request)
        engine.segment = (now, steps, wall, chunks)
        engine.busy_until = now + duration
        engine.epoch += 1
        self.at(engine.busy_until, "segment_end", (engine.id, engine.epoch))

    def interrupt(self, engine: _Engine) -> None:
        """New work arrived mid-jump: end the jump at the next step boundary instead."""
        if engine.segment is None or engine.busy_until is None:
            return
        start, steps, wall, chunks = engine.segment
        done = math.floor((self.clock.now() - start) / wall) + 1  # the step in progress ends
        if done >= steps:
            return  # the segment already ends at (or before) that boundary
        engine.segment = (start, done, wall, chunks)
        engine.busy_until = start + done * wall
        engine.epoch += 1
        self.at(engine.busy_until, "segment_end", (engine.id, engine.epoch))

    def finish_segment(self, engine: _Engine) -> None:
        assert engine.segment is not None and engine.busy_until is not None
        start, steps, wall, chunks = engine.segment
        now = self.clock.now()
        engine.busy_time += now - start
        first_step_end = start + wall
        # Decode: every sequence gained ``steps`` tokens.
        if engine.decoding:
            engine.new_joins = []
            engine.steps += steps
            engine.context_sum += engine.batch * steps
            while engine.decoding and engine.decoding[0][0] <= engine.steps:
                _, _, seq = heapq.heappop(engine.decoding)
                engine.context_sum -= (
                    seq.request.spec.prompt_tokens + seq.request.spec.output_tokens
                )
                engine.free_blocks += seq.request.decode_blocks
                seq.request.decode_blocks = 0
                # The last token, like the first, crosses the hop to the router.
                self.at(now + self.config.leg_overhead_s, "finished", seq.request)
        # Prefill chunks (only ever in single-step segments).
        for request, n in chunks:
            job = engine.prefill_queue[0] if engine.prefill_queue else None
            for item in engine.prefill_queue:
                if item[0] is request:
                    job = item
                    break
            assert job is not None
            job[1] += n
            if request.outcome == "abandoned":
                engine.prefill_queue.remove(job)
                self.free_leg(engine, request)
            elif job[1] >= request.spec.prompt_tokens:
                engine.prefill_queue.remove(job)
                if request.local:
                    self.local_prefilled(engine, request, first_step_end)
                else:
                    self.at(first_step_end + self.config.leg_overhead_s, "prefill_done", request)
        engine.segment = None
        engine.busy_until = None
        self.kick(engine)


def run_des(
    config: DesConfig, specs: Iterable[RequestSpec], models: dict[str, EngineModels] | None = None
) -> DesResult:
    started = time.monotonic()
    if models is None:
        # What a perfect profile of each engine would find; equal timings share one object.
        shared: dict[EngineModels, EngineModels] = {}
        models = {e: shared.setdefault(t, t.in_wall_seconds()) for e, t in config.timings.items()}
    sim = _Simulation(config, models)
    sim.run(specs)
    budgets: Budgets = config.fleet.budgets
    ttft, tpot, met = [], [], 0
    outcomes: list[str] = []
    for r in sim.requests:
        if r.outcome == "abandoned":
            outcomes.append("ttft_late")  # no first token within the client's patience
            continue
        if r.outcome != "ok" or r.first_token is None or r.last_token is None:
            outcomes.append("rejected" if r.outcome == "rejected" else "failed")
            continue
        t1 = r.first_token - r.spec.arrival
        ttft.append(t1)
        n = r.spec.output_tokens
        t2 = (r.last_token - r.first_token) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpot.append(t2)
        if t1 > budgets.ttft_s:
            outcomes.append("ttft_late")
        elif t2 > budgets.tpot_s or r.deadline_missed:
            outcomes.append("tpot_late")
        else:
            outcomes.append("met")
            met += 1
    answered = [r for r in sim.requests if r.outcome == "ok"]
    arrivals = [r.spec.arrival for r in sim.requests]
    ends = [r.last_token for r in sim.requests if r.last_token is not None]
    duration = (max(ends + arrivals) - min(arrivals)) if arrivals else 0.0
    return DesResult(
        offered=len(sim.requests),
        completed=sum(1 for r in sim.requests if r.outcome == "ok"),
        rejected=sum(1 for r in sim.requests if r.outcome == "rejected"),
        met_slo=met,
        deadline_missed=sum(1 for r in sim.requests if r.deadline_missed),
        abandoned=sum(1 for r in sim.requests if r.outcome == "abandoned"),
        duration_s=duration,
        flips=sim.flips,
        ttft=ttft,
        tpot=tpot,
        utilisation={
            e.id: (e.busy_time / duration if duration else 0.0) for e in sim.engines.values()
        },
        wall_s=time.monotonic() - started,
        outcomes=outcomes,
        prompt_tokens=sum(r.spec.prompt_tokens for r in answered),
        cached_tokens=sum(r.cached_tokens for r in answered),
        pulled_tokens=sum(r.pulled_tokens for r in answered),
    )
