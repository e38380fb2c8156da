"""The P/D request path: pick a pair, run the prefill leg, open the decode leg under the
first-token deadline, retry what can be retried, and hand back a decode stream positioned after
its first event. Relaying that stream to the client lives in ``relay.py``.

A local pick (scheduler v1 with ``routing.local_prefill``) skips the prefill leg: the decode
engine gets one ordinary request (no ``kv_transfer_params``), prefills it itself and streams it
back through the same decode-leg code, deadline, retries and relay."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from narwhal.contract import FleetContract
from narwhal.engines.client import EnginePool
from narwhal.engines.legs import decode_leg_body, prefill_leg_body
from narwhal.engines.sse import SseEventStream
from narwhal.engines.transport import EngineResponse, EngineTransportError, read_prefix
from narwhal.metrics import RouterMetrics
from narwhal.routing.admission import Admit, Queue, Reject, Unavailable, admit
from narwhal.routing.fleet_state import EngineState, FleetState
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.prompt_length import PromptLengthEstimator
from narwhal.routing.roles import DemandTracker
from narwhal.routing.scheduler import (
    NoPair,
    Pair,
    RequestShape,
    SchedulerV0,
    SchedulerV1,
    decode_load,
    prefill_load,
)
from narwhal.serve.errors import RouterError
from narwhal.serve.record import RequestRecord
from narwhal.serve.validation import ClientRequest

__all__ = ["DecodeStream", "PDRouter"]

log = logging.getLogger(__name__)

_MAX_ERROR_BODY = 64 * 1024
# What a chat request without a max_tokens is assumed to generate, for scheduling only.
DEFAULT_CHAT_MAX_TOKENS = 256


class _LegFailure(Exception):
    """A leg failed in a way another engine may not: connection, 5xx, timeout, bad answer."""

    def __init__(self, message: str, *, deadline: bool = False) -> None:
        super().__init__(message)
        self.deadline = deadline


class _EngineClientError(Exception):
    """The engine refused the request itself (4xx): the client's error, not the engine's."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body


@dataclass
class DecodeStream:
    engine: str
    response: EngineResponse
    events: SseEventStream
    # The first event with a choice, and the events that arrived with it (relayed next).
    first_events: list[bytes]
    prefill_prompt_tokens: int | None
    predicted_tpot_s: float | None = None
    batch_at_start: int = 1  # the decode engine's batch when this stream joined it
    started_at: float = 0.0  # the router's clock at its first token

    async def aclose(self, drain: bool = False) -> None:
        """Close the upstream response. After a complete stream, ``drain`` reads the closing
        chunk first so the connection goes back to the pool instead of being dropped."""
        if drain:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    while await self.events.next_batch():
                        pass
        await self.response.aclose()


