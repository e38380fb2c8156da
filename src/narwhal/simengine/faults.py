"""Fault injection for the simulated engine: set from CLI flags at start and changed at run time
through the guarded admin endpoint. Each field says what it breaks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FaultSettings", "FaultUpdate"]

MetricsFault = Literal["ok", "lie", "stop", "hang"]


class FaultSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Answer the next N generation requests with `fail_status` before doing any work.
    fail_next: int = Field(0, ge=0)
    fail_status: int = Field(503, ge=500, le=599)
    # Exit the process (as a crash: no cleanup, exit code 137) at the named moment.
    crash_on_prefill: bool = False  # when the next prompt starts computing
    crash_on_kv_read: bool = False  # when a decode leg is about to pull remote KV
    crash_after_tokens: int | None = Field(None, ge=1)  # once a stream has sent this many
    # A decode leg's KV READ stalls this long before it is posted (bounded by the read timeout).
    hang_kv_read_s: float = Field(0.0, ge=0)
    # Only READs from these prefill engines (remote engine ids) stall; empty: every READ does.
    hang_kv_read_from: list[str] = Field(default_factory=list)
    # The first token of each request is held back this long (wall seconds).
    stall_first_token_s: float = Field(0.0, ge=0)
    # Multiplies every step time: 10 makes the engine ten times slower.
    slowdown: float = Field(1.0, gt=0)
    # Streams drop their connection (no terminating chunk) after this many tokens.
    drop_stream_after_tokens: int | None = Field(None, ge=0)
    # Generation fails after this many tokens, as vLLM's does (an output finished "error"):
    # the token after the N-th is replaced by an error event (vLLM's error object, then
    # [DONE]) in a stream, and a whole response that would have more answers 500 with it.
    # Counted over a response's choices; a response of at most N tokens is unaffected.
    error_after_tokens: int | None = Field(None, ge=0)
    # /metrics: "lie" reports an idle engine, "stop" answers 503, "hang" never answers.
    metrics: MetricsFault = "ok"
    # The next N /health requests never answer (a stalled API server).
    hang_health_next: int = Field(0, ge=0)


class FaultUpdate(BaseModel):
    """A partial update; fields left out keep their value."""

    model_config = ConfigDict(extra="forbid")

    fail_next: int | None = Field(None, ge=0)
    fail_status: int | None = Field(None, ge=500, le=599)
    crash_now: bool = False
    crash_on_prefill: bool | None = None
    crash_on_kv_read: bool | None = None
    crash_after_tokens: int | None = Field(None, ge=1)
    hang_kv_read_s: float | None = Field(None, ge=0)
    hang_kv_read_from: list[str] | None = None
    stall_first_token_s: float | None = Field(None, ge=0)
    slowdown: float | None = Field(None, gt=0)
    drop_stream_after_tokens: int | None = Field(None, ge=0)
    error_after_tokens: int | None = Field(None, ge=0)
    metrics: MetricsFault | None = None
    hang_health_next: int | None = Field(None, ge=0)

    def apply(self, settings: FaultSettings) -> None:
        for name, value in self.model_dump(exclude_unset=True, exclude={"crash_now"}).items():
            setattr(settings, name, value)
