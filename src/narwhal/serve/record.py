"""What the router learns about one request, and its single terminal journal record."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestRecord"]


_LEG_FIELDS = (
    "prompt_tokens",
    "prefill_engine",
    "decode_engine",
    "role_generation",
    "handoff",
    "mode",
    "t_prefill_start",
    "t_prefill_end",
    "t_decode_start",
    "handoff_first_token_s",
    "cached_tokens_predicted",
    "kv_blocks_predicted",
    "prefill_prompt_details",
)


@dataclass
class RequestRecord:
    """Mutable while the request runs; ``end_fields`` becomes its ``request.end`` record.

    Times are seconds after arrival on the monotonic clock (``t_*``), so they are exact
    durations; ``arrival`` alone is wall-clock, for people.
    """

    id: str
    arrival: float  # wall clock
    arrival_mono: float
    endpoint: str
    client_request_id: str | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prefill_engine: str | None = None
    decode_engine: str | None = None
    role_generation: int | None = None
    handoff: str | None = None  # "nixl" when KV moved, "local" when decode prefilled itself
    # "pd": a prefill leg then a decode leg; "local": the scheduler sent the whole request to
    # the decode engine (routing.local_prefill); None until an engine was picked.
    mode: str | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    t_prefill_start: float | None = None
    t_prefill_end: float | None = None
    t_decode_start: float | None = None
    t_first_token: float | None = None
    t_last_token: float | None = None
    handoff_first_token_s: float | None = None
    # Prompt tokens in the prefilling engine's prefix cache: predicted at the pick, and as the
    # engine reported them; the prompt's KV blocks the decode engine was predicted to pull.
    cached_tokens_predicted: int | None = None
    cached_tokens_reported: int | None = None
    kv_blocks_predicted: int | None = None
    # The KV bytes decode engines pulled for it, over every handoff that reached a first token
    # (choices, a migration's continuation): each handoff's blocks (its prompt's, less those
    # the decode engine held as the index saw them) times the fleet's block bytes.
    kv_bytes_moved: int | None = None
    # The prefill leg's usage.prompt_tokens_details (not journaled): what a migrated answer's
    # usage reports for the client's prompt, whose continuation prompt is another.
    prefill_prompt_details: dict[str, Any] | None = None
    # Choices answered (n times the prompts of a batch): each ran as a P/D request of its own,
    # whose legs are this record's attempts; the engines and times above are choice 0's.
    choices: int = 1
    # Times the request was continued on another pair after its decode leg broke mid-answer.
    migrations: int = 0
    outcome: str | None = None
    status: int | None = None
    error: str | None = None
    ended: bool = False

    def since_arrival(self) -> float:
        return time.monotonic() - self.arrival_mono

    def attempt(self, leg: str, engine: str, outcome: str, **extra: Any) -> None:
        self.attempts.append(
            {
                "leg": leg,
                "engine": engine,
                "outcome": outcome,
                "t": round(self.since_arrival(), 6),
                **extra,
            }
        )

    def legs_snapshot(self) -> tuple[Any, ...]:
        """The first legs' engines, times and counts, which a migration's continuation legs
        must not overwrite (the client's first token was theirs)."""
        return tuple(getattr(self, name) for name in _LEG_FIELDS)

    def restore_legs(self, snapshot: tuple[Any, ...]) -> None:
        for name, value in zip(_LEG_FIELDS, snapshot, strict=True):
            setattr(self, name, value)

    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's definition), if measurable."""
        if (
            self.t_first_token is None
            or self.t_last_token is None
            or not self.completion_tokens
            or self.completion_tokens < 2 * self.choices
        ):
            return None
        # Choices decode side by side: a choice's tokens take the time, not their sum.
        per_choice = self.completion_tokens / self.choices
        return (self.t_last_token - self.t_first_token) / (per_choice - 1)

    def end_fields(self) -> dict[str, Any]:
        fields = {
            "arrival": self.arrival,
            "endpoint": self.endpoint,
            "client_request_id": self.client_request_id,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "prefill_engine": self.prefill_engine,
            "decode_engine": self.decode_engine,
            "role_generation": self.role_generation,
            "mode": self.mode,
            "handoff": self.handoff,
            "t_prefill_start": self.t_prefill_start,
            "t_prefill_end": self.t_prefill_end,
            "t_decode_start": self.t_decode_start,
            "t_first_token": self.t_first_token,
            "t_last_token": self.t_last_token,
            "handoff_first_token_s": self.handoff_first_token_s,
            "status": self.status,
            "error": self.error,
        }
        if self.cached_tokens_predicted is not None:
            fields["cached_tokens_predicted"] = self.cached_tokens_predicted
        if self.cached_tokens_reported is not None:
            fields["cached_tokens_reported"] = self.cached_tokens_reported
        if self.kv_blocks_predicted is not None:
            fields["kv_blocks_predicted"] = self.kv_blocks_predicted
        if self.kv_bytes_moved is not None:
            fields["kv_bytes_moved"] = self.kv_bytes_moved
        if self.choices > 1:
            fields["choices"] = self.choices
        if self.migrations:
            fields["migrations"] = self.migrations
        # Always there, empty when no leg was tried (turned away, no pair): a reader of the
        # journal need not test for it.
        fields["attempts"] = self.attempts
        return fields
