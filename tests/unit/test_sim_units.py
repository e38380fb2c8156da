"""Pure unit tests of the simulated engine's building blocks: vocabulary, generation, KV layout,
step timing, block accounting, request parsing and kv_transfer_params parsing."""

from __future__ import annotations

import asyncio
import random
import socket
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.contract import SimulatedEngineSettings
from narwhal.routing.prefix import chain_keys
from narwhal.simengine.engine import (
    EngineConfig,
    EngineCore,
    RemoteKV,
    RequestKind,
    SimRequest,
    TokenEvent,
    parse_kv_transfer_params,
)
from narwhal.simengine.faults import FaultSettings
from narwhal.simengine.generation import ContextChain, GenerationModel, KVLayout
from narwhal.simengine.kv_blocks import BlockPool
from narwhal.simengine.kv_transfer import KVTransferAgent
from narwhal.simengine.metrics import EngineMetrics
from narwhal.simengine.protocol import ProtocolError, parse_generation
from narwhal.simengine.side_channel import PeerDirectory
from narwhal.simengine.timing import CALIBRATION, sim_models
from narwhal.simengine.vocab import EOS, IM_END, IM_START, NUM_BYTE_TOKENS, Vocabulary
from narwhal.testing.ports import ephemeral_range_start, free_ports

VOCAB = Vocabulary()

# --- Vocabulary ----------------------------------------------------------------------------


def test_generated_words_round_trip() -> None:
    model = GenerationModel(VOCAB)
    ids = model.generate([1, 2, 3], 200)
    assert len(ids) == 200
    text = VOCAB.decode(ids)
    assert VOCAB.encode(text) == ids
    assert all(VOCAB.first_word_id <= t < VOCAB.im_start_id for t in ids)
    # Every generated piece is " " plus four letters: text reads as words.
    assert text == "".join(VOCAB.token_text(t) for t in ids)
    assert all(len(VOCAB.token_text(t)) == 5 and VOCAB.token_text(t)[0] == " " for t in ids)


def test_every_word_round_trips() -> None:
    ids = list(range(VOCAB.first_word_id, VOCAB.im_start_id))
    assert len(ids) == VOCAB.num_words
    assert VOCAB.encode(VOCAB.decode(ids)) == ids


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld",
        "日本語のテキスト",
        "emoji 🐋🐳 and ZWJ 👩‍💻",
        "tabs\tand\nnewlines\r\n",
        " aaaa",
    ],
)
def test_arbitrary_utf8_falls_back_to_bytes(text: str) -> None:
    ids = VOCAB.encode(text)
    assert VOCAB.decode(ids) == text
    # Non-ASCII characters can only be byte tokens.
    assert set(text.encode("utf-8")) - set(range(128)) <= set(ids)
    # " aaaa" is not a word (words alternate consonant and vowel): plain bytes.
    if text == " aaaa":
        assert ids == list(b" aaaa")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",))))
def test_any_text_round_trips(text: str) -> None:
    for special in (IM_START, IM_END, EOS):
        text = text.replace(special, "")
    ids = VOCAB.encode(text)
    assert VOCAB.check_ids(ids) is None
    assert VOCAB.decode(ids) == text


def test_special_tokens() -> None:
    v = VOCAB
    assert v.im_start_id == NUM_BYTE_TOKENS + v.num_words
    assert (v.im_end_id, v.eos_id, v.size) == (v.im_start_id + 1, v.im_start_id + 2, v.eos_id + 1)
    ids = v.encode(f"{IM_START}user\nhi{IM_END}\n{EOS}")
    assert ids == [v.im_start_id, *b"user\nhi", v.im_end_id, *b"\n", v.eos_id]
    # EOS has no text; the chat markers decode to themselves.
    assert v.decode(ids) == f"{IM_START}user\nhi{IM_END}\n"
    assert v.token_text(v.eos_id) == ""
    assert v.check_ids([0, v.eos_id]) is None
    assert v.check_ids([0, v.size]) == v.size
    assert v.check_ids([-1]) == -1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        v.token_text(v.size)


