"""Helpers shared by the deployment tests: test checkpoints and sidecar processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from narwhal.testing import procs

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "deployment"
SIDECAR = TOOLS / "attestation_sidecar.py"


def make_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A small checkpoint: config.json, three shards (one in a subdirectory), and a file the
    manifest must ignore."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "seed": seed}))
    for i, size in enumerate((300_000, 123_457, 65_536), start=1):
        sub = directory / ("experts" if i == 3 else "")
        sub.mkdir(exist_ok=True)
        data = hashlib.sha256(f"{seed}:{i}".encode()).digest() * (size // 32 + 1)
        (sub / f"model-{i:05d}-of-00003.safetensors").write_bytes(data[:size])
    (directory / "tokenizer.json").write_text("{}")
    return directory


def independent_manifest(directory: Path) -> tuple[list[str], str, str]:
    """(lines, manifest sha256, config sha256) computed without the sidecar's code."""
    lines = sorted(
        f"{p.relative_to(directory).as_posix()}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
        for p in directory.rglob("*.safetensors")
    )
    text = "".join(line + "\n" for line in lines)
    config = hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()
    return lines, hashlib.sha256(text.encode()).hexdigest(), config


def wait_for(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> Any:
    """GET ``url`` until it answers 200; its JSON (or text). Bounded by ``timeout_s``."""
    seen: dict[str, Any] = {"last": ""}

    def answered() -> bool:
        try:
            resp = httpx.get(url, timeout=2.0)
        except httpx.HTTPError as exc:
            seen["last"] = repr(exc)
            return False
        if resp.status_code != 200:
            seen["last"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return False
        json_body = "json" in resp.headers.get("content-type", "")
        seen["body"] = resp.json() if json_body else resp.text
        return True

    try:
        procs.wait_ready(answered, timeout_s, process=proc, name=url, interval=0.05)
    except procs.ProcessError as exc:
        raise AssertionError(f"{exc} ({seen['last']})") from None
    return seen["body"]


@contextlib.contextmanager
def running_sidecar(
    port: int, checkpoint: Path, log: Path, *extra: str, engine_id: str = "e0", **flags: str
) -> Iterator[subprocess.Popen[bytes]]:
    args = {
        "--engine-id": engine_id,
        "--host": "127.0.0.1",
        "--port": str(port),
        "--checkpoint": str(checkpoint),
        "--model-id": "moonshotai/Kimi-K3",
        "--model-revision": "sim",
        "--tp": "8",
        "--gpu-arch": "sim",
        **{(k if k.startswith("--") else "--" + k.replace("_", "-")): v for k, v in flags.items()},
    }
    argv = [sys.executable, str(SIDECAR)]
    for key, value in args.items():
        argv += [key, value]
    proc = procs.start([*argv, *extra], log)
    try:
        wait_for(f"http://127.0.0.1:{port}/health", 20, proc)
        yield proc
    finally:
        procs.stop(proc, 10, group=True)
