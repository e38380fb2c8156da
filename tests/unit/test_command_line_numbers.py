"""Numbers on the command lines (``narwhal.contract.flags``): out of range, NaN included, is a
usage error naming the flag and the reason, in every tool that takes them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

from narwhal.contract.flags import (
    base_url,
    http_url_problem,
    number_type,
    out_of_range,
    positive,
)
from narwhal.fleetsim import cli as fleetsim_cli
from tools.deployment import (
    attestation_contract,
    attestation_sidecar,
    deploy_hosts,
    launch_plan,
)
from tools.measurement import benchmark_runner, load_trial


@pytest.mark.parametrize(
    ("value", "bounds", "reason"),
    [
        (0.0, {"low": 0, "low_allowed": False}, "must be greater than 0, got 0"),
        (float("nan"), {"low": 0}, "must be at least 0, got nan"),
        (70000, {"low": 1, "high": 65535}, "must be from 1 to 65535, got 70000"),
        (-10485760, {"low": 1}, "must be at least 1, got -10485760"),
        (0.5, {"low": 1.5}, "must be at least 1.5, got 0.5"),
        (1.0, {"low": 0, "high": 1, "low_allowed": False, "high_allowed": False},
         "must be greater than 0 and below 1, got 1"),
        (2.0, {"low": 0, "high": 1, "high_allowed": True, "low_allowed": False},
         "must be greater than 0 and at most 1, got 2"),
    ],
)  # fmt: skip
def test_a_value_out_of_range_says_the_range(
    value: float, bounds: dict[str, float | bool], reason: str
) -> None:
    assert out_of_range(value, **bounds) == reason  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [1e-9, 1.0, 1e300])
def test_a_value_in_range_passes(value: float) -> None:
    assert out_of_range(value, 0, low_allowed=False) is None
    assert positive(float)(str(value)) == value


def test_an_integer_past_a_floats_range_is_out_of_range_not_a_crash() -> None:
    """math.isinf on such an int raises OverflowError (narwhal-serve --max-body-bytes 1e400)."""
    huge = 10**400
    assert out_of_range(huge, 1, 65535) is not None
    assert out_of_range(huge, 1) is None  # in range: an int has no infinity
    with pytest.raises(argparse.ArgumentTypeError, match="must be from 1 to 65535"):
        number_type(int, 1, 65535)(str(huge))


@pytest.mark.parametrize("text", ["inf", "-inf", "Infinity"])
def test_an_infinite_number_is_refused_on_a_command_line(text: str) -> None:
    """deploy_hosts.py --step-timeout inf reached subprocess.run as an OverflowError."""
    assert out_of_range(float("inf"), 0) == "must be a finite number, got inf"
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be a finite number, got -?inf"):
        number_type(float, float("-inf"))(text)
    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number, got inf"):
        positive(float)("inf")


def test_an_argparse_type_names_what_it_expected() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer, got '1\.5'"):
        number_type(int, 1)("1.5")
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number, got 'x'"):
        positive(float)("x")
    assert number_type(int, 1, 65535)("8000") == 8000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--rate", "nan"], "argument --rate: must be greater than 0, got nan"),
        (["run", "--attainment", "95"], "--attainment: must be greater than 0 and at most 1"),
        (["run", "--ttft", "0"], "argument --ttft: must be greater than 0, got 0"),
        (["prepare", "--trace-start", "-5"], "argument --trace-start: must be at least 0, got -5"),
    ],
)  # fmt: skip
def test_load_trial_refuses_numbers_out_of_range(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        load_trial.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--scrape-interval", "--drain-timeout", "--max-gap"])
@pytest.mark.parametrize("value", ["nan", "0", "-1"])
def test_benchmark_runner_refuses_seconds_out_of_range(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--base", "http://127.0.0.1:1", "--model", "m", "--plan", "p", "--out", "o"]
    with pytest.raises(SystemExit) as exit_:
        benchmark_runner.build_parser().parse_args([*argv, flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be greater than 0, got {value}" in capsys.readouterr().err


SIDECAR = ["--engine-id", "e", "--checkpoint", "c", "--model-id", "m", "--model-revision", "r"]
SIDECAR += ["--tp", "1"]
GT0 = "must be greater than 0, got"


@pytest.mark.parametrize(
    ("tool", "argv", "message"),
    [
        (launch_plan, ["wait", "p", "--timeout", "nan"], f"argument --timeout: {GT0} nan"),
        (launch_plan, ["wait", "p", "--interval", "-1"], f"argument --interval: {GT0} -1"),
        (launch_plan, ["capture", "p", "--out", "o", "--timeout", "-1"], "argument --timeout"),
        (
            attestation_contract,
            ["finalize-fleet", "--fleet", "f", "--timeout", "nan"],
            f"argument --timeout: {GT0} nan",
        ),
        (
            attestation_sidecar,
            [*SIDECAR, "--port", "70000"],
            "argument --port: must be from 1 to 65535, got 70000",
        ),
        (
            attestation_sidecar,
            [*SIDECAR, "--port", "9", "--verify-interval", "nan"],
            "argument --verify-interval: must be a finite number greater than 0, got nan",
        ),
        (
            deploy_hosts,
            ["--deployment", "d", "--commit", "c", "--step-timeout", "nan"],
            f"argument --step-timeout: {GT0} nan",
        ),
    ],
)
def test_deployment_tools_refuse_numbers_out_of_range(
    tool: Any, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found probing the tools: a negative wait interval, a negative or NaN timeout, a port past
    65535 were tracebacks (or, NaN, a wait that never ends)."""
    with pytest.raises(SystemExit) as exit_:
        tool._parser().parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engines", "100000000:1"], "at least 1 of each role and at most 4,096 in all"),
        (["--engines", "0:4"], "--engines: at least 1 of each role"),
        (["--fleet", "f.json", "--ttft", "5"], "--ttft/--tpot: a fleet file's budgets apply"),
        (["--engines", "2:2", "--tpot", "-1"], "argument --tpot: must be greater than 0, got -1"),
    ],
)  # fmt: skip
def test_fleetsim_refuses_what_it_would_ignore_or_cannot_hold(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ttft/--tpot beside --fleet were silently ignored; 100 M engines grew to gigabytes."""
    with pytest.raises(SystemExit) as exit_:
        sys.exit(fleetsim_cli.main(argv))
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "text",
    ["http://127.0.0.1:8a", "http://127.0.0.1:0", "http://127.0.0.1:99999", "ftp://h", "h:8000"],
)
def test_a_base_url_a_tool_cannot_use_is_refused(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port of letters was a traceback where the URL was first used (benchmark_runner's
    ValueError, load_trial's httpx.InvalidURL; a CLI fuzz pass): refused before anything runs,
    as a URL without a host was."""
    says = f"--base: {text!r} is not a router URL (http://HOST:PORT)"
    runner = ["--base", text, "--model", "m", "--plan", str(tmp_path / "p.json")]
    assert benchmark_runner.main([*runner, "--out", str(tmp_path / "o")]) == 2
    assert says in capsys.readouterr().err
    prepare = ["prepare", "--base", text, "--out", str(tmp_path / "o"), "--seed", "1"]
    assert load_trial.main(prepare) == 2
    assert says in capsys.readouterr().err
    assert http_url_problem("http://127.0.0.1:8000") is None
    with pytest.raises(argparse.ArgumentTypeError, match="port from 1 to 65535"):
        base_url("http://127.0.0.1:8a")


def test_a_demo_port_of_letters_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from narwhal import demo

    monkeypatch.setenv("DEMO_PORT", "abc")
    monkeypatch.setattr(sys, "argv", ["demo"])
    with pytest.raises(SystemExit) as exit_:
        demo.main()
    assert exit_.value.code == 2
    assert "argument --port: expected an integer, got 'abc'" in capsys.readouterr().err
