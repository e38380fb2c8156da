"""The simulated engine's Prometheus metrics, under vLLM's own names and label sets, on a
registry of the engine's own (never the global one)."""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["EngineMetrics"]

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 34, 2))
_M = TypeVar("_M", bound=MetricWrapperBase)


class EngineMetrics:
    def __init__(self, model_name: str, engine: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        self._values = {"model_name": model_name, "engine": engine}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed."
        )
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LATENCY_BUCKETS,
        )
        self.nixl_xfer_time = histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            _LATENCY_BUCKETS,
        )
        self.nixl_bytes = histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            _BYTES_BUCKETS,
        )
        self.nixl_descriptors = histogram(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL KV Cache transfers.",
            tuple(float(2**k) for k in range(0, 16)),
        )
        self.nixl_failed_transfers = counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers."
        )
        self.nixl_kv_expired = counter(
            "vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire."
        )
        self.kv_verify_failures = counter(
            "narwhal_sim:kv_verify_failures",
            "Pulled KV blocks whose bytes did not match the prompt (never decoded).",
        )
        # What the host adds to the engine's modelled steps (the work between sleeps, a
        # late wake-up on a busy host): wall seconds of working steps against the seconds the
        # model planned for them (both counters; their ratio is the step inflation).
        self.step_seconds = counter(
            "narwhal_sim:step_seconds", "Wall seconds of working engine steps, measured."
        )
        self.step_planned_seconds = counter(
            "narwhal_sim:step_planned_seconds",
            "Wall seconds the latency model planned for the same steps.",
        )
        self.kv_holds = gauge(
            "narwhal_sim:kv_holds", "Prefilled requests whose KV blocks wait to be pulled."
        )
        self.local_prefill_fallbacks = counter(
            "narwhal_sim:local_prefill_fallbacks",
            "Decode legs with unusable kv_transfer_params, so the prompt was prefilled locally.",
        )
        # Create every labelled child now: a series must exist before its first event.
        for metric in (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage_perc,
            self.prompt_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.nixl_xfer_time,
            self.nixl_bytes,
            self.nixl_descriptors,
            self.nixl_failed_transfers,
            self.nixl_kv_expired,
            self.kv_verify_failures,
            self.kv_holds,
            self.local_prefill_fallbacks,
            self.step_seconds,
            self.step_planned_seconds,
        ):
            metric.labels(**self._values)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(**self._values, finished_reason=reason)

    def cache_config(self, block_size: int, num_gpu_blocks: int, prefix_caching: bool) -> None:
        """``vllm:cache_config_info``: vLLM's info gauge (1) whose labels are its CacheConfig's
        fields as strings and the engine index; the fields a reader needs are simulated (how a
        benchmark proves prefix caching was off: ``enable_prefix_caching="False"``)."""
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "engine"],
            registry=self.registry,
        )
        info.labels(
            block_size=str(block_size),
            cache_dtype="auto",
            enable_prefix_caching=str(prefix_caching),
            num_gpu_blocks=str(num_gpu_blocks),
            engine=self._values["engine"],
        ).set(1)

    def get(self, metric: _M) -> _M:
        return metric.labels(**self._values)

    def finished(self, reason: str) -> Counter:
        return self.request_success.labels(**self._values, finished_reason=reason)