def test_vocab_seed_permutes_word_ids() -> None:
    other = Vocabulary(seed=7)
    text = " kalo mira tuse"
    assert VOCAB.encode(text) != other.encode(text)
    assert VOCAB.decode(VOCAB.encode(text)) == other.decode(other.encode(text)) == text
    assert Vocabulary(seed=7).encode(text) == other.encode(text)
    assert other.size == VOCAB.size and set(other.words) == set(VOCAB.words)
    # Bytes and special tokens keep their ids.
    assert other.encode("é<|eos|>") == VOCAB.encode("é<|eos|>")


# --- GenerationModel ------------------------------------------------------------------------


def test_generation_is_deterministic() -> None:
    prompt = [5, 300, 301, 302]
    a, b = GenerationModel(VOCAB), GenerationModel(Vocabulary())
    assert a.generate(prompt, 50) == b.generate(list(prompt), 50)
    assert ContextChain(0, prompt).key() == ContextChain(0, tuple(prompt)).key()
    # Position matters.
    assert len(set(a.generate(prompt, 50))) > 40


def test_model_seed_and_prompt_change_tokens() -> None:
    model = GenerationModel(VOCAB)
    prompt = [5, 300, 301, 302]
    base = model.generate(prompt, 20)
    other_seed = GenerationModel(VOCAB, model_seed=1).generate(prompt, 20)
    other_prompt = model.generate([*prompt[:-1], 303], 20)
    assert base != other_seed
    assert base != other_prompt


def test_eos_probability() -> None:
    chain = ContextChain(0, [1, 2])
    keys = []
    for k in range(2000):
        keys.append(chain.key())
        chain.append(VOCAB.first_word_id + k)
    never = GenerationModel(VOCAB, eos_prob=0.0)
    always = GenerationModel(VOCAB, eos_prob=1.0)
    assert all(never.token_at(key) != VOCAB.eos_id for key in keys[:500])
    assert all(always.token_at(key) == VOCAB.eos_id for key in keys[:50])
    some = GenerationModel(VOCAB, eos_prob=0.2)
    hits = sum(some.token_at(key) == VOCAB.eos_id for key in keys)
    assert 250 < hits < 550
    # With EOS masked (min_tokens, ignore_eos) the model writes the word it would have.
    assert all(some.token_at(key) in (VOCAB.eos_id, some.word_at(key)) for key in keys)
    assert all(never.token_at(key) == never.word_at(key) for key in keys)


# --- KVLayout ------------------------------------------------------------------------------


LAYOUT = KVLayout(model_seed=0, block_size=16, block_bytes=1024)


def test_block_contents_shape() -> None:
    tokens = list(range(300, 383))  # 83 tokens: 6 blocks, the last one partial
    blocks = LAYOUT.block_contents(tokens)
    assert blocks.shape == (6, 1024) and blocks.dtype == np.uint8
    assert LAYOUT.num_blocks(83) == 6 and LAYOUT.num_blocks(96) == 6 and LAYOUT.num_blocks(97) == 7
    assert LAYOUT.block_contents([]).shape == (0, 1024)
    # Distinct blocks are distinct bytes.
    assert len({bytes(row) for row in blocks}) == 6
    with pytest.raises(ValueError, match="multiple of 64"):
        KVLayout(0, 16, 1000)


def test_block_i_depends_only_on_its_prefix() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(VOCAB.size) for _ in range(5 * 16 + 3)]
    full = LAYOUT.block_contents(tokens)
    for i in range(len(full)):
        prefix = LAYOUT.block_contents(tokens[: (i + 1) * 16])
        assert np.array_equal(prefix, full[: i + 1])
        if (i + 1) * 16 <= len(tokens):
            # Whatever follows a full block does not change it.
            tail = [rng.randrange(VOCAB.size) for _ in range(40)]
            extended = LAYOUT.block_contents(tokens[: (i + 1) * 16] + tail)
            assert np.array_equal(extended[: i + 1], full[: i + 1])


@pytest.mark.parametrize("j", [0, 2, 5])
def test_changing_a_token_changes_its_block_and_later_ones(j: int) -> None:
    tokens = list(range(300, 383))
    full = LAYOUT.block_contents(tokens)
    changed = list(tokens)
    changed[j * 16 + 1] += 1
    after = LAYOUT.block_contents(changed)
    for i in range(len(full)):
        assert np.array_equal(after[i], full[i]) == (i < j), i


def test_model_seed_changes_kv() -> None:
    tokens = list(range(300, 340))
    other = KVLayout(model_seed=1, block_size=16, block_bytes=1024)
    a, b = LAYOUT.block_contents(tokens), other.block_contents(tokens)
    assert all(not np.array_equal(a[i], b[i]) for i in range(len(a)))


