"""narwhal-fleetsim's bad input: a usage error naming the flag or the trace's row, never a
traceback and never a run of nonsense (a rate of 0 divided by zero; a negative patience
abandoned every request before it arrived)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from narwhal.fleetsim.cli import main as fleetsim_main
from narwhal.fleetsim.simulator import DesConfig
from narwhal.fleetsim.workloads import read_azure_trace, synthetic_fleet

BASE = ["--engines", "1:1", "--requests", "5"]
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--rate", "0", "must be greater than 0, got 0"),
        ("--rate", "-1", "must be greater than 0, got -1"),
        ("--rate", "fast", "expected a number, got 'fast'"),
        ("--rate-scale", "0", "must be greater than 0"),
        ("--requests", "-5", "must be greater than 0, got -5"),
        ("--requests", "2.5", "expected an integer, got '2.5'"),
        ("--rate", "nan", "must be greater than 0, got nan"),
        ("--prompt-tokens", "0", "must be greater than 0"),
        ("--output-tokens", "0", "must be greater than 0"),
        ("--abandon-after-s", "0", "must be greater than 0, got 0"),
        ("--abandon-after-s", "-1", "must be greater than 0, got -1"),
    ],
)
def test_a_number_out_of_range_is_a_usage_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        fleetsim_main([*BASE, flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {says}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("a,b\n1,2\n", "not an Azure LLM inference trace: no TIMESTAMP, ContextTokens,"
         " GeneratedTokens columns (columns: a, b)"),
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,374\n", "no GeneratedTokens column "),
        (HEADER + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0,abc,5\n",
         "line 3: ContextTokens 'abc' is not a whole number of tokens"),
        (HEADER + "2023-11-16 18:15:46.6805900,374,44\nyesterday,3,5\n",
         "line 3: TIMESTAMP 'yesterday' is not a date and time"),
        # Python's own words alone ('month must be in 1..12') named no field.
        (HEADER + "2023-13-01 00:00:00,3,5\n",
         "line 2: TIMESTAMP '2023-13-01 00:00:00' is not a date and time"),
        (HEADER + "2023-11-16 18:15:46.6805900,374\n",
         "line 2: no GeneratedTokens (the row has fewer fields than the header)"),
        (HEADER + "2023-11-16 18:15:46.6805900,,4\n", "line 2: ContextTokens '' is not a whole"),
        (HEADER + "2023-11-16 18:15:46.68,-374,44\n", "line 2: ContextTokens -374 is negative"),
        (HEADER + "2023-11-16 18:15:46.6805900,374,-1\n", "line 2: GeneratedTokens -1 is negative"),
        (HEADER, "no requests in it"),
        # The offset is applied: 12:00 at -05:00 is after 16:00 at +00:00.
        (HEADER + "2023-11-16 16:00:00.5+00:00,374,44\n2023-11-16 12:00:00.1-05:00,3,5\n"
         "2023-11-16 16:00:00.2Z,3,5\n", "line 4: TIMESTAMP 2023-11-16 16:00:00.2Z is before"),
        # Out of time order (replayed in file order, it would arrive before its time).
        (HEADER + "2023-11-16 18:15:46.6,374,44\n2023-11-16 18:15:47.0,3,5\n"
         "2023-11-16 18:15:46.9,3,5\n", "line 4: TIMESTAMP 2023-11-16 18:15:46.9 is before"),
    ],
)  # fmt: skip
def test_a_trace_that_is_not_one_is_named_with_its_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, says: str
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(content)
    assert fleetsim_main([*BASE, "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"narwhal-fleetsim: --trace {trace}")
    assert says in err
    assert "Traceback" not in err


def test_a_trace_that_is_not_text_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_bytes(HEADER.encode() + b"2023-11-16 18:15:46.68,\xff\xfe,44\n")
    assert fleetsim_main([*BASE, "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"--trace {trace}: not a readable CSV file: 'utf-8' codec can't decode" in err


def test_a_trace_that_cannot_be_read_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "absent.csv"
    assert fleetsim_main([*BASE, "--trace", str(missing)]) == 2
    assert f"--trace {missing}: cannot read: No such file or directory" in capsys.readouterr().err


def test_a_good_trace_reads_as_before(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        HEADER + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.1805900,9000,0\n"
    )
    rows = read_azure_trace(trace, max_prompt=8192)
    assert rows == [(0.0, 374, 44), (pytest.approx(0.5), 8192, 1)]


def test_the_simulator_refuses_a_patience_that_is_not_positive() -> None:
    fleet, timings = synthetic_fleet(1, 1, {"ttft_s": 10.0, "tpot_s": 0.3})
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="abandon_after_s must be greater than 0"):
            DesConfig(fleet, timings, abandon_after_s=bad)
    assert DesConfig(fleet, timings, abandon_after_s=10.0).abandon_after_s == 10.0


def test_a_replay_says_how_many_prompts_it_clipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet, _ = synthetic_fleet(1, 1, {"ttft_s": 10.0, "tpot_s": 0.3})
    half = fleet.model.max_model_len // 2
    trace = tmp_path / "trace.csv"
    trace.write_text(
        HEADER
        + "2023-11-16 18:15:46.6805900,374,4\n"
        + f"2023-11-16 18:15:47.1805900,{half + 1},4\n"
        + f"2023-11-16 18:15:47.6805900,{half},4\n"
    )
    assert fleetsim_main(["--engines", "1:1", "--trace", str(trace)]) == 0
    out = capsys.readouterr()
    assert f"1 of 3 trace prompts clipped to {half:,} tokens" in out.err
    assert '"trace_prompts_clipped": 1' in out.out


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        # A request no engine would take, reported "completed" (a CLI fuzz pass).
        (["--prompt-tokens", "1000000"], "exceed the fleet's max_model_len 16384"),
        # Simulated for hours: the controllers tick through every simulated second.
        (["--output-tokens", "99999999999"], "exceed the fleet's max_model_len"),
        (["--rate", "1e-300"], "at most 1e+07 s are simulated"),
    ],
)
def test_a_poisson_run_that_could_not_be_served_or_would_not_end_is_refused(
    capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    assert fleetsim_main([*BASE, *extra]) == 2
    assert says in capsys.readouterr().err


def test_a_trace_answer_longer_than_the_context_is_cut_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(HEADER + "2023-11-16 18:15:46.68,374,99999999999\n")
    assert fleetsim_main(["--engines", "1:1", "--trace", str(trace), "--requests", "1"]) == 0
    assert '"completed": 1' in capsys.readouterr().out


def test_times_without_an_offset_are_utc_not_the_host_s_zone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read in the host's zone, a trace crossing its daylight-saving change gained an hour
    between two rows an hour apart (New York, 2023-11-05: 01:30 EDT, then 02:30 EST)."""
    trace = tmp_path / "trace.csv"
    trace.write_text(HEADER + "2023-11-05 01:30:00.0,374,44\n2023-11-05 02:30:00.0,3,5\n")
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        rows = read_azure_trace(trace)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert rows[1][0] == 3600.0


def test_a_bad_argument_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse printed its 9-line usage block before the error line."""
    with pytest.raises(SystemExit) as exited:
        fleetsim_main([*BASE, "--rate", "fast"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "narwhal-fleetsim: argument --rate: expected a number, got 'fast'\n"
    )
    with pytest.raises(SystemExit):
        fleetsim_main(["--requests", "5"])
    assert capsys.readouterr().err == (
        "narwhal-fleetsim: one of the arguments --fleet --engines is required\n"
    )


@pytest.mark.parametrize("argv", [["--fleet", ""], [*BASE, "--trace", ""]], ids=["fleet", "trace"])
def test_an_empty_path_is_refused_naming_its_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """--fleet '' was a traceback; --trace '' (an unset $TRACE) ran a Poisson workload."""
    assert fleetsim_main(argv) == 2
    assert capsys.readouterr().err == f"narwhal-fleetsim: {argv[-2]}: an empty path\n"
