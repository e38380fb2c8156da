"""Attestation sidecar: serves the identity of the engine it runs beside, over HTTP.

    attestation_sidecar.py --engine-id e0 --checkpoint /data/models/Kimi-K3 --port 8090 \\
        --model-id moonshotai/Kimi-K3 --model-revision REV --tp 8 \\
        --kv-connector NixlConnector --kv-role kv_both --nixl-host H --nixl-port 5600 \\
        [--image-digest sha256:...] [--container NAME [--container-runtime docker|podman]] \\
        [--gpu-arch gfx950] [--accelerator NAME] [--cache FILE | --no-cache] \\
        [--engine-pid PID | --engine-pidfile FILE | --generation G]

GET /attestation  the identity (same field names as the simulated engine's /attestation where
                  they overlap) plus image digest, manifest lines and drift; 503 while hashing
GET /drift        what changed since the manifest was computed
GET /manifest     the manifest text (``path:sha256`` lines, sorted by path)
POST /rehash      full re-hash of every shard, ignoring the cache (``?rebaseline=1`` adopts the
                  result as the new baseline, after a deliberate weight change and restart)
GET /health       200 while the sidecar runs

With ``--container`` the image digest is what the running container reports, read on every
/attestation (``RUNTIME inspect`` for its image, ``RUNTIME image inspect`` for that image's
repository digests), not what the operator declared: ``image_digest`` is the observed
``sha256:...`` (the declared one when it is among the image's repository digests, so a
multi-repository image is not misreported), ``image_digest_declared`` the plan's, and
``image_digest_source`` says which ("container", "declared", or "container-unreadable" with
``image_digest`` null and ``image_digest_error`` saying why: never the declared value in its
place).

The shard manifest is one ``relative/path.safetensors:<sha256 hex>`` line per shard, sorted by
path, each ending in a newline; its SHA-256 is the checkpoint's identity. The config hash is
the SHA-256 of ``config.json``'s bytes. A checkpoint is terabytes: files are hashed in chunks
(never whole in memory) on a thread pool (hashlib releases the GIL on large updates), and the
result is cached keyed by path, size and mtime so a restarted sidecar does not re-read it (a
rehash rewrites the entries with the bytes it read, so the cache never outlives what is on disk).
Sizes and mtimes are re-checked (and config.json re-hashed) on an interval; a byte change that
keeps size and mtime is only visible to POST /rehash.

Standard library only: it runs on any engine host (or in the engine's container) with a
python3, without Narwhal installed. Exit status: 2 for bad arguments or an unusable
checkpoint, 1 if the port cannot be bound.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = [
    "Attestor",
    "Entry",
    "hash_file",
    "main",
    "manifest_text",
    "scan_shards",
]

SCHEMA = "narwhal.attestation/v1"
CACHE_SCHEMA = "narwhal.manifest-cache/v1"
SHARD_GLOB = "*.safetensors"
CHUNK_BYTES = 8 << 20
PROG = "attestation_sidecar.py"


class SidecarError(Exception):
    pass


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the checkpoint, '/'-separated
    size: int
    mtime_ns: int
    sha256: str


@dataclass
class Progress:
    total_bytes: int = 0
    hashed_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self.lock:
            self.hashed_bytes += n


def hash_file(path: Path, chunk_bytes: int = CHUNK_BYTES, progress: Progress | None = None) -> str:
    """SHA-256 of a file read ``chunk_bytes`` at a time into one reused buffer."""
    digest = hashlib.sha256()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            if progress is not None:
                progress.add(n)
    return digest.hexdigest()


def scan_shards(root: Path) -> dict[str, os.stat_result]:
    """Every ``*.safetensors`` file under ``root`` (recursively) by relative path."""
    found: dict[str, os.stat_result] = {}
    for path in root.rglob(SHARD_GLOB):
        if path.is_file():
            found[path.relative_to(root).as_posix()] = path.stat()
    return found


def manifest_text(entries: list[Entry]) -> str:
    return "".join(f"{e.path}:{e.sha256}\n" for e in sorted(entries, key=lambda e: e.path))


def _load_cache(path: Path | None, root: Path) -> dict[str, Entry]:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != CACHE_SCHEMA or data.get("root") != str(root):
            return {}
        return {
            k: Entry(k, int(v["size"]), int(v["mtime_ns"]), str(v["sha256"]))
            for k, v in data["entries"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        # A damaged cache only costs a re-hash; it must never stop the sidecar.
        _log(f"ignoring unreadable manifest cache {path}")
        return {}


def _save_cache(path: Path | None, root: Path, entries: list[Entry]) -> None:
    if path is None:
        return
    doc = {
        "schema": CACHE_SCHEMA,
        "root": str(root),
        "entries": {
            e.path: {"size": e.size, "mtime_ns": e.mtime_ns, "sha256": e.sha256} for e in entries
        },
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:
        _log(f"cannot write manifest cache {path}: {exc.strerror or exc}")


def compute_manifest(
    root: Path,
    cache: dict[str, Entry],
    workers: int,
    chunk_bytes: int,
    progress: Progress,
) -> tuple[list[Entry], int]:
    """Entries for every shard, reusing cached hashes whose size and mtime still match.

    Returns the entries and how many files were actually read. The stat is taken before the
    file is read: if the file changes while it is hashed, the next verification sees its new
    mtime and reports drift rather than trusting a hash of a moving target.
    """
    stats = scan_shards(root)
    if not stats:
        raise SidecarError(f"no {SHARD_GLOB} files under {root}")
    entries: list[Entry] = []
    todo: list[tuple[str, os.stat_result]] = []
    for rel, st in stats.items():
        hit = cache.get(rel)
        if hit is not None and (hit.size, hit.mtime_ns) == (st.st_size, st.st_mtime_ns):
            entries.append(hit)
        else:
            todo.append((rel, st))
    progress.total_bytes = sum(st.st_size for _, st in todo)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {
            pool.submit(hash_file, root / rel, chunk_bytes, progress): (rel, st) for rel, st in todo
        }
        for fut in concurrent.futures.as_completed(futures):
            rel, st = futures[fut]
            entries.append(Entry(rel, st.st_size, st.st_mtime_ns, fut.result()))
    entries.sort(key=lambda e: e.path)
    return entries, len(todo)


def detect_gpu_arch(timeout_s: float = 30.0) -> list[str] | None:
    """GPU architectures rocminfo reports (e.g. ['gfx950']); None without rocminfo."""
    exe = shutil.which("rocminfo")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe], capture_output=True, text=True, timeout=timeout_s, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    archs = sorted(set(re.findall(r"^\s*Name:\s+(gfx[0-9a-z]+)\s*$", out, re.M)))
    return archs or None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def process_identity(pid: int) -> tuple[int, float] | None:
    """(start ticks since boot, start time as epoch seconds) of a live process, else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    ticks = int(fields[19])
    return ticks, btime + ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Settings:
    engine_id: str
    root: Path
    model_id: str
    model_revision: str
    tp: int
    gpu_arch: str
    gpu_arch_source: str
    declared_gpu_arch: str | None
    kv_connector: str | None
    kv_role: str | None
    nixl: dict[str, Any] | None
    image_digest: str | None
    container: str | None
    container_runtime: str
    accelerator: str | None
    engine_pid: int | None
    engine_pidfile: Path | None
    generation: str | None
    cache: Path | None
    workers: int
    chunk_bytes: int
    verify_interval_s: float