def test_chains_extend_a_parent_and_write_tiles_what_block_contents_gives() -> None:
    tokens = list(range(300, 383))  # 6 blocks, the last one partial
    chains = LAYOUT.chains(tokens)
    assert len(chains) == 6 and LAYOUT.chains(tokens, 2, 4) == chains[2:4]
    assert LAYOUT.chains(tokens, 2, parent=chains[1]) == chains[2:]  # no hashing from block 0
    full = LAYOUT.block_contents(tokens)
    pool = np.zeros((9, 1024), np.uint8)
    LAYOUT.write(pool, [7, 1], [chains[4], chains[0]])
    assert np.array_equal(pool[7], full[4]) and np.array_equal(pool[1], full[0])
    assert not pool[[0, 2, 3, 4, 5, 6, 8]].any()
    with pytest.raises(ValueError, match="C-contiguous"):
        LAYOUT.write(np.zeros((1024, 9), np.uint8).T, [0], chains[:1])


# --- EngineCore: the KV it writes ------------------------------------------------------------


def _core() -> EngineCore:
    config = EngineConfig(
        "e0", "m", num_blocks=64, block_bytes=1024, timing=replace(CALIBRATION, time_scale=1e6)
    )
    pool = np.zeros((config.num_blocks, config.block_bytes), np.uint8)
    agent = KVTransferAgent("a", pool, lambda message: None)
    generation = GenerationModel(VOCAB, config.model_seed)
    metrics = EngineMetrics("m", "0")
    return EngineCore(config, generation, metrics, FaultSettings(), agent, PeerDirectory())


async def _served(core: EngineCore, prompt: list[int], kind: RequestKind, max_tokens: int) -> Any:
    """Run a request to its end: (the request, its last token event)."""
    request = SimRequest(core.new_request_id("r"), prompt, max_tokens, ignore_eos=True, kind=kind)
    core.submit(request)
    while True:
        event = await asyncio.wait_for(request.events.get(), 10)
        assert isinstance(event, TokenEvent)
        if event.finish_reason is not None:
            return request, event


async def test_the_kv_written_is_the_prompts_whether_its_prefix_was_cached_or_not() -> None:
    """Only the blocks that need it are written (those cached, and a prefill leg's every block
    it did not hit), each on from the chain of the block before: the bytes a reader pulls, and
    those a later prompt hits, are the prompt's KV all the same."""
    warm, cold = _core(), _core()
    warm.start()
    cold.start()
    try:
        shared = [300 + (i * 37) % 9000 for i in range(160)]  # 10 blocks
        first = [*shared, 7000, 7001, 7002, 7003, 7004]
        answered, _ = await _served(warm, first, RequestKind.LOCAL, 40)
        # The answer completed 2 more blocks (204 tokens with KV), cached with their contents.
        tokens = first + answered.output[:-1]
        blocks = warm.allocator.cached_prefix(chain_keys(tokens, 16))
        assert len(blocks) == 12
        assert np.array_equal(warm.pool[blocks], LAYOUT.block_contents(tokens)[:12])
        # A conversation's next turn, as a prefill leg: it hits all 12, a cold engine none.
        turn = tokens + list(range(8000, 8020))
        expected = LAYOUT.block_contents(turn)
        for core, hit in ((warm, 192), (cold, 0)):
            request, last = await _served(core, turn, RequestKind.PRODUCER, 1)
            assert request.num_cached_tokens == hit
            held = last.kv_transfer_params["remote_block_ids"][0]
            assert np.array_equal(core.pool[held], expected)
        # Another tail on the shared prefix: it hits the 10 blocks the first prompt cached.
        other = shared + list(range(9000, 9033))
        request, last = await _served(warm, other, RequestKind.PRODUCER, 1)
        assert request.num_cached_tokens == 160
        held = last.kv_transfer_params["remote_block_ids"][0]
        assert np.array_equal(warm.pool[held], LAYOUT.block_contents(other))
    finally:
        await warm.close()
        await cold.close()


