"""The profiler's decode sample: the window where every concurrent sequence decodes, and the
probe run again when a busy host kept the sequences apart."""

from __future__ import annotations

import pytest

from narwhal.profiler.runner import (
    DECODE_PROBE_ATTEMPTS,
    EngineProfilingError,
    NoDecodeOverlapError,
    sample_decode,
)


def stream(first: float, tokens: int, seconds_per_token: float) -> list[float]:
    return [first + i * seconds_per_token for i in range(tokens)]


# Two sequences decoding side by side at 10 ms/token, the second starting 50 ms later.
OVERLAPPING = [stream(0.0, 64, 0.010), stream(0.05, 64, 0.010)]
# The second sequence's first token comes after the first one finished: no shared stretch.
APART = [stream(0.0, 64, 0.010), stream(1.0, 64, 0.010)]


class Probe:
    """Hands out canned arrival times, one set per run, and counts the runs."""

    def __init__(self, *runs: list[list[float]]) -> None:
        self.runs = list(runs)
        self.calls = 0

    async def __call__(self) -> list[list[float]]:
        self.calls += 1
        return self.runs.pop(0)


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


async def test_too_few_tokens_is_not_retried() -> None:
    probe = Probe([[0.0, 0.01], [0.0, 0.01]], OVERLAPPING)
    with pytest.raises(EngineProfilingError, match="too few tokens") as failed:
        await sample_decode(probe, 64, 2, 64)
    assert not isinstance(failed.value, NoDecodeOverlapError)
    assert probe.calls == 1
