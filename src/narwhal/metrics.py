"""Every Prometheus metric the router exports, defined once.

Metrics live on a registry owned by the router instance (never the process-global one), and
every labelled series the router knows in advance (each outcome, each engine, each role, each
flip direction) is created at start-up with value 0: a series that first appears after its
first event breaks dashboards, alert rules and scrape-coverage checks.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "FLEET_BACKGROUND_TASKS",
    "HEALTH_PROBE_FAILURES",
    "OUTCOMES",
    "RouterMetrics",
    "kv_events_task",
]

# Every terminal outcome a request can have; journal and metrics use the same words.
OUTCOMES = (
    "ok",
    "client_error",
    "rejected",
    "unavailable",
    "prefill_failed",
    "decode_failed",
    "deadline_exceeded",
    "client_abort",
    "stream_error",
    "router_shutdown",
    "router_restart",
    "internal_error",
)
ROLES = ("prefill", "decode")
LEGS = ("prefill", "decode")
STRANDED_REASONS = (
    "decode_failed",
    "decode_refused",
    "deadline_exceeded",
    "client_abort",
    "hedge_lost",
)
# timeout: no answer within the probe's timeouts; unreachable: refused, reset or cut short;
# status: an answer other than 200.
HEALTH_PROBE_FAILURES = ("timeout", "unreachable", "status")
REJECT_REASONS = ("over_budget", "queue_full", "queue_timeout", "journal_unavailable", "draining")

_LATENCY = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    7.5,
    8.5,
    10.0,
    12.5,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
_TPOT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.15,
    0.2,
    0.225,
    0.25,
    0.275,
    0.3,
    0.35,
    0.4,
    0.5,
    0.75,
    1.0,
    2.0,
)
_JOURNAL = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


# What broke a stream that was migrated (serve.relay.EventRenderer.interrupt), and how a
# hedged leg ended (serve.pd.PDRouter._race).
MIGRATION_REASONS = ("connection", "engine_error", "malformed", "stall")
HEDGE_OUTCOMES = ("hedge", "original", "failed", "refused")
# The router's background loops (narwhal.serve.supervisor), besides one KV event subscription
# per engine that publishes them (``kv_events_task``).
FLEET_BACKGROUND_TASKS = (
    "health_probes",
    "engine_scrapes",
    "role_controller",
    "etcd_coordination",
    "generation_watch",
)


def kv_events_task(engine: str) -> str:
    return f"kv_events/{engine}"


class RouterMetrics:
    def __init__(
        self, engines: Iterable[str], fleet_name: str, fleet_sha256: str, profile_sha256: str | None
    ) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        engines = list(engines)
        self.requests = Counter(
            "narwhal_requests", "Requests by terminal outcome.", ["outcome"], registry=r
        )
        self.ttft = Histogram(
            "narwhal_ttft_seconds",
            "Time to first token seen by the client.",
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "narwhal_tpot_seconds",
            "Time per output token after the first (per request mean).",
            buckets=_TPOT,
            registry=r,
        )
        self.e2e = Histogram(
            "narwhal_e2e_seconds",
            "Arrival to last byte, completed requests.",
            buckets=_LATENCY,
            registry=r,
        )
        self.prefill = Histogram(
            "narwhal_prefill_seconds",
            "Prefill leg duration.",
            ["engine"],
            buckets=_LATENCY,
            registry=r,
        )
        self.handoff = Histogram(
            "narwhal_kv_handoff_seconds",
            "Decode leg start to its first token: KV pull plus first step (the deadline's span).",
            ["engine"],
            buckets=_LATENCY,
            registry=r,
        )
        self.in_flight = Gauge(
            "narwhal_in_flight",
            "Legs in flight by engine and role.",
            ["engine", "role"],
            registry=r,
        )
        self.engine_role = Gauge(
            "narwhal_engine_role",
            "1 for the role each engine serves now.",
            ["engine", "role"],
            registry=r,
        )
        self.flips = Counter(
            "narwhal_flips", "Role flips by direction.", ["from_role", "to_role"], registry=r
        )
        self.deadline_exceeded = Counter(
            "narwhal_first_token_deadline_exceeded",
            "Decode legs aborted because their first token missed first_token_timeout_s.",
            ["engine"],
            registry=r,
        )
        self.first_token_waits = Counter(
            "narwhal_first_token_waits",
            "Decode legs (after a KV handoff or prefilling locally) whose wait for the first token"
            " ended: in time or past first_token_timeout_s.",
            ["engine"],
            registry=r,
        )
        self.stranded = Counter(
            "narwhal_stranded_handoffs",
            "Prefills whose KV was handed out but whose decode leg produced no token.",
            ["engine", "reason"],
            registry=r,
        )
        self.kv_released = Counter(
            "narwhal_kv_released",
            "KV handed out for a decode leg its decode engine refused, or that never reached"
            " it, pulled by a release leg so that the prefill engine frees it.",
            ["engine"],
            registry=r,
        )
        self.local_prefills = Counter(
            "narwhal_local_prefills",
            "Requests sent whole to a decode engine to prefill themselves (local prefill).",
            ["engine"],
            registry=r,
        )
        self.prefix_prompt_tokens = Counter(
            "narwhal_prefix_prompt_tokens",
            "Prompt tokens of finished requests, by the engine that prefilled them (the "
            "denominator of its prefix hit rate).",
            ["engine"],
            registry=r,
        )
        self.prefix_cached_tokens = Counter(
            "narwhal_prefix_cached_tokens",
            "Prompt tokens found in the prefilling engine's prefix cache: as the router "
            "predicted at its pick, and as the engine reported (usage.prompt_tokens_details).",
            ["engine", "source"],
            registry=r,
        )
        self.kv_bytes_moved = Counter(
            "narwhal_kv_bytes_moved",
            "KV bytes decode engines pulled for the router's handoffs that reached a first "
            "token, by decode engine: the blocks the prompts needed, less those the engine "
            "held as the prefix index saw them, times the fleet's block bytes (set only where "
            "the fleet says a block's bytes; 0 where it does not).",
            ["engine"],
            registry=r,
        )
        self.kv_event_batches = Counter(
            "narwhal_kv_event_batches",
            "KV event batches applied to the prefix index, per publishing engine.",
            ["engine"],
            registry=r,
        )
        self.kv_event_resets = Counter(
            "narwhal_kv_event_resets",
            "Times an engine's prefix index entries were dropped: events lost beyond replay, "
            "an unreadable batch, or an engine restart.",
            ["engine"],
            registry=r,
        )
        self.kv_event_unreadable = Counter(
            "narwhal_kv_event_unreadable_batches",
            "KV event messages from an engine that could not be read or applied to the prefix "
            "index (a batch that could not be read or applied also resets the engine's "
            "entries).",
            ["engine"],
            registry=r,
        )
        self.background_task_restarts = Counter(
            "narwhal_background_task_restarts",
            "Background loops started again after a fault (health_probes, engine_scrapes, "
            "role_controller, etcd_coordination, generation_watch, kv_events/<engine>).",
            ["task"],
            registry=r,
        )
        self.profile_stale = Gauge(
            "narwhal_engine_profile_stale",
            "1 while the engine runs another generation than the one its profile was measured "
            "at (restarted since profiling: re-profile it).",
            ["engine"],
            registry=r,
        )
        self.prefix_index_blocks = Gauge(
            "narwhal_prefix_index_blocks",
            "KV blocks the router's prefix index holds for each engine.",
            ["engine"],
            registry=r,
        )
        self.kv_events_configured = Gauge(
            "narwhal_kv_events_configured",
            "1 when the fleet names the engine's KV event stream (kv_events) and the router "
            "follows it (prefix routing on).",
            ["engine"],
            registry=r,
        )
        self.kv_events_followed = Gauge(
            "narwhal_kv_events_followed",
            "1 while the prefix index's entries for the engine come from its KV events, 0 while "
            "they come from routing history (no event stream, none read yet, or reset).",
            ["engine"],
            registry=r,
        )
        self.retries = Counter(
            "narwhal_retries", "Legs retried on another engine.", ["leg"], registry=r
        )
        self.migrations = Counter(
            "narwhal_migrations",
            "Requests continued on another pair after their decode leg broke mid-answer, by the "
            "engine whose leg broke and what broke it (engine_error, connection, malformed, "
            "stall).",
            ["engine", "reason"],
            registry=r,
        )
        self.hedges = Counter(
            "narwhal_hedges",
            "Legs hedged on another engine after running past their predicted time, by which "
            "leg answered first (hedge, original) or failed.",
            ["leg", "outcome"],
            registry=r,
        )
        self.leg_failures = Counter(
            "narwhal_leg_failures", "Failed engine legs.", ["engine", "leg"], registry=r
        )
        self.engine_healthy = Gauge(
            "narwhal_engine_healthy", "1 if the last health probe passed.", ["engine"], registry=r
        )
        self.health_probe_failures = Counter(
            "narwhal_health_probe_failures",
            "Failed /health probes of an engine, by reason.",
            ["engine", "reason"],
            registry=r,
        )
        self.slow_client_pauses = Counter(
            "narwhal_slow_client_pauses",
            "Times a decode stream's engine connection was paused because its client read "
            "slower than the engine wrote (push relay).",
            ["engine"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "narwhal_engine_breaker_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open.",
            ["engine"],
            registry=r,
        )
        self.engine_load = Gauge(
            "narwhal_engine_scraped",
            "Load scraped from engine /metrics.",
            ["engine", "signal"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "narwhal_engine_scrape_errors", "Failed /metrics scrapes.", ["engine"], registry=r
        )
        self.admission_rejections = Counter(
            "narwhal_admission_rejections", "Requests refused at admission.", ["reason"], registry=r
        )
        self.journal_write = Histogram(
            "narwhal_journal_write_seconds",
            "Time to write and flush one journal record.",
            buckets=_JOURNAL,
            registry=r,
        )
        self.journal_backlog = Gauge(
            "narwhal_journal_backlog", "Journal records queued.", registry=r
        )
        self.journal_errors = Counter(
            "narwhal_journal_write_errors", "Failed journal writes.", registry=r
        )
        self.journal_dropped = Counter(
            "narwhal_journal_dropped",
            "Journal records dropped (best_effort policy only).",
            registry=r,
        )
        self.admission_queue = Gauge(
            "narwhal_admission_queue", "Requests waiting in the admission queue.", registry=r
        )
        self.latency_ratio = Gauge(
            "narwhal_latency_ratio",
            "Observed / predicted latency per engine and phase (EWMA; 1 = the profile holds).",
            ["engine", "phase"],
            registry=r,
        )
        self.profile_drift = Gauge(
            "narwhal_profile_drift",
            "1 when an engine's observed/predicted ratio left the drift band.",
            ["engine", "phase"],
            registry=r,
        )
        self.budget = Gauge(
            "narwhal_fleet_budget",
            "The fleet's budgets, for dashboards and alerts to compare against.",
            ["budget"],
            registry=r,
        )
        self.slo = Counter(
            "narwhal_slo_requests",
            "Finished requests by whether they met both TTFT and TPOT budgets "
            "(rejected and failed requests count as missed; client errors and aborts not at all).",
            ["result"],
            registry=r,
        )
        self.role_generation = Gauge(
            "narwhal_role_generation",
            "Generation of the role map (increments on every flip).",
            registry=r,
        )
        self.coordination_up = Gauge(
            "narwhal_coordination_up",
            "1 while this replica reaches etcd (roles shared with the other replicas), 0 while "
            "it serves with the roles last seen; 1 on a router that runs alone.",
            registry=r,
        )
        self.role_leader = Gauge(
            "narwhal_role_leader",
            "1 on the replica that runs the role controller (holds the etcd leader lease); 1 on "
            "a router that runs alone.",
            registry=r,
        )
        self.coordination_watch_lag = Gauge(
            "narwhal_coordination_watch_lag_seconds",
            "From a roles change written (by any replica's clock) to this replica applying it, "
            "for the last change.",
            registry=r,
        )
        self.coordination_replicas = Gauge(
            "narwhal_coordination_replicas",
            "Replicas this one sees publishing demand in etcd, itself included.",
            registry=r,
        )
        self.fleet_info = Gauge(
            "narwhal_fleet_info",
            "The fleet and profile store being served.",
            ["fleet", "fleet_sha256", "profile_sha256"],
            registry=r,
        )
        self.fleet_info.labels(fleet_name, fleet_sha256, profile_sha256 or "none").set(1)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for result in ("met", "missed"):
            self.slo.labels(result)
        for budget in ("ttft_seconds", "tpot_seconds", "attainment", "first_token_timeout_seconds"):
            self.budget.labels(budget)
        for reason in REJECT_REASONS:
            self.admission_rejections.labels(reason)
        for a in ROLES:
            for b in ROLES:
                if a != b:
                    self.flips.labels(a, b)
        for leg in LEGS:
            self.retries.labels(leg)
        for outcome in HEDGE_OUTCOMES:
            self.hedges.labels("prefill", outcome)
        for task in FLEET_BACKGROUND_TASKS:
            self.background_task_restarts.labels(task)
        for engine in engines:
            self.background_task_restarts.labels(kv_events_task(engine))
            for reason in MIGRATION_REASONS:
                self.migrations.labels(engine, reason)
            self.prefill.labels(engine)
            self.handoff.labels(engine)
            self.deadline_exceeded.labels(engine)
            self.profile_stale.labels(engine)
            self.first_token_waits.labels(engine)
            self.local_prefills.labels(engine)
            self.kv_bytes_moved.labels(engine)
            self.prefix_prompt_tokens.labels(engine)
            for source in ("predicted", "reported"):
                self.prefix_cached_tokens.labels(engine, source)
            self.kv_event_batches.labels(engine)
            self.kv_event_resets.labels(engine)
            self.kv_event_unreadable.labels(engine)
            self.prefix_index_blocks.labels(engine)
            self.kv_events_configured.labels(engine)
            self.kv_events_followed.labels(engine)
            self.engine_healthy.labels(engine)
            for reason in HEALTH_PROBE_FAILURES:
                self.health_probe_failures.labels(engine, reason)
            self.breaker_state.labels(engine)
            self.slow_client_pauses.labels(engine)
            self.scrape_errors.labels(engine)
            for role in ROLES:
                self.in_flight.labels(engine, role)
                self.engine_role.labels(engine, role)
            for leg in LEGS:
                self.leg_failures.labels(engine, leg)
            for reason in STRANDED_REASONS:
                self.stranded.labels(engine, reason)
            self.kv_released.labels(engine)
            for phase in ("prefill", "decode"):
                self.latency_ratio.labels(engine, phase).set(1)
                self.profile_drift.labels(engine, phase)
            for signal in ("running", "waiting", "kv_cache_usage"):
                self.engine_load.labels(engine, signal)
