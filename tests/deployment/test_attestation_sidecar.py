"""The attestation sidecar: its manifest matches one computed here, drift is reported, the
cache spares a re-read, and hashing streams."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tracemalloc
from pathlib import Path

import httpx
import pytest

from narwhal.testing.ports import free_ports
from narwhal.testing.procs import wait_until
from tests.deployment.sidecars import (
    independent_manifest,
    make_checkpoint,
    running_sidecar,
    wait_for,
)
from tools.deployment import attestation_sidecar as sidecar

SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"


def test_manifest_matches_an_independent_computation_and_drift_is_reported(
    tmp_path: Path,
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    lines, manifest_sha, config_sha = independent_manifest(ckpt)
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    with running_sidecar(
        port,
        ckpt,
        tmp_path / "sidecar.log",
        "--verify-interval",
        "0.1",
        "--hash-workers",
        "3",
        generation="gen-test",
        **{"--cache": str(tmp_path / "cache.json"), "--image-digest": "sha256:" + "ab" * 32},
    ):
        att = wait_for(f"{base}/attestation", 20)
        assert att["manifest"] == lines
        assert att["shard_manifest_sha256"] == manifest_sha
        assert att["config_sha256"] == config_sha
        assert att["shard_count"] == 3 and att["hashed_files"] == 3
        assert att["gpu_arch"] == "sim" and att["gpu_arch_source"] == "declared"
        assert att["generation"] == "gen-test"
        assert att["image_digest"] == "sha256:" + "ab" * 32
        assert att["drift"] == [] and att["ok"] is True
        assert httpx.get(f"{base}/manifest").text == "".join(line + "\n" for line in lines)

        # New bytes, same size: the mtime moves, and the interval check reports it.
        shard1 = ckpt / SHARD1
        old_sha1 = hashlib.sha256(shard1.read_bytes()).hexdigest()
        new_bytes = bytes(reversed(shard1.read_bytes()))
        shard1.write_bytes(new_bytes)
        new_sha1 = hashlib.sha256(new_bytes).hexdigest()

        def drift_kinds() -> set[tuple[str, str]]:
            doc = httpx.get(f"{base}/drift").json()
            return {(d["path"], d["kind"]) for d in doc["drift"]}

        assert wait_until(lambda: (SHARD1, "mtime") in drift_kinds(), 10)
        # A full re-hash names the byte change.
        result = httpx.post(f"{base}/rehash", timeout=30).json()
        assert {
            "path": SHARD1,
            "kind": "sha256",
            "expected": old_sha1,
            "actual": new_sha1,
        } in result["drift"]
        assert result["ok"] is False

        # A size change.
        shard2 = ckpt / SHARD2
        old_size = shard2.stat().st_size
        with open(shard2, "ab") as f:
            f.write(b"\0" * 10)
        assert wait_until(lambda: (SHARD2, "size") in drift_kinds(), 10)
        att = httpx.get(f"{base}/attestation").json()
        size = next(d for d in att["drift"] if d["path"] == SHARD2)
        assert (size["expected"], size["actual"]) == (old_size, old_size + 10)
        assert att["ok"] is False
        # The attested identity stays what was computed first: the engine loaded those bytes.
        assert att["shard_manifest_sha256"] == manifest_sha

        # Adopting the new files as the baseline clears the drift.
        result = httpx.post(f"{base}/rehash?rebaseline=1", timeout=30).json()
        assert result["drift"] == []
        att = httpx.get(f"{base}/attestation").json()
        assert att["shard_manifest_sha256"] == independent_manifest(ckpt)[1]


def test_byte_change_that_keeps_size_and_mtime_needs_a_rehash(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=3)
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    with running_sidecar(
        port,
        ckpt,
        tmp_path / "sidecar.log",
        "--verify-interval",
        "0.1",
        "--no-cache",
        generation="g",
    ):
        wait_for(f"{base}/attestation", 20)
        shard = ckpt / SHARD2
        st = shard.stat()
        data = bytearray(shard.read_bytes())
        data[1000] ^= 0xFF
        shard.write_bytes(bytes(data))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        verified = httpx.get(f"{base}/drift").json()["verified_at"]
        assert wait_until(lambda: httpx.get(f"{base}/drift").json()["verified_at"] != verified, 5)
        assert httpx.get(f"{base}/drift").json()["drift"] == []
        result = httpx.post(f"{base}/rehash", timeout=30).json()
        assert [(d["path"], d["kind"]) for d in result["drift"]] == [(SHARD2, "sha256")]


def test_a_restart_after_a_rehash_attests_the_bytes_on_disk(tmp_path: Path) -> None:
    """A rehash found a shard whose bytes changed with the same size and mtime; the cache still
    held the old hash under that size and mtime, so a restarted sidecar attested the old
    manifest with no drift (and finalize-fleet passed on bytes known to differ)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=4)
    _, before_sha, _ = independent_manifest(ckpt)
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    flags = {"generation": "g", "--cache": str(tmp_path / "cache.json")}
    with running_sidecar(port, ckpt, tmp_path / "a.log", **flags):
        assert wait_for(f"{base}/attestation", 20)["shard_manifest_sha256"] == before_sha
        shard = ckpt / SHARD1
        st = shard.stat()
        data = bytearray(shard.read_bytes())
        data[:4] = b"ZZZZ"
        shard.write_bytes(bytes(data))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        result = httpx.post(f"{base}/rehash", timeout=30).json()
        assert [(d["path"], d["kind"]) for d in result["drift"]] == [(SHARD1, "sha256")]
    _, on_disk_sha, _ = independent_manifest(ckpt)
    assert on_disk_sha != before_sha
    with running_sidecar(port, ckpt, tmp_path / "b.log", **flags):
        att = wait_for(f"{base}/attestation", 20)
    assert att["shard_manifest_sha256"] == on_disk_sha
    # From the cache the rehash rewrote, not by reading the shards again.
    assert (att["hashed_files"], att["cached_files"]) == (0, 3)


