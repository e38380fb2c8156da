"""The P/D request path over HTTP: run the legs the routing lifecycle dispatches (the prefill
leg, then the decode leg under the first-token deadline), retry what can be retried, and hand
back a decode stream positioned after its first event. Every routing decision and every count on
the engines is the lifecycle's (``narwhal.routing.lifecycle``): this module reports what the
legs did. Relaying the stream to the client lives in ``relay.py``.

A local pick (scheduler v1 with ``routing.local_prefill``) skips the prefill leg: the decode
engine gets one ordinary request (no ``kv_transfer_params``), prefills it itself and streams it
back through the same decode-leg code, deadline, retries and relay."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from narwhal.contract import FleetContract
from narwhal.engines.client import EnginePool
from narwhal.engines.context import DEFAULT_COMPLETIONS_MAX_TOKENS
from narwhal.engines.legs import decode_leg_body, prefill_leg_body, release_leg_body
from narwhal.engines.sse import SseEventStream
from narwhal.engines.transport import EngineResponse, EngineTransportError, read_prefix
from narwhal.metrics import RouterMetrics
from narwhal.routing.admission import Admit, Queue, Reject, Verdict
from narwhal.routing.breaker import BreakerState
from narwhal.routing.fleet_state import Role
from narwhal.routing.lifecycle import (
    QUEUE_RECHECK_S,
    HedgeEnd,
    Lifecycle,
    LifecycleObserver,
    Ticket,
)
from narwhal.routing.prefix import prompt_keys, token_prompt
from narwhal.routing.scheduler import NoPair, Pair
from narwhal.serve.errors import (
    AdmissionRejected,
    EngineRefused,
    FirstTokenDeadlineExceeded,
    NoEligiblePair,
    RouterError,
    UpstreamFailed,
)
from narwhal.serve.record import RequestRecord
from narwhal.serve.stalls import StallSweeper
from narwhal.serve.token_ids import cut_prompt_ids
from narwhal.serve.validation import ClientRequest

__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETIONS_MAX_TOKENS",
    "DecodeStream",
    "MetricsObserver",
    "PDRouter",
]

log = logging.getLogger(__name__)

_MAX_ERROR_BODY = 64 * 1024
# The statuses of an engine refusing the request itself (its fields), not the caller or the
# route: after one a release leg, which carries none of the decode leg's own fields, is served.
_REFUSED_REQUEST = frozenset((400, 422))
# What a chat request without a max_tokens is assumed to generate, for scheduling only.
DEFAULT_CHAT_MAX_TOKENS = 256


def _legs(count: int) -> str:
    return "1 leg" if count == 1 else f"{count} legs"


class _LegFailure(Exception):
    """A leg failed in a way another engine may not: connection, 5xx, timeout, bad answer."""

    def __init__(self, message: str, *, deadline: bool = False, engine: str | None = None) -> None:
        super().__init__(message)
        self.deadline = deadline
        # The engine the leg ran on, where the pair it was picked with may not say it (a
        # hedged prefill's legs run on two engines).
        self.engine = engine


class _EngineClientError(Exception):
    """The engine refused the request itself (4xx): the client's error, not the engine's."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body


@dataclass
class _Tried:
    """What one opening of a decode stream has tried so far: its failed legs, whether a
    first-token deadline passed, the last error, and where its attempts begin in the record
    (a continuation's opening has its own)."""

    opened_at: int
    prefill_failures: int = 0
    decode_failures: int = 0
    deadline_hit: bool = False
    last_error: str = "no attempt"
    # A migration's continuation: its first token came long ago (no TTFT budget is left to
    # bound its retries), and once its legs are spent a local leg on any healthy engine
    # rescues it (``Lifecycle.rescue``: once a ticket, ``migrate``'s own rescue included).
    continuation: bool = False


@dataclass
class _PrefillLeg:
    """Whether a prefill leg reports its end to the lifecycle: a leg that was hedged no longer
    does (the race between it and its hedge reports the winner)."""

    counted: bool = True


@dataclass(eq=False)
class _HedgeRace:
    """A prefill leg running inline in ``task`` and, once hedged, its hedge (``second``)."""

    task: asyncio.Task[Any]
    first: _PrefillLeg
    pair: Pair  # the pair the request holds: the hedge's once there is one
    second: asyncio.Future[tuple[Any, int | None, list[int] | None]] | None = None
    # The hedge, when its end decided the race (it answered or refused before the slow leg).
    decided: asyncio.Future[tuple[Any, int | None, list[int] | None]] | None = None
    closed: bool = False  # the race is over: nothing may interrupt the task any more


def _hedge_end(hedge: asyncio.Future[Any]) -> HedgeEnd:
    """How a hedge ended when the slow leg it raced ended first: cancelled by that end, unless
    it had already answered, been refused or failed (its own callback not yet run)."""
    if not hedge.done() or hedge.cancelled():
        return "cancelled"
    exc = hedge.exception()
    if exc is None:
        return "answered"
    return "refused" if isinstance(exc, _EngineClientError) else "failed"


