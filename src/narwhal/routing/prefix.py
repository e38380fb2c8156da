"""Prompt prefixes as KV block chains, and the router's index of which engine holds which.

A prompt's full blocks of ``block_size`` tokens are keyed as vLLM keys its prefix cache: block
i's key is a hash of block i-1's key and block i's token ids (block 0's parent is the root,
which ``cache_salt`` changes), so equal keys mean equal prefixes and a request's cached prefix
on an engine is the run of its leading keys that engine holds. The keys are Narwhal's own
(``extend_chain``; for text prompts a 64-bit blake2b chain): vLLM's block hashes depend on its
hash algorithm and seed, so the index rebuilds each engine's chain from the token ids its KV
events carry (``BlockStored``) and keeps the engine's own hashes only to apply its later
``BlockRemoved`` and place a later ``BlockStored``'s parent.

``PrefixIndex`` holds, per engine, either what the engine published (precise: stored, removed,
cleared) or, for an engine that publishes nothing, what the router itself sent there
(approximate: each entry lives ``history_ttl_s`` and the engine's entries are bounded by its KV
capacity in blocks, least recently used first out). Pure: times are passed in.

An engine that publishes its events says what it holds only once it has computed (or pulled)
the blocks: seconds after the router sent the prompt, while it queued and prefilled. In that
gap the router's own routing stands in: a token prompt sent to such an engine is held there
*in flight* for ``in_flight_ttl_s`` (the fleet's TTFT budget: a request that has not stored its
prompt by then has missed or failed), so that the prompts sharing its prefix that arrive
meanwhile follow it rather than compute the same blocks on another engine. The engine's own
events take over once they come.

Keying an engine's stored blocks from their token ids costs a hash per block, twice per request
(the prefill engine computes the blocks, the decode engine pulls them). The router has keyed the
prompt already; ``expect`` registers it where each engine is expected to start storing, and a
``BlockStored`` after that parent whose token ids are the prompt's (compared still packed, see
``PackedTokenIds``) takes the prompt's keys. Anything else is hashed as before.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "TEXT_BYTES_PER_TOKEN",
    "EngineHash",
    "PackedTokenIds",
    "PrefixIndex",
    "TokenPrompt",
    "chain_keys",
    "chain_root",
    "extend_chain",
    "prompt_keys",
    "text_keys",
    "token_prompt",
]

# vLLM's ExternalBlockHash: sha256 bytes by default, a 64-bit int with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
EngineHash = bytes | int

_PERSON = b"narwhal-prefix"
# Runs of stored blocks keyed by hashing that a second engine may store too (PrefixIndex.stored).
_KEYED_RUNS = 64
# A text prompt's blocks are keyed by its UTF-8 bytes, this many per token (a typical BPE
# average) times the block size: the router has no tokenizer on its hot path.
TEXT_BYTES_PER_TOKEN = 4


def chain_root(salt: str | None = None) -> int:
    """The parent key of a prompt's first block: one root per ``cache_salt`` (vLLM puts the salt
    in block 0's hash, so salted prompts share nothing with unsalted ones)."""
    if not salt:
        return 0
    return int.from_bytes(
        hashlib.blake2b(salt.encode(), digest_size=8, person=_PERSON).digest(), "little"
    )


def extend_chain(parent: int, block_tokens: Sequence[int]) -> int:
    """The key of a block whose parent block has key ``parent``: Python's hash of the pair,
    which for ints and tuples of ints is the same in every process (only str and bytes hashes
    are salted by PYTHONHASHSEED) and a few times faster than a digest: a 12,000-token prompt
    is keyed in well under a millisecond on the router's hot path."""
    return hash((parent, tuple(int(t) for t in block_tokens)))


