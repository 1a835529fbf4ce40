"""
The daemon's SQLite file is shared: the store service holds one
connection, the installed engines' table (blazar.engines.installed) opens
others in the same process, and other processes (the CLI, a backup,
sqlite3) read it while the daemon runs. Every write the daemon commits
must be seen by them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from blazar import store


def read_usage(path: Path) -> str:
    """
    The usage table as another process reads it (and closes it after).
    """
    return subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sqlite3, sys; db = sqlite3.connect(sys.argv[1]); "
                "print(sorted(db.execute('SELECT key, tokens FROM key_usage'))); db.close()"
            ),
            str(path),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_another_process_sees_every_write(tmp_path: Path) -> None:
    """
    Opening the database for a second service used to open and close a
    descriptor of the file, which drops every POSIX lock the process held
    on it: a reader in another process then took itself for the last one,
    deleted the WAL, and saw no write the daemon made after that (they were
    lost in a crash).
    """
    path = tmp_path / "blazar.db"
    usage = store.thd_open(path)
    others = [store.thd_open(path), store.thd_open(path)]  # the other connections in the process
    try:
        store.thd_add_usage(usage, [("2026-12-04", "a", 5)])
        assert read_usage(path) == "[('a', 5)]"
        store.thd_add_usage(usage, [("2026-12-04", "b", 7)])
        assert read_usage(path) == "[('a', 5), ('b', 7)]"
        assert (tmp_path / "blazar.db-wal").exists()  # the daemon's WAL is still its
    finally:
        for db in [usage, *others]:
            db.close()