@dataclass
class DecodeStream:
    engine: str
    response: EngineResponse
    events: SseEventStream
    # The first event with a choice, and the events that arrived with it (relayed next).
    first_events: list[bytes]
    prefill_prompt_tokens: int | None
    ticket: Ticket
    # The prompt's token ids as the prefill engine returned them (only a prefill leg has them).
    prompt_token_ids: list[int] | None = None
    # The inside of the list of prompt ids the decode engine returned on its first chunk, cut
    # out of it (``serve.token_ids.cut_prompt_ids``): a migration parses them.
    decode_prompt_ids: bytes | None = None
    # A migration's continuation: the tokens the legs before it generated.
    completion_offset: int = 0
    # The engine broke the stream after its first token and it was not continued elsewhere (a
    # server error event, a malformed event, the connection cut): a failure on its engine. An
    # error event of a 4xx (the request's fault, as vLLM refuses some fields mid-stream) is not.
    broke: bool = False
    # The engine cut the stream after the answer's finish reason (``relay.cut_after_answer``):
    # the answer is whole, but a connection that broke is no success on the engine either.
    cut: bool = False

    async def aclose(self, drain: bool = False) -> None:
        """Close the upstream response. After a complete stream, ``drain`` reads the closing
        chunk first so the connection goes back to the pool instead of being dropped."""
        if drain:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    while await self.events.next_batch():
                        pass
        await self.response.aclose()


class MetricsObserver(LifecycleObserver):
    """The lifecycle's reports as the router's metrics; a leg's end also wakes the admission
    queue."""

    def __init__(self, metrics: RouterMetrics, capacity: asyncio.Event) -> None:
        self.metrics = metrics
        self.capacity = capacity

    def in_flight(self, engine: str, role: Role, delta: int) -> None:
        self.metrics.in_flight.labels(engine, role).inc(delta)

    def queue_depth(self, depth: int) -> None:
        self.metrics.admission_queue.set(depth)

    def leg_failed(self, engine: str, leg: Literal["prefill", "decode"]) -> None:
        self.metrics.leg_failures.labels(engine, leg).inc()

    def breaker(self, engine: str, state: BreakerState) -> None:
        self.metrics.breaker_state.labels(engine).set(int(state))

    def correction(self, engine: str, phase: str, ratio: float, drifted: bool) -> None:
        self.metrics.latency_ratio.labels(engine, phase).set(ratio)
        self.metrics.profile_drift.labels(engine, phase).set(1 if drifted else 0)

    def capacity_freed(self) -> None:
        self.capacity.set()


