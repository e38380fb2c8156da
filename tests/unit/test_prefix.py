"""Prefix keys, the router's prefix index and the simulated engine's block pool (pure)."""

from __future__ import annotations

import pytest

from narwhal.routing.prefix import (
    PrefixIndex,
    chain_keys,
    chain_root,
    extend_chain,
    text_keys,
)
from narwhal.simengine.kv_blocks import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored

BS = 4


def test_chain_keys_are_prefix_keys() -> None:
    a = chain_keys(list(range(10)), BS)
    b = chain_keys([*range(8), 99, 98, 97, 96], BS)
    assert len(a) == 2 and len(b) == 3  # the partial last block is not keyed
    assert a == b[:2]
    assert chain_keys([*range(4), 7, *range(5, 8)], BS)[0] == a[0]
    assert chain_keys([*range(4), 7, *range(5, 8)], BS)[1] != a[1]
    # Block i's key depends on every block before it, not only on its own tokens.
    assert chain_keys([9, 9, 9, 9, 4, 5, 6, 7], BS)[1] != a[1]
    # A salt changes every key.
    assert chain_keys(list(range(8)), BS, salt="s")[0] != a[0]
    assert extend_chain(chain_root("s"), [0, 1, 2, 3]) == chain_keys(list(range(8)), BS, "s")[0]
    with pytest.raises(ValueError):
        chain_keys([1], 0)


def index(ttl: float = 10.0) -> PrefixIndex:
    idx = PrefixIndex(BS, history_ttl_s=ttl)
    for e in ("p0", "p1", "d0"):
        idx.add_engine(e, capacity_blocks=100)
    return idx


def event_index(capacity_blocks: int) -> PrefixIndex:
    """Engines p0 and p1 publishing KV events; prompts held in flight for 5 s."""
    idx = PrefixIndex(BS, in_flight_ttl_s=5.0)
    for e in ("p0", "p1"):
        idx.add_engine(e, capacity_blocks)
        idx.set_precise(e, True)
    return idx


def test_match_counts_leading_blocks_per_engine() -> None:
    idx = index()
    keys = chain_keys(list(range(20)), BS)  # 5 blocks
    idx.record_routed("p0", keys[:3], now=0.0)
    idx.record_routed("p1", keys, now=0.0)
    idx.record_routed("d0", keys[1:], now=0.0)  # holds no block 0: matches nothing
    assert idx.match(keys, now=1.0) == {"p0": 3, "p1": 5}
    assert idx.match(chain_keys([7, *range(1, 20)], BS), now=1.0) == {}
    assert idx.match([], now=1.0) == {}


def test_history_entries_expire_and_are_bounded_by_capacity() -> None:
    idx = index(ttl=10.0)
    keys = chain_keys(list(range(40)), BS)  # 10 blocks
    idx.record_routed("p0", keys, now=0.0)
    assert idx.match(keys, now=9.9) == {"p0": 10}
    assert idx.match(keys, now=10.0) == {}
    idx.record_routed("p0", keys[:2], now=20.0)  # expired entries are dropped on write
    assert idx.blocks_held("p0") == 2
    idx.add_engine("p0", capacity_blocks=3)
    idx.record_routed("p0", keys[:6], now=21.0)
    # Least recently used first out: the deepest blocks of the last prompt stay.
    assert idx.blocks_held("p0") == 3
    assert idx.match(keys, now=22.0) == {}


def test_blocks_held_at_a_time_leaves_out_expired_history() -> None:
    """What the index holds, as narwhal_prefix_index_blocks reads it: history that expired is
    not counted (expiry is lazy, on the engine's next prompt, so it was while none came)."""
    idx = index(ttl=1.0)
    keys = chain_keys(list(range(12)), BS)  # 3 blocks
    idx.record_routed("p0", keys, now=0.0)
    assert idx.blocks_held("p0", now=0.5) == 3
    assert idx.match(keys, now=5.0) == {}
    assert idx.blocks_held("p0", now=5.0) == 0
    assert idx.match(keys, now=5.0) == {} and idx.blocks_held("p0") == 0


