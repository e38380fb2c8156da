"""The journal's files: the active one (a raw ``O_APPEND`` descriptor that is written, truncated
back to its last complete record and fsynced), rotation to numbered backups, and listing them.

The file is a raw ``O_APPEND`` descriptor with no user-space buffer: when ``os.write`` returns,
the record is in the kernel and survives a crash of the process (that is the per-record
"flush"). ``fsync`` (survive a crash of the machine) runs every ``fsync_interval_s``, when
``flush(fsync=True)`` asks, before a rotation and at close. Files are private: mode 0600 in
directories created 0700.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import Final

log = logging.getLogger("narwhal.journal")

FILE_MODE: Final = 0o600
DIR_MODE: Final = 0o700
_OPEN_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC


def journal_files(path: str | os.PathLike[str]) -> list[Path]:
    """The journal's existing files, oldest first: ``<path>.N`` ... ``<path>.1``, ``<path>``.

    Every numeric suffix is listed, also beyond the current ``backups`` (left by an earlier
    configuration), so recovery never misses a start.
    """
    path = Path(path)
    prefix = path.name + "."
    backups: list[tuple[int, Path]] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in path.parent.iterdir():
            suffix = entry.name[len(prefix) :]
            if entry.name.startswith(prefix) and suffix.isdigit() and entry.is_file():
                backups.append((int(suffix), entry))
    files = [p for _, p in sorted(backups, reverse=True)]
    if path.is_file():
        files.append(path)
    return files


def backup_path(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def rotate_files(path: Path, backups: int) -> None:
    """``<path>`` -> ``<path>.1`` -> ... -> ``<path>.<backups>`` (the oldest dropped), like
    logging's RotatingFileHandler. Raises ``OSError``; the caller has closed ``<path>``."""
    for index in range(backups - 1, 0, -1):
        source = backup_path(path, index)
        if source.exists():
            os.replace(source, backup_path(path, index + 1))
    if path.exists():
        os.replace(path, backup_path(path, 1))
    fsync_dir(path.parent)


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and missing parents with mode 0700 (existing ones are untouched).

    ``os.makedirs(mode=...)`` applies the mode to the leaf only, so each level is made here.
    """
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory_to_make in reversed(missing):
        try:
            os.mkdir(directory_to_make, DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(directory_to_make, DIR_MODE)  # the umask may have narrowed it, never widened


def make_files_private(path: Path) -> None:
    """Set mode 0600 on every existing file of the journal at ``path`` (warns on failure)."""
    for existing in journal_files(path):
        try:
            os.chmod(existing, FILE_MODE)
        except OSError as exc:
            log.warning("journal: cannot chmod %s to 0600: %s", existing, exc)


def fsync_dir(directory: Path) -> None:
    """Make a create or rename durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


class JournalFile:
    """The active journal file: a raw ``O_APPEND`` descriptor and the size of its complete
    records.

    No user-space buffer, so there is nothing to flush and nothing half-written left in memory
    after an error. The writer thread owns it exclusively.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    @classmethod
    def open(cls, path: Path) -> JournalFile:
        fd = os.open(path, _OPEN_FLAGS, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # an existing file keeps its mode through os.open
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        fsync_dir(path.parent)
        return cls(fd, size)

    def ends_with_newline(self, path: Path) -> bool:
        """Whether the file is empty or its last byte ends a line (a crash can tear the last
        record; the next one must not be glued onto it)."""
        if self.size == 0:
            return True
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def end_torn_line(self, path: Path) -> None:
        """After a crash tore the last record, end its line so the next record starts on a new
        one. Recovery reports the fragment; it is never removed (evidence, not garbage).
        Closes the file if that write fails, and raises."""
        if self.ends_with_newline(path):
            return
        try:
            self.write(b"\n")
        except BaseException:
            self.close()
            raise

    def write(self, data: bytes) -> None:
        """Write all of ``data`` or raise; ``size`` follows what reached the file."""
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            self.size += n
            view = view[n:]

    def truncate(self, size: int) -> None:
        """Cut the file back to ``size`` (the end of its last complete record)."""
        os.ftruncate(self.fd, size)
        self.size = size

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
