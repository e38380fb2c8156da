"""A request's life through the fleet, as one pure object: admission (with the idle override),
the admission queue, pair selection, each leg's accounting on ``FleetState``, the breakers'
verdicts, the online corrections of the latency models and the demand record.

Two drivers run it, and nothing else decides any of this: ``narwhal.serve.pd`` runs the legs
over HTTP, the virtual-time simulator (``narwhal.fleetsim``) runs simulated ones. A routing
change is written here once, and the simulator measures what the router does.

A driver tells the lifecycle what happened, in order, and asks it what to do::

    ticket = lifecycle.arrive(...)
    verdict = lifecycle.admit(ticket)        # Admit: its first leg is already counted
    ...                                      # Queue: wait, then take it from lifecycle.drain()
    lifecycle.prefill_done(ticket, "ok")     # a P/D pair: the decode leg is counted from now
    lifecycle.first_token(ticket)
    lifecycle.finished(ticket, completion_tokens=n, complete=True)

A failed leg (``prefill_done(t, "failed")``, ``decode_failed(t, "failed")``) leaves the ticket
waiting for :meth:`Lifecycle.retry`; ``cancel`` releases whatever a ticket still holds (a client
that left, a router shutting down). Pure: the clock is the fleet state's, there is no I/O, and
what the router's metrics want to hear goes to an injected :class:`LifecycleObserver`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from narwhal.routing.admission import Admit, Queue, Reject, Verdict, admit
from narwhal.routing.breaker import BreakerState, CircuitBreaker
from narwhal.routing.fleet_state import EngineState, FleetState, Role
from narwhal.routing.output_length import OutputLengthEstimator
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.prefix import TEXT_BYTES_PER_TOKEN, TokenPrompt
from narwhal.routing.prompt_length import MAX_BYTES_PER_TOKEN, PromptLengthEstimator
from narwhal.routing.roles import DemandTracker
from narwhal.routing.scheduler import (
    NoPair,
    Pair,
    RequestShape,
    Scheduler,
    decode_load,
    prefill_load,
)

__all__ = [
    "QUEUE_RECHECK_S",
    "LegOutcome",
    "Lifecycle",
    "LifecycleObserver",
    "Phase",
    "Ticket",
]

# While requests wait in the admission queue, drivers decide on them again whenever a leg ends
# and at least this often.
QUEUE_RECHECK_S = 0.05

# new: not yet admitted, or waiting for a retry after a failed leg; queued: in the admission
# queue; prefill: its prefill leg runs; decode: its decode leg runs, no token yet; streaming:
# the decode leg has produced its first token; done: nothing held any more.
Phase = Literal["new", "queued", "prefill", "decode", "streaming", "done"]

# ok: the leg did its work; refused: the engine answered 4xx (the request's fault: the engine is
# fine and the request is over); failed: the engine failed (a retry may go elsewhere);
# deadline: the decode leg produced no first token within the first-token deadline.
LegOutcome = Literal["ok", "refused", "failed", "deadline"]
# How a hedge's leg ended when the slow leg it raced ended first (``Lifecycle.prefill_done``):
# cancelled by that end, or it had answered, been refused or failed in the same moment.
HedgeEnd = Literal["cancelled", "answered", "refused", "failed"]


@dataclass(eq=False, slots=True)
class HedgeRace:
    """A prefill leg a hedge took over that still runs (``Lifecycle.hedge_prefill``): its pair
    and when that was dispatched (its prefix claims are stamped so), and which leg has failed
    so far (each is counted once)."""

    slow: Pair
    slow_dispatched_at: float
    slow_failed: bool = False
    hedge_failed: bool = False
    # The slow leg's predicted prefill seconds and dispatch time in its engine's queue
    # (``EngineState.prefill_work``) when it was hedged: its engine still does that work.
    slow_work: tuple[float, float] | None = None
    # The hedge failed and the request waits on the slow leg: its prefill leg is counted in
    # flight, and its predicted work queued, on the slow leg's engine until the race ends.
    slow_carries: bool = False


@dataclass(eq=False)
class Ticket:
    """One request's routing state, from arrival to its end. Times are on the lifecycle's
    clock."""

    id: str
    arrival: float
    max_tokens: int
    # Exact when known: a prompt of token ids, or the count a prefill leg reported.
    prompt_tokens: int | None = None
    prompt_bytes: int = 0  # a text prompt's size, from which its length is estimated
    local_ok: bool = True  # False when the request needs what only a prefill leg returns
    prefix: tuple[int, ...] = ()  # the prompt's prefix keys (RequestShape.prefix)
    prefix_exact: bool = True  # keys of token ids (else of text: routing history only)
    # The prompt itself when it is token ids: engines that publish KV events are told to
    # expect it (PrefixIndex.expect).
    prefix_prompt: TokenPrompt | None = None
    phase: Phase = "new"
    pair: Pair | None = None
    queued_at: float | None = None
    waited_s: float | None = None  # time in the admission queue, once admitted from it
    idle_admitted: bool = False
    # Its decode leg is its engine's half-open breaker's probe; once its first token closed
    # the breaker, the breaker's success count then: a break before any other success opens
    # it again at once (the probe failed), not after as many breaks as a closed one takes.
    decode_probe: bool = False
    probe_cycle: int = 0  # the decode breaker's half_opened when this ticket took its probe
    # Its prefill leg is its engine's half-open breaker's probe: (engine, that breaker's
    # half_opened then). Only the probe's leaving frees the probe (a leg sent before the
    # breaker opened, refused or cancelled after, is not it).
    prefill_probe: tuple[str, int] | None = None
    rescued: bool = False  # a continuation's one rescue (``Lifecycle.rescue``) is spent
    closed_breaker: int | None = None
    # Engines that failed this request, which its retry avoids. Shared empty sets until one
    # does: two sets per request were 0.4 GB of a million-request simulation.
    failed_prefill: frozenset[str] = frozenset()
    failed_decode: frozenset[str] = frozenset()
    prefill_started: float = 0.0
    # When its pair was dispatched: what the prefix index recorded for it is stamped so, and
    # a failed leg takes back only that (``PrefixIndex.forget_routed``).
    dispatched_at: float = 0.0
    # A hedged prefill's race, until it ends (``prefill_done``): the slow leg's prefix claims
    # stand till then.
    race: HedgeRace | None = None
    # The prefill leg's predicted queue wait plus prefill, without the correction in force
    # when it was dispatched: what its duration is compared with when it ends.
    prefill_predicted_s: float | None = None
    decode_started: float = 0.0
    local_predicted_s: float | None = None  # likewise, a local leg's first token
    first_token_at: float | None = None
    batch_at_start: int = 0  # the decode engine's batch when this request joined it
    decode_area_at_start: float = 0.0  # its EngineState.decode_area() then
    # When its decode leg is predicted to end, as counted in its decode engine's decode_ends.
    decode_end: float | None = None

    @property
    def local(self) -> bool:
        return self.pair is not None and self.pair.local


class LifecycleObserver:
    """What the lifecycle reports as it goes (the router turns it into metrics). Every method
    is a no-op here: the simulator observes nothing."""

    def decided(self, ticket: Ticket, decision: Verdict | Pair | NoPair) -> None:
        """An admission verdict on ``ticket`` (``Queue`` included), or a retry's pick."""

    def in_flight(self, engine: str, role: Role, delta: int) -> None:
        """Legs of ``role`` in flight on ``engine`` moved by ``delta``."""

    def queue_depth(self, depth: int) -> None:
        """The admission queue now holds ``depth`` requests."""

    def leg_failed(self, engine: str, leg: Literal["prefill", "decode"]) -> None:
        """A leg failed on ``engine`` (counted against its breaker)."""

    def breaker(self, engine: str, state: BreakerState) -> None:
        """``engine``'s breaker is now in ``state`` (after a leg's verdict)."""

    def correction(self, engine: str, phase: str, ratio: float, drifted: bool) -> None:
        """The online correction of ``engine``'s ``phase`` model is now ``ratio``."""

    def capacity_freed(self) -> None:
        """A leg ended: queued requests may fit now."""


