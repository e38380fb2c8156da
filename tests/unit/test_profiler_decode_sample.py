"""The profiler's decode sample: the engine's own inter-token latencies when they cover the
probe, else the client's window where every concurrent sequence decodes, and the probe run again
when a busy host kept the sequences apart; and the turns engines that share a host take."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.engines.probes import (
    DECODE_PROBE_ATTEMPTS,
    DecodeProbe,
    NoDecodeOverlapError,
    PrefillTurns,
    ProbeError,
    sample_decode,
)


def stream(first: float, tokens: int, seconds_per_token: float) -> list[float]:
    return [first + i * seconds_per_token for i in range(tokens)]


# Two sequences decoding side by side at 10 ms/token, the second starting 50 ms later.
OVERLAPPING = [stream(0.0, 64, 0.010), stream(0.05, 64, 0.010)]
# The second sequence's first token comes after the first one finished: no shared stretch.
APART = [stream(0.0, 64, 0.010), stream(1.0, 64, 0.010)]
# Both decoded together, but the engine's API server fell behind on the second: vLLM merged its
# 64 tokens into 10 chunks that reached the client at once, as the first stream ended.
LUMPED = [stream(0.0, 64, 0.010), [0.63 + i * 1e-6 for i in range(10)]]


class Probe:
    """Hands out canned probe results, one per run, and counts the runs."""

    def __init__(self, *runs: list[list[float]] | DecodeProbe) -> None:
        self.runs = [r if isinstance(r, DecodeProbe) else DecodeProbe(r) for r in runs]
        self.calls = 0

    async def __call__(self) -> DecodeProbe:
        self.calls += 1
        return self.runs.pop(0)


async def test_the_engines_own_latencies_win_over_lumpy_arrivals() -> None:
    # The client saw both streams in lumps; the engine's histogram moved by 2 x 63 gaps.
    lumps = [[0.5 + i * 1e-6 for i in range(5)], [0.5 + i * 1e-6 for i in range(7)]]
    sample = await sample_decode(Probe(DecodeProbe(lumps, (126 * 0.004, 126))), 64, 2, 64)
    assert sample.seconds_per_token == pytest.approx(0.004)
    assert sample.itl_samples == 126
    assert sample.mean_context == pytest.approx(64 + 31.5)


async def test_engine_latencies_that_do_not_match_the_probe_are_not_used() -> None:
    # Other traffic moved the histogram (400 gaps, not 126): the client's timing is used.
    sample = await sample_decode(Probe(DecodeProbe(OVERLAPPING, (400 * 0.5, 400))), 64, 2, 64)
    assert sample.seconds_per_token == pytest.approx(0.010)
    # Sequences that did not decode together are not a batch, whatever the engine counted.
    probe = Probe(DecodeProbe(APART, (126 * 0.004, 126)), OVERLAPPING)
    sample = await sample_decode(probe, 64, 2, 64)
    assert probe.calls == 2
    assert sample.seconds_per_token == pytest.approx(0.010)


async def test_overlapping_streams_give_the_shared_rate() -> None:
    probe = Probe(OVERLAPPING)
    sample = await sample_decode(probe, 64, 2, 64)
    assert probe.calls == 1
    assert sample.concurrency == 2
    assert sample.seconds_per_token == pytest.approx(0.010)
    assert sample.itl_samples > 100


async def test_streams_kept_apart_are_probed_again() -> None:
    retries: list[str] = []
    probe = Probe(APART, APART, OVERLAPPING)
    sample = await sample_decode(probe, 64, 2, 64, attempts=3, on_retry=retries.append)
    assert probe.calls == 3
    assert sample.seconds_per_token == pytest.approx(0.010)
    assert len(retries) == 2
    assert "no window where all 2 sequences decoded together" in retries[0]
    assert retries[0].endswith("probing again (2/3)") and retries[1].endswith("(3/3)")


async def test_gives_up_after_the_last_attempt() -> None:
    probe = Probe(*([APART] * DECODE_PROBE_ATTEMPTS))
    with pytest.raises(NoDecodeOverlapError, match="raise --decode-tokens"):
        await sample_decode(probe, 64, 2, 64)
    assert probe.calls == DECODE_PROBE_ATTEMPTS


async def test_a_stream_that_arrived_in_a_lump_reads_the_other_ones_rate() -> None:
    probe = Probe(LUMPED)
    sample = await sample_decode(probe, 64, 2, 64)
    assert probe.calls == 1
    assert sample.seconds_per_token == pytest.approx(0.010)
    assert sample.itl_samples == 63
    assert sample.mean_context == pytest.approx(64 + 31.5)


async def test_a_lump_long_after_the_other_stream_ended_is_no_batch() -> None:
    # The lump came a second after the first stream finished: it did not decode beside it.
    late = [stream(0.0, 64, 0.010), [1.63 + i * 1e-6 for i in range(10)]]
    probe = Probe(late, late, late)
    with pytest.raises(NoDecodeOverlapError):
        await sample_decode(probe, 64, 2, 64)
    assert probe.calls == 3


async def test_too_few_tokens_is_not_retried() -> None:
    probe = Probe([[0.0, 0.01], [0.0, 0.01]], OVERLAPPING)
    with pytest.raises(ProbeError, match="too few tokens") as failed:
        await sample_decode(probe, 64, 2, 64)
    assert not isinstance(failed.value, NoDecodeOverlapError)
    assert probe.calls == 1


def chunked_prefill(
    concurrency: int, tokens: int, prefill_s: float, decode_s: float
) -> DecodeProbe:
    """What an engine with chunked prefill streams for ``concurrency`` prompts sent at once:
    one prompt prefilled per step beside the decoding sequences (a step then takes
    ``prefill_s`` more), each prompt's first token at the end of its step; with the engine's
    inter-token latencies, which count every gap after a first token."""
    runs: list[list[float]] = [[] for _ in range(concurrency)]
    t, step = 0.0, 0
    while any(len(r) < tokens for r in runs):
        t += decode_s + (prefill_s if step < concurrency else 0.0)
        for r in runs[: min(step, concurrency)]:
            if len(r) < tokens:
                r.append(t)
        if step < concurrency:
            runs[step].append(t)
        step += 1
    itl = (sum(r[-1] - r[0] for r in runs), concurrency * (tokens - 1))
    return DecodeProbe(runs, itl)


async def test_a_probe_whose_decode_shared_its_steps_with_the_prefills_is_refused() -> None:
    # 8 prompts prefilled one a step (0.24 s each) and 16 tokens: the last first token comes
    # when the first sequence has a few tokens left, too short a window to count, and the
    # engine's mean inter-token latency is 0.129 s against the 0.073 it decodes 8 at. Refused,
    # and not run again: it would share its steps the same way.
    probe = Probe(chunked_prefill(8, 16, 0.24, 0.073), OVERLAPPING)
    itl_sum, itl_count = probe.runs[0].engine_itl or (0.0, 1)
    assert itl_sum / itl_count > 1.5 * 0.073
    with pytest.raises(ProbeError, match="shared steps with the others' prefills") as refused:
        await sample_decode(probe, 8192, 8, 16)
    assert "raise --decode-tokens" in str(refused.value)
    assert not isinstance(refused.value, NoDecodeOverlapError)
    assert probe.calls == 1
    # With 64 tokens the sequences decode together long enough to be timed alone.
    sample = await sample_decode(Probe(chunked_prefill(8, 64, 0.24, 0.073)), 8192, 8, 64)
    assert sample.seconds_per_token == pytest.approx(0.073)


async def test_lumped_streams_keep_the_engines_latencies_however_late_they_came() -> None:
    # The API server fell behind: each stream reached the client in one lump, the lumps a
    # tenth of a second apart. A lump's late first arrival is the server catching up, not a
    # prefill: the engine's own latencies are the sample.
    engine = chunked_prefill(4, 64, 0.002, 0.010)
    lumps = [[0.64 + 0.05 * i + j * 1e-6 for j in range(5)] for i in range(4)]
    sample = await sample_decode(Probe(DecodeProbe(lumps, engine.engine_itl)), 64, 4, 64)
    assert sample.seconds_per_token == pytest.approx(0.010, rel=0.02)


async def test_a_sequence_a_busy_host_admitted_late_is_probed_again_not_refused() -> None:
    # No prefill cost at all: the fourth sequence was admitted 0.4 s late and ended as late.
    # The sequences did not end together: probed again (a busy host), not refused as
    # prefill-shared.
    late = [stream(0.0, 64, 0.010) for _ in range(3)] + [stream(0.4, 64, 0.010)]
    probe = Probe(late, [stream(0.0, 64, 0.010) for _ in range(4)])
    sample = await sample_decode(probe, 64, 4, 64)
    assert probe.calls == 2
    assert sample.seconds_per_token == pytest.approx(0.010)


def test_engines_that_share_a_host_take_turns_for_their_prefills() -> None:
    """PrefillTurns: prefills on one host never overlap, hosts run at once, decode waits for
    the host's prefills, and an engine that failed before its prefills holds up no other."""
    hosts = {"a0": "a", "a1": "a", "a2": "a", "b0": "b"}
    turns = PrefillTurns(hosts)
    log: list[str] = []
    inside: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}

    async def engine(engine_id: str) -> None:
        host = hosts[engine_id]
        try:
            if engine_id == "a2":
                return  # failed before its prefills
            async with turns.prefills(engine_id):
                inside[host] += 1
                most[host] = max(most[host], inside[host])
                await asyncio.sleep(0.01)
                inside[host] -= 1
                log.append(f"prefilled {engine_id}")
            await turns.host_prefilled(engine_id)
            log.append(f"decode {engine_id}")
        finally:
            turns.done(engine_id)

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(engine(e) for e in hosts)), 5)

    asyncio.run(main())
    assert most == {"a": 1, "b": 1}
    # b's engine did not wait for host a; a's engines decode only after both a prefills.
    assert log.index("decode b0") < log.index("prefilled a1")
    assert log.index("decode a0") > log.index("prefilled a1")
