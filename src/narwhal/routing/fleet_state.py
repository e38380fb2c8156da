"""The router's live picture of its fleet: roles, health, in-flight legs and scraped load.

Pure data with small methods; the I/O edges (health prober, scraper, request handlers) write
into it and the scheduler reads it. Two load signals are kept apart on purpose: what the router
itself has in flight, and what the engine reports. A router that lets its own count overwrite
the engine's (or the reverse) routes on a number that lies.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from narwhal.clock import Clock
from narwhal.contract import FleetContract
from narwhal.routing.breaker import BreakerState, CircuitBreaker
from narwhal.routing.prefix import PrefixIndex

__all__ = ["EngineState", "FleetState", "Role", "ScrapedLoad"]

Role = Literal["prefill", "decode"]

# How far back a decode engine's local prefills are remembered (longer than any horizon the
# scheduler asks about: a request's output at the TPOT budget).
LOCAL_HISTORY_S = 600.0
# The time constant of a decode engine's join rate (DecodeJoins): several answers' lives, so
# that a burst's peak is read against the rate the engine sustains.
JOIN_RATE_S = 120.0


@dataclass
class ScrapedLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    at: float | None = None  # clock time of the last successful scrape


@dataclass
class DecodeJoins:
    """The rate at which requests join a decode engine's batch (picked with it as their decode
    engine), exponentially decayed with time constant ``JOIN_RATE_S``: what will join a
    batch while a request admitted now decodes in it."""

    weight: float = 0.0  # the decayed count, as of ``at``
    at: float = -math.inf
    since: float | None = None  # the first join

    def note(self, now: float) -> None:
        if self.since is None:
            self.since = now
            self.weight = 1.0
        else:
            self.weight = self.weight * math.exp((self.at - now) / JOIN_RATE_S) + 1.0
        self.at = now

    def rate(self, now: float) -> float:
        """Joins per second: the decayed count over the span it covers (the whole time
        constant once the engine has been joined that long)."""
        if self.since is None:
            return 0.0
        span = JOIN_RATE_S * -math.expm1(-max(now - self.since, 1.0) / JOIN_RATE_S)
        return self.weight * math.exp((self.at - now) / JOIN_RATE_S) / span


class PrefillWork(dict[str, tuple[float, float]]):
    """An engine's prefill legs in flight: request id -> (predicted seconds, dispatched at).

    A dict that keeps its total and its oldest leg's dispatch time until it next changes: the
    scheduler asks ``queued_prefill_s`` of every prefill candidate for every request, and legs
    come and go far less often than that. ``done`` removes a leg that ended and remembers when,
    from which the legs left have progressed."""

    __slots__ = ("_summary", "last_done")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._summary: tuple[float, float] | None = None
        self.last_done = -math.inf  # when a leg last ended here

    def done(self, key: str, now: float) -> None:
        """The leg ``key`` ended at ``now`` (a no-op for a leg not here)."""
        if key in self:
            self.pop(key)
            self.last_done = now

    def summary(self) -> tuple[float, float]:
        """(total predicted seconds, the oldest leg's dispatch time); not for an empty dict."""
        summary = self._summary
        if summary is None:
            total = 0.0
            since = math.inf
            for predicted, at in self.values():
                total += predicted
                if at < since:
                    since = at
            summary = self._summary = (total, since)
        return summary

    def ahead(self, now: float, scale: float = 1.0) -> float:
        """Predicted prefill seconds still ahead of a new prompt (see
        ``EngineState.queued_prefill_s``), the legs' seconds times ``scale`` (the engine's
        correction now, for legs kept as the raw model's seconds)."""
        if not self:
            return 0.0
        total, since = self.summary()
        last = self.last_done
        waited = now - (since if since > last else last)
        if waited < 0.0:
            waited = 0.0
        total *= scale
        # (min() and max() written out: the scheduler asks this of every candidate)
        return total - (total if total < waited else waited)

    # Every way to change a dict forgets the summary.
    def __setitem__(self, key: str, value: tuple[float, float]) -> None:
        self._summary = None
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._summary = None
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self._summary = None
        return super().pop(*args)

    def popitem(self) -> tuple[str, tuple[float, float]]:
        self._summary = None
        return super().popitem()

    def clear(self) -> None:
        self._summary = None
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._summary = None
        super().update(*args, **kwargs)

    def setdefault(self, *args: Any) -> Any:
        self._summary = None
        return super().setdefault(*args)

    def __ior__(self, other: Any) -> PrefillWork:  # type: ignore[override,misc]
        self._summary = None
        return super().__ior__(other)


@dataclass
class EngineState:
    id: str
    url: str
    roles: tuple[Role, ...]
    role: Role
    breaker: CircuitBreaker
    healthy: bool | None = None  # None until the first probe
    probe_timeouts: int = 0  # consecutive /health probes that timed out
    # A /health probe found nothing listening (or the connection reset) since the engine was
    # last seen up: when it answers again it is most likely a new process, its cache empty.
    unreachable: bool = False
    # When a leg here last succeeded (the state clock): a busy engine's late /health probe is
    # not a hung engine's.
    answered_at: float = -math.inf
    in_flight_prefill: int = 0
    in_flight_decode: int = 0
    # The integral of in_flight_decode over time (sequence-seconds) up to ``_decode_area_at``:
    # the batch a request shared is its change over the request's life divided by the life.
    _decode_area: float = 0.0
    _decode_area_at: float = 0.0
    # Requests admitted with this engine as their decode engine, still in their prefill leg:
    # they will join its batch, so predictions count them now.
    pending_decode: int = 0
    # When each sequence decoding here (first token sent) is predicted to end, ascending: a
    # request admitted now joins the batch only after its prefill leg, when the short answers
    # decoding now may be gone. Sequences without predictions (a scheduler that makes none)
    # are counted in the two counters above only.
    decode_ends: list[float] = field(default_factory=list)
    # Ends up to this time were dropped from decode_ends (prune_decode_ends): those sequences
    # are past their predicted end, still decoding, counted in the counters alone.
    decode_ends_pruned_to: float = -math.inf
    # The requests counted in pending_decode that were predicted: request id -> when it is
    # predicted to join the batch (its first token) and to leave it.
    pending_spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    joins: DecodeJoins = field(default_factory=DecodeJoins)
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)
    draining_from: Role | None = None
    role_since: float = 0.0
    # Prefill legs in flight here: request id -> (predicted seconds, dispatched at). A prefill
    # engine's legs in the raw model's seconds (the correction in force when each was sent
    # would go stale while it waits: the current one scales them); a decode engine's local
    # prefills in corrected seconds.
    prefill_work: PrefillWork = field(default_factory=PrefillWork)
    # Local prefills sent to this (decode) engine: (dispatched at, predicted seconds), oldest
    # first, the last LOCAL_HISTORY_S seconds: each one stalled its decode batch that long.
    local_prefills: deque[tuple[float, float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if type(self.prefill_work) is not PrefillWork:
            self.prefill_work = PrefillWork(self.prefill_work)

    def add_decode(self, now: float, delta: int) -> None:
        """A decode leg starts (+1) or ends (-1) here at ``now``."""
        self._decode_area = self.decode_area(now)
        self._decode_area_at = now
        self.in_flight_decode += delta

    def decode_area(self, now: float) -> float:
        """Sequence-seconds of decode legs in flight here, from the start to ``now``."""
        return self._decode_area + self.in_flight_decode * (now - self._decode_area_at)

    def foresee_decode_end(self, at: float) -> None:
        insort(self.decode_ends, at)

    def forget_decode_end(self, at: float) -> None:
        if at <= self.decode_ends_pruned_to:
            return  # pruned already
        ends = self.decode_ends
        i = bisect_right(ends, at) - 1
        if i >= 0 and ends[i] == at:
            del ends[i]

    def prune_decode_ends(self, now: float) -> None:
        """Drop the ends predicted at or before ``now``: the sequences still decode (past their
        predicted end they stay counted), so the scheduler need not search past them."""
        ends = self.decode_ends
        del ends[: bisect_right(ends, now)]
        self.decode_ends_pruned_to = now

    def decode_batch_at(self, now: float, at: float) -> int:
        """The router's own sequences here (pending or in flight) still predicted to decode at
        ``at``: all but those decoding now and predicted to end between ``now`` and ``at``.
        One past its predicted end still decodes (slower than predicted): it stays, as do
        those without a predicted end."""
        ends = self.decode_ends
        leaving = bisect_right(ends, at) - bisect_right(ends, now)
        return self.in_flight_decode + self.pending_decode - leaving

    def note_local_prefill(self, now: float, predicted_s: float) -> None:
        self.local_prefills.append((now, predicted_s))
        while self.local_prefills and self.local_prefills[0][0] < now - LOCAL_HISTORY_S:
            self.local_prefills.popleft()

    def recent_local_prefill_s(self, since: float) -> float:
        """Predicted seconds of local prefill dispatched here at or after ``since``."""
        total = 0.0
        for at, seconds in reversed(self.local_prefills):
            if at < since:
                break
            total += seconds
        return total

    def queued_prefill_s(self, now: float, scale: float = 1.0) -> float:
        """Predicted prefill work still ahead of a new prompt on this engine: the legs' total
        less the time the engine has worked on them, since the later of the last leg's end
        and the oldest leg's dispatch (at least nothing).

        The engine prefills first come, first served, packing the prompts in line into each
        step's token budget: a step works on several of them at once, so the time since the
        last end counts against the whole queue. Crediting only the oldest leg (at most its
        own predicted time) overcounted a packed queue by up to a step; crediting the whole
        queue since the oldest leg's dispatch wiped out queues whose oldest leg had itself
        waited behind legs since finished. ``scale``: the engine's prefill correction, for a
        prefill engine (whose legs are kept uncorrected).
        """
        return self.prefill_work.ahead(now, scale)

    def can(self, role: Role) -> bool:
        return role in self.roles

    def accepts(self, role: Role) -> bool:
        """May new legs of ``role`` go here? Its role, and, for an engine that just left the
        prefill role, only once its queued prefills have finished (drain)."""
        if role != self.role:
            return False
        return not (self.draining_from == "prefill" and self.in_flight_prefill > 0)

    def settle_drain(self) -> bool:
        """Clear the drain mark once the old role's legs are done; True if it was cleared."""
        if self.draining_from is None:
            return False
        left = self.in_flight_prefill if self.draining_from == "prefill" else self.in_flight_decode
        if left == 0:
            self.draining_from = None
            return True
        return False

    def available(self) -> bool:
        """Healthy (or not yet probed) and its breaker lets a request through."""
        return self.healthy is not False and self.breaker.allows_request()

    def takes(self, role: Role) -> bool:
        """``accepts(role) and available()``, in one call (the scheduler asks it of every
        engine it considers, for every request)."""
        if role != self.role or (self.draining_from == "prefill" and self.in_flight_prefill > 0):
            return False
        if self.healthy is False:
            return False
        breaker = self.breaker
        return breaker.state is BreakerState.CLOSED or breaker.allows_request()


class FleetState:
    def __init__(
        self,
        fleet: FleetContract,
        clock: Clock,
        *,
        breaker_failures: int = 3,
        breaker_open_s: float = 5.0,
        scrape_stale_s: float = 5.0,
    ) -> None:
        self.fleet = fleet
        self.clock = clock
        self.scrape_stale_s = scrape_stale_s
        self.role_generation = 0
        now = clock.now()
        self.engines: dict[str, EngineState] = {
            spec.id: EngineState(
                id=spec.id,
                url=spec.url,
                roles=tuple(spec.roles),
                role=spec.initial_role,
                breaker=CircuitBreaker(clock, breaker_failures, breaker_open_s),
                role_since=now,
            )
            for spec in fleet.engines
        }
        # Which engine holds which prompt prefix (routing.prefix); None when the engines cache
        # no prefixes or the fleet routes without them.
        self.prefix_index: PrefixIndex | None = None
        caching = fleet.engine.prefix_caching
        if caching.enabled and fleet.routing.prefix.enabled:
            # A request that has not stored its prompt within the TTFT budget missed or failed:
            # its in-flight entries (PrefixIndex) live no longer.
            self.prefix_index = PrefixIndex(
                caching.block_size,
                fleet.routing.prefix.history_ttl_s,
                in_flight_ttl_s=fleet.budgets.ttft_s,
            )
            for spec in fleet.engines:
                capacity = spec.sim.num_blocks if spec.sim is not None else caching.capacity_blocks
                self.prefix_index.add_engine(spec.id, capacity)
        # Kept per role so that schedulers sampling large fleets never scan all of it.
        self._by_role: dict[str, list[EngineState]] = {"prefill": [], "decode": []}
        for engine in self.engines.values():
            self._by_role[engine.role].append(engine)

    def cached_tokens(
        self,
        keys: tuple[int, ...],
        prompt_tokens: int,
        tokens_per_key: float | None = None,
        in_flight: bool = True,
    ) -> dict[str, int]:
        """Per engine holding the prompt's first block: its prompt tokens in the engine's prefix
        cache, as vLLM finds them: whole blocks within all but the last token, which an engine
        always computes (``max_cache_hit_length = num_tokens - 1``: a prompt of exactly 190
        blocks hits 189). ``tokens_per_key``: the tokens a key stands for when it is not a
        block of token ids (``RequestShape.tokens_per_key``), counted down to whole blocks.
        ``in_flight``: as ``PrefixIndex.match``."""
        index = self.prefix_index
        if index is None or not keys:
            return {}
        size = index.block_size
        cap = max(0, prompt_tokens - 1) // size * size
        matched = index.match(keys, self.clock.now(), in_flight)
        if tokens_per_key is None:
            return {e: min(blocks * size, cap) for e, blocks in matched.items()}
        return {
            e: min(int(blocks * tokens_per_key) // size * size, cap)
            for e, blocks in matched.items()
        }

    def kv_pulled(
        self, decode_id: str, prompt_tokens: int, held_tokens: int | None
    ) -> tuple[int, int | None] | None:
        """(blocks, bytes) a decode engine pulls for a ``prompt_tokens`` prompt, as vLLM's
        NixlConnector does: every block of the prompt, the partial last one whole, less the
        full blocks it finds in its own prefix cache (within all but the last token).
        ``held_tokens``: its cached prompt tokens as the index saw them; None when the engines
        cache prefixes and no index follows them (the blocks are then unknown: None). The
        bytes are None where the fleet does not say a block's size in bytes."""
        block_tokens, block_bytes = self.fleet.kv_block(decode_id)
        if not self.fleet.engine.prefix_caching.enabled:
            held_tokens = 0
        if held_tokens is None or prompt_tokens <= 0:
            return None
        held = min(held_tokens, prompt_tokens - 1) // block_tokens
        blocks = max(0, -(-prompt_tokens // block_tokens) - held)
        return blocks, None if block_bytes is None else blocks * block_bytes

    def in_role(self, role: Role) -> list[EngineState]:
        """Engines serving ``role`` now (a copy, in fleet order)."""
        return list(self._by_role[role])

    def is_permitted(self, prefill_id: str, decode_id: str) -> bool:
        return self.fleet.is_permitted(prefill_id, decode_id)

    def decode_batch(self, engine: EngineState) -> int:
        """Sequences decoding on ``engine``: the larger of our count and the engine's report."""
        own = engine.in_flight_decode
        if self.scraped_fresh(engine):
            own = max(own, int(engine.scraped.running))
        return own + engine.pending_decode

    def scraped_fresh(self, engine: EngineState) -> bool:
        at = engine.scraped.at
        return at is not None and self.clock.now() - at <= self.scrape_stale_s

    def ready(self) -> tuple[bool, str]:
        """P/D-aware readiness: a healthy prefill engine, a healthy decode engine, a pair."""
        pools: list[list[EngineState]] = []
        roles: tuple[Role, Role] = ("prefill", "decode")
        for role in roles:
            healthy = [e for e in self.in_role(role) if e.healthy]
            if not healthy:
                return False, f"no healthy engine in the {role} role"
            pool = [e for e in healthy if e.breaker.allows_request()]
            if not pool:
                # Answering its probes, but failed requests opened its breaker: it takes
                # requests again once the breaker's cool-off lets a probe request through.
                names = ", ".join(e.id for e in healthy)
                return (
                    False,
                    f"every healthy engine in the {role} role has its breaker open ({names})",
                )
            pools.append(pool)
        prefill, decode = pools
        for p in prefill:
            for d in decode:
                if self.is_permitted(p.id, d.id):
                    return True, f"{len(prefill)} prefill, {len(decode)} decode engines healthy"
        return False, "no permitted KV transfer pair between healthy prefill and decode engines"

    def set_role(self, engine_id: str, role: Role) -> None:
        engine = self.engines[engine_id]
        if role == engine.role:
            return
        if not engine.can(role):
            raise ValueError(f"engine {engine_id} is not permitted the {role} role")
        engine.draining_from = engine.role
        self._by_role[engine.role].remove(engine)
        order = list(self.engines)
        self._by_role[role].append(engine)
        self._by_role[role].sort(key=lambda e: order.index(e.id))
        engine.role = role
        engine.role_since = self.clock.now()
        self.role_generation += 1
