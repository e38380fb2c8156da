"""The virtual-time simulator against the live simulated fleet on the same workload: attainment
and TTFT/TPOT medians agree within 10%. The larger version is ``bench/des_agreement.py``; both
use ``narwhal.fleetsim.agreement``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from narwhal.contract import load_fleet
from narwhal.fleetsim.agreement import compare, leg_overhead_s, replay, run_des_like_live
from narwhal.fleetsim.workloads import poisson_requests, timings_of
from narwhal.profiles.store import ProfileStore, engine_models
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, running_fleet, running_router
from tests.integration.test_profile_v1 import profile, write_limits

pytestmark = pytest.mark.slow

SCALE = 2.0


def test_des_agrees_with_the_live_fleet(tmp_path: Path) -> None:
    with running_fleet(
        tmp_path,
        4,
        sim={"time_scale": SCALE},
        ttft_s=10 / SCALE,
        tpot_s=0.3 / SCALE,
        first_token_timeout_s=8.5 / SCALE,
        role_control={"enabled": False},
    ) as fleet:
        store_path = tmp_path / "store.json"
        r = profile(
            fleet.fleet_path,
            write_limits(tmp_path),
            store_path,
            prefill_lens="256,1024,2048",
            decode_lens="512,1024",
            decode_tokens="16",
        )
        assert r.returncode == 0, r.stderr
        specs = poisson_requests(rate=2.4, count=60, prompt_tokens=1024, output_tokens=32, seed=7)
        with running_router(tmp_path, fleet.fleet_path, "--profiles", str(store_path)) as router:
            live = asyncio.run(replay(router.url, specs, MODEL))
            assert wait_until(lambda: len(router.ends()) == len(specs), 10)
            ends = list(router.ends().values())
    models = engine_models(ProfileStore.model_validate_json(store_path.read_text()))
    fleet_contract = load_fleet(fleet.fleet_path).contract
    # The simulator is told what one HTTP leg costs on this live stack, measured in this run.
    overhead = leg_overhead_s(ends, timings_of(fleet_contract), 1024)
    result = run_des_like_live(fleet_contract, models, specs, overhead)
    agreement = compare(live, result, fleet_contract.budgets, overhead)
    assert agreement.within(0.10), agreement.report()
