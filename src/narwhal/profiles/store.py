"""The profile store: per engine and generation, the raw samples and the fitted models.

One pydantic model per file format (the store and the profiling limits). The store is written
as canonical JSON, so its SHA-256 is stable for identical content and the same as the hash of
its parsed document, which is what a fleet's ``profile_store.sha256`` pins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from narwhal.contract import canonical_json, sha256_hex, validate_document
from narwhal.profiles.models import (
    DEFAULT_MAX_EXTRAPOLATION,
    DecodeLatencyModel,
    EngineModels,
    FitQuality,
    PrefillLatencyModel,
    fit_decode,
    fit_prefill,
)

__all__ = [
    "PROFILE_SCHEMA",
    "DecodeFit",
    "DecodeSample",
    "EngineModels",
    "EngineProfile",
    "PrefillFit",
    "PrefillSample",
    "ProfileStore",
    "ProfilingLimits",
    "ProfilingPlan",
    "engine_models",
    "fit_engine",
    "parse_profile_store",
    "store_bytes",
]

PROFILE_SCHEMA = "narwhal.profiles/v1"
LIMITS_SCHEMA = "narwhal.profiling-limits/v1"


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True
    )


class ProfilingLimits(_Model):
    """What one profiling run may spend per engine."""

    schema_version: Literal["narwhal.profiling-limits/v1"] = Field(alias="schema")
    max_wall_s_per_engine: float = Field(gt=0)
    max_tokens_per_engine: int = Field(gt=0)
    probe_timeout_s: float = Field(gt=0)


class ProfilingPlan(_Model):
    prefill_lens: list[int] = Field(min_length=2)
    prefill_repeats: int = Field(ge=1)
    decode_input_lens: list[int] = Field(min_length=1)
    decode_concurrency: list[int] = Field(min_length=2)
    decode_tokens: int = Field(ge=4)

    def tokens_needed(self) -> int:
        prefill = sum(n + 1 for n in self.prefill_lens) * self.prefill_repeats
        decode = sum(
            (n + self.decode_tokens) * c
            for n in self.decode_input_lens
            for c in self.decode_concurrency
        )
        return prefill + decode


class PrefillSample(_Model):
    input_tokens: int = Field(gt=0)
    repeat: int = Field(ge=0)
    seconds: float = Field(gt=0)


class DecodeSample(_Model):
    input_tokens: int = Field(gt=0)
    concurrency: int = Field(gt=0)
    tokens: int = Field(gt=0)
    mean_context: float = Field(gt=0)
    seconds_per_token: float = Field(gt=0)
    itl_samples: int = Field(gt=0)


class PrefillFit(_Model):
    a: float = Field(ge=0)
    b: float = Field(ge=0)
    c: float = Field(ge=0)
    min_tokens: int = Field(gt=0)
    max_tokens: int = Field(gt=0)
    r2: float
    max_rel_residual: float = Field(ge=0)
    samples: int = Field(gt=0)

    @model_validator(mode="after")
    def _a_time(self) -> PrefillFit:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} is above max_tokens {self.max_tokens}")
        # As far as the router extrapolates the fit (PrefillLatencyModel.predict).
        n = _extrapolated(self.max_tokens, "max_tokens")
        _finite_positive(self.a + self.b * n + self.c * n * n, f"a prefill of {n:g} tokens")
        return self


def _extrapolated(limit: int, name: str) -> float:
    """How far the router extrapolates a fit past its range's end ``limit``; ValueError for an
    integer too large for a float (JSON reads 10**400 as one): no engine's range either."""
    try:
        return limit * DEFAULT_MAX_EXTRAPOLATION
    except OverflowError:
        raise ValueError(f"{name} is too large to be a profiled range") from None


def _finite_positive(seconds: float, what: str) -> None:
    # NaN or infinity (a coefficient of 1e308 squared) would break every comparison the
    # scheduler makes; 0 s would make the engine look infinitely fast and draw all the work.
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"predicts {seconds:g} s for {what}: no engine takes that")


