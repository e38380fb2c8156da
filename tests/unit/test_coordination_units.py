"""The pure parts of replica coordination: the shared roles document, the etcd URL, the fleet's
demand summed over replicas, and narwhal-serve's refusals of bad coordination flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.coordination import SharedRoles, parse_coordination_url
from narwhal.coordination.replica import HISTORY_KEPT, namespace_of
from narwhal.metrics import RouterMetrics
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.roles import DemandSnapshot, DemandTracker, FleetDemand
from narwhal.serve.cli import main
from narwhal.serve.roles import RoleService
from narwhal.simengine.fleet import local_fleet_document


def test_a_flip_makes_the_next_generation_and_keeps_a_bounded_history() -> None:
    doc = SharedRoles(
        generation=4, roles={"e0": "prefill", "e1": "decode"}, written_by="a", written_at=1.0
    )
    entry = {"engine": "e1", "from_role": "decode", "to_role": "prefill", "reason": "r"}
    nxt = doc.with_flip(entry, "b", 2.0)
    assert nxt.generation == 5 and nxt.roles == {"e0": "prefill", "e1": "prefill"}
    assert nxt.history[-1] == {**entry, "role_generation": 5, "decided_by": "b"}
    assert doc.roles["e1"] == "decode"  # the document read is unchanged
    pinned = nxt.with_pinned(True, "c", 3.0)
    assert pinned.pinned and pinned.generation == 5 and pinned.written_by == "c"
    assert SharedRoles.model_validate_json(pinned.encode()) == pinned
    many = doc
    for _ in range(HISTORY_KEPT + 5):
        many = many.with_flip(entry, "a", 0.0)
    assert len(many.history) == HISTORY_KEPT
    assert many.history[-1]["role_generation"] == many.generation == 4 + HISTORY_KEPT + 5
    with pytest.raises(ValueError):
        SharedRoles.model_validate_json(b'{"generation": 1, "roles": {"e0": "both"}}')


def test_coordination_urls() -> None:
    assert parse_coordination_url("etcd://10.0.0.1:2379") == ["http://10.0.0.1:2379"]
    assert parse_coordination_url("etcd://a:2379,b:2379/") == ["http://a:2379", "http://b:2379"]
    for bad in ("http://a:2379", "a:2379", "etcd://a", "etcd://a:x", "etcd://a:2379/path"):
        with pytest.raises(ValueError):
            parse_coordination_url(bad)
    assert namespace_of("fleet", "ab" * 32) == "/narwhal/fleet/" + "ab" * 8 + "/"


def test_fleet_demand_sums_every_replicas_window() -> None:
    clock = VirtualClock()
    local = DemandTracker(clock, window_s=10.0, started_at=clock.now() - 10.0)
    for _ in range(10):
        local.record_start(0.2, 1000, 100)
    other = DemandSnapshot(
        span_s=10.0,
        requests=30,
        prefill_s=3.0,
        output_tokens=30 * 300,
        context_tokens=30 * (500 + 150),
        queued_prefill_s=1.5,
    )
    fleet = FleetDemand(local, [other])
    assert fleet.rate() == pytest.approx(1.0 + 3.0)
    assert fleet.prefill_work_rate() == pytest.approx(0.2 + 0.3)
    assert fleet.mean_output_tokens() == pytest.approx((10 * 100 + 30 * 300) / 40)
    assert fleet.mean_context() == pytest.approx((10 * 1050 + 30 * 650) / 40)
    assert fleet.others_queued_prefill_s() == 1.5
    assert local.others_queued_prefill_s() == 0.0
    # A replica's own window round-trips through what it publishes.
    snap = local.snapshot(0.25)
    assert (snap.requests, snap.prefill_s, snap.queued_prefill_s) == (10, pytest.approx(2.0), 0.25)
    alone = FleetDemand(local, [])
    assert (alone.rate(), alone.mean_output_tokens()) == (local.rate(), local.mean_output_tokens())
    empty = FleetDemand(DemandTracker(clock), [])
    assert empty.mean_context() == 0.0


TTL_1 = ["--coordination-lease-ttl", "1"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--coordination", "http://127.0.0.1:2379", "--replica-id", "a"], "--coordination: "),
        (["--coordination", "etcd://127.0.0.1:2379"], "needs --replica-id"),
        (
            ["--coordination", "etcd://127.0.0.1:0", "--replica-id", "a"],
            "--coordination: etcd member '127.0.0.1:0': port is not 1-65535",
        ),
        (["--replica-id", "a b"], "--replica-id: 'a b' is not a name"),
        (["--coordination", "", "--replica-id", "a"], "--coordination: expected etcd://"),
        (
            ["--coordination", "etcd://127.0.0.1:99999", "--replica-id", "a"],
            "--coordination: etcd member '127.0.0.1:99999': port is not 1-65535",
        ),
        (
            [
                "--coordination",
                "etcd://127.0.0.1:2379",
                "--replica-id",
                "a",
                "--coordination-lease-ttl",
                "3601",
            ],
            "--coordination-lease-ttl: at most 3600 seconds",
        ),
        (
            ["--coordination", "etcd://127.0.0.1:2379", "--replica-id", "a", *TTL_1],
            "--coordination-lease-ttl: at least 2",
        ),
    ],
)
def test_bad_coordination_flags_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(local_fleet_document([18001, 18002], [18101, 18102])))
    argv = ["--fleet", str(fleet), "--journal", str(tmp_path / "j.jsonl"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("narwhal-serve: ") and message in err, err
    assert "Traceback" not in err


class _RecordedJournal:
    """What the role service journals, in order (the journal's file is not under test)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, object]]] = []

    def record(self, kind: str, **fields: object) -> None:
        self.records.append((kind, fields))

    def role_flip(self, **fields: object) -> None:
        self.records.append(("role.flip", fields))


def _role_service() -> tuple[RoleService, _RecordedJournal]:
    loaded = parse_fleet(local_fleet_document([1, 2, 3, 4], [5, 6, 7, 8]), "fleet.json")
    clock = VirtualClock()
    journal = _RecordedJournal()
    service = RoleService(
        loaded.contract,
        FleetState(loaded.contract, clock),
        RouterMetrics(["e0", "e1", "e2", "e3"], "local-sim", "0" * 64, None),
        journal,  # type: ignore[arg-type]
        DemandTracker(clock, window_s=10.0),
        None,
    )
    return service, journal


def _three_flips_applied() -> tuple[RoleService, _RecordedJournal, dict[str, str], SharedRoles]:
    """A replica that synced at generation 0 and applied three flips (e1 to decode and back,
    e2 to prefill): the service, its journal, the roles at 0 and the document at 3."""
    service, journal = _role_service()
    roles = {"e0": "prefill", "e1": "prefill", "e2": "decode", "e3": "decode"}
    doc = SharedRoles(generation=0, roles=roles, written_by="a", written_at=0.0)
    service.apply_shared(doc)
    for engine, role in (("e1", "decode"), ("e1", "prefill"), ("e2", "prefill")):
        doc = _flipped(doc, engine, role)
        service.apply_shared(doc)
    return service, journal, roles, doc


def _flipped(doc: SharedRoles, engine: str, to_role: str) -> SharedRoles:
    entry = {"engine": engine, "from_role": doc.roles[engine], "to_role": to_role, "reason": "r"}
    return doc.with_flip(entry, "leader", 0.0)


def test_a_document_gone_back_a_generation_is_a_sync_not_a_replay_of_flips() -> None:
    # etcd restored from a backup, or wiped and re-created: the document's generation is below
    # what the replica applied. Each change is journaled once, and a later document whose
    # history holds entries past its own generation replays none of them.
    service, journal = _role_service()
    roles = {"e0": "prefill", "e1": "prefill", "e2": "decode", "e3": "decode"}
    doc = SharedRoles(generation=0, roles=roles, written_by="a", written_at=0.0)
    service.apply_shared(doc)
    assert [k for k, _ in journal.records] == ["role.sync"]
    for engine, role in (("e1", "decode"), ("e1", "prefill"), ("e2", "prefill")):
        doc = _flipped(doc, engine, role)
        service.apply_shared(doc)
    assert [k for k, _ in journal.records] == ["role.sync", *["role.flip"] * 3]
    assert service.state.role_generation == 3
    journal.records.clear()

    # Restored at generation 1 (e1 decode, e2 decode): adopted whole, one sync, no flips.
    restored = SharedRoles(
        generation=1,
        roles={"e0": "prefill", "e1": "decode", "e2": "decode", "e3": "decode"},
        history=doc.history[:1],
        written_by="restore",
        written_at=0.0,
    )
    service.apply_shared(restored)
    assert [(k, f.get("regressed_from")) for k, f in journal.records] == [("role.sync", 3)]
    assert service.state.engines["e1"].role == "decode"
    assert service.state.engines["e2"].role == "decode"
    assert service.state.role_generation == 1
    assert [e["role_generation"] for e in service.history] == [1]
    journal.records.clear()

    # A document whose history holds entries past its generation (written by a replica that
    # had replayed another's), then the same document again at each reconnect: nothing new.
    polluted = restored.model_copy(update={"history": (*doc.history, *doc.history)})
    for _ in range(3):
        service.apply_shared(polluted)
    assert journal.records == []
    assert [e["role_generation"] for e in service.shared_now().history] == [1]

    # The next real flip is journaled once.
    nxt = _flipped(restored, "e3", "prefill")
    service.apply_shared(nxt)
    service.apply_shared(nxt)
    assert [(k, f["engine"]) for k, f in journal.records] == [("role.flip", "e3")]


def test_a_role_change_no_flip_explains_is_journaled_as_a_sync() -> None:
    # A document at a later generation whose history was cut short changes a role without an
    # entry for it: the change is journaled, not applied silently.
    service, journal = _role_service()
    roles = {"e0": "prefill", "e1": "prefill", "e2": "decode", "e3": "decode"}
    service.apply_shared(SharedRoles(generation=2, roles=roles, written_by="a", written_at=0.0))
    journal.records.clear()
    later = SharedRoles(
        generation=5, roles={**roles, "e1": "decode"}, written_by="a", written_at=1.0
    )
    service.apply_shared(later)
    assert [k for k, _ in journal.records] == ["role.sync"]
    assert service.state.engines["e1"].role == "decode"


def test_a_restored_timeline_flipped_past_this_replicas_generation_is_a_sync() -> None:
    # Cut off while etcd was restored to generation 1 and the fleet flipped on to 4, past this
    # replica's 3: the document's generation is higher, but its flip at 3 is another flip.
    # Adopted whole (regressed_from 3), not replayed against the old timeline (a review).
    service, journal, roles, doc = _three_flips_applied()
    journal.records.clear()
    new = SharedRoles(
        generation=1,
        roles={**roles, "e1": "decode"},
        history=doc.history[:1],
        written_by="restore",
        written_at=0.0,
    )
    for engine, role in (("e3", "prefill"), ("e1", "prefill"), ("e0", "decode")):
        new = new.with_flip(
            {"engine": engine, "from_role": new.roles[engine], "to_role": role, "t": 9.0},
            "leader",
            1.0,
        )
    service.apply_shared(new)
    assert [(k, f.get("regressed_from")) for k, f in journal.records] == [("role.sync", 3)]
    assert [e["role_generation"] for e in service.history] == [1, 2, 3, 4]
    assert service.history[-1]["engine"] == "e0"


def test_the_last_entry_of_a_generation_wins_and_a_flip_drops_stale_ones() -> None:
    # A document whose history holds stale entries (a replica wrote back another timeline's)
    # and then the real next flip after them: the real one is journaled, the stale one not;
    # the leader's write keeps no entry at or past its own generation.
    service, journal, roles, doc = _three_flips_applied()
    restored = SharedRoles(
        generation=1,
        roles={**roles, "e1": "decode"},
        history=doc.history[:1],
        written_by="restore",
        written_at=0.0,
    )
    polluted = restored.model_copy(update={"history": (*doc.history, *doc.history)})
    service.apply_shared(polluted)
    journal.records.clear()
    nxt = _flipped(polluted, "e3", "prefill")
    assert [e["role_generation"] for e in nxt.history] == [1, 1, 2]
    service.apply_shared(nxt)
    got = [(k, f.get("engine"), f.get("role_generation")) for k, f in journal.records]
    assert got == [("role.flip", "e3", 2)], got
    assert [(e["role_generation"], e["engine"]) for e in service.history] == [(1, "e1"), (2, "e3")]
