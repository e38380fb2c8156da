"""The command line narwhal-serve journals with router.start: as given, secrets masked."""

from __future__ import annotations

from narwhal.serve.cli import masked_command


def test_api_keys_on_the_command_line_are_masked() -> None:
    line = masked_command(
        ["narwhal-serve", "--fleet", "f.json", "--api-key", "sk-1", "--api-key=sk-2", "--port", "8"]
    )
    assert line == "narwhal-serve --fleet f.json --api-key '***' '--api-key=***' --port 8"
    assert "sk-" not in line
    assert masked_command(["x", "--journal", "a b.jsonl"]) == "x --journal 'a b.jsonl'"
