"""The run's evidence bundle, as the reference run hands it over: ``qualification-artifacts.tgz``
and its SHA-256, holding the runner's whole output directory (client records, journal slices,
metric samples, per-point evidence, the post-load check, the workload, the report and the
pinned inputs) plus what the serving router ran on: its whole journal, the narwhal-check report
that qualified the fleet and the profile store.

The archive is reproducible: members sorted, owners and times zeroed, gzip without a timestamp,
so the same evidence always hashes the same.
"""

from __future__ import annotations

import gzip
import hashlib
import shutil
import tarfile
from pathlib import Path
from typing import Any

from narwhal.journal import journal_files

__all__ = ["BUNDLE_NAME", "gather_evidence", "write_bundle"]

BUNDLE_NAME = "qualification-artifacts.tgz"


def _copy(source: Path, folder: Path, notes: list[str], what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, folder / source.name)
    except OSError as exc:
        notes.append(f"{what}: {source}: {exc.strerror or exc}")


def gather_evidence(
    out: Path, journal: Path, head: dict[str, Any], fleet_path: Path, profile_store: str | None
) -> list[str]:
    """Copy into ``out/evidence/`` what the router ran on: its journal (rotated files too),
    the check report of its ``router.start`` (``head``) with the report's ``.sha256``, and the
    fleet's profile store. The notes say what could not be copied (nothing is guessed)."""
    notes: list[str] = []
    evidence = out / "evidence"
    for file in journal_files(journal):
        _copy(file, evidence / "journal", notes, "router journal")
    qualification = head.get("qualification") or {}
    report = qualification.get("report")
    if isinstance(report, str):
        _copy(Path(report), evidence / "check", notes, "check report")
        digest = Path(report + ".sha256")
        if digest.exists():
            _copy(digest, evidence / "check", notes, "check report digest")
    else:
        notes.append(f"check report: none (qualification {qualification.get('status')})")
    if profile_store:
        store = Path(profile_store)
        if not store.is_absolute() and not store.exists():
            store = fleet_path.parent / store
        _copy(store, evidence / "profiles", notes, "profile store")
    else:
        notes.append("profile store: none in the fleet")
    return notes


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def write_bundle(out: Path) -> tuple[Path, str]:
    """``out/qualification-artifacts.tgz`` of everything under ``out`` (but the bundle and its
    digest), and ``<bundle>.sha256`` beside it (``sha256sum`` format); (path, SHA-256)."""
    bundle = out / BUNDLE_NAME
    skip = {bundle, out / (BUNDLE_NAME + ".sha256")}
    files = sorted(p for p in out.rglob("*") if p.is_file() and p not in skip)
    with (
        bundle.open("wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for path in files:
            tar.add(path, arcname=str(path.relative_to(out)), filter=_reset)
    digest = hashlib.sha256(bundle.read_bytes()).hexdigest()
    (out / (BUNDLE_NAME + ".sha256")).write_text(f"{digest}  {BUNDLE_NAME}\n")
    return bundle, digest