def chain_keys(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The keys of the prompt's full blocks (a partial last block is never cached)."""
    return _chain(tokens, block_size, chain_root(salt))


def _chain(tokens: Sequence[int], block_size: int, root: int) -> list[int]:
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    ids = tuple(tokens)
    keys: list[int] = []
    key = root
    for start in range(0, len(ids) - block_size + 1, block_size):
        key = hash((key, ids[start : start + block_size]))
        keys.append(key)
    return keys


def text_keys(parts: Iterable[str], block_size: int, salt: str | None = None) -> list[int]:
    """Keys of a text prompt's full blocks of ``block_size * TEXT_BYTES_PER_TOKEN`` UTF-8 bytes
    (``parts`` in order, each ended by a NUL so that part boundaries count). Their root is not
    any token prompt's: they match only text keys, which only routing history records."""
    data = b"".join(part.encode("utf-8", "surrogatepass") + b"\0" for part in parts)
    size = block_size * TEXT_BYTES_PER_TOKEN
    key = chain_root("text\0" + (salt or ""))
    keys = []
    for start in range(0, len(data) - size + 1, size):
        h = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8, person=_PERSON)
        h.update(data[start : start + size])
        key = int.from_bytes(h.digest(), "little")
        keys.append(key)
    return keys


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt of token ids as the router received it, and the parent key of its first block
    (``chain_root`` of its salt): what ``PrefixIndex.expect`` needs to know the blocks an engine
    will store for it."""

    tokens: Sequence[int]
    root: int


def token_prompt(body: Mapping[str, Any]) -> TokenPrompt | None:
    """The request's prompt when it is token ids (not hashed: ``prompt_keys`` keys it)."""
    prompt = body.get("prompt")
    # isinstance: JSON's true and false are ids 1 and 0 to vLLM (and hash as 1 and 0 here).
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return None
    salt = body.get("cache_salt")
    return TokenPrompt(prompt, chain_root(salt if isinstance(salt, str) else None))


def prompt_keys(body: Mapping[str, Any], chat: bool, block_size: int) -> tuple[int, ...]:
    """A client request's prefix keys: exact for a prompt of token ids, by its text otherwise
    (a chat's roles and contents in order); () when the prompt is neither (a batch, images)
    or is not what the engine computes (a ``suffix``: the engine renders both into a
    fill-in-the-middle prompt)."""
    if body.get("suffix") is not None:
        return ()
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) else None
    special = body.get("add_special_tokens")
    if special is not None and bool(special) != (not chat):
        # Special tokens added where the route's default adds none (a Responses request's
        # chat), or left out where it adds them: the same text, other tokens from the first.
        salt = (salt or "") + "\0special" + ("+" if special else "-")
    if chat:
        parts: list[str] = []
        for message in body.get("messages") or ():
            if not isinstance(message, Mapping):
                return ()
            parts.append(str(message.get("role")))
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, Mapping) else None
                    if not isinstance(text, str):
                        return tuple(text_keys(parts, block_size, salt))  # up to the image
                    parts.append(text)
        return tuple(text_keys(parts, block_size, salt))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tuple(text_keys([prompt], block_size, salt))
    tokens = token_prompt(body)
    if tokens is not None:
        # Not every element checked (a loop per token on the hot path): the router keys only
        # prompts its validation passed, and an element that is no int gives keys no engine's
        # blocks have, or (unhashable) none.
        try:
            return tuple(_chain(tokens.tokens, block_size, tokens.root))
        except TypeError:
            return ()
    return ()


class PackedTokenIds(Protocol):
    """A ``BlockStored``'s token ids as they came (msgpack), unpacked only when needed: comparing
    them with a prompt the router sent is cheaper than reading and hashing them."""

    def __len__(self) -> int: ...

    def unpack(self) -> Sequence[int]:
        """The ids; ValueError when they are not a list of ints."""
        ...

    def equals(self, tokens: Sequence[int], start: int, stop: int, probe: int) -> bool:
        """Whether they are ``tokens[start:stop]`` (the first ``probe`` compared first)."""
        ...

    def joins(self, parts: Sequence[Any]) -> bool:
        """Whether they are the ids of ``parts`` (packed alike) one after another, by their
        bytes; False, never a wrong True, for parts packed otherwise."""
        ...

    def __hash__(self) -> int:
        """By the packed bytes, as ``==`` between two of them compares."""
        ...


