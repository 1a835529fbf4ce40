"""
Signals and file modes with a real daemon and real llama-server children
(part of the reliability suite): SIGHUP reloads the config file as
`blazar reload` does while a stream runs, and a broken file leaves the
daemon serving its old config; SIGTERM and SIGINT still stop it cleanly;
under umask 022 the files that hold conversations, usage, keys and audit
lines are 0600 in a 0700 data dir, and a data dir left open by an older
version is tightened at the next start.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon, alive
from tests.integration.reliability import TALLY, tallied

HELLO = [{"role": "user", "content": "hi"}]
KEY = "sighup-secret-0123456789"
WITH_KEY = f'[[keys]]\nname = "late"\nsecret = "{KEY}"\n'
RELOADED = "SIGHUP: config reloaded from"
REFUSED = "SIGHUP: config not reloaded, the running config stays"


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("signals"), daemon_config(engine, models))
    with tallied(d):
        yield d


def call(d: Daemon, method: str, path: str, body: Any = None, key: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def hangup(d: Daemon, needle: str) -> None:
    """
    SIGHUP the daemon and wait for the log line C{needle} that it causes.
    """
    assert d.proc is not None
    before = d.log().count(needle)
    d.proc.send_signal(signal.SIGHUP)
    TALLY.faults += 1
    deadline = time.monotonic() + 15
    while d.log().count(needle) <= before:
        assert d.proc.poll() is None, f"SIGHUP stopped the daemon ({d.proc.returncode}):\n{d.log()[-3000:]}"
        assert time.monotonic() < deadline, f"no {needle!r} after SIGHUP:\n{d.log()[-3000:]}"
        time.sleep(0.02)


def test_sighup_reloads_while_a_stream_runs(daemon: Daemon) -> None:
    base = daemon.config.read_text()
    assert call(daemon, "POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": HELLO})[0] == 200
    events: list[tuple[str, float]] = []
    failures: list[BaseException] = []
    started = threading.Event()

    def read() -> None:
        try:
            for data, at in daemon.stream(
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": HELLO,
                    "stream": True,
                    "max_tokens": 1900,
                    "ignore_eos": True,
                },
            ):
                events.append((data, at))
                started.set()
        except BaseException as e:
            failures.append(e)
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert started.wait(30) and not failures, failures
        daemon.config.write_text(base + WITH_KEY)  # a change made before the signal
        hangup(daemon, RELOADED)
        reloaded_at = time.monotonic()
    finally:
        reader.join(120)
        daemon.config.write_text(base)
    try:
        assert not failures, failures
        assert events[-1][0] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e, _ in events[:-1]]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length", finish[-3:]  # all 1900 tokens
        # the reload happened while the stream ran, and the stream went on to its end
        assert events[-1][1] > reloaded_at, "the stream ended before the reload: make it longer"
        assert call(daemon, "GET", "/v1/models")[0] == 401  # the new key is in force
        assert call(daemon, "GET", "/v1/models", key=KEY)[0] == 200
        print(
            f"SIGHUP reload mid-stream; the stream ran {events[-1][1] - reloaded_at:.2f} s past it, "
            f"{events[-1][1] - events[0][1]:.2f} s in all, {len(events)} events, {sum(1 for _, t in events if t > reloaded_at)} after"
        )
    finally:
        hangup(daemon, RELOADED)  # back to the open config for the next tests
    assert call(daemon, "GET", "/v1/models")[0] == 200


@pytest.mark.parametrize(
    "broken",
    [
        "not toml = = =\n",  # not TOML
        'listen = "tcp:1"\nlisten = "tcp:2"\n',  # a key given twice (inside the [[keys]] table)
        "no_such_setting = 1\n",  # valid TOML, unknown key
    ],
)
def test_sighup_with_a_broken_config_keeps_the_running_one(daemon: Daemon, broken: str) -> None:
    base = daemon.config.read_text()
    try:
        daemon.config.write_text(base + WITH_KEY)
        hangup(daemon, RELOADED)
        daemon.config.write_text(base + WITH_KEY + broken)
        hangup(daemon, REFUSED)
        assert daemon.request("GET", "/health")[0] == 200
        assert call(daemon, "GET", "/v1/models")[0] == 401  # the last good config: keys on
        status, body = call(
            daemon, "POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": HELLO}, key=KEY
        )
        assert status == 200, body
        assert str(daemon.config) in daemon.log().split(REFUSED)[-1].splitlines()[0]
    finally:
        daemon.config.write_text(base)
        hangup(daemon, RELOADED)
    assert "Unhandled Error" not in daemon.log() and "Traceback" not in daemon.log(), daemon.log()[-3000:]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signals_stay_the_graceful_stop(
    engine: str,
    models: dict[str, GeneratedModel],
    tmp_path: Path,
    stop: signal.Signals,
) -> None:
    d = Daemon(tmp_path, daemon_config(engine, models))
    d.start()
    try:
        assert call(d, "POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": HELLO})[0] == 200
        run = tmp_path / "data" / "run"
        assert len(list(run.glob("*.pid"))) == len(list(run.glob("*.apikey"))) == 1
        hangup(d, RELOADED)  # a SIGHUP first changes nothing about the stop
        engines = d.engines()
        assert engines
        assert d.proc is not None
        d.proc.send_signal(stop)
        TALLY.faults += 1
        code = d.proc.wait(60)
        log = d.log()
        # twistd re-raises the signal that stopped it
        assert code == -stop, (code, log[-3000:])
        assert f"Received {stop.name}, shutting down." in log and "Main loop terminated." in log, log[-3000:]
        assert list(run.glob("*.pid")) + list(run.glob("*.apikey")) == []
        assert [p.pid for p in engines if alive(p)] == []
    finally:
        d.kill_everything()


def _group_leader() -> None:
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_terminals_ctrl_c_lets_the_daemon_stop_its_engines(
    engine: str, models: dict[str, GeneratedModel], tmp_path: Path
) -> None:
    """
    A terminal's Ctrl-C signals its whole foreground process group: the
    engines are in a group of their own, so the daemon stops them itself,
    after listing their slots to save the sessions in them.
    """
    d = Daemon(tmp_path, daemon_config(engine, models))
    with open(d.log_path, "ab") as out:
        d.proc = subprocess.Popen(
            d.command(), stdout=out, stderr=subprocess.STDOUT, cwd=d.root, preexec_fn=_group_leader
        )
    try:
        d.wait_healthy()
        assert call(d, "POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": HELLO})[0] == 200
        engines = d.engines()
        assert engines
        group = os.getpgid(d.proc.pid)
        assert group == d.proc.pid
        assert [os.getpgid(p.pid) == group for p in engines] == [False] * len(engines)
        os.killpg(group, signal.SIGINT)  # what the terminal does
        TALLY.faults += 1
        code = d.proc.wait(60)
        log = d.log()
        assert code == -signal.SIGINT, (code, log[-3000:])
        assert "listing its slots before it stops failed" not in log, log[-3000:]
        assert "Received SIGINT, shutting down." in log and "Main loop terminated." in log, log[-3000:]
        assert [p.pid for p in engines if alive(p)] == []
    finally:
        d.kill_everything()


def modes(paths: list[Path]) -> dict[str, str]:
    return {p.name: f"{stat.S_IMODE(p.stat().st_mode):04o}" for p in paths}


def test_private_files_under_umask_022(engine: str, models: dict[str, GeneratedModel], tmp_path: Path) -> None:
    audit = tmp_path / "logs" / "audit.jsonl"
    d = Daemon(tmp_path / "d", f'audit_log = "{audit}"\n' + daemon_config(engine, models))
    data = d.root / "data"

    def start() -> None:
        old = os.umask(0o022)  # the usual one; the daemon inherits it
        try:
            d.start()
        finally:
            os.umask(old)

    def check() -> None:
        status, body = call(d, "POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4})
        assert status == 200, body  # a stored response: a conversation in blazar.db
        deadline = time.monotonic() + 10
        while not audit.exists() or not audit.read_text():
            assert time.monotonic() < deadline, "no audit line"
            time.sleep(0.05)
        run = data / "run"
        files = [
            data / "blazar.db",
            data / "blazar.db-wal",
            data / "blazar.db-shm",
            audit,
            *run.glob("*.apikey"),
            *run.glob("*.pid"),
        ]
        assert len(files) == 6, sorted(p.name for p in run.iterdir())
        assert modes(files) == {p.name: "0600" for p in files}
        assert modes([data, run]) == {"data": "0700", "run": "0700"}

    start()
    try:
        check()
    finally:
        d.close()
    # as an older version left them: readable by everyone
    os.chmod(data, 0o755)
    os.chmod(data / "run", 0o755)
    for p in (data / "blazar.db", audit):
        os.chmod(p, 0o644)
    start()
    try:
        check()
        assert "was mode 0755; set to 0700" in d.log()
    finally:
        d.close()
