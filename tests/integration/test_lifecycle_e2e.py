"""
The daemon's process lifecycle: clean stop, bind conflicts, bad configs.
Each test runs its own short-lived daemon.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon, alive


def test_stop_leaves_no_engine_behind(engine: str, models: dict[str, GeneratedModel], tmp_path: Path) -> None:
    d = Daemon(tmp_path, daemon_config(engine, models))
    d.start()
    try:
        for model in ("tiny", "cold"):
            status, body = d.post_json(
                "/v1/chat/completions",
                {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert status == 200, body
        engines = d.engines()
        assert len(engines) == 2
        code = d.stop()
        assert code in (0, -signal.SIGTERM), d.log()[-3000:]
        assert [p.pid for p in engines if alive(p)] == []
        assert "stopped" in d.log()
    finally:
        d.kill_everything()


def test_engines_die_with_a_killed_daemon(engine: str, models: dict[str, GeneratedModel], tmp_path: Path) -> None:
    d = Daemon(tmp_path, daemon_config(engine, models))
    d.start()
    try:
        status, _ = d.post_json(
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert status == 200
        (child,) = d.engines()
        run = d.root / "data" / "run"
        assert json.loads((run / "tiny_latest.pid").read_text())["pid"] == child.pid
        assert (run / "tiny_latest.apikey").stat().st_mode & 0o777 == 0o600
        assert d.proc is not None
        d.proc.kill()
        d.proc.wait()
        # PR_SET_PDEATHSIG: the kernel kills the orphan at once
        child.wait(10)
        assert not alive(child)
        # the stale run files are found and cleared on the next start
        assert (run / "tiny_latest.pid").exists()
        d.start()
        assert not (run / "tiny_latest.pid").exists()
        status, _ = d.post_json(
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert status == 200
        (new,) = d.engines()
        assert json.loads((run / "tiny_latest.pid").read_text())["pid"] == new.pid
        d.stop()
        assert not (run / "tiny_latest.pid").exists()
    finally:
        d.kill_everything()


def test_second_daemon_on_same_port_exits_3(engine: str, models: dict[str, GeneratedModel], tmp_path: Path) -> None:
    first = Daemon(tmp_path / "a", daemon_config(engine, models))
    first.start()
    try:
        second = Daemon(tmp_path / "b", daemon_config(engine, models), port=first.port)
        second.start(wait=False)
        assert second.proc is not None
        assert second.proc.wait(30) == 3
        assert f"cannot listen on 127.0.0.1:{first.port}" in second.log()
        assert "listen" in second.log()
        # the first one is unharmed
        assert first.request("GET", "/health")[0] == 200
    finally:
        first.stop()
        first.kill_everything()


@pytest.mark.parametrize(
    "config_text, needle",
    [
        ("listne = 1\n", "'listne'"),
        ('ready_timeout = "soon"\n', "'ready_timeout'"),
        ("[models.tiny]\nctx_size = -4\n", "'models.tiny.ctx_size'"),
    ],
)
def test_bad_config_exits_nonzero_naming_the_key(tmp_path: Path, config_text: str, needle: str) -> None:
    d = Daemon(tmp_path, config_text)
    result = subprocess.run(d.command(), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert needle in output, output
    assert str(d.config) in output


def blazar_cli(*args: str) -> subprocess.CompletedProcess[str]:
    import sys
    from pathlib import Path as P

    return subprocess.run([str(P(sys.executable).parent / "blazar"), *args], capture_output=True, text=True, timeout=60)


def test_control_verbs(engine: str, models: dict[str, GeneratedModel], tmp_path: Path) -> None:
    import stat

    d = Daemon(tmp_path, daemon_config(engine, models))
    d.start()
    try:
        cfg = str(d.config)
        run = d.root / "data" / "run"
        sock = run / "control.sock"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        status, _ = d.post_json(
            "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        )
        assert status == 200
        (child,) = d.engines()
        ps = blazar_cli("ps", "--json", "-c", cfg)
        assert ps.returncode == 0, ps.stderr
        rows = json.loads(ps.stdout)
        assert [(r["model"], r["pid"], r["state"]) for r in rows] == [("tiny:latest", child.pid, "ready")]
        table = blazar_cli("ps", "-c", cfg)
        assert "tiny:latest" in table.stdout and str(child.pid) in table.stdout
        st = blazar_cli("status", "-c", cfg)
        assert st.returncode == 0 and engine in st.stdout
        miss = blazar_cli("evict", "nope", "-c", cfg)
        assert miss.returncode == 1 and "nope" in miss.stderr
        ev = blazar_cli("evict", "tiny", "-c", cfg)
        assert ev.returncode == 0 and "tiny:latest" in ev.stdout
        child.wait(10)
        assert not alive(child)
        assert "tiny" in blazar_cli("models", "list", "-c", cfg).stdout
    finally:
        d.stop()
        d.kill_everything()
    for verb in (["ps"], ["status"], ["evict", "--all"], ["version"], ["models", "list"]):
        gone = blazar_cli(*verb, "-c", cfg)
        assert gone.returncode == 2, (verb, gone.stdout, gone.stderr)
        assert gone.stderr.count("\n") == 1 and "blazar serve" in gone.stderr


def test_run_and_doctor(engine: str, models: dict[str, GeneratedModel], tmp_path: Path) -> None:
    d = Daemon(tmp_path, daemon_config(engine, models))
    d.start()
    try:
        cfg = str(d.config)
        one = blazar_cli("run", "tiny", "hello", "-c", cfg)
        assert one.returncode == 0, one.stderr
        assert one.stdout.endswith("\n") and len(one.stdout) > 1
        missing = blazar_cli("run", "nope", "hi", "-c", cfg)
        assert missing.returncode == 1 and 'model "nope" not found' in missing.stderr
        doctor = blazar_cli("doctor", "-c", cfg)
        assert doctor.returncode == 0, doctor.stdout
        assert "[ok] engine:" in doctor.stdout and "in use" in doctor.stdout
    finally:
        d.stop()
        d.kill_everything()
    gone = blazar_cli("run", "tiny", "hi", "-c", cfg)
    assert gone.returncode == 2 and "blazar serve" in gone.stderr


def test_second_daemon_on_same_data_dir_and_reload(
    engine: str, models: dict[str, GeneratedModel], tmp_path: Path
) -> None:
    first = Daemon(tmp_path / "a", daemon_config(engine, models))
    first.start()
    try:
        # another port, the same data_dir: the control socket's lock refuses it
        second = Daemon(tmp_path / "b", daemon_config(engine, models))
        second.config.write_text(
            second.config.read_text().replace(
                f'data_dir = "{second.root / "data"}"', f'data_dir = "{first.root / "data"}"'
            )
        )
        second.start(wait=False)
        assert second.proc is not None and second.proc.wait(30) == 3
        assert "another blazar daemon runs on this data_dir" in second.log()
        assert first.request("GET", "/health")[0] == 200
        # reload: a new key takes effect without a restart
        text = first.config.read_text()
        first.config.write_text(text + '[[keys]]\nname = "late"\nsecret = "late-secret-0123456789"\n')
        out = blazar_cli("reload", "-c", str(first.config))
        assert out.returncode == 0 and "config reloaded" in out.stdout, out.stderr
        assert first.request("GET", "/v1/models")[0] == 401
        first.config.write_text(text + 'listen = "tcp:1"\n')  # invalid: listen twice
        bad = blazar_cli("reload", "-c", str(first.config))
        assert bad.returncode == 1
        assert first.request("GET", "/v1/models")[0] == 401  # still the last good config
    finally:
        first.stop()
        first.kill_everything()
