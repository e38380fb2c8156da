"""The measurement tools' output directory, made (or refused, naming the flag) before any
work: a trial or a plan's points take minutes, and their results must have somewhere to go."""

from __future__ import annotations

from pathlib import Path

__all__ = ["OutDirError", "prepare_out_dir"]


class OutDirError(ValueError):
    pass


def prepare_out_dir(out: Path, flag: str = "--out") -> None:
    """``out`` exists as a directory afterwards (its parents made), else OutDirError."""
    if out.exists() and not out.is_dir():
        raise OutDirError(f"{flag}: {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutDirError(f"{flag}: cannot create {out}: {exc.strerror or exc}") from None
