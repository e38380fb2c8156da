"""Schedulers: filter -> score -> pick over (prefill, decode) pairs.

Filters drop engines and pairs that cannot serve (role, health and breaker, permission, KV room,
engines the request already failed on). Scorers rank what is left; the picker takes the best.

``SchedulerV0`` scores by outstanding work: the larger of the router's own in-flight count and
what the engine last reported, so neither signal can hide the other, with ties taken in
rotation. ``SchedulerV1`` scores by predicted TTFT and TPOT from the profiled latency models and
leaves admission (what to do when no pair meets the budgets) to its caller.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol

from narwhal.contract import Budgets
from narwhal.profiles.models import DecodeLatencyModel
from narwhal.routing.breaker import BreakerState
from narwhal.routing.fleet_state import EngineState, FleetState, Role
from narwhal.routing.predictor import LatencyPredictor

__all__ = ["NoPair", "Pair", "RequestShape", "Scheduler", "SchedulerV0", "SchedulerV1"]

KV_FULL = 0.98


@dataclass(frozen=True)
class RequestShape:
    """What the scheduler knows of a request."""

    prompt_tokens: int = 1
    max_tokens: int = 16
    elapsed_s: float = 0.0  # already spent (queueing, earlier attempts) against the TTFT budget
    # False when the request needs what only a prefill leg gives (the prompt's token ids).
    local_ok: bool = True
    # The prompt's full KV blocks as chain keys (``narwhal.routing.prefix``: block i's key stands
    # for blocks 0..i, equal keys equal prefixes), what prefix-aware policies match, at the
    # fleet's ``engine.prefix_caching.block_size``. Empty when unknown.
    prefix: tuple[int, ...] = ()
    # The tokens it is expected to generate (``narwhal.routing.output_length``); None: all of
    # ``max_tokens``.
    expected_tokens: int | None = None
    # Prompt tokens one key of ``prefix`` stands for: None for token-id keys (a block of
    # ``block_size`` tokens); for a text prompt's keys (blocks of bytes) the estimate from the
    # router's bytes per token, as ``prompt_tokens`` is estimated.
    tokens_per_key: float | None = None


@dataclass(frozen=True)
class Pair:
    prefill: str
    decode: str
    score: float
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    predicted_prefill_s: float | None = None
    # The decode engine prefills the prompt itself (routing.local_prefill): no prefill leg,
    # no handoff; ``prefill`` and ``decode`` name the same engine.
    local: bool = False
    # Prompt tokens predicted to be in the prefill (or local) engine's prefix cache, and in
    # the decode engine's (blocks it will not pull).
    cached_tokens: int = 0
    decode_cached_tokens: int = 0
    # The scheduler matched the prompt's prefix against the fleet's prefix index (v1 does):
    # the two counts above are what it found, zeros included. False: it never looked (v0, the
    # baselines), and the lifecycle looks for it.
    prefix_looked: bool = False


@dataclass(frozen=True)
class NoPair:
    reason: str
    # Set when pairs exist but none is predicted to meet the budgets: admission's business.
    over_budget: Pair | None = None


class Scheduler(Protocol):
    def pick(
        self,
        state: FleetState,
        shape: RequestShape | None = None,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Pair | NoPair:
        """The pair to serve a request of ``shape`` now, avoiding the excluded engines; or
        why there is none (with the best over-budget pair when only the budgets stand in the
        way)."""
        ...


PairFilter = Callable[[FleetState, EngineState, EngineState], bool]


def _available(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return p.available() and d.available()


def _roles(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return p.accepts("prefill") and d.accepts("decode") and p.id != d.id


def _permitted(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return state.is_permitted(p.id, d.id)


def _has_room(state: FleetState, engine: EngineState) -> bool:
    return not (state.scraped_fresh(engine) and engine.scraped.kv_cache_usage >= KV_FULL)


def _kv_room(state: FleetState, p: EngineState, d: EngineState) -> bool:
    return _has_room(state, p) and _has_room(state, d)


FILTERS: tuple[tuple[str, PairFilter], ...] = (
    ("role", _roles),
    ("permitted pair", _permitted),
    # Health and the breaker both: an engine that answers /health but whose breaker is open
    # is out too (the message said "healthy" of engines the breakers had excluded).
    ("available (healthy, breaker not open)", _available),
    ("KV room", _kv_room),
)


def prefill_load(state: FleetState, engine: EngineState) -> float:
    return _load(engine, engine.in_flight_prefill, state.clock.now(), state.scrape_stale_s)


def decode_load(state: FleetState, engine: EngineState) -> float:
    return _load(engine, engine.in_flight_decode, state.clock.now(), state.scrape_stale_s)


def _load(engine: EngineState, own: int, now: float, stale_s: float) -> float:
    """The larger of the router's own count of legs on ``engine`` and what the engine last
    reported (when that report is at most ``stale_s`` old)."""
    scraped = engine.scraped
    at = scraped.at
    if at is not None and now - at <= stale_s:
        return max(own, scraped.running + scraped.waiting)
    return own


def sample(rng: random.Random, population: list[EngineState], k: int) -> list[EngineState]:
    """``rng.sample(population, k)`` for ``0 <= k <= len(population)``: the same draws from
    ``rng`` in the same order, so the same engines, without two Python calls per draw (it
    runs twice per request). CPython's ``Random.sample`` with ``_randbelow_with_getrandbits``
    (what ``random.Random`` itself uses), written out; any other generator gets its own
    ``sample``. tests/unit/test_routing.py holds the two to each other."""
    if type(rng) is not random.Random:
        return rng.sample(population, k)
    getrandbits = rng.getrandbits
    n = len(population)
    result: list[EngineState] = []
    setsize = 21  # as Random.sample: a list of n beats a set of k below this
    if k > 5:
        setsize += 4 ** math.ceil(math.log(k * 3, 4))
    if n <= setsize:
        pool = list(population)
        for i in range(k):
            m = n - i
            bits = m.bit_length()
            j = getrandbits(bits)
            while j >= m:
                j = getrandbits(bits)
            result.append(pool[j])
            pool[j] = pool[m - 1]
        return result
    bits = n.bit_length()
    selected: set[int] = set()
    for _ in range(k):
        # randbelow(n) until it is not yet selected: draws until one is < n and new
        j = getrandbits(bits)
        while j >= n or j in selected:
            j = getrandbits(bits)
        selected.add(j)
        result.append(population[j])
    return result


class SchedulerV0:
    """Least outstanding work."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(
        self,
        state: FleetState,
        shape: RequestShape | None = None,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Pair | NoPair:
        prefills = [e for e in state.engines.values() if e.id not in exclude_prefill]
        decodes = [e for e in state.engines.values() if e.id not in exclude_decode]
        candidates = [(p, d) for p in prefills for d in decodes]
        for name, keep in FILTERS:
            remaining = [(p, d) for p, d in candidates if keep(state, p, d)]
            if not remaining:
                return NoPair(f"no (prefill, decode) pair passes the {name} filter")
            candidates = remaining
        scored = [
            (prefill_load(state, p) + decode_load(state, d), p.id, d.id) for p, d in candidates
        ]
        best = min(s for s, _, _ in scored)
        ties = sorted((p, d) for s, p, d in scored if s == best)
        self._turn += 1
        p_id, d_id = ties[self._turn % len(ties)]
        return Pair(p_id, d_id, best)


