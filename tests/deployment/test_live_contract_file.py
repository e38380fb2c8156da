"""finalize-fleet --live reads a `capture` file as strictly as a fleet: a value of another type
is refused by its place (not coerced, not compared as written), and so is an engine given twice
(the first used to win without a word). Refused before any engine is asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing.ports import free_ports
from tools.deployment import attestation_contract


def _engine(engine_id: str, port: int, nixl: int) -> dict[str, Any]:
    return {
        "id": engine_id,
        "url": f"http://127.0.0.1:{port}",
        "model_id": "moonshotai/Kimi-K3",
        "kv_cache": {"block_size": 16, "num_blocks": 4096, "source": "attestation"},
        "nixl": {"host": "127.0.0.1", "port": nixl, "listening": True, "source": "attestation"},
    }


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A fleet of two engines on free ports (nothing listens there) and a live contract for it."""
    http, nixl = free_ports(2), free_ports(2)
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(local_fleet_document(http, nixl)))
    live = {
        "schema": "narwhal.live-contract/v1",
        "engines": [_engine(f"e{i}", http[i], nixl[i]) for i in range(2)],
    }
    return fleet, live


def _finalize(fleet: Path, live: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    out = fleet.with_name("final.json")
    argv = ["finalize-fleet", "--fleet", str(fleet), "--out", str(out), "--live", str(live)]
    code = attestation_contract.main([*argv, "--timeout", "1"])
    assert not out.exists()
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "engine, key, field, value, expected",
    [
        (0, "kv_cache", "block_size", "16", "an integer (got '16')"),
        (1, "kv_cache", "block_bytes", 16384.0, "an integer (got 16384.0)"),
        (0, "nixl", "port", "5600", "an integer (got '5600')"),
        (1, "nixl", "listening", "yes", "a boolean (got 'yes')"),
        (0, None, "max_model_len", True, "an integer (got true)"),
    ],
)
def test_a_live_value_of_another_type_is_refused_by_its_place(
    files: tuple[Path, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    engine: int,
    key: str | None,
    field: str,
    value: Any,
    expected: str,
) -> None:
    """`"block_size": "16"` was read as written and compared: 'e1: KV block_size 16 differs
    from e0's 16'."""
    fleet, doc = files
    node = doc["engines"][engine] if key is None else doc["engines"][engine][key]
    node[field] = value
    live = fleet.with_name("live.json")
    live.write_text(json.dumps(doc))
    code, err = _finalize(fleet, live, capsys)
    place = f"engines[{engine}]." + (f"{key}.{field}" if key else field)
    assert (code, err) == (
        2,
        f"attestation_contract.py: --live {live}: {place}: expected {expected}\n",
    )


def test_an_engine_given_twice_is_refused(
    files: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    fleet, doc = files
    doc["engines"].append(dict(doc["engines"][0], url="http://127.0.0.1:1"))
    live = fleet.with_name("live.json")
    live.write_text(json.dumps(doc))
    code, err = _finalize(fleet, live, capsys)
    assert (code, err) == (
        2,
        f"attestation_contract.py: --live {live}: engines[2].id: duplicate engine 'e0' "
        "(engines[0] is it too)\n",
    )


def test_a_live_file_that_is_not_json_says_where(
    files: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """It was '--live l.json: : Invalid JSON: EOF while parsing a list' (an empty place)."""
    fleet, doc = files
    live = fleet.with_name("live.json")
    live.write_text(json.dumps(doc)[:60])
    code, err = _finalize(fleet, live, capsys)
    assert code == 2
    assert err.startswith(f"attestation_contract.py: --live {live}: invalid JSON at line 1 column ")
    assert ": : " not in err and len(err.splitlines()) == 1
    live.write_text(json.dumps(doc).replace('"schema"', '"schema": "x", "schema"', 1))
    code, err = _finalize(fleet, live, capsys)
    assert (code, err) == (
        2,
        f"attestation_contract.py: --live {live}: invalid JSON: duplicate key 'schema'\n",
    )
