"""
API keys end to end: 401 on all three surfaces in their own shapes, a
scoped key's 404 for a model outside its scope (tests/integration/test_scope_e2e.py
has the rest of what scoped keys may see), scoped listings, and `blazar
keys rotate` rewriting the config file.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

ADMIN = "admin-secret-0123456789"
SCOPED = "tiny-secret-0123456789"
ONE = "one-at-a-time-0123456789"
SLOW = "two-per-minute-0123456789"
FEW = "few-tokens-per-minute-0123"
DAILY = "few-tokens-per-day-012345"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed(engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("keys"),
        daemon_config(engine, models)
        + (
            "# keys for the suite: keep this comment\n"
            f'[[keys]]\nname = "admin"\nsecret = "{ADMIN}"\n'
            f'[[keys]]\nname = "tinyonly"\nsecret = "{SCOPED}"\nmodels = ["tiny"]\n'
            f'[[keys]]\nname = "one"\nsecret = "{ONE}"\nmax_concurrent = 1\n'
            f'[[keys]]\nname = "slow"\nsecret = "{SLOW}"\nrpm = 2\n'
            f'[[keys]]\nname = "few"\nsecret = "{FEW}"\ntpm = 20\n'
            f'[[keys]]\nname = "daily"\nsecret = "{DAILY}"\ndaily_tokens = 20\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    d.kill_everything()
    assert code in (0, -signal.SIGTERM)


def call(
    d: Daemon, method: str, path: str, body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    try:
        conn.request(
            method,
            path,
            json.dumps(body) if body is not None else None,
            {"content-type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


REQUESTS = [
    ("openai", "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 1}),
    ("ollama", "/api/chat", {"model": "tiny", "messages": HELLO, "stream": False, "options": {"num_predict": 1}}),
    ("anthropic", "/v1/messages", {"model": "tiny", "messages": HELLO, "max_tokens": 1}),
]


def assert_shape(surface: str, status: int, body: bytes) -> str:
    parsed = json.loads(body)
    if surface == "ollama":
        return str(parsed["error"])
    if surface == "anthropic":
        assert parsed["type"] == "error"
        assert (
            parsed["error"]["type"]
            == {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}[status]
        )
        return str(parsed["error"]["message"])
    assert set(parsed["error"]) == {"message", "type", "param", "code"}
    return str(parsed["error"]["message"])


@pytest.mark.parametrize("surface, path, body", REQUESTS)
def test_missing_and_wrong_keys_are_401(keyed: Daemon, surface: str, path: str, body: dict) -> None:
    for headers in ({}, {"authorization": "Bearer wrong-wrong-wrong-wrong"}, {"x-api-key": "nope"}):
        status, _, data = call(keyed, "POST", path, body, headers)
        assert status == 401, (headers, data)
        assert "API key" in assert_shape(surface, 401, data)
    for headers in ({"authorization": f"Bearer {ADMIN}"}, {"x-api-key": ADMIN}):
        status, _, data = call(keyed, "POST", path, body, headers)
        assert status == 200, data


def test_open_routes(keyed: Daemon) -> None:
    assert call(keyed, "GET", "/health")[0] == 200
    assert call(keyed, "GET", "/healthz")[0] == 200
    assert call(keyed, "GET", "/")[0] == 200


@pytest.mark.parametrize("surface, path, body", REQUESTS)
def test_scoped_key_is_404_on_other_models(keyed: Daemon, surface: str, path: str, body: dict) -> None:
    # a model outside the key's scope is, to it, a model that does not exist
    status, _, data = call(keyed, "POST", path, {**body, "model": "cold"}, {"x-api-key": SCOPED})
    assert status == 404, data
    assert "not found" in assert_shape(surface, 404, data)
    assert call(keyed, "POST", path, body, {"x-api-key": SCOPED})[0] == 200


def test_scoped_listings(keyed: Daemon) -> None:
    _, _, data = call(keyed, "GET", "/v1/models", headers={"x-api-key": SCOPED})
    assert [m["id"] for m in json.loads(data)["data"]] == ["tiny:latest"]
    _, _, data = call(keyed, "GET", "/api/tags", headers={"x-api-key": SCOPED})
    assert [m["name"] for m in json.loads(data)["models"]] == ["tiny:latest"]
    _, _, data = call(keyed, "GET", "/v1/models", headers={"x-api-key": ADMIN})
    assert len(json.loads(data)["data"]) >= 3
    status, _, data = call(keyed, "DELETE", "/api/delete", {"model": "tiny"}, {"x-api-key": SCOPED})
    assert status == 403


def test_keys_rotate_rewrites_config(keyed: Daemon) -> None:
    blazar = str(Path(sys.executable).parent / "blazar")
    listed = subprocess.run([blazar, "keys", "list", "-c", str(keyed.config)], capture_output=True, text=True)
    assert "tinyonly" in listed.stdout and SCOPED not in listed.stdout  # redacted
    out = subprocess.run(
        [blazar, "keys", "rotate", "tinyonly", "-c", str(keyed.config)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    new = out.stdout.strip().splitlines()[-1]
    assert new.startswith("blz-") and out.stdout.count(new) == 1
    text = keyed.config.read_text()
    assert "# keys for the suite: keep this comment" in text and new in text and SCOPED not in text
    assert list(keyed.config.parent.glob("config.toml.*.bak"))
    body = REQUESTS[0][2]
    assert call(keyed, "POST", "/v1/chat/completions", body, {"x-api-key": SCOPED})[0] == 401
    assert call(keyed, "POST", "/v1/chat/completions", body, {"x-api-key": new})[0] == 200
    assert new not in keyed.log() and ADMIN not in keyed.log()  # secrets never logged


def streaming_request(d: Daemon, secret: str) -> http.client.HTTPConnection:
    from blazar.models.testmodel import vocabulary

    no_end = {str(vocabulary()[0].index(t)): -100 for t in ("<|im_end|>", "</s>")}
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": "tiny", "messages": HELLO, "stream": True, "logit_bias": no_end}),
        {"content-type": "application/json", "x-api-key": secret},
    )
    return conn


def test_max_concurrent_lease(keyed: Daemon) -> None:
    body = REQUESTS[0][2]
    for finish in ("drain", "disconnect"):
        conn = streaming_request(keyed, ONE)
        resp = conn.getresponse()
        assert resp.status == 200
        resp.readline()
        for surface, path, b in REQUESTS:
            status, headers, data = call(keyed, "POST", path, b, {"x-api-key": ONE})
            assert status == 429, (surface, data)
            assert headers["retry-after"] == "1"
            assert "max_concurrent" in assert_shape_429(surface, data)
        if finish == "drain":
            resp.read()
            conn.close()
        else:
            conn.sock.close()
            conn.close()
        deadline = time.monotonic() + 5
        while call(keyed, "POST", "/v1/chat/completions", body, {"x-api-key": ONE})[0] != 200:
            assert time.monotonic() < deadline, f"lease not released after {finish}"
            time.sleep(0.1)


def assert_shape_429(surface: str, body: bytes) -> str:
    parsed = json.loads(body)
    if surface == "ollama":
        return str(parsed["error"])
    if surface == "anthropic":
        assert parsed["error"]["type"] == "rate_limit_error"
        return str(parsed["error"]["message"])
    assert parsed["error"]["type"] == "rate_limit_error"
    return str(parsed["error"]["message"])


def test_rpm(keyed: Daemon) -> None:
    body = REQUESTS[0][2]
    assert call(keyed, "POST", "/v1/chat/completions", body, {"x-api-key": SLOW})[0] == 200
    assert call(keyed, "POST", "/v1/chat/completions", body, {"x-api-key": SLOW})[0] == 200
    for surface, path, b in REQUESTS:
        status, headers, data = call(keyed, "POST", path, b, {"x-api-key": SLOW})
        assert status == 429 and 1 <= int(headers["retry-after"]) <= 60, (surface, data)
        assert "rpm" in assert_shape_429(surface, data)


def test_failed_key_write_is_reported_and_changes_nothing(keyed: Daemon) -> None:
    blazar = str(Path(sys.executable).parent / "blazar")
    before = keyed.config.read_bytes()
    blocker = keyed.config.with_name(f".{keyed.config.name}.tmp")
    blocker.mkdir()  # the atomic write's temporary file cannot be created
    try:
        out = subprocess.run(
            [blazar, "keys", "rotate", "admin", "-c", str(keyed.config)], capture_output=True, text=True
        )
    finally:
        blocker.rmdir()
    assert out.returncode == 1 and "Is a directory" in out.stderr, out
    assert keyed.config.read_bytes() == before
    assert call(keyed, "GET", "/v1/models", headers={"x-api-key": ADMIN})[0] == 200  # old secret still works


def test_tpm_counts_the_childs_usage(keyed: Daemon) -> None:
    # the prompt alone is ~21 tokens: one request goes over tpm 20, whatever the answer
    status, _, _ = call(
        keyed,
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": HELLO, "max_tokens": 16, "stream": True},
        {"x-api-key": FEW},
    )
    assert status == 200
    status, headers, data = call(
        keyed, "POST", "/api/chat", {"model": "tiny", "messages": HELLO, "stream": False}, {"x-api-key": FEW}
    )
    assert status == 429 and "tpm" in json.loads(data)["error"]
    assert 1 <= int(headers["retry-after"]) <= 60


def test_daily_tokens_survive_a_restart(keyed: Daemon) -> None:
    status, _, data = call(
        keyed, "POST", "/v1/messages", {"model": "tiny", "max_tokens": 16, "messages": HELLO}, {"x-api-key": DAILY}
    )
    assert status == 200, data
    status, _, data = call(
        keyed, "POST", "/v1/messages", {"model": "tiny", "max_tokens": 16, "messages": HELLO}, {"x-api-key": DAILY}
    )
    assert status == 429 and json.loads(data)["error"]["type"] == "rate_limit_error"
    keyed.stop()
    keyed.start()
    status, headers, data = call(keyed, "POST", "/v1/chat/completions", REQUESTS[0][2], {"x-api-key": DAILY})
    assert status == 429 and "daily_tokens" in json.loads(data)["error"]["message"]
    assert int(headers["retry-after"]) <= 86400


def test_big_body_is_413_without_holding_it(keyed: Daemon) -> None:
    import psutil

    assert keyed.proc is not None
    daemon = psutil.Process(keyed.proc.pid)
    before = daemon.memory_info().rss
    big = b'{"model":"tiny","messages":[{"role":"user","content":"' + b"x" * (51 * 1024 * 1024) + b'"}]}'
    import httpx

    for path, surface in (("/v1/chat/completions", "openai"), ("/api/chat", "ollama"), ("/v1/messages", "anthropic")):
        # answered at the headers, the connection closed with the body unread
        # (httpx reads that answer; bare http.client fails writing the body)
        resp = httpx.post(
            f"http://127.0.0.1:{keyed.port}{path}",
            content=big,
            timeout=120,
            headers={"content-type": "application/json", "x-api-key": ADMIN},
        )
        data = resp.content
        assert resp.status_code == 413, (path, data[:200])
        parsed = json.loads(data)
        assert ("error" in parsed) and (surface != "anthropic" or parsed["error"]["type"] == "request_too_large")
    grown = daemon.memory_info().rss - before
    assert grown < 20 * 1024 * 1024, f"the daemon grew by {grown / 2**20:.0f} MiB"


def test_blazar_run_sends_a_key(keyed: Daemon) -> None:
    """
    `blazar run` is a client of the HTTP API: on a gateway with keys it
    sends --key, or $BLAZAR_API_KEY, and without one it says what is missing.
    """
    import os

    blazar = str(Path(sys.executable).parent / "blazar")
    argv = [blazar, "run", "tiny", "hi", "-c", str(keyed.config)]
    env = {k: v for k, v in os.environ.items() if k != "BLAZAR_API_KEY"}
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 1 and "missing API key" in refused.stderr, refused.stderr
    # (a key no other test of the module rotates)
    with_flag = subprocess.run([*argv, "--key", ONE], capture_output=True, text=True, timeout=120, env=env)
    assert with_flag.returncode == 0, with_flag.stderr
    from_env = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**env, "BLAZAR_API_KEY": ONE})
    assert from_env.returncode == 0, from_env.stderr
