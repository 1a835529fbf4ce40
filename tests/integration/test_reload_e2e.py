"""
`blazar reload` against one real daemon: each key that can change at run
time is changed in the config file, reloaded, and its effect observed over
HTTP (the 413 at the new body limit, the CORS header, the header timeout's
408, the keys' 401, /metrics closed, /api/ps expiry from the new default
keep_alive, a pull from the new hub, a wedged child given up on after the
new child_header_timeout_secs under a new engine binary); the CLI names,
key by key, what it applied and what needs a restart. The keys that HTTP
does not show are observed on the assembled service tree in
tests/test_service.py (ReloadEveryKeyTests).
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Iterator

import pytest

from blazar.models.testmodel import GeneratedModel, make_test_model
from tests.integration.fakehub import FakeHub
from tests.integration.harness import Daemon, fake_engine

KEY = "reload-secret-0123456789"
HELLO = [{"role": "user", "content": "hi"}]
ORIGIN = "https://app.example"
REPO = "test/reload-GGUF"
PULLED = "hf.co/test/reload-GGUF:Q4_K_M"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    root = tmp_path_factory.mktemp("reloadhub")
    h = FakeHub({REPO: {"m-Q4_K_M.gguf": make_test_model(root / "m.gguf", seed=7).path.read_bytes()}})
    yield h
    h.close()


class Reloadable:
    """
    The daemon and its config file, rewritten as the base file plus one
    change at a time.
    """

    def __init__(self, d: Daemon, engine: str, models_dir: Path) -> None:
        self.d = d
        self.head = d.config.read_text().split("\n", 2)
        self.engine = engine
        self.models_dir = models_dir

    def text(self, top: str = "", tables: str = "", binary: str | None = None) -> str:
        lines = {
            "listen": self.head[0].split(" = ", 1)[1],
            "data_dir": self.head[1].split(" = ", 1)[1],
            "models_dir": f'"{self.models_dir}"',
            "hf_endpoint": '"http://127.0.0.1:9"',
            "ready_timeout": "60",
            "stop_grace": "5",
            "breaker_crashes": "1000",
        }
        for line in top.splitlines():  # the change replaces the base line of its key
            key, value = line.split(" = ", 1)
            lines[key] = value
        return (
            "".join(f"{k} = {v}\n" for k, v in lines.items())
            + f'[engines.llamacpp]\nbinary = "{binary or self.engine}"\nargs = ["--threads", "1"]\n'
            + tables
        )

    def reload(self, top: str = "", tables: str = "", binary: str | None = None) -> list[str]:
        """
        Write the file and run `blazar reload`; its output lines.
        """
        self.d.config.write_text(self.text(top, tables, binary))
        logged = self.d.log().count("blazar reload: config reloaded")
        out = subprocess.run(
            [str(Path(sys.executable).parent / "blazar"), "reload", "-c", str(self.d.config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert self.d.log().count("blazar reload: config reloaded") == logged + 1  # the daemon logs it too
        return [line.strip() for line in out.stdout.splitlines()]

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.d.port, timeout=60)
        try:
            conn.request(method, path, body, {"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def live(
    engine: str, models: dict[str, GeneratedModel], hub: FakeHub, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Reloadable]:
    root = tmp_path_factory.mktemp("reload")
    d = Daemon(root, "")
    r = Reloadable(d, engine, models["tiny"].path.parent)
    d.config.write_text(r.text())
    d.start()
    try:
        yield r
    finally:
        d.stop()
        leftovers = d.leftovers
        d.kill_everything()
        assert leftovers == [], "llama-server outlived the daemon"


def applied(lines: list[str], *keys: str) -> None:
    assert lines == ["config reloaded", *(f"applied: {k}" for k in keys)], lines


def test_max_body_bytes(live: Reloadable) -> None:
    body = json.dumps({"model": "nope", "messages": HELLO, "pad": "x" * 3000}).encode()
    assert live.request("POST", "/v1/chat/completions", body)[0] == 404  # read, then: no such model
    applied(live.reload("max_body_bytes = 2000\n"), "max_body_bytes")
    status, _, answer = live.request("POST", "/v1/chat/completions", body)
    assert status == 413 and b"max_body_bytes = 2000" in answer, answer
    applied(live.reload(), "max_body_bytes")
    assert live.request("POST", "/v1/chat/completions", body)[0] == 404


def test_cors_origins(live: Reloadable) -> None:
    origin = {"origin": ORIGIN}
    assert "access-control-allow-origin" not in live.request("GET", "/v1/models", headers=origin)[1]
    applied(live.reload(f'cors_origins = ["{ORIGIN}"]\n'), "cors_origins")
    assert live.request("GET", "/v1/models", headers=origin)[1]["access-control-allow-origin"] == ORIGIN
    applied(live.reload(), "cors_origins")
    assert "access-control-allow-origin" not in live.request("GET", "/v1/models", headers=origin)[1]


def late_headers(live: Reloadable, wait: float) -> bytes:
    """
    Open a connection, send half a request line, and read for C{wait} s.
    """
    with socket.create_connection(("127.0.0.1", live.d.port)) as s:
        s.sendall(b"GET /health HT")
        s.settimeout(wait)
        try:
            return s.recv(4096)
        except socket.timeout:
            return b""


def test_header_timeout_secs(live: Reloadable) -> None:
    assert late_headers(live, 2.0) == b""  # 10 s by default
    applied(live.reload("header_timeout_secs = 1\n"), "header_timeout_secs")
    t0 = time.monotonic()
    answer = late_headers(live, 5.0)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3, answer
    applied(live.reload(), "header_timeout_secs")


def test_keys_and_metrics_require_key(live: Reloadable) -> None:
    keys = f'[[keys]]\nname = "late"\nsecret = "{KEY}"\n'
    bearer = {"authorization": f"Bearer {KEY}"}
    assert live.request("GET", "/v1/models")[0] == 200
    applied(live.reload("", keys), "keys")
    assert live.request("GET", "/v1/models")[0] == 401
    assert live.request("GET", "/v1/models", headers=bearer)[0] == 200
    assert live.request("GET", "/metrics")[0] == 401  # unset: an admin key, from loopback too
    assert live.request("GET", "/metrics", headers=bearer)[0] == 200
    applied(live.reload("metrics_require_key = false\n", keys), "metrics_require_key")
    assert live.request("GET", "/metrics")[0] == 200
    applied(live.reload(), "metrics_require_key", "keys")
    assert live.request("GET", "/v1/models")[0] == 200


def expires_in(live: Reloadable) -> float:
    status, _, body = live.request("GET", "/api/ps")
    assert status == 200
    (row,) = [m for m in json.loads(body)["models"] if m["name"] == "tiny:latest"]
    return datetime.fromisoformat(row["expires_at"].replace("Z", "+00:00")).timestamp() - time.time()


def test_keep_alive(live: Reloadable) -> None:
    chat = json.dumps({"model": "tiny", "messages": HELLO, "stream": False, "options": {"num_predict": 1}}).encode()
    assert live.request("POST", "/api/chat", chat)[0] == 200
    assert 240 < expires_in(live) <= 300  # the default 5m
    applied(live.reload('keep_alive = "2h"\n'), "keep_alive")
    assert live.request("POST", "/api/chat", chat)[0] == 200
    assert 7000 < expires_in(live) <= 7200
    applied(live.reload(), "keep_alive")


def test_hf_endpoint(live: Reloadable, hub: FakeHub) -> None:
    pull = json.dumps({"model": PULLED, "stream": False}).encode()
    status, _, body = live.request("POST", "/api/pull", pull)
    assert status == 502 and b"127.0.0.1:9" in body, body
    applied(live.reload(f'hf_endpoint = "{hub.url}"\n'), "hf_endpoint")
    status, _, body = live.request("POST", "/api/pull", pull)
    assert status == 200 and json.loads(body)["status"] == "success", body
    applied(live.reload(), "hf_endpoint")


def test_child_header_timeout_and_engine_binary(live: Reloadable, tmp_path: Path) -> None:
    fake = fake_engine(tmp_path, "fake_wedged_engine.py")
    applied(
        live.reload("child_header_timeout_secs = 1\n", binary=str(fake)),
        "child_header_timeout_secs",
        "engines.llamacpp.binary",
    )
    try:
        t0 = time.monotonic()
        status, _, body = live.request(
            "POST", "/v1/chat/completions", json.dumps({"model": "cold", "messages": HELLO}).encode()
        )
        assert status == 504 and b"child_header_timeout_secs = 1 s" in body, body
        assert time.monotonic() - t0 < 20
    finally:
        applied(live.reload(), "child_header_timeout_secs", "engines.llamacpp.binary")


def test_restart_keys_are_named_and_not_applied(live: Reloadable) -> None:
    other = f'listen = "tcp:{live.d.port + 1}:interface=127.0.0.1"\n'
    lines = live.reload(other + 'otlp_endpoint = "http://127.0.0.1:4318"\n')
    assert lines == [
        "config reloaded",
        "restart the daemon to apply: listen",
        "restart the daemon to apply: otlp_endpoint",
    ], lines
    assert live.request("GET", "/health")[0] == 200  # still on the old port
    lines = live.reload()
    assert lines == ["config reloaded; nothing changed"], lines