@dataclass(eq=False, slots=True)
class _Expected:
    """A prompt sent to engines that publish KV events, until they store its blocks."""

    tokens: Sequence[int]
    keys: Sequence[int]
    root: int
    size: int  # len(tokens), what it counts against PrefixIndex.expected_tokens
    parents: list[int] = field(default_factory=list)  # where it is registered in _expected
    # The token ids of a stored run that matched, by its token range: a P/D request's decode
    # engine stores the run its prefill engine stored, compared as the events' bytes.
    matched: dict[tuple[int, int], Sequence[int] | PackedTokenIds] = field(default_factory=dict)
    waiting: int = 0  # stored runs still expected (over all its registrations)


@dataclass(eq=False, slots=True)
class _Waiting:
    """An expected prompt's registration: ``engines`` engines will store it from ``start``."""

    entry: _Expected
    start: int
    engines: int


@dataclass
class _EngineEntries:
    # Routing history: key -> expiry, least recently used first. Token-id prompts' keys, for an
    # engine that publishes no events (its events say what it holds otherwise) ...
    keys: OrderedDict[int, float] = field(default_factory=OrderedDict)
    # ... and text and chat prompts' keys, for every engine (no event carries them): kept apart
    # so that a change of the engine's source drops the token keys and keeps these.
    text_keys: OrderedDict[int, float] = field(default_factory=OrderedDict)
    capacity_blocks: int = 0
    precise: bool = False
    bit: int = 0  # the engine's bit in PrefixIndex._holders
    # Published entries: the engine's hash -> Narwhal's key, in the order stored; applies
    # BlockRemoved and places a BlockStored's parent. A plain dict, not an LRU: the engine's
    # own BlockRemoved keep it to what the engine holds (a block stored or removed costs two
    # dict writes, the hottest loop with long prompts); ``_trim`` bounds it all the same.
    by_engine_hash: dict[EngineHash, int] = field(default_factory=dict)
    # Token keys sent to an engine that publishes events: key -> when, in two generations
    # (``PrefixIndex._fly``); alive for ``in_flight_ttl_s`` after being sent.
    flying: dict[int, float] = field(default_factory=dict)
    flown: dict[int, float] = field(default_factory=dict)
    flying_since: float = float("-inf")  # when ``flying`` began
    last_flown: float = float("-inf")  # the latest send
    # An engine that publishes events: the blocks it has stored so far, and each text key's
    # count when it was last sent there, oldest first. Its cache is an LRU of
    # ``capacity_blocks``: a prefix not sent again is gone once that many blocks were stored
    # after it, and no event says so of a text key (``_evict_text``).
    stored_blocks: int = 0
    text_stored_at: OrderedDict[int, int] = field(default_factory=OrderedDict)


def _tiling(
    matched: Mapping[tuple[int, int], Sequence[int] | PackedTokenIds], start: int, stop: int
) -> list[Any] | None:
    """The matched runs that cover ``start:stop`` end to end, in order (None if they do not,
    or if one of them is unpacked ids)."""
    parts: list[Any] = []
    at = start
    while at < stop:
        for (a, b), ids in matched.items():
            if a == at and b <= stop and not isinstance(ids, Sequence):
                parts.append(ids)
                at = b
                break
        else:
            return None
    return parts if len(parts) > 1 else None


