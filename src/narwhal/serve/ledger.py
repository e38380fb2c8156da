"""The request ledger: every request that reaches the router is opened here (its
``request.start``, written before any engine is contacted) and closed here exactly once (its one
``request.end`` and its outcome metrics), whatever way it ends."""

from __future__ import annotations

from narwhal.contract import Budgets
from narwhal.journal import Journal
from narwhal.metrics import RouterMetrics
from narwhal.serve.record import RequestRecord
from narwhal.serve.relay import StreamTally

__all__ = ["RequestLedger"]


class RequestLedger:
    def __init__(self, journal: Journal, metrics: RouterMetrics, budgets: Budgets) -> None:
        self.journal = journal
        self.metrics = metrics
        self.budgets = budgets
        self.active: set[str] = set()
        # Set when the router stops admitting (SIGTERM): new requests are refused, and those the
        # drain's end cuts off are closed as router_shutdown by the endpoint that cut them.
        self.draining = False
        self._journal_seen: dict[str, int] = {}

    def open(self, record: RequestRecord) -> bool:
        """The request's ``request.start``; False (nothing recorded) when the journal refuses
        it."""
        if not self.journal.request_start(
            record.id,
            record.arrival,
            endpoint=record.endpoint,
            client_request_id=record.client_request_id,
        ):
            return False
        self.active.add(record.id)
        return True

    def refused_unjournaled(self) -> None:
        """A request refused because the journal takes no more records (``fail_closed``): no
        record can say so, but it reached the router and was turned away, so the metrics
        count it as any request turned away (rejected, and missed)."""
        self.metrics.requests.labels("rejected").inc()
        self.metrics.slo.labels("missed").inc()

    def close(
        self,
        record: RequestRecord,
        outcome: str,
        status: int | None,
        error: str | None = None,
        tally: StreamTally | None = None,
    ) -> None:
        """The request's one ``request.end`` and its metrics. Idempotent."""
        if record.ended:
            return
        record.ended = True
        record.outcome, record.status, record.error = outcome, status, error
        if tally is not None:
            if tally.completion_tokens is not None:
                record.completion_tokens = tally.completion_tokens
            if record.prompt_tokens is None and isinstance(tally.prompt_tokens, int):
                record.prompt_tokens = tally.prompt_tokens  # no prefill leg counted them
            if tally.cached_tokens is not None:
                record.cached_tokens_reported = tally.cached_tokens
            if tally.first_token_at is not None:
                record.t_first_token = tally.first_token_at - record.arrival_mono
            if tally.last_token_at is not None:
                record.t_last_token = tally.last_token_at - record.arrival_mono
        m = self.metrics
        m.requests.labels(outcome).inc()
        tpot = record.tpot_s()
        met = (
            outcome == "ok"
            and record.t_first_token is not None
            and record.t_first_token <= self.budgets.ttft_s
            and (tpot or 0.0) <= self.budgets.tpot_s
        )
        # A malformed request is nobody's latency, and a client that left is not the fleet's
        # to answer for: the attainment alert and the dashboards leave both out.
        if outcome not in ("client_error", "client_abort"):
            m.slo.labels("met" if met else "missed").inc()
        if outcome == "ok":
            if record.t_first_token is not None:
                m.ttft.observe(record.t_first_token)
            m.e2e.observe(record.since_arrival())
            if tpot is not None:
                m.tpot.observe(tpot)
            engine = record.prefill_engine
            if engine is not None and record.prompt_tokens is not None:
                m.prefix_prompt_tokens.labels(engine).inc(record.prompt_tokens)
                if record.cached_tokens_predicted is not None:
                    m.prefix_cached_tokens.labels(engine, "predicted").inc(
                        record.cached_tokens_predicted
                    )
                if record.cached_tokens_reported is not None:
                    m.prefix_cached_tokens.labels(engine, "reported").inc(
                        record.cached_tokens_reported
                    )
        self.journal.request_end(record.id, outcome, **record.end_fields())
        self.active.discard(record.id)

    def sync_journal_metrics(self) -> None:
        """Carry the journal's own counters into Prometheus (they only ever grow)."""
        stats = self.journal.stats()
        self.metrics.journal_backlog.set(stats.backlog)
        for counter, value, key in (
            (self.metrics.journal_errors, stats.write_errors, "errors"),
            (self.metrics.journal_dropped, stats.dropped, "dropped"),
        ):
            delta = value - self._journal_seen.get(key, 0)
            if delta > 0:
                counter.inc(delta)
                self._journal_seen[key] = value
