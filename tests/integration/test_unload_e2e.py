"""
Ollama's unload (empty prompt, keep_alive 0) while another client's stream
runs on the child: the lease contract (blazar/engines/lease.py) says a
keep_alive of 0 from another request waits for the running one.
"""

from __future__ import annotations

import http.client
import json
import signal
from typing import Iterator

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("unload")
    models = root / "models"
    make_test_model(models / "tiny.gguf")
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\n'
            '[models."tiny"]\nparallel = 1\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    d.kill_everything()
    assert code in (0, -signal.SIGTERM)


def test_unload_does_not_cut_a_running_stream(daemon: Daemon) -> None:
    # the model is loaded (a warm stream: its first line is a data event)
    assert daemon.request("POST", "/api/generate", {"model": "tiny"})[0] == 200
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(
            {
                "model": "tiny",
                "stream": True,
                "max_tokens": 1500,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "count"}],
            }
        ),
        {"content-type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = resp.readline()
    assert first.startswith(b"data: "), first
    # another client unloads the model while the stream is running
    status, _, body = daemon.request("POST", "/api/generate", {"model": "tiny", "keep_alive": 0})
    assert status == 200, body
    rest = resp.read().decode()
    conn.close()
    events = [line[6:] for line in rest.split("\n") if line.startswith("data: ")]
    print("unload answered:", body.decode())
    print("last events of the running stream:", events[-2:])
    assert events and events[-1] == "[DONE]", f"the running stream was cut: {events[-2:]}"
    # ... and the unload happens once it has ended
    import time

    deadline = time.monotonic() + 10
    while daemon.request("GET", "/api/ps")[2] != b'{"models":[]}':
        assert time.monotonic() < deadline, daemon.request("GET", "/api/ps")
        time.sleep(0.1)
    assert "unloading once its 1 running request(s) end (keep_alive 0)" in daemon.log()
