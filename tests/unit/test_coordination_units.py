"""The pure parts of replica coordination: the shared roles document, the etcd URL, the fleet's
demand summed over replicas, and narwhal-serve's refusals of bad coordination flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.clock import VirtualClock
from narwhal.coordination import SharedRoles, parse_coordination_url
from narwhal.coordination.replica import HISTORY_KEPT, namespace_of
from narwhal.routing.roles import DemandSnapshot, DemandTracker, FleetDemand
from narwhal.serve.cli import main
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
