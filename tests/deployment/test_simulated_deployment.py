"""The deployment procedure end to end on simulated engines: check, start, capture, sidecars,
finalize-fleet, then narwhal-serve (and narwhal-check, once it exists) on the result."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from narwhal.contract import load_fleet
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing import procs
from narwhal.testing.ports import free_ports
from tests.deployment.sidecars import ROOT, TOOLS, independent_manifest, make_checkpoint, wait_for
from tests.helpers import MODEL, running_router

pytestmark = pytest.mark.slow

SIM_PLAN = ROOT / "configs" / "launch" / "local-sim.yaml"


def tool(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@dataclass
class Deployment:
    directory: Path
    fleet: Path
    plan: Path
    run_dir: Path
    checkpoint: Path
    live: Path
    out: Path
    finalize: subprocess.CompletedProcess[str]
    engine_urls: list[str]
    sidecar_urls: list[str]


def write_plan_and_fleet(
    directory: Path, n: int, engine_args: list[dict[str, Any]] | None = None
) -> tuple[Path, Path, list[str], list[str]]:
    """The shipped simulated plan, moved to free ports, with a sidecar per engine."""
    ports = free_ports(3 * n)
    http, nixl, side = ports[:n], ports[n : 2 * n], ports[2 * n :]
    # Prefix caching off, as the shipped plan runs its engines.
    doc = local_fleet_document(
        http, nixl, sim={"time_scale": 50.0}, prefix_caching={"enabled": False}
    )
    for i, engine in enumerate(doc["engines"]):
        engine["attestation_url"] = f"http://127.0.0.1:{side[i]}/attestation"
    fleet = directory / "fleet.json"
    fleet.write_text(json.dumps(doc, indent=2))
    plan = yaml.safe_load(SIM_PLAN.read_text())
    plan["simulated"]["args"]["--time-scale"] = 50
    plan["engines"] = [
        {
            "id": f"e{i}",
            "host": "127.0.0.1",
            "port": http[i],
            "side_channel": {"host": "127.0.0.1", "port": nixl[i]},
            "attestation_port": side[i],
            **({"args": engine_args[i]} if engine_args else {}),
        }
        for i in range(n)
    ]
    plan_path = directory / "plan.yaml"
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return (
        plan_path,
        fleet,
        [f"http://127.0.0.1:{p}" for p in http],
        [f"http://127.0.0.1:{p}" for p in side],
    )


@contextlib.contextmanager
def started(plan: Path, fleet: Path, run_dir: Path) -> Iterator[None]:
    result = tool(
        "launch_plan.py", "start", str(plan), "--fleet", str(fleet), "--run-dir", str(run_dir)
    )
    try:
        assert result.returncode == 0, result.stderr
        yield
    finally:
        stop = tool("launch_plan.py", "stop", "--run-dir", str(run_dir), timeout=60)
        assert stop.returncode == 0, stop.stderr


@contextlib.contextmanager
def sidecars(plan: Path, checkpoint: Path, run_dir: Path, directory: Path) -> Iterator[list[Any]]:
    """Start the sidecars exactly as `render --sidecars` prints them."""
    rendered = tool(
        "launch_plan.py",
        "render",
        str(plan),
        "--sidecars",
        "--json",
        "--checkpoint",
        str(checkpoint),
        "--run-dir",
        str(run_dir),
    )
    assert rendered.returncode == 0, rendered.stderr
    started: list[subprocess.Popen[bytes]] = []
    try:
        for engine in json.loads(rendered.stdout)["engines"]:
            argv = engine["sidecar_argv"]
            assert argv[:2] == ["python3", "tools/deployment/attestation_sidecar.py"]
            argv = [sys.executable, argv[1], *argv[2:]]
            argv += ["--cache", str(directory / f"cache-{engine['engine_id']}.json")]
            log = directory / f"sidecar-{engine['engine_id']}.log"
            started.append(procs.start(argv, log, cwd=ROOT))
            port = argv[argv.index("--port") + 1]
            wait_for(f"http://127.0.0.1:{port}/attestation", 30, started[-1])
        yield started
    finally:
        for proc in started:
            proc.terminate()
        for proc in started:
            procs.stop(proc, 10)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    directory = tmp_path_factory.mktemp("sim-deployment")
    plan, fleet, engine_urls, sidecar_urls = write_plan_and_fleet(directory, 2)
    run_dir = directory / "run"
    check = tool("launch_plan.py", "check", str(plan), "--fleet", str(fleet))
    assert check.returncode == 0, check.stderr
    checkpoint = make_checkpoint(directory / "checkpoint")
    live = directory / "live.json"
    out = directory / "fleet-final.json"
    with started(plan, fleet, run_dir):
        capture = tool("launch_plan.py", "capture", str(plan), "--out", str(live))
        assert capture.returncode == 0, capture.stderr
        with sidecars(plan, checkpoint, run_dir, directory):
            finalize = tool(
                "attestation_contract.py",
                "finalize-fleet",
                "--fleet",
                str(fleet),
                "--out",
                str(out),
                "--live",
                str(live),
            )
            yield Deployment(
                directory,
                fleet,
                plan,
                run_dir,
                checkpoint,
                live,
                out,
                finalize,
                engine_urls,
                sidecar_urls,
            )


def test_capture_records_kv_geometry_and_side_channels(deployment: Deployment) -> None:
    live = json.loads(deployment.live.read_text())
    assert live["schema"] == "narwhal.live-contract/v1"
    fleet = load_fleet(deployment.fleet).contract
    for engine, spec in zip(live["engines"], fleet.engines, strict=True):
        assert engine["id"] == spec.id and engine["url"] == spec.url
        assert engine["model_id"] == MODEL and engine["version"]
        assert engine["kv_cache"] == {
            "block_size": 16,
            "num_blocks": 4096,
            "block_bytes": 16384,
            "source": "attestation",
        }
        assert engine["nixl"] == {
            "host": spec.nixl.host,
            "port": spec.nixl.port,
            "source": "attestation",
            "listening": True,
        }
        assert (engine["kv_connector"], engine["kv_role"], engine["tp"]) == (
            "NixlConnector",
            "kv_both",
            8,
        )
        pid = int((deployment.run_dir / f"engine-{spec.id}.pid").read_text())
        assert engine["pid"] == pid


def test_finalize_fills_the_fleet_from_the_running_engines(deployment: Deployment) -> None:
    result = deployment.finalize
    assert result.returncode == 0, result.stderr
    final = load_fleet(deployment.out)
    printed = result.stdout.strip().splitlines()[-1]
    assert printed == f"sha256 {final.sha256}"
    sha_file = deployment.out.with_name(deployment.out.name + ".sha256")
    assert sha_file.read_text() == final.sha256 + "\n"
    _, manifest_sha, config_sha = independent_manifest(deployment.checkpoint)
    assert final.contract.model.shard_manifest_sha256 == manifest_sha
    assert final.contract.model.config_sha256 == config_sha
    for spec, url in zip(final.contract.engines, deployment.sidecar_urls, strict=True):
        att = httpx.get(f"{url}/attestation", timeout=5).json()
        assert spec.generation == att["generation"] and spec.generation
        assert att["pid"] == int((deployment.run_dir / f"engine-{spec.id}.pid").read_text())
    # Everything else is the fleet as written.
    before = json.loads(deployment.fleet.read_text())
    after = json.loads(deployment.out.read_text())
    for doc in (before, after):
        doc["model"].pop("config_sha256", None)
        doc["model"].pop("shard_manifest_sha256", None)
        for engine in doc["engines"]:
            engine.pop("generation", None)
    assert before == after


def test_finalize_refuses_a_live_contract_captured_elsewhere(deployment: Deployment) -> None:
    """A live contract whose engine URLs are not the fleet's (another deployment's capture, or
    an emptied field) describes other engines: refused, naming the engine."""
    live = json.loads(deployment.live.read_text())
    live["engines"][1]["url"] = ""
    other = deployment.directory / "live-elsewhere.json"
    other.write_text(json.dumps(live))
    done = tool(
        "attestation_contract.py",
        "finalize-fleet",
        "--fleet",
        str(deployment.fleet),
        "--out",
        str(deployment.directory / "never.json"),
        "--live",
        str(other),
    )
    assert done.returncode == 1, done.stderr
    assert f"e1: the live contract {other} captured it at ''; the fleet says" in done.stderr
    assert not (deployment.directory / "never.json").exists()


def test_the_reference_runs_finalize_and_profile_commands_as_written(
    deployment: Deployment,
) -> None:
    """`finalize-fleet --fleet F` (in place, the live facts read now) and narwhal-profile with
    the reference run's exact flags and no --out (the store lands in the working directory)."""
    assert deployment.finalize.returncode == 0, deployment.finalize.stderr
    run = deployment.directory / "as-written"
    (run / "deployment").mkdir(parents=True)
    fleet = run / "deployment" / "fleet.json"
    shutil.copy(deployment.fleet, fleet)
    done = subprocess.run(
        [
            sys.executable,
            "tools/deployment/attestation_contract.py",
            "finalize-fleet",
            "--fleet",
            str(fleet),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert load_fleet(fleet).sha256 == load_fleet(deployment.out).sha256
    limits = run / "deployment" / "profiling-limits.json"
    shutil.copy(ROOT / "configs" / "fleet" / "profiling-limits.json", limits)
    argv = [str(Path(sys.executable).with_name("narwhal-profile"))]
    argv += ["--fleet", "deployment/fleet.json", "--limits", "deployment/profiling-limits.json"]
    argv += ["--prefill-lens", "256,1024,4096,8192", "--decode-input-lens", "512,4096,8192"]
    argv += ["--decode-concurrency", "1,2,4", "--decode-tokens", "64", "--prefill-repeats", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=run)
    assert done.returncode == 0, done.stderr[-3000:]
    store = json.loads((run / "profile-store.json").read_text())
    assert sorted(store["engines"]) == ["e0", "e1"]
    final = load_fleet(fleet).contract
    for spec in final.engines:
        assert store["engines"][spec.id]["generation"] == spec.generation


def test_narwhal_serve_accepts_the_finalized_fleet(deployment: Deployment) -> None:
    assert deployment.finalize.returncode == 0, deployment.finalize.stderr
    router_dir = deployment.directory / "router"
    router_dir.mkdir(exist_ok=True)
    with running_router(router_dir, deployment.out) as router:
        assert httpx.get(f"{router.url}/ready", timeout=5).status_code == 200
        resp = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": MODEL, "prompt": "a short prompt", "max_tokens": 4},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text


def test_narwhal_check_accepts_the_finalized_fleet(deployment: Deployment) -> None:
    # The console script, as an operator runs it (pyproject's [project.scripts]).
    exe = shutil.which("narwhal-check", path=str(Path(sys.executable).parent))
    assert exe is not None, f"no narwhal-check script beside {sys.executable}: pip install -e ."
    report = deployment.out.with_name("check-report.json")  # never into the working tree
    result = subprocess.run(
        [exe, "--fleet", str(deployment.out), "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_finalize_refuses_engines_with_different_weights(tmp_path: Path) -> None:
    # e1 runs another model seed: the simulator's notion of different weights. The sidecars read
    # the same checkpoint and agree, so only the engines' own reports tell them apart.
    plan, fleet, _, _ = write_plan_and_fleet(tmp_path, 2, [{}, {"--model-seed": 7}])
    fleet_bytes = fleet.read_bytes()
    checkpoint = make_checkpoint(tmp_path / "checkpoint")
    out = tmp_path / "final.json"
    run_dir = tmp_path / "run"
    with started(plan, fleet, run_dir), sidecars(plan, checkpoint, run_dir, tmp_path):
        result = tool(
            "attestation_contract.py", "finalize-fleet", "--fleet", str(fleet), "--out", str(out)
        )
        also_in_place = tool("attestation_contract.py", "finalize-fleet", "--fleet", str(fleet))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "attestation_contract.py: e1: engine-reported shard_manifest_sha256 "
    )
    assert "differs from e0's" in lines[0]
    assert lines[1] == "attestation_contract.py: 1 problem(s); nothing written"
    assert not out.exists() and not out.with_name(out.name + ".sha256").exists()
    assert also_in_place.returncode == 1
    assert fleet.read_bytes() == fleet_bytes
    assert not fleet.with_name(fleet.name + ".sha256").exists()


def test_start_failure_stops_what_started_and_stop_is_safe(tmp_path: Path) -> None:
    plan, fleet, urls, _ = write_plan_and_fleet(tmp_path, 2)
    # e1's interpreter cannot start (no standard library there): e1 exits at once, and e0
    # must not be left running.
    doc = yaml.safe_load(plan.read_text())
    doc["engines"][1]["env"] = {"PYTHONHOME": str(tmp_path / "no-python-here")}
    plan.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = tool(
        "launch_plan.py",
        "start",
        str(plan),
        "--fleet",
        str(fleet),
        "--run-dir",
        str(tmp_path / "run"),
        "--timeout",
        "30",
    )
    assert result.returncode == 1
    assert "e1: exited before it was healthy" in result.stderr
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{urls[0]}/health", timeout=2)
    stop = tool("launch_plan.py", "stop", "--run-dir", str(tmp_path / "run"))
    assert stop.returncode == 0
    assert "not running" in stop.stdout


def test_start_refuses_ports_another_process_holds(tmp_path: Path) -> None:
    """Started twice on the same ports (another --run-dir): the second start's engines could
    not bind and exited, while the first run's answered their health checks, and the second
    start reported them healthy under its own dead pids. Refused before anything starts."""
    plan, fleet, urls, _ = write_plan_and_fleet(tmp_path, 2)
    ports = [url.rsplit(":", 1)[1] for url in urls]
    with started(plan, fleet, tmp_path / "run1"):
        again = tool(
            "launch_plan.py",
            "start",
            str(plan),
            "--fleet",
            str(fleet),
            "--run-dir",
            str(tmp_path / "run1b"),
            "--timeout",
            "30",
        )
        assert again.returncode == 1, again.stdout + again.stderr
        assert "healthy" not in again.stdout
        lines = again.stderr.strip().splitlines()
        assert lines[0] == (
            f"launch_plan.py: e0: port {ports[0]} on 127.0.0.1 is already in use (engines[0].port)"
        )
        assert lines[-1] == "launch_plan.py: not starting local-sim: a port it needs is taken"
        assert len(lines) == 5, lines  # each engine's HTTP and NIXL port, and the verdict
        assert not (tmp_path / "run1b" / "run.json").exists()
        # The first run's engines were not disturbed.
        for url in urls:
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_wait_polls_every_engine_until_it_serves_the_plans_model(tmp_path: Path) -> None:
    plan, fleet, urls, _ = write_plan_and_fleet(tmp_path, 2)
    # Nothing is up yet: each engine is named with why it is not ready, within the bound.
    result = tool("launch_plan.py", "wait", str(plan), "--timeout", "1", "--interval", "0.2")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert [line.split(":", 1)[0] for line in lines] == ["launch_plan.py"] * 2, lines
    assert f"e0: not ready within 1 s at {urls[0]} (ConnectError" in lines[0]
    assert f"e1: not ready within 1 s at {urls[1]} (ConnectError" in lines[1]
    with started(plan, fleet, tmp_path / "run"):
        result = tool("launch_plan.py", "wait", str(plan), "--timeout", "30", "--interval", "0.2")
        assert result.returncode == 0, result.stderr
        ready = result.stdout.strip().splitlines()
        assert [line.split()[0] for line in ready] == ["e0", "e1"], ready
        assert ready[0].startswith(f"e0 ready at {urls[0]} after ")
