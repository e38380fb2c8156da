"""Reading a running engine's live facts: served model, version, KV cache geometry and NIXL
side channel. Used by ``launch_plan.py capture`` and by ``finalize-fleet``.

A simulated engine serves all of it on ``/attestation``. A real vLLM engine does not: its
model comes from ``/v1/models``, its version from ``/version``, its cache geometry from the
``vllm:cache_config_info`` gauge on ``/metrics``, and its side channel is the one the plan
set through ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT``, probed with a TCP connect. Each fact says
where it came from, so a reader can tell a measured value from a declared one.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from narwhal.contract import ContractError, read_json_document, validate_document
from narwhal.contract.loader import validation_reasons
from narwhal.contract.models import format_loc

__all__ = [
    "LIVE_SCHEMA",
    "Declared",
    "KVCacheFacts",
    "LiveContract",
    "LiveEngine",
    "NixlFacts",
    "capture_engine",
    "load_live",
]

LIVE_SCHEMA = "narwhal.live-contract/v1"

# Live facts come from engines of several versions: keep what we do not know about.
_OPEN = ConfigDict(extra="allow")


class _Open(BaseModel):
    model_config = _OPEN


# The facts finalize-fleet compares across engines are typed, so that a file read strictly
# refuses "16" where 16 belongs: coerced or compared as written, it made lines such as
# "KV block_size 16 differs from e0's 16".
@with_config(_OPEN)
class KVCacheFacts(TypedDict, total=False):
    block_size: int | None
    num_blocks: int | None
    block_bytes: int | None
    cache_dtype: str | None
    source: str


@with_config(_OPEN)
class NixlFacts(TypedDict, total=False):
    host: str
    port: int
    listening: bool
    source: str


class LiveEngine(_Open):
    id: str
    url: str
    model_id: str | None = None
    models: list[str] = []
    max_model_len: int | None = None
    version: str | None = None
    kv_cache: KVCacheFacts | None = None
    nixl: NixlFacts | None = None
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_buffer_device: str | None = None
    tp: int | None = None
    gpu_arch: str | None = None
    pid: int | None = None
    generation: str | None = None
    engine_attestation: dict[str, Any] | None = None


class LiveContract(_Open):
    schema_version: Literal["narwhal.live-contract/v1"] = Field(alias="schema")
    engines: list[LiveEngine]

    def engine(self, engine_id: str) -> LiveEngine | None:
        return next((e for e in self.engines if e.id == engine_id), None)


def load_live(path: str, source: str) -> LiveContract:
    """A ``capture`` file, read as strictly as a fleet (no value coerced to a field's type, no
    duplicate JSON keys) and with each engine once; ContractError naming ``source`` and the
    place otherwise."""
    try:
        raw = read_json_document(path)
    except ContractError as exc:
        raise ContractError(source, exc.path, exc.reason) from None
    live = validate_document(raw, LiveContract, source, strict=True)
    first: dict[str, int] = {}
    for i, engine in enumerate(live.engines):
        if engine.id in first:
            # Which of the two is the engine's facts cannot be told; the first used to win.
            raise ContractError(
                source,
                f"engines[{i}].id",
                f"duplicate engine {engine.id!r} (engines[{first[engine.id]}] is it too)",
            )
        first[engine.id] = i
    return live


@dataclass(frozen=True)
class Declared:
    """What the plan or fleet says about an engine, for facts vLLM does not serve."""

    nixl_host: str | None = None
    nixl_port: int | None = None
    kv_connector: str | None = None
    kv_role: str | None = None


def _get_json(client: httpx.Client, url: str) -> tuple[Any, str | None]:
    try:
        resp = client.get(url)
    except httpx.HTTPError as exc:
        return None, f"GET {url}: {type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return None, f"GET {url}: HTTP {resp.status_code}"
    try:
        return resp.json(), None
    except ValueError:
        return None, f"GET {url}: not JSON"


def _listening(host: str, port: int, timeout_s: float = 2.0) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout_s):
        return True
    return False


def _cache_from_metrics(client: httpx.Client, url: str) -> dict[str, Any] | None:
    try:
        resp = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        families = list(text_string_to_metric_families(resp.text))
    except ValueError:
        return None
    for family in families:
        if family.name != "vllm:cache_config_info":
            continue
        for sample in family.samples:
            labels = sample.labels
            with contextlib.suppress(KeyError, ValueError):
                return {
                    "block_size": int(labels["block_size"]),
                    "num_blocks": int(labels["num_gpu_blocks"]),
                    "block_bytes": None,
                    "cache_dtype": labels.get("cache_dtype"),
                    "source": "metrics",
                }
    return None


def capture_engine(
    client: httpx.Client, engine_id: str, url: str, declared: Declared
) -> tuple[LiveEngine, list[str]]:
    """The engine's live facts and one line per fact that could not be read."""
    problems: list[str] = []
    url = url.rstrip("/")
    try:
        health = client.get(f"{url}/health").status_code
    except httpx.HTTPError as exc:
        return LiveEngine(id=engine_id, url=url), [f"{engine_id}: unreachable at {url}: {exc}"]
    if health != 200:
        problems.append(f"{engine_id}: /health answered {health}")
    facts: dict[str, Any] = {"id": engine_id, "url": url}
    models, err = _get_json(client, f"{url}/v1/models")
    if err:
        problems.append(f"{engine_id}: {err}")
    elif isinstance(models, dict) and isinstance(models.get("data"), list):
        data = [m for m in models["data"] if isinstance(m, dict)]
        facts["models"] = [str(m.get("id")) for m in data]
        if data:
            facts["model_id"] = str(data[0].get("id"))
            if isinstance(data[0].get("max_model_len"), int):
                facts["max_model_len"] = data[0]["max_model_len"]
    version, err = _get_json(client, f"{url}/version")
    if not err and isinstance(version, dict):
        facts["version"] = version.get("version")
    att, err = _get_json(client, f"{url}/attestation")
    if not err and isinstance(att, dict):
        facts["engine_attestation"] = att
        for key in ("kv_connector", "kv_role", "kv_buffer_device", "tp", "gpu_arch", "pid"):
            facts[key] = att.get(key)
        facts["generation"] = att.get("generation")
        if isinstance(att.get("kv_cache"), dict):
            facts["kv_cache"] = {**att["kv_cache"], "source": "attestation"}
        if isinstance(att.get("nixl"), dict):
            facts["nixl"] = {**att["nixl"], "source": "attestation"}
    if "kv_cache" not in facts:
        cache = _cache_from_metrics(client, url)
        if cache is None:
            problems.append(
                f"{engine_id}: no KV cache geometry (no /attestation, no vllm:cache_config_info)"
            )
        else:
            facts["kv_cache"] = cache
    if "nixl" not in facts and declared.nixl_host and declared.nixl_port:
        facts["nixl"] = {"host": declared.nixl_host, "port": declared.nixl_port, "source": "plan"}
    if facts.get("kv_connector") is None and declared.kv_connector:
        facts["kv_connector"] = declared.kv_connector
        facts["kv_role"] = declared.kv_role
    nixl = facts.get("nixl")
    if nixl is None:
        problems.append(f"{engine_id}: NIXL side channel unknown")
    else:
        nixl["listening"] = _listening(str(nixl["host"]), int(nixl["port"]))
        if not nixl["listening"]:
            where = f"{nixl['host']}:{nixl['port']}"
            problems.append(f"{engine_id}: nothing listens on the NIXL side channel {where}")
    try:
        return LiveEngine.model_validate(facts), problems
    except ValidationError as exc:
        # An engine answering a fact in a shape no engine uses: one line, not a traceback.
        loc, reason = validation_reasons(exc)[0]
        problems.append(f"{engine_id}: unreadable live facts at {url}: {format_loc(loc)}: {reason}")
        return LiveEngine(id=engine_id, url=url), problems
