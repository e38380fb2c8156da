"""The contract gate: each engine's attestation matches the fleet contract, and the engines
agree on everything NIXL peers must share."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from narwhal.check.gates.common import GateOutcome, outcome
from narwhal.contract import FleetContract

__all__ = ["contract_gate"]


# A digest as engines attest one: hex, optionally named (sha256:...) or marked as a sidecar's
# generation (g...). Only these are cut short: their first 12 digits tell them apart, while a
# model id, a revision name or a version cut short may hide the very part that differs.
_DIGEST = re.compile(r"(?:[a-z0-9]+:|g)?[0-9a-f]{16,}")


def _short(value: Any) -> str:
    text = str(value)
    if isinstance(value, str) and _DIGEST.fullmatch(text):
        return text[:12] + "…"
    return text


# Attested values every pair of NIXL peers must share: a decode engine reads the prefill
# engine's KV blocks byte for byte, so model, weights, parallelism, connector and block layout
# must all be the same.
_PEER_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model_id", ("model_id",)),
    ("model_revision", ("model_revision",)),
    ("config_sha256", ("config_sha256",)),
    ("shard_manifest_sha256", ("shard_manifest_sha256",)),
    ("image_digest", ("image_digest",)),
    ("tp", ("tp",)),
    ("gpu_arch", ("gpu_arch",)),
    ("accelerator", ("accelerator",)),
    ("kv_connector", ("kv_connector",)),
    ("kv_role", ("kv_role",)),
    ("kv_buffer_device", ("kv_buffer_device",)),
    ("kv_cache.block_size", ("kv_cache", "block_size")),
    ("kv_cache.block_bytes", ("kv_cache", "block_bytes")),
)


def _get(doc: Mapping[str, Any], path: Sequence[str]) -> Any:
    node: Any = doc
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


@dataclass
class _Comparer:
    """Compares one engine's attested values with the fleet's, recording each row."""

    engine_id: str
    rows: dict[str, Any]
    failures: list[str]

    def __call__(self, what: str, attested: Any, expected: Any, required: bool = True) -> None:
        row: dict[str, Any] = {"fleet": expected, "attested": attested}
        self.rows[what] = row
        if attested is None:
            row["match"] = None if not required else False
            if required:
                self.failures.append(f"{self.engine_id}: the attestation reports no {what}")
            return
        row["match"] = attested == expected
        if attested != expected:
            self.failures.append(
                f"{self.engine_id}: attested {what} {_short(attested)} differs from the "
                f"fleet's {_short(expected)}"
            )


def contract_gate(
    fleet: FleetContract,
    attestations: Mapping[str, dict[str, Any] | None],
    fetch_errors: Mapping[str, str],
) -> GateOutcome:
    """Each engine's attestation matches the fleet, and the engines agree with each other.

    Against the fleet: engine id, model id and revision, config and shard-manifest hashes
    (where the fleet pins them: null means "not pinned", reported but not failed), TP, GPU
    architecture, accelerator, KV connector, role and buffer device (where attested), NIXL side
    channel, generation (where the fleet pins it), readiness, checkpoint drift and a live
    engine process (sidecar attestations). Across engines: every value NIXL peers must share.
    """
    failures: list[str] = []
    notes: list[str] = []
    model, eng = fleet.model, fleet.engine
    per_engine: dict[str, Any] = {}
    for spec in fleet.engines:
        e = spec.id
        doc = attestations.get(e)
        if doc is None:
            why = fetch_errors.get(e) or "the fleet gives no attestation_url"
            failures.append(f"{e}: no attestation to check ({why})")
            per_engine[e] = None
            continue
        rows: dict[str, Any] = {}
        compare = _Comparer(e, rows, failures)
        state = doc.get("state")
        if state not in (None, "ready"):
            failures.append(f"{e}: attestation state is {state!r}, not ready")
        if doc.get("engine_id") is not None and doc.get("engine_id") != e:
            failures.append(
                f"{e}: the attestation at {spec.attestation_url} is engine "
                f"{doc.get('engine_id')!r}'s (wrong URL in the fleet?)"
            )
        compare("model_id", doc.get("model_id"), model.id)
        compare("model_revision", doc.get("model_revision"), model.revision)
        for key in ("config_sha256", "shard_manifest_sha256"):
            pinned = getattr(model, key)
            if pinned is not None:
                compare(key, doc.get(key), pinned)
            else:
                rows[key] = {"fleet": None, "attested": doc.get(key), "match": None}
        compare("tp", doc.get("tp"), eng.tp)
        compare("gpu_arch", doc.get("gpu_arch"), eng.gpu_arch)
        compare("accelerator", doc.get("accelerator"), eng.accelerator, required=False)
        compare("kv_connector", doc.get("kv_connector"), eng.kv_connector, required=False)
        compare("kv_role", doc.get("kv_role"), eng.kv_role, required=False)
        compare(
            "kv_buffer_device", doc.get("kv_buffer_device"), eng.kv_buffer_device, required=False
        )
        nixl = doc.get("nixl")
        expected_nixl = f"{spec.nixl.host}:{spec.nixl.port}"
        attested_nixl = (
            f"{nixl.get('host')}:{nixl.get('port')}" if isinstance(nixl, Mapping) else None
        )
        compare("nixl", attested_nixl, expected_nixl, required=False)
        if attested_nixl is None:
            notes.append(f"{e}: the attestation does not report its NIXL side channel")
        if spec.generation is not None:
            compare("generation", doc.get("generation"), spec.generation)
        else:
            rows["generation"] = {"fleet": None, "attested": doc.get("generation"), "match": None}
        drift = doc.get("drift")
        if isinstance(drift, list) and drift:
            first = drift[0] if isinstance(drift[0], Mapping) else {}
            failures.append(
                f"{e}: the checkpoint drifted since it was attested: {first.get('path')} "
                f"{first.get('kind')} ({len(drift)} change(s))"
            )
        if doc.get("engine_alive") is False:
            failures.append(f"{e}: the attestation's engine process (pid {doc.get('pid')}) is gone")
        per_engine[e] = rows
    for key in ("config_sha256", "shard_manifest_sha256"):
        if getattr(model, key) is None:
            notes.append(f"model.{key} is not pinned by the fleet: compared across engines only")

    # Agreement between engines, on what they attest (whatever the fleet pins).
    agreement: dict[str, Any] = {}
    for what, path in _PEER_KEYS:
        # Keyed by repr: values may be unhashable (lists) and 1 must differ from "1".
        groups: dict[str, tuple[Any, list[str]]] = {}
        for e, doc in attestations.items():
            if doc is None:
                continue
            value = _get(doc, path)
            if value is not None:
                groups.setdefault(repr(value), (value, []))[1].append(e)
        if not groups:
            continue
        agreement[what] = [{"value": v, "engines": sorted(ids)} for v, ids in groups.values()]
        if len(groups) > 1:
            ranked = sorted(groups.values(), key=lambda vi: (-len(vi[1]), sorted(vi[1])))
            parts = [f"{', '.join(sorted(ids))} {_short(value)}" for value, ids in ranked]
            failures.append(f"engines disagree on {what}: {'; '.join(parts)}")
    return outcome(
        f"{len(fleet.engines)} attestations match the fleet and each other",
        failures,
        notes,
        {"engines": per_engine, "agreement": agreement},
    )
