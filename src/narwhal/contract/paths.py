"""Where the tools write their output files (a profile store, a check report): checked before
the work that produces them, which takes minutes, so that a path that cannot be written fails
at once and says why, not after the work is done."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "empty_path",
    "file_in_the_way",
    "input_overwritten",
    "same_file",
    "why_unwritable",
]


def file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a directory (a regular file:
    ``path`` can never be made under it), else None."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def why_unwritable(out: Path) -> str | None:
    """Why a file cannot be written at ``out`` (its missing directories created), or None."""
    if out.is_dir():
        return f"{out} is a directory; name the file to write"
    if out.exists() and not out.is_file():
        # A device or a pipe takes the open and fails the write (/dev/full), or swallows a
        # document that is to be read back and hashed; either only after the work is done.
        return f"{out} is {_kind(out)}, not a regular file; name the file to write"
    if (blocker := file_in_the_way(out)) is not None:
        return f"{blocker} is not a directory"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".narwhal-"):
            pass
    except OSError as exc:
        return f"cannot write in {out.parent}: {exc.strerror or exc}"
    return None


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same resolved path (a symlink, ``..`` or
    another spelling), or, when both exist, the same file (a hard link)."""
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, RuntimeError):  # unreadable, or a symlink loop: not provably one file
        return False


def empty_path(pairs: Iterable[tuple[str, str | None]]) -> str | None:
    """The refusal of the first empty path among ``pairs`` of (flag, value as given; None when
    the flag was not given), or None. An empty path (an unset variable in a script) names no
    file: it read as the flag not given, or as the working directory."""
    for flag, value in pairs:
        if value is not None and not value.strip():
            return f"{flag}: an empty path"
    return None


def input_overwritten(
    flag: str, out: Path, beside: Sequence[Path], inputs: Mapping[str, Path]
) -> str | None:
    """Why writing ``out`` (given with ``flag``) or the files written ``beside`` it (its
    sidecars) would replace one of the command's ``inputs`` (what names each: "the file given
    with --fleet"), or None: a one-word slip must not cost the operator a fleet contract or a
    profile store."""
    for written in (out, *beside):
        what = "" if written == out else f"its {written.name} "
        for name, path in inputs.items():
            if same_file(written, path):
                return f"{flag} {out}: {what}is {name} (it would be overwritten)"
    return None


def _kind(path: Path) -> str:
    if path.is_char_device():
        return "a character device"
    if path.is_block_device():
        return "a block device"
    if path.is_fifo():
        return "a named pipe"
    if path.is_socket():
        return "a socket"
    return "a special file"