def test_published_events_place_blocks_by_their_tokens() -> None:
    idx = index()
    tokens = list(range(12))
    keys = chain_keys(tokens, BS)
    idx.set_precise("p0", True)
    # The engine's own hashes are opaque (bytes here, as vLLM's sha256 default).
    assert idx.stored("p0", [b"h0", b"h1"], None, tokens[:8], BS)
    assert idx.stored("p0", [b"h2"], b"h1", tokens[8:12], BS)
    assert idx.match(keys, now=1e9) == {"p0": 3}  # published entries do not expire
    idx.record_routed("p0", chain_keys(list(range(100, 120)), BS), now=0.0)  # in flight
    assert idx.blocks_held("p0") == 3  # only what the engine published
    idx.removed("p0", [b"h1"])
    assert idx.match(keys, now=0.0) == {"p0": 1}
    idx.removed("p0", [b"unknown"])
    # A parent never seen stored (a lost event) cannot be placed.
    assert not idx.stored("p0", [b"h9"], b"lost", tokens[:4], BS)
    # Another block size cannot be placed either.
    assert not idx.stored("p0", [b"h8"], None, tokens[:8], 8)
    idx.clear("p0")
    assert idx.match(keys, now=0.0) == {}
    assert idx.blocks_held("p0") == 0


def test_published_entries_live_beside_text_history_and_are_bounded() -> None:
    idx = index(ttl=10.0)
    idx.add_engine("p0", capacity_blocks=2)
    idx.set_precise("p0", True)
    tokens = list(range(8))
    keys = chain_keys(tokens, BS)
    assert idx.stored("p0", [b"h0", b"h1"], None, tokens, BS)
    # Text keys, which no event carries, are the routing history's, with its lifetime; the
    # published entries beside them do not expire.
    text = text_keys(["a prompt long enough for two blocks of text"], BS)
    idx.record_routed("p0", text, now=0.0, exact=False)
    assert idx.match(text, now=5.0) == {"p0": 2}
    assert idx.match(text, now=10.0) == {}
    assert idx.match(keys, now=1e9) == {"p0": 2}
    assert idx.blocks_held("p0") == 4
    # An engine that stores more than the fleet says it holds (and removes none) is bounded at
    # twice its capacity, the first stored out first.
    more = list(range(100, 112))
    assert idx.stored("p0", [b"h2", b"h3", b"h4"], None, more, BS)
    assert idx.match(keys, now=0.0) == {}
    assert idx.match(chain_keys(more, BS), now=0.0) == {"p0": 3}
    # Three blocks stored after the text was sent, of a capacity of two: its blocks are gone
    # from the engine's LRU, and its keys from the index.
    assert idx.match(text, now=1.0) == {}
    assert idx.blocks_held("p0") == 4
    idx.clear("p0")
    assert idx.blocks_held("p0") == 0
    assert idx.match(text, now=1.0) == {} and idx.match(chain_keys(more, BS), now=0.0) == {}