def _stepping_core(max_num_batched_tokens: int) -> EngineCore:
    """A started engine core whose steps take real (halved) time, ``max_num_batched_tokens``
    a step."""
    config = EngineConfig(
        "e0",
        "m",
        num_blocks=64,
        block_bytes=1024,
        max_num_batched_tokens=max_num_batched_tokens,
        timing=replace(CALIBRATION, time_scale=0.5),
    )
    pool = np.zeros((config.num_blocks, config.block_bytes), np.uint8)
    core = EngineCore(
        config,
        GenerationModel(VOCAB, config.model_seed),
        EngineMetrics("m", "0"),
        FaultSettings(),
        KVTransferAgent("a", pool, lambda message: None),
        PeerDirectory(),
    )
    core.start()
    return core


async def _last_event(request: SimRequest) -> Any:
    """Wait for the request's last token event."""
    while True:
        event = await asyncio.wait_for(request.events.get(), 10)
        if event.finish_reason is not None:
            return event


async def test_a_chunk_is_cached_when_scheduled_as_vllm_caches_it() -> None:
    """vLLM caches a chunk's full blocks when it schedules it (``allocate_slots``), not when
    the prompt is done: a request sharing the prefix that is admitted while the first still
    prefills hits what was scheduled, and the KV both hand over is the prompt's."""
    core = _stepping_core(64)  # 4 blocks a step: the prompt takes 4 steps
    try:
        shared = [300 + (i * 37) % 9000 for i in range(240)]  # 15 blocks
        first = [*shared, 7000, 7001]
        second = [*shared, 8000, 8001]
        r1 = SimRequest(core.new_request_id("r"), first, 1, kind=RequestKind.PRODUCER)
        core.submit(r1)
        for _ in range(1000):
            if r1.computed > 0:
                break
            await asyncio.sleep(0.001)
        assert 0 < r1.computed < len(first)
        r2 = SimRequest(core.new_request_id("r"), second, 1, kind=RequestKind.PRODUCER)
        core.submit(r2)
        ends = [await _last_event(r) for r in (r1, r2)]
        # Admitted after the first chunk ran (and a second was scheduled): at least 4 blocks hit.
        assert r2.num_cached_tokens >= 64
        for prompt, end in zip((first, second), ends, strict=True):
            held = end.kv_transfer_params["remote_block_ids"][0]
            assert np.array_equal(core.pool[held], LAYOUT.block_contents(prompt))
    finally:
        await core.close()


@pytest.mark.parametrize("step_tokens", [64, 1024])
async def test_a_prompt_scheduled_after_another_hits_its_blocks_even_in_the_same_step(
    step_tokens: int,
) -> None:
    """vLLM looks a waiting request up when it schedules it, after the chunks scheduled
    before it in the same ``schedule()`` were cached: two prompts sharing a prefix that arrive
    together share it, whether both fit one step (1,024 tokens) or the second waits for
    tokens while the first's chunks take them all (64). Admitting both before scheduling
    either, the second hit nothing."""
    core = _stepping_core(step_tokens)
    try:
        shared = [300 + (i * 37) % 9000 for i in range(240)]  # 15 blocks
        prompts = ([*shared, 7000, 7001], [*shared, 8000, 8001])
        requests = [
            SimRequest(core.new_request_id("r"), p, 1, kind=RequestKind.PRODUCER) for p in prompts
        ]
        for request in requests:  # before the step loop first runs: both wait together
            core.submit(request)
        ends = [await _last_event(r) for r in requests]
        assert [r.num_cached_tokens for r in requests] == [0, 240]
        for prompt, end in zip(prompts, ends, strict=True):
            held = end.kv_transfer_params["remote_block_ids"][0]
            assert np.array_equal(core.pool[held], LAYOUT.block_contents(prompt))
    finally:
        await core.close()


# --- Step timing (the latency model) --------------------------------------------------------


def test_timing_calibration() -> None:
    p, d = CALIBRATION.prefill, CALIBRATION.decode
    assert p.chunk_seconds(0, 8192) == pytest.approx(0.92, rel=0.01)
    assert d.seconds_per_token(1, 512) == pytest.approx(0.2416, abs=0.0005)
    assert d.seconds_per_token(1, 8192) == pytest.approx(0.2426, abs=0.0005)
    assert p.chunk_seconds(0, 0) == 0.0 and p.chunk_seconds(100, 0) == 0.0
    assert d.seconds_per_token(8, 512) > d.seconds_per_token(1, 512)


