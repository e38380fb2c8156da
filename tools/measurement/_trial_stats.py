"""Per-request client records and the load-trial summary, with vLLM's definitions.

Definitions (``vllm bench serve``, ``vllm/benchmarks/serve.py``, where they overlap):

- TTFT: request sent -> first streamed chunk that carries a choice.
- E2E latency: request sent -> last streamed chunk that carries a choice (the usage-only chunk and
  ``[DONE]`` are not tokens).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request with more than one output token: the
  first token is excluded. ``output_tokens`` is the server's ``usage.completion_tokens``.
- ITL: the gaps between consecutive choice chunks, pooled over all completed requests.
- Duration: first measured request sent -> last measured request finished, so it includes the
  drain after the last arrival. Completed rate, output throughput and total token throughput
  divide by it ("including drain").
- Percentiles: ``numpy.percentile`` with linear interpolation, as vLLM
  (``narwhal.testing.stats.percentile``).

Narwhal's own: a request is *within limits* when it completed (HTTP 200, ``[DONE]``, no error
event, exactly the requested output tokens) with TTFT <= the TTFT budget and TPOT <= the TPOT
budget; attainment = within limits / measured requests (failures count against it); the verdict
passes when attainment >= the target. The budgets are the fleet contract's type
(``narwhal.contract.Budgets``); the client's per-request bound is the summary's ``timeout_s``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from narwhal.contract import Budgets
from narwhal.testing.stats import percentile

__all__ = [
    "CLIENT_OUTCOMES",
    "SUMMARY_SCHEMA",
    "ClientRecord",
    "Distribution",
    "TrialSummary",
    "distribution",
    "summarize",
]

SUMMARY_SCHEMA = "narwhal.load-trial-summary/v1"

Outcome = Literal[
    "ok",  # complete, exactly the requested output tokens
    "short_output",  # complete stream but fewer/more tokens than requested (ignore_eos was set)
    "http_error",  # a non-200 answer
    "stream_error",  # an error event, or a stream that ended without [DONE]
    "timeout",  # no end within --timeout; the client closed the connection
    "connect_error",  # never reached the router
    "transport_error",  # the connection broke after it was established
]
CLIENT_OUTCOMES: tuple[str, ...] = Outcome.__args__  # type: ignore[attr-defined]


class ClientRecord(BaseModel):
    """One line of ``client_records.jsonl``. Times are seconds on the client's monotonic clock
    relative to the run's ``t0`` (see the summary's ``t0_wall`` to place them on wall time)."""

    model_config = ConfigDict(extra="forbid")

    index: int  # -1 for the warmup
    warmup: bool
    client_request_id: str
    router_request_id: str | None = None
    scheduled_s: float | None  # the planned send time (None: the warmup)
    sent_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    status: int | None = None
    outcome: Outcome
    error: str | None = None
    prompt_tokens: int  # as sent
    expected_output_tokens: int
    output_tokens: int | None = None  # usage.completion_tokens (else the chunk count)
    output_tokens_source: Literal["usage", "chunks"] | None = None
    usage_prompt_tokens: int | None = None
    chunks: int = 0
    finish_reason: str | None = None
    # After [DONE]: did the server end the response (None: no [DONE] was read)?
    closed_after_done: bool | None = None
    # Gaps between consecutive choice chunks, seconds (every token's time follows from these).
    itl: list[float] = Field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.outcome == "ok"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        """vLLM's TPOT; 0 for a request with a single output token (as vLLM's goodput)."""
        if self.ttft is None or self.e2e is None or not self.output_tokens:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class Distribution(BaseModel):
    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None
    min: float | None
    max: float | None


def distribution(values: Sequence[float]) -> Distribution:
    if not values:
        return Distribution(count=0, mean=None, p50=None, p95=None, p99=None, min=None, max=None)
    return Distribution(
        count=len(values),
        mean=float(np.mean(values)),
        p50=percentile(values, 50),
        p95=percentile(values, 95),
        p99=percentile(values, 99),
        min=float(min(values)),
        max=float(max(values)),
    )


class TrialSummary(BaseModel):
    """``summary.json``: seconds throughout (the CSV converts to MAD's milliseconds)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["narwhal.load-trial-summary/v1"] = Field(alias="schema")
    run_id: str
    base: str
    model: str
    workload: dict[str, Any]
    arrivals: dict[str, Any]
    budgets: Budgets
    timeout_s: float  # the client's bound on each request (load_trial.py run --timeout)
    t0_wall: float
    started_wall: float
    ended_wall: float
    requests: int
    completed: int
    by_outcome: dict[str, int]
    warmup: dict[str, Any]
    duration_s: float | None
    offered_rate_rps: float | None
    completed_rate_rps: float | None
    output_throughput_tps: float | None
    total_token_throughput_tps: float | None
    total_input_tokens: int
    total_output_tokens: int
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2el_s: Distribution
    within_limits: int
    attainment: float
    verdict: Literal["pass", "fail"]
    result: str  # "200/200 within limits"
    peak_concurrency: int
    max_send_lag_s: float  # worst lateness of a send against its schedule (open-loop fidelity)
    streams_left_open: int  # responses the server kept open after [DONE] (see ClientRecord)
    command: list[str]
    versions: dict[str, Any]


def peak_concurrency(records: Iterable[ClientRecord]) -> int:
    events: list[tuple[float, int]] = []
    for r in records:
        end = r.end_s if r.end_s is not None else r.sent_s
        events.append((r.sent_s, 1))
        events.append((end, -1))
    # Ends before starts at equal times: a request that ended does not overlap the next.
    events.sort(key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def summarize(
    records: list[ClientRecord],
    *,
    budgets: Budgets,
    offered_rate_rps: float | None,
    **fields: Any,
) -> TrialSummary:
    measured = [r for r in records if not r.warmup]
    done = [r for r in measured if r.completed]
    warm = next((r for r in records if r.warmup), None)
    duration = None
    if done:
        start = min(r.sent_s for r in measured)
        end = max(r.end_s for r in done if r.end_s is not None)
        duration = end - start if end > start else None
    out_tokens = sum(r.output_tokens or 0 for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None and (r.output_tokens or 0) > 1]
    itls = [gap for r in done for gap in r.itl]
    e2es = [r.e2e for r in done if r.e2e is not None]
    within = sum(
        1
        for r in done
        if r.ttft is not None
        and r.ttft <= budgets.ttft_s
        and r.tpot is not None
        and r.tpot <= budgets.tpot_s
    )
    attainment = within / len(measured) if measured else 0.0
    lags = [r.sent_s - r.scheduled_s for r in measured if r.scheduled_s is not None]
    return TrialSummary(
        schema=SUMMARY_SCHEMA,
        budgets=budgets,
        requests=len(measured),
        completed=len(done),
        by_outcome=dict(sorted(Counter(r.outcome for r in measured).items())),
        warmup={
            "outcome": warm.outcome if warm else None,
            "client_request_id": warm.client_request_id if warm else None,
            "ttft_s": warm.ttft if warm else None,
            "e2e_s": warm.e2e if warm else None,
        },
        duration_s=duration,
        offered_rate_rps=offered_rate_rps,
        completed_rate_rps=len(done) / duration if duration else None,
        output_throughput_tps=out_tokens / duration if duration else None,
        total_token_throughput_tps=(in_tokens + out_tokens) / duration if duration else None,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        ttft_s=distribution(ttfts),
        tpot_s=distribution(tpots),
        itl_s=distribution(itls),
        e2el_s=distribution(e2es),
        within_limits=within,
        attainment=attainment,
        verdict="pass" if measured and attainment >= budgets.attainment else "fail",
        result=f"{within}/{len(measured)} within limits",
        peak_concurrency=peak_concurrency(measured),
        max_send_lag_s=max(lags) if lags else 0.0,
        streams_left_open=sum(1 for r in records if r.closed_after_done is False),
        **fields,
    )
