"""What the collector brings back from the engines: plain data the gates judge.

The collector (``collect.py``) does every socket call and fills these; the gates (``gates/``)
never touch the network, so each verdict can be reproduced from recorded evidence in a test.
Times are seconds from the injected monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Call",
    "EngineHealth",
    "GenerationResult",
    "HandoffProbe",
    "KVEventsSeen",
    "ModelsResult",
    "PaceResult",
    "PairResult",
    "TokenizeResult",
]


@dataclass(frozen=True)
class Call:
    """One bounded HTTP call: its status (None: no answer) and how long it took."""

    status: int | None
    latency_s: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def describe(self) -> str:
        if self.error:
            return self.error
        return f"HTTP {self.status}"


@dataclass(frozen=True)
class EngineHealth:
    engine_id: str
    health: Call
    # None when the fleet gives the engine no attestation_url.
    attestation: Call | None
    attestation_doc: dict[str, Any] | None = None


@dataclass(frozen=True)
class GenerationResult:
    engine_id: str
    requested: int
    tokens: list[int] | None = None  # token ids as the engine returned them
    text: str | None = None
    completion_tokens: int | None = None  # usage.completion_tokens
    finish_reason: str | None = None
    latency_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class ModelsResult:
    engine_id: str
    ids: list[str] | None = None
    max_model_len: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class TokenizeResult:
    engine_id: str
    # One token-id list per prompt of the fixed set, in order; None: the engine failed.
    tokens: list[list[int]] | None = None
    error: str | None = None


@dataclass(frozen=True)
class PaceResult:
    engine_id: str
    live_generation: str | None
    idle_problem: str | None = None  # why the engine was not idle (measurements unusable)
    prefill_tokens: int = 0
    prefill_s: list[float] = field(default_factory=list)  # time to first token, per repeat
    decode_input_tokens: int = 0
    decode_tokens: int = 0
    decode_s_per_token: float | None = None  # median inter-token gap of one stream
    error: str | None = None


@dataclass(frozen=True)
class HandoffProbe:
    """One real P/D handoff: prefill leg on P, decode leg on D with P's kv_transfer_params."""

    prefill_s: float | None = None  # prefill leg, request to response
    first_token_s: float | None = None  # decode leg start to its first token (the deadline's)
    tokens: int = 0  # tokens the decode leg streamed
    error: str | None = None
    # Whether the prefill leg's usage had prompt_tokens_details.cached_tokens (vLLM's
    # --enable-prompt-tokens-details); None when its answer was not read.
    reports_cached_tokens: bool | None = None


@dataclass(frozen=True)
class PairResult:
    prefill: str
    decode: str
    probes: list[HandoffProbe]
    # Rise of the decode engine's vllm:nixl_bytes_transferred histogram over the probes;
    # None when the engine does not export it (KV movement then unconfirmed, not failed).
    kv_transfers: float | None = None
    kv_bytes: float | None = None
    failed_transfers: float | None = None  # rise of vllm:nixl_num_failed_transfers

    @property
    def name(self) -> str:
        return f"{self.prefill}->{self.decode}"


@dataclass(frozen=True)
class KVEventsSeen:
    """What one engine's KV event stream (its fleet ``kv_events``) carried while the
    kv_transfer gate's handoffs ran, read as the router reads it (``KVEventSubscriber``)."""

    engine_id: str
    endpoint: str
    replay_endpoint: str | None
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    block_sizes: tuple[int, ...] = ()  # the block sizes its BlockStored events carried
    bad_payloads: int = 0  # batches the router could not read
    resets: int = 0  # gaps the replay socket could not fill, restarts
    # "ok" when the replay socket gave back the last batch seen, else why not; None without
    # a replay socket or a batch to ask for.
    replay: str | None = None
    error: str | None = None  # why the subscription stopped reading before the end
