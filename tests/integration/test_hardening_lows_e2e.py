"""
Hardening, the low findings (issue 36), on one real daemon in the
reliability suite (its closing line counts the inputs tried here): a
remote whose ids are no Ollama names, scoped to a key as docs/remotes.md
writes it, answering a stream request with one JSON answer; terminal
escapes from clients in the log; a key added under a removed key's name;
/metrics with keys on; a config file others may read; TLS 1.2's suites;
a hub that sends more (or less) than it lists.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.fakehub import FakeHub
from tests.integration.harness import Daemon, free_port
from tests.integration.reliability import TALLY, tallied
from tests.integration.test_tls_e2e import self_signed

ADMIN = "lows-admin-secret-0123456789"
SCOPED = "lows-scoped-secret-0123456789"
REPO = "lows/tiny-GGUF"
FILE = b"GGUF" + bytes(range(256)) * 64  # the hub's file (16 KiB)


class JSONRemote(http.server.ThreadingHTTPServer):
    """
    An OpenAI-compatible remote that lists C{a"b} and C{qwen3:8b} and
    answers every chat request, streamed or not, with one JSON answer
    (C{application/json}).
    """

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def send(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.send({"object": "list", "data": [{"id": 'a"b'}, {"id": "qwen3:8b"}]})

            def do_POST(self) -> None:
                asked = json.loads(self.rfile.read(int(self.headers["content-length"])))
                self.send(
                    {
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "created": 1,
                        "model": asked["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "from the remote"},
                            }
                        ],
                        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
                    }
                )

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def remote() -> Iterator[JSONRemote]:
    server = JSONRemote()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    h = FakeHub({REPO: {"tiny-Q4_K_M.gguf": FILE}})
    yield h
    h.close()


@pytest.fixture(scope="module")
def tls_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def daemon(
    engine: str, remote: JSONRemote, hub: FakeHub, tls_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("lows")
    make_test_model(root / "models" / "tiny.gguf")
    cert, key = self_signed(root)
    d = Daemon(
        root,
        (
            f'models_dir = "{root / "models"}"\nhf_endpoint = "{hub.url}"\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
            f'[[remotes]]\nname = "peer"\nbase_url = "{remote.url}"\nmodels = "*"\n'
            f'[[keys]]\nname = "admin"\nsecret = "{ADMIN}"\n'
            # docs/remotes.md's example: a remote's model whose id has its own ':'
            f'[[keys]]\nname = "webui"\nsecret = "{SCOPED}"\nmodels = ["peer:qwen3:8b"]\n'
        ),
    )
    d.config.write_text(
        d.config.read_text().replace(
            f'listen = "tcp:{d.port}:interface=127.0.0.1"',
            f'listen = ["tcp:{d.port}:interface=127.0.0.1", '
            f'"ssl:{tls_port}:interface=127.0.0.1:privateKey={key}:certKey={cert}"]',
        )
    )
    d.config.chmod(0o644)  # secrets others may read: named at startup, never changed
    with tallied(d) as started:
        yield started


def bearer(secret: str = ADMIN) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def listed(d: Daemon, name: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, body = d.request("GET", "/v1/models", headers=bearer())
        if status == 200 and name in [m["id"] for m in json.loads(body)["data"]]:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} never listed")


def test_a_config_others_may_read_is_named_at_startup(daemon: Daemon) -> None:
    TALLY.inputs += 1
    assert (
        f"config file {daemon.config} holds secrets ([[keys]] secret) and everyone may read it (mode 644): "
        f"run `chmod 600 {daemon.config}`" in daemon.log()
    ), daemon.log()[-3000:]
    assert daemon.config.stat().st_mode & 0o777 == 0o644  # (until `blazar keys` writes it: 0600, below)


def test_a_remote_id_that_is_no_name_does_not_break_copy(daemon: Daemon) -> None:
    listed(daemon, 'peer:a"b')
    TALLY.inputs += 2
    status, _, body = daemon.request(
        "POST", "/api/copy", {"source": "tiny", "destination": "tiny-copy"}, headers=bearer()
    )
    assert status == 200, body
    status, _, body = daemon.request("POST", "/api/copy", {"source": 'peer:a"b', "destination": "x"}, headers=bearer())
    assert status == 400 and b"remote" in body, (status, body)


@pytest.mark.parametrize(
    "path,body,marker",
    [
        ("/v1/chat/completions", {"stream": True}, b"data: [DONE]"),
        ("/api/chat", {}, b'"done":true'),
        ("/v1/messages", {"stream": True, "max_tokens": 8}, b"message_stop"),
    ],
)
def test_a_scoped_remote_model_streams_a_json_answer(
    daemon: Daemon, path: str, body: dict[str, Any], marker: bytes
) -> None:
    listed(daemon, "peer:qwen3:8b")
    TALLY.inputs += 1
    asked = {"model": "peer:qwen3:8b", "messages": [{"role": "user", "content": "hi"}], **body}
    status, headers, data = daemon.request("POST", path, asked, headers=bearer(SCOPED))
    assert status == 200, data
    assert b"from the remote" in data and marker in data, data
    # the key's scope is still its scope
    status, _, data = daemon.request("POST", path, {**asked, "model": 'peer:a"b'}, headers=bearer(SCOPED))
    assert status == 404, data


def test_terminal_escapes_from_clients_are_text_in_the_log(daemon: Daemon) -> None:
    TALLY.inputs += 1
    agent = "evil\x1b]0;owned\x07\x1b[2J\x9b"
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        body = json.dumps(
            {"model": "peer:qwen3:8b", "service_tier": "auto", "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        for name, value in (
            ("user-agent", agent.encode("latin-1")),
            ("authorization", f"Bearer {ADMIN}".encode()),
            ("content-type", b"application/json"),
            ("content-length", str(len(body)).encode()),
        ):
            conn.putheader(name, value)
        conn.endheaders(body)
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    deadline = time.monotonic() + 10
    while "evil\\x1b]0;owned\\x07\\x1b[2J" not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()[-3000:]
        time.sleep(0.1)
    raw = daemon.log_path.read_bytes()
    assert b"\x1b" not in raw and b"\x07" not in raw and "\x9b".encode() not in raw


def blazar(d: Daemon, *args: str) -> str:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "blazar"), *args, "--config", str(d.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def upload(d: Daemon, secret: str) -> int:
    boundary = uuid.uuid4().hex
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n{}\n\r\n"
        f"--{boundary}--\r\n"
    ).encode()
    status, _, data = d.request(
        "POST",
        "/v1/files",
        raw=body,
        headers={**bearer(secret), "content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert status == 200, data
    return status


def files_of(d: Daemon, secret: str) -> list[str]:
    status, _, data = d.request("GET", "/v1/files", headers=bearer(secret))
    assert status == 200, data
    return [f["id"] for f in json.loads(data)["data"]]


def test_a_key_added_under_a_removed_keys_name_inherits_nothing(daemon: Daemon) -> None:
    TALLY.inputs += 1
    first = blazar(daemon, "keys", "add", "alice").strip().splitlines()[-1]
    upload(daemon, first)
    assert len(files_of(daemon, first)) == 1
    assert daemon.config.stat().st_mode & 0o777 == 0o600  # Blazar wrote it: 0600, whatever it was
    blazar(daemon, "keys", "rm", "alice")
    again = blazar(daemon, "keys", "add", "alice").strip().splitlines()[-1]
    assert files_of(daemon, again) == []


def test_metrics_need_an_admin_key_with_keys_on(daemon: Daemon) -> None:
    TALLY.inputs += 3
    assert daemon.request("GET", "/metrics")[0] == 401  # from loopback too
    status, _, data = daemon.request("GET", "/metrics", headers=bearer(SCOPED))
    assert status == 403 and b"metrics_require_key = false" in data, data
    status, _, data = daemon.request("GET", "/metrics", headers=bearer())
    assert status == 200 and b"blazar_requests_total" in data


def handshake(port: int, ciphers: str | None) -> str:
    """
    A TLS 1.2 handshake offering only C{ciphers} (all of OpenSSL's
    defaults with L{None}, and TLS 1.3 then too): the suite agreed.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    if ciphers is not None:
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        context.set_ciphers(ciphers)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            suite = tls.cipher()
            assert suite is not None
            return str(suite[0])


def test_tls12_accepts_only_forward_secret_aead_suites(daemon: Daemon, tls_port: int) -> None:
    for weak in ("AES128-SHA", "ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA384"):
        TALLY.inputs += 1
        with pytest.raises(ssl.SSLError):
            handshake(tls_port, weak)
    assert handshake(tls_port, "ECDHE-ECDSA-AES128-GCM-SHA256") == "ECDHE-ECDSA-AES128-GCM-SHA256"
    assert handshake(tls_port, None).startswith("TLS_")  # a default client: TLS 1.3
    TALLY.inputs += 2


def pull(d: Daemon) -> tuple[int, bytes]:
    status, _, data = d.request(
        "POST", "/api/pull", {"model": f"hf.co/{REPO}:Q4_K_M", "stream": False}, headers=bearer()
    )
    return status, data


def test_a_hub_sending_more_or_less_than_it_lists(daemon: Daemon, hub: FakeHub) -> None:
    partial = daemon.root / "models" / ".partial"
    TALLY.inputs += 2
    hub.extra = os.urandom(1 << 20)
    try:
        status, data = pull(daemon)
    finally:
        hub.extra = b""
    assert status == 502 and b"than the 16388 bytes its listing gives" in data, (status, data)
    assert not partial.exists() or not any(partial.iterdir())
    hub.cut = 100
    try:
        status, data = pull(daemon)
    finally:
        hub.cut = None
    assert status == 502 and b"ended after 100 of the 16388 bytes" in data, (status, data)
    status, data = pull(daemon)  # resumed from byte 100
    assert status == 200, data
    assert hub.ranges[-1] == "bytes=100-"
    pulled = daemon.root / "models" / "hf.co" / REPO / "Q4_K_M.gguf"
    assert hashlib.sha256(pulled.read_bytes()).hexdigest() == hashlib.sha256(FILE).hexdigest()