class PDRouter:
    def __init__(
        self,
        fleet: FleetContract,
        state: FleetState,
        scheduler: SchedulerV0 | SchedulerV1,
        engines: EnginePool,
        metrics: RouterMetrics,
        prefill_timeout_s: float,
        predictor: LatencyPredictor | None = None,
        demand: DemandTracker | None = None,
    ) -> None:
        self.fleet = fleet
        self.state = state
        self.scheduler = scheduler
        self.engines = engines
        self.metrics = metrics
        self.prefill_timeout_s = prefill_timeout_s
        self.predictor = predictor
        self.demand = demand
        self._prompt_ids: dict[str, list[int] | None] = {}
        self.lengths = PromptLengthEstimator()
        self.queued = 0
        self._capacity = asyncio.Event()

    def shape(self, request: ClientRequest, record: RequestRecord) -> RequestShape:
        if request.prompt_tokens_exact is not None:
            tokens = request.prompt_tokens_exact
        else:
            tokens = self.lengths.estimate(request.prompt_bytes)
        default_max = 16 if not request.chat else DEFAULT_CHAT_MAX_TOKENS
        return RequestShape(
            tokens,
            request.max_tokens or default_max,
            record.since_arrival(),
            # The prompt's token ids come back from a prefill leg only.
            local_ok=not request.body.get("return_token_ids"),
        )

    async def _admit(self, request: ClientRequest, record: RequestRecord) -> Pair:
        """The first pick, under admission control: reject or queue when nothing fits."""
        policy = self.fleet.routing
        pick = self.scheduler.pick(self.state, self.shape(request, record))
        verdict = self._idle_override(pick, admit(pick, policy, self.queued), record)
        if isinstance(verdict, Queue):
            self.queued += 1
            self.metrics.admission_queue.set(self.queued)
            start = record.since_arrival()
            try:
                while isinstance(verdict, Queue):
                    self._capacity.clear()
                    left = policy.queue_timeout_s - (record.since_arrival() - start)
                    # Re-evaluate when capacity frees up, and at least every 50 ms.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._capacity.wait(), max(0.0, min(left, 0.05)))
                    pick = self.scheduler.pick(self.state, self.shape(request, record))
                    verdict = self._idle_override(
                        pick,
                        admit(
                            pick,
                            policy,
                            self.queued,
                            record.since_arrival() - start,
                            in_queue=True,
                        ),
                        record,
                    )
                if isinstance(verdict, Admit):
                    record.attempt(
                        "admission",
                        verdict.pair.prefill,
                        "queued",
                        waited_s=round(record.since_arrival() - start, 6),
                    )
            finally:
                self.queued -= 1
                self.metrics.admission_queue.set(self.queued)
        if isinstance(verdict, Admit):
            return verdict.pair
        if isinstance(verdict, Reject):
            if self.demand is not None:  # demand: what arrived, whether served or not
                self.demand.record_rejected(self.shape(request, record), pick)
            raise self._reject(verdict.reason, verdict.message)
        raise RouterError(
            503,
            f"no engine pair can serve: {verdict.message}",
            "service_unavailable",
            "unavailable",
            headers={"Retry-After": "1"},
        )

    def _idle_override(
        self,
        pick: Pair | NoPair,
        verdict: Admit | Queue | Reject | Unavailable,
        record: RequestRecord,
    ) -> Admit | Queue | Reject | Unavailable:
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
        record.attempt(
            "admission", pair.prefill, "idle_pair", predicted_ttft_s=pair.predicted_ttft_s
        )
        return Admit(pair)

    def _reject(self, reason: str, message: str) -> RouterError:
        self.metrics.admission_rejections.labels(reason).inc()
        return RouterError(
            429,
            f"request rejected by admission control: {message}",
            "rate_limit_exceeded",
            "rejected",
            headers={"Retry-After": "1"},
            code=reason,
        )

    def capacity_freed(self) -> None:
        self._capacity.set()

    async def open(self, request: ClientRequest, record: RequestRecord) -> DecodeStream:
        """Run legs until a decode stream has produced its first event, or raise RouterError."""
        routing = self.fleet.routing
        deadline_s = self.fleet.engine.first_token_timeout_s
        failed_prefill: set[str] = set()
        failed_decode: set[str] = set()
        prefill_failures = decode_failures = 0
        last_error = "no attempt"
        deadline_hit = False
        first = True
        while True:
            if first:
                first = False
                pick: Pair | NoPair = await self._admit(request, record)
                if self.demand is not None:
                    shape = self.shape(request, record)
                    # A local prefill is no work for the prefill pool.
                    prefill_s = 0.0 if pick.local else pick.predicted_prefill_s or 0.0
                    self.demand.record_start(prefill_s, shape.prompt_tokens, shape.max_tokens)
            else:
                pick = self.scheduler.pick(
                    self.state, self.shape(request, record), failed_prefill, failed_decode
                )
                if isinstance(pick, NoPair) and pick.over_budget is not None:
                    pick = pick.over_budget  # already admitted: retry on the best pair there is
            if isinstance(pick, NoPair):
                if prefill_failures or decode_failures:
                    raise self._exhausted(
                        prefill_failures, decode_failures, deadline_hit, last_error
                    )
                raise RouterError(
                    503,
                    f"no engine pair can serve: {pick.reason}",
                    "service_unavailable",
                    "unavailable",
                    headers={"Retry-After": "1"},
                )
            prefill = self.state.engines[pick.prefill]
            decode = self.state.engines[pick.decode]
            record.role_generation = self.state.role_generation
            record.mode = "local" if pick.local else "pd"
            params: Any = None
            prompt_tokens: int | None = None
            if not pick.local:
                # Prefill leg. Its decode engine counts it from now (it will join that batch).
                decode.pending_decode += 1
                try:
                    params, prompt_tokens = await self._prefill(prefill, request, record, pick)
                except _EngineClientError as exc:
                    raise RouterError.passthrough(exc.status, exc.body) from None
                except _LegFailure as exc:
                    prefill_failures += 1
                    last_error = f"prefill on {prefill.id}: {exc}"
                    failed_prefill.add(prefill.id)
                    if prefill_failures >= routing.max_prefill_attempts:
                        raise self._exhausted(
                            prefill_failures, decode_failures, False, last_error
                        ) from None
                    self.metrics.retries.labels("prefill").inc()
                    continue
                finally:
                    decode.pending_decode -= 1
            # Decode leg, under the first-token deadline.
            try:
                return await self._decode(
                    pick, decode, request, record, params, prompt_tokens, deadline_s
                )
            except _EngineClientError as exc:
                if params is not None:
                    self._stranded(prefill.id, "decode_failed", record)
                raise RouterError.passthrough(exc.status, exc.body) from None
            except _LegFailure as exc:
                decode_failures += 1
                what = "local prefill and decode" if pick.local else "decode"
                last_error = f"{what} on {decode.id}: {exc}"
                failed_decode.add(decode.id)
                if params is not None:
                    reason = "deadline_exceeded" if exc.deadline else "decode_failed"
                    self._stranded(prefill.id, reason, record)
                if exc.deadline:
                    deadline_hit = True
                    if routing.fallback == "fail":
                        raise self._exhausted(
                            prefill_failures, decode_failures, True, last_error
                        ) from None
                budget_left = self.fleet.budgets.ttft_s - record.since_arrival()
                if decode_failures >= routing.max_decode_attempts or budget_left <= 0:
                    raise self._exhausted(
                        prefill_failures, decode_failures, deadline_hit, last_error
                    ) from None
                self.metrics.retries.labels("decode").inc()
                continue

    def _exhausted(
        self, prefill_failures: int, decode_failures: int, deadline: bool, last_error: str
    ) -> RouterError:
        if deadline:
            return RouterError(
                504,
                f"no first token within the fleet's first-token deadline "
                f"({self.fleet.engine.first_token_timeout_s} s) on any pair tried: {last_error}",
                "timeout",
                "deadline_exceeded",
                code="first_token_deadline_exceeded",
            )
        if decode_failures:
            return RouterError(
                502,
                f"decode failed on every engine tried: {last_error}",
                "upstream_error",
                "decode_failed",
            )
        return RouterError(
            502,
            f"prefill failed on every engine tried: {last_error}",
            "upstream_error",
            "prefill_failed",
        )

    def _stranded(self, prefill_id: str, reason: str, record: RequestRecord) -> None:
        # The prefill engine holds this KV until its lease expires: nobody will pull it.
        self.metrics.stranded.labels(prefill_id, reason).inc()
        record.attempt("handoff", prefill_id, "stranded", reason=reason)
        log.warning("request %s: KV prefilled on %s stranded (%s)", record.id, prefill_id, reason)

    def _leg_failed(self, engine: EngineState, leg: str) -> None:
        engine.breaker.record_failure()
        self.metrics.leg_failures.labels(engine.id, leg).inc()
        self.metrics.breaker_state.labels(engine.id).set(int(engine.breaker.state))

    def _leg_ok(self, engine: EngineState) -> None:
        engine.breaker.record_success()
        self.metrics.breaker_state.labels(engine.id).set(int(engine.breaker.state))

    async def _prefill(
        self, engine: EngineState, request: ClientRequest, record: RequestRecord, pick: Pair
    ) -> tuple[Any, int | None]:
        path = "/v1/chat/completions" if request.chat else "/v1/completions"
        body = orjson.dumps(prefill_leg_body(request.body, request.chat))
        record.prefill_engine = engine.id
        record.t_prefill_start = record.since_arrival()
        engine.breaker.on_dispatch()
        engine.in_flight_prefill += 1
        predicted_total = None
        if pick.predicted_prefill_s is not None:
            now = self.state.clock.now()
            # Queue and prefill, without the correction in force now (see observe below).
            predicted_total = engine.queued_prefill_s(now) + pick.predicted_prefill_s
            if self.predictor is not None:
                predicted_total = self.predictor.uncorrected(engine.id, "prefill", predicted_total)
            engine.prefill_work[record.id] = (pick.predicted_prefill_s, now)
        gauge = self.metrics.in_flight.labels(engine.id, "prefill")
        gauge.inc()
        client = self.engines.client(engine.id)
        headers = {"X-Request-Id": record.id, "Content-Type": "application/json"}
        response: EngineResponse | None = None
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                response = await client.post(path, body, headers)
                if response.status >= 400:
                    content = await read_prefix(response, _MAX_ERROR_BODY)
                else:
                    content = await response.read()
        except (EngineTransportError, TimeoutError) as exc:
            self._leg_failed(engine, "prefill")
            why = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            record.attempt("prefill", engine.id, "failed", error=why)
            raise _LegFailure(why) from None
        finally:
            engine.in_flight_prefill -= 1
            engine.prefill_work.pop(record.id, None)
            gauge.dec()
            self._capacity.set()
            if response is not None:
                await response.aclose()
        record.t_prefill_end = record.since_arrival()
        if response.status >= 500:
            self._leg_failed(engine, "prefill")
            record.attempt("prefill", engine.id, "failed", status=response.status)
            raise _LegFailure(f"HTTP {response.status}")
        if response.status >= 400:
            self._leg_ok(engine)  # the engine is fine; the request is not
            raise _EngineClientError(response.status, content)
        try:
            data = orjson.loads(content)
            usage = data.get("usage") or {}
            prompt_tokens = usage.get("prompt_tokens")
            params = data.get("kv_transfer_params")
            choices = data.get("choices") or [{}]
            ids = choices[0].get("prompt_token_ids") if isinstance(choices[0], dict) else None
            if ids is None:
                ids = data.get("prompt_token_ids")
            # Kept for the client that asked (return_token_ids): only the prefill leg has them.
            self._prompt_ids[record.id] = ids if isinstance(ids, list) else None
        except (orjson.JSONDecodeError, AttributeError):
            self._leg_failed(engine, "prefill")
            record.attempt("prefill", engine.id, "failed", error="malformed response")
            raise _LegFailure("malformed prefill response") from None
        self._leg_ok(engine)
        leg_s = record.t_prefill_end - record.t_prefill_start
        self.metrics.prefill.labels(engine.id).observe(leg_s)
        record.attempt("prefill", engine.id, "ok")
        if isinstance(prompt_tokens, int):
            record.prompt_tokens = prompt_tokens
            if request.prompt_tokens_exact is None:
                self.lengths.observe(request.prompt_bytes, prompt_tokens)
        if self.predictor is not None and predicted_total is not None:
            ratio = self.predictor.observe(
                engine.id, "prefill", predicted_total, leg_s, uncorrected=True
            )
            self._export_ratio(engine.id, "prefill", ratio)
        # vLLM returns kv_transfer_params only when the prefill stopped on its length cap with
        # blocks to hand over; without them the decode engine prefills the prompt itself.
        record.handoff = "nixl" if params is not None else "local"
        return params, prompt_tokens if isinstance(prompt_tokens, int) else None

    def _export_ratio(self, engine_id: str, phase: str, ratio: float) -> None:
        assert self.predictor is not None
        self.metrics.latency_ratio.labels(engine_id, phase).set(ratio)
        self.metrics.profile_drift.labels(engine_id, phase).set(
            1 if self.predictor.drifted(engine_id, phase) else 0
        )

    def observe_tpot(self, stream: DecodeStream, tpot_s: float, context: float) -> None:
        """A finished request's TPOT against the model at the batch it actually shared (the
        mean of the engine's batch when it joined and when it left): comparing with the batch
        at pick time instead would read growing load as a slow engine."""
        if self.predictor is None or not self.predictor.has(stream.engine) or tpot_s <= 0:
            return
        batch = (
            stream.batch_at_start + self.state.decode_batch(self.state.engines[stream.engine]) + 1
        ) / 2
        expected = self.predictor.decode(stream.engine, max(1, round(batch)), context).seconds
        # Local prefills sent to this engine while the stream decoded stalled its steps: part of
        # what was expected, not a slower engine (spread over the stream's tokens).
        engine = self.state.engines[stream.engine]
        now = self.state.clock.now()
        stalls = engine.recent_local_prefill_s(stream.started_at)
        if stalls > 0 and now > stream.started_at:
            expected += stalls * tpot_s / (now - stream.started_at)
        ratio = self.predictor.observe(stream.engine, "decode", expected, tpot_s)
        self._export_ratio(stream.engine, "decode", ratio)

    async def _decode(
        self,
        pick: Pair,
        engine: EngineState,
        request: ClientRequest,
        record: RequestRecord,
        params: Any,
        prompt_tokens: int | None,
        deadline_s: float,
    ) -> DecodeStream:
        path = "/v1/chat/completions" if request.chat else "/v1/completions"
        # A local pick sends the client's request as it is: no kv_transfer_params at all.
        body = orjson.dumps(decode_leg_body(request.body, params))
        client = self.engines.client(engine.id)
        record.decode_engine = engine.id
        record.t_decode_start = record.since_arrival()
        engine.breaker.on_dispatch()
        engine.in_flight_decode += 1
        self.metrics.in_flight.labels(engine.id, "decode").inc()
        local_predicted = 0.0
        if pick.local:
            # The engine that decodes prefills: journaled as both, with no handoff.
            record.prefill_engine = engine.id
            record.handoff = None
            record.t_prefill_start = record.t_decode_start
            record.t_prefill_end = None
            self.metrics.local_prefills.labels(engine.id).inc()
            now = self.state.clock.now()
            predicted = pick.predicted_prefill_s or 0.0
            # The online correction of local legs on this engine compares their first tokens
            # with the predicted TTFT, without the correction in force now.
            if self.predictor is not None and self.predictor.has(engine.id):
                local_predicted = self.predictor.uncorrected(
                    engine.id, "local", pick.predicted_ttft_s or 0.0
                )
            # Queued local prefill work (the next local pick waits behind it) and the stall
            # history the scheduler weighs against this engine's batch.
            engine.prefill_work[record.id] = (predicted, now)
            engine.note_local_prefill(now, predicted)
        handed_over = False
        response: EngineResponse | None = None
        leg = "local" if pick.local else "decode"  # as the journal's attempts name it
        headers = {
            "X-Request-Id": record.id,
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
        }

        async def first_event() -> tuple[EngineResponse, SseEventStream, list[bytes]]:
            nonlocal response
            response = await client.stream(path, body, headers)
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
                    obj = orjson.loads(data)
                    if isinstance(obj, dict) and "error" in obj:
                        message = str((obj.get("error") or {}).get("message", obj["error"]))
                        raise _LegFailure(f"engine error before the first token: {message}")
                    if isinstance(obj, dict) and obj.get("choices"):
                        return response, events, batch[i:]
            raise _LegFailure("stream ended before the first token")

        try:
            try:
                async with asyncio.timeout(deadline_s):
                    resp, events, first = await first_event()
            except TimeoutError:
                self.metrics.deadline_exceeded.labels(engine.id).inc()
                # The tail of handoff latency includes the legs that missed (at least this
                # long); and a missed deadline is a failed leg for the breaker, or a half-open
                # probe that missed would hold its breaker half-open for good.
                if not pick.local:
                    self.metrics.handoff.labels(engine.id).observe(
                        record.since_arrival() - record.t_decode_start
                    )
                self._leg_failed(engine, "decode")
                record.attempt(
                    leg,
                    engine.id,
                    "deadline_exceeded",
                    after_s=round(record.since_arrival() - record.t_decode_start, 6),
                )
                raise _LegFailure(f"no first token within {deadline_s} s", deadline=True) from None
            except EngineTransportError as exc:
                self._leg_failed(engine, "decode")
                record.attempt(leg, engine.id, "failed", error=str(exc))
                raise _LegFailure(str(exc)) from None
            except ValueError as exc:  # orjson.JSONDecodeError, an oversized event
                self._leg_failed(engine, "decode")
                record.attempt(leg, engine.id, "failed", error=f"{type(exc).__name__}: {exc}")
                raise _LegFailure(f"{type(exc).__name__}: {exc}") from None
            except _LegFailure as exc:
                self._leg_failed(engine, "decode")
                record.attempt(leg, engine.id, "failed", error=str(exc))
                raise
            except _EngineClientError:
                self._leg_ok(engine)
                raise
            handed_over = True
        finally:
            if pick.local:
                engine.prefill_work.pop(record.id, None)
            if not handed_over:
                engine.in_flight_decode -= 1
                self.metrics.in_flight.labels(engine.id, "decode").dec()
                if response is not None:
                    with contextlib.suppress(Exception):
                        await response.aclose()
        self._leg_ok(engine)
        first_token_s = record.since_arrival() - record.t_decode_start
        if pick.local:
            record.t_prefill_end = record.t_decode_start + first_token_s
            record.attempt(leg, engine.id, "first_token", after_s=round(first_token_s, 6))
            if self.predictor is not None and local_predicted > 0:
                self.predictor.observe(
                    engine.id, "local", local_predicted, first_token_s, uncorrected=True
                )
        else:
            record.handoff_first_token_s = first_token_s
            self.metrics.handoff.labels(engine.id).observe(first_token_s)
            record.attempt("decode", engine.id, "first_token", after_s=round(first_token_s, 6))
            if self.predictor is not None and pick.predicted_tpot_s is not None:
                self.predictor.observe_handoff(engine.id, first_token_s, pick.predicted_tpot_s)
        return DecodeStream(
            engine.id,
            resp,
            events,
            first,
            prompt_tokens,
            pick.predicted_tpot_s,
            self.state.decode_batch(engine),
            self.state.clock.now(),
        )

    def prompt_token_ids(self, request_id: str) -> list[int] | None:
        """The prompt's token ids as the prefill engine returned them (once per request)."""
        return self._prompt_ids.pop(request_id, None)

    def decode_done(self, engine_id: str) -> None:
        self.state.engines[engine_id].in_flight_decode -= 1
        self.metrics.in_flight.labels(engine_id, "decode").dec()
        self._capacity.set()
