"""Fleet contract: example fleets, hashing, pair expansion and one-line error messages."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from narwhal.contract import (
    CheckReport,
    ContractError,
    FleetContract,
    LoadedFleet,
    canonical_json,
    load_fleet,
    parse_fleet,
    read_json_document,
    sha256_hex,
    validate_document,
)

REPO = Path(__file__).resolve().parents[2]
PROD_FLEET = REPO / "configs" / "fleet" / "kimi-k3-mi355x.example.json"
SIM_FLEET = REPO / "configs" / "fleet" / "local-sim.json"

Doc = dict[str, Any]


def sim_doc() -> Doc:
    return json.loads(SIM_FLEET.read_text())


def minimal_doc() -> Doc:
    """The smallest valid fleet: everything with a default is left out."""
    return {
        "schema": "narwhal.fleet/v1",
        "name": "mini",
        "model": {"id": "m", "revision": "r", "max_model_len": 4096},
        "budgets": {"ttft_s": 10, "tpot_s": 0.3, "attainment": 0.95},
        "engine": {"first_token_timeout_s": 2.5, "tp": 1, "accelerator": "a", "gpu_arch": "g"},
        "engines": [
            {
                "id": f"e{i}",
                "url": f"http://127.0.0.1:{9000 + i}/",
                "roles": ["prefill", "decode"],
                "initial_role": role,
                "nixl": {"host": "127.0.0.1", "port": 9100 + i},
            }
            for i, role in enumerate(["prefill", "decode"])
        ],
    }


def parse_error(doc: Any) -> str:
    with pytest.raises(ContractError) as info:
        parse_fleet(doc, "fleet.json")
    return str(info.value)


# --- example fleets -------------------------------------------------------------------------


@pytest.mark.parametrize("path", [PROD_FLEET, SIM_FLEET], ids=["prod", "sim"])
def test_example_fleets_load(path: Path) -> None:
    loaded = load_fleet(path)
    assert isinstance(loaded, LoadedFleet)
    assert loaded.path == path
    assert loaded.raw == json.loads(path.read_text())
    assert loaded.sha256 == sha256_hex(json.loads(path.read_text()))
    fleet = loaded.contract
    assert fleet.schema_version == "narwhal.fleet/v1"
    assert fleet.model.id == "moonshotai/Kimi-K3"
    assert [e.id for e in fleet.engines] == ["e0", "e1", "e2", "e3"]
    assert [e.initial_role for e in fleet.engines] == ["prefill", "prefill", "decode", "decode"]
    assert fleet.kv_transfer_pairs == "all"
    assert len(fleet.permitted_pairs()) == 12


def test_production_example_values() -> None:
    fleet = load_fleet(PROD_FLEET).contract
    assert fleet.name == "kimi-k3-mi355x"
    assert fleet.model.max_model_len == 131072
    assert fleet.model.config_sha256 == (
        "9710e121a58d03ac92c8d6da287a19541994319afbbe6d6202af001ffd379213"
    )
    assert fleet.engine.first_token_timeout_s == 2.5
    assert fleet.engine.tp == 8
    assert fleet.engine.gpu_arch == "gfx950"
    assert fleet.engine_by_id("e2").url == "http://10.20.0.13:8000"
    assert fleet.engine_by_id("e2").nixl.port == 5600
    assert fleet.engine_by_id("e3").attestation_url == "http://10.20.0.14:8090/attestation"
    assert all(e.sim is None for e in fleet.engines)


def test_sim_example_values() -> None:
    fleet = load_fleet(SIM_FLEET).contract
    assert fleet.engine.kv_buffer_device == "cpu"
    assert [e.url for e in fleet.engines] == [f"http://127.0.0.1:{p}" for p in range(18100, 18104)]
    assert [e.nixl.port for e in fleet.engines] == list(range(18200, 18204))
    for e in fleet.engines:
        assert e.sim is not None
        assert e.sim.time_scale == 10.0
        assert e.sim.block_size == 16  # untouched knobs keep their defaults


def test_minimal_document_gets_defaults_and_normalised_urls() -> None:
    fleet = parse_fleet(minimal_doc()).contract
    e0 = fleet.engine_by_id("e0")
    assert e0.url == "http://127.0.0.1:9000"  # trailing slash dropped
    assert e0.host == "127.0.0.1"  # defaulted from the URL
    assert fleet.engine.request_timeout_s == 600
    assert fleet.engine.kv_connector == "NixlConnector"
    assert fleet.roles.cooldown_s == 60 and fleet.routing.fallback == "retry"
    assert fleet.profile_store is None
    assert fleet.model_dump(mode="json")["schema"] == "narwhal.fleet/v1"


def test_local_prefill_is_off_by_default_and_leaves_existing_hashes_alone() -> None:
    doc = minimal_doc()
    loaded = parse_fleet(doc)
    assert loaded.contract.routing.local_prefill.enabled is False
    assert loaded.sha256 == sha256_hex(minimal_doc())  # the option's default is not hashed
    doc["routing"] = {"local_prefill": {"enabled": True, "max_prompt_tokens": 512}}
    on = parse_fleet(doc)
    assert on.contract.routing.local_prefill.max_prompt_tokens == 512
    assert on.sha256 != loaded.sha256


def test_contract_is_frozen() -> None:
    fleet = parse_fleet(minimal_doc()).contract
    with pytest.raises(ValueError, match="frozen"):
        fleet.name = "other"  # type: ignore[misc]
    loaded = parse_fleet(minimal_doc())
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.sha256 = "x"  # type: ignore[misc]


def test_engine_lookup_unknown_id_raises_key_error() -> None:
    with pytest.raises(KeyError):
        parse_fleet(minimal_doc()).contract.engine_by_id("nope")


# --- hashing --------------------------------------------------------------------------------


def test_canonical_json_form() -> None:
    assert canonical_json({"b": [1, 2.5, None], "a": "ü", "c": {"y": True, "x": 0.1}}) == (
        '{"a":"ü","b":[1,2.5,null],"c":{"x":0.1,"y":true}}'.encode()
    )
    assert sha256_hex({}) == "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_hash_ignores_key_order_and_whitespace(tmp_path: Path) -> None:
    doc = sim_doc()

    def reverse_keys(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: reverse_keys(value[k]) for k in reversed(list(value))}
        if isinstance(value, list):
            return [reverse_keys(v) for v in value]
        return value

    compact = tmp_path / "compact.json"
    compact.write_text(json.dumps(reverse_keys(doc), separators=(",", ":")))
    spaced = tmp_path / "spaced.json"
    spaced.write_text(json.dumps(doc, indent=7) + "\n\n")
    assert load_fleet(compact).sha256 == load_fleet(SIM_FLEET).sha256
    assert load_fleet(spaced).sha256 == load_fleet(SIM_FLEET).sha256
    # A byte order mark (some editors save one) is read past; it was "Unexpected UTF-8 BOM
    # (decode using utf-8-sig)", an instruction to the wrong reader.
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + json.dumps(doc).encode())
    assert load_fleet(marked).sha256 == load_fleet(SIM_FLEET).sha256


def test_hash_changes_when_a_value_changes() -> None:
    doc = sim_doc()
    before = parse_fleet(doc).sha256
    doc["budgets"]["tpot_s"] = 0.31
    assert parse_fleet(doc).sha256 != before


def test_hash_is_of_the_document_not_the_model_dump() -> None:
    # Defaults the document leaves out are not hashed, so adding a defaulted field to the
    # code never renames an existing fleet.
    doc = minimal_doc()
    loaded = parse_fleet(doc)
    assert loaded.sha256 == sha256_hex(doc)
    assert loaded.sha256 != sha256_hex(loaded.contract.model_dump(mode="json"))


def test_raw_is_a_private_copy() -> None:
    doc = minimal_doc()
    loaded = parse_fleet(doc)
    doc["name"] = "changed"
    assert loaded.raw["name"] == "mini"
    assert loaded.sha256 == sha256_hex(loaded.raw)


# --- permitted pairs ------------------------------------------------------------------------


def test_all_expands_to_every_ordered_pair_of_distinct_engines() -> None:
    fleet = load_fleet(SIM_FLEET).contract
    pairs = fleet.permitted_pairs()
    ids = ["e0", "e1", "e2", "e3"]
    assert pairs == [(p, d) for p in ids for d in ids if p != d]
    assert all(p != d for p, d in pairs)
    assert fleet.is_permitted("e0", "e3")
    assert not fleet.is_permitted("e1", "e1")
    assert not fleet.is_permitted("e0", "e9")


def test_all_respects_permitted_roles() -> None:
    doc = sim_doc()
    doc["engines"][0]["roles"] = ["prefill"]
    doc["engines"][3]["roles"] = ["decode"]
    fleet = parse_fleet(doc).contract
    assert [e.id for e in fleet.prefill_capable()] == ["e0", "e1", "e2"]
    assert [e.id for e in fleet.decode_capable()] == ["e1", "e2", "e3"]
    assert fleet.permitted_pairs() == [
        ("e0", "e1"),
        ("e0", "e2"),
        ("e0", "e3"),
        ("e1", "e2"),
        ("e1", "e3"),
        ("e2", "e1"),
        ("e2", "e3"),
    ]
    assert not fleet.is_permitted("e3", "e0")  # e3 cannot prefill, e0 cannot decode
    assert not fleet.is_permitted("e1", "e0")


def test_explicit_pairs() -> None:
    doc = sim_doc()
    doc["kv_transfer_pairs"] = [
        {"prefill": "e0", "decode": "e2"},
        {"prefill": "e1", "decode": "e3"},
    ]
    fleet = parse_fleet(doc).contract
    assert fleet.permitted_pairs() == [("e0", "e2"), ("e1", "e3")]
    assert fleet.is_permitted("e0", "e2")
    assert not fleet.is_permitted("e2", "e0")
    assert not fleet.is_permitted("e0", "e3")


def test_cached_lookups_do_not_break_equality() -> None:
    a = parse_fleet(sim_doc()).contract
    b = parse_fleet(sim_doc()).contract
    assert a.is_permitted("e0", "e1")
    a.engine_by_id("e0")
    assert a == b


# --- invalid documents: exact one-line messages ---------------------------------------------


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """A mutation setting ``value`` at a dotted path ("engines.2.roles.0")."""

    def mutate(doc: Doc) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = doc
        for p in parents:
            node = node[p]
        node[last] = value

    return mutate


def _delete(path: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = doc
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


def _all(*mutations: Callable[[Doc], None]) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        for m in mutations:
            m(doc)

    return mutate


INVALID_CASES: list[tuple[str, Callable[[Doc], None], str]] = [
    (
        "unknown-role",
        _set("engines.2.roles.0", "prefil"),
        "engines[2].roles[0]: 'prefil' is not one of prefill, decode",
    ),
    ("missing-budget", _delete("budgets.ttft_s"), "budgets.ttft_s: required field is missing"),
    (
        "negative-tpot",
        _set("budgets.tpot_s", -0.3),
        "budgets.tpot_s: must be greater than 0 (got -0.3)",
    ),
    ("unknown-field", _set("engines.0.colour", "teal"), "engines[0].colour: unknown field"),
    (
        "port-wrong-type",
        _set("engines.0.nixl.port", "abc"),
        "engines[0].nixl.port: expected an integer (got 'abc')",
    ),
    (
        "port-as-string-is-not-coerced",
        _set("engines.0.nixl.port", "18200"),
        "engines[0].nixl.port: expected an integer (got '18200')",
    ),
    (
        "port-out-of-range",
        _set("engines.1.nixl.port", 70000),
        "engines[1].nixl.port: must be less than or equal to 65535 (got 70000)",
    ),
    (
        "kv-events-port-out-of-range",
        _set("engines.1.kv_events", {"endpoint": "tcp://127.0.0.1:99999"}),
        "engines[1].kv_events.endpoint: port is not a number from 1 to 65535 "
        "(got 'tcp://127.0.0.1:99999')",
    ),
    (
        # What vLLM's --kv-events-config says (tcp://*:5557), pasted: the router would try to
        # connect to it, fail, and log a traceback every 30 s.
        "kv-events-bind-address",
        _set("engines.0.kv_events", {"endpoint": "tcp://*:5557"}),
        "engines[0].kv_events.endpoint: '*' is an address to bind to (vLLM's publisher binds "
        "tcp://*:PORT), not one to connect to: name the engine's host, e.g. "
        "tcp://ENGINE_HOST:5557 (got 'tcp://*:5557')",
    ),
    (
        "kv-events-any-address",
        _set(
            "engines.0.kv_events",
            {"endpoint": "tcp://e0:5557", "replay_endpoint": "tcp://0.0.0.0:5558"},
        ),
        "engines[0].kv_events.replay_endpoint: '0.0.0.0' is an address to bind to (vLLM's "
        "publisher binds tcp://*:PORT), not one to connect to: name the engine's host, e.g. "
        "tcp://ENGINE_HOST:5558 (got 'tcp://0.0.0.0:5558')",
    ),
    (
        "kv-events-not-tcp",
        _set("engines.0.kv_events", {"endpoint": "http://127.0.0.1:5557"}),
        "engines[0].kv_events.endpoint: must be a tcp://HOST:PORT address of the engine's ZMQ "
        "socket (got 'http://127.0.0.1:5557')",
    ),
    (
        "kv-events-no-port",
        _set("engines.0.kv_events", {"endpoint": "tcp://127.0.0.1"}),
        "engines[0].kv_events.endpoint: must be tcp://HOST:PORT, a host and a port and nothing "
        "else (got 'tcp://127.0.0.1')",
    ),
    (
        "kv-events-ipv6",
        _set("engines.0.kv_events", {"endpoint": "tcp://[::1]:5557"}),
        "engines[0].kv_events.endpoint: IPv6 addresses are not supported here: name the "
        "engine's host by a name or an IPv4 address (got 'tcp://[::1]:5557')",
    ),
    (
        # Two engines on one stream: each credited with the other's blocks.
        "kv-events-shared-endpoint",
        _all(
            _set("engines.0.kv_events", {"endpoint": "tcp://127.0.0.1:28300"}),
            _set("engines.2.kv_events", {"endpoint": "tcp://127.0.0.1:28300"}),
        ),
        "engines[2].kv_events.endpoint: 'tcp://127.0.0.1:28300' is also the kv_events.endpoint "
        "of engine 'e0'",
    ),
    (
        "kv-events-replay-is-the-endpoint",
        _set(
            "engines.1.kv_events",
            {"endpoint": "tcp://127.0.0.1:28300", "replay_endpoint": "tcp://127.0.0.1:28300"},
        ),
        "engines[1].kv_events.replay_endpoint: 'tcp://127.0.0.1:28300' is also the "
        "kv_events.endpoint of engine 'e1'",
    ),
    (
        "kv-events-on-an-http-port",
        _set("engines.1.kv_events", {"endpoint": "tcp://127.0.0.1:18100"}),
        "engines[1].kv_events.endpoint: 'tcp://127.0.0.1:18100' is also the HTTP address of "
        "engine 'e0'",
    ),
    (
        "kv-events-on-a-nixl-port",
        _set("engines.1.kv_events", {"endpoint": "tcp://127.0.0.1:18201"}),
        "engines[1].kv_events.endpoint: 'tcp://127.0.0.1:18201' is also the NIXL side channel "
        "of engine 'e1'",
    ),
    (
        "bool-is-not-a-number",
        _set("budgets.ttft_s", True),
        "budgets.ttft_s: expected a number (got true)",
    ),
    (
        "an-integer-past-a-float-is-told-by-its-size",
        _set("budgets.ttft_s", 10**400),
        "budgets.ttft_s: expected a number (got an integer of 401 digits)",
    ),
    (
        "number-is-not-a-string",
        _set("name", 7),
        "name: expected a string (got 7)",
    ),
    (
        "nixl-not-object",
        _set("engines.0.nixl", None),
        "engines[0].nixl: expected an object (got null)",
    ),
    (
        "duplicate-engine-id",
        _set("engines.3.id", "e1"),
        "engines[3].id: duplicate engine id 'e1'",
    ),
    (
        "duplicate-url-after-normalisation",
        _set("engines.3.url", "HTTP://127.0.0.1:18100/"),
        "engines[3].url: duplicate URL 'http://127.0.0.1:18100' (also engine 'e0')",
    ),
    (
        "duplicate-nixl-side-channel",
        _set("engines.2.nixl.port", 18200),
        "engines[2].nixl: duplicate NIXL side channel 127.0.0.1:18200 (also engine 'e0')",
    ),
    (
        "nixl-side-channel-on-another-engines-http-port",
        _set("engines.2.nixl.port", 18101),
        "engines[2].nixl: 127.0.0.1:18101 is also the HTTP address of engine 'e1'",
    ),
    (
        "ttft-budget-past-a-day",
        _set("budgets.ttft_s", 1e308),
        "budgets.ttft_s: must be less than or equal to 86400 (got 1e+308)",
    ),
    (
        "role-tick-past-a-day",
        _set("roles", {"tick_s": 1e300}),
        "roles.tick_s: must be less than or equal to 86400 (got 1e+300)",
    ),
    (
        "attempts-past-the-bound",
        _set("routing", {"max_prefill_attempts": 10**12}),
        "routing.max_prefill_attempts: must be less than or equal to 64 (got 1000000000000)",
    ),
    (
        "initial-role-not-permitted",
        _all(_set("engines.1.roles", ["prefill"]), _set("engines.1.initial_role", "decode")),
        "engines[1].initial_role: 'decode' is not among its permitted roles (prefill)",
    ),
    (
        "duplicate-role",
        _set("engines.0.roles", ["decode", "decode"]),
        "engines[0].roles: duplicate role 'decode'",
    ),
    ("no-roles", _set("engines.0.roles", []), "engines[0].roles: must not be empty"),
    ("no-engines", _set("engines", []), "engines: must not be empty"),
    (
        "bad-engine-id",
        _set("engines.0.id", "-e0"),
        "engines[0].id: '-e0' is not a valid engine id (1 to 63 letters, digits, '_', '.' or '-', "
        "starting with a letter or digit)",
    ),
    (
        "unknown-engine-in-pair",
        _set("kv_transfer_pairs", [{"prefill": "e0", "decode": "e9"}]),
        "kv_transfer_pairs[0].decode: unknown engine 'e9'",
    ),
    (
        "decode-only-engine-as-prefill",
        _all(
            _set("engines.2.roles", ["decode"]),
            _set(
                "kv_transfer_pairs",
                [{"prefill": "e0", "decode": "e3"}, {"prefill": "e2", "decode": "e3"}],
            ),
        ),
        "kv_transfer_pairs[1].prefill: engine 'e2' cannot prefill (its permitted roles: decode)",
    ),
    (
        "self-pair",
        _set("kv_transfer_pairs", [{"prefill": "e1", "decode": "e1"}]),
        "kv_transfer_pairs[0]: pair from engine 'e1' to itself",
    ),
    (
        "duplicate-pair",
        _set(
            "kv_transfer_pairs",
            [{"prefill": "e0", "decode": "e2"}, {"prefill": "e0", "decode": "e2"}],
        ),
        "kv_transfer_pairs[1]: duplicate pair e0 -> e2",
    ),
    (
        "pair-missing-side",
        _set("kv_transfer_pairs", [{"prefill": "e0"}]),
        "kv_transfer_pairs[0].decode: required field is missing",
    ),
    (
        "pairs-wrong-string",
        _set("kv_transfer_pairs", "any"),
        "kv_transfer_pairs: expected 'all' or a list of transfer pairs (got 'any')",
    ),
    (
        "no-permitted-pair",
        _set("kv_transfer_pairs", []),
        "kv_transfer_pairs: no permitted pair: KV must be able to move from a prefill-capable "
        "engine to a different decode-capable engine",
    ),
    (
        "first-token-timeout-above-ttft",
        _set("engine.first_token_timeout_s", 12),
        "engine.first_token_timeout_s: 12.0 must be below budgets.ttft_s (10.0)",
    ),
    (
        "first-token-timeout-equal-to-ttft",
        _set("engine.first_token_timeout_s", 10.0),
        "engine.first_token_timeout_s: 10.0 must be below budgets.ttft_s (10.0)",
    ),
    (
        "request-timeout-below-first-token-timeout",
        _set("engine.request_timeout_s", 2),
        "engine.request_timeout_s: 2.0 must be above engine.first_token_timeout_s (2.5)",
    ),
    (
        "role-minimums-exceed-engines",
        _all(_set("roles.min_prefill", 3), _set("roles.min_decode", 2)),
        "roles: min_prefill + min_decode = 5 exceeds the number of engines (4)",
    ),
    (
        "too-few-decode-capable",
        _all(
            _set("engines.0.roles", ["prefill"]),
            _set("engines.1.roles", ["prefill"]),
            _set("engines.2.roles", ["prefill"]),
            _set("engines.2.initial_role", "prefill"),
            _set("roles.min_decode", 2),
        ),
        "roles.min_decode: at least 2 engines must be decode-capable, found 1 (e3)",
    ),
    (
        "initial-roles-below-minimum",
        _set("roles.min_prefill", 3),
        "roles.min_prefill: at least 3 engines must start as prefill (initial_role), "
        "found 2 (e0, e1)",
    ),
    (
        "url-without-port",
        _set("engines.1.url", "http://127.0.0.1"),
        "engines[1].url: URL must name a port (got 'http://127.0.0.1')",
    ),
    (
        "url-with-path",
        _set("engines.1.url", "http://127.0.0.1:18101/v1"),
        "engines[1].url: URL must not have a path (got 'http://127.0.0.1:18101/v1')",
    ),
    (
        "url-wrong-scheme",
        _set("engines.1.url", "grpc://127.0.0.1:18101"),
        "engines[1].url: URL scheme must be http or https (got 'grpc://127.0.0.1:18101')",
    ),
    (
        "url-with-query",
        _set("engines.1.url", "http://127.0.0.1:18101?x=1"),
        "engines[1].url: URL must not have a query or fragment (got 'http://127.0.0.1:18101?x=1')",
    ),
    (
        "url-with-credentials-is-not-echoed",
        _set("engines.1.url", "http://admin:hunter2@127.0.0.1:18101"),
        "engines[1].url: URL must not carry credentials",
    ),
    (
        "attestation-url-not-http",
        _set("engines.1.attestation_url", "file:///etc/passwd"),
        "engines[1].attestation_url: URL scheme must be http or https (got 'file:///etc/passwd')",
    ),
    # Accepted, then tracebacks in narwhal-serve and narwhal-check (a CLI fuzz pass).
    (
        "key-file-with-a-nul",
        _set("engine.api_key_file", "a\u0000b"),
        "engine.api_key_file: path must not contain a NUL character",
    ),
    (
        "attestation-url-port-not-a-number",
        _set("engines.1.attestation_url", "http://h:8a/attestation"),
        "engines[1].attestation_url: URL port is not a number from 1 to 65535 "
        "(got 'http://h:8a/attestation')",
    ),
    (
        "attestation-url-port-zero",
        _set("engines.1.attestation_url", "http://h:0/attestation"),
        "engines[1].attestation_url: URL port is not a number from 1 to 65535 "
        "(got 'http://h:0/attestation')",
    ),
    (
        "attestation-url-port-past-65535",
        _set("engines.1.attestation_url", "http://h:99999/attestation"),
        "engines[1].attestation_url: URL port is not a number from 1 to 65535 "
        "(got 'http://h:99999/attestation')",
    ),
    (
        "attainment-above-one",
        _set("budgets.attainment", 1.5),
        "budgets.attainment: must be less than or equal to 1 (got 1.5)",
    ),
    (
        "attainment-zero",
        _set("budgets.attainment", 0),
        "budgets.attainment: must be greater than 0 (got 0)",
    ),
    (
        "min-decode-negative",
        _set("roles.min_decode", -1),
        "roles.min_decode: must be greater than or equal to 0 (got -1)",
    ),
    (
        "bad-sha256-uppercase",
        _set(
            "model.config_sha256",
            "9710E121A58D03AC92C8D6DA287A19541994319AFBBE6D6202AF001FFD379213",
        ),
        "model.config_sha256: must be 64 lowercase hex digits "
        "(got '9710E121A58D03AC92C8D6DA287A19541994319AFBBE6D6202AF001FFD379213')",
    ),
    (
        "bad-profile-store-sha256",
        _set("profile_store", {"path": "profiles/store.json", "sha256": "abc"}),
        "profile_store.sha256: must be 64 lowercase hex digits (got 'abc')",
    ),
    (
        "wrong-schema",
        _set("schema", "narwhal.fleet/v2"),
        "schema: must be narwhal.fleet/v1 (got 'narwhal.fleet/v2')",
    ),
    (
        "wrong-kv-connector",
        _set("engine.kv_connector", "LMCacheConnector"),
        "engine.kv_connector: must be NixlConnector (got 'LMCacheConnector')",
    ),
    (
        "nan-from-code",
        _set("budgets.tpot_s", float("nan")),
        "budgets.tpot_s: must be a finite number (got nan)",
    ),
    (
        "several-problems-first-in-document-order",
        _all(
            _set("engines.3.colour", "teal"),
            _delete("budgets.ttft_s"),
            _set("name", ""),
        ),
        "name: must not be empty (and 2 more problems)",
    ),
    (
        "local-prefill-zero-tokens",
        _set("routing", {"local_prefill": {"enabled": True, "max_prompt_tokens": 0}}),
        "routing.local_prefill.max_prompt_tokens: must be greater than or equal to 1 (got 0)",
    ),
    (
        "local-prefill-enabled-not-boolean",
        _set("routing", {"local_prefill": {"enabled": "yes"}}),
        "routing.local_prefill.enabled: expected a boolean (got 'yes')",
    ),
    (
        "local-prefill-beyond-max-model-len",
        _set("routing", {"local_prefill": {"enabled": True, "max_prompt_tokens": 16385}}),
        "routing.local_prefill.max_prompt_tokens: 16385 must not exceed model.max_model_len "
        "(16384)",
    ),
    (
        "two-problems",
        _all(_set("engines.1.nixl.port", 0), _set("engines.3.nixl.port", 0)),
        "engines[1].nixl.port: must be greater than or equal to 1 (got 0) (and 1 more problem)",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [pytest.param(m, e, id=i) for i, m, e in INVALID_CASES],
)
def test_invalid_fleet_message(mutate: Callable[[Doc], None], expected: str) -> None:
    doc = sim_doc()
    mutate(doc)
    assert parse_error(doc) == f"fleet.json: {expected}"


def test_error_attributes() -> None:
    doc = sim_doc()
    doc["engines"][2]["roles"][0] = "prefil"
    with pytest.raises(ContractError) as info:
        parse_fleet(doc, "fleet.json")
    err = info.value
    assert err.source == "fleet.json"
    assert err.path == "engines[2].roles[0]"
    assert err.reason == "'prefil' is not one of prefill, decode"
    assert err.problems == (("engines[2].roles[0]", "'prefil' is not one of prefill, decode"),)


def test_error_lists_every_problem() -> None:
    doc = sim_doc()
    doc["engines"][3]["colour"] = "teal"
    del doc["budgets"]["ttft_s"]
    with pytest.raises(ContractError) as info:
        parse_fleet(doc, "fleet.json")
    assert info.value.problems == (
        ("budgets.ttft_s", "required field is missing"),
        ("engines[3].colour", "unknown field"),
    )


def test_error_is_one_line_without_traceback() -> None:
    doc = sim_doc()
    doc["engines"][0]["bad\nkey"] = 1
    doc["engines"][1]["nixl"]["port"] = "12\n34"
    message = parse_error(doc)
    assert "\n" not in message and "\r" not in message
    assert "Traceback" not in message
    assert "pydantic" not in message
    assert message == ("fleet.json: engines[0].bad\\nkey: unknown field (and 1 more problem)")


def test_top_level_must_be_an_object() -> None:
    assert parse_error([1, 2]) == "fleet.json: top level must be a JSON object (got a list)"


# --- file errors ----------------------------------------------------------------------------


def _load_error(path: Path) -> ContractError:
    with pytest.raises(ContractError) as info:
        load_fleet(path)
    assert "\n" not in str(info.value)
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    err = _load_error(path)
    assert str(err) == f"{path}: cannot read: No such file or directory"
    assert err.path == ""


def test_string_path_is_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ContractError) as info:
        load_fleet("fleet.json")
    assert str(info.value) == "fleet.json: cannot read: No such file or directory"


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text('{\n  "schema": "narwhal.fleet/v1",\n  "name": "x"\n  "model": {}\n}\n')
    assert str(_load_error(path)) == (
        f"{path}: invalid JSON at line 4 column 3: Expecting ',' delimiter"
    )


def test_top_level_array_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text("[]")
    assert str(_load_error(path)) == f"{path}: top level must be a JSON object (got a list)"


def test_duplicate_key_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(
        SIM_FLEET.read_text().replace('"name": "local-sim",', '"name": "a", "name": "b",')
    )
    assert str(_load_error(path)) == f"{path}: invalid JSON: duplicate key 'name'"


def test_non_finite_number_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(SIM_FLEET.read_text().replace('"tpot_s": 0.3', '"tpot_s": NaN'))
    assert str(_load_error(path)) == f"{path}: invalid JSON: NaN is not a finite number"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("1e999", "1e999 is not a finite number"),  # valid JSON that reads as infinity
        ("-1e999", "-1e999 is not a finite number"),
        ("9" * 5000, "a number too long to read"),  # past Python's 4,300 digits
    ],
)
def test_a_number_no_field_can_hold_is_refused_naming_the_file(
    tmp_path: Path, value: str, reason: str
) -> None:
    """Found by a CLI fuzz pass: these were tracebacks (a profile store, a check report, a
    limits file: infinity reached the hashing; 5,000 digits Python's int conversion)."""
    path = tmp_path / "fleet.json"
    path.write_text(SIM_FLEET.read_text().replace('"tpot_s": 0.3', f'"tpot_s": {value}'))
    assert str(_load_error(path)) == f"{path}: invalid JSON: {reason}"
    store = tmp_path / "store.json"
    store.write_text(f'{{"wall_s": {value}}}')
    with pytest.raises(ContractError, match="invalid JSON"):
        read_json_document(store)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_bytes(b'{"name": "\xff"}')
    assert str(_load_error(path)) == f"{path}: not UTF-8 (byte 10: invalid start byte)"


def test_validation_error_from_file_names_the_file(tmp_path: Path) -> None:
    doc = sim_doc()
    doc["budgets"]["tpot_s"] = -0.3
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(doc))
    assert str(_load_error(path)) == f"{path}: budgets.tpot_s: must be greater than 0 (got -0.3)"


