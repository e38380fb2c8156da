"""Helpers for the narwhal-check tests: synthetic stores, running the CLI, starting the router
with a check report."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from narwhal.contract import LoadedFleet, parse_fleet, sha256_hex
from narwhal.profiles.store import (
    DecodeSample,
    PrefillSample,
    ProfileStore,
    fit_engine,
)
from narwhal.serve.cli import serve_command
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing import procs, profiling
from narwhal.testing.ports import free_ports

PROFILE_LIMITS = {
    "schema": "narwhal.profiling-limits/v1",
    "max_wall_s_per_engine": 300,
    "max_tokens_per_engine": 400000,
    "probe_timeout_s": 60,
}


def fleet_doc(n: int = 4, **kwargs: Any) -> dict[str, Any]:
    ports = free_ports(2 * n)
    return local_fleet_document(ports[:n], ports[n:], **kwargs)


def loaded(doc: dict[str, Any], path: str = "fleet.json") -> LoadedFleet:
    return parse_fleet(doc, path, path=Path(path))


def make_store(
    engines: dict[str, dict[str, float]],
    generations: dict[str, str | None] | None = None,
    prefill_lens: tuple[int, ...] = (1024, 4096, 8192),
    decode_lens: tuple[int, ...] = (512, 4096, 8192),
) -> tuple[ProfileStore, str]:
    """A store whose samples follow the simulator's formulas exactly, per engine parameters
    ``a, b, c, intercept, slope, ctx``; (store, sha256)."""
    profiles: dict[str, Any] = {}
    for engine_id, p in engines.items():
        prefill = [
            PrefillSample(input_tokens=n, repeat=0, seconds=p["a"] + p["b"] * n + p["c"] * n * n)
            for n in prefill_lens
        ]
        decode = [
            DecodeSample(
                input_tokens=n,
                concurrency=c,
                tokens=64,
                mean_context=n + 32.0,
                seconds_per_token=p["intercept"] + p["slope"] * c + p["ctx"] * (n + 32),
                itl_samples=60,
            )
            for n in decode_lens
            for c in (1, 2, 4)
        ]
        pf, df = fit_engine(prefill, decode)
        profiles[engine_id] = {
            "engine_id": engine_id,
            "url": "http://127.0.0.1:1",
            "generation": (generations or {}).get(engine_id, f"gen-{engine_id}"),
            "wall_s": 1.0,
            "tokens_used": 1,
            "prefill_samples": [s.model_dump() for s in prefill],
            "decode_samples": [s.model_dump() for s in decode],
            "prefill_fit": pf.model_dump(),
            "decode_fit": df.model_dump(),
        }
    doc = {
        "schema": "narwhal.profiles/v1",
        "created_at": "2026-01-01T00:00:00+00:00",
        "complete": True,
        "fleet_name": "t",
        "fleet_sha256": "0" * 64,
        "plan": {
            "prefill_lens": list(prefill_lens),
            "prefill_repeats": 1,
            "decode_input_lens": list(decode_lens),
            "decode_concurrency": [1, 2, 4],
            "decode_tokens": 64,
        },
        "limits": PROFILE_LIMITS,
        "engines": profiles,
    }
    store = ProfileStore.model_validate(doc)
    return store, sha256_hex(store.model_dump(mode="json", by_alias=True))


def attestation(fleet: Any, engine: Any, **over: Any) -> dict[str, Any]:
    """A ready attestation document for ``engine`` that matches ``fleet``, with ``over``
    replacing fields."""
    doc = {
        "schema": "narwhal.attestation/v1",
        "engine_id": engine.id,
        "model_id": fleet.model.id,
        "model_revision": fleet.model.revision,
        "config_sha256": "c" * 64,
        "shard_manifest_sha256": "a" * 64,
        "tp": fleet.engine.tp,
        "gpu_arch": fleet.engine.gpu_arch,
        "accelerator": fleet.engine.accelerator,
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "nixl": {"host": engine.nixl.host, "port": engine.nixl.port},
        "kv_cache": {"block_size": 16, "num_blocks": 4096, "block_bytes": 16384},
        "generation": f"gen-{engine.id}",
    }
    doc.update(over)
    return doc


# The qualification fleet's engine, as the simulator models it at time scale 1.
KIMI = {"a": 0.02, "b": 1.0e-4, "c": 1.2e-9, "intercept": 0.24, "slope": 0.0015, "ctx": 1.3e-7}


def plan_doc(fleet_sha: str, points: list[dict[str, Any]], **workload: int) -> dict[str, Any]:
    return {
        "schema": "narwhal.benchmark-plan/v1",
        "fleet": {"path": "fleet.json", "sha256": fleet_sha},
        "client_revision": "31b0b78e0d8b1438b212ae56b9fbba32832b53a2",
        "workload": {"input_tokens": 8192, "output_tokens": 128, **workload},
        "points": points,
    }


def point(name: str, rate: float, **over: Any) -> dict[str, Any]:
    base = {
        "name": name,
        "rate": rate,
        "requests": 200,
        "ttft_s": 10.0,
        "tpot_s": 0.3,
        "attainment": 0.95,
        "timeout_s": 180.0,
    }
    base.update(over)
    return base


def write_json(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc, indent=2))
    return path


def fleet_copy(src: Path, dst: Path, **engine_overrides: Any) -> Path:
    """A copy of a fleet file with fields of the document replaced (dotted keys allowed via
    nested dicts: ``engine={"first_token_timeout_s": 8.5}``)."""
    doc = json.loads(src.read_text())
    out = copy.deepcopy(doc)
    for key, value in engine_overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return write_json(dst, out)


def check(
    *args: str, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal.check.cli", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def profile(fleet_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    limits = write_json(out.parent / "limits.json", PROFILE_LIMITS)
    return profiling.profile(fleet_path, limits, out, *extra)


def serve_args(fleet: Path, journal: Path, port: int, *extra: str) -> list[str]:
    return serve_command(fleet, port, journal, *extra)


def serve_refused(fleet: Path, journal: Path, *extra: str, cwd: Path | None = None) -> str:
    """Run narwhal-serve expecting a refusal: returns its one stderr line."""
    r = subprocess.run(
        serve_args(fleet, journal, free_ports(1)[0], *extra),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def serve_ready(
    fleet: Path, journal: Path, log: Path, *extra: str, cwd: Path | None = None
) -> tuple[bool, str]:
    """Start narwhal-serve, wait (bounded) for /ready 200, stop it; (ready, its log)."""
    port = free_ports(1)[0]
    proc = procs.start(serve_args(fleet, journal, port, *extra), log, append=False, cwd=cwd)
    try:
        ok = procs.wait_all(
            {"router": lambda: procs.http_ok(f"http://127.0.0.1:{port}/ready")},
            30,
            alive={"router": lambda: proc.poll() is None},
            interval=0.05,
        ).ok
    finally:
        procs.stop(proc, 30)
    return ok, log.read_text()