def test_text_keys_on_an_event_engine_go_once_its_cache_has_turned_over() -> None:
    """An engine that publishes events evicts a text prompt's blocks as any others (LRU of its
    capacity), but its BlockRemoved name token blocks, never text keys: the claim lived out
    the history's 30 minutes and drew the prompts sharing it to an engine that had lost it (a
    QA pass: 3,088 tokens predicted cached, 0 found). It goes once the engine stored its
    capacity's worth of blocks after the prompt was last sent there."""
    idx = index(ttl=1800.0)
    idx.add_engine("p0", capacity_blocks=4)
    idx.set_precise("p0", True)
    text = text_keys(["a prompt long enough for two blocks of text"], BS)
    idx.record_routed("p0", text, now=0.0, exact=False)
    assert idx.stored("p0", [b"t0", b"t1"], None, list(range(8)), BS)  # its own blocks
    assert idx.match(text, now=1.0) == {"p0": 2}
    # Sent again (a hit: the engine's LRU touches its blocks), then one other block stored.
    idx.record_routed("p0", text, now=2.0, exact=False)
    assert idx.stored("p0", [b"a0"], None, list(range(100, 104)), BS)
    assert idx.match(text, now=3.0) == {"p0": 2}
    # Three more: four stored since it was last sent, the whole capacity: gone.
    assert idx.stored("p0", [b"a1", b"a2", b"a3"], b"a0", list(range(104, 116)), BS)
    assert idx.match(text, now=4.0) == {}
    assert idx.blocks_held("p0") == 2 + 4  # published entries only (bounded at twice capacity)
    # An engine routed by history keeps its text keys for their lifetime, as before.
    idx.add_engine("h0", capacity_blocks=4)
    idx.record_routed("h0", text, now=0.0, exact=False)
    assert idx.match(text, now=1000.0) == {"h0": 2}


def test_text_keys_count_blocks_the_index_could_not_place_and_from_when_events_came() -> None:
    """The engine's LRU moves on with every block it stores, placed by the index or not (a
    parent the index never saw, after a reset); and text keys sent while the engine was
    routed by history count from when its events took over (a review of 083b358)."""
    idx = index(ttl=1800.0)
    idx.add_engine("p0", capacity_blocks=4)
    text = text_keys(["a prompt long enough for two blocks of text"], BS)
    idx.record_routed("p0", text, now=0.0, exact=False)  # routed by history: not stamped
    idx.set_precise("p0", True)
    assert idx.match(text, now=1.0) == {"p0": 2}
    # Four blocks under a parent the index never saw: not placed, but counted.
    assert not idx.stored("p0", [b"a0", b"a1", b"a2", b"a3"], b"unknown", list(range(16)), BS)
    assert idx.match(text, now=2.0) == {}


def test_prompts_in_flight_to_an_event_engine_are_held_until_it_says_or_for_their_ttl() -> None:
    idx = event_index(capacity_blocks=4)
    tokens = list(range(12))
    keys = chain_keys(tokens, BS)
    # Sent, not yet computed: held in flight, for the TTL, and not counted as published.
    idx.record_routed("p0", keys, now=0.0)
    assert idx.match(keys, now=4.9) == {"p0": 3}
    assert idx.blocks_held("p0") == 0
    assert idx.match(keys, now=5.0) == {}
    # Sent again, then the engine stored the first two blocks: those never expire, the third
    # (not published, say its request failed) lives out its TTL.
    idx.record_routed("p0", keys, now=10.0)
    assert idx.stored("p0", [b"h0", b"h1"], None, tokens[:8], BS)
    assert idx.match(keys, now=12.0) == {"p0": 3}
    assert idx.match(keys, now=100.0) == {"p0": 2}
    # A prefix another engine published, extended in flight on this one: each its own depth.
    assert idx.stored("p1", [b"g0"], None, tokens[:4], BS)
    idx.record_routed("p1", keys, now=100.0)
    assert idx.match(keys, now=101.0) == {"p0": 2, "p1": 3}
    # Bounded by twice the engine's capacity, in two generations: a full one is dropped once
    # the next one fills.
    longer = chain_keys(list(range(100, 120)), BS)
    idx.record_routed("p1", longer, now=102.0)
    assert idx.match(longer, now=102.5) == {"p1": 5}
    for n in range(3):
        idx.record_routed("p1", chain_keys([200 + n] * 8, BS), now=102.5)
    assert idx.match(keys, now=102.5) == {"p0": 2, "p1": 1}
    assert idx.match(longer, now=102.5) == {}
    # The engine's restart forgets what was in flight too.
    idx.record_routed("p1", keys, now=103.0)
    idx.clear("p1")
    assert idx.match(keys, now=103.5) == {"p0": 2}
    # A TTL of 0 turns it off: only what the engine publishes.
    off = PrefixIndex(BS, in_flight_ttl_s=0.0)
    off.add_engine("p0", 4)
    off.set_precise("p0", True)
    off.record_routed("p0", keys, now=0.0)
    assert off.match(keys, now=0.0) == {}
    with pytest.raises(ValueError):
        PrefixIndex(BS, in_flight_ttl_s=-1.0)


