"""narwhal-serve's command line: journaled with router.start as given, secrets masked; a
number out of range refused naming its flag."""

from __future__ import annotations

import json
import os
import re
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
        # Finite, but past a day: the probes (the fsyncs) would in effect never run again.
        ("--health-interval", "1e20"),
        ("--scrape-interval", "86401"),
        ("--journal-fsync-interval", "1e9"),
        ("--prefill-timeout", "nan"),
    ],
)
def test_a_number_out_of_range_is_a_usage_error_naming_the_flag(flag: str, value: str) -> None:
    args = _parser().parse_args(
        ["--fleet", str(FLEET), "--journal", "j.jsonl", "--skip-qualification", flag, value]
    )
    with pytest.raises(UsageError, match=f"^{flag}: "):
        build_settings(args)


def test_an_empty_api_key_and_a_journal_under_a_file_are_usage_errors(tmp_path: Path) -> None:
    """An empty --api-key counted as a key configured (no loopback fallback, no warning) that
    admits no one; a journal under a regular file was a traceback at start."""
    base = ["--fleet", str(FLEET), "--skip-qualification"]
    args = _parser().parse_args([*base, "--journal", str(tmp_path / "j.jsonl"), "--api-key", " "])
    with pytest.raises(UsageError, match=r"^--api-key: an API key must not be empty"):
        build_settings(args)
    plain = tmp_path / "plain"
    plain.write_text("")
    args = _parser().parse_args([*base, "--journal", str(plain / "sub" / "j.jsonl")])
    with pytest.raises(UsageError, match=f"^--journal: {re.escape(str(plain))} is not a directory"):
        build_settings(args)


def test_an_unknown_log_level_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["--fleet", "f", "--journal", "j", "--log-level", "bogus"])
    assert exit_.value.code == 2
    assert "--log-level: invalid choice: 'bogus'" in capsys.readouterr().err
    assert (
        _parser().parse_args(["--fleet", "f", "--journal", "j", "--log-level", "DEBUG"]).log_level
        == "debug"
    )


def test_a_journal_has_one_router_and_is_a_journal(tmp_path: Path) -> None:
    """Two routers on one journal interleaved their records, and the second's recovery closed
    the first's live requests (two terminal records for one request); a file that is not a
    journal was appended to; an unwritable journal was a traceback at start."""
    from narwhal.testing.ports import free_ports

    journal = tmp_path / "j.jsonl"
    base = ["--fleet", str(FLEET), "--skip-qualification", "--journal", str(journal)]
    first = build_settings(_parser().parse_args([*base, "--port", str(free_ports(1)[0])]))[0]
    assert first.journal_claim is not None and journal.exists()
    assert (tmp_path / "j.jsonl.lock").read_text().strip().isdigit()  # the holder's pid
    args = _parser().parse_args([*base, "--port", str(free_ports(1)[0])])
    with pytest.raises(UsageError, match=r"^--journal: .* is in use by another router \(process"):
        build_settings(args)
    first.journal_claim.close()  # the first router exits
    build_settings(args)[0].journal_claim.close()
    fleet_copy = tmp_path / "fleet.json"
    fleet_copy.write_bytes(FLEET.read_bytes())
    args = _parser().parse_args([*base[:-1], str(fleet_copy), "--port", str(free_ports(1)[0])])
    with pytest.raises(UsageError, match=r"is not a Narwhal journal \(its first line"):
        build_settings(args)
    assert fleet_copy.read_bytes() == FLEET.read_bytes()  # untouched
    unwritable = Path("/proc/narwhal-test/j.jsonl")
    args = _parser().parse_args([*base[:-1], str(unwritable), "--port", str(free_ports(1)[0])])
    with pytest.raises(UsageError, match=r"^--journal: /proc/narwhal-test/j.jsonl: cannot write"):
        build_settings(args)


