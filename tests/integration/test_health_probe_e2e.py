"""
The cancelled health probe (issue 18), on a real daemon and a real child.

A long non-streamed request runs on a child that, busy with it, does not
answer C{/health}. After C{child_header_timeout_secs} the gateway asks the
child's C{/health}; the client leaves while that probe waits. The client's
cancellation says nothing about the child: it must not be taken for
"unhealthy" (which got the busy child SIGKILLed as wedged), so the same
child, same pid, serves the next request.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

import psutil

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon, alive, fake_engine


def chat(content: str) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}]}


def test_client_leaving_during_a_health_probe_does_not_kill_the_busy_child(tmp_path: Path) -> None:
    pids = tmp_path / "engine.pids"
    fake = fake_engine(tmp_path, "fake_busy_engine.py", pids)
    make_test_model(tmp_path / "models" / "tiny.gguf")
    d = Daemon(
        tmp_path / "d",
        (
            f'models_dir = "{tmp_path / "models"}"\nchild_header_timeout_secs = 1\n'
            f'[engines.llamacpp]\nbinary = "{fake}"\n'
        ),
    )
    d.start()
    try:
        status, body = d.post_json("/v1/chat/completions", chat("hi"))
        assert status == 200, body
        (pid,) = [int(line) for line in pids.read_text().split()]
        child = psutil.Process(pid)

        # The held request: headers do not come, so at 1 s the gateway
        # probes /health, which the busy child does not answer (the probe
        # gives up after 3 s). The client leaves at 2 s, mid-probe.
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=2)
        conn.request("POST", "/v1/chat/completions", json.dumps(chat("hold")), {"content-type": "application/json"})
        try:
            conn.getresponse()
            raise AssertionError("the held request was answered")
        except socket.timeout:
            pass
        finally:
            conn.close()
        time.sleep(3.5)  # past the probe's own timeout

        assert alive(child), f"the busy child was killed:\n{d.log()[-3000:]}"
        assert "wedged" not in d.log(), d.log()[-3000:]
        assert d.request("GET", "/health", timeout=5)[0] == 200
        status, body = d.post_json("/v1/chat/completions", chat("hi again"), timeout=10)
        assert status == 200, body
        assert [int(line) for line in pids.read_text().split()] == [pid]  # the same child served it
        assert alive(child)
    finally:
        d.stop()
        d.kill_everything()
        for line in pids.read_text().split() if pids.exists() else ():
            try:
                psutil.Process(int(line)).kill()
            except psutil.NoSuchProcess:
                pass
