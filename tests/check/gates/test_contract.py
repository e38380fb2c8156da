"""The contract gate against recorded attestations."""

from __future__ import annotations

from typing import Any

from narwhal.check.gates.contract import contract_gate
from tests.check.support import attestation, fleet_doc, loaded


def test_contract_passes_unpinned_hashes_as_evidence_and_fails_disagreement() -> None:
    fleet = loaded(fleet_doc(3)).contract
    docs = {e.id: attestation(fleet, e) for e in fleet.engines}
    ok = contract_gate(fleet, docs, {})
    assert ok.verdict == "pass", ok.failures
    assert any("shard_manifest_sha256 is not pinned" in n for n in ok.notes)
    assert ok.evidence["engines"]["e0"]["shard_manifest_sha256"]["match"] is None

    docs["e1"] = attestation(fleet, fleet.engines[1], shard_manifest_sha256="b" * 64)
    out = contract_gate(fleet, docs, {})
    assert out.verdict == "fail"
    assert out.failures == [
        f"engines disagree on shard_manifest_sha256: e0, e2 {'a' * 12}…; e1 {'b' * 12}…"
    ]


def test_contract_compares_pinned_identity_and_engine_facts() -> None:
    doc = fleet_doc(2)
    doc["model"]["config_sha256"] = "c" * 64
    doc["engines"][1]["generation"] = "gen-old"
    fleet = loaded(doc).contract
    e0, e1 = fleet.engines
    docs: dict[str, dict[str, Any] | None] = {
        "e0": attestation(fleet, e0, config_sha256="d" * 64, tp=4, engine_id="e9"),
        "e1": attestation(fleet, e1, nixl={"host": "127.0.0.1", "port": 1}),
    }
    out = contract_gate(fleet, docs, {})
    text = "\n".join(out.failures)
    assert "e0: attested config_sha256" in text
    assert "e0: attested tp 4 differs from the fleet's 8" in text
    assert "is engine 'e9''s" in text
    assert (
        f"e1: attested nixl 127.0.0.1:1 differs from the fleet's 127.0.0.1:{e1.nixl.port}" in text
    )
    assert "e1: attested generation gen-e1 differs from the fleet's gen-old" in text
    missing = contract_gate(fleet, {"e0": docs["e0"], "e1": None}, {"e1": "timed out"})
    assert "e1: no attestation to check (timed out)" in missing.failures


def test_model_ids_are_printed_whole_and_only_digests_cut_short() -> None:
    """A model id is no hash: cut at 12 characters, "moonshotai/K…" hides what differs."""
    doc = fleet_doc(3)
    doc["model"]["id"] = "moonshotai/Kimi-K3"
    fleet = loaded(doc).contract
    docs: dict[str, dict[str, Any] | None] = {e.id: attestation(fleet, e) for e in fleet.engines}
    docs["e2"] = attestation(fleet, fleet.engines[2], model_id="moonshotai/Kimi-K3-Instruct")
    out = contract_gate(fleet, docs, {})
    assert (
        "e2: attested model_id moonshotai/Kimi-K3-Instruct differs from the fleet's "
        "moonshotai/Kimi-K3" in out.failures
    ), out.failures
    assert (
        "engines disagree on model_id: e0, e1 moonshotai/Kimi-K3; e2 moonshotai/Kimi-K3-Instruct"
        in out.failures
    ), out.failures
    # Digests stay short: sha256:-named ones and a sidecar's g-prefixed generation too.
    docs = {e.id: attestation(fleet, e) for e in fleet.engines}
    docs["e1"] = attestation(fleet, fleet.engines[1], image_digest="sha256:" + "e" * 64)
    docs["e0"] = attestation(fleet, fleet.engines[0], image_digest="sha256:" + "f" * 64)
    out = contract_gate(fleet, docs, {})
    assert any(
        f.startswith("engines disagree on image_digest:") and "sha256:eeeee…" in f
        for f in out.failures
    ), out.failures