def test_the_sim_block_defaults_are_the_calibration() -> None:
    # The fleet file's sim block (floor 1) cannot import the constant: it repeats its numbers.
    assert sim_models(SimulatedEngineSettings()) == CALIBRATION
    assert sim_models(None) is CALIBRATION


def test_the_sim_block_converts_every_timing_knob() -> None:
    sim = SimulatedEngineSettings(
        time_scale=7.0,
        slowdown=1.5,
        prefill_a=0.1,
        prefill_b=0.2,
        prefill_c=0.3,
        decode_intercept=0.4,
        decode_slope=0.5,
        decode_ctx_coef=0.6,
    )
    m = sim_models(sim)
    assert (m.prefill.a, m.prefill.b, m.prefill.c) == (0.1, 0.2, 0.3)
    assert (m.decode.intercept, m.decode.slope, m.decode.ctx_coef) == (0.4, 0.5, 0.6)
    assert (m.time_scale, m.slowdown) == (7.0, 1.5)


@pytest.mark.parametrize("chunks", [[8192], [4096, 4096], [1000, 3000, 4192], [1] * 7 + [8185]])
def test_prefill_chunks_add_up_to_the_whole(chunks: list[int]) -> None:
    # The engine charges prefill.a once per step and the rest per chunk.
    p = CALIBRATION.prefill
    offset, total = 0, p.a
    for n in chunks:
        total += p.chunk_seconds(offset, n) - p.a
        offset += n
    assert total == pytest.approx(p.chunk_seconds(0, offset), rel=1e-12)
    assert total == pytest.approx(p.seconds(offset), rel=1e-12)


def test_wall_time_scales() -> None:
    fast = sim_models(SimulatedEngineSettings(time_scale=50))
    assert fast.wall(1.0) == pytest.approx(0.02)
    assert sim_models(SimulatedEngineSettings(time_scale=50, slowdown=10)).wall(1.0) == (
        pytest.approx(0.2)
    )


def test_in_wall_seconds_is_what_a_profile_would_fit() -> None:
    m = sim_models(SimulatedEngineSettings(time_scale=50, slowdown=10))
    w = m.in_wall_seconds()
    assert (w.time_scale, w.slowdown) == (1.0, 1.0)
    for n in (1, 700, 8192):
        assert w.prefill.seconds(n) == pytest.approx(m.wall(m.prefill.seconds(n)), rel=1e-12)
    assert w.decode.seconds_per_token(8, 4096) == pytest.approx(
        m.wall(m.decode.seconds_per_token(8, 4096)), rel=1e-12
    )
    # The ranges are the calibration's: where predictions are flagged as extrapolated.
    assert (w.prefill.min_tokens, w.prefill.max_tokens) == (1, 8192)
    assert (w.decode.max_batch, w.decode.max_context) == (64, 16384)


def test_the_engines_cost_is_never_clamped() -> None:
    # Predictions far beyond the profiled range follow the tangent; an engine's step does not.
    p = CALIBRATION.prefill
    n = 10 * p.max_tokens
    assert p.predict(n).clamped and p.predict(n).seconds < p.chunk_seconds(0, n)
    assert p.chunk_seconds(0, n) == pytest.approx(p.a + p.b * n + p.c * n * n, rel=1e-12)


# --- BlockPool (allocation) ----------------------------------------------------------------


def test_block_allocator() -> None:
    alloc = BlockPool(10, caching=False)
    assert (alloc.num_free, alloc.usage) == (10, 0.0)
    a = alloc.allocate(4)
    b = alloc.allocate(6)
    assert a is not None and b is not None
    assert sorted(a + b) == list(range(10))
    assert (alloc.num_free, alloc.usage) == (0, 1.0)
    assert alloc.allocate(1) is None
    assert alloc.allocate(0) == []
    alloc.free(a)
    assert alloc.num_free == 4 and alloc.usage == pytest.approx(0.6)
    # All or nothing: a request that does not fit takes no block.
    assert alloc.allocate(5) is None
    assert alloc.num_free == 4
    c = alloc.allocate(4)
    assert c is not None and sorted(c) == sorted(a)
    with pytest.raises(ValueError):
        BlockPool(0)


# --- protocol.parse_generation -------------------------------------------------------------


def parse(body: dict[str, Any], chat: bool = False, max_model_len: int = 1024) -> Any:
    return parse_generation(body, VOCAB, chat, max_model_len)