def test_fleet_contract_validates_when_built_directly() -> None:
    # The cross-field rules run inside the model too, so code that builds a contract without
    # the loader cannot get an inconsistent one.
    doc = copy.deepcopy(minimal_doc())
    doc["engines"][1]["id"] = "e0"
    with pytest.raises(ValueError, match="duplicate engine id 'e0'"):
        FleetContract.model_validate(doc)


def _fleet_with_key_file(directory: Path, key_file: str) -> Path:
    doc = minimal_doc()
    doc["engine"]["api_key_file"] = key_file
    path = directory / "fleet.json"
    path.write_text(json.dumps(doc))
    return path


def test_engine_api_key_file_is_read_relative_to_the_fleet_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "engine.key").write_text("  k-123 \n")
    path = _fleet_with_key_file(tmp_path, "secrets/engine.key")
    monkeypatch.chdir(REPO)  # not the fleet's directory: the path is the fleet file's
    loaded = load_fleet(path)
    assert loaded.engine_api_key == "k-123"
    assert loaded.contract.engine.api_key_file == "secrets/engine.key"
    assert "k-123" not in repr(loaded)
    # The pure parser reads no file: no key, and the document's hash does not depend on it.
    parsed = parse_fleet(json.loads(path.read_text()), str(path))
    assert parsed.engine_api_key is None
    assert parsed.sha256 == loaded.sha256
    # Where the key is read from, for a command that must not overwrite it.
    assert loaded.api_key_path == tmp_path / "secrets" / "engine.key"
    assert load_fleet(SIM_FLEET).api_key_path is None