class DecodeFit(_Model):
    intercept: float = Field(ge=0)
    slope: float = Field(ge=0)
    ctx_coef: float = Field(ge=0)
    max_batch: int = Field(gt=0)
    max_context: int = Field(gt=0)
    r2: float
    max_rel_residual: float = Field(ge=0)
    samples: int = Field(gt=0)

    @model_validator(mode="after")
    def _a_time(self) -> DecodeFit:
        b = _extrapolated(self.max_batch, "max_batch")
        ctx = _extrapolated(self.max_context, "max_context")
        seconds = self.intercept + self.slope * b + self.ctx_coef * ctx
        _finite_positive(seconds, f"a token at batch {b:g} and context {ctx:g}")
        return self


class EngineProfile(_Model):
    engine_id: str
    url: str
    generation: str | None
    wall_s: float = Field(ge=0)
    tokens_used: int = Field(ge=0)
    prefill_samples: list[PrefillSample] = Field(min_length=2)
    decode_samples: list[DecodeSample] = Field(min_length=2)
    prefill_fit: PrefillFit
    decode_fit: DecodeFit


class ProfileStore(_Model):
    schema_version: Literal["narwhal.profiles/v1"] = Field(alias="schema")
    created_at: str
    complete: bool
    fleet_name: str
    fleet_sha256: str
    plan: ProfilingPlan
    limits: ProfilingLimits
    engines: dict[str, EngineProfile]
    failures: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> ProfileStore:
        for key, engine in self.engines.items():
            if engine.engine_id != key:
                raise ValueError(f"engines.{key}: engine_id is {engine.engine_id!r}")
        if self.complete and self.failures:
            raise ValueError("a store with failures cannot be complete")
        return self


def _quality(fit: PrefillFit | DecodeFit) -> FitQuality:
    return FitQuality(fit.r2, fit.max_rel_residual, fit.samples)


def fit_engine(
    prefill: list[PrefillSample], decode: list[DecodeSample]
) -> tuple[PrefillFit, DecodeFit]:
    p = fit_prefill([s.input_tokens for s in prefill], [s.seconds for s in prefill])
    d = fit_decode(
        [s.concurrency for s in decode],
        [s.mean_context for s in decode],
        [s.seconds_per_token for s in decode],
    )
    assert p.quality is not None and d.quality is not None
    return (
        PrefillFit(
            a=p.a,
            b=p.b,
            c=p.c,
            min_tokens=p.min_tokens,
            max_tokens=p.max_tokens,
            r2=p.quality.r2,
            max_rel_residual=p.quality.max_rel_residual,
            samples=p.quality.samples,
        ),
        DecodeFit(
            intercept=d.intercept,
            slope=d.slope,
            ctx_coef=d.ctx_coef,
            max_batch=d.max_batch,
            max_context=d.max_context,
            r2=d.quality.r2,
            max_rel_residual=d.quality.max_rel_residual,
            samples=d.quality.samples,
        ),
    )


def engine_models(store: ProfileStore) -> dict[str, EngineModels]:
    out = {}
    for engine_id, profile in store.engines.items():
        pf, df = profile.prefill_fit, profile.decode_fit
        out[engine_id] = EngineModels(
            prefill=PrefillLatencyModel(
                pf.a, pf.b, pf.c, pf.min_tokens, pf.max_tokens, _quality(pf)
            ),
            decode=DecodeLatencyModel(
                df.intercept, df.slope, df.ctx_coef, df.max_batch, df.max_context, _quality(df)
            ),
            generation=profile.generation,
        )
    return out


def store_bytes(store: ProfileStore) -> bytes:
    """The canonical bytes written to disk (their SHA-256 is the store's identity)."""
    return canonical_json(store.model_dump(mode="json", by_alias=True))


def parse_profile_store(raw: object, source: str) -> tuple[ProfileStore, str]:
    """Validate a parsed store document: (store, sha256). Pure."""
    # Strict as a file people can edit: true was read as 1 for a number (the store's models
    # coerce, for the profiler's own values).
    store = validate_document(raw, ProfileStore, source, strict=True)
    return store, sha256_hex(raw)


def generation_problems(store: ProfileStore, live: Mapping[str, str | None]) -> list[str]:
    """Why this store does not describe the live engines (empty when it does)."""
    problems = []
    for engine_id, generation in live.items():
        profile = store.engines.get(engine_id)
        if profile is None:
            problems.append(f"engine {engine_id} has no profile in the store")
        elif generation is not None and profile.generation != generation:
            problems.append(
                f"engine {engine_id} was profiled at generation {profile.generation} but runs "
                f"generation {generation} now (restarted): re-profile it"
            )
    return problems