_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


def _runtime(argv: list[str]) -> str:
    """One container-runtime query's stdout; RuntimeError with its own words on failure."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{argv[0]}: {exc}") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise RuntimeError(f"{' '.join(argv[:2])}: {why}")
    return done.stdout.strip()


def container_image_digests(runtime: str, container: str) -> list[str]:
    """The repository digests (``sha256:...``) of the image the container runs."""
    image = _runtime([runtime, "inspect", "--format", "{{.Image}}", container])
    raw = _runtime([runtime, "image", "inspect", "--format", "{{json .RepoDigests}}", image])
    try:
        repo_digests = json.loads(raw) or []
    except ValueError:
        raise RuntimeError(f"{runtime} image inspect: not a JSON list: {raw[:80]}") from None
    found = [m.group(0) for d in repo_digests if (m := _DIGEST_RE.search(str(d)))]
    if not found:
        raise RuntimeError(
            f"image {image[:19]} of container {container} has no repository digest "
            "(built or loaded locally, never pulled by digest)"
        )
    return found


def image_doc(s: Settings) -> dict[str, Any]:
    """The attestation's image fields: observed from the container when there is one."""
    if s.container is None:
        return {
            "image_digest": s.image_digest,
            "image_digest_declared": s.image_digest,
            "image_digest_source": "declared" if s.image_digest else None,
        }
    try:
        digests = container_image_digests(s.container_runtime, s.container)
    except RuntimeError as exc:
        return {
            "image_digest": None,
            "image_digest_declared": s.image_digest,
            "image_digest_source": "container-unreadable",
            "image_digest_error": str(exc),
        }
    observed = s.image_digest if s.image_digest in digests else digests[0]
    return {
        "image_digest": observed,
        "image_digest_declared": s.image_digest,
        "image_digest_source": "container",
        "container": s.container,
    }


