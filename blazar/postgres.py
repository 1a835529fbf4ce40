"""
The durable store on PostgreSQL (C{[cluster] database =
"postgresql://..."}): one connection that speaks as much of
C{sqlite3.Connection} as L{blazar.store}'s functions use (C{execute},
C{executemany}, C{close}, with C{?} placeholders), so that the same
functions run on either store, and that fails loudly and reconnects.

A store that cannot be reached is never taken for an empty one: the
operation raises L{StoreUnavailable}, which names the server
(C{PostgreSQL at db.lan:5432 is unreachable: ...}), and the next operation
opens a new connection. A transaction whose connection broke is over: its
statements fail until its C{ROLLBACK}, so no half of one runs on a new
connection.

psycopg is imported on the first connection only: a daemon on SQLite never
loads it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, Sequence

if TYPE_CHECKING:
    import psycopg

CONNECT_TIMEOUT_SECS = 5
# a server that stops answering without closing (a partition, a host gone) is found dead
# within ~15 s rather than hanging the store's thread, and with it the key poll, for good
DEAD_PEER = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 15000,  # ms: data sent and not acknowledged
}
"""How long a connection attempt may take before the store is unreachable."""


class Rows(Protocol):
    """
    What a statement gives back, as SQLite's cursor does: its rows
    (tuples) and how many it changed.
    """

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class StoreUnavailable(Exception):
    """
    The durable store cannot be reached (or the connection to it broke);
    the message names it. The operation did not happen (or, for a
    C{COMMIT} cut short, may not have).
    """


def describe(url: str) -> str:
    """
    C{host:port} of a PostgreSQL connection URL (C{postgresql://user:secret@host:port/db}),
    as messages name the server: never its user or password.
    """
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(url)
    except Exception:
        return "the configured address"
    host = str(parts.get("host") or parts.get("hostaddr") or "localhost")
    return f"{host}:{parts.get('port') or 5432}"


class PgDatabase:
    """
    One connection to a PostgreSQL database, in autocommit mode (a
    transaction is an explicit C{BEGIN} ... C{COMMIT}, as L{blazar.store}
    writes them for SQLite too), opened on first use and again after it
    broke.

    It may be shared by threads: a statement, or a whole transaction
    (L{transaction}), holds the connection's lock, so one thread's
    transaction never takes another's statements in.

    @ivar url: The connection URL (holds the password: never logged).
    @ivar where: C{host:port}, as messages name the server.
    """

    dialect = "postgresql"

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = describe(url)
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.RLock()
        self._in_transaction = False
        self._broken_in_transaction = False
        self._sql: dict[str, str] = {}

    @property
    def in_transaction(self) -> bool:
        """
        Whether a C{BEGIN} is open (its C{COMMIT} or C{ROLLBACK} to come).
        """
        return self._in_transaction

    def _unavailable(self, error: BaseException | None = None) -> StoreUnavailable:
        reason = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else "connection lost"
        return StoreUnavailable(f"PostgreSQL at {self.where} is unreachable: {reason}")

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self._drop()
        if self._in_transaction:
            # the transaction died with its connection: nothing of it may run on another
            self._broken_in_transaction = True
            raise self._unavailable()
        import psycopg
        import psycopg.conninfo

        try:
            conninfo = psycopg.conninfo.make_conninfo(self.url, **DEAD_PEER)
            self._conn = psycopg.connect(conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECS)
        except psycopg.OperationalError as e:
            raise self._unavailable(e) from None
        return self._conn

    def _translate(self, sql: str) -> str:
        done = self._sql.get(sql)
        if done is None:
            if "%" in sql:
                raise ValueError(f"a store statement may not hold '%': {sql!r}")
            done = self._sql[sql] = sql.replace("?", "%s")
        return done

    def _run(self, sql: str, call: Any) -> Any:
        import psycopg

        with self._lock:
            word = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
            if word == "ROLLBACK" and (self._broken_in_transaction or self._conn is None or self._conn.broken):
                # the server dropped the transaction with the connection
                self._in_transaction = self._broken_in_transaction = False
                self._drop()
                return _NO_ROWS
            conn = self._connection()
            try:
                result = call(conn)
            except psycopg.OperationalError as e:
                if conn.closed or conn.broken:
                    if self._in_transaction:
                        self._broken_in_transaction = True
                    if word in ("COMMIT", "ROLLBACK"):
                        self._in_transaction = self._broken_in_transaction = False
                    self._drop()
                    raise self._unavailable(e) from None
                raise
            finally:
                if word in ("COMMIT", "ROLLBACK", "END", "ABORT"):
                    self._in_transaction = False
            if word in ("BEGIN", "START"):
                self._in_transaction = True
            return result

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Rows:
        """
        Run one statement (C{?} placeholders, as for SQLite).

        @return: Its cursor: C{fetchone}, C{fetchall}, C{rowcount},
            iteration over the rows (tuples).
        @raise StoreUnavailable: The server cannot be reached, or the
            connection broke.
        """
        query = self._translate(sql)
        return self._run(sql, lambda conn: conn.execute(query, tuple(parameters) if parameters else None))

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Rows:
        """
        Run one statement once per parameter row.

        @raise StoreUnavailable: As L{execute}.
        """
        query = self._translate(sql)
        rows = [tuple(p) for p in parameters]

        def many(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
            cursor = conn.cursor()
            if rows:
                cursor.executemany(query, rows)
            return cursor

        return self._run(sql, many)

    @contextmanager
    def transaction(self, begin: str = "BEGIN") -> Iterator[None]:
        """
        One transaction around the block, holding the connection's lock
        throughout: C{BEGIN} (SQLite's C{BEGIN IMMEDIATE} is a plain one
        here: PostgreSQL locks rows as they are written), C{COMMIT} after,
        C{ROLLBACK} if the block or the commit raises.
        """
        with self._lock:
            self.execute("BEGIN" if begin.upper().startswith("BEGIN IMMEDIATE") else begin)
            try:
                yield
                self.execute("COMMIT")
            except BaseException:
                if self._in_transaction:
                    self.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._in_transaction = self._broken_in_transaction = False
            self._drop()


class _NoRows:
    @property
    def rowcount(self) -> int:
        return 0

    def fetchone(self) -> None:
        return None

    def fetchall(self) -> list[Any]:
        return []

    def __iter__(self) -> Iterator[Any]:
        return iter(())


_NO_ROWS = _NoRows()
