"""
A real HAProxy for the cluster's tests: Debian's C{haproxy} (or
C{BLAZAR_HAPROXY}) on a free loopback port, run in the foreground from
the very config Blazar ships (C{contrib/haproxy/blazar.cfg}, never a copy
of it): its addresses come from the environment (C{BLAZAR_LISTEN},
C{BLAZAR_NODE_A}...), which is how that file takes them. Its log is a
file in a temp dir. No system service is touched.

A missing haproxy fails the test (never a skip), saying what to install.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.servers import free_port, not_installed

INSTALL = "apt-get install haproxy (Debian's, /usr/sbin/haproxy)"

CONFIG = Path(__file__).resolve().parent.parent / "contrib" / "haproxy" / "blazar.cfg"

NODES = ("a", "b", "c")  # the servers the shipped config names


def binary() -> str | None:
    """
    The C{haproxy} to run, if installed.
    """
    given = os.environ.get("BLAZAR_HAPROXY")
    if given:
        return given if Path(given).exists() else None
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None)


def missing() -> AssertionError:
    return not_installed("the cluster's balancer tests need HAProxy, which is", INSTALL)


def environment(listen: str, nodes: dict[str, str]) -> dict[str, str]:
    """
    The variables the shipped config reads.

    @param listen: C{host:port} of the frontend.
    @param nodes: Server name (C{a}, C{b}, C{c}) to C{host:port}.
    """
    assert set(nodes) == set(NODES), f"the shipped config names servers {NODES}"
    return {"BLAZAR_LISTEN": listen, **{f"BLAZAR_NODE_{name.upper()}": where for name, where in nodes.items()}}


def check(path: str, listen: str, nodes: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """
    C{haproxy -c} on the shipped config with these addresses.
    """
    return subprocess.run(
        [path, "-c", "-f", str(CONFIG)],
        env={**os.environ, **environment(listen, nodes)},
        capture_output=True,
        text=True,
        timeout=30,
    )


class HAProxy:
    """
    One C{haproxy -db -f contrib/haproxy/blazar.cfg} on a loopback port.

    @ivar port: The frontend's port.
    """

    def __init__(self, path: str, nodes: dict[str, int]) -> None:
        self._binary = path
        self.root = Path(tempfile.mkdtemp(prefix="blazar-haproxy-"))
        self.port = free_port()
        self.nodes = {name: f"127.0.0.1:{port}" for name, port in nodes.items()}
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.root / "haproxy.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        """
        Check the config, start HAProxy and wait until its frontend takes
        connections.

        @raise RuntimeError: The config does not check, or HAProxy exited.
        """
        listen = f"127.0.0.1:{self.port}"
        checked = check(self._binary, listen, self.nodes)
        if checked.returncode != 0:
            raise RuntimeError(f"haproxy -c refused {CONFIG}:\n{checked.stdout}{checked.stderr}")
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [self._binary, "-db", "-f", str(CONFIG)],
                env={**os.environ, **environment(listen, self.nodes)},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self._process.returncode}:\n{self.log()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("haproxy did not take connections within 30 s")

    def stop(self) -> None:
        """
        Stop HAProxy (TERM, then KILL after 10 s) and wait for it.
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


def server(nodes: dict[str, int]) -> HAProxy:
    """
    A running HAProxy in front of C{nodes} (server name to loopback port),
    removed at exit (or by L{HAProxy.remove}).

    @raise AssertionError: haproxy is not installed (L{missing}).
    """
    path = binary()
    if path is None:
        raise missing()
    made = HAProxy(path, nodes)
    atexit.register(made.remove)
    made.start()
    return made