def test_cache_spares_a_restarted_sidecar_the_reread(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=5)
    cache = tmp_path / "cache.json"
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    flags = {"generation": "g", "--cache": str(cache)}
    with running_sidecar(port, ckpt, tmp_path / "a.log", **flags):
        first = wait_for(f"{base}/attestation", 20)
    assert first["hashed_files"] == 3
    # Touch one shard: only that one is read again.
    os.utime(ckpt / SHARD1)
    with running_sidecar(port, ckpt, tmp_path / "b.log", **flags):
        second = wait_for(f"{base}/attestation", 20)
    assert (second["hashed_files"], second["cached_files"]) == (1, 2)
    assert second["shard_manifest_sha256"] == first["shard_manifest_sha256"]


def test_hashing_streams_in_chunks(tmp_path: Path) -> None:
    # A sparse 64 MiB shard: hashing it must not hold it in memory.
    big = tmp_path / "ckpt" / "big.safetensors"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(64 << 20)
    expected = hashlib.sha256()
    zeros = bytes(1 << 20)
    for _ in range(64):
        expected.update(zeros)
    tracemalloc.start()
    try:
        got = sidecar.hash_file(big, chunk_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == expected.hexdigest()
    assert peak < 4 << 20, f"peak {peak} bytes while hashing a 64 MiB file"


def test_parallel_manifest_equals_the_independent_one(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=9)
    entries, hashed = sidecar.compute_manifest(ckpt, {}, 4, 4096, sidecar.Progress())
    lines, manifest_sha, _ = independent_manifest(ckpt)
    assert hashed == 3
    text = sidecar.manifest_text(entries)
    assert text.splitlines() == lines
    assert hashlib.sha256(text.encode()).hexdigest() == manifest_sha


def test_gpu_arch_comes_from_rocminfo_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "rocminfo"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\necho '  Name:                    AMD EPYC 9575F'\n"
        "echo '  Name:                    gfx950'\necho '  Name:                    gfx950'\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    assert sidecar.detect_gpu_arch() == ["gfx950"]


def test_generation_follows_the_engine_process(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    pidfile = tmp_path / "engine.pid"
    pidfile.write_text(f"{os.getpid()}\n")
    args = sidecar._parser().parse_args(
        [
            *("--engine-id", "e0", "--checkpoint", str(ckpt), "--port", "1", "--model-id", "m"),
            *("--model-revision", "r", "--tp", "8", "--gpu-arch", "sim"),
            *("--engine-pidfile", str(pidfile), "--no-cache"),
        ]
    )
    att = sidecar.Attestor(sidecar._settings(args))
    doc = att.engine_doc()
    assert doc["pid"] == os.getpid() and doc["engine_alive"] is True
    assert doc["generation"].startswith("g") and len(doc["generation"]) == 17
    assert doc["generation"] == att.engine_doc()["generation"]  # stable for one process
    pidfile.write_text("999999999\n")  # no such process: the engine is gone
    doc = att.engine_doc()
    assert doc["engine_alive"] is False and doc["generation"] is None


def test_a_pidfile_that_holds_no_pid_is_said_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    pidfile = tmp_path / "engine.pid"
    args = sidecar._parser().parse_args(
        [
            *("--engine-id", "e0", "--checkpoint", str(ckpt), "--port", "1", "--model-id", "m"),
            *("--model-revision", "r", "--tp", "8", "--gpu-arch", "sim"),
            *("--engine-pidfile", str(pidfile), "--no-cache"),
        ]
    )
    att = sidecar.Attestor(sidecar._settings(args))
    # Not written yet, or empty while being written: no pid, nothing to say.
    assert att.engine_doc()["pid"] is None
    pidfile.write_text("")
    assert att.engine_doc()["pid"] is None
    assert capsys.readouterr().err == ""
    # Garbage (a path, a negative number) was read as no pid without a word.
    for garbage in ("/run/engine.pid\n", "-5\n"):
        pidfile.write_text(garbage)
        doc = att.engine_doc()
        att.engine_doc()  # said once per content, not at every read
        assert doc["pid"] is None and doc["generation"] is None
        err = capsys.readouterr().err
        assert err.count("not a process id") == 1 and repr(garbage) in err
    pidfile.write_text(f"{os.getpid()}\n")
    assert att.engine_doc()["pid"] == os.getpid()


def test_unusable_checkpoint_is_an_input_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code = sidecar.main(
        [
            *("--engine-id", "e0", "--checkpoint", str(tmp_path / "empty"), "--port", "1"),
            *("--model-id", "m", "--model-revision", "r", "--tp", "8", "--gpu-arch", "sim"),
        ]
    )
    assert code == 2


@pytest.mark.parametrize("flag", ["--tp", "--hash-workers", "--chunk-mib"])
def test_a_count_below_one_is_refused_by_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """One message named all four flags at once, not the one that was wrong."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    args = {"--tp": "8", "--hash-workers": "2", "--chunk-mib": "8", flag: "0"}
    code = sidecar.main(
        [
            *("--engine-id", "e0", "--checkpoint", str(ckpt), "--port", "1"),
            *("--model-id", "m", "--model-revision", "r", "--gpu-arch", "sim"),
            *(item for pair in args.items() for item in pair),
        ]
    )
    assert code == 2
    assert (
        capsys.readouterr().err == f"attestation_sidecar.py: {flag}: must be at least 1 (got 0)\n"
    )


# A stand-in for the container runtime's two queries, answering as `docker inspect --format`
# does from a state file the test rewrites (no container runtime runs on the test host).
FAKE_RUNTIME = """#!/usr/bin/env python3
import json, sys
state = json.load(open(sys.argv[0] + ".json"))
args = sys.argv[1:]
if args[:1] == ["inspect"] and args[-1] in state["containers"]:
    print(state["containers"][args[-1]])
elif args[:2] == ["image", "inspect"] and args[-1] in state["images"]:
    print(json.dumps(state["images"][args[-1]]))
else:
    print(f"Error: No such object: {args[-1]}", file=sys.stderr)
    sys.exit(1)
"""


def test_the_image_digest_is_what_the_running_container_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    declared, other = "sha256:" + "ab" * 32, "sha256:" + "cd" * 32
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    runtime = bin_dir / "docker"
    runtime.write_text(FAKE_RUNTIME)
    runtime.chmod(0o755)
    state = bin_dir / "docker.json"

    def containers_run(image_id: str, repo_digests: list[str]) -> None:
        images = {image_id: repo_digests}
        state.write_text(json.dumps({"containers": {"narwhal-e0": image_id}, "images": images}))

    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    containers_run("sha256:" + "11" * 32, [f"docker.io/vllm/vllm-openai-rocm@{declared}"])
    ckpt = make_checkpoint(tmp_path / "ckpt")
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    with running_sidecar(
        port,
        ckpt,
        tmp_path / "sidecar.log",
        "--no-cache",
        generation="gen-test",
        **{"--image-digest": declared, "--container": "narwhal-e0"},
    ):
        att = wait_for(f"{base}/attestation", 20)
        assert (att["image_digest"], att["image_digest_source"]) == (declared, "container")
        # The container was recreated from another image under the same tag: the attestation
        # says so on the next read, whatever the plan declared.
        containers_run("sha256:" + "22" * 32, [f"docker.io/vllm/vllm-openai-rocm@{other}"])
        att = httpx.get(f"{base}/attestation").json()
        assert att["image_digest"] == other and att["image_digest_declared"] == declared
        # A locally built image has no repository digest: unreadable, never the declared one.
        containers_run("sha256:" + "33" * 32, [])
        att = httpx.get(f"{base}/attestation").json()
        assert att["image_digest"] is None
        assert att["image_digest_source"] == "container-unreadable"
        assert "has no repository digest" in att["image_digest_error"]
        state.write_text(json.dumps({"containers": {}, "images": {}}))
        att = httpx.get(f"{base}/attestation").json()
        assert att["image_digest"] is None
        assert "No such object: narwhal-e0" in att["image_digest_error"]