def test_a_failed_leg_takes_back_what_its_send_recorded_and_nothing_later() -> None:
    """Without events: the failed send's keys go from the engine's history, except those a
    later send refreshed; other engines keep theirs. With events: likewise in flight, and what
    the engine published stays."""
    idx = index()
    keys = chain_keys(list(range(20)), BS)  # 5 blocks
    other = chain_keys([*range(8), 50, 51, 52, 53], BS)  # shares the first two blocks
    idx.record_routed("p0", keys, now=1.0)
    idx.record_routed("p1", keys, now=1.0)
    idx.record_routed("p0", other, now=2.0)  # later: its first two blocks are stamped 2.0
    idx.forget_routed("p0", keys, sent_at=1.0)
    assert idx.match(keys, now=3.0) == {"p0": 2, "p1": 5}
    assert idx.match(other, now=3.0) == {"p0": 3, "p1": 2}
    # A send stamped otherwise takes back nothing; nor does an engine the index does not know.
    idx.forget_routed("p1", keys, sent_at=0.5)
    assert idx.match(keys, now=3.0) == {"p0": 2, "p1": 5}
    idx.forget_routed("nope", keys, sent_at=1.0)

    events = event_index(capacity_blocks=100)
    tokens = list(range(12))
    three = chain_keys(tokens, BS)
    assert events.stored("p0", [b"h0"], None, tokens[:4], BS)
    events.record_routed("p0", three, now=0.0)
    events.record_routed("p1", three, now=0.0)
    events.record_routed("p0", other, now=0.5)  # refreshes the first two blocks in flight
    assert events.match(three, now=1.0) == {"p0": 3, "p1": 3}
    events.forget_routed("p0", three, sent_at=0.0)
    # p0: block 0 published, block 1 still in flight for the later send; p1 untouched.
    assert events.match(three, now=1.0) == {"p0": 2, "p1": 3}
    assert events.match(other, now=1.0) == {"p0": 3, "p1": 2}
    # Text keys (which no event carries) are history on every engine: taken back as such.
    text = text_keys(["a shared system prompt" * 40], BS)
    events.record_routed("p0", text, now=0.0, exact=False)
    assert events.match(text, now=1.0) == {"p0": len(text)}
    events.forget_routed("p0", text, sent_at=0.0, exact=False)
    assert events.match(text, now=1.0) == {}


def test_salted_prompts_match_only_their_salt() -> None:
    idx = index()
    tokens = list(range(8))
    idx.set_precise("p0", True)
    assert idx.stored("p0", [1, 2], None, tokens, BS, salt="tenant-a")
    assert idx.match(chain_keys(tokens, BS, salt="tenant-a"), 0.0) == {"p0": 2}
    assert idx.match(chain_keys(tokens, BS), 0.0) == {}


def test_switching_an_engine_to_events_forgets_its_token_history_and_keeps_its_text() -> None:
    """The events say which token blocks an engine holds, so the token-id prompts' history
    goes when they start (and their entries when they stop); text and chat prompts' history,
    which no event carries and either source keeps, stays. It went too: an engine's first
    batch (and its first after every reset) sent the next turn of a chat to a cold engine."""
    idx = index()
    keys = chain_keys(list(range(8)), BS)
    text = text_keys(["a prompt long enough for two blocks of text"], BS)
    idx.record_routed("p0", keys, now=0.0)
    idx.record_routed("p0", text, now=0.0, exact=False)
    idx.set_precise("p0", True)
    assert idx.match(keys, now=1.0) == {}
    assert idx.match(text, now=1.0) == {"p0": 2}
    assert idx.is_precise("p0") and not idx.is_precise("p1")
    assert idx.stored("p0", [b"h0", b"h1"], None, list(range(8)), BS)
    # A reset (a lost stream): routed by history again, the published entries gone.
    idx.set_precise("p0", False)
    assert idx.match(keys, now=1.0) == {}
    assert idx.match(text, now=1.0) == {"p0": 2}
    assert idx.blocks_held("p0") == 2
    # What an engine holds no longer at all (AllBlocksCleared, a restart): the text too.
    idx.clear("p0")
    assert idx.match(text, now=1.0) == {} and idx.blocks_held("p0") == 0
    with pytest.raises(KeyError):
        idx.record_routed("nope", keys, now=0.0)


