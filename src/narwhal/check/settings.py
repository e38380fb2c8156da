"""The knobs of a check run, and the fixed prompts the identity gates send.

Every value here ends up in the report's ``settings``: a verdict is only meaningful next to the
tolerance it was judged with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GENERATION_TEXT", "TOKENIZATION_PROMPTS", "CheckSettings"]

# Tokenized once (on the first engine that answers) into the token-id prompt every engine
# generates from: the same ids go to every engine, so the generation gate compares weights,
# not tokenizers (the tokenization gate compares those).
GENERATION_TEXT = (
    "Make sure the data size fits the page: take the same line of code, note the rate and time."
)

# The tokenization gate's fixed prompt set. Plain English prose, prose dense with short common
# words (" data", " time", " code" ... which are whole tokens in real vocabularies and in the
# simulator's, so a permuted vocabulary shows), code, numbers and a chat-shaped turn. ASCII
# dominated on purpose: the router's bytes-per-token estimate is meant for such traffic.
TOKENIZATION_PROMPTS: tuple[str, ...] = (
    "Disaggregated serving splits the compute bound prefill of a prompt from the memory bound "
    "decode of its answer, and moves the key value cache between engines over a fast fabric.",
    "Take the same data, make a note of the time, save the file, then take a look at the code "
    "line by line: the page size, the base rate and the wide side of the same tile.",
    "def first_token(deadline_s: float) -> bool:\n    return elapsed() <= deadline_s  # note\n",
    "Budgets: ttft 10.0 s, tpot 0.300 s, attainment 95%; 8192 input tokens, 128 output, "
    "seed 1729, rates 0.5 and 1.0 requests per second.",
    "user: Why split prefill from decode? Give me the same answer in one line, make it safe.",
)


@dataclass(frozen=True)
class CheckSettings:
    # health: bound on each /health and attestation answer.
    health_timeout_s: float = 5.0
    # Bound on any single probe request (generation, tokenize, pace, a P/D leg).
    probe_timeout_s: float = 60.0
    # generation: greedy tokens per engine.
    generation_tokens: int = 8
    # pace: relative deviation allowed between a probe and the profile store, both ways.
    pace_tolerance: float = 0.35
    pace_repeats: int = 3
    # tokenization: relative error allowed between the router's learnt prompt-length estimate
    # and the engines' token count.
    token_tolerance: float = 0.5
    # kv_transfer: handoffs per permitted pair, their prompt length (None: from the plan's
    # workload, else the store's longest profiled prompt, else 1024), decode tokens streamed,
    # the observation window per leg (None: the larger of the TTFT budget and twice the
    # deadline) and the margin a recommended deadline keeps above the observed maximum (60%:
    # with the qualification run's numbers, 5.274 s observed, it recommends the 8.5 s chosen).
    kv_probes: int = 3
    kv_prompt_tokens: int | None = None
    kv_output_tokens: int = 2
    kv_window_s: float | None = None
    kv_margin: float = 0.6
    # slo: fraction of the TPOT budget the batch-1 decode time must leave free.
    tpot_headroom: float = 0.1

    def document(self) -> dict[str, Any]:
        return asdict(self)
