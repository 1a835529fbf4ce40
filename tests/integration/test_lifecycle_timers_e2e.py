"""
Idle eviction and the crash breaker with real llama-server children.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon, alive, fake_engine

HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def lifecycle(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("lifecycle")
    models = root / "models"
    make_test_model(models / "tiny.gguf")
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\nidle_timeout_secs = 2\n'
            "breaker_crashes = 3\nbreaker_window_secs = 60\nbreaker_backoff_secs = 3\n"
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
            # a model whose engine exits at start: a flag llama-server rejects
            '[models."broken"]\npath = "tiny.gguf"\nargs = ["--no-such-flag"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    d.kill_everything()
    assert code in (0, -signal.SIGTERM)


def chat(d: Daemon, **extra: object) -> tuple[int, dict]:
    return d.post_json("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 2, **extra})


def test_keep_alive_seconds_then_gone(lifecycle: Daemon) -> None:
    status, _ = chat(lifecycle, keep_alive="3s")
    assert status == 200
    child = lifecycle.engine_for("tiny:latest")
    time.sleep(2.0)
    assert alive(child), "evicted before its keep_alive ran out"
    child.wait(5)
    assert not alive(child)


def test_idle_timeout_applies_without_keep_alive(lifecycle: Daemon) -> None:
    assert chat(lifecycle)[0] == 200
    child = lifecycle.engine_for("tiny:latest")
    child.wait(6)  # idle_timeout_secs = 2, reaped within a second after
    assert not alive(child)


def test_negative_keep_alive_survives_idle_timeout(lifecycle: Daemon) -> None:
    status, _, _ = lifecycle.request("POST", "/api/generate", {"model": "tiny", "keep_alive": -1})
    assert status == 200
    child = lifecycle.engine_for("tiny:latest")
    time.sleep(4)
    assert alive(child)
    status, _, body = lifecycle.request("GET", "/api/ps")
    assert b"9999-12-31" in body
    # and an explicit unload still works
    assert lifecycle.request("POST", "/api/generate", {"model": "tiny", "keep_alive": 0})[0] == 200
    child.wait(10)


def test_api_ps_expires_at_counts_down(lifecycle: Daemon) -> None:
    import json
    from datetime import datetime, timezone

    assert chat(lifecycle, keep_alive="1m")[0] == 200
    _, _, body = lifecycle.request("GET", "/api/ps")
    (model,) = [m for m in json.loads(body)["models"] if m["name"] == "tiny:latest"]
    expires = datetime.fromisoformat(model["expires_at"].replace("Z", "+00:00")[:26] + "+00:00")
    left = (expires - datetime.now(timezone.utc)).total_seconds()
    assert 50 < left <= 61, left
    chat(lifecycle, keep_alive=0)


def test_crash_breaker(lifecycle: Daemon) -> None:
    for _ in range(3):
        status, body = lifecycle.post_json(
            "/v1/chat/completions", {"model": "broken", "messages": HELLO, "max_tokens": 1}
        )
        assert status == 502, body
    t0 = time.monotonic()
    status, body = lifecycle.post_json("/v1/chat/completions", {"model": "broken", "messages": HELLO})
    assert time.monotonic() - t0 < 0.1
    assert status == 503 and body["error"]["code"] == "engine_unavailable"
    assert "exit code" in body["error"]["message"]
    assert "no-such-flag" in body["error"]["message"]  # the stderr tail
    starts = lifecycle.log().count("starting broken:latest")
    time.sleep(3.2)
    status, body = lifecycle.post_json("/v1/chat/completions", {"model": "broken", "messages": HELLO})
    assert status == 502  # the one trial start, which fails again
    assert lifecycle.log().count("starting broken:latest") == starts + 1
    status, body = lifecycle.post_json("/v1/chat/completions", {"model": "broken", "messages": HELLO})
    assert status == 503
    # other models are unaffected
    assert chat(lifecycle)[0] == 200


def test_cold_streaming_request_gets_headers_at_once(engine: str, tmp_path: Path) -> None:
    import http.client
    import json
    import stat

    # A wrapper that makes the engine take 5 s to start listening.
    slow = tmp_path / "slow-llama-server"
    slow.write_text(f'#!/bin/sh\nsleep 5\nexec {engine} "$@"\n')
    slow.chmod(slow.stat().st_mode | stat.S_IEXEC)
    make_test_model(tmp_path / "models" / "tiny.gguf")
    d = Daemon(
        tmp_path / "d",
        (f'models_dir = "{tmp_path / "models"}"\n[engines.llamacpp]\nbinary = "{slow}"\nargs = ["--threads", "1"]\n'),
    )
    d.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        t0 = time.monotonic()
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 3, "stream": True}),
            {"content-type": "application/json"},
        )
        resp = conn.getresponse()
        assert time.monotonic() - t0 < 1.0
        assert resp.status == 200 and resp.getheader("content-type") == "text/event-stream"
        body = resp.read().decode()
        assert time.monotonic() - t0 > 4.5  # it did wait for the load
        assert body.startswith(": loading\n\n") and body.count(": loading") >= 2
        assert body.rstrip().endswith("data: [DONE]")
        conn.close()
        # a client that leaves during a load does not abort the load
        d.request("POST", "/api/generate", {"model": "tiny", "keep_alive": 0})
        for p in d.engines():
            p.wait(10)
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 3, "stream": True}),
            {"content-type": "application/json"},
        )
        conn.getresponse().readline()
        conn.sock.close()
        conn.close()
        deadline = time.monotonic() + 15
        while "tiny:latest ready on port" not in d.log().split("keep_alive 0")[-1]:
            assert time.monotonic() < deadline, "the load was abandoned"
            time.sleep(0.2)
    finally:
        d.stop()
        d.kill_everything()


def test_max_loaded_models_one_alternating(engine: str, tmp_path: Path) -> None:
    import threading

    make_test_model(tmp_path / "models" / "a.gguf", seed=1)
    make_test_model(tmp_path / "models" / "b.gguf", seed=2)
    d = Daemon(
        tmp_path / "d",
        (
            f'models_dir = "{tmp_path / "models"}"\nmax_loaded_models = 1\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        ),
    )
    d.start()
    most = [0]
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            most[0] = max(most[0], len(d.engines()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for model in ["a", "b", "a", "b", "a"]:
            status, body = d.post_json("/v1/chat/completions", {"model": model, "messages": HELLO, "max_tokens": 2})
            assert status == 200, body
            assert [p.cmdline()[p.cmdline().index("--alias") + 1] for p in d.engines()] == [f"{model}:latest"]
    finally:
        watching.set()
        watcher.join()
        d.stop()
        d.kill_everything()
    assert most[0] == 1
    assert d.log().count(": making room for") == 4


def test_wedged_child_is_evicted_retried_then_504(tmp_path: Path) -> None:
    fake = fake_engine(tmp_path, "fake_wedged_engine.py")
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
        t0 = time.monotonic()
        status, body = d.post_json("/v1/chat/completions", {"model": "tiny", "messages": HELLO})
        assert status == 504, body
        assert "child_header_timeout_secs" in body["error"]["message"]
        assert time.monotonic() - t0 < 20
        assert d.logged("starting tiny:latest", 2) == 2  # retried once on a fresh child
        assert d.logged("wedged: no response headers", 2) >= 2
    finally:
        d.stop()
        d.kill_everything()


def test_disconnect_mid_stream_frees_the_slot(engine: str, tmp_path: Path) -> None:
    import http.client
    import json

    make_test_model(tmp_path / "models" / "one.gguf")
    d = Daemon(
        tmp_path / "d",
        (
            f'models_dir = "{tmp_path / "models"}"\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
            "[models.one]\nparallel = 1\n"
        ),
    )
    d.start()
    try:
        assert d.post_json("/v1/chat/completions", {"model": "one", "messages": HELLO, "max_tokens": 1})[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "one", "messages": HELLO, "stream": True, "ignore_eos": True}),
            {"content-type": "application/json"},
        )
        resp = conn.getresponse()
        resp.readline()
        conn.sock.close()  # the client goes away mid-generation
        conn.close()
        t0 = time.monotonic()
        status, body = d.post_json("/v1/chat/completions", {"model": "one", "messages": HELLO, "max_tokens": 2})
        assert status == 200, body
        # the only slot was freed at once, not after ~2000 more tokens
        assert time.monotonic() - t0 < 2.0
        time.sleep(0.2)
        assert "cancel" in d.engine_log("one").lower()
    finally:
        d.stop()
        d.kill_everything()


def test_num_ctx_up_to_and_above_the_trained_context_share_one_child(lifecycle: Daemon) -> None:
    # tiny is trained for 2048 tokens and starts with all of them: a larger
    # num_ctx is clamped to that, so nothing grows (growing: test_num_ctx_e2e)
    pids = set()
    for num_ctx in (1024, 8192, 2048):
        status, _, _ = lifecycle.request(
            "POST",
            "/api/chat",
            {
                "model": "tiny",
                "messages": HELLO,
                "stream": False,
                "keep_alive": "1m",
                "options": {"num_ctx": num_ctx, "num_predict": 2},
            },
        )
        assert status == 200
        pids.add(lifecycle.engine_for("tiny:latest").pid)
    assert len(pids) == 1  # one child served all three: no reload


def test_keep_alive_header_on_openai_and_anthropic(lifecycle: Daemon) -> None:
    import http.client
    import json

    for path, body in [
        ("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 2}),
        ("/v1/messages", {"model": "tiny", "messages": HELLO, "max_tokens": 2}),
    ]:
        conn = http.client.HTTPConnection("127.0.0.1", lifecycle.port, timeout=60)
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json", "x-blazar-keep-alive": "0"})
        assert conn.getresponse().status == 200
        conn.close()
        deadline = time.monotonic() + 10
        while [p for p in lifecycle.engines() if "tiny.gguf" in " ".join(p.cmdline())]:
            assert time.monotonic() < deadline, f"{path}: the child outlived keep_alive 0"
            time.sleep(0.05)
    status, body = lifecycle.post_json(
        "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "keep_alive": "soon"}
    )
    assert status == 400 and body["error"]["param"] == "keep_alive"
