"""The routing policies Narwhal's scheduler is measured against, as the P/D routers operators
would otherwise deploy (vllm-router, SGLang's router) run them, for the virtual-time simulator.

Each picks the prefill engine and the decode engine on its own, by the same policy, from the
engines that take that role now (healthy, breaker closed, not draining); nothing is predicted
and every request is admitted: these routers have no admission control. Load is what such a
router counts itself: the legs it has in flight on an engine (a decode engine also counts the
requests it was chosen for that are still in their prefill leg, as those routers count a
request on both workers from the moment they pick the pair).

- ``RoundRobinScheduler`` (``--policy round_robin``): each role's engines in fleet order, in
  turn.
- ``PowerOfTwoScheduler`` (``--policy power_of_two``): two distinct engines drawn at random,
  the less loaded (the first drawn on a tie). vllm-router 0.1.17 in P/D mode compares loads
  that never move (below): ``blind=True``, registered as ``vllm_power_of_two``.
- ``LeastOutstandingScheduler`` (least outstanding requests): the least loaded engine, the
  first in fleet order on a tie.
- ``CacheAwareScheduler`` (``--policy cache_aware``, vllm-router's default): prefix affinity
  while the role's load is balanced, least load when it is not.

A decode engine must be a permitted KV transfer peer of the chosen prefill engine (all are in a
fleet whose ``kv_transfer_pairs`` is ``all``); the policy chooses among those. Pure: no clock
but ``state.clock``, no I/O.

``cache_aware`` as vllm-router 0.1.x has it (github.com/vllm-project/router: src/policies/
cache_aware.rs, src/tree.rs, src/policies/mod.rs, src/routers/factory.rs,
src/routers/http/vllm_pd_router.rs; docs/load_balancing/README.md; the launcher's defaults in
py_src/vllm_router/router_args.py, as installed here with vllm-router 0.1.17):

- One approximate radix tree over the request *text* (characters), shared by the role's workers
  as tenants. A worker's tree size is the characters it holds (a prefix counted once).
- Imbalanced, when ``max - min > balance_abs_threshold`` and ``max > min *
  balance_rel_threshold`` over the loads of all the role's workers: the least loaded healthy
  worker (the first on a tie), and the text is still inserted for it.
- Balanced: the longest prefix any worker holds; match rate = matched / text characters. Above
  ``cache_threshold`` (strictly): the worker holding that deepest match (if it is no longer
  healthy its whole tree is dropped and the first healthy worker is taken, nothing inserted).
  At or below: the *least loaded* healthy worker, first on a tie. The docs (README, the
  module's header comment, router.py) say "the smallest tree" there, as SGLang's router did
  until sgl-project/sglang#14650 (2025-12); vllm-router's cache_aware.rs (both versions read)
  and the 0.1.17 binary (no ``get_smallest_tenant`` left in it) take the least loaded one:
  ``low_match="smallest_tree"`` gives the documented rule.
- The chosen worker gets the text inserted (its tree grows by what it did not hold).
- A background thread every ``eviction_interval_secs`` evicts, per worker whose tree is over
  ``max_tree_size`` characters, its least recently used leaves until it is not.
- Defaults, as ``vllm-router`` (the launcher) passes them: cache_threshold 0.3,
  balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval_secs 120,
  max_tree_size 2**25 characters per worker. (The Rust ``CacheAwareConfig::default()`` and the
  README's table say 0.5, 32, 1.1, 30 s, 10,000.)
- P/D (``--vllm-pd-disaggregation``): ``--policy`` builds two separate policy instances (two
  trees), one choosing among the prefill workers, one among the decode workers
  (``--prefill-policy``/``--decode-policy`` override either); both are given the same text,
  the serialized request body. Loads: the router's own count, a prefill worker's while its
  prefill leg runs, a decode worker's from the pick (the request still in its prefill leg)
  to the end of the decode response, streamed or not.

What vllm-router 0.1.17 (the installed binary) does in P/D mode, measured on 2 prefill and 2
decode simulated engines (a request sent while another was in its prefill leg, or decoding, 40
tokens streamed or not; six times each), where the sources read (vllm_pd_router.rs, several
versions; power_of_two.rs) leave it open:

- ``round_robin``: one counter per role (prefill picks e0 e1 e0 e1 ..., decode e2 e3 e2 e3
  ..., whatever the other role did), over the role's healthy workers (``count % healthy``,
  src/policies/round_robin.rs): ``RoundRobinScheduler``.
- ``cache_aware``: the second request always went to the other prefill engine while the first
  was prefilling, and to the other decode engine both while the first was in its prefill leg
  and while it was decoding, streamed or not (its Prometheus gauges
  ``vllm_router_pd_pending_decode_requests`` and ``..._active_decode_requests`` show the same
  count, the latter held until the stream ends); sequential requests with nothing in flight
  all went to the first engine of each role (least load, first on a tie; not the smallest
  tree). ``decode_load="outstanding"``.
- ``power_of_two``: with two engines per role both are drawn every time, yet the second
  request went to the busy engine about half the time in either role: the loads it compares do
  not move (its ``/get_load`` poll of the workers fails: ``/get_loads`` reports "Failed to get
  load" for every worker, vLLM's engines and the simulated ones serve no ``/get_load``), so it
  takes the first drawn, a uniform random choice.

Modelled in Narwhal's terms: the text is the prompt's KV blocks (``RequestShape.prefix``,
content hashes in order, block i matching only where blocks 0..i match: a chain of hashes) of
``block_tokens`` tokens each, 512 by default, the block of the Mooncake traces whose
``hash_ids`` the simulator replays (the trace's sharing is only known to that grain). Each role
keeps, per engine, the block chains it holds with their recency and its tree size in tokens;
match rate = matched tokens / prompt tokens. A prompt without a prefix (or the part of one past
its blocks) is content no one shares: it matches nothing but is inserted, growing the tree.
``max_tree_size`` becomes tokens at 4 characters a token (a typical BPE average). Where this
differs from vllm-router:

- Blocks, not characters: matches end on block boundaries; the request body's JSON around the
  prompt (shared by every request, and short) is left out.
- Recency is exact (each use touches the whole chain, ancestors last) where vllm-router's is
  approximate (leaf stamps on insert, one match in eight stamped); a worker's unique content
  is evicted in part (exactly down to the limit) rather than by whole prompts.
- Of several engines holding the deepest match, the first to have inserted it (vllm-router
  takes the tenant its node cached, in practice the first to insert it).
- Eviction runs at the first pick at or after each interval's end (the trees change only at
  picks), intervals counted from the role's first pick.
- Engines excluded by Narwhal (a retry's failed engines, decode engines that are not KV
  transfer peers of the prefill engine) are passed over as unhealthy ones are, their trees
  kept.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from operator import attrgetter
from typing import Literal

from narwhal.routing.fleet_state import EngineState, FleetState, Role
from narwhal.routing.scheduler import NoPair, Pair, RequestShape

__all__ = [
    "BASELINES",
    "CacheAwareParams",
    "CacheAwareScheduler",
    "LeastOutstandingScheduler",
    "PowerOfTwoScheduler",
    "RoundRobinScheduler",
]


def outstanding(engine: EngineState, role: Role) -> int:
    """The legs a load-counting router has on ``engine`` in ``role``."""
    if role == "prefill":
        return engine.in_flight_prefill
    return engine.in_flight_decode + engine.pending_decode


@dataclass(frozen=True, slots=True)
class _RoleChoice:
    """What a per-role policy sees when it chooses one role's engine for a request."""

    role: Role
    candidates: list[EngineState]  # may take the leg (non-empty, fleet order)
    listed: list[EngineState]  # all the role's engines, as a router lists its workers
    shape: RequestShape
    now: float


