"""The evidence bundle, as the reference run hands it over: ``qualification-artifacts.tgz`` and
its SHA-256 (``sha256sum`` format) beside it, holding everything under one directory.

The archive is reproducible: members sorted, owners and times zeroed, gzip without a timestamp,
so the same evidence always hashes the same. A bundle already inside the directory (the
benchmark runner's, below a qualification run) is left out: every file it holds is there
itself, and its digest file stays.
"""

from __future__ import annotations

import gzip
import hashlib
import tarfile
from pathlib import Path

__all__ = ["BUNDLE_NAME", "write_bundle"]

BUNDLE_NAME = "qualification-artifacts.tgz"


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def write_bundle(out: Path) -> tuple[Path, str]:
    """``out/qualification-artifacts.tgz`` of everything under ``out`` (but bundles and this
    bundle's digest), and ``<bundle>.sha256`` beside it; (path, SHA-256)."""
    bundle = out / BUNDLE_NAME
    digest_file = out / (BUNDLE_NAME + ".sha256")
    files = sorted(
        p for p in out.rglob("*") if p.is_file() and p.name != BUNDLE_NAME and p != digest_file
    )
    tmp = bundle.with_name(bundle.name + ".tmp")
    with (
        tmp.open("wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for path in files:
            tar.add(path, arcname=str(path.relative_to(out)), filter=_reset)
    tmp.replace(bundle)
    digest = hashlib.sha256(bundle.read_bytes()).hexdigest()
    digest_file.write_text(f"{digest}  {BUNDLE_NAME}\n")
    return bundle, digest
