"""
The door end to end, on a real daemon with keys and header_timeout_secs = 2:
what is decided from a request's headers before its body is read (a missing
key is a 401 with the body unsent and nothing spooled; credentials sent
twice are a 400), the header and body deadlines (408), oversized headers
(431), and reason phrases on the wire (429 Too Many Requests). The units are
in tests/web/test_site.py; each test here counts in the reliability tally
as an injected fault (a hostile or broken client).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon
from tests.integration.reliability import TALLY

ADMIN = "door-admin-secret-0123456789"
ONE_RPM = "door-one-a-minute-0123456789"
MiB = 1024 * 1024
HEADER_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def door(engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("door")
    d = Daemon(
        root,
        f"header_timeout_secs = {HEADER_TIMEOUT}\n"
        + daemon_config(engine, models)
        + (f'[[keys]]\nname = "admin"\nsecret = "{ADMIN}"\n[[keys]]\nname = "slow"\nsecret = "{ONE_RPM}"\nrpm = 1\n'),
    )
    # the daemon's temporary files go here, so a test can see whether a body was spooled
    d.tmp = root / "tmp"
    d.tmp.mkdir()
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(d.tmp)
    try:
        d.start()
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
    TALLY.ran = True
    yield d
    code = d.stop()
    d.kill_everything()
    assert code in (0, -signal.SIGTERM), d.log()[-3000:]


def temp_files(d: Daemon) -> list[str]:
    """
    The daemon's open files in its temporary directory (spooled bodies are
    unlinked at once, so they show only here, as "(deleted)").
    """
    assert d.proc is not None
    found = []
    for fd in Path(f"/proc/{d.proc.pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(d.tmp)):
            found.append(target)
    return found


def read_until_closed(s: socket.socket, within: float) -> tuple[bytes, bool]:
    """
    What the server sends until it closes the connection or C{within}
    seconds pass; and whether it closed.
    """
    data = b""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            return data, True
        data += chunk
    return data, False


def parse(raw: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    top, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = top.split(b"\r\n")
    return status, {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}, body


def post_head(path: bytes, length: int, *extra: bytes) -> bytes:
    return b"\r\n".join(
        [
            b"POST " + path + b" HTTP/1.1",
            b"Host: 127.0.0.1",
            b"Content-Type: application/json",
            b"Content-Length: %d" % length,
            *extra,
            b"",
            b"",
        ]
    )


def test_unauthenticated_45_mib_body_is_401_at_once_with_nothing_spooled(door: Daemon) -> None:
    TALLY.faults += 1
    with socket.create_connection(("127.0.0.1", door.port), timeout=5) as s:
        started = time.monotonic()
        s.sendall(
            post_head(b"/v1/chat/completions", 45 * MiB)
            + b'{"model":"tiny","messages":[{"role":"user","content":"'
            + b"x" * 4000
        )
        data, closed = read_until_closed(s, within=1.0)
        elapsed = time.monotonic() - started
    status, headers, body = parse(data)
    assert status == b"HTTP/1.1 401 Unauthorized", data[:300]
    assert closed and elapsed < 1.0, (closed, elapsed)
    assert headers[b"connection"] == b"close"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert temp_files(door) == []
    assert list(door.tmp.iterdir()) == []


def test_a_keyed_big_body_is_spooled_so_the_check_above_can_see_one(door: Daemon) -> None:
    # the control for the test above: with a key, a body past 1 MiB goes to a temporary file
    with socket.create_connection(("127.0.0.1", door.port), timeout=5) as s:
        s.sendall(post_head(b"/v1/chat/completions", 5 * MiB, b"x-api-key: " + ADMIN.encode()))
        s.sendall(b"x" * (2 * MiB))
        deadline = time.monotonic() + 5
        while not (spooled := temp_files(door)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spooled, "a keyed 2 MiB body was not spooled: the no-temp-file check proves nothing"
    deadline = time.monotonic() + 5
    while temp_files(door) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert temp_files(door) == []  # closed with its connection


def test_slow_headers_are_408_within_the_deadline(door: Daemon) -> None:
    TALLY.faults += 1
    with socket.create_connection(("127.0.0.1", door.port), timeout=5) as s:
        started = time.monotonic()
        s.sendall(b"POST /api/chat HTTP/1.1\r\n")
        data, closed = b"", False
        for byte in b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n":
            try:
                s.sendall(bytes([byte]))  # one byte a second
            except OSError:
                break
            data, closed = read_until_closed(s, within=1.0)
            if data:
                if not closed:
                    more, closed = read_until_closed(s, within=1.0)
                    data += more
                break
        elapsed = time.monotonic() - started
    status, headers, body = parse(data)
    assert status == b"HTTP/1.1 408 Request Timeout", data[:300]
    assert HEADER_TIMEOUT <= elapsed < HEADER_TIMEOUT + 1.5, elapsed
    assert closed
    assert "header_timeout_secs = 2" in json.loads(body)["error"]  # Ollama's shape


def test_a_stalled_body_is_408(door: Daemon) -> None:
    TALLY.faults += 1
    with socket.create_connection(("127.0.0.1", door.port), timeout=5) as s:
        s.sendall(post_head(b"/v1/messages", 100_000, b"x-api-key: " + ADMIN.encode()) + b'{"model":')
        started = time.monotonic()
        data, closed = read_until_closed(s, within=HEADER_TIMEOUT + 2)
        elapsed = time.monotonic() - started
    status, _, body = parse(data)
    assert status == b"HTTP/1.1 408 Request Timeout", data[:300]
    assert closed and HEADER_TIMEOUT <= elapsed < HEADER_TIMEOUT + 1.5, (closed, elapsed)
    assert json.loads(body)["type"] == "error"  # Anthropic's shape


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages"])
@pytest.mark.parametrize(
    "header, values",
    [
        ("authorization", (f"Bearer {ADMIN}", "Bearer someone-else-0123456789")),
        ("x-api-key", (ADMIN, ADMIN)),
    ],
)
def test_credentials_sent_twice_are_400(door: Daemon, path: str, header: str, values: tuple[str, str]) -> None:
    TALLY.faults += 1
    conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=30)
    try:
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        conn.putrequest("POST", path)
        conn.putheader("content-type", "application/json")
        for value in values:
            conn.putheader(header, value)
        conn.putheader("content-length", str(len(body)))
        conn.endheaders(body.encode())
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
    finally:
        conn.close()
    assert status == 400, data
    parsed = json.loads(data)
    message = parsed["error"] if path == "/api/chat" else parsed["error"]["message"]
    assert f"the {header} header was sent 2 times" in message


def test_a_64_kib_header_is_431(door: Daemon) -> None:
    TALLY.faults += 1
    with socket.create_connection(("127.0.0.1", door.port), timeout=5) as s:
        s.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: "
            + ADMIN.encode()
            + b"\r\nx-junk: "
            + b"v" * (64 * 1024)
            + b"\r\n\r\n"
        )
        data, closed = read_until_closed(s, within=5)
    status, headers, body = parse(data)
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large", data[:300]
    assert closed and headers[b"connection"] == b"close"
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


def test_429_has_its_reason_phrase(door: Daemon) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answers = []
    for _ in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=120)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(body),
                {"content-type": "application/json", "x-api-key": ONE_RPM},
            )
            resp = conn.getresponse()
            answers.append((resp.status, resp.reason, resp.read()))
        finally:
            conn.close()
    assert answers[0][0] == 200, answers[0]
    assert answers[1][:2] == (429, "Too Many Requests"), answers[1]


def test_metrics_need_an_admin_key_from_loopback_too(door: Daemon) -> None:
    # metrics_require_key is unset: an admin key is needed, from this machine too (issue 36)
    status, _, data = door.request("GET", "/metrics")
    assert status == 401, (status, data)
    status, _, data = door.request("GET", "/metrics", headers={"authorization": f"Bearer {ADMIN}"})
    assert status == 200 and b"blazar_requests_total" in data
