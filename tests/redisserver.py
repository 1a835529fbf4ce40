"""
A real Redis for the Redis quotas' tests: Debian's C{redis-server} (or
C{BLAZAR_REDIS_SERVER}) on a free loopback port, its files in a temp dir,
no persistence (C{--save "" --appendonly no}). No system service is
touched.

L{shared} starts one server for the whole run (stopped and removed at
exit); each test takes a database number of its own (L{RedisServer.url}
with L{RedisServer.new_db}, flushed first). L{server} starts one for a
test that stops it. A missing redis-server fails the
test (never a skip), saying what to install.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.servers import free_port, not_installed

INSTALL = "apt-get install redis-server (Debian's server, /usr/bin/redis-server)"


def binary() -> str | None:
    """
    The C{redis-server} to run, if installed.
    """
    given = os.environ.get("BLAZAR_REDIS_SERVER")
    if given:
        return given if Path(given).exists() else None
    return shutil.which("redis-server")


def missing() -> AssertionError:
    return not_installed("the Redis quotas' tests need Redis's server, which is", INSTALL)


class RedisServer:
    """
    One C{redis-server} on a loopback port, in a temp dir.

    @ivar port: The port it listens on (the same after L{stop} and L{start}).
    """

    def __init__(self, path: str) -> None:
        self._binary = path
        self.root = Path(tempfile.mkdtemp(prefix="blazar-redis-"))
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._dbs = itertools.count(1)

    def start(self) -> None:
        """
        Start the server and wait until it answers C{PING}.
        """
        argv = [
            self._binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.root),
            "--save",
            "",
            "--appendonly",
            "no",
            "--databases",
            "64",
            "--daemonize",
            "no",
        ]
        log = open(self.root / "server.log", "ab")
        self._process = subprocess.Popen(argv, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer within 30 s")

    def stop(self) -> None:
        """
        Stop the server (TERM, then KILL after 10 s) and wait for it.
        """
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def new_db(self) -> str:
        """
        The URL of a database number no other test of this run used,
        flushed.
        """
        import redis

        db = next(self._dbs) % 64
        client = redis.Redis.from_url(self.url(db))
        client.flushdb()
        client.close()
        return self.url(db)


_shared: RedisServer | None = None


def server() -> RedisServer:
    """
    A new server of its own (a test that stops it), removed at exit.

    @raise AssertionError: it is not installed (L{missing}).
    @raise AssertionError: redis-server is not installed, in CI.
    """
    path = binary()
    if path is None:
        raise missing()
    made = RedisServer(path)
    atexit.register(made.remove)
    made.start()
    return made


def shared() -> RedisServer:
    """
    The run's one server, started on first use.

    @raise AssertionError: it is not installed (L{missing}).
    """
    global _shared
    if _shared is None:
        _shared = server()
    return _shared