class Attestor:
    """Baseline manifest, periodic verification and drift, behind one lock."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.lock = threading.Lock()
        self.rehash_lock = threading.Lock()
        self.progress = Progress()
        self.baseline: list[Entry] | None = None
        self.config_sha256: str | None = None
        self.computed_at: float | None = None
        self.hashed_files = 0
        self.cached_files = 0
        self.stat_drift: list[dict[str, Any]] = []
        self.hash_drift: list[dict[str, Any]] = []
        self.verified_at: float | None = None
        self.error: str | None = None
        self.stop = threading.Event()
        self._bad_pidfile: str | None = None  # the pidfile's last content that held no pid

    # -- computing -------------------------------------------------------------------------
    def build_baseline(self, use_cache: bool = True) -> None:
        cache = _load_cache(self.s.cache, self.s.root) if use_cache else {}
        progress = Progress()
        self.progress = progress
        entries, hashed = compute_manifest(
            self.s.root, cache, self.s.workers, self.s.chunk_bytes, progress
        )
        config = hash_file(self.s.root / "config.json", self.s.chunk_bytes)
        _save_cache(self.s.cache, self.s.root, entries)
        with self.lock:
            self.baseline = entries
            self.config_sha256 = config
            self.computed_at = time.time()
            self.hashed_files = hashed
            self.cached_files = len(entries) - hashed
            self.stat_drift = []
            self.hash_drift = []
        _log(
            f"manifest of {len(entries)} shards ready ({hashed} hashed, "
            f"{len(entries) - hashed} from cache): {self.manifest_sha256()}"
        )

    def verify_once(self) -> None:
        """Compare sizes and mtimes with the baseline and re-hash config.json."""
        with self.lock:
            baseline = list(self.baseline or [])
            config_expected = self.config_sha256
        if not baseline:
            return
        now = scan_shards(self.s.root)
        drift: list[dict[str, Any]] = []
        for e in baseline:
            st = now.pop(e.path, None)
            if st is None:
                drift.append(_drift(e.path, "missing", e.size, None))
            elif st.st_size != e.size:
                drift.append(_drift(e.path, "size", e.size, st.st_size))
            elif st.st_mtime_ns != e.mtime_ns:
                drift.append(_drift(e.path, "mtime", e.mtime_ns, st.st_mtime_ns))
        for rel, st in sorted(now.items()):
            drift.append(_drift(rel, "added", None, st.st_size))
        try:
            config_now: str | None = hash_file(self.s.root / "config.json", self.s.chunk_bytes)
        except OSError:
            config_now = None
        if config_now != config_expected:
            drift.append(_drift("config.json", "config_sha256", config_expected, config_now))
        with self.lock:
            if [d["kind"] + d["path"] for d in drift] != [
                d["kind"] + d["path"] for d in self.stat_drift
            ]:
                for d in drift:
                    _log(f"drift: {d['path']}: {d['kind']} {d['expected']} -> {d['actual']}")
            self.stat_drift = drift
            self.verified_at = time.time()

    def rehash(self, rebaseline: bool) -> dict[str, Any]:
        """Read every shard again (no cache) and compare with the baseline."""
        with self.rehash_lock:
            if rebaseline:
                self.build_baseline(use_cache=False)
                self.verify_once()
                return self.drift_doc()
            progress = Progress()
            entries, _ = compute_manifest(
                self.s.root, {}, self.s.workers, self.s.chunk_bytes, progress
            )
            # The cache now holds the bytes just read under their size and mtime: a change that
            # kept both would otherwise stay cached as the old hash, and a restarted sidecar
            # would attest bytes no longer on disk, with no drift to show it.
            _save_cache(self.s.cache, self.s.root, entries)
            with self.lock:
                base = {e.path: e for e in self.baseline or []}
            drift = [
                _drift(e.path, "sha256", base[e.path].sha256, e.sha256)
                for e in entries
                if e.path in base and base[e.path].sha256 != e.sha256
            ]
            with self.lock:
                self.hash_drift = drift
            self.verify_once()
            return self.drift_doc()

    def run_verifier(self) -> None:
        try:
            self.build_baseline()
        except (OSError, SidecarError) as exc:
            self.error = str(exc)
            _log(f"cannot compute the manifest: {exc}")
            return
        while not self.stop.wait(self.s.verify_interval_s):
            try:
                self.verify_once()
            except OSError as exc:
                _log(f"verification failed: {exc}")

    # -- documents -------------------------------------------------------------------------
    def manifest_sha256(self) -> str | None:
        with self.lock:
            if self.baseline is None:
                return None
            return hashlib.sha256(manifest_text(self.baseline).encode()).hexdigest()

    def drift_doc(self) -> dict[str, Any]:
        with self.lock:
            drift = self.stat_drift + self.hash_drift
            return {"drift": drift, "ok": not drift, "verified_at": self.verified_at}

    def engine_doc(self) -> dict[str, Any]:
        pid = self.s.engine_pid
        if self.s.engine_pidfile is not None:
            # Re-read every time: a restarted engine writes a new pid, which is a new generation.
            pid = self._pid_from_file(self.s.engine_pidfile)
        ident = process_identity(pid) if pid is not None else None
        generation = self.s.generation
        if generation is None and ident is not None:
            seed = f"{_boot_id()}:{pid}:{ident[0]}"
            generation = "g" + hashlib.sha256(seed.encode()).hexdigest()[:16]
        return {
            "generation": generation,
            "pid": pid,
            "started_at": ident[1] if ident else None,
            "engine_alive": ident is not None if pid is not None else None,
        }

    def _pid_from_file(self, path: Path) -> int | None:
        """The pid the engine's pidfile holds; None while it holds none (not written yet, or
        empty while being written). Anything else there is said once per content: read as no
        pid without a word, it left the generation unknown and restarts unseen."""
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return None
        words = text.split()
        if not words:
            return None
        try:
            pid = int(words[0])
        except ValueError:
            pid = 0
        if pid > 0:
            self._bad_pidfile = None
            return pid
        if text != self._bad_pidfile:
            self._bad_pidfile = text
            _log(
                f"--engine-pidfile {path} holds {text[:40]!r}, not a process id: the engine's"
                " generation is unknown (its restarts go unseen) until it does"
            )
        return None

    def attestation(self) -> tuple[int, dict[str, Any]]:
        if self.error is not None:
            return 500, {"schema": SCHEMA, "state": "failed", "error": self.error}
        with self.lock:
            baseline = self.baseline
        if baseline is None:
            p = self.progress
            return 503, {
                "schema": SCHEMA,
                "state": "hashing",
                "hashed_bytes": p.hashed_bytes,
                "total_bytes": p.total_bytes,
            }
        drift = self.drift_doc()
        s = self.s
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "source": "sidecar",
            "state": "ready",
            "engine_id": s.engine_id,
            "model_id": s.model_id,
            "model_revision": s.model_revision,
            "config_sha256": self.config_sha256,
            "shard_manifest_sha256": self.manifest_sha256(),
            "tp": s.tp,
            "gpu_arch": s.gpu_arch,
            "gpu_arch_source": s.gpu_arch_source,
            "declared_gpu_arch": s.declared_gpu_arch,
            "accelerator": s.accelerator,
            "kv_connector": s.kv_connector,
            "kv_role": s.kv_role,
            "nixl": s.nixl,
            **image_doc(s),
            **self.engine_doc(),
            "checkpoint": str(s.root),
            "shard_count": len(baseline),
            "total_bytes": sum(e.size for e in baseline),
            "manifest": manifest_text(baseline).splitlines(),
            "manifest_computed_at": self.computed_at,
            "hashed_files": self.hashed_files,
            "cached_files": self.cached_files,
            **drift,
        }
        return 200, doc


def _drift(path: str, kind: str, expected: Any, actual: Any) -> dict[str, Any]:
    return {"path": path, "kind": kind, "expected": expected, "actual": actual}


def _log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(f"{stamp} {PROG}: {message}", file=sys.stderr, flush=True)


def _handler(att: Attestor) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "narwhal-attestation-sidecar"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would drown the drift messages

        def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else (json.dumps(body) + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/health":
                self._send(200, {"status": "ok"})
            elif path == "/attestation":
                self._send(*att.attestation())
            elif path == "/drift":
                self._send(200, att.drift_doc())
            elif path == "/manifest":
                with att.lock:
                    baseline = att.baseline
                if baseline is None:
                    self._send(503, {"state": "hashing"})
                else:
                    self._send(200, manifest_text(baseline).encode(), "text/plain; charset=utf-8")
            else:
                self._send(404, {"error": f"no route {path}"})

        def do_POST(self) -> None:
            parts = urlsplit(self.path)
            if parts.path != "/rehash":
                self._send(404, {"error": f"no route {parts.path}"})
                return
            if att.baseline is None:
                self._send(503, {"state": "hashing"})
                return
            flag = parse_qs(parts.query).get("rebaseline", ["0"])[0]
            try:
                self._send(200, att.rehash(rebaseline=flag.lower() in ("1", "true", "yes")))
            except (OSError, SidecarError) as exc:
                self._send(500, {"error": str(exc)})

    return Handler


def _port(text: str) -> int:
    """An argparse type (this script runs on engine hosts with the standard library only)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be from 1 to 65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number greater than 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--engine-id", required=True, help="id of the engine this sidecar attests")
    p.add_argument("--checkpoint", required=True, help="directory with config.json and shards")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, required=True, help="HTTP port to serve on")
    p.add_argument("--model-id", required=True, help="model id the engine serves, as attested")
    p.add_argument("--model-revision", required=True, help="model revision, as attested")
    p.add_argument("--tp", type=int, required=True, help="the engine's tensor parallel size")
    p.add_argument("--gpu-arch", help="declared architecture; rocminfo's answer wins if present")
    p.add_argument("--accelerator", help="accelerator name to attest (default: none)")
    p.add_argument(
        "--kv-connector",
        default="NixlConnector",
        help="the engine's KV connector, as attested (default %(default)s)",
    )
    p.add_argument(
        "--kv-role",
        default="kv_both",
        help="the engine's KV transfer role, as attested (default %(default)s)",
    )
    p.add_argument("--nixl-host", help="the engine's NIXL side-channel host (with --nixl-port)")
    p.add_argument(
        "--nixl-port", type=_port, help="the engine's NIXL side-channel port (with --nixl-host)"
    )
    p.add_argument("--image-digest", help="sha256:... of the engine's image (from the plan)")
    p.add_argument("--container", help="the engine's container: its image digest is read from it")
    p.add_argument(
        "--container-runtime",
        choices=("docker", "podman"),
        default="docker",
        help="runtime that inspects --container (default %(default)s)",
    )
    who = p.add_mutually_exclusive_group()
    who.add_argument("--engine-pid", type=int, help="the engine's process id")
    who.add_argument("--engine-pidfile", help="file holding the engine's pid (re-read each time)")
    p.add_argument("--generation", help="engine generation, instead of deriving it from the pid")
    p.add_argument(
        "--cache",
        help="manifest cache file (default: ~/.cache/narwhal/attestation/KEY.json, KEY from the "
        "checkpoint's path)",
    )
    p.add_argument("--no-cache", action="store_true", help="always hash every shard at start")
    p.add_argument(
        "--hash-workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="threads hashing shards (default: the CPU count, at most 8; here %(default)s)",
    )
    p.add_argument("--chunk-mib", type=int, default=8, help="read size per hashing call (MiB)")
    p.add_argument("--verify-interval", type=_seconds, default=60.0, help="seconds between checks")
    return p


