"""narwhal-serve's command line: journaled with router.start as given, secrets masked; a
number out of range refused naming its flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal.serve.cli import UsageError, _parser, build_settings, masked_command

FLEET = Path(__file__).resolve().parents[2] / "configs" / "fleet" / "local-sim.json"


def test_api_keys_on_the_command_line_are_masked() -> None:
    line = masked_command(
        ["narwhal-serve", "--fleet", "f.json", "--api-key", "sk-1", "--api-key=sk-2", "--port", "8"]
    )
    assert line == "narwhal-serve --fleet f.json --api-key '***' '--api-key=***' --port 8"
    assert "sk-" not in line
    assert masked_command(["x", "--journal", "a b.jsonl"]) == "x --journal 'a b.jsonl'"


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "70000"),
        ("--max-body-bytes", "0"),
        ("--drain-timeout", "-1"),
        ("--breaker-failures", "0"),
        ("--breaker-open-seconds", "-1"),
        ("--health-interval", "nan"),
        ("--prefill-timeout", "nan"),
    ],
)
def test_a_number_out_of_range_is_a_usage_error_naming_the_flag(flag: str, value: str) -> None:
    args = _parser().parse_args(
        ["--fleet", str(FLEET), "--journal", "j.jsonl", "--skip-qualification", flag, value]
    )
    with pytest.raises(UsageError, match=f"^{flag}: "):
        build_settings(args)