def parse_error(body: Any, chat: bool = False, max_model_len: int = 1024) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_generation(body, VOCAB, chat, max_model_len)
    assert info.value.status == 400
    return info.value


def test_parse_generation_valid() -> None:
    p = parse({"prompt": "hello world", "max_tokens": 5, "temperature": 0.7, "seed": 3})
    assert p.prompt == VOCAB.encode("hello world") and p.max_tokens == 5 and not p.stream
    assert parse({"prompt": [300, 301]}).max_tokens == 16  # the completions default
    chat = parse({"messages": [{"role": "user", "content": "hi"}]}, chat=True, max_model_len=100)
    assert chat.max_tokens == 100 - len(chat.prompt)  # chat defaults to the rest of the context
    s = parse({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert s.stream and s.include_usage
    assert parse({"prompt": ["batch of one"]}).prompt == VOCAB.encode("batch of one")
    # Token ids as vLLM 0.32's lax list[int] reads them: true is 1, 300.0 and "301" are 300, 301.
    for prompt in ([300.0, "301", True], [[300.0, "301", True]], ["300", 301, 1]):
        ids = parse({"prompt": prompt}).prompt
        assert ids == [300, 301, 1] and all(type(t) is int for t in ids)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "n": 2, "temperature": 0}, None, "greedy sampling"),
        ({"prompt": "x", "best_of": 2}, "best_of", "best_of"),
        ({"prompt": "x", "echo": True}, "echo", "echo"),
        ({"prompt": [300, VOCAB.size]}, "prompt", f"Token id {VOCAB.size} is out of vocabulary"),
        ({"prompt": [300, -1]}, "prompt", "out of vocabulary"),
        ({"prompt": [300, 301.5]}, "prompt", "list of token ids"),
        ({"prompt": [300, -1.0]}, "prompt", "list of token ids"),
        ({"prompt": [300.0, VOCAB.size]}, "prompt", "out of vocabulary"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, None, "max_tokens=4, got 5"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"prompt": "x", "max_tokens": "five"}, "max_tokens", "integer"),
        ({"prompt": ["a", "b"]}, "prompt", "batched"),
        ({"prompt": []}, None, "You must pass at least one prompt"),
        ({"prompt": ""}, "prompt", "Either prompt or prompt_embeds must be provided"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "only supported for models with FIM"),
        ({"prompt": [300], "suffix": "y"}, "suffix", "requires text prompt input"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": "maybe"}},
            "include_usage",
            "boolean",
        ),
    ],
)
def test_parse_generation_errors(body: dict[str, Any], param: str | None, words: str) -> None:
    err = parse_error(body)
    assert err.param == param
    assert words in err.message


def test_the_context_length_as_vllm_032_applies_it() -> None:
    # Probed on vLLM 0.32: a prompt past the context is refused (input_tokens), one that fills
    # it leaves max_tokens 0 (refused), a max_tokens past the context is refused whatever the
    # prompt, and a max_tokens past what the prompt leaves is cut to it.
    err = parse_error({"prompt": [300] * 100, "max_tokens": 1}, max_model_len=64)
    assert "maximum context length is 64 tokens" in err.message
    assert "your prompt contains 100 input tokens" in err.message  # ids: counted
    assert err.param == "input_tokens"
    err = parse_error({"prompt": "word " * 100, "max_tokens": 1}, max_model_len=64)
    assert "your prompt contains at least 65 input tokens" in err.message  # text: cut at 65
    err = parse_error({"prompt": [300] * 64, "max_tokens": 1}, max_model_len=64)
    assert err.param == "max_tokens" and "at least 1, got 0" in err.message
    err = parse_error({"prompt": [300] * 2, "max_tokens": 65}, max_model_len=64)
    assert err.param == "max_tokens" and "cannot be greater than max_model_len=64" in err.message
    cut = parse_generation({"prompt": [300] * 60, "max_tokens": 10}, VOCAB, False, 64)
    assert cut.max_tokens == 4
    err = parse_error({"prompt": [300] * 60, "max_tokens": 10, "min_tokens": 5}, max_model_len=64)
    assert "min_tokens must be less than or equal to max_tokens=4, got 5." in err.message