class _PerRolePolicy:
    """A pair from one engine choice per role; subclasses say how one role's engine is chosen
    from its (non-empty) list of candidates."""

    def choose(self, c: _RoleChoice) -> EngineState:
        raise NotImplementedError

    def pick(
        self,
        state: FleetState,
        shape: RequestShape | None = None,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Pair | NoPair:
        listed_prefill = state.in_role("prefill")
        prefills = [e for e in listed_prefill if e.id not in exclude_prefill and e.takes("prefill")]
        if not prefills:
            return NoPair("no available engine in the prefill role")
        listed_decode = state.in_role("decode")
        decodes = [e for e in listed_decode if e.id not in exclude_decode and e.takes("decode")]
        if not decodes:
            return NoPair("no available engine in the decode role")
        shape = shape or RequestShape()
        now = state.clock.now()
        p = self.choose(_RoleChoice("prefill", prefills, listed_prefill, shape, now))
        peers = [d for d in decodes if d.id != p.id and state.is_permitted(p.id, d.id)]
        if not peers:
            return NoPair(f"no available decode engine is a permitted KV transfer peer of {p.id}")
        d = self.choose(_RoleChoice("decode", peers, listed_decode, shape, now))
        return Pair(p.id, d.id, 0.0)


class RoundRobinScheduler(_PerRolePolicy):
    def __init__(self) -> None:
        self._turn: dict[Role, int] = {"prefill": 0, "decode": 0}

    def choose(self, c: _RoleChoice) -> EngineState:
        turn = self._turn[c.role]
        self._turn[c.role] = turn + 1
        return c.candidates[turn % len(c.candidates)]


def _no_load(engine: EngineState) -> int:
    return 0


# How a router counts a decode engine's load: "outstanding", from the pick (its request still
# in its prefill leg) to the last token; "decode_legs", from the end of the prefill leg to the
# last token; "none".
DecodeCount = Literal["outstanding", "decode_legs", "none"]


def router_load(role: Role, decode: DecodeCount = "outstanding") -> Callable[[EngineState], int]:
    """A router's own count of an engine's load in ``role``: a prefill engine's prefill legs;
    a decode engine's as ``decode`` says."""
    if role == "prefill":
        return attrgetter("in_flight_prefill")
    if decode == "outstanding":
        return _outstanding_decode
    return attrgetter("in_flight_decode") if decode == "decode_legs" else _no_load


def _outstanding_decode(engine: EngineState) -> int:
    return engine.in_flight_decode + engine.pending_decode


class PowerOfTwoScheduler(_PerRolePolicy):
    """Two distinct engines at random, the less loaded (``outstanding``), the first drawn on a
    tie (vllm-router's src/policies/power_of_two.rs: ``load1 <= load2``). ``blind``: every
    load reads 0, so the first drawn, a uniform random choice: vllm-router 0.1.17's
    ``--policy power_of_two`` in P/D mode (see the module docstring)."""

    def __init__(self, rng: random.Random | None = None, blind: bool = False) -> None:
        self.rng = rng or random.Random(0)
        self.blind = blind

    def choose(self, c: _RoleChoice) -> EngineState:
        if len(c.candidates) == 1:
            return c.candidates[0]
        a, b = self.rng.sample(c.candidates, 2)
        if self.blind:
            return a
        return b if outstanding(b, c.role) < outstanding(a, c.role) else a


class LeastOutstandingScheduler(_PerRolePolicy):
    def choose(self, c: _RoleChoice) -> EngineState:
        return min(c.candidates, key=lambda e: outstanding(e, c.role))


# The Mooncake traces' block (their hash_ids are of 512-token blocks).
MOONCAKE_BLOCK_TOKENS = 512
# vllm-router's --max-tree-size default (characters per worker) at a typical 4 characters a
# token of BPE text.
MAX_TREE_TOKENS = 2**25 // 4


@dataclass(frozen=True, slots=True)
class CacheAwareParams:
    """vllm-router's cache_aware settings (its launcher's defaults), in Narwhal's units."""

    cache_threshold: float = 0.3  # match rate above which the best-matching engine is taken
    balance_abs_threshold: int = 64  # imbalanced: max - min load above this ...
    balance_rel_threshold: float = 1.5  # ... and max above min times this
    eviction_interval_s: float = 120.0  # <= 0: never evict (vllm-router: no thread at 0)
    max_tree_tokens: int = MAX_TREE_TOKENS  # per engine and role
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per ``RequestShape.prefix`` hash
    # At or below the threshold: the least loaded engine (what vllm-router does) or the one
    # with the smallest tree (what its docs say).
    low_match: Literal["min_load", "smallest_tree"] = "min_load"
    # A decode engine's load: vllm-router 0.1.17 counts a request from the pick to its last
    # token, streamed or not (measured: see the module docstring).
    decode_load: DecodeCount = "outstanding"

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], not {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 0:
            raise ValueError("the balance thresholds must not be negative")
        if self.block_tokens <= 0 or self.max_tree_tokens < 0:
            raise ValueError("block_tokens must be positive and max_tree_tokens not negative")


# A block chain's key (an int), or a piece of unique content's (a tuple: matched by nothing).
_Key = int | tuple[str, int]


@dataclass(frozen=True, slots=True)
class _Content:
    """A prompt as the trees see it: its chain keys, each block's tokens, the tokens past its
    blocks (unique) and its length."""

    keys: list[int]
    tokens: list[int]
    unique: int
    prompt: int

    @staticmethod
    def of(shape: RequestShape, block_tokens: int) -> _Content:
        keys, tokens, key, left = [], [], 0, shape.prompt_tokens
        for h in shape.prefix:
            # Block i's key stands for blocks 0..i: equal keys, equal prefixes. (An int tuple's
            # hash does not depend on PYTHONHASHSEED: runs repeat.)
            key = hash((key, h))
            keys.append(key)
            tokens.append(min(block_tokens, max(0, left)))
            left -= block_tokens
        return _Content(keys, tokens, max(0, left), shape.prompt_tokens)


class _RoleTrees:
    """One role's trees (vllm-router builds one policy, so one tree, per role): per engine, the
    block chains it holds (key -> tokens, least recently used first) and its size in tokens;
    and which engines hold each chain, in the order they inserted it (the match's answer)."""

    def __init__(self, params: CacheAwareParams) -> None:
        self.params = params
        self.blocks: dict[str, OrderedDict[_Key, int]] = {}
        self.size: dict[str, int] = {}
        self.holders: dict[int, dict[str, None]] = {}
        self._over: set[str] = set()  # engines over max_tree_tokens since the last eviction
        self._unique = 0
        self.next_eviction_at: float | None = None

    def match(self, content: _Content) -> tuple[int, str | None]:
        """(tokens of the longest prefix any engine holds, the first engine to have inserted
        its deepest block)."""
        depth, matched, holders = 0, 0, self.holders
        for key, tokens in zip(content.keys, content.tokens, strict=True):
            if key not in holders:
                break
            depth += 1
            matched += tokens
        if depth == 0:
            return 0, None
        return matched, next(iter(holders[content.keys[depth - 1]]))

    def insert(self, engine_id: str, content: _Content) -> None:
        lru = self.blocks.get(engine_id)
        if lru is None:
            lru = self.blocks[engine_id] = OrderedDict()
        added = content.unique
        if added:
            # The deepest part first (least recent of this insert); unique content used last
            # already is one entry with it (a long run of prefix-less prompts stays one entry).
            last = next(reversed(lru), None)
            if isinstance(last, tuple):
                lru[last] += added
            else:
                self._unique += 1
                lru["unique", self._unique] = added
        holders = self.holders
        # Deepest block first, so that every block is more recent than its descendants and LRU
        # eviction takes leaves first, as vllm-router's does: a held chain never loses a link.
        for key, tokens in zip(reversed(content.keys), reversed(content.tokens), strict=True):
            if key in lru:
                lru.move_to_end(key)
                continue
            lru[key] = tokens
            added += tokens
            holding = holders.get(key)
            if holding is None:
                holders[key] = {engine_id: None}
            else:
                holding[engine_id] = None
        size = self.size.get(engine_id, 0) + added
        self.size[engine_id] = size
        if size > self.params.max_tree_tokens:
            self._over.add(engine_id)

    def forget(self, engine_id: str) -> None:
        """Drop an engine's tree (vllm-router's remove_tenant of a stale worker)."""
        for key in self.blocks.pop(engine_id, {}):
            if isinstance(key, int):
                self._release(key, engine_id)
        self.size.pop(engine_id, None)
        self._over.discard(engine_id)

    def evict_due(self, now: float) -> None:
        """What the eviction thread has done by ``now``: at the end of each interval, every
        engine over ``max_tree_tokens`` evicts its least recently used blocks down to it."""
        interval = self.params.eviction_interval_s
        if interval <= 0:
            return
        due = self.next_eviction_at
        if due is None:
            self.next_eviction_at = now + interval
            return
        if now < due:
            return
        for engine_id in self._over:
            self._evict(engine_id)
        self._over.clear()
        self.next_eviction_at = due + ((now - due) // interval + 1) * interval

    def _evict(self, engine_id: str) -> None:
        lru, size, cap = self.blocks[engine_id], self.size[engine_id], self.params.max_tree_tokens
        while size > cap and lru:
            key, tokens = lru.popitem(last=False)
            if isinstance(key, tuple) and tokens > size - cap:
                lru[key] = tokens - (size - cap)  # unique content: evicted in part
                lru.move_to_end(key, last=False)
                size = cap
                break
            size -= tokens
            if isinstance(key, int):
                self._release(key, engine_id)
        self.size[engine_id] = size

    def _release(self, key: int, engine_id: str) -> None:
        holding = self.holders[key]
        del holding[engine_id]
        if not holding:
            del self.holders[key]


class CacheAwareScheduler(_PerRolePolicy):
    """vllm-router's ``cache_aware``, one tree per role (see the module's docstring)."""

    def __init__(self, params: CacheAwareParams | None = None) -> None:
        self.params = params or CacheAwareParams()
        self.trees: dict[Role, _RoleTrees] = {
            "prefill": _RoleTrees(self.params),
            "decode": _RoleTrees(self.params),
        }

    def load_of(self, role: Role) -> Callable[[EngineState], int]:
        """vllm-router's count: a prefill engine's prefill legs, a decode engine's as
        ``params.decode_load`` says."""
        return router_load(role, self.params.decode_load)

    def choose(self, c: _RoleChoice) -> EngineState:
        params, trees, load = self.params, self.trees[c.role], self.load_of(c.role)
        trees.evict_due(c.now)
        content = _Content.of(c.shape, params.block_tokens)
        loads = [load(e) for e in c.listed]
        low, high = min(loads, default=0), max(loads, default=0)
        if high - low > params.balance_abs_threshold and high > low * params.balance_rel_threshold:
            chosen = min(c.candidates, key=load)
        else:
            matched, holder = trees.match(content)
            rate = matched / content.prompt if content.prompt > 0 else 0.0
            if holder is not None and rate > params.cache_threshold:
                best = next((e for e in c.candidates if e.id == holder), None)
                if best is None:
                    # Gone from the role or unhealthy: vllm-router drops its tree. Passed over
                    # for other reasons (breaker, drain, Narwhal's exclusions): kept.
                    listed = next((e for e in c.listed if e.id == holder), None)
                    if listed is None or listed.healthy is False:
                        trees.forget(holder)
                    return c.candidates[0]  # the first healthy worker; nothing inserted
                chosen = best
            elif params.low_match == "smallest_tree":
                chosen = min(c.candidates, key=lambda e: trees.size.get(e.id, 0))
            else:
                chosen = min(c.candidates, key=load)
        trees.insert(chosen.id, content)
        return chosen


# Name (as the simulator's ``DesConfig.scheduler`` and ``narwhal-fleetsim --scheduler`` take
# it) -> a new scheduler, given the run's random generator.
# ``vllm_power_of_two`` is vllm-router 0.1.17's ``--policy power_of_two`` in P/D mode (blind to
# load); ``power_of_two`` counts outstanding legs, as the policy means to.
BASELINES: dict[str, Callable[[random.Random], _PerRolePolicy]] = {
    "round_robin": lambda rng: RoundRobinScheduler(),
    "power_of_two": PowerOfTwoScheduler,
    "vllm_power_of_two": lambda rng: PowerOfTwoScheduler(rng, blind=True),
    "least_outstanding": lambda rng: LeastOutstandingScheduler(),
    "cache_aware": lambda rng: CacheAwareScheduler(),
}