class SchedulerV1:
    """Profile-based: predicted TTFT and TPOT per pair, the most slack against both budgets.

    Predicted TTFT = the prefill engine's queued work and prefill(n) through its learnt line
    (``RatioEwma.line``) + KV transfer to the decode engine + its first step at batch + 1;
    predicted TPOT = the decode model at batch + 1 and the request's mean context, where batch
    is the one the request joins: the decode engine's sequences (and those on their way to
    it) less the ones decoding now that are predicted to end before its first token
    (``EngineState.decode_ends``). Slack is the smaller of the two budgets'
    remaining fractions; ties go to the less loaded pair. TTFT depends on the prefill engine only
    through its predicted time, so for each decode engine the best permitted prefill engine is
    the first one in order of predicted time: O(P log P + D), not O(P x D), for open fleets.

    Local prefill (``routing.local_prefill`` in the fleet, off by default): for a prompt of at
    most ``max_prompt_tokens`` each decode engine is also a candidate that prefills the prompt
    itself. Its TTFT = its own queued local prefills + its prefill model at n + when its batch
    is not empty, half a decode step (the step in progress) and the decode step the prefill
    shares; all but the queue scaled by the engine's learnt ratio of observed to predicted
    local first-token times. A prefill stalls every sequence of that engine's batch for its
    duration, so its TPOT is the decode model at batch + 1 plus the stalls a sequence there
    sees over the request's output: the local prefills sent to that engine in the last (output
    tokens x TPOT) seconds, and this one when the batch is not empty, spread over the output
    tokens. The recent stalls count against a handoff to that engine too: its sequence decodes
    there all the same. A local candidate wins only when it is predicted faster than every
    handoff pair, meets both budgets, comes within the first-token deadline (which bounds its
    whole leg), and leaves at least the slack of the best handoff pair: it spends its batch's
    TPOT headroom, so it is taken where TTFT binds (behind long prefill queues) or where it
    stalls nobody (an idle engine).
    """

    def __init__(
        self,
        predictor: LatencyPredictor,
        budgets: Budgets,
        candidates: int | None = None,
        rng: random.Random | None = None,
        margin: float = 0.05,
        prefix_window: float = 0.5,
        prefix_limit: float = 0.75,
    ) -> None:
        """``candidates``: in a pool larger than this, score a random sample of this many
        engines per role instead of all of them (power of k choices: near-optimal balance at
        O(k) per request, for fleets of hundreds or thousands of engines). ``margin``: slack
        (a fraction of the budgets) within which candidates count as equally good and the
        less loaded one is taken. ``prefix_window``: a prefill engine holding more of the
        prompt's prefix than the soonest ready one is taken if it is ready within this
        fraction of the TTFT budget of it, and within ``prefix_limit`` of the request's TTFT
        budget left: the sooner engine's gain is only this request's TTFT, which the budget
        allows, where the cached one saves the compute the cold one would spend again, and
        keeps the prefix's next requests (a conversation's next turns) where it is cached
        instead of spreading copies that crowd each other out of the caches."""
        self.predictor = predictor
        self.budgets = budgets
        self.candidates = candidates
        self.rng = rng or random.Random(0)
        self.margin = margin
        self.prefix_window = prefix_window
        self.prefix_limit = prefix_limit

    def _pool(
        self, state: FleetState, role: Role, holders: Collection[str] = ()
    ) -> list[EngineState]:
        """``role``'s pool, or in a pool larger than ``candidates`` a random sample of it and
        the engines of the role among ``holders`` (those holding some of the prompt's prefix:
        a sample that left them out would score the prompt as cached nowhere)."""
        pool = state._by_role[role]
        if self.candidates is not None and len(pool) > self.candidates:
            picked = sample(self.rng, pool, self.candidates)
            if holders:
                have = {e.id for e in picked}
                for engine_id in holders:
                    e = state.engines.get(engine_id)
                    if e is not None and e.role == role and engine_id not in have:
                        picked.append(e)
            return picked
        return pool

    def _eligible(
        self,
        state: FleetState,
        role: Role,
        exclude: Collection[str],
        now: float,
        stale: float,
        holders: Collection[str] = (),
    ) -> list[EngineState]:
        """The engines of ``role``'s pool (or its sample) that may take a leg now: not
        excluded, with KV room (when the engine's report is fresh), accepting ``role``,
        healthy and let through by their breaker."""
        out: list[EngineState] = []
        closed = BreakerState.CLOSED  # read once: an enum member is a slow global lookup
        for e in self._pool(state, role, holders):
            scraped = e.scraped
            at = scraped.at
            if at is not None and now - at <= stale and scraped.kv_cache_usage >= KV_FULL:
                continue
            if e.id in exclude:
                continue
            # What takes(role) answers, without the call, for the usual engine: in the role,
            # not draining, healthy (or not yet probed), its breaker closed.
            if (
                e.role == role
                and e.draining_from is None
                and e.healthy is not False
                and e.breaker.state is closed
            ) or e.takes(role):
                out.append(e)
        return out

    def pick(
        self,
        state: FleetState,
        shape: RequestShape | None = None,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Pair | NoPair:
        # One pass over the engines and no per-engine objects: this runs for every request,
        # and in the virtual-time simulator for a million of them over a thousand engines.
        shape = shape or RequestShape()
        now = state.clock.now()
        stale = state.scrape_stale_s
        n = shape.prompt_tokens
        # Prompt tokens each engine holds in its prefix cache (only those holding some).
        hits = state.cached_tokens(shape.prefix, n, shape.tokens_per_key) if shape.prefix else None
        holders = hits.keys() if hits else ()
        prefills = self._eligible(state, "prefill", exclude_prefill, now, stale, holders)
        decodes = self._eligible(state, "decode", exclude_decode, now, stale, holders)
        local_cfg = state.fleet.routing.local_prefill
        local_on = local_cfg.enabled and shape.local_ok and n <= local_cfg.max_prompt_tokens
        if not prefills and not (local_on and decodes):
            return NoPair("no available engine in the prefill role")
        if not decodes:
            return NoPair("no available engine in the decode role")
        predictor = self.predictor
        models = predictor.models
        # As predictor.ratio(): 1 for an engine with no samples, else RatioEwma.value (its
        # observed / predicted), read inline here.
        ratios = predictor.ratios
        # (when its queue and this prompt's prefill would be done, engine id, predicted prefill
        # seconds, load), soonest first: ids are unique, so the load never takes part in the
        # order. The load is read once here rather than per decode engine below.
        ready: list[tuple[float, str, float, float]] = []
        prefill_model = None
        raw = 0.0
        raw_cached: dict[tuple[int, int], float] = {}
        for p in prefills:
            p_id = p.id
            model = models[p_id].prefill
            hit = hits.get(p_id, 0) if hits else 0
            if hit:
                key = (id(model), hit)
                got = raw_cached.get(key)
                if got is None:
                    got = raw_cached[key] = model.predict_cached(n, hit).seconds
                raw = got
                prefill_model = None
            elif model is not prefill_model:  # engines mostly share one: predicted once
                prefill_model = model
                raw = model.predict(n).seconds
            ewma = ratios.get((p_id, "prefill"))
            # The leg's wait and prefill, as the learnt line through its observed durations.
            offset, correction = ewma.line if ewma is not None else (0.0, 1.0)
            predicted = raw * correction
            work = p.prefill_work  # p.queued_prefill_s(now, correction), one call fewer
            predicted_ready = offset + (work.ahead(now, correction) if work else 0.0) + predicted
            # _load(p, own, now, stale), inline: this loop runs for every request
            load: float = p.in_flight_prefill
            scraped = p.scraped
            at = scraped.at
            if at is not None and now - at <= stale:
                reported = scraped.running + scraped.waiting
                if reported > load:
                    load = reported
            ready.append((predicted_ready, p_id, predicted, load))
        ready.sort()
        open_pairs = state.fleet.kv_transfer_pairs == "all"
        context = n + shape.max_tokens / 2
        tokens = shape.expected_tokens or shape.max_tokens
        ttft_budget = self.budgets.ttft_s - shape.elapsed_s
        ttft_scale = self.budgets.ttft_s
        tpot_budget = self.budgets.tpot_s
        transfers = predictor.transfer  # as predictor.transfer_s()
        default_transfer_s = predictor.default_transfer_s
        raw_decode: dict[int, dict[int, float]] = {}  # decode model -> batch -> seconds/token
        decode_model: DecodeLatencyModel | None = None
        raw_by_batch: dict[int, float] = {}
        # Within ``margin`` of the best, predictions cannot tell candidates apart (corrections
        # are noisy, engines alike): the less loaded one wins, so work spreads instead of
        # herding onto whichever engine's ratio happens to read lowest.
        margin = self.margin
        ttft_window = margin * self.budgets.ttft_s
        prefix_window = self.prefix_window * self.budgets.ttft_s
        prefix_limit = self.prefix_limit * ttft_budget

        def best_prefill(decode_id: str | None) -> tuple[float, str, float, float] | None:
            """The prefill engine for ``decode_id`` (None: any decode engine, when every
            pair is permitted and none is the same engine): the soonest ready, or within
            ``ttft_window`` of it, the one holding more of the prompt's prefix (a fact, not a
            noisy prediction: it saves its compute, and keeps the prefix's next requests where
            it is), then the less loaded."""
            choice = None
            until = until_cached = 0.0
            held = 0
            for item in ready:
                if decode_id is not None and (
                    item[1] == decode_id
                    or not (open_pairs or state.is_permitted(item[1], decode_id))
                ):
                    continue
                if choice is None:
                    choice = item
                    held = hits.get(item[1], 0) if hits else 0
                    # The window is the soonest's: measured from the choice as it moved, it
                    # crept from one engine to the next, each within the window of the one
                    # before, as far as seconds behind the soonest in a burst.
                    until = item[0] + ttft_window
                    until_cached = max(until, min(item[0] + prefix_window, prefix_limit))
                elif item[0] > (until_cached if hits else until):
                    break
                elif hits:
                    other = hits.get(item[1], 0)
                    if item[0] > until:
                        # Past the load window, only for more of the prefix (see __init__).
                        if other > held:
                            choice, held = item, other
                    elif other > held or (other == held and item[3] < choice[3]):
                        choice, held = item, other
                elif item[3] < choice[3]:
                    choice = item
            return choice

        # With every pair permitted, the choice is the same for every decode engine (none is
        # also a prefill candidate: an engine is in one role's pool): found once.
        shared = best_prefill(None) if open_pairs else None
        candidates: list[
            tuple[float, float, EngineState, tuple[float, str, float, float], float, float]
        ] = []
        local: list[tuple[float, float, EngineState, float, float, float]] = []
        top = -math.inf  # the best slack
        local_enabled = local_cfg.enabled
        for d in decodes:
            d_id = d.id
            scraped = d.scraped
            at = scraped.at
            fresh = at is not None and now - at <= stale
            own = d.in_flight_decode
            choice = shared if open_pairs else best_prefill(d_id)
            handoff = transfers.get(d_id)
            handoff_s = handoff.value if handoff is not None else default_transfer_s
            if hits and d_id in hits:
                # Blocks the decode engine holds are not pulled again: the rest moves.
                handoff_s *= 1.0 - hits[d_id] / n
            # The batch it joins: the sequences predicted to still decode when its first token
            # comes (short answers decoding now may be gone by then), and what the engine
            # reports beyond the router's own. A local prefill starts now: the batch as it is.
            # (EngineState.decode_batch_at, inline, with the overdue ends pruned first: this
            # loop runs for every request.)
            batch = batch_now = own + d.pending_decode
            if fresh and scraped.running > own:
                batch = batch_now = batch_now + int(scraped.running) - own
            ends = d.decode_ends
            if ends and choice is not None:
                if ends[0] <= now:
                    d.prune_decode_ends(now)
                joins = now + choice[0] + handoff_s
                if ends and ends[0] <= joins:
                    batch -= bisect_right(ends, joins)
            d_model = models[d_id].decode
            if d_model is not decode_model:
                decode_model = d_model
                raw_by_batch = raw_decode.setdefault(id(d_model), {})
            cached = raw_by_batch.get(batch)
            if cached is None:
                # predict(batch + 1, context).seconds, without its flags
                raw = raw_by_batch[batch] = d_model.seconds_per_token(batch + 1, context)
            else:
                raw = cached
            ewma = ratios.get((d_id, "decode"))
            ratio = ewma.observed / ewma.predicted if ewma is not None else 1.0
            tpot = step = raw * ratio
            if local_enabled:
                # Local prefills stall every sequence here, this request's too, however it
                # gets here: at the rate recently sent, spread over its output tokens.
                horizon = max(1, shape.max_tokens - 1)
                stalls = d.recent_local_prefill_s(now - horizon * tpot)
                if local_on:
                    tpot_now = tpot
                    if batch_now != batch:
                        tpot_now = d_model.seconds_per_token(batch_now + 1, context) * ratio
                    hit = hits.get(d_id, 0) if hits else 0
                    local.append(
                        self._local(state, d, n, shape, batch_now, tpot_now, stalls, now, hit)
                    )
                tpot += stalls / horizon
            if choice is None:
                continue
            if tpot > tpot_budget:
                # Over the budget in the batch at its join: TPOT is a mean over its life, and
                # a burst's short answers come and go within it (see _life_batch). Only here:
                # this loop runs for every request.
                life = _life_batch(d, batch, now + choice[0] + handoff_s, tpot, tokens, now)
                if life < batch:
                    tpot = d_model.seconds_per_token(life + 1, context) * ratio + (tpot - step)
            ttft = choice[0] + handoff_s + step
            # min() of the two, the first on a tie
            ttft_slack = (ttft_budget - ttft) / ttft_scale
            tpot_slack = (tpot_budget - tpot) / tpot_budget
            slack = tpot_slack if tpot_slack < ttft_slack else ttft_slack
            # _load(d, own, now, stale), inline, and the requests still in their prefill leg
            # that will join this batch: in a burst most of what an engine is about to carry.
            if fresh:
                reported = scraped.running + scraped.waiting
                load = choice[3] + (reported if reported > own else own) + d.pending_decode
            else:
                load = choice[3] + own + d.pending_decode
            candidates.append((slack, load, d, choice, ttft, tpot))
            if slack > top:
                top = slack
        if local:
            fastest = min((c[4] for c in candidates), default=float("inf"))
            # Faster is not enough: a local prefill spends its batch's TPOT headroom, which
            # the handoffs to come need. It must leave at least the slack the best handoff
            # would (so it wins where TTFT binds: behind long prefill queues, or on an idle
            # engine, where it stalls no one).
            best = max((c[0] for c in candidates), default=0.0) - 1e-9
            deadline = state.fleet.engine.first_token_timeout_s
            fits = [
                c for c in local if c[0] >= 0 and c[0] >= best and c[3] < min(fastest, deadline)
            ]
            if fits:
                top = max(c[0] for c in fits)
                floor = max(top - margin, 0.0)
                slack, _, d, ttft, tpot, prefill_s = min(
                    (c for c in fits if c[0] >= floor), key=lambda c: (c[1], -c[0], c[2].id)
                )
                hit = hits.get(d.id, 0) if hits else 0
                return Pair(
                    d.id, d.id, slack, ttft, tpot, prefill_s, True, hit, hit, hits is not None
                )
        if not prefills:
            return NoPair("no available engine in the prefill role")
        if not candidates:
            return NoPair("no permitted KV transfer pair between available engines")
        floor = top - margin
        if top >= 0:
            floor = max(floor, 0.0)
        # Of those within ``margin`` of the best: the least loaded, then (with a prefix) the
        # one holding more of it (fewer blocks to move), then the most slack, then the first
        # engine id (the first such candidate on a full tie, as min() with that key).
        best_c = None
        for c in candidates:
            if not c[0] >= floor:
                continue
            if best_c is None or c[1] < best_c[1]:
                best_c = c
            elif c[1] == best_c[1]:
                if hits:
                    held, best_held = hits.get(c[2].id, 0), hits.get(best_c[2].id, 0)
                    if held != best_held:
                        if held > best_held:
                            best_c = c
                        continue
                if (-c[0], c[2].id) < (-best_c[0], best_c[2].id):
                    best_c = c
        assert best_c is not None
        slack, _, d, (_, p_id, prefill_s, _), ttft, tpot = best_c
        pair = Pair(p_id, d.id, slack, ttft, tpot, prefill_s, prefix_looked=hits is not None)
        if hits:
            pair = replace(
                pair, cached_tokens=hits.get(p_id, 0), decode_cached_tokens=hits.get(d.id, 0)
            )
        if slack < 0:
            return NoPair(
                f"no pair is predicted to meet the budgets (best {p_id}->{d.id}:"
                f" TTFT {ttft:.3f} s, TPOT {tpot:.4f} s)",
                over_budget=pair,
            )
        return pair

    def _local(
        self,
        state: FleetState,
        d: EngineState,
        n: int,
        shape: RequestShape,
        batch: int,
        tpot: float,
        stalls: float,
        now: float,
        hit: int = 0,
    ) -> tuple[float, float, EngineState, float, float, float]:
        """The candidate "``d`` prefills the prompt itself": (slack, load, engine, TTFT, TPOT,
        prefill seconds)."""
        predictor = self.predictor
        # Local legs' first tokens against their predictions (phase "local", learnt online)
        # scale the whole of it, the prefill (and so the stall) included.
        correction = predictor.ratio(d.id, "local")
        prefill_s = (
            predictor.models[d.id].prefill.predict_cached(n, hit).seconds
            * predictor.ratio(d.id, "prefill")
            * correction
        )
        # The step in progress finishes first; the step that prefills also decodes the batch
        # (an idle engine's first token comes with the prefill alone).
        others = 1.5 * tpot if batch > 0 else 0.0
        ttft = d.queued_prefill_s(now) + others * correction + prefill_s
        horizon = max(1, shape.max_tokens - 1)
        if batch > 0:
            stalls += prefill_s
        tpot_local = tpot + stalls / horizon
        slack = min(
            (self.budgets.ttft_s - shape.elapsed_s - ttft) / self.budgets.ttft_s,
            (self.budgets.tpot_s - tpot_local) / self.budgets.tpot_s,
        )
        return slack, decode_load(state, d), d, ttft, tpot_local, prefill_s


def _life_batch(
    d: EngineState, batch: int, joins: float, tpot: float, tokens: int, now: float
) -> float:
    """The others in the batch a request joining ``d`` at ``joins`` decodes in, on average
    over its life of ``tokens`` at ``tpot``, where ``batch`` others are counted at its join:
    a sequence decoding there counts for the share of that life until its foreseen end, one
    in its prefill leg for the share between its foreseen join and end, the rest all of it;
    what joins later (at the engine's sustained join rate, for half the life on average)
    refills it, never past ``batch``."""
    life = max(1, tokens - 1) * tpot
    until = joins + life
    ends = d.decode_ends
    lo = bisect_right(ends, joins)
    hi = bisect_right(ends, until)
    decoding = len(ends) - lo
    stay = (sum(ends[lo:hi]) - (hi - lo) * joins) + (len(ends) - hi) * life
    pending = d.pending_spans
    for start, end in pending.values():
        overlap = (end if end < until else until) - (start if start > joins else joins)
        if overlap > 0:
            stay += overlap
    rest = batch - decoding - len(pending)
    shared = (rest if rest > 0 else 0) + stay / life + d.joins.rate(now) * life / 2
    return shared if shared < batch else batch