@pytest.mark.parametrize(
    ("content", "reason"),
    [(None, "cannot read"), ("  \n", "is empty"), ("a\nb\n", "one line")],
    ids=["missing", "empty", "two-lines"],
)
def test_a_bad_engine_api_key_file_is_a_one_line_error_naming_the_field(
    tmp_path: Path, content: str | None, reason: str
) -> None:
    if content is not None:
        (tmp_path / "engine.key").write_text(content)
    path = _fleet_with_key_file(tmp_path, "engine.key")
    with pytest.raises(ContractError) as caught:
        load_fleet(path)
    message = str(caught.value)
    assert caught.value.path == "engine.api_key_file"
    assert reason in message and str(tmp_path / "engine.key") in message
    assert "\n" not in message and "a\\nb" not in message


def test_engine_api_key_file_must_not_be_empty_in_the_document() -> None:
    doc = minimal_doc()
    doc["engine"]["api_key_file"] = ""
    assert parse_error(doc) == "fleet.json: engine.api_key_file: must not be empty"


def test_a_path_in_the_home_of_an_unknown_user_names_its_field(tmp_path: Path) -> None:
    """``~nosuchuser/k`` was a RuntimeError traceback wherever the file was opened."""
    doc = json.loads(SIM_FLEET.read_text())
    doc["engine"]["api_key_file"] = "~narwhal-no-such-user/k"
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(doc))
    assert str(_load_error(path)) == (
        f"{path}: engine.api_key_file: names the home of a user this host does not know "
        "(got '~narwhal-no-such-user/k')"
    )
    del doc["engine"]["api_key_file"]
    doc["profile_store"] = {"path": "~narwhal-no-such-user/s.json", "sha256": "0" * 64}
    path.write_text(json.dumps(doc))
    with pytest.raises(ContractError, match=r"profile_store\.path: names the home of a user"):
        _ = load_fleet(path).profile_store_path


