"""narwhal-check's kv_transfer gate listens to the engines' KV event streams while its handoffs
run, as narwhal-serve would: a fleet whose engines publish where the fleet says passes with
their batches, blocks and replay in the evidence; an endpoint nobody publishes on, or a replay
socket that does not answer, fails naming the engine (the router would route to it by its
routing history only, or could not fill a gap)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from narwhal.contract import load_report
from narwhal.testing.fleet import SimFleet
from narwhal.testing.ports import free_ports
from tests.check.support import check, write_json
from tests.helpers import running_fleet

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def publishing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, Path]]:
    directory = tmp_path_factory.mktemp("check-kv-events")
    with running_fleet(directory, 2, kv_events=True) as fleet:
        yield fleet, directory


def _kv_check(fleet: Path, out: Path) -> tuple[int, object]:
    done = check("--fleet", str(fleet), "--gates", "kv_transfer", "--kv-probes", "1",
                 "--kv-prompt-tokens", "512", "--report", str(out))  # fmt: skip
    return done.returncode, load_report(out)[0].gate("kv_transfer")


def test_engines_that_publish_where_the_fleet_says_pass(
    publishing: tuple[SimFleet, Path],
) -> None:
    fleet, directory = publishing
    code, gate = _kv_check(fleet.fleet_path, directory / "ok.json")
    assert code == 0, gate.failures  # type: ignore[attr-defined]
    events = gate.evidence["kv_events"]  # type: ignore[attr-defined]
    assert set(events) == {"e0", "e1"}
    for engine in ("e0", "e1"):  # the prefill engine computed the prompt, e1 pulled it
        seen = events[engine]
        assert seen["batches"] > 0 and seen["stored_blocks"] >= 512 // 16, (engine, seen)
        assert seen["block_sizes"] == [16] and seen["unreadable_batches"] == 0
        assert seen["replay"] == "ok"


@pytest.mark.parametrize("broken", ["endpoint", "replay_endpoint"])
def test_an_engine_whose_events_do_not_arrive_fails_by_name(
    publishing: tuple[SimFleet, Path], broken: str
) -> None:
    fleet, directory = publishing
    doc = json.loads(fleet.fleet_path.read_text())
    (nobody,) = free_ports(1)
    doc["engines"][1]["kv_events"][broken] = f"tcp://127.0.0.1:{nobody}"
    path = write_json(directory / f"{broken}.json", doc)
    code, gate = _kv_check(path, directory / f"{broken}-report.json")
    assert code == 1
    failures = gate.failures  # type: ignore[attr-defined]
    assert len(failures) == 1, failures
    if broken == "endpoint":
        assert failures[0].startswith(
            f"e1: KV events at tcp://127.0.0.1:{nobody}: no batch during its handoffs"
        )
    else:
        assert failures[0].startswith(
            f"e1: KV event replay at tcp://127.0.0.1:{nobody}: no answer within 2 s"
        )
