"""The virtual-time simulator against the live simulated fleet on the same workload: attainment
and TTFT/TPOT medians agree within 10%."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import httpx
import orjson
import pytest

from narwhal.contract import load_fleet
from narwhal.profiles.store import ProfileStore, engine_models
from narwhal.sim.des import DesConfig, poisson_requests, run_des, timings_of
from tests.helpers import MODEL, running_fleet, running_router, wait_until
from tests.integration.test_profile_v1 import profile, write_limits

pytestmark = pytest.mark.slow

SCALE = 2.0


async def replay(url: str, specs: list) -> list[tuple[int, float | None, float | None]]:
    """Open loop: each request at its arrival time; returns (status, ttft, tpot)."""

    async def one(
        client: httpx.AsyncClient, i: int, spec
    ) -> tuple[int, float | None, float | None]:
        await asyncio.sleep(max(0.0, t0 + spec.arrival - time.monotonic()))
        sent = time.monotonic()
        prompt = [300 + (i * 131 + k) % 9000 for k in range(spec.prompt_tokens)]
        times: list[float] = []
        async with client.stream(
            "POST",
            url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": spec.output_tokens,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            if r.status_code != 200:
                return r.status_code, None, None
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = orjson.loads(line[6:])
                    if any(c.get("text") for c in chunk.get("choices") or ()):
                        times.append(time.monotonic())
        ttft = times[0] - sent
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return 200, ttft, tpot

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
        t0 = time.monotonic() + 0.2
        return await asyncio.gather(*(one(client, i, s) for i, s in enumerate(specs)))


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
            live = asyncio.run(replay(router.url, specs))
            assert wait_until(lambda: len(router.ends()) == len(specs), 10)
            ends = list(router.ends().values())
    store = ProfileStore.model_validate_json(store_path.read_text())
    # The simulator is told what one HTTP leg costs on this live stack (router, client and
    # engine servers on loopback), measured in this very run: the prefill leg's duration less
    # the profiled prefill time.
    model = engine_models(store)["e0"].prefill
    leg_overhead = max(
        0.0,
        statistics.median(e["t_prefill_end"] - e["t_prefill_start"] for e in ends)
        - model.seconds(1024),
    )
    fleet_contract = load_fleet(fleet.fleet_path).contract
    budgets = fleet_contract.budgets
    result = run_des(
        DesConfig(
            fleet_contract,
            timings_of(fleet_contract),
            scheduler="v1",
            flipping=False,
            transfer_s=0.004,
            leg_overhead_s=leg_overhead,
            candidates=None,
        ),
        specs,
        engine_models(store),
    )
    live_ok = [(t1, t2) for status, t1, t2 in live if status == 200 and t1 is not None]
    live_met = sum(1 for t1, t2 in live_ok if t1 <= budgets.ttft_s and (t2 or 0) <= budgets.tpot_s)
    live_attainment = live_met / len(specs)
    live_ttft = statistics.median(t1 for t1, _ in live_ok)
    live_tpot = statistics.median(t2 for _, t2 in live_ok if t2 is not None)
    des_ttft = statistics.median(result.ttft)
    des_tpot = statistics.median(result.tpot)
    report = (
        f"leg overhead {leg_overhead:.4f} s; attainment live {live_attainment:.3f} "
        f"des {result.attainment:.3f}; "
        f"TTFT p50 live {live_ttft:.4f} des {des_ttft:.4f}; "
        f"TPOT p50 live {live_tpot:.4f} des {des_tpot:.4f}"
    )
    assert result.attainment == pytest.approx(live_attainment, rel=0.10), report
    assert des_ttft == pytest.approx(live_ttft, rel=0.10), report
    assert des_tpot == pytest.approx(live_tpot, rel=0.10), report
