"""Prefix caches in the virtual-time simulator and the Mooncake trace reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.contract import parse_fleet
from narwhal.fleetsim.simulator import DesConfig, RequestSpec, run_des
from narwhal.fleetsim.workloads import (
    PrefixTrace,
    back_to_back,
    ideal_hit_rate,
    mooncake_requests,
    read_mooncake_trace,
    timings_of,
)
from narwhal.routing.prefix import chain_root, extend_chain
from narwhal.simengine.fleet import local_fleet_document


def _trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_rows_keys_clipping_and_ties(tmp_path: Path) -> None:
    path = _trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
            {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 9]},
            {
                "timestamp": 3000,
                "input_length": 5000,
                "output_length": 100,
                "hash_ids": list(range(10)),
            },
        ],
    )
    trace = read_mooncake_trace(path, max_model_len=2048)
    (t0, _, g0, k0), (t1, _, _, k1), (t2, p2, _, k2) = trace.rows
    # Two requests on one whole-second stamp are spread over that second, in order.
    assert (t0, t1, t2) == (0.0, 0.5, 3.0)
    # Full 512-token blocks only; equal first hash ids, equal first keys.
    assert len(k0) == 2 and len(k1) == 1 and k0[0] == k1[0]
    assert k0[1] == extend_chain(extend_chain(chain_root(), (1,)), (2,))
    # Clipped to fit the model with its output: 1,948 tokens, 3 full blocks.
    assert (p2, len(k2), trace.clipped) == (1948, 3, 1)
    # 3 requests over 3 s is 1 request/s: at half that rate, twice as far apart.
    specs = mooncake_requests(trace.rows, rate=0.5)
    assert [s.arrival for s in specs] == pytest.approx([0.0, 1.0, 6.0])
    assert specs[0].prefix == k0 and specs[0].max_tokens is None and g0 == 10


def test_ideal_hit_rate_counts_earlier_prefixes_within_capacity() -> None:
    a, b = (11, 12), (11, 13)
    rows = [(0.0, 1100, 1, a), (1.0, 1100, 1, a), (2.0, 1100, 1, b)]
    # Unbounded: the second hits 2 blocks (1,024 of 1,100), the third 1 block.
    assert ideal_hit_rate(rows, None) == pytest.approx((1024 + 512) / 3300)
    # Room for one block: the head survives (a prompt's tail is evicted first).
    assert ideal_hit_rate(rows, 512) == pytest.approx((512 + 512) / 3300)


def _fleet(prefix: bool):  # one prefill and one decode engine, 512-token blocks
    doc = local_fleet_document(
        [20000, 20001], [40000, 40001], sim={"block_size": 512}, ttft_s=10.0, tpot_s=0.3
    )
    doc["engine"]["prefix_caching"] = {"block_size": 512, "capacity_blocks": 1000}
    doc["routing"] = {"prefix": {"enabled": prefix}}
    return parse_fleet(doc, "t").contract


def test_the_simulators_engines_hit_their_caches_and_pull_only_what_they_lack() -> None:
    chain = []  # 8 blocks of one chain
    key = chain_root()
    for h in range(8):
        key = extend_chain(key, (h,))
        chain.append(key)
    specs = [RequestSpec(10.0 * i, 4096 + 100, 4, None, tuple(chain)) for i in range(3)]
    fleet = _fleet(True)
    cached = run_des(
        DesConfig(fleet, timings_of(fleet), flipping=False, prefix_cache_tokens=1_000_000),
        specs,
    )
    cold = run_des(DesConfig(fleet, timings_of(fleet), flipping=False), specs)
    assert cold.cached_tokens == 0 and cold.pulled_tokens == 3 * 4196
    # The 2nd and 3rd find the 8 blocks on both engines: prefill of 100 tokens, 100 pulled.
    assert cached.cached_tokens == 2 * 4096
    assert cached.pulled_tokens == 4196 + 2 * 100
    assert cached.hit_rate == pytest.approx(2 * 4096 / (3 * 4196))
    assert sorted(cached.ttft)[0] < sorted(cold.ttft)[0]


def test_a_prompt_is_looked_up_when_scheduled_and_cached_as_its_chunks_are() -> None:
    """As vLLM: two prompts over one new prefix arriving together on the one prefill engine
    are scheduled in one step, and the second, looked up when scheduled, hits the blocks the
    first's chunk was scheduled to compute (looked up on arrival and cached when the first's
    prefill ended, it hit nothing)."""
    chain = []
    key = chain_root()
    for h in range(8):
        key = extend_chain(key, (h,))
        chain.append(key)
    fleet = _fleet(True)
    together = [RequestSpec(0.0, 4096 + 100, 4, None, tuple(chain)) for _ in range(2)]
    result = run_des(
        DesConfig(fleet, timings_of(fleet), flipping=False, prefix_cache_tokens=1_000_000),
        together,
    )
    assert result.cached_tokens == 4096


def test_back_to_back_copies_share_prefixes_within_not_across() -> None:
    a, b = (11, 12), (11, 13)
    one = PrefixTrace([(5.0, 1100, 1, a), (6.0, 1100, 1, a), (7.0, 1100, 1, b)], clipped=1)
    three = back_to_back(one, 3)
    assert len(three.rows) == 9 and three.clipped == 3
    # Each copy starts a mean gap (1 s) after the one before ends, from the trace's start.
    assert [r[0] for r in three.rows] == [5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0]
    # Within a copy keys are equal where the trace's are; no key is shared across copies.
    copies = [three.rows[i : i + 3] for i in (0, 3, 6)]
    for rows in copies:
        assert rows[0][3] == rows[1][3] and rows[0][3][0] == rows[2][3][0]
    keys = [{k for r in rows for k in r[3]} for rows in copies]
    assert not (keys[0] & keys[1]) and not (keys[1] & keys[2]) and not (keys[0] & keys[2])
    # So an unbounded cache finds in three copies what it finds in one.
    assert ideal_hit_rate(three.rows, None) == pytest.approx(ideal_hit_rate(one.rows, None))
    assert back_to_back(one, 1) is one
