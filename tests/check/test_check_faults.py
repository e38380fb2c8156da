"""Identity gates against simulated engines started wrong: each fails for its own reason and
names the engine. No profile store is needed (pace and slo are not run here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal.contract import CheckReport, load_report
from tests.check.support import check
from tests.helpers import running_fleet

pytestmark = pytest.mark.slow

# Timing does not matter to these gates: fast engines.
SIM = {"time_scale": 50.0}


def _check(fleet_path: Path, directory: Path, gates: str) -> tuple[int, CheckReport, str]:
    out = directory / "report.json"
    r = check("--fleet", str(fleet_path), "--gates", gates, "--report", str(out), timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, load_report(out)[0], r.stdout


def test_different_model_seed_fails_generation_and_contract(tmp_path: Path) -> None:
    with running_fleet(tmp_path, 3, sim=SIM, engine_args={"e1": ["--model-seed", "7"]}) as fleet:
        code, report, stdout = _check(fleet.fleet_path, tmp_path, "contract,generation")
    assert code == 1
    generation = report.gate("generation")
    assert generation.failures == [
        "e1 generated different tokens from e0, e2 for the same prompt: different weights or "
        "configuration"
    ]
    assert generation.evidence["distinct_outputs"] == 2
    contract = report.gate("contract")
    assert len(contract.failures) == 1, contract.failures
    assert contract.failures[0].startswith("engines disagree on shard_manifest_sha256: e0, e2 ")
    assert "; e1 " in contract.failures[0]
    assert "e1 generated different tokens" in stdout


def test_wrong_served_model_name_fails_model(tmp_path: Path) -> None:
    with running_fleet(tmp_path, 3, sim=SIM, engine_args={"e1": ["--model", "other/model"]}) as f:
        code, report, _ = _check(f.fleet_path, tmp_path, "model")
    assert code == 1
    model = report.gate("model")
    assert model.failures == ["e1: serves 'other/model', not exactly 'moonshotai/Kimi-K3'"]
    assert model.evidence["engines"]["e0"]["ids"] == ["moonshotai/Kimi-K3"]


def test_different_vocabulary_fails_tokenization_not_generation(tmp_path: Path) -> None:
    with running_fleet(tmp_path, 3, sim=SIM, engine_args={"e2": ["--vocab-seed", "7"]}) as fleet:
        code, report, _ = _check(fleet.fleet_path, tmp_path, "generation,tokenization")
    assert code == 1
    tokenization = report.gate("tokenization")
    assert len(tokenization.failures) == 1, tokenization.failures
    assert tokenization.failures[0].startswith("e2 tokenizes ")
    assert "differently from e0" in tokenization.failures[0]
    assert list(tokenization.evidence["disagreeing_engines"]) == ["e2"]
    # The same token ids give the same tokens: the weights agree, only the tokenizer differs.
    assert report.gate("generation").verdict == "pass"


def test_an_engine_that_is_down_fails_health_and_blocks_the_rest(tmp_path: Path) -> None:
    with running_fleet(tmp_path, 3, sim=SIM) as fleet:
        fleet.kill("e2")
        code, report, _ = _check(fleet.fleet_path, tmp_path, "health,contract,kv_transfer")
    assert code == 1
    health = report.gate("health")
    assert [f.split(":")[0] for f in health.failures] == ["e2", "e2"]
    assert "/health did not answer 200" in health.failures[0]
    for name in ("contract", "kv_transfer"):
        skip = report.gate(name).skip
        assert skip is not None and skip.kind == "blocked"
    assert report.engines["e2"].generation is None
