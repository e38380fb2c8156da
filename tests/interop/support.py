"""Requests, responses and metrics for the real-vLLM interop suite."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import metric

NIXL_COUNT = "vllm:nixl_bytes_transferred_count"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"


@dataclass
class Result:
    """One generation, streamed or not, reduced to what the suite compares."""

    status: int
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    request_id: str | None = None
    body: Any = None
    events: list[Any] = field(default_factory=list)

    @property
    def usage_counts(self) -> tuple[Any, Any, Any] | None:
        if self.usage is None:
            return None
        u = self.usage
        return (u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens"))


def _whole(response: httpx.Response, chat: bool) -> Result:
    body = response.json()
    out = Result(response.status_code, body=body, request_id=response.headers.get("x-request-id"))
    if response.status_code != 200:
        return out
    choice = body["choices"][0]
    out.text = choice["message"]["content"] if chat else choice["text"]
    out.token_ids = choice.get("token_ids")
    out.finish_reason = choice.get("finish_reason")
    out.usage = body.get("usage")
    return out


def _streamed(response: httpx.Response, chat: bool) -> Result:
    out = Result(response.status_code, request_id=response.headers.get("x-request-id"))
    if response.status_code != 200:
        response.read()
        out.body = response.json()
        return out
    texts: list[str] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            out.events.append("[DONE]")
            break
        obj = json.loads(data)
        out.events.append(obj)
        if "error" in obj:
            raise AssertionError(f"error event in the stream: {obj}")
        if obj.get("usage") and not obj.get("choices"):
            out.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            if chat:
                texts.append((choice.get("delta") or {}).get("content") or "")
            else:
                texts.append(choice.get("text") or "")
            if isinstance(choice.get("token_ids"), list):
                out.token_ids = (out.token_ids or []) + choice["token_ids"]
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
    out.text = "".join(texts)
    return out


def generate(
    base_url: str,
    body: dict[str, Any],
    chat: bool,
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
) -> Result:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(base_url=base_url, timeout=timeout, trust_env=False) as client:
        if body.get("stream"):
            with client.stream("POST", path, json=body, headers=headers) as response:
                return _streamed(response, chat)
        return _whole(client.post(path, json=body, headers=headers), chat)


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10, trust_env=False).text


@dataclass(frozen=True)
class NixlCounters:
    transfers: float
    bytes: float
    failed: float

    def minus(self, before: NixlCounters) -> NixlCounters:
        return NixlCounters(
            self.transfers - before.transfers,
            self.bytes - before.bytes,
            self.failed - before.failed,
        )


def nixl_counters(url: str) -> NixlCounters:
    text = scrape(url)
    return NixlCounters(
        metric(text, NIXL_COUNT), metric(text, NIXL_BYTES), metric(text, NIXL_FAILED)
    )


def engine_load(url: str) -> tuple[float, float]:
    text = scrape(url)
    return metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting")


def info_labels(text: str, name: str) -> dict[str, str]:
    """The labels of an info-style gauge (vLLM exports its cache config that way)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return dict(sample.labels)
    return {}


@dataclass(frozen=True)
class KVGeometry:
    """Bytes of one KV block across all layers, from the model's config: K and V, per layer,
    per KV head, head_dim values, block_size tokens, dtype bytes each."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.block_size * self.dtype_bytes

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @classmethod
    def from_model(cls, model_dir: Path, block_size: int, dtype_bytes: int = 2) -> KVGeometry:
        config = json.loads((model_dir / "config.json").read_text())
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            block_size=block_size,
            dtype_bytes=dtype_bytes,
        )