class Lifecycle:
    """Every request's life through one fleet. See the module docstring for the protocol."""

    def __init__(
        self,
        state: FleetState,
        scheduler: Scheduler,
        *,
        predictor: LatencyPredictor | None = None,
        demand: DemandTracker | None = None,
        observer: LifecycleObserver | None = None,
    ) -> None:
        self.state = state
        self.clock = state.clock
        self.scheduler = scheduler
        self.predictor = predictor
        self.demand = demand
        self.observer = observer or LifecycleObserver()
        self.policy = state.fleet.routing
        self.lengths = PromptLengthEstimator()
        self.outputs = OutputLengthEstimator()
        # The admission queue in arrival order (a dict: ordered, O(1) removal).
        self._queue: dict[Ticket, None] = {}

    # --- arrival and admission ----------------------------------------------------------

    def arrive(
        self,
        request_id: str,
        *,
        max_tokens: int,
        prompt_tokens: int | None = None,
        prompt_bytes: int = 0,
        local_ok: bool = True,
        arrival: float | None = None,
        prefix: tuple[int, ...] = (),
        prefix_exact: bool = True,
        prefix_prompt: TokenPrompt | None = None,
    ) -> Ticket:
        return Ticket(
            request_id,
            self.clock.now() if arrival is None else arrival,
            max_tokens,
            prompt_tokens,
            prompt_bytes,
            local_ok,
            prefix,
            prefix_exact,
            prefix_prompt,
        )

    @property
    def queued(self) -> int:
        """Requests waiting in the admission queue."""
        return len(self._queue)

    def _max_tokens(self, ticket: Ticket) -> int:
        """The engines cut max_tokens to what the prompt leaves of the context (vLLM 0.32),
        planned so: by the prompt's length once counted (validation cuts a token-id prompt's),
        a text prompt's by the least it can be (an estimate too high would cut it short and
        foresee its decode ending early)."""
        least = ticket.prompt_tokens
        if least is None:
            least = int(ticket.prompt_bytes / MAX_BYTES_PER_TOKEN)
        return max(1, min(ticket.max_tokens, self.state.fleet.model.max_model_len - least))

    def shape(self, ticket: Ticket) -> RequestShape:
        tokens = ticket.prompt_tokens
        if tokens is None:
            tokens = self.lengths.estimate(ticket.prompt_bytes)
        max_tokens = self._max_tokens(ticket)
        return RequestShape(
            tokens,
            max_tokens,
            self.clock.now() - ticket.arrival,
            ticket.local_ok,
            ticket.prefix,
            self.outputs.expected(max_tokens),
            self._tokens_per_key(ticket),
        )

    def _tokens_per_key(self, ticket: Ticket) -> float | None:
        """What one of the ticket's prefix keys stands for in tokens (``RequestShape``): a text
        prompt's keys are blocks of bytes, counted at the bytes per token the engines' reports
        taught (a tokenizer of one byte a token made a chat's hits read a quarter of their
        size where 4 bytes a token were assumed)."""
        index = self.state.prefix_index
        if ticket.prefix_exact or index is None:
            return None
        return index.block_size * TEXT_BYTES_PER_TOKEN / self.lengths.bytes_per_token

    def decode_holds(self, ticket: Ticket, engine_id: str, prompt_tokens: int) -> int:
        """The prompt's tokens ``engine_id`` holds in its prefix cache now, as the index sees
        them, claims in flight left out: what a decode leg sent now finds there and does not
        pull (blocks another handoff is pulling, this request's earlier choices' or a hedge's
        slow leg's, are not in vLLM's prefix cache until they land)."""
        if not ticket.prefix:
            return 0
        hits = self.state.cached_tokens(
            ticket.prefix, prompt_tokens, self._tokens_per_key(ticket), in_flight=False
        )
        return hits.get(engine_id, 0)

    def admit(self, ticket: Ticket) -> Verdict:
        """The first decision on a request. ``Admit``: its first leg is dispatched (counted on
        its engines) before this returns. ``Queue``: it waits in the admission queue, and
        :meth:`drain` decides again."""
        if ticket.phase != "new":
            raise ValueError(f"request {ticket.id} was already admitted ({ticket.phase})")
        return self._decide(ticket, in_queue=False)

    def drain(self) -> list[tuple[Ticket, Verdict]]:
        """Decide again on every queued request, oldest first (each admitted one is counted
        before the next is decided); returns those that left the queue, with their verdict."""
        left: list[tuple[Ticket, Verdict]] = []
        for ticket in list(self._queue):
            verdict = self._decide(ticket, in_queue=True)
            if not isinstance(verdict, Queue):
                left.append((ticket, verdict))
        return left

    def _decide(self, ticket: Ticket, in_queue: bool) -> Verdict:
        shape = self.shape(ticket)
        pick = self.scheduler.pick(self.state, shape)
        now = self.clock.now()
        waited = now - ticket.queued_at if in_queue and ticket.queued_at is not None else 0.0
        verdict = self._idle_override(
            pick, admit(pick, self.policy, len(self._queue), waited, in_queue=in_queue)
        )
        self.observer.decided(ticket, verdict)
        if isinstance(verdict, Queue):
            if not in_queue:
                ticket.phase = "queued"
                ticket.queued_at = now
                self._queue[ticket] = None
                self.observer.queue_depth(len(self._queue))
            return verdict
        if in_queue:
            del self._queue[ticket]
            ticket.waited_s = waited
            self.observer.queue_depth(len(self._queue))
        if isinstance(verdict, Admit):
            ticket.idle_admitted = verdict.idle
            if self.demand is not None:
                # A local prefill is no work for the prefill pool.
                pair = verdict.pair
                prefill_s = 0.0 if pair.local else pair.predicted_prefill_s or 0.0
                self.demand.record_start(prefill_s, shape.prompt_tokens, shape.max_tokens)
            self._dispatch(ticket, verdict.pair)
            return verdict
        ticket.phase = "done"
        if isinstance(verdict, Reject) and self.demand is not None:
            self.demand.record_rejected(shape, pick)  # demand all the same
        return verdict

    def _idle_override(self, pick: Pair | NoPair, verdict: Verdict) -> Verdict:
        """Admit the best over-budget pair when nothing at all is running on it.

        Predictions carry corrections learnt from the requests served (prefill and decode
        ratios, the handoff time). A burst can teach them values that put every pair over
        budget; then nothing is admitted, nothing is observed, and the fleet, idle, would
        reject every request for good. An idle pair takes the request instead: it delays no
        one, and what it measures corrects the predictions.
        """
        if isinstance(verdict, Admit) or not isinstance(pick, NoPair):
            return verdict
        pair = pick.over_budget
        if pair is None:
            return verdict
        p, d = self.state.engines[pair.prefill], self.state.engines[pair.decode]
        busy = prefill_load(self.state, p) or p.prefill_work
        if busy or decode_load(self.state, d) or d.pending_decode:
            return verdict
        return Admit(pair, idle=True)

    def retry(self, ticket: Ticket) -> Pair | NoPair:
        """After a failed leg: the best pair avoiding the engines that failed this request
        (over budget or not: it was admitted), dispatched; or why there is none."""
        if ticket.phase != "new":
            raise ValueError(f"request {ticket.id} has nothing to retry ({ticket.phase})")
        shape = self.shape(ticket)
        pick: Pair | NoPair = NoPair("")
        last = ticket.pair
        if (
            last is not None
            and not last.local
            and last.decode in ticket.failed_decode
            and last.prefill not in ticket.failed_prefill
        ):
            # The decode leg failed before its first token: it may have failed reading the KV
            # its prefill engine holds (a restarted engine's NIXL agent fails every decode
            # engine's read). The retry prefills again anyway, so another prefill engine comes
            # first; the same one, not counted as failed, when no other will do.
            avoid = ticket.failed_prefill | {last.prefill}
            pick = self.scheduler.pick(self.state, shape, avoid, ticket.failed_decode)
            if isinstance(pick, NoPair) and pick.over_budget is None:
                # No other decode engine can serve at all (one over budget is still taken
                # below): the same one, with another prefill engine, before giving up (a
                # prefill engine that died once it answered fails its decode engine's read,
                # which is not that engine's fault). The suspect prefill engine is not tried
                # again for this request (nor counted failed on its breaker); the retries stay
                # bounded by routing.max_decode_attempts.
                again = self.scheduler.pick(
                    self.state, shape, avoid, ticket.failed_decode - {last.decode}
                )
                if isinstance(again, Pair) and not again.local:
                    pick = again
                    ticket.failed_prefill = avoid
        if not isinstance(pick, Pair):
            pick = self.scheduler.pick(
                self.state, shape, ticket.failed_prefill, ticket.failed_decode
            )
        if isinstance(pick, NoPair) and pick.over_budget is not None:
            pick = pick.over_budget
        self.observer.decided(ticket, pick)
        if isinstance(pick, Pair):
            self._dispatch(ticket, pick)
        else:
            ticket.phase = "done"
        return pick

    def hedge_prefill(self, ticket: Ticket, budget_left_s: float) -> Pair | NoPair:
        """The prefill leg runs past its predicted time: the best pair with another prefill
        engine (never a local one: the hedge is a second prefill leg) whose predicted TTFT fits
        in ``budget_left_s``. When there is one, the slow leg is ended as failed (its breaker
        counts it; it keeps running outside the counts until one of the two answers) and the
        pair dispatched; when there is none, nothing changes and the slow leg runs on."""
        if ticket.phase != "prefill" or ticket.pair is None:
            raise ValueError(f"request {ticket.id} has no prefill leg running ({ticket.phase})")
        avoid = ticket.failed_prefill | {ticket.pair.prefill}
        shape = replace(self.shape(ticket), local_ok=False)
        # A half-open decode engine's probe this ticket holds must not hide that engine from
        # its own hedge's pick: given back for the pick, taken again if nothing changes.
        held = self.state.engines[ticket.pair.decode].breaker
        self._give_probe_back(ticket, held)
        pick = self.scheduler.pick(self.state, shape, avoid, ticket.failed_decode)
        if isinstance(pick, NoPair) and pick.over_budget is not None:
            pick = pick.over_budget
        refused: NoPair | None = None
        if isinstance(pick, NoPair) or pick.local:
            refused = pick if isinstance(pick, NoPair) else NoPair("no prefill engine to hedge on")
        elif pick.predicted_ttft_s is not None and pick.predicted_ttft_s > budget_left_s:
            refused = NoPair("no prefill engine meets the TTFT budget's remainder")
        if refused is not None:
            self._take_probe(ticket, held)
            return refused
        assert isinstance(pick, Pair)
        # The slow leg runs on (it may still answer first): ended in the counts, not in the
        # prefix index, whose claim on its engine stands until the race ends.
        slow_work = self.state.engines[ticket.pair.prefill].prefill_work.get(ticket.id)
        race = HedgeRace(ticket.pair, ticket.dispatched_at, slow_work=slow_work)
        self._settle_race(ticket, slow_holds=True)  # an earlier race's, had there been one
        # Its breaker counts it now (a hung engine stops getting work at once); the failed
        # leg is reported when the race shows it was one (prefill_done, slow_leg_failed).
        self._prefill_failed(ticket, runs_on=True, report=False)
        ticket.race = race
        self.observer.decided(ticket, pick)
        self._dispatch(ticket, pick)
        return pick

    def migrate(
        self,
        ticket: Ticket,
        request_id: str,
        *,
        prompt_tokens: int,
        max_tokens: int,
        prefix: tuple[int, ...] = (),
        prefix_prompt: TokenPrompt | None = None,
    ) -> tuple[Ticket, Pair | NoPair]:
        """A streaming request's decode leg broke (``decode_broke`` first): a new ticket for
        its continuation (``prompt_tokens``: the prompt and what was generated), avoiding the
        engines that failed it, dispatched on the best pair. Not admitted again: it was."""
        if ticket.phase != "done":
            raise ValueError(f"request {ticket.id} is still running ({ticket.phase})")
        follow = self.arrive(
            request_id,
            max_tokens=max_tokens,
            prompt_tokens=prompt_tokens,
            local_ok=True,
            arrival=ticket.arrival,
            prefix=prefix,
            prefix_prompt=prefix_prompt,
        )
        follow.failed_prefill = ticket.failed_prefill
        follow.failed_decode = ticket.failed_decode
        pick = self.retry(follow)
        if isinstance(pick, NoPair):
            rescue = self.rescue(follow)
            if rescue is not None:
                return follow, rescue
        return follow, pick

    def rescue(self, ticket: Ticket) -> Pair | None:
        """A continuation of a broken stream (``migrate``'s ticket) that no pair can take, or
        whose legs all failed (every decode engine failed it, or none is in the decode role):
        a local leg, dispatched, on the least loaded healthy engine its breaker lets through
        and that has not failed it, whatever its role, one permitted to decode first; None
        when there is none. Any vLLM engine can answer a request whole, and an answer half
        sent is worth more than a role's purity for one request. Once a ticket: a rescue
        that failed is not rescued again."""
        if ticket.phase not in ("new", "done"):
            raise ValueError(f"request {ticket.id} is still running ({ticket.phase})")
        if ticket.rescued:
            return None

        def rank(e: EngineState) -> tuple[bool, int]:
            return ("decode" not in e.roles, e.in_flight_decode + e.in_flight_prefill)

        candidates = [
            e
            for e in self.state.engines.values()
            if e.id not in ticket.failed_decode
            and e.id not in ticket.failed_prefill
            and e.healthy is not False
            and e.breaker.allows_request()
        ]
        if not candidates:
            return None
        best = min(candidates, key=rank)
        pick = Pair(best.id, best.id, 0.0, local=True)
        ticket.rescued = True
        ticket.phase = "new"
        self.observer.decided(ticket, pick)
        self._dispatch(ticket, pick)
        return pick

    def _dispatch(self, ticket: Ticket, pair: Pair) -> None:
        ticket.pair = pair
        ticket.decode_probe = False
        now = self.clock.now()
        ticket.dispatched_at = now
        d = self.state.engines[pair.decode]
        d.joins.note(now)
        index = self.state.prefix_index
        if index is not None and ticket.prefix:
            if not pair.prefix_looked:
                # A scheduler that routes without the index (v0, a baseline): what the engines
                # hold all the same, for the journal and the metrics. One that looked (v1) has
                # said what they hold, nothing included: not matched again.
                prompt_tokens = ticket.prompt_tokens or self.lengths.estimate(ticket.prompt_bytes)
                hits = self.state.cached_tokens(
                    ticket.prefix, prompt_tokens, self._tokens_per_key(ticket)
                )
                if hits:
                    pair = ticket.pair = replace(
                        pair,
                        cached_tokens=hits.get(pair.prefill, 0),
                        decode_cached_tokens=hits.get(pair.decode, 0),
                    )
            race = ticket.race
            if race is not None and pair.decode == race.slow.decode:
                # A hedge decoding where its slow leg would: that engine's claim on the prompt
                # is this request's own, in flight and not pulled yet; it holds what it did at
                # the slow leg's pick (the journal's kv_blocks_predicted and kv_bytes_moved).
                pair = ticket.pair = replace(
                    pair, decode_cached_tokens=race.slow.decode_cached_tokens
                )
            # Both engines will hold the prompt's blocks: the prefill engine computed them, the
            # decode engine pulled them (what engines that publish events say for themselves).
            index.record_routed(d.id, ticket.prefix, now, ticket.prefix_exact)
            if not pair.local:
                index.record_routed(pair.prefill, ticket.prefix, now, ticket.prefix_exact)
            if ticket.prefix_prompt is not None:
                size = index.block_size
                starts = [
                    cached // size
                    for engine, cached in (
                        (d.id, pair.decode_cached_tokens),
                        (pair.prefill, pair.cached_tokens),
                    )
                    if index.is_precise(engine)
                ]
                if starts:
                    index.expect(ticket.prefix_prompt, ticket.prefix, starts)
        if pair.local:
            self._begin_decode(ticket)
            return
        p = self.state.engines[pair.prefill]
        # The decode engine counts the request from now: it will join that batch.
        d.pending_decode += 1
        # A half-open decode engine's one probe is this request's from now, not from its
        # decode leg: every request picked during this prefill would otherwise have picked it
        # too (the breaker let through a burst of legs, each paying the first-token deadline).
        # Given back as the prefill ends (``_end_prefill``); the decode leg takes it again.
        self._take_probe(ticket, d.breaker)
        if pair.predicted_ttft_s is not None and pair.predicted_tpot_s is not None:
            # Its stay: the mean length of the answers recently completed (what it adds to a
            # batch over time, on average: the tail's high quantile, which its end is foreseen
            # by once it decodes, counted a burst of short answers as long ones, v1_max1024 in
            # bench/policies_des.py), at the TPOT budget's pace at least: its predicted TPOT
            # is a mean over a batch that those picked after it assume shrinks as foreseen;
            # foreseeing it gone that early let them assume the same, and the batch grew past
            # the budget under sustained overload (tests/reliability/test_overload.py).
            joins = now + pair.predicted_ttft_s
            tokens = self.outputs.mean(self._max_tokens(ticket))
            pace = max(pair.predicted_tpot_s, self.state.fleet.budgets.tpot_s)
            d.pending_spans[ticket.id] = (joins, joins + max(0.0, tokens - 1) * pace)
        ticket.prefill_probe = None
        if p.breaker.state is BreakerState.HALF_OPEN and not p.breaker.probe_in_flight:
            p.breaker.on_dispatch()
            ticket.prefill_probe = (p.id, p.breaker.half_opened)
        p.in_flight_prefill += 1
        self.observer.in_flight(p.id, "prefill", 1)
        ticket.phase = "prefill"
        ticket.prefill_started = now
        ticket.prefill_predicted_s = None
        if pair.predicted_prefill_s is not None:
            # Queue and prefill, without the correction in force now (see prefill_done); the
            # leg waits in the queue as the raw model's seconds.
            _, scale = (
                self.predictor.line(p.id, "prefill") if self.predictor is not None else (0.0, 1.0)
            )
            prefill_raw = pair.predicted_prefill_s / scale
            ticket.prefill_predicted_s = p.queued_prefill_s(now, scale) / scale + prefill_raw
            p.prefill_work[ticket.id] = (prefill_raw, now)

    # --- the prefill leg ----------------------------------------------------------------

    def prefill_done(
        self,
        ticket: Ticket,
        outcome: LegOutcome,
        *,
        prompt_tokens: int | None = None,
        hedge_ended: HedgeEnd | None = None,
    ) -> None:
        """The prefill leg ended. ``ok``: the decode leg is dispatched to the pair's decode
        engine (counted from now); ``prompt_tokens`` is the count the engine reported.

        ``hedge_ended``: the outcome (``ok`` or ``refused``) is a hedged prefill's slow leg's
        (``hedge_prefill``), which ended before its hedge; the hedge's own leg ended so:
        ``cancelled`` (no verdict on its engine), ``answered`` or ``refused`` (its engine is
        fine), ``failed`` (counted against its engine, once: see ``hedge_failed``). A hedge
        that lost is no sample of its engine's speed. The request decodes on the hedge's
        pair."""
        if ticket.phase != "prefill" or ticket.pair is None:
            raise ValueError(f"request {ticket.id} has no prefill leg running ({ticket.phase})")
        race = ticket.race
        by_slow_leg = hedge_ended is not None
        if by_slow_leg and (outcome not in ("ok", "refused") or race is None):
            raise ValueError(f"request {ticket.id} has no hedged leg that answered")
        if race is not None and not race.slow_failed:
            slow = self.state.engines[race.slow.prefill]
            if by_slow_leg:
                # The slow leg answered first: its engine was slow, not hung; the failure its
                # breaker counted at the hedge is cleared (a burst that hedged several legs of
                # a healthy engine opened its breaker and cut it off). A refusal clears it only
                # on a breaker still closed (``_refusal``).
                if outcome == "refused":
                    self._refusal(slow)
                else:
                    self._verdict(slow, ok=True)
            else:
                self.observer.leg_failed(slow.id, "prefill")  # it lost to its hedge
        # A leg cancelled keeps its claim (what it computed before the abort stays in the
        # engine's prefix cache); one that failed or was refused gives it back.
        self._settle_race(ticket, slow_holds=not (by_slow_leg and outcome == "refused"))
        hedge_counted = race is not None and race.hedge_failed
        if outcome in ("failed", "deadline"):
            self._prefill_failed(ticket, runs_on=False, counted=hedge_counted)
            return
        p = self._end_prefill(ticket)
        if hedge_counted:
            pass  # its failure was counted when it came
        elif hedge_ended == "failed":
            self._hedge_lost(ticket, p)
        elif hedge_ended == "cancelled":
            self._give_prefill_probe_back(ticket, p)
        elif hedge_ended == "refused" or (outcome == "refused" and not by_slow_leg):
            self._refusal(p)
            self._give_prefill_probe_back(ticket, p)  # it ran nothing: the next leg probes
        else:
            self._verdict(p, ok=True)
        if hedge_ended == "refused":
            self._forget_routed(ticket, p.id)
        if outcome == "refused":
            # Nothing was decoded, and nothing computed on the engine that refused.
            refused_here = () if by_slow_leg else (p.id,)
            self._forget_routed(ticket, ticket.pair.decode, *refused_here)
            ticket.phase = "done"
            return
        if prompt_tokens is not None and prompt_tokens > 0:
            if ticket.prompt_tokens is None:
                self.lengths.observe(ticket.prompt_bytes, prompt_tokens)
            ticket.prompt_tokens = prompt_tokens
        predicted = ticket.prefill_predicted_s
        if self.predictor is not None and predicted is not None and not by_slow_leg:
            ratio = self.predictor.observe(
                p.id,
                "prefill",
                predicted,
                self.clock.now() - ticket.prefill_started,
                uncorrected=True,
            )
            self._report_correction(p.id, "prefill", ratio)
        self._begin_decode(ticket)

    def slow_leg_failed(self, ticket: Ticket) -> None:
        """The slow leg of a hedged prefill failed while its hedge runs on (already counted
        against its engine when it was hedged): neither its prefill nor its decode engine will
        hold the prompt."""
        race = ticket.race
        if race is None or race.slow_failed or ticket.phase != "prefill":
            raise ValueError(f"request {ticket.id} has no hedged leg running")
        race.slow_failed = True
        self.observer.leg_failed(race.slow.prefill, "prefill")
        self._forget_slow(ticket, race, slow_holds=False)

    def hedge_failed(self, ticket: Ticket) -> None:
        """The hedge of a hedged prefill failed while its slow leg runs on: counted against the
        hedge's engine now (its client may leave before the slow leg ends), its claim on the
        prompt taken back; the request waits on the slow leg."""
        race = ticket.race
        if race is None or race.hedge_failed or ticket.phase != "prefill" or ticket.pair is None:
            raise ValueError(f"request {ticket.id} has no hedge running")
        race.hedge_failed = True
        hedge = self.state.engines[ticket.pair.prefill]
        self._hedge_lost(ticket, hedge)
        if not race.slow_failed:
            hedge.prefill_work.done(ticket.id, self.clock.now())
            if race.slow_work is not None:
                self.state.engines[race.slow.prefill].prefill_work[ticket.id] = race.slow_work
            self._move_prefill_leg(hedge.id, race.slow.prefill)
            race.slow_carries = True

    def _move_prefill_leg(self, from_engine: str, to_engine: str) -> None:
        """The request's prefill leg counted in flight on ``to_engine`` instead."""
        engines, observer = self.state.engines, self.observer
        engines[from_engine].in_flight_prefill -= 1
        observer.in_flight(from_engine, "prefill", -1)
        engines[to_engine].in_flight_prefill += 1
        observer.in_flight(to_engine, "prefill", 1)

    def _hedge_lost(self, ticket: Ticket, engine: EngineState) -> None:
        """A hedge failed: a verdict against its engine, which the request's retries avoid and
        which holds no part of the prompt."""
        self._verdict(engine, ok=False, leg="prefill")
        self._forget_routed(ticket, engine.id)
        ticket.failed_prefill = ticket.failed_prefill | {engine.id}

    def _settle_race(self, ticket: Ticket, *, slow_holds: bool) -> None:
        """A hedged prefill's race ended (or the request did): the slow leg's claims are
        settled (``_forget_slow``) unless its failure settled them already."""
        race = ticket.race
        if race is None:
            return
        ticket.race = None
        if race.slow_carries:
            # Back where the ticket's pair says, for the leg's end to be counted there; the
            # slow leg's queued work ends with the race.
            assert ticket.pair is not None
            self._move_prefill_leg(race.slow.prefill, ticket.pair.prefill)
            self.state.engines[race.slow.prefill].prefill_work.done(ticket.id, self.clock.now())
        if not race.slow_failed:
            self._forget_slow(ticket, race, slow_holds=slow_holds)

    def _forget_slow(self, ticket: Ticket, race: HedgeRace, *, slow_holds: bool) -> None:
        """The slow leg's decode engine gives back its claim (the request decodes on the
        hedge's pair, or not at all), and its prefill engine too unless it holds the prompt
        (``slow_holds``: it answered, or was cancelled with what it computed). Engines of the
        request's own pair keep theirs: the pair's outcome settles them."""
        slow = race.slow
        lost = {slow.decode} if slow_holds else {slow.prefill, slow.decode}
        if ticket.pair is not None:
            lost -= {ticket.pair.prefill, ticket.pair.decode}
        self._forget_routed(ticket, *lost, sent_at=race.slow_dispatched_at)

    def _prefill_failed(
        self, ticket: Ticket, *, runs_on: bool, counted: bool = False, report: bool = True
    ) -> None:
        """The prefill leg ended failed (``runs_on``: ended by a hedge, its request still
        running on the engine), counted against its engine (unless ``counted`` already), and
        reported as a failed leg unless not ``report``."""
        assert ticket.pair is not None
        p = self._end_prefill(ticket)
        if not counted:
            self._verdict(p, ok=False, leg="prefill", report=report)
        if not runs_on:
            # Neither engine will hold the prompt as the dispatch recorded: the prefill was
            # not done, so the decode engine pulls nothing.
            self._forget_routed(ticket, p.id, ticket.pair.decode)
        ticket.failed_prefill = ticket.failed_prefill | {p.id}
        ticket.phase = "new"

    def _end_prefill(self, ticket: Ticket) -> EngineState:
        assert ticket.pair is not None
        p = self.state.engines[ticket.pair.prefill]
        d = self.state.engines[ticket.pair.decode]
        d.pending_decode -= 1
        # The probe held since the dispatch: a decode leg that follows at once takes it again
        # (``_begin_decode``); a failed or cancelled prefill leaves it to the next request.
        self._give_probe_back(ticket, d.breaker)
        d.pending_spans.pop(ticket.id, None)
        p.in_flight_prefill -= 1
        p.prefill_work.done(ticket.id, self.clock.now())
        self.observer.in_flight(p.id, "prefill", -1)
        self.observer.capacity_freed()
        return p

    # --- the decode leg -----------------------------------------------------------------

    def _begin_decode(self, ticket: Ticket) -> None:
        assert ticket.pair is not None
        pair = ticket.pair
        d = self.state.engines[pair.decode]
        breaker = d.breaker
        self._take_probe(ticket, breaker)
        breaker.on_dispatch()  # a leg sent to a half-open breaker whose probe is another's
        now = self.clock.now()
        d.add_decode(now, 1)
        self.observer.in_flight(d.id, "decode", 1)
        ticket.phase = "decode"
        ticket.decode_started = now
        ticket.local_predicted_s = None
        if pair.local:
            predicted = pair.predicted_prefill_s or 0.0
            # A local leg's first token against the predicted TTFT, without the correction in
            # force now, corrects local legs on this engine.
            if self.predictor is not None and self.predictor.has(d.id):
                ticket.local_predicted_s = self.predictor.uncorrected(
                    d.id, "local", pair.predicted_ttft_s or 0.0
                )
            # Queued local prefill work (the next local pick waits behind it) and the stall
            # history the scheduler weighs against this engine's batch.
            d.prefill_work[ticket.id] = (predicted, now)
            d.note_local_prefill(now, predicted)

    def first_token(self, ticket: Ticket) -> None:
        """The decode leg's first token reached the router."""
        if ticket.phase != "decode" or ticket.pair is None:
            raise ValueError(f"request {ticket.id} has no decode leg waiting ({ticket.phase})")
        now = self.clock.now()
        d = self.state.engines[ticket.pair.decode]
        if ticket.local:
            d.prefill_work.done(ticket.id, now)
        # The leg's verdict is its end (``finished``, ``decode_broke``): a success here would
        # reset what the engine's last broken stream counted, and an engine that breaks every
        # stream after its first token would never have its breaker opened. Only a half-open
        # breaker's probe closes it now: it answered, and others need not wait for its end.
        if ticket.decode_probe and d.breaker.state is BreakerState.HALF_OPEN:
            self._verdict(d, ok=True)
            ticket.closed_breaker = d.breaker.successes
        else:
            d.answered_at = now
        ticket.phase = "streaming"
        ticket.first_token_at = now
        after = now - ticket.decode_started
        predictor = self.predictor
        if predictor is not None:
            if ticket.local:
                if ticket.local_predicted_s:
                    predictor.observe(
                        d.id, "local", ticket.local_predicted_s, after, uncorrected=True
                    )
            elif ticket.pair.predicted_tpot_s is not None:
                # What is left after the predicted first step is the KV transfer.
                predictor.observe_handoff(d.id, after, ticket.pair.predicted_tpot_s)
        ticket.batch_at_start = self.state.decode_batch(d)
        ticket.decode_area_at_start = d.decode_area(now)
        if ticket.pair.predicted_tpot_s is not None:
            self._foresee_end(ticket, d, now)

    def decode_failed(self, ticket: Ticket, outcome: LegOutcome) -> None:
        """The decode leg ended before its first token: ``failed`` or ``deadline`` (the
        engine's fault: a retry may go elsewhere), or ``refused`` (the request is over)."""
        if ticket.phase != "decode" or ticket.pair is None:
            raise ValueError(f"request {ticket.id} has no decode leg waiting ({ticket.phase})")
        d = self._end_decode(ticket)
        if outcome == "refused":
            self._refusal(d)
            self._give_probe_back(ticket, d.breaker)  # it ran nothing: the next leg probes
            ticket.phase = "done"
            return
        self._verdict(d, ok=False, leg="decode")
        # Before its first token: it may not have pulled the prompt's KV.
        self._forget_routed(ticket, d.id)
        ticket.failed_decode = ticket.failed_decode | {d.id}
        ticket.phase = "new"

    def decode_broke(self, ticket: Ticket) -> None:
        """The decode stream broke after its first token (the engine failed, closed it or
        stalled): the leg ends, counted failed on its engine."""
        if ticket.phase != "streaming" or ticket.pair is None:
            raise ValueError(f"request {ticket.id} is not streaming ({ticket.phase})")
        d = self._end_decode(ticket)
        if ticket.closed_breaker is not None and ticket.closed_breaker == d.breaker.successes:
            d.breaker.trip()
        self._verdict(d, ok=False, leg="decode")
        ticket.failed_decode = ticket.failed_decode | {d.id}
        ticket.phase = "done"

    def finished(
        self,
        ticket: Ticket,
        *,
        completion_tokens: int | None = None,
        complete: bool = False,
        answered: bool = True,
    ) -> None:
        """The decode stream is over; ``complete``: it delivered its whole answer of
        ``completion_tokens``, whose time per output token after the first (from the first
        token's arrival to now) then corrects the decode model: against the model at the batch
        the request actually shared (the mean of the engine's batch when it joined and when it
        left; comparing with the batch at pick time would read growing load as a slow
        engine)."""
        if ticket.phase != "streaming" or ticket.pair is None:
            raise ValueError(f"request {ticket.id} is not streaming ({ticket.phase})")
        d = self._end_decode(ticket)
        ticket.phase = "done"
        if answered and d.breaker.state is BreakerState.CLOSED:
            # Resets the count of failures. Not on a breaker that opened while this stream ran
            # (begun before): that would close it without its cool-off and half-open probe;
            # nor for a stream cut short by the router or its client (``answered`` False),
            # which says nothing of the engine.
            self._verdict(d, ok=True)
        else:
            d.answered_at = self.clock.now()
        predictor = self.predictor
        n = completion_tokens or 0
        if complete and n > 0:
            self.outputs.observe(n)
        first = ticket.first_token_at
        if not complete or predictor is None or n < 2 or first is None or not predictor.has(d.id):
            return
        now = self.clock.now()
        if now <= first:
            return
        tpot_s = (now - first) / (n - 1)
        # The batch it shared, averaged over its life (itself included): the mean of the
        # batch when it joined and when it left read a burst's answers, which end together,
        # as decoding in a batch a fifth smaller than they did (live, 8,192/128 at capacity).
        batch = (d.decode_area(now) - ticket.decode_area_at_start) / (now - first)
        context = (ticket.prompt_tokens or 0) + n / 2
        expected = predictor.decode(d.id, max(1.0, batch), context).seconds
        # Local prefills sent to this engine while the request decoded stalled its steps: part
        # of what was expected, not a slower engine (spread over its tokens).
        expected += d.recent_local_prefill_s(first) / (n - 1)
        ratio = predictor.observe(d.id, "decode", expected, tpot_s)
        self._report_correction(d.id, "decode", ratio)

    def _end_decode(self, ticket: Ticket) -> EngineState:
        assert ticket.pair is not None
        d = self.state.engines[ticket.pair.decode]
        d.add_decode(self.clock.now(), -1)
        self._forget_end(ticket)
        if ticket.local:
            d.prefill_work.done(ticket.id, self.clock.now())
        self.observer.in_flight(d.id, "decode", -1)
        self.observer.capacity_freed()
        return d

    # --- the end, whatever it was ---------------------------------------------------------

    def cancel(self, ticket: Ticket, *, prefill_answered: bool = False) -> None:
        """Release whatever the ticket still holds, with no verdict on any engine: the client
        left, or the router stops. Idempotent. ``prefill_answered``: the prefill leg answered
        in the moment the request was cancelled (before its decode leg was sent): its engine
        gets its success."""
        phase = ticket.phase
        ticket.phase = "done"
        if phase == "queued":
            self._queue.pop(ticket, None)
            self.observer.queue_depth(len(self._queue))
        elif phase == "prefill":
            hedge_counted = ticket.race is not None and ticket.race.hedge_failed
            # The engines abort it: a prefill engine keeps what it computed before (its claim
            # stays), a decode engine pulled nothing.
            self._settle_race(ticket, slow_holds=True)
            p = self._end_prefill(ticket)
            if prefill_answered:
                self._verdict(p, ok=True)
            elif not hedge_counted:  # else its verdict is in
                self._give_prefill_probe_back(ticket, p)
            assert ticket.pair is not None
            self._forget_routed(ticket, ticket.pair.decode)
        elif phase in ("decode", "streaming"):
            # Only the probe's departure frees the probe: another leg's says nothing.
            self._give_probe_back(ticket, self._end_decode(ticket).breaker)

    # --- helpers ------------------------------------------------------------------------

    def _take_probe(self, ticket: Ticket, breaker: CircuitBreaker) -> None:
        """The ticket becomes the half-open decode breaker's one probe, when it is free."""
        if breaker.state is BreakerState.HALF_OPEN and not breaker.probe_in_flight:
            breaker.on_dispatch()
            ticket.decode_probe = True
            ticket.probe_cycle = breaker.half_opened

    def _give_probe_back(self, ticket: Ticket, breaker: CircuitBreaker) -> None:
        """The ticket's probe, if it holds one, is free again: only in the cool-off it was
        taken in (a breaker that opened again and went half-open since has another probe)."""
        if ticket.decode_probe:
            ticket.decode_probe = False
            if breaker.half_opened == ticket.probe_cycle:
                breaker.on_abandon()

    def _give_prefill_probe_back(self, ticket: Ticket, p: EngineState) -> None:
        """The ticket's prefill leg on ``p`` ended with no verdict: if it was the half-open
        breaker's probe, taken in this cool-off, the next leg may probe."""
        held, ticket.prefill_probe = ticket.prefill_probe, None
        if held == (p.id, p.breaker.half_opened):
            p.breaker.on_abandon()

    def _foresee_end(self, ticket: Ticket, d: EngineState, first_token_at: float) -> None:
        """Count on ``d`` when the ticket's decode leg, which sent its first token at
        ``first_token_at``, is predicted to end: after the rest of the tokens it is expected
        to generate (``narwhal.routing.output_length``) at the pace below. Only for a leg
        that decodes: one still in its prefill leg is foreseen by a span
        (``EngineState.pending_spans``), not an end the batch count leaves out."""
        assert ticket.pair is not None
        # At the pace of the batch it decodes in now (``batch_at_start``, itself included), or
        # the TPOT budget's if slower: the TPOT predicted at its pick assumed the batch would
        # shrink as foreseen, and ends foreseen that early let the next requests assume the
        # same, a loop (under sustained overload, tests/reliability/test_overload.py, the
        # batch reached 7 where the budget allows 4, and the admitted met their budgets 23%
        # of the time). Under the budget's pace, the batch may grow to the budget before it
        # ends: its end is foreseen late rather than early. Over it, as late as it comes.
        pace = ticket.pair.predicted_tpot_s or 0.0
        predictor = self.predictor
        max_tokens = self._max_tokens(ticket)
        if predictor is not None and predictor.has(d.id):
            context = (ticket.prompt_tokens or 0) + max_tokens / 2
            # predictor.decode(...).seconds, without its flags: this runs for every request
            model = predictor.models[d.id].decode
            pace = model.seconds_per_token(max(1, ticket.batch_at_start), context)
            pace *= predictor.ratio(d.id, "decode")
        tpot = max(pace, self.state.fleet.budgets.tpot_s)
        tokens = self.outputs.expected(max_tokens)
        end = first_token_at + max(0, tokens - 1) * tpot
        d.foresee_decode_end(end)
        ticket.decode_end = end

    def _forget_end(self, ticket: Ticket) -> None:
        if ticket.decode_end is not None and ticket.pair is not None:
            self.state.engines[ticket.pair.decode].forget_decode_end(ticket.decode_end)
            ticket.decode_end = None

    def _forget_routed(self, ticket: Ticket, *engines: str, sent_at: float | None = None) -> None:
        """A failed leg: what the dispatch recorded the engines would hold, forgotten (the
        ticket's current dispatch, or the one at ``sent_at``)."""
        index = self.state.prefix_index
        if index is not None and ticket.prefix:
            stamp = ticket.dispatched_at if sent_at is None else sent_at
            for engine in set(engines):
                index.forget_routed(engine, ticket.prefix, stamp, ticket.prefix_exact)

    def _verdict(
        self,
        engine: EngineState,
        ok: bool,
        leg: Literal["prefill", "decode"] = "decode",
        report: bool = True,
    ) -> None:
        if ok:
            engine.breaker.record_success()
            engine.answered_at = self.clock.now()
        else:
            engine.breaker.record_failure()
            if report:
                self.observer.leg_failed(engine.id, leg)
        self.observer.breaker(engine.id, engine.breaker.state)

    def _refusal(self, engine: EngineState) -> None:
        """The engine refused a leg (a 4xx: the request is at fault): it answers, which
        clears the failures a closed breaker has counted, but it computed nothing, so an open
        or half-open breaker waits for a leg that ran (a leg sent before the breaker opened,
        or a bad request as the half-open probe, must not close it: the engine may fail every
        leg it runs while its front end validates requests)."""
        if engine.breaker.state is BreakerState.CLOSED:
            self._verdict(engine, ok=True)  # which vouches for it to slow /health probes too

    def _report_correction(self, engine: str, phase: str, ratio: float) -> None:
        assert self.predictor is not None
        self.observer.correction(engine, phase, ratio, self.predictor.drifted(engine, phase))
