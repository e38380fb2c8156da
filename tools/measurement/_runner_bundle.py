"""The run's evidence bundle, as the reference run hands it over: ``qualification-artifacts.tgz``
and its SHA-256, holding the runner's whole output directory (client records, journal slices,
metric samples, per-point evidence, the post-load check, the workload, the report and the
pinned inputs) plus what the serving router ran on: its whole journal, the narwhal-check report
that qualified the fleet and the profile store.

The archive is written by ``narwhal.qualify.bundle`` (reproducible: the same evidence always
hashes the same).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from narwhal.journal import journal_files
from narwhal.qualify.bundle import BUNDLE_NAME, write_bundle

__all__ = ["BUNDLE_NAME", "gather_evidence", "write_bundle"]


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
    profile store it read (``head``'s, a router's ``--profiles`` included; else the fleet's,
    ``profile_store``: its path as ``LoadedFleet.profile_store_path`` resolves it). The notes
    say what could not be copied (nothing is guessed)."""
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
    served = head.get("profile_store")
    if isinstance(served, str) and not Path(served).is_file() and profile_store:
        # The router's path is not on this host (or not readable here): the fleet's store.
        notes.append(f"profile store: {served} (the router's) not found here; the fleet's copied")
        served = None
    if isinstance(served, str) or profile_store:
        store = Path(served if isinstance(served, str) else str(profile_store))
        _copy(store, evidence / "profiles", notes, "profile store")
    elif head.get("profile_sha256"):
        notes.append("profile store: the router read one its router.start does not locate")
    else:
        notes.append("profile store: none (the router ran without one)")
    return notes