def test_a_device_is_refused_and_a_pipe_is_read(tmp_path: Path) -> None:
    """/dev/zero was read without end (a CLI fuzz pass); a pipe, as a shell's process
    substitution gives one (``--fleet <(jq ... fleet.json)``), is read to its end."""
    path = Path("/dev/zero")
    assert str(_load_error(path)) == f"{path}: cannot read: not a regular file or a pipe"
    with pytest.raises(ContractError, match="not a regular file or a pipe"):
        read_json_document(path)
    read, write = os.pipe()
    try:
        os.write(write, SIM_FLEET.read_bytes())
        os.close(write)
        write = -1
        assert load_fleet(f"/dev/fd/{read}").contract.name == "local-sim"
    finally:
        os.close(read)
        if write != -1:
            os.close(write)


def test_a_profile_store_or_limits_file_is_read_without_coercion(tmp_path: Path) -> None:
    """true was read as 1 for a number in a profile store or a limits file (a CLI fuzz pass):
    files people can edit are read strictly, as the fleet is."""
    from narwhal.profiles.store import ProfilingLimits

    # (A store: tests/integration/test_profile_v1.py, on one narwhal-profile wrote.)
    limits = {
        "schema": "narwhal.profiling-limits/v1",
        "max_wall_s_per_engine": 10,
        "max_tokens_per_engine": 1000,
        "probe_timeout_s": True,
    }
    with pytest.raises(ContractError, match=r"probe_timeout_s: expected a number \(got true\)"):
        validate_document(limits, ProfilingLimits, "limits.json", strict=True)


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        # The schema key last: the first problem was "engines: unknown field".
        (
            {"engines": [], "fits": {}, "schema": "narwhal.profile-store/v1"},
            "schema: must be narwhal.check-report/v1 (got 'narwhal.profile-store/v1')",
        ),
        ({"engines": [], "fits": {}}, "schema: required field is missing"),
    ],
)
def test_a_file_of_another_format_is_named_by_its_schema_first(doc: Doc, says: str) -> None:
    with pytest.raises(ContractError) as refused:
        validate_document(doc, CheckReport, "r.json")
    assert str(refused.value).startswith(f"r.json: {says} (and ")


def test_a_simulated_engines_block_bytes_must_be_the_fleets() -> None:
    doc = minimal_doc()
    doc["engine"]["prefix_caching"] = {"block_bytes": 65536}
    doc["engines"][1]["sim"] = {"block_bytes": 16384}
    message = parse_error(doc)
    assert "engines[1].sim.block_bytes" in message, message
    assert "differs from engine.prefix_caching.block_bytes (65536)" in message, message
    doc["engines"][1]["sim"] = {"block_bytes": 65536}
    assert parse_fleet(doc).contract.engine.prefix_caching.block_bytes == 65536
    doc["engine"]["prefix_caching"] = {"block_bytes": 0}
    assert "block_bytes" in parse_error(doc)
