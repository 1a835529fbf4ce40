"""
A real PostgreSQL for the store's tests: Debian's server binaries
(C{/usr/lib/postgresql/<version>/bin}, or C{BLAZAR_POSTGRES_BIN}), a
cluster made by C{initdb} in a temp dir, C{postgres} on a free loopback
port (and its socket in that dir), as the C{postgres} user when the tests
run as root (initdb refuses root). No system service is touched.

L{shared} starts one server for the whole run (stopped and removed at exit);
each test takes a fresh database of it (L{PostgresServer.new_database}).
A missing PostgreSQL fails the test (never a skip), saying what to install.
"""

from __future__ import annotations

import atexit
import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tests.servers import free_port, not_installed
from tests.typed import TestCaseMixin

if TYPE_CHECKING:
    from blazar.store import Database

INSTALL = "apt-get install postgresql (Debian's server: /usr/lib/postgresql/*/bin)"


def binaries() -> Path | None:
    """
    The folder of C{initdb} and C{postgres}, if installed.
    """
    given = os.environ.get("BLAZAR_POSTGRES_BIN")
    if given:
        return Path(given) if (Path(given) / "initdb").exists() else None
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


def missing() -> AssertionError:
    return not_installed("the PostgreSQL store's tests need PostgreSQL's server, which is", INSTALL)


class PostgresServer:
    """
    One PostgreSQL cluster in a temp dir, its server on a loopback port.

    @ivar port: The port it listens on (the same after L{stop} and L{start}).
    """

    def __init__(self, bin_dir: Path) -> None:
        self._bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="blazar-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._names = itertools.count()
        self._as: list[str] = []
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        subprocess.run(
            [
                *self._as,
                str(self._bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def start(self) -> None:
        """
        Start the server and wait until it takes connections.
        """
        argv = [
            *self._as,
            str(self._bin / "postgres"),
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-h",
            "127.0.0.1",
            "-k",
            str(self.root),
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
        ]
        log = open(self.root / "server.log", "ab")
        self._process = subprocess.Popen(argv, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"postgres exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                import psycopg

                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError("postgres did not take connections within 30 s")

    def stop(self) -> None:
        """
        Stop the server (fast shutdown: sessions are cut) and wait for it.
        """
        process, self._process = self._process, None
        if process is None:
            return
        subprocess.run(
            [*self._as, str(self._bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """
        A new empty database; its URL.
        """
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


_shared: PostgresServer | None = None


def server() -> PostgresServer:
    """
    A new server of its own (a test that stops it), removed at exit.

    @raise AssertionError: it is not installed (L{missing}).
    @raise AssertionError: PostgreSQL is not installed, in CI.
    """
    bin_dir = binaries()
    if bin_dir is None:
        raise missing()
    made = PostgresServer(bin_dir)
    atexit.register(made.remove)
    made.start()
    return made


def shared() -> PostgresServer:
    """
    The run's one shared server, started on first use.

    @raise AssertionError: it is not installed (L{missing}).
    @raise AssertionError: PostgreSQL is not installed, in CI.
    """
    global _shared
    if _shared is None:
        _shared = server()
    return _shared


class StoreMixin(TestCaseMixin):
    """
    For a test case run on both stores: L{open_store} gives a new, migrated
    store; subclasses say which (L{SQLiteStore}, L{PostgresStore}).
    """

    def open_store(self) -> Database:
        raise NotImplementedError

    def open_stores(self, n: int) -> list[Database]:
        """
        C{n} connections to one new, migrated store (as C{n} nodes share
        it).
        """
        raise NotImplementedError


class SQLiteStore(StoreMixin):
    def open_store(self) -> Database:
        from blazar import store

        db = store.thd_open(Path(self.mktemp()) / "blazar.db")
        self.addCleanup(db.close)
        return db

    def open_stores(self, n: int) -> list[Database]:
        from blazar import store

        path = Path(self.mktemp()) / "blazar.db"
        opened: list[Database] = []
        for _ in range(n):
            db = store.thd_open(path)
            self.addCleanup(db.close)
            opened.append(db)
        return opened


class PostgresStore(StoreMixin):
    def open_store(self) -> Database:
        from blazar import store

        db = store.thd_open_postgres(shared().new_database())
        self.addCleanup(db.close)
        return db

    def open_stores(self, n: int) -> list[Database]:
        from blazar import store

        url = shared().new_database()
        opened: list[Database] = []
        for _ in range(n):
            db = store.thd_open_postgres(url)
            self.addCleanup(db.close)
            opened.append(db)
        return opened