class PrefixIndex:
    """Which engine holds which block chain, for ``match``ing a prompt's keys against all."""

    def __init__(
        self,
        block_size: int,
        history_ttl_s: float = 1800.0,
        expected_tokens: int = 1 << 20,
        in_flight_ttl_s: float = 10.0,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if history_ttl_s <= 0:
            raise ValueError("history_ttl_s must be positive")
        if in_flight_ttl_s < 0:
            raise ValueError("in_flight_ttl_s must not be negative")
        self.block_size = block_size
        self.history_ttl_s = history_ttl_s
        self.in_flight_ttl_s = in_flight_ttl_s
        self._engines: dict[str, _EngineEntries] = {}
        # key -> the engines holding it, a bit each (``_EngineEntries.bit``): an int is set in
        # one dict write and tested against all of a match's candidates in one AND.
        self._holders: dict[int, int] = {}
        # Engines that publish events with keys sent there lately (``_fly``).
        self._flying: dict[str, _EngineEntries] = {}
        self._engine_ids: list[str] = []  # by bit position
        # Prompts sent to engines that publish events, by the key of the block before the first
        # one an engine is expected to store (with that block's index): their keys are known,
        # so a BlockStored that carries their tokens is keyed without hashing (``expect``).
        # Bounded by ``expected_tokens`` prompt tokens, oldest out first.
        self.expected_tokens = expected_tokens
        # Registrations leave once their engines stored the run, so that a lookup (every
        # BlockStored) compares with the prompts in flight only.
        self._expected: dict[int, list[_Waiting]] = {}
        self._expected_order: deque[_Expected] = deque()
        self._expected_held = 0
        self.expected_hits = 0  # BlockStored events keyed from an expected prompt
        # Runs keyed by hashing, by their parent's key and packed ids, the latest _KEYED_RUNS.
        self._keyed_runs: dict[tuple[int, PackedTokenIds], Sequence[int]] = {}
        self.reused_runs = 0  # BlockStored events keyed from _keyed_runs

    # --- membership --------------------------------------------------------------------------

    def add_engine(self, engine_id: str, capacity_blocks: int) -> None:
        """Track an engine whose prefix cache holds at most ``capacity_blocks`` blocks."""
        entries = self._engines.get(engine_id)
        if entries is None:
            entries = self._engines[engine_id] = _EngineEntries(bit=1 << len(self._engine_ids))
            self._engine_ids.append(engine_id)
        entries.capacity_blocks = max(1, capacity_blocks)
        self._trim(entries)

    def set_precise(self, engine_id: str, precise: bool) -> None:
        """Whether the engine's token-id entries come from its KV events (True) or from routing
        history. A change of source starts them afresh (neither source's entries say anything
        about the other's); the text prompts' history, which either source keeps, stays."""
        entries = self._entry(engine_id)
        if entries.precise != precise:
            self._drop_token_entries(engine_id, entries)
            entries.precise = precise
            if precise:
                # Text keys sent while it was routed by history were never stamped: they count
                # from now, as if sent now (``_evict_text``).
                entries.text_stored_at = OrderedDict.fromkeys(
                    entries.text_keys, entries.stored_blocks
                )

    def is_precise(self, engine_id: str) -> bool:
        entries = self._engines.get(engine_id)
        return entries is not None and entries.precise

    def engines(self) -> list[str]:
        return list(self._engines)

    def blocks_held(self, engine_id: str, now: float | None = None) -> int:
        """The engine's entries; at ``now``, without the routing history that expired by then
        (expiry is otherwise lazy: the next prompt sent there)."""
        entries = self._engines.get(engine_id)
        if entries is None:
            return 0
        if now is not None:
            self._expire(entries, now)
        return len(entries.keys) + len(entries.text_keys) + len(entries.by_engine_hash)

    # --- lookups -------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], now: float, in_flight: bool = True) -> dict[str, int]:
        """Per engine holding at least the first block: how many leading blocks it holds.
        ``in_flight``: with the blocks an engine that publishes events was sent and has not yet
        said it stored (what it will hold: a pick's view); without, what its cache holds now
        (what a decode leg sent now finds there)."""
        holders = self._holders
        flying = self._flying if in_flight else None
        alive = holders.get(keys[0], 0) if keys else 0
        if not alive:
            return self._in_flight_depth(keys, now, {}) if flying and keys else {}
        depth: dict[str, int] = {}
        d = 1
        for key in itertools.islice(keys, 1, None):
            kept = alive & holders.get(key, 0)
            if kept != alive:
                self._set_depth(depth, alive & ~kept, d)
                alive = kept
                if not alive:
                    break
            d += 1
        self._set_depth(depth, alive, d)
        # Expiry, checked once per engine: a prompt's keys are refreshed together with all
        # their ancestors, so a block's entry never outlives its parent's: walk back from the
        # deepest held to the deepest still alive. A key held but not in the history is held
        # by the engine's events (no expiry).
        held: dict[str, int] = {}
        for e, n in depth.items():
            entries = self._engines[e]
            history, text = entries.keys, entries.text_keys
            dead = 0.0 if not entries.precise else float("inf")
            while n:
                key = keys[n - 1]
                expiry = history.get(key)
                if expiry is None:
                    expiry = text.get(key, dead)
                if expiry > now:
                    break
                n -= 1
            if n:
                held[e] = n
        return self._in_flight_depth(keys, now, held) if flying else held

    def _in_flight_depth(
        self, keys: Sequence[int], now: float, held: dict[str, int]
    ) -> dict[str, int]:
        """``held`` extended, per engine with keys in flight, to the prompt's keys in flight
        there. A key is sent with all its ancestors (a chain key stands for its whole prefix),
        and a later send refreshes them: the keys alive in flight are a leading run, found by
        bisection."""
        horizon = now - self.in_flight_ttl_s
        idle = []
        for e, entries in self._flying.items():
            if entries.last_flown <= horizon:
                idle.append(e)
                continue
            flying, flown = entries.flying, entries.flown
            lo, hi = held.get(e, 0), len(keys)  # keys[:lo] held; is keys[hi - 1] in flight?
            while lo < hi:
                mid = (lo + hi + 1) // 2
                key = keys[mid - 1]
                sent = flying.get(key)
                if sent is None:
                    sent = flown.get(key)
                if sent is not None and sent > horizon:
                    lo = mid
                else:
                    hi = mid - 1
            if lo:
                held[e] = lo
        for e in idle:
            entries = self._flying.pop(e)
            entries.flying, entries.flown = {}, {}
        return held

    def _set_depth(self, depth: dict[str, int], engines: int, d: int) -> None:
        ids = self._engine_ids
        while engines:
            low = engines & -engines
            depth[ids[low.bit_length() - 1]] = d
            engines ^= low

    # --- routing history (engines without events) ----------------------------------------------

    def record_routed(
        self, engine_id: str, keys: Iterable[int], now: float, exact: bool = True
    ) -> None:
        """The router sent a prompt with these keys to the engine: it will hold them. Token
        keys (``exact``) are ignored for an engine that publishes its events (they say what it
        holds); text keys, which no event carries, are recorded for every engine."""
        entries = self._entry(engine_id)
        if entries.precise and exact:
            self._fly(engine_id, entries, keys, now)
            return
        self._expire(entries, now)
        expiry = now + self.history_ttl_s
        history = entries.keys if exact else entries.text_keys
        if entries.precise:  # text keys (token keys are in flight above)
            keys = list(keys)
            stamps, at = entries.text_stored_at, entries.stored_blocks
            for key in keys:
                stamps[key] = at
                stamps.move_to_end(key)
            # Keys the history dropped meanwhile (its TTL, its bound) leave their stamps
            # behind until the count passes them: bounded all the same.
            while len(stamps) > 2 * entries.capacity_blocks:
                stamps.popitem(last=False)
        for key in keys:
            self._put(entries, history, key, expiry)
        self._trim(entries)

    def forget_routed(
        self, engine_id: str, keys: Iterable[int], sent_at: float, exact: bool = True
    ) -> None:
        """A leg the router sent there at ``sent_at`` with these keys failed: the engine may
        not hold them after all, and the claim would steer the prompts that share them to it,
        to wait there for a hit that does not come (worse than routing blind). Takes back
        what that send recorded and nothing a later one refreshed: the keys still stamped
        ``sent_at`` (in flight on an engine that publishes events, else in its routing
        history). A key an earlier send also recorded goes too (the later stamp replaced the
        earlier one): the index then claims less than the sends in flight, never more; what
        an engine published stays."""
        entries = self._engines.get(engine_id)
        if entries is None:
            return
        if entries.precise and exact:
            for generation in (entries.flying, entries.flown):
                for key in keys:
                    if generation.get(key) == sent_at:
                        del generation[key]
            return
        held = entries.keys if exact else entries.text_keys
        expiry = sent_at + self.history_ttl_s  # as record_routed stamped it
        for key in keys:
            if held.get(key) == expiry:
                del held[key]
                self._unhold(entries, key)

    def _fly(
        self, engine_id: str, entries: _EngineEntries, keys: Iterable[int], now: float
    ) -> None:
        """Hold the keys in flight on an engine that publishes events, for ``in_flight_ttl_s``
        (its events say what it then holds). Two generations rather than an expiry per key: a
        12,000-token prompt's 750 keys go in with one C-level dict update, on the hot path,
        and a generation is dropped whole once nothing in it can be alive (or the engine's
        capacity is reached, which bounds them)."""
        if self.in_flight_ttl_s <= 0:
            return
        if (
            now - entries.flying_since >= self.in_flight_ttl_s
            or len(entries.flying) >= entries.capacity_blocks
        ):
            entries.flown, entries.flying, entries.flying_since = entries.flying, {}, now
        entries.flying.update(zip(keys, itertools.repeat(now)))
        entries.last_flown = now
        self._flying[engine_id] = entries

    def expect(self, prompt: TokenPrompt, keys: Sequence[int], starts: Iterable[int]) -> None:
        """The router sent a token prompt whose keys are ``keys`` to engines that publish their
        events and hold its first ``starts`` blocks (one per engine): each will store the rest,
        from its start on, in a ``BlockStored`` whose tokens ``stored`` then compares with the
        prompt's instead of hashing them (a decode engine stores the blocks it pulled, as the
        prefill engine does those it computed: two chains of hashes a request saved)."""
        if not keys or self.expected_tokens <= 0:
            return
        entry = _Expected(prompt.tokens, keys, prompt.root, len(prompt.tokens))
        for start, engines in Counter(starts).items():
            if 0 <= start < len(keys):
                self._expect_at(entry, start, engines)
        if not entry.waiting:
            return
        self._expected_order.append(entry)
        self._expected_held += entry.size
        while self._expected_held > self.expected_tokens and len(self._expected_order) > 1:
            self._forget_expected(self._expected_order.popleft())

    @property
    def expected_runs(self) -> int:
        """Stored runs of expected prompts not yet seen (one per engine and start)."""
        return sum(w.engines for waiting in self._expected.values() for w in waiting)

    def _expect_at(self, entry: _Expected, start: int, engines: int) -> None:
        parent = entry.keys[start - 1] if start else entry.root
        waiting = self._expected.setdefault(parent, [])
        entry.waiting += engines
        for w in waiting:
            if w.entry is entry and w.start == start:
                w.engines += engines
                return
        waiting.append(_Waiting(entry, start, engines))
        entry.parents.append(parent)

    def _unregister(self, parent: int, entry: _Expected) -> None:
        waiting = self._expected.get(parent)
        if waiting is not None:
            waiting[:] = [w for w in waiting if w.entry is not entry]
            if not waiting:
                del self._expected[parent]

    def _forget_expected(self, entry: _Expected) -> None:
        # An entry whose runs were all stored is still counted until it leaves the FIFO (which
        # bounds how many there are); it holds no tokens by then.
        self._expected_held -= entry.size
        for parent in entry.parents:
            self._unregister(parent, entry)

    def _expected_chain(
        self,
        parent: int,
        token_ids: Sequence[int] | PackedTokenIds,
        blocks: int,
        block_size: int,
    ) -> Sequence[int] | None:
        """The keys of a stored run of ``blocks`` blocks after ``parent`` when it is an
        expected prompt's (the latest sent first), else None."""
        waiting = self._expected.get(parent)
        if not waiting:
            return None
        for w in reversed(waiting):
            entry, start = w.entry, w.start
            end = start + blocks
            if end > len(entry.keys):
                continue
            a, b = start * block_size, end * block_size
            matched = entry.matched.get((a, b))
            try:
                if matched is not None and matched == token_ids:
                    same = True
                elif isinstance(token_ids, Sequence):
                    same = list(token_ids) == list(entry.tokens[a:b])
                else:
                    # The decode engine pulls in one run what the prefill engine stored in
                    # chunks (an event per scheduled chunk): compared with their bytes first.
                    parts = _tiling(entry.matched, a, b) if matched is None else None
                    same = (parts is not None and token_ids.joins(parts)) or token_ids.equals(
                        entry.tokens, a, b, block_size
                    )
            except (TypeError, ValueError):
                same = False
            if same:
                self.expected_hits += 1
                keys = entry.keys[start:end]
                if end < len(entry.keys):
                    # The rest comes in a later step's event (a chunked prefill) after this one.
                    self._expect_at(entry, end, 1)
                entry.matched[(a, b)] = token_ids
                w.engines -= 1
                entry.waiting -= 1
                if not w.engines:
                    self._unregister(parent, entry)  # its one registration after this parent
                if not entry.waiting:
                    # Every engine stored its run: nothing more to compare with.
                    entry.tokens, entry.keys = (), ()
                    entry.matched.clear()
                return keys
        return None

    # --- KV events (precise) ----------------------------------------------------------------------

    def stored(
        self,
        engine_id: str,
        block_hashes: Sequence[EngineHash],
        parent_hash: EngineHash | None,
        token_ids: Sequence[int] | PackedTokenIds,
        block_size: int,
        salt: str | None = None,
    ) -> bool:
        """A ``BlockStored`` event. False (nothing applied) when it cannot be placed: a parent
        the index never saw stored (an event was lost: resynchronise), a block size other
        than the index's, or token ids that are not ints."""
        entries = self._entry(engine_id)
        if block_size != self.block_size or len(token_ids) != block_size * len(block_hashes):
            return False
        # Counted whether or not the index can place them (a parent it never saw): the
        # engine's LRU moved on all the same (``_evict_text``).
        entries.stored_blocks += len(block_hashes)
        if entries.text_stored_at:
            self._evict_text(entries)
        if parent_hash is None:
            key = chain_root(salt)
        else:
            parent = entries.by_engine_hash.get(parent_hash)
            if parent is None:
                return False
            key = parent
        chain = self._expected_chain(key, token_ids, len(block_hashes), block_size)
        if chain is None:
            chain = self._hashed_chain(key, token_ids, block_size)
            if chain is None:
                return False
        # Hot with long prompts (every engine's every new block).
        by_engine_hash, bit, holders = entries.by_engine_hash, entries.bit, self._holders
        for engine_hash, key in zip(block_hashes, chain, strict=True):
            by_engine_hash[engine_hash] = key
            holders[key] = holders.get(key, 0) | bit
        if len(by_engine_hash) > 2 * entries.capacity_blocks:
            self._trim(entries)
        return True

    def _evict_text(self, entries: _EngineEntries) -> None:
        """Drop the text keys of an engine that publishes events once ``capacity_blocks``
        blocks were stored after they were last sent there: its LRU cache has evicted them,
        and its ``BlockRemoved`` cannot name them (they are keyed by text, its blocks by
        token). Before, such a claim lived out ``history_ttl_s`` and drew the prompts that
        share it to an engine that had lost it. A prompt's own blocks count too, so a long
        one may go a little early: the index then claims less, never more."""
        stamps, text = entries.text_stored_at, entries.text_keys
        horizon = entries.stored_blocks - entries.capacity_blocks
        while stamps:
            key, at = next(iter(stamps.items()))
            if at > horizon:
                break
            del stamps[key]
            if text.pop(key, None) is not None:
                self._unhold(entries, key)

    def _hashed_chain(
        self, parent: int, token_ids: Sequence[int] | PackedTokenIds, block_size: int
    ) -> Sequence[int] | None:
        """The keys of a stored run no expected prompt matched (another replica's request), by
        hashing its ids; None when they are not ints (a malformed event, dropped whole). The
        second engine of its P/D pair stores the same run after the same parent: keyed once."""
        run = None if isinstance(token_ids, Sequence) else (parent, token_ids)
        if run is not None and (chain := self._keyed_runs.get(run)) is not None:
            self.reused_runs += 1
            return chain
        try:
            ids = token_ids if isinstance(token_ids, Sequence) else token_ids.unpack()
            chain = _chain(ids, block_size, parent)
        except (TypeError, ValueError):
            return None
        if run is not None:
            self._keyed_runs[run] = chain
            if len(self._keyed_runs) > _KEYED_RUNS:
                del self._keyed_runs[next(iter(self._keyed_runs))]
        return chain

    def removed(self, engine_id: str, block_hashes: Sequence[EngineHash]) -> None:
        """A ``BlockRemoved`` event (hashes the index does not know are ignored)."""
        entries = self._entry(engine_id)
        by_engine_hash, holders, others = entries.by_engine_hash, self._holders, ~entries.bit
        # Hot: a full cache evicts a block for every one it stores. The loop body is _unhold's,
        # inlined.
        for engine_hash in block_hashes:
            key = by_engine_hash.pop(engine_hash, None)
            if key is not None:
                engines = holders.pop(key, 0) & others
                if engines:
                    holders[key] = engines

    def clear(self, engine_id: str) -> None:
        """``AllBlocksCleared``, an engine restart, or a lost event stream: forget the engine's
        entries."""
        entries = self._engines.get(engine_id)
        if entries is None:
            return
        for key in entries.text_keys:
            self._unhold(entries, key)
        entries.text_keys.clear()
        entries.text_stored_at.clear()
        self._drop_token_entries(engine_id, entries)

    def _drop_token_entries(self, engine_id: str, entries: _EngineEntries) -> None:
        for key in itertools.chain(entries.keys, entries.by_engine_hash.values()):
            self._unhold(entries, key)
        entries.keys.clear()
        entries.by_engine_hash.clear()
        entries.flying, entries.flown = {}, {}
        self._flying.pop(engine_id, None)

    # --- internals -------------------------------------------------------------------------------

    def _entry(self, engine_id: str) -> _EngineEntries:
        entries = self._engines.get(engine_id)
        if entries is None:
            raise KeyError(f"engine {engine_id!r} is not in the prefix index")
        return entries

    def _put(
        self, entries: _EngineEntries, history: OrderedDict[int, float], key: int, expiry: float
    ) -> None:
        if key in history:
            history.move_to_end(key)
        else:
            self._holders[key] = self._holders.get(key, 0) | entries.bit
        history[key] = expiry

    def _unhold(self, entries: _EngineEntries, key: int) -> None:
        engines = self._holders.pop(key, 0) & ~entries.bit
        if engines:
            self._holders[key] = engines

    def _trim(self, entries: _EngineEntries) -> None:
        """Bound the history by the engine's capacity and the published entries by twice that,
        the oldest out first. The engine's own removals keep the published ones to what it
        holds; the slack is for an engine that holds more than the fleet says (its entries' order
        is their store order, not its LRU: trimming them drops parents that later blocks need)."""
        history, text = entries.keys, entries.text_keys
        for _ in range(len(history) + len(text) - entries.capacity_blocks):
            # The least recently sent of both (each is in the order its keys were sent).
            older = history
            if not history or (text and next(iter(text.values())) < next(iter(history.values()))):
                older = text
            self._unhold(entries, older.popitem(last=False)[0])
        published = entries.by_engine_hash
        excess = len(published) - 2 * entries.capacity_blocks
        if excess > 0:
            for engine_hash in list(itertools.islice(published, excess)):
                self._unhold(entries, published.pop(engine_hash))

    def _expire(self, entries: _EngineEntries, now: float) -> None:
        # Approximate entries are refreshed in time order with one TTL: the oldest are first.
        for history in (entries.keys, entries.text_keys):
            while history:
                key, expiry = next(iter(history.items()))
                if expiry > now:
                    break
                history.popitem(last=False)
                self._unhold(entries, key)