def test_keys_a_client_could_never_send_and_an_empty_key_list_are_usage_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key with a non-ASCII character never matched (clients send Latin-1 bytes, the file
    is UTF-8); NARWHAL_API_KEYS of separators alone configured no key, and the router served
    unauthenticated with a warning."""
    base = ["--fleet", str(FLEET), "--skip-qualification", "--journal", str(tmp_path / "j.jsonl")]
    keys = tmp_path / "keys"
    keys.write_text("cl\u00e9-key\n", encoding="utf-8")
    keys.chmod(0o600)
    args = _parser().parse_args([*base, "--api-keys-file", str(keys)])
    with pytest.raises(UsageError, match=f"^{keys}: an API key must be printable ASCII"):
        build_settings(args)
    monkeypatch.setenv("NARWHAL_API_KEYS", " , ,")
    with pytest.raises(UsageError, match=r"^NARWHAL_API_KEYS: no API key in it"):
        build_settings(_parser().parse_args(base))


def test_a_secrets_file_other_users_may_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from narwhal.testing.ports import free_ports

    keys = tmp_path / "keys"
    keys.write_text("k-1\n")
    keys.chmod(0o644)
    base = ["--fleet", str(FLEET), "--skip-qualification", "--journal", str(tmp_path / "j.jsonl")]
    args = [*base, "--api-keys-file", str(keys), "--port", str(free_ports(1)[0])]
    with caplog.at_level("WARNING"):
        settings = build_settings(_parser().parse_args(args))[0]
    settings.journal_claim.close()
    assert f"{keys}: other users may read the API keys (mode 644): chmod 600" in caplog.text


def test_an_indented_comment_is_no_key_and_a_file_without_end_is_refused(tmp_path: Path) -> None:
    """Found by a CLI fuzz pass: an indented '#revoked' line was read as a valid API key;
    /dev/zero was read without end."""
    from narwhal.serve.auth import Auth

    base = ["--fleet", str(FLEET), "--skip-qualification", "--journal", str(tmp_path / "j.jsonl")]
    keys = tmp_path / "keys"
    keys.write_text("k-live\n   # k-revoked\n\t#k-old\n")
    keys.chmod(0o600)
    settings = build_settings(_parser().parse_args([*base, "--api-keys-file", str(keys)]))[0]
    settings.journal_claim.close()
    auth = Auth(settings.api_key_hashes, None)
    assert len(settings.api_key_hashes) == 1 and auth.client_allowed("Bearer k-live")
    assert not auth.client_allowed("Bearer # k-revoked") and not auth.client_allowed(
        "Bearer #k-old"
    )
    path = Path("/dev/zero")
    args = _parser().parse_args([*base, "--api-keys-file", str(path)])
    with pytest.raises(UsageError, match=f"^{path}: cannot read API keys: not a regular file"):
        build_settings(args)
    # A pipe is read (process substitution keeps the keys off the disk).
    read, write = os.pipe()
    os.write(write, b"k-piped\n")
    os.close(write)
    try:
        args = _parser().parse_args([*base, "--api-keys-file", f"/dev/fd/{read}"])
        piped = build_settings(args)[0]
        piped.journal_claim.close()
    finally:
        os.close(read)
    assert Auth(piped.api_key_hashes, None).client_allowed("Bearer k-piped")


def test_a_journal_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    """--journal /dev/null started a router whose every fsync failed: each request a 503."""
    base = ["--fleet", str(FLEET), "--skip-qualification"]
    args = _parser().parse_args([*base, "--journal", "/dev/null"])
    with pytest.raises(UsageError, match=r"^--journal: /dev/null is not a regular file"):
        build_settings(args)


def test_the_push_relay_over_httpx_is_refused_and_the_default_follows_the_transport(
    tmp_path: Path,
) -> None:
    """--relay push with --engine-transport httpx was accepted and quietly pulled (a CLI fuzz
    pass); without --relay the transport's own relay is taken."""
    base = ["--fleet", str(FLEET), "--skip-qualification", "--journal", str(tmp_path / "j.jsonl")]
    args = _parser().parse_args([*base, "--relay", "push", "--engine-transport", "httpx"])
    with pytest.raises(UsageError, match=r"^--relay push: needs --engine-transport aiohttp"):
        build_settings(args)
    for transport, relay in (("httpx", "asgi"), ("aiohttp", "push")):
        args = _parser().parse_args([*base, "--engine-transport", transport])
        settings = build_settings(args)[0]
        settings.journal_claim.close()
        assert settings.relay == relay


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        # Accepted without --coordination, a mistake waiting for the day it is turned on.
        (["--coordination-lease-ttl", "-1"], "--coordination-lease-ttl: at least 2 seconds"),
        # The limit was not in the message (a CLI fuzz pass).
        (["--replica-id", "r" * 64], "is not a name of at most 63 letters"),
        # Bound every interface without a word.
        (["--host", ""], "--host: empty"),
    ],
)
def test_values_that_could_never_be_meant_are_usage_errors(
    tmp_path: Path, extra: list[str], says: str
) -> None:
    base = ["--fleet", str(FLEET), "--skip-qualification", "--journal", str(tmp_path / "j.jsonl")]
    with pytest.raises(UsageError, match=re.escape(says)):
        build_settings(_parser().parse_args([*base, *extra]))


