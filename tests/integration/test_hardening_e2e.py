"""
Hardening, round two (issue 36), on a real llama-server child, in the
reliability suite (its closing line counts the inputs tried here).

H1: a forced tool call whose schema is a 30-entry type list nested 4 deep
(1.5 KB) made the daemon walk it 30^4 times on the reactor: /health
stalled for 44.5 s. The grammar is now made in a thread, each subschema
walked once, under a node budget and a deadline.
"""

from __future__ import annotations

import http.client
import threading
import time
from typing import Any, Iterator

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon
from tests.integration.reliability import TALLY, tallied


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("hardening")
    make_test_model(root / "models" / "tiny.gguf")
    with tallied(Daemon(root, (
        f'models_dir = "{root / "models"}"\n[models."tiny"]\nparallel = 2\n'
        f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
    ))) as d:
        yield d


def nested(kinds: list[str], depth: int) -> dict[str, Any]:
    """
    The attack's shape: a type list at every level, one property holding
    the next (4 deep with 30 entries: 1.5 KB).
    """
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": kinds, "properties": {"a": schema}}
    return schema


def health_times(daemon: Daemon, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        began = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
        try:
            conn.request("GET", "/health")
            assert conn.getresponse().read()
        finally:
            conn.close()
        out.append(time.monotonic() - began)
        time.sleep(0.02)


def test_a_forced_calls_schema_cannot_stall_the_daemon(daemon: Daemon) -> None:
    status, _ = daemon.post_json("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "warm"}], "max_tokens": 1})
    assert status == 200
    attacks = {
        "type list nested": nested(["object"] * 30, 4),
        "every type nested": nested(["object", "array", "string", "integer", "number", "boolean", "null"], 12),
    }
    for name, schema in attacks.items():
        TALLY.inputs += 1
        stop, times = threading.Event(), []
        watcher = threading.Thread(target=health_times, args=(daemon, stop, times))
        watcher.start()
        began = time.monotonic()
        try:
            status, _, data = daemon.request("POST", "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 64, "seed": 1,
                "tools": [{"type": "function", "function": {"name": "emit", "parameters": schema}}],
                "tool_choice": {"type": "function", "function": {"name": "emit"}}}, timeout=60)
        finally:
            stop.set()
            watcher.join()
        took = time.monotonic() - began
        assert status == 200, (name, status, data[:300])
        assert took < 10, (name, took)
        assert times and max(times) < 0.1, (name, max(times), len(times))
        print(f"{name}: {status} in {took:.2f} s; /health at most {max(times) * 1000:.0f} ms over {len(times)}")