class PDRouter:
    """Runs each request's legs over HTTP as its lifecycle dispatches them."""

    def __init__(
        self,
        fleet: FleetContract,
        lifecycle: Lifecycle,
        engines: EnginePool,
        metrics: RouterMetrics,
        prefill_timeout_s: float,
        capacity: asyncio.Event,
    ) -> None:
        """``capacity`` is set whenever a leg ends (the lifecycle's observer sets it): the
        admission queue is decided on again then, and at least every ``QUEUE_RECHECK_S``."""
        self.fleet = fleet
        self.lifecycle = lifecycle
        self.state = lifecycle.state
        self.engines = engines
        self.metrics = metrics
        self.prefill_timeout_s = prefill_timeout_s
        self._capacity = capacity
        self._waiters: dict[Ticket, asyncio.Future[Verdict]] = {}
        self._pump: asyncio.Task[None] | None = None
        # Release legs under way (``_start_release``): held here, so that one whose request was
        # cancelled still runs to its end. Once settled (shutdown), none is sent any more.
        self._releases: set[asyncio.Task[str | None]] = set()
        self._releases_settled = False
        # Every migratable stream's stall deadline (stall_s), on one timer.
        self.stalls = StallSweeper(fleet.routing.migration.stall_floor_s / 4)

    async def settle_releases(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the release legs under way: at shutdown, before the
        engines' connections close under them. Those still running then are cancelled (and
        counted stranded)."""
        self._releases_settled = True
        if not self._releases:
            return
        _, pending = await asyncio.wait(set(self._releases), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def ticket(self, request: ClientRequest, record: RequestRecord) -> Ticket:
        default_max = DEFAULT_CHAT_MAX_TOKENS if request.chat else DEFAULT_COMPLETIONS_MAX_TOKENS
        index = self.state.prefix_index
        keys = prompt_keys(request.body, request.chat, index.block_size) if index else ()
        return self.lifecycle.arrive(
            record.id,
            max_tokens=request.max_tokens or default_max,
            prompt_tokens=request.prompt_tokens_exact,
            prompt_bytes=request.prompt_bytes,
            # The prompt's token ids come back from a prefill leg only.
            local_ok=not request.body.get("return_token_ids"),
            arrival=record.arrival_mono,
            prefix=keys,
            prefix_exact=request.prompt_tokens_exact is not None,
            prefix_prompt=token_prompt(request.body) if keys and not request.chat else None,
        )

    async def open(
        self, request: ClientRequest, record: RequestRecord, token_ids: bool = False
    ) -> DecodeStream:
        """Run legs until a decode stream has produced its first event, or raise RouterError.
        Whatever way this ends short of a stream, the request holds nothing on any engine.
        ``token_ids``: the decode leg asks for them (``return_token_ids``), so that the request
        can be migrated (``serve.migration``)."""
        ticket = self.ticket(request, record)
        try:
            return await self._open(ticket, request, record, token_ids=token_ids)
        except BaseException:
            self.lifecycle.cancel(ticket)  # a no-op once the lifecycle has ended it
            raise

    def finish(self, stream: DecodeStream, record: RequestRecord) -> None:
        """The stream is over (its record closed): its decode leg ends, and a completed
        answer's time per token corrects the decode model. A leg a failed migration already
        ended is left as it is."""
        if stream.ticket.phase != "streaming":
            return
        if stream.broke:
            self.lifecycle.decode_broke(stream.ticket)
            return
        if record.prompt_tokens is not None and not stream.completion_offset:
            stream.ticket.prompt_tokens = record.prompt_tokens
        completion = record.completion_tokens
        if completion is not None:
            completion -= stream.completion_offset
        self.lifecycle.finished(
            stream.ticket,
            completion_tokens=completion,
            complete=record.outcome == "ok",
            # Only a whole answer is a success on the engine: a stream the router or its
            # client cut (a choice's sibling broke, the client left, a drain), or the engine
            # after its last token, says nothing.
            answered=record.outcome == "ok" and not stream.cut,
        )

    def stall_s(self, stream: DecodeStream) -> float:
        """How long ``stream`` may go without a token before it counts as stalled: a multiple
        of its predicted time per output token (the budget's without one), with a floor."""
        migration = self.fleet.routing.migration
        pair = stream.ticket.pair
        tpot = pair.predicted_tpot_s if pair is not None else None
        if tpot is None:
            tpot = self.fleet.budgets.tpot_s
        return max(migration.stall_floor_s, migration.stall_tpot_factor * tpot)

    async def continue_on(
        self,
        stream: DecodeStream,
        request: ClientRequest,
        record: RequestRecord,
        reason: str,
        migration: int,
        completion_offset: int,
    ) -> DecodeStream:
        """``stream`` broke after its first token: its leg ends as failed on its engine and
        ``request`` (``serve.migration.continuation_request``) runs on another pair, without
        admission (the request was admitted). The record keeps the first legs' engines and
        times (the client's TTFT was theirs); the continuation's legs are its attempts. Raises
        RouterError when no pair could continue it."""
        self.lifecycle.decode_broke(stream.ticket)
        await stream.aclose()
        record.attempt(
            "migration", stream.engine, reason, after_tokens=completion_offset, number=migration
        )
        index = self.state.prefix_index
        # A continuation request (continuation_request) has both: a token-id prompt, a cap.
        assert request.prompt_tokens_exact is not None and request.max_tokens is not None
        ticket, pick = self.lifecycle.migrate(
            stream.ticket,
            f"{record.id}-m{migration}",
            prompt_tokens=request.prompt_tokens_exact,
            max_tokens=request.max_tokens,
            prefix=prompt_keys(request.body, False, index.block_size) if index else (),
            prefix_prompt=token_prompt(request.body) if index else None,
        )
        if isinstance(pick, NoPair):
            raise UpstreamFailed("decode_failed", f"no pair to continue on: {pick.reason}")
        kept = record.legs_snapshot()
        try:
            follow = await self._open(
                ticket, request, record, pair=pick, token_ids=True, continuation=True
            )
        except BaseException:
            self.lifecycle.cancel(ticket)
            raise
        finally:
            record.restore_legs(kept)
        # Counted once it goes on: a continuation no pair could take is the client's error.
        self.metrics.migrations.labels(stream.engine, reason).inc()
        follow.completion_offset = completion_offset
        return follow

    # --- admission ----------------------------------------------------------------------

    async def _admit(self, ticket: Ticket, record: RequestRecord) -> Pair:
        """The first decision, under admission control: reject, or wait in the queue."""
        verdict = self.lifecycle.admit(ticket)
        queued_at: float | None = None
        if isinstance(verdict, Queue):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[ticket] = waiter
            if self._pump is None or self._pump.done():
                self._pump = asyncio.create_task(self._run_queue())
            queued_at = self.lifecycle.clock.now()
            try:
                verdict = await waiter
            except asyncio.CancelledError:
                self._left_queue(record, queued_at)  # its client left while it waited
                raise
            finally:
                self._waiters.pop(ticket, None)
        if isinstance(verdict, Admit):
            pair = verdict.pair
            if verdict.idle:
                record.attempt(
                    "admission", pair.prefill, "idle_pair", predicted_ttft_s=pair.predicted_ttft_s
                )
            if ticket.waited_s is not None:
                record.attempt(
                    "admission", pair.prefill, "queued", waited_s=round(ticket.waited_s, 6)
                )
            return pair
        if queued_at is not None:
            self._left_queue(record, queued_at)
        if isinstance(verdict, Reject):
            self.metrics.admission_rejections.labels(verdict.reason).inc()
            raise AdmissionRejected(verdict.reason, verdict.message)
        raise NoEligiblePair(verdict.message)

    def _left_queue(self, record: RequestRecord, queued_at: float) -> None:
        """A request that waited in the admission queue and left it unadmitted (turned away,
        or its client gone) says how long it waited, as an admitted one does: no engine."""
        waited = round(self.lifecycle.clock.now() - queued_at, 6)
        record.attempt("admission", "", "queued", waited_s=waited, admitted=False)

    async def _run_queue(self) -> None:
        """Decide on the queued requests whenever a leg ends, and at least every
        ``QUEUE_RECHECK_S`` on the lifecycle's clock, until none waits."""
        while self._waiters:
            self._capacity.clear()
            freed = asyncio.ensure_future(self._capacity.wait())
            recheck = asyncio.ensure_future(self.lifecycle.clock.sleep(QUEUE_RECHECK_S))
            try:
                await asyncio.wait((freed, recheck), return_when=asyncio.FIRST_COMPLETED)
            finally:
                freed.cancel()
                recheck.cancel()
            for ticket, verdict in self.lifecycle.drain():
                waiter = self._waiters.get(ticket)
                if waiter is not None and not waiter.done():
                    waiter.set_result(verdict)
                else:  # its request is gone (cancelled) as it was admitted
                    self.lifecycle.cancel(ticket)

    # --- the legs -----------------------------------------------------------------------

    async def _open(
        self,
        ticket: Ticket,
        request: ClientRequest,
        record: RequestRecord,
        pair: Pair | None = None,
        token_ids: bool = False,
        continuation: bool = False,
    ) -> DecodeStream:
        routing = self.fleet.routing
        deadline_s = self.fleet.engine.first_token_timeout_s
        # This opening's legs (a continuation has its own).
        tried = _Tried(opened_at=len(record.attempts), continuation=continuation)
        if pair is None:
            pair = await self._admit(ticket, record)
        while True:
            record.role_generation = self.state.role_generation
            record.mode = "local" if pair.local else "pd"
            params: Any = None
            prompt_tokens: int | None = None
            prompt_ids: list[int] | None = None
            if not pair.local:
                try:
                    params, prompt_tokens, prompt_ids, pair = await self._hedged_prefill(
                        ticket, pair, request, record
                    )
                except _EngineClientError as exc:
                    raise EngineRefused(exc.status, exc.body) from None
                except _LegFailure as exc:
                    tried.prefill_failures += 1
                    tried.last_error = f"prefill on {exc.engine or pair.prefill}: {exc}"
                    # Judged as a prefill failure even after a decode leg's deadline passed.
                    if tried.prefill_failures >= routing.max_prefill_attempts:
                        pair = self._rescue(ticket, tried, record, deadline=False)
                        continue
                    self.metrics.retries.labels("prefill").inc()
                    pair = self._retry(ticket, tried, record, deadline=False)
                    continue
            # Decode leg, under the first-token deadline.
            try:
                return await self._decode(
                    ticket,
                    pair,
                    request,
                    record,
                    params,
                    prompt_tokens,
                    prompt_ids,
                    deadline_s,
                    token_ids,
                )
            except _EngineClientError as exc:
                if params is not None:
                    if exc.status in _REFUSED_REQUEST:
                        await self._release_refused_handoff(pair, request, record, params)
                    else:  # it would refuse the release leg alike (401, 403, 404...)
                        self._stranded(pair.prefill, "decode_refused", record)
                raise EngineRefused(exc.status, exc.body) from None
            except _LegFailure as exc:
                tried.decode_failures += 1
                what = "local prefill and decode" if pair.local else "decode"
                tried.last_error = f"{what} on {pair.decode}: {exc}"
                if params is not None:
                    reason = "deadline_exceeded" if exc.deadline else "decode_failed"
                    self._stranded(pair.prefill, reason, record)
                give_up = False
                if exc.deadline:
                    tried.deadline_hit = True
                    give_up = routing.fallback == "fail"
                if give_up:  # routing.fallback "fail": a missed deadline ends it, rescue or not
                    raise self._exhausted(tried, record) from None
                budget_left = self.fleet.budgets.ttft_s - record.since_arrival()
                if tried.decode_failures >= routing.max_decode_attempts or (
                    budget_left <= 0 and not continuation
                ):
                    pair = self._rescue(ticket, tried, record)
                    continue
                self.metrics.retries.labels("decode").inc()
                pair = self._retry(ticket, tried, record)

    def _retry(
        self, ticket: Ticket, tried: _Tried, record: RequestRecord, deadline: bool | None = None
    ) -> Pair:
        pick = self.lifecycle.retry(ticket)
        if isinstance(pick, NoPair):
            return self._rescue(ticket, tried, record, deadline)
        return pick

    def _rescue(
        self, ticket: Ticket, tried: _Tried, record: RequestRecord, deadline: bool | None = None
    ) -> Pair:
        """An opening with nothing left to try: a continuation's one rescue (a local leg on any
        healthy engine that has not failed it), else the error that ends it."""
        if tried.continuation:
            pick = self.lifecycle.rescue(ticket)
            if pick is not None:
                return pick  # its leg is journaled as any local leg (``local``)
        raise self._exhausted(tried, record, deadline)

    def _exhausted(
        self, tried: _Tried, record: RequestRecord, deadline: bool | None = None
    ) -> RouterError:
        """The error that ends an opening with nothing left to try; ``deadline``, when given,
        says whether to judge it by a first-token deadline instead of ``tried.deadline_hit``."""
        last_error = tried.last_error
        if tried.deadline_hit if deadline is None else deadline:
            # Every engine tried is in the journal's attempts; the message says how many legs.
            legs = tried.decode_failures + tried.prefill_failures
            return FirstTokenDeadlineExceeded(
                f"no first token within the fleet's first-token deadline "
                f"({self.fleet.engine.first_token_timeout_s} s) on any pair tried "
                f"({_legs(max(legs, 1))}, the last {last_error})"
            )
        # The journal's attempts name every engine tried; the message says how many.
        if tried.decode_failures:
            return UpstreamFailed(
                "decode_failed",
                f"decode failed on every engine tried ({_legs(tried.decode_failures)}, the last "
                f"{last_error})",
            )
        # A hedged attempt is two legs on two engines: the legs are counted, not the attempts.
        legs = sum(
            1
            for a in record.attempts[tried.opened_at :]
            if a["leg"] == "prefill" and a["outcome"] == "failed"
        )
        return UpstreamFailed(
            "prefill_failed",
            f"prefill failed on every engine tried "
            f"({_legs(max(legs, tried.prefill_failures))}, the last {last_error})",
        )

    async def _release_refused_handoff(
        self, pair: Pair, request: ClientRequest, record: RequestRecord, params: Any
    ) -> None:
        """The decode engine refused the decode leg before touching its KV (a field only that leg
        carries, such as ``logprobs`` past its ``--max-logprobs`` or a grammar it cannot compile;
        a ``min_tokens`` past what the context leaves): the prompt's KV would stay held on the
        prefill engine until its lease expires (vLLM 0.32's ``kv_lease_duration``, 30 s by
        default), and a client repeating such a request could keep a prefill engine's cache full
        of KV nobody pulls. The same decode engine gets a release leg (the prefill leg's body
        and the KV it was handed: nothing it refused is on it) and pulls the blocks, which frees
        them on the prefill engine. The client's refusal waits for it (a client repeating bad
        requests is held back by its own); the release leg has a deadline of its own, the
        first-token deadline, and runs to its end even when the request is cancelled (the
        client left, the drain ran out, another choice of the request failed): cancelling it
        would leave the KV held."""
        task = self._start_release(pair, request, record.id, params, "decode_refused")
        started = record.since_arrival()
        try:
            why = await asyncio.shield(task)
        except asyncio.CancelledError:
            record.attempt("handoff", pair.prefill, "releasing", via=pair.decode)
            raise
        after_s = round(record.since_arrival() - started, 6)
        if why is None:
            record.attempt("handoff", pair.prefill, "released", via=pair.decode, after_s=after_s)
        else:
            record.attempt("handoff", pair.prefill, "stranded", reason="decode_refused")

    def _release_unsent_handoff(
        self, pair: Pair, request: ClientRequest, record: RequestRecord, params: Any
    ) -> None:
        """The request was cancelled (the client left, another choice of it failed) after its
        prefill handed out KV and before its decode leg reached the decode engine: nobody will
        pull that KV, and the prefill engine would hold it until its lease. A decode engine that
        got the leg frees it as the leg is aborted (vLLM notifies the prefill engine, no
        transfer); one that never got it is sent the release leg, which runs on by itself."""
        self._start_release(pair, request, record.id, params, "client_abort")
        record.attempt("handoff", pair.prefill, "releasing", via=pair.decode)

    def _orphaned_prefill(
        self, pair: Pair, request: ClientRequest, record: RequestRecord, status: int, content: bytes
    ) -> None:
        """The prefill leg was cancelled (the client left; or a hedge won, or the leg's timeout
        ran out) as its answer arrived: the KV that answer hands out is released like an
        unsent one (a failed release counted stranded as ``client_abort``)."""
        if status >= 300:
            return
        try:
            params = orjson.loads(content).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if params is not None:
            self._release_unsent_handoff(pair, request, record, params)

    def _start_release(
        self, pair: Pair, request: ClientRequest, request_id: str, params: Any, reason: str
    ) -> asyncio.Task[str | None]:
        """The release leg as a task of its own (``reason``: why the KV is stranded if the leg
        fails)."""
        task = asyncio.ensure_future(self._release_leg(pair, request, request_id, params, reason))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    async def _release_leg(
        self, pair: Pair, request: ClientRequest, request_id: str, params: Any, reason: str
    ) -> str | None:
        """Send the release leg; None once the decode engine answered it (it pulled the KV), or
        why not. Counted here, whether or not its request still waits for it."""
        engine = pair.decode
        path = "/v1/chat/completions" if request.chat else "/v1/completions"
        body = orjson.dumps(release_leg_body(request.body, request.chat, params))
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        why: str | None = None
        response: EngineResponse | None = None
        try:
            if self._releases_settled:  # the engines' connections are closing
                why = "the router is stopping"
            else:
                async with asyncio.timeout(self.fleet.engine.first_token_timeout_s):
                    response = await self.engines.client(engine).post(path, body, headers)
                    await read_prefix(response, _MAX_ERROR_BODY)
                if response.status >= 400:
                    why = f"HTTP {response.status}"
        except TimeoutError:
            why = "timed out"
        except EngineTransportError as exc:
            why = exc.reason
        except Exception as exc:  # nobody may await this task to see it
            log.exception("request %s: release leg on %s raised", request_id, engine)
            why = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:  # the router stops: the KV waits out its lease
            self.metrics.stranded.labels(pair.prefill, reason).inc()
            raise
        finally:
            if response is not None:
                with contextlib.suppress(Exception):
                    await response.aclose()
        if why is None:
            self.metrics.kv_released.labels(pair.prefill).inc()
            return None
        self.metrics.stranded.labels(pair.prefill, reason).inc()
        log.warning(
            "request %s: KV prefilled on %s stranded (%s): the release leg on %s failed: %s",
            request_id,
            pair.prefill,
            reason,
            engine,
            why,
        )
        return why

    def _stranded(self, prefill_id: str, reason: str, record: RequestRecord) -> None:
        # The prefill engine holds this KV until its lease expires: nobody will pull it.
        self.metrics.stranded.labels(prefill_id, reason).inc()
        record.attempt("handoff", prefill_id, "stranded", reason=reason)
        log.warning("request %s: KV prefilled on %s stranded (%s)", record.id, prefill_id, reason)

    async def _hedged_prefill(
        self, ticket: Ticket, pair: Pair, request: ClientRequest, record: RequestRecord
    ) -> tuple[Any, int | None, list[int] | None, Pair]:
        """The prefill leg; one that runs past ``routing.hedge.factor`` times its predicted
        queue wait and prefill is hedged on another prefill engine (``Lifecycle.hedge_prefill``)
        and the first of the two to answer wins. Returns the leg's result and the pair the
        request now holds (the hedge's, whichever leg won: its decode engine is dispatched).

        The leg runs inline under a timer, not as a task: the healthy path pays for one timer
        handle. When the timer fires the hedge starts as a task; if it answers first, it
        interrupts the inline leg by cancelling this task (as ``asyncio.timeout`` does)."""
        hedge = self.fleet.routing.hedge
        if not hedge.enabled:
            return (*await self._prefill(ticket, pair, request, record), pair)
        predicted = ticket.prefill_predicted_s
        if predicted is not None:
            after_s = max(hedge.floor_s, hedge.factor * predicted)
        else:  # no latency model (scheduler v0): half the TTFT budget
            after_s = max(hedge.floor_s, self.fleet.budgets.ttft_s / 2)
        task = asyncio.current_task()
        assert task is not None
        race = _HedgeRace(task, _PrefillLeg(), pair)
        timer = asyncio.get_running_loop().call_later(
            after_s, self._start_hedge, race, ticket, request, record, after_s, predicted
        )
        try:
            try:
                result = await self._prefill(ticket, pair, request, record, race.first)
            except asyncio.CancelledError:
                decided = race.decided
                if decided is None:
                    # Cancelled from outside: the hedge is cancelled below, unless it answered
                    # in this moment (its callback not run yet).
                    self._client_left_as_hedge_answered(ticket, race, request, record)
                    raise
                if task.uncancel() > 0:
                    # Cancelled from outside (the client left) in the moment the hedge
                    # answered. A refusal ends the request as refused.
                    if decided.exception() is None:
                        self._client_left_as_hedge_answered(ticket, race, request, record)
                    else:
                        with contextlib.suppress(_EngineClientError):
                            self._hedge_won(ticket, decided)
                    raise
                return (*self._hedge_won(ticket, decided), race.pair)
            except (_LegFailure, _EngineClientError) as exc:
                if race.second is None:
                    raise
                if isinstance(exc, _EngineClientError):
                    self._slow_leg_decided(ticket, race, record, "refused")
                    self.metrics.hedges.labels("prefill", "refused").inc()
                    raise
                # The slow leg failed; the hedge may still answer.
                self.lifecycle.slow_leg_failed(ticket)
                second = race.second
                race.closed = True
                try:
                    await asyncio.wait((second,))
                except asyncio.CancelledError:
                    self._client_left_as_hedge_answered(ticket, race, request, record)
                    raise
                return (*self._hedge_won(ticket, second), race.pair)
            if race.second is None:
                return (*result, pair)
            race.closed = True
            self._slow_leg_decided(ticket, race, record, "ok", result[1])
            self.metrics.hedges.labels("prefill", "original").inc()
            return (*result, race.pair)
        finally:
            race.closed = True
            timer.cancel()
            if race.second is not None:
                race.second.cancel()

    def _client_left_as_hedge_answered(
        self, ticket: Ticket, race: _HedgeRace, request: ClientRequest, record: RequestRecord
    ) -> None:
        """The request is cancelled from outside (the client left): if its hedge has answered
        (in this same moment), that engine served well, and the KV it holds no decode leg will
        pull: released."""
        hedge = race.second
        if hedge is None or not hedge.done() or hedge.cancelled() or hedge.exception() is not None:
            return
        self.lifecycle.cancel(ticket, prefill_answered=True)
        self.metrics.hedges.labels("prefill", "hedge").inc()
        params = hedge.result()[0]
        if params is not None:
            self._release_unsent_handoff(race.pair, request, record, params)

    def _slow_leg_decided(
        self,
        ticket: Ticket,
        race: _HedgeRace,
        record: RequestRecord,
        outcome: Literal["ok", "refused"],
        prompt_tokens: int | None = None,
    ) -> None:
        """The slow leg's answer or refusal decides a hedged prefill: reported with how its
        hedge ended; a hedge that answered in the same moment left KV no one pulls."""
        assert race.second is not None
        ended = _hedge_end(race.second)
        self.lifecycle.prefill_done(ticket, outcome, prompt_tokens=prompt_tokens, hedge_ended=ended)
        if ended == "answered":
            self._stranded(race.pair.prefill, "hedge_lost", record)

    def _start_hedge(
        self,
        race: _HedgeRace,
        ticket: Ticket,
        request: ClientRequest,
        record: RequestRecord,
        after_s: float,
        predicted: float | None,
    ) -> None:
        """The hedge timer fired: a second prefill leg on the best other prefill engine whose
        predicted TTFT fits what is left of the budget; none, and the slow leg runs on."""
        if race.closed or ticket.phase != "prefill":
            return  # the slow leg has ended (its end is being reported)
        budget_left = self.fleet.budgets.ttft_s - record.since_arrival()
        pick = self.lifecycle.hedge_prefill(ticket, budget_left)
        if isinstance(pick, NoPair):
            return  # nowhere to hedge: the slow leg runs on, counted
        race.first.counted = False
        record.attempt(
            "prefill",
            race.pair.prefill,
            "hedged",
            after_s=round(after_s, 6),
            predicted_s=None if predicted is None else round(predicted, 6),
            hedge=pick.prefill,
        )
        race.pair = pick
        second = asyncio.ensure_future(
            self._prefill(ticket, pick, request, record, _PrefillLeg(counted=False))
        )
        race.second = second

        def decide(done: asyncio.Future[tuple[Any, int | None, list[int] | None]]) -> None:
            # The hedge answered (or refused) first: the inline leg is interrupted. A hedge that
            # failed is counted now and leaves the slow leg to run on.
            if race.closed or done.cancelled():
                return
            exc = done.exception()
            if exc is not None and not isinstance(exc, _EngineClientError):
                self.lifecycle.hedge_failed(ticket)
                return
            race.decided = done
            race.closed = True
            race.task.cancel()

        second.add_done_callback(decide)

    def _hedge_won(
        self, ticket: Ticket, second: asyncio.Future[tuple[Any, int | None, list[int] | None]]
    ) -> tuple[Any, int | None, list[int] | None]:
        """The hedge's end decides the request's prefill: its answer, its refusal, or (the slow
        leg having failed too) one failure for the two."""
        exc = second.exception()
        if exc is None:
            result = second.result()
            self.lifecycle.prefill_done(ticket, "ok", prompt_tokens=result[1])
            self.metrics.hedges.labels("prefill", "hedge").inc()
            return result
        if isinstance(exc, _EngineClientError):
            self.lifecycle.prefill_done(ticket, "refused")
            self.metrics.hedges.labels("prefill", "refused").inc()
        else:
            self.lifecycle.prefill_done(ticket, "failed")
            self.metrics.hedges.labels("prefill", "failed").inc()
        raise exc

    def _prefill_done(
        self,
        ticket: Ticket,
        leg: _PrefillLeg | None,
        outcome: Literal["ok", "refused", "failed"],
        prompt_tokens: int | None = None,
    ) -> None:
        if leg is None or leg.counted:
            self.lifecycle.prefill_done(ticket, outcome, prompt_tokens=prompt_tokens)

    async def _prefill(
        self,
        ticket: Ticket,
        pair: Pair,
        request: ClientRequest,
        record: RequestRecord,
        leg: _PrefillLeg | None = None,
    ) -> tuple[Any, int | None, list[int] | None]:
        engine = pair.prefill
        path = "/v1/chat/completions" if request.chat else "/v1/completions"
        body = orjson.dumps(prefill_leg_body(request.body, request.chat))
        started = record.since_arrival()
        if leg is None or leg.counted:
            record.prefill_engine = engine
            record.t_prefill_start = started
        client = self.engines.client(engine)
        headers = {"X-Request-Id": record.id, "Content-Type": "application/json"}
        response: EngineResponse | None = None

        def on_orphan(status: int, content: bytes) -> None:
            self._orphaned_prefill(pair, request, record, status, content)

        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                response = await client.post(path, body, headers, on_orphan)
                if response.status >= 400:
                    content = await read_prefix(response, _MAX_ERROR_BODY)
                else:
                    content = await response.read()
        except asyncio.CancelledError:
            if leg is None or leg.counted:  # a hedge race's legs: its `hedged` attempt says
                since = round(record.since_arrival() - started, 6)
                record.attempt("prefill", engine, "cancelled", after_s=since)
            raise
        except (EngineTransportError, TimeoutError) as exc:
            self._prefill_done(ticket, leg, "failed")
            why = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            record.attempt("prefill", engine, "failed", error=why)
            # The client's error says what failed, not where: the journal has the address.
            raise _LegFailure(
                why if isinstance(exc, TimeoutError) else exc.reason, engine=engine
            ) from None
        finally:
            if response is not None:
                await response.aclose()
        ended = record.since_arrival()
        if response.status >= 500:
            self._prefill_done(ticket, leg, "failed")
            record.attempt("prefill", engine, "failed", status=response.status)
            raise _LegFailure(f"HTTP {response.status}", engine=engine)
        if response.status >= 400:
            self._prefill_done(ticket, leg, "refused")  # the engine is fine; the request not
            raise _EngineClientError(response.status, content)
        try:
            data = orjson.loads(content)
            usage = data.get("usage") or {}
            prompt_tokens = usage.get("prompt_tokens")
            params = data.get("kv_transfer_params")
            # A completion answers its one choice (vLLM's prefill too); anything else that is
            # JSON is not a prefill, whatever its status.
            choices = data["choices"]
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                raise TypeError("no choice")
            ids = choices[0].get("prompt_token_ids")
            if ids is None:
                ids = data.get("prompt_token_ids")
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError):
            self._prefill_done(ticket, leg, "failed")
            record.attempt("prefill", engine, "failed", error="malformed response")
            raise _LegFailure("malformed prefill response", engine=engine) from None
        counted = prompt_tokens if isinstance(prompt_tokens, int) else None
        # The decode leg is counted on its engine from here.
        self._prefill_done(ticket, leg, "ok", counted)
        # The leg that answered is the request's prefill (a hedge's winner included).
        record.prefill_engine = engine
        record.t_prefill_start, record.t_prefill_end = started, ended
        self.metrics.prefill.labels(engine).observe(ended - started)
        record.attempt("prefill", engine, "ok")
        if counted is not None:
            record.prompt_tokens = counted
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if isinstance(details, dict):
            record.prefill_prompt_details = details
        # vLLM returns kv_transfer_params only when the prefill stopped on its length cap with
        # blocks to hand over; without them the decode engine prefills the prompt itself.
        record.handoff = "nixl" if params is not None else "local"
        # Kept for the client that asked (return_token_ids): only the prefill leg has them.
        return params, counted, ids if isinstance(ids, list) else None

    async def _decode(
        self,
        ticket: Ticket,
        pair: Pair,
        request: ClientRequest,
        record: RequestRecord,
        params: Any,
        prompt_tokens: int | None,
        prompt_ids: list[int] | None,
        deadline_s: float,
        token_ids: bool,
    ) -> DecodeStream:
        engine = pair.decode
        path = "/v1/chat/completions" if request.chat else "/v1/completions"
        # A local pick sends the client's request as it is: no kv_transfer_params at all.
        leg_body = decode_leg_body(request.body, params)
        # A client that asked for ids gets the first chunk's prompt ids as the engine wrote them.
        client_ids = bool(request.body.get("return_token_ids"))
        if token_ids:
            leg_body["return_token_ids"] = True
        body = orjson.dumps(leg_body)
        client = self.engines.client(engine)
        record.decode_engine = engine
        record.t_decode_start = record.since_arrival()
        index = self.state.prefix_index
        # The lifecycle's copy: it adds what the index holds when the scheduler did not look.
        picked = ticket.pair or pair
        counted = prompt_tokens if prompt_tokens is not None else ticket.prompt_tokens
        pull = None
        if params is not None and counted is not None:
            # A handoff (no params: the decode engine prefills itself and pulls nothing). What
            # the engine holds now, not what the pick foresaw it would: another choice's or
            # request's pull of the same prompt there is not in its cache until it lands.
            held: int | None = None
            if index is not None:
                # The pick's view holds as much or more (claims in flight with it): looked up
                # again only when it says the engine holds some.
                held = picked.decode_cached_tokens
                if held:
                    held = min(held, self.lifecycle.decode_holds(ticket, engine, counted))
            pull = self.state.kv_pulled(engine, counted, held)
        if index is not None and ticket.prefix:
            record.cached_tokens_predicted = picked.cached_tokens
            if pull is not None:
                record.kv_blocks_predicted = pull[0]
        if pair.local:
            # The engine that decodes prefills: journaled as both, with no handoff.
            record.prefill_engine = engine
            record.handoff = None
            record.t_prefill_start = record.t_decode_start
            record.t_prefill_end = None
            self.metrics.local_prefills.labels(engine).inc()
        handed_over = False
        response: EngineResponse | None = None
        leg = "local" if pair.local else "decode"  # as the journal's attempts name it
        headers = {
            "X-Request-Id": record.id,
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
        }

        sent = False

        def on_send() -> None:
            nonlocal sent
            sent = True

        async def first_event() -> tuple[EngineResponse, SseEventStream, list[bytes], bytes | None]:
            nonlocal response
            response = await client.stream(path, body, headers, on_send)
            if response.status >= 400:
                content = await read_prefix(response, _MAX_ERROR_BODY)
                if response.status >= 500:
                    raise _LegFailure(f"HTTP {response.status}")
                raise _EngineClientError(response.status, content)
            events = SseEventStream(response)
            while batch := await events.next_batch():
                for i, data in enumerate(batch):
                    if data == b"[DONE]":
                        raise _LegFailure("stream ended before the first token")
                    # The prompt's ids (a migratable leg's first chunk) are not parsed: cut out
                    # once, here, and relayed as null to a client that did not ask for them.
                    raw = None
                    if token_ids:
                        data, raw = cut_prompt_ids(data)
                    obj = orjson.loads(data)
                    if isinstance(obj, dict) and "error" in obj:
                        error = obj.get("error") or {}
                        code = error.get("code") if isinstance(error, dict) else None
                        if isinstance(code, int) and 400 <= code < 500:
                            # vLLM checks sampling parameters against the engine (logprobs
                            # past --max-logprobs, a grammar it cannot compile) as the stream
                            # starts: a 200 whose first event is a 4xx error is a refusal,
                            # the client's error, not a failing engine.
                            raise _EngineClientError(code, data)
                        message = str(
                            error.get("message", error) if isinstance(error, dict) else error
                        )
                        raise _LegFailure(f"engine error before the first token: {message}")
                    if isinstance(obj, dict) and obj.get("choices"):
                        if raw is None or client_ids:
                            return response, events, batch[i:], None
                        return response, events, [data, *batch[i + 1 :]], raw
            raise _LegFailure("stream ended before the first token")

        try:
            try:
                async with asyncio.timeout(deadline_s):
                    resp, events, first, decode_prompt_ids = await first_event()
            except asyncio.CancelledError:
                # The client left (the request was cancelled) before the first token: the
                # leg was tried, and the journal says so.
                since = round(record.since_arrival() - record.t_decode_start, 6)
                record.attempt(leg, engine, "cancelled", after_s=since)
                if params is not None and not sent:  # waiting for a connection to the engine
                    self._release_unsent_handoff(pair, request, record, params)
                raise
            except TimeoutError:
                self.metrics.deadline_exceeded.labels(engine).inc()
                self.metrics.first_token_waits.labels(engine).inc()
                # The tail of handoff latency includes the legs that missed (at least this
                # long); and a missed deadline is a failed leg for the breaker, or a half-open
                # probe that missed would hold its breaker half-open for good.
                if not pair.local:
                    self.metrics.handoff.labels(engine).observe(
                        record.since_arrival() - record.t_decode_start
                    )
                self.lifecycle.decode_failed(ticket, "deadline")
                record.attempt(
                    leg,
                    engine,
                    "deadline_exceeded",
                    after_s=round(record.since_arrival() - record.t_decode_start, 6),
                )
                raise _LegFailure(f"no first token within {deadline_s} s", deadline=True) from None
            except EngineTransportError as exc:
                self.lifecycle.decode_failed(ticket, "failed")
                record.attempt(leg, engine, "failed", error=str(exc))
                raise _LegFailure(exc.reason) from None
            except ValueError as exc:  # orjson.JSONDecodeError, an oversized event
                self.lifecycle.decode_failed(ticket, "failed")
                record.attempt(leg, engine, "failed", error=f"{type(exc).__name__}: {exc}")
                raise _LegFailure(f"{type(exc).__name__}: {exc}") from None
            except _LegFailure as exc:
                self.lifecycle.decode_failed(ticket, "failed")
                record.attempt(leg, engine, "failed", error=str(exc))
                raise
            except _EngineClientError:
                self.lifecycle.decode_failed(ticket, "refused")
                raise
            handed_over = True
        finally:
            if not handed_over and response is not None:
                with contextlib.suppress(Exception):
                    await response.aclose()
        self.lifecycle.first_token(ticket)
        self.metrics.first_token_waits.labels(engine).inc()
        first_token_s = record.since_arrival() - record.t_decode_start
        if pair.local:
            record.t_prefill_end = record.t_decode_start + first_token_s
            record.attempt(leg, engine, "first_token", after_s=round(first_token_s, 6))
        else:
            record.handoff_first_token_s = first_token_s
            self.metrics.handoff.labels(engine).observe(first_token_s)
            if pull is not None and pull[1] is not None:
                # The engine pulled before its first token: each handoff's bytes add up (a
                # migration's continuation moves its own prompt's).
                record.kv_bytes_moved = (record.kv_bytes_moved or 0) + pull[1]
                self.metrics.kv_bytes_moved.labels(engine).inc(pull[1])
            record.attempt("decode", engine, "first_token", after_s=round(first_token_s, 6))
        return DecodeStream(
            engine, resp, events, first, prompt_tokens, ticket, prompt_ids, decode_prompt_ids
        )