def test_chat_errors() -> None:
    empty = parse_error({"messages": []}, chat=True)
    assert empty.param is None and "empty conversation" in empty.message
    bad_part = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert parse_error(bad_part, chat=True).param == "messages"
    too_few = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2}
    assert "max_tokens=2, got 3" in parse_error({**too_few, "min_tokens": 3}, chat=True).message
    # vLLM 0.32 has no min_completion_tokens: ignored, as vLLM ignores unknown fields.
    parse({**too_few, "min_completion_tokens": 3}, chat=True)
    # The cap names the field it came from.
    err = parse_error({**too_few, "max_completion_tokens": 10**6}, chat=True)
    assert err.param == "max_completion_tokens"
    assert err.message.startswith("max_completion_tokens=1000000 cannot be greater")
    assert parse_error("not an object").param is None


# --- engine.parse_kv_transfer_params -------------------------------------------------------


VALID_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [4, 5, 6],
    "remote_engine_id": "e0",
    "remote_request_id": "req-1-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 8,
}


def test_kv_params_valid() -> None:
    remote, why = parse_kv_transfer_params(VALID_PARAMS)
    assert why is None
    assert remote == RemoteKV("e0", (4, 5, 6), "req-1-0", "127.0.0.1", 5600)


def test_kv_params_nested_block_list() -> None:
    remote, why = parse_kv_transfer_params({**VALID_PARAMS, "remote_block_ids": [[7, 8]]})
    assert why is None and remote is not None and remote.block_ids == (7, 8)
    # Two KV cache groups: the simulator has one, so this is unusable.
    remote, why = parse_kv_transfer_params({**VALID_PARAMS, "remote_block_ids": [[7], [8]]})
    assert remote is None and "remote_block_ids" in (why or "")


@pytest.mark.parametrize(
    "key",
    ["remote_engine_id", "remote_block_ids", "remote_request_id", "remote_host", "remote_port"],
)
def test_kv_params_missing_key(key: str) -> None:
    params = {k: v for k, v in VALID_PARAMS.items() if k != key}
    remote, why = parse_kv_transfer_params(params)
    assert remote is None and why == f"missing {key}"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"do_remote_prefill": False}, "do_remote_prefill"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
        ({"remote_engine_id": None}, "strings"),
        ({"remote_host": 1}, "strings"),
        ({"remote_port": 0}, "TCP port"),
        ({"remote_port": 70000}, "TCP port"),
        ({"remote_port": True}, "TCP port"),
        ({"remote_port": "5600"}, "TCP port"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"remote_block_ids": [1, True]}, "remote_block_ids"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"remote_block_ids": None}, "remote_block_ids"),
    ],
)
def test_kv_params_invalid(change: dict[str, Any], words: str) -> None:
    remote, why = parse_kv_transfer_params({**VALID_PARAMS, **change})
    assert remote is None and why is not None and words in why


def test_kv_params_not_an_object() -> None:
    assert parse_kv_transfer_params(None) == (None, "kv_transfer_params is not an object")
    assert parse_kv_transfer_params([VALID_PARAMS])[0] is None


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(p < ephemeral_range_start() for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_of_two_xdist_workers_never_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pytest-xdist each worker draws from its own slice of the range: a port one worker
    promised a process that has not bound it yet is never promised by the other."""
    drawn: dict[str, set[int]] = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        drawn[worker] = {p for _ in range(20) for p in free_ports(10)}
    middle = 10_000 + (ephemeral_range_start() - 10_000) // 2
    assert max(drawn["gw0"]) < middle <= min(drawn["gw1"])
    assert all(p < ephemeral_range_start() for p in drawn["gw1"])
    # Nor ever the shipped local-sim configuration's fixed ports (tests/qualify binds them).
    assert not {p for ports in drawn.values() for p in ports} & set(range(18_000, 18_400))


def test_stream_options_and_an_unused_max_tokens_are_read_as_vllm_032_reads_them() -> None:
    """``include_usage: "false"`` is false to vLLM's bool field (it was true here), and a
    chat's ``max_tokens: 0`` beside ``max_completion_tokens`` is not the limit vLLM uses."""
    streamed = {"prompt": "x", "stream": True, "stream_options": {"include_usage": "false"}}
    assert not parse_generation(streamed, VOCAB, False, 1024).include_usage
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2}
    assert parse_generation({**chat, "max_tokens": 0}, VOCAB, True, 1024).max_tokens == 2