def test_token_and_text_history_share_the_capacity_least_recently_sent_out_first() -> None:
    idx = index(ttl=100.0)
    idx.add_engine("p0", capacity_blocks=4)
    keys = chain_keys(list(range(12)), BS)  # 3 blocks
    text = text_keys(["a prompt long enough for two blocks of text"], BS)  # 2 blocks
    idx.record_routed("p0", keys, now=0.0)
    idx.record_routed("p0", text, now=1.0, exact=False)
    assert idx.blocks_held("p0") == 4  # the token prompt's first block out
    assert idx.match(keys, now=2.0) == {} and idx.match(text, now=2.0) == {"p0": 2}
    idx.record_routed("p0", keys, now=3.0)
    assert idx.blocks_held("p0") == 4  # now the text's first block out
    assert idx.match(keys, now=4.0) == {"p0": 3} and idx.match(text, now=4.0) == {}
    # Both expire with the history's lifetime.
    assert idx.blocks_held("p0", now=1000.0) == 0


# --- BlockPool ------------------------------------------------------------------------------


def test_block_pool_hits_evicts_and_reports_events() -> None:
    pool = BlockPool(3, caching=True, record_events=True)
    tokens = list(range(8))
    keys = chain_keys(tokens, BS)
    a = pool.allocate(2)
    assert a is not None
    assert pool.cache(a, keys, tokens, BS) == [0, 1]
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == keys and stored.parent_block_hash is None
    assert stored.token_ids == tokens and stored.block_size == BS
    pool.free(a)
    assert pool.num_free == 3 and pool.num_cached == 2  # free, yet still cached
    hit = pool.cached_prefix(keys)
    assert hit == a
    b = pool.allocate(1, hit)
    assert b is not None and b[:2] == a and pool.num_free == 0
    pool.free(b)
    # Two new blocks: the free queue's head goes first. b was freed last block first, so
    # b[2] (uncached) and then a[1] (block 1 of the prompt) are taken: block 0 stays.
    c = pool.allocate(2)
    assert c is not None and set(c) == {b[2], a[1]}
    events = pool.take_events()
    assert events == [BlockRemoved([keys[1]])]
    assert pool.cached_prefix(keys) == [a[0]]
    pool.free(c)
    assert pool.clear() and pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_prefix(keys) == []


def test_block_pool_all_or_nothing_counts_reclaimed_hits() -> None:
    pool = BlockPool(3, caching=True)
    keys = chain_keys(list(range(8)), BS)
    a = pool.allocate(2)
    assert a is not None
    pool.cache(a, keys, list(range(8)), BS)
    pool.free(a)
    # Taking the two cached blocks back leaves one free block: two more do not fit.
    assert pool.allocate(2, a) is None and pool.num_free == 3
    assert pool.allocate(1, a) is not None and pool.num_free == 0
    assert pool.events == []  # nothing recorded without a publisher
    with pytest.raises(ValueError):
        pool.free([0, 0, 0, 0])


def test_block_pool_without_caching_never_hits() -> None:
    pool = BlockPool(4, caching=False)
    keys = chain_keys(list(range(8)), BS)
    a = pool.allocate(2)
    assert a is not None and pool.cache(a, keys, list(range(8)), BS) == []
    pool.free(a)
    assert pool.cached_prefix(keys) == []