def test_a_missing_store_the_fleet_pins_names_the_field(tmp_path: Path) -> None:
    """'sub/nope.json: cannot read' did not say the fleet's profile_store.path named it."""
    doc = json.loads(FLEET.read_text())
    doc["profile_store"] = {"path": "sub/nope.json", "sha256": "0" * 64}
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(doc))
    args = _parser().parse_args(
        ["--fleet", str(fleet), "--skip-qualification", "--journal", str(tmp_path / "j.jsonl")]
    )
    with pytest.raises(UsageError, match=re.escape(f"{fleet}: profile_store.path: ")):
        build_settings(args)


def test_a_journal_whose_first_record_was_torn_is_still_taken(tmp_path: Path) -> None:
    """A router killed while writing its very first record: the next one recovers the file.
    Anything else on one line without a newline (narwhal-profile's store) is no journal."""
    from narwhal.testing.ports import free_ports

    journal = tmp_path / "j.jsonl"
    journal.write_bytes(b'{"type":"router.start","ts":1796673493.59,"pid":41')
    base = ["--fleet", str(FLEET), "--skip-qualification", "--journal", str(journal)]
    settings = build_settings(_parser().parse_args([*base, "--port", str(free_ports(1)[0])]))[0]
    settings.journal_claim.close()
    journal.write_bytes(b'{"complete":true,"engines":{}}')
    journal.chmod(0o644)
    with pytest.raises(UsageError, match=r"is not a Narwhal journal \(its only line, without"):
        build_settings(_parser().parse_args(base))
    assert journal.read_bytes() == b'{"complete":true,"engines":{}}'
    assert journal.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    "flag", ["--fleet", "--journal", "--profiles", "--check-report", "--api-keys-file",
             "--admin-token-file"],
)  # fmt: skip
def test_an_empty_path_is_a_usage_error_naming_its_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    """--profiles '' (an unset $STORE) served without a profile store, the v0 scheduler."""
    monkeypatch.chdir(tmp_path)  # a blank path is relative: taken, it lands here
    given = {"--fleet": str(FLEET), "--journal": str(tmp_path / "j.jsonl"), flag: " "}
    argv = [part for pair in given.items() for part in pair]
    if flag != "--check-report":
        argv.append("--skip-qualification")
    with pytest.raises(UsageError, match=f"^{flag}: an empty path$"):
        build_settings(_parser().parse_args(argv))


@pytest.mark.parametrize("tail", ["/", "/.", "/.."])
def test_a_journal_named_as_a_directory_is_refused(tmp_path: Path, tail: str) -> None:
    given = f"{tmp_path}/new{tail}"
    argv = ["--fleet", str(FLEET), "--skip-qualification", "--journal", given]
    with pytest.raises(UsageError, match=f"^--journal: {re.escape(given)} names a directory"):
        build_settings(_parser().parse_args(argv))
    assert list(tmp_path.iterdir()) == []


def test_a_bad_argument_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["--fleet", "f", "--journal", "j", "--body-timeout", "soon"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "narwhal-serve: argument --body-timeout: invalid float value: 'soon'\n"
    )