def _settings(args: argparse.Namespace) -> Settings:
    root = Path(args.checkpoint).resolve()
    if not root.is_dir():
        raise SidecarError(f"--checkpoint {args.checkpoint}: not a directory")
    if not (root / "config.json").is_file():
        raise SidecarError(f"--checkpoint {args.checkpoint}: no config.json")
    for flag, value in (
        ("--tp", args.tp),
        ("--hash-workers", args.hash_workers),
        ("--chunk-mib", args.chunk_mib),
    ):
        if value < 1:
            raise SidecarError(f"{flag}: must be at least 1 (got {value})")
    if (args.nixl_host is None) != (args.nixl_port is None):
        raise SidecarError("--nixl-host and --nixl-port go together")
    detected = detect_gpu_arch()
    if detected is not None:
        gpu_arch, source = ",".join(detected), "rocminfo"
    elif args.gpu_arch:
        gpu_arch, source = args.gpu_arch, "declared"
    else:
        raise SidecarError("no rocminfo on this host: declare the architecture with --gpu-arch")
    if args.no_cache:
        cache = None
    elif args.cache:
        cache = Path(args.cache)
    else:
        key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
        cache = Path.home() / ".cache" / "narwhal" / "attestation" / f"{key}.json"
    return Settings(
        engine_id=args.engine_id,
        root=root,
        model_id=args.model_id,
        model_revision=args.model_revision,
        tp=args.tp,
        gpu_arch=gpu_arch,
        gpu_arch_source=source,
        declared_gpu_arch=args.gpu_arch,
        kv_connector=args.kv_connector,
        kv_role=args.kv_role,
        nixl=(
            {"host": args.nixl_host, "port": args.nixl_port} if args.nixl_host is not None else None
        ),
        image_digest=args.image_digest,
        container=args.container,
        container_runtime=args.container_runtime,
        accelerator=args.accelerator,
        engine_pid=args.engine_pid,
        engine_pidfile=Path(args.engine_pidfile) if args.engine_pidfile else None,
        generation=args.generation,
        cache=cache,
        workers=args.hash_workers,
        chunk_bytes=args.chunk_mib << 20,
        verify_interval_s=args.verify_interval,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = _settings(args)
    except SidecarError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    att = Attestor(settings)
    try:
        server = ThreadingHTTPServer((args.host, args.port), _handler(att))
    except OSError as exc:
        print(f"{PROG}: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    server.daemon_threads = True

    def on_signal(signum: int, frame: object) -> None:
        att.stop.set()
        # shutdown() waits for serve_forever to return: call it off the main thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    verifier = threading.Thread(target=att.run_verifier, name="verifier", daemon=True)
    verifier.start()
    _log(f"serving {settings.engine_id} attestation on {args.host}:{args.port} for {settings.root}")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
