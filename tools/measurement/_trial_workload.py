"""Workloads for load_trial.py: a token pool taken from the model's own prompt ids, prompts of
exact token counts drawn from it, output lengths, optional trace arrival times, and a SHA-256.

Why token ids: a text prompt's length depends on the tokenizer, so "8,192 input tokens" is only
exact when the client sends ids. Why a pool from the *prompt* ids of a seed completion: those are
ids the served tokenizer really produces for ordinary text, whereas a greedy seed completion's
output ids can all be the same id (the qualification run saw exactly that), which would give a
repeated-token prompt.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from narwhal.contract.hashing import sha256_hex
from narwhal.fleetsim.workloads import read_azure_trace

__all__ = [
    "DEFAULT_SEED_PROMPT",
    "WORKLOAD_FILE",
    "WORKLOAD_SCHEMA",
    "PoolSource",
    "SeedError",
    "TokenPool",
    "TraceRow",
    "Workload",
    "WorkloadError",
    "WorkloadRequest",
    "build_fixed_workload",
    "build_trace_workload",
    "fetch_pool",
    "load_workload",
    "read_trace",
    "save_workload",
]

WORKLOAD_SCHEMA = "narwhal.workload/v1"
WORKLOAD_FILE = "workload.json"
# Ordinary English: its prompt ids are ids the served tokenizer emits for text.
DEFAULT_SEED_PROMPT = (
    "Narwhals are medium-sized toothed whales that live year-round in the Arctic waters "
    "around Greenland, Canada and Russia."
)
# Fewer distinct ids than this and prompts become near-repetitions of a few tokens.
MIN_DISTINCT_IDS = 8

PoolSource = Literal["completion.prompt_token_ids", "stream.prompt_token_ids", "engine./tokenize"]


class WorkloadError(Exception):
    """A workload or trace file cannot be read or is inconsistent (one line)."""


class SeedError(Exception):
    """The seed completion did not yield usable prompt token ids (one line)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenPool(_Model):
    source: PoolSource
    seed_prompt: str
    # The prompt ids as returned, in order (repeats kept), and the distinct ids prompts use.
    ids: list[int]
    distinct: list[int]


class TraceRef(_Model):
    path: str
    sha256: str  # of the trace file's bytes
    first_row: int
    rows: int
    capped_prompts: int  # rows whose ContextTokens exceeded the model's room and were capped


class WorkloadRequest(_Model):
    prompt: list[int] = Field(min_length=1)
    output_tokens: int = Field(gt=0)
    # Seconds after the first trace row; None for Poisson workloads.
    arrival_s: float | None = None


class Workload(_Model):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["narwhal.workload/v1"] = Field(alias="schema")
    model: str
    seed: int
    # Fixed shapes; None for trace workloads, whose lengths vary per request.
    input_tokens: int | None
    output_tokens: int | None
    pool: TokenPool
    trace: TraceRef | None = None
    warmup: WorkloadRequest
    requests: list[WorkloadRequest] = Field(min_length=1)
    # Where and how it was made: for people, not part of the identity.
    provenance: dict[str, Any] = Field(default_factory=dict)
    sha256: str = ""

    def identity(self) -> str:
        """SHA-256 of the canonical JSON of everything but ``sha256`` and ``provenance``."""
        doc = self.model_dump(by_alias=True, exclude={"sha256", "provenance"})
        return sha256_hex(doc)

    @property
    def has_arrivals(self) -> bool:
        return all(r.arrival_s is not None for r in self.requests)


# --- the seed completion -----------------------------------------------------------------


def _prompt_ids_from_choice(obj: Any) -> list[int] | None:
    if not isinstance(obj, dict):
        return None
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            ids = choice.get("prompt_token_ids")
            if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
                return list(ids)
    ids = obj.get("prompt_token_ids")  # chat responses carry it at the top level
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return list(ids)
    return None


def _seed_body(model: str, prompt: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _error_text(response: httpx.Response) -> str:
    try:
        message = response.json().get("error", {}).get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {response.status_code}" + (f": {str(message)[:200]}" if message else "")


@dataclass
class PoolAttempt:
    method: str
    result: str


def fetch_pool(
    client: httpx.Client,
    model: str,
    prompt: str,
    tokenize_url: str | None,
    attempts: list[PoolAttempt],
) -> tuple[PoolSource, list[int]]:
    """Ask for the seed prompt's token ids: the non-streamed completion first, then the first
    chunk of a streamed one (vLLM sends ``prompt_token_ids`` there), then, only if the operator
    named one, ``/tokenize`` at ``tokenize_url`` (an engine's, or the router's: it passes
    ``/tokenize`` to an engine)."""
    response = client.post("/v1/completions", json=_seed_body(model, prompt, stream=False))
    if response.status_code != 200:
        raise SeedError(f"seed completion failed: {_error_text(response)}")
    ids = _prompt_ids_from_choice(response.json())
    attempts.append(PoolAttempt("completion", "ids" if ids else "no prompt_token_ids"))
    if ids:
        return "completion.prompt_token_ids", ids
    with client.stream(
        "POST", "/v1/completions", json=_seed_body(model, prompt, stream=True)
    ) as response:
        if response.status_code != 200:
            response.read()
            raise SeedError(f"streamed seed completion failed: {_error_text(response)}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                chunk = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(chunk, dict) and chunk.get("choices"):
                ids = _prompt_ids_from_choice(chunk)
                break  # only the first chunk carries them
    attempts.append(PoolAttempt("stream", "ids" if ids else "no prompt_token_ids in first chunk"))
    if ids:
        return "stream.prompt_token_ids", ids
    if tokenize_url is None:
        raise SeedError(
            "no prompt token ids through this URL (non-streamed completion and first stream "
            "chunk lack prompt_token_ids); pass --tokenize-url URL to ask the /tokenize "
            "of an engine (or of the router, which passes it to one)"
        )
    response = client.post(
        tokenize_url.rstrip("/") + "/tokenize", json={"model": model, "prompt": prompt}
    )
    if response.status_code != 200:
        raise SeedError(f"{tokenize_url}/tokenize failed: {_error_text(response)}")
    tokens = response.json().get("tokens")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)):
        raise SeedError(f"{tokenize_url}/tokenize returned no token list")
    attempts.append(PoolAttempt("tokenize", "ids"))
    return "engine./tokenize", list(tokens)


