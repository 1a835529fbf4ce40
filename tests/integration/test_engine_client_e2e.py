"""
The real L{blazar.engines.client.EngineClient} against a real llama-server
serving SmolLM2-135M-Instruct keeps the IEngineClient contract
(tests/engines/engine_client_contract.py) that the fake the unit tests
use keeps (tests/engines/test_engine_client_contract.py). A missing engine
or model is a failure, never a skip.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.integration.harness import free_port, real_model

CONTRACT = """
import sys
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import react
from blazar.engines.client import EngineClient
from blazar.httpbody import read_body
from tests.engines.engine_client_contract import check_engine_client

port, key = int(sys.argv[1]), sys.argv[2]

async def main(reactor):
    async def read(response):
        return await read_body(response, reactor, idle_timeout=30, max_bytes=1 << 20)

    await check_engine_client(EngineClient(reactor), f"http://127.0.0.1:{port}",
                              {b"authorization": [b"Bearer " + key.encode()]}, read)
    print("contract kept")

react(lambda reactor: ensureDeferred(main(reactor)))
"""

REUSE = """
import json, sys
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import deferLater, react
from blazar.engines.client import EngineClient
from blazar.httpbody import read_body

port, key = int(sys.argv[1]), sys.argv[2]
url = f"http://127.0.0.1:{port}/v1/chat/completions"
headers = {b"authorization": [b"Bearer " + key.encode()], b"content-type": [b"application/json"]}

async def main(reactor):
    client = EngineClient(reactor)
    opened = []
    connect = client._wire.connect
    client._wire.connect = lambda key: opened.append(key) or connect(key)
    requests = 0
    for pause in (0.0, 0.3, 2.5, 6.0, 0.0):  # past the pool's 2 s, past the child's 5 s keep-alive
        await deferLater(reactor, pause, lambda: None)
        for stream in (False, True, True, False, False, True):
            body = json.dumps({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2,
                               "stream": stream}).encode()
            response = await client.request("POST", url, body, headers, stream=stream)
            data = await read_body(response, reactor, idle_timeout=30, max_bytes=1 << 20)
            assert response.code == 200, (response.code, data)
            assert (b"[DONE]" in data) == stream, data
            requests += 1
    await client.close()
    print(f"{requests} requests, {len(opened)} connections opened")

react(lambda reactor: ensureDeferred(main(reactor)))
"""


def healthy(port: int) -> bool:
    """
    Whether the child's C{/health} answers 200 (503 while it loads).
    """
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:  # refused, or an HTTPError (503)
        return False


@pytest.fixture(scope="module")
def llama_server(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """
    A llama-server child serving SmolLM2 with a key: its port and the key;
    its output in a file (a pipe nobody reads would stall it); stopped with
    TERM, then KILL.
    """
    port, key = free_port(), secrets.token_urlsafe(16)
    output = tmp_path_factory.mktemp("llama-server") / "output.log"
    log = output.open("wb")
    child = subprocess.Popen(
        [
            engine,
            "-m",
            str(real_model()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key",
            key,
            "-c",
            "2048",
            "-np",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not healthy(port):
            assert child.poll() is None, output.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "llama-server did not answer /health 200 within 120 s"
            time.sleep(0.2)
        yield port, key
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.close()


def test_the_real_engine_client_keeps_the_contract(llama_server: tuple[int, str]) -> None:
    port, key = llama_server
    result = subprocess.run(
        [sys.executable, "-c", CONTRACT, str(port), key],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0 and "contract kept" in result.stdout, result.stdout + result.stderr


def test_kept_connections_and_spares_never_surface_as_errors(llama_server: tuple[int, str]) -> None:
    """
    Plain requests and streams, back to back and after idle pauses past
    the pool's bound and the child's keep-alive: every one answered
    (a connection the child closed is never an error), and connections
    are reused (fewer opened than requests: kept ones for plain
    requests, while the child closes each stream's).
    """
    port, key = llama_server
    result = subprocess.run(
        [sys.executable, "-c", REUSE, str(port), key],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stdout + result.stderr
    requests, opened = (int(word) for word in result.stdout.split() if word.isdigit())
    assert requests == 30 and opened < requests, result.stdout
