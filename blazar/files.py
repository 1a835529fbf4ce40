"""
Private files and directories. What Blazar writes that holds conversations,
usage, keys or audit lines (C{<data_dir>/blazar.db} and its C{-wal}/C{-shm},
the audit log, C{run/*.apikey}, the config file's rewrites) is mode 0600,
and the directories it keeps them in 0700: set explicitly, never left to
the umask, before any data is written. A file or directory that already
exists with another mode is set to it when Blazar opens it, so a data dir
made by an older version (0644 files in a 0755 directory) is tightened at
the next start.

Standard library only, so that any layer may use it. Every function here
blocks (file system calls): call it in a thread pool, or at startup before
the reactor serves.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, Callable, TypeVar

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700

T = TypeVar("T")


def set_mode(path: Path, mode: int) -> int | None:
    """
    Set C{path}'s permission bits to exactly C{mode}, if it exists with
    others. A path owned by another user (C{chmod} refused with C{EPERM})
    is left as its owner made it.

    @return: The previous permission bits if they were changed, else
        L{None} (already C{mode}, missing, or not ours).
    """
    try:
        old = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    if old == mode:
        return None
    try:
        os.chmod(path, mode)
    except PermissionError:
        return None
    return old


def private_dir(path: Path) -> int | None:
    """
    Create C{path} (and missing parents, which get the usual mode) and make
    C{path} itself mode 0700.

    @return: Its previous permission bits if it existed with others, else
        L{None}.
    """
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    return set_mode(path, PRIVATE_DIR)


def open_private(path: Path, flags: int) -> int:
    """
    C{os.open(path, flags | O_CREAT, 0o600)}, then C{fchmod} to 0600: the
    mode holds whatever the umask, and an existing file with a looser mode
    is tightened before the caller writes to it (a file owned by another
    user keeps its mode).

    @param flags: C{os.O_*} flags (C{O_CREAT} is added).
    @return: The open file descriptor; the caller closes it.
    """
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE_FILE:
            os.fchmod(fd, PRIVATE_FILE)
    except PermissionError:
        pass
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_whole(temp: Path, final: Path, write: Callable[[BinaryIO], T], private: bool = False) -> T:
    """
    Write a file whole or not at all: C{write(out)} into C{temp}, flushed
    to disk, then renamed to C{final}, so C{final} never holds part of a
    file. On any failure C{temp} is removed and the error raised.

    @param private: Make C{temp} mode 0600 (L{open_private}), whatever the
        umask; otherwise it gets the usual mode.
    @return: What C{write} returned.
    """
    try:
        with os.fdopen(open_private(temp, os.O_WRONLY | os.O_TRUNC), "wb") if private else open(temp, "wb") as out:
            result = write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return result