def make_pool(source: PoolSource, prompt: str, ids: list[int]) -> TokenPool:
    distinct = sorted(set(ids))
    if len(distinct) < MIN_DISTINCT_IDS:
        raise SeedError(
            f"the seed prompt gave only {len(distinct)} distinct token ids (need at least "
            f"{MIN_DISTINCT_IDS}); use a longer --seed-prompt"
        )
    return TokenPool(source=source, seed_prompt=prompt, ids=ids, distinct=distinct)


# --- building ------------------------------------------------------------------------------


def _prompt(rng: random.Random, pool: list[int], n: int) -> list[int]:
    # random.Random is stable across Python versions; the stored prompts are the record anyway.
    return rng.choices(pool, k=n)


def build_fixed_workload(
    model: str,
    pool: TokenPool,
    input_tokens: int,
    output_tokens: int,
    seed: int,
    num_prompts: int,
    provenance: dict[str, Any],
) -> Workload:
    rng = random.Random(seed)
    warmup = WorkloadRequest(
        prompt=_prompt(rng, pool.distinct, input_tokens), output_tokens=output_tokens
    )
    requests = [
        WorkloadRequest(
            prompt=_prompt(rng, pool.distinct, input_tokens), output_tokens=output_tokens
        )
        for _ in range(num_prompts)
    ]
    wl = Workload(
        schema=WORKLOAD_SCHEMA,
        model=model,
        seed=seed,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        pool=pool,
        warmup=warmup,
        requests=requests,
        provenance=provenance,
    )
    wl.sha256 = wl.identity()
    return wl


@dataclass(frozen=True)
class TraceRow:
    t_s: float  # seconds after the first row read
    context_tokens: int
    generated_tokens: int


def read_trace(path: Path, first_row: int, rows: int) -> tuple[list[TraceRow], str]:
    """Rows ``first_row`` .. ``first_row + rows - 1`` (0 = the first data row) of an Azure-format
    trace (``TIMESTAMP, ContextTokens, GeneratedTokens``), times from the first of them, and the
    file's SHA-256. Read by narwhal-fleetsim's reader, so both tools take and refuse the same
    files with the same words (the row, the column, why)."""
    try:
        data = path.read_bytes()
        read = read_azure_trace(path, limit=first_row + rows, data=data)
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise WorkloadError(str(exc)) from None
    window = read[first_row:]
    if not window:
        raise WorkloadError(f"{path}: no data rows from row {first_row}")
    t0 = window[0][0]
    out = [TraceRow(t - t0, context, generated) for t, context, generated in window]
    return out, hashlib.sha256(data).hexdigest()


def build_trace_workload(
    model: str,
    pool: TokenPool,
    trace_path: Path,
    trace_sha256: str,
    rows: list[TraceRow],
    first_row: int,
    seed: int,
    max_model_len: int,
    provenance: dict[str, Any],
) -> Workload:
    rng = random.Random(seed)
    capped = 0
    requests: list[WorkloadRequest] = []
    for row in rows:
        out = min(row.generated_tokens, max_model_len - 1)
        room = max_model_len - out
        n = row.context_tokens
        if n > room:
            n, capped = room, capped + 1
        requests.append(
            WorkloadRequest(
                prompt=_prompt(rng, pool.distinct, n), output_tokens=out, arrival_s=row.t_s
            )
        )
    first = requests[0]
    warmup = WorkloadRequest(
        prompt=_prompt(rng, pool.distinct, len(first.prompt)), output_tokens=first.output_tokens
    )
    wl = Workload(
        schema=WORKLOAD_SCHEMA,
        model=model,
        seed=seed,
        input_tokens=None,
        output_tokens=None,
        pool=pool,
        trace=TraceRef(
            path=str(trace_path),
            sha256=trace_sha256,
            first_row=first_row,
            rows=len(rows),
            capped_prompts=capped,
        ),
        warmup=warmup,
        requests=requests,
        provenance=provenance,
    )
    wl.sha256 = wl.identity()
    return wl


# --- files ---------------------------------------------------------------------------------


def save_workload(wl: Workload, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / WORKLOAD_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(wl.model_dump_json(by_alias=True), encoding="utf-8")
    tmp.replace(path)
    return path


def load_workload(directory: Path) -> Workload:
    path = directory / WORKLOAD_FILE if directory.is_dir() else directory
    try:
        wl = Workload.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise WorkloadError(f"{path}: {where}: {err.get('msg')}") from None
    if wl.identity() != wl.sha256:
        raise WorkloadError(f"{path}: sha256 does not match the content (edited or truncated?)")
    return wl
