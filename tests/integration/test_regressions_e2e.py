"""
Regressions found by attacking the Ollama and Anthropic surfaces.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

from blazar.models.testmodel import make_test_model, vocabulary
from tests.integration.harness import Daemon, fake_engine

HELLO = [{"role": "user", "content": "hi"}]
NO_END = {str(vocabulary()[0].index(t)): -100 for t in ("<|im_end|>", "</s>")}


def test_waiter_of_a_load_that_is_unloaded_gets_an_answer(daemon: Daemon) -> None:
    daemon.request("POST", "/api/generate", {"model": "cold", "keep_alive": 0})
    result: list[int] = []
    t = threading.Thread(
        target=lambda: result.append(
            daemon.request(
                "POST",
                "/api/chat",
                {"model": "cold", "messages": HELLO, "stream": False, "options": {"num_predict": 1}},
                timeout=30,
            )[0]
        )
    )
    t.start()
    time.sleep(0.05)
    daemon.request("POST", "/api/generate", {"model": "cold", "keep_alive": 0})
    t.join(20)
    assert not t.is_alive(), "the waiting request hung"
    assert result[0] in (200, 502)


def test_keep_alive_zero_waits_for_running_requests(daemon: Daemon) -> None:
    result: list[tuple[int, dict]] = []
    long = {"model": "cold", "messages": HELLO, "stream": False, "options": {"num_predict": 1500, "logit_bias": NO_END}}
    t = threading.Thread(target=lambda: result.append(daemon.post_json("/api/chat", long)))
    t.start()
    time.sleep(0.3)
    status, _ = daemon.post_json(
        "/api/chat",
        {"model": "cold", "messages": HELLO, "stream": False, "keep_alive": 0, "options": {"num_predict": 1}},
    )
    assert status == 200
    t.join(60)
    assert result[0][0] == 200, result[0]


def test_bad_inputs_are_4xx(daemon: Daemon) -> None:
    cases = [
        ("/api/chat", {"model": "tiny", "messages": HELLO, "stream": False, "tools": [{"junk": "a" * 1_200_000}]}, 400),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "keep_alive": "nan"}, 400),
        ("/api/chat", {"model": "\ud800", "messages": HELLO}, 404),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "options": {"num_predict": "3"}}, 400),
        ("/api/generate", {"model": "tiny", "prompt": 0}, 400),
        ("/api/generate", {"model": "tiny", "prompt": "x", "raw": "no"}, 400),
        ("/api/copy", {"source": "tiny", "destination": "sh-00001-of-00002"}, 400),
        (
            "/v1/messages",
            {
                "model": "tiny",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "document", "source": "x"}]}],
            },
            400,
        ),
        ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": []}]}, 400),
        (
            "/v1/messages",
            {
                "model": "tiny",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}
                ],
            },
            400,
        ),
        ("/v1/messages/count_tokens", {"model": "tiny-embed", "messages": HELLO}, 400),
        (
            "/v1/messages",
            {
                "model": "tiny",
                "max_tokens": 5,
                "stream": True,
                "messages": HELLO,
                "tools": [{"name": "f", "input_schema": {"type": "x" * 1_200_000}}],
            },
            400,
        ),
    ]
    for path, body, expected in cases:
        raw = (
            json.dumps(body).encode()
            if "\ud800" not in json.dumps(body, ensure_ascii=False)
            else (b'{"model":"\\ud800","messages":[{"role":"user","content":"hi"}]}')
        )
        status, _, data = daemon.request("POST", path, raw=raw)
        assert status == expected, (path, status, data[:300])


def test_num_predict_as_float_and_huge_keep_alive(daemon: Daemon) -> None:
    status, body = daemon.post_json(
        "/api/chat",
        {"model": "tiny", "messages": HELLO, "stream": False, "keep_alive": 1e300, "options": {"num_predict": 3.0}},
    )
    assert status == 200 and body["eval_count"] <= 3
    status, _, data = daemon.request("GET", "/api/ps")
    assert status == 200 and b"9999-12-31" in data
    daemon.request("POST", "/api/generate", {"model": "tiny", "keep_alive": "5m"})


def test_stop_sequence_reply_counts_the_prompt(daemon: Daemon) -> None:
    for seed in range(1, 20):
        status, body = daemon.post_json(
            "/v1/messages",
            {"model": "tiny", "max_tokens": 60, "messages": HELLO, "seed": seed, "stop_sequences": ["a", "e", "o"]},
        )
        assert status == 200
        if body["stop_reason"] == "stop_sequence":
            assert body["usage"]["input_tokens"] > 0
            return
    raise AssertionError("no stop_sequence answer")


def test_non_streaming_disconnect_frees_the_engine(daemon: Daemon) -> None:
    before = daemon.engine_log("tiny").count("cancel task")
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    conn.request(
        "POST",
        "/api/chat",
        json.dumps(
            {
                "model": "tiny",
                "messages": HELLO,
                "stream": False,
                "options": {"num_predict": 1900, "logit_bias": NO_END},
            }
        ),
        {"content-type": "application/json"},
    )
    time.sleep(0.3)
    conn.sock.close()
    deadline = time.monotonic() + 5
    while daemon.engine_log("tiny").count("cancel task") == before:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.1)


def test_kept_connection_closed_by_the_child_is_retried_on_a_fresh_one(tmp_path: Path) -> None:
    """
    Non-streamed replies reuse connections to the child; one the child
    closes just as it is reused is sent again on a fresh connection, and
    the client never sees it.
    """
    fake = fake_engine(tmp_path, "fake_closing_engine.py")
    make_test_model(tmp_path / "models" / "tiny.gguf")
    d = Daemon(tmp_path / "d", f'models_dir = "{tmp_path / "models"}"\n[engines.llamacpp]\nbinary = "{fake}"\n')
    d.start()
    try:
        for _ in range(10):
            status, body = d.post_json(
                "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == "ok"
        deadline = time.monotonic() + 5
        while d.engine_log("tiny").count("closed a kept connection under a request") < 4:  # the fake's output
            assert time.monotonic() < deadline, d.engine_log("tiny")[-3000:]
            time.sleep(0.05)
    finally:
        d.stop()
        d.kill_everything()


def test_engine_output_is_in_its_log_not_the_daemons(daemon: Daemon) -> None:
    """
    Each line a llama-server prints goes to its model's ring (`blazar logs
    MODEL`), not through the daemon's log as an event (issue 19): nine per
    request were a third of the daemon's CPU. The daemon's log keeps its own
    lines about the child (started, ready) and the engine's warnings.
    """
    status, _ = daemon.post_json(
        "/api/chat", {"model": "tiny", "messages": HELLO, "stream": False, "options": {"num_predict": 2}}
    )
    assert status == 200
    deadline = time.monotonic() + 5
    while "print_timing" not in daemon.engine_log("tiny"):  # llama-server's per-request info line
        assert time.monotonic() < deadline, daemon.engine_log("tiny")[-2000:]
        time.sleep(0.1)
    own = daemon.log()
    assert "print_timing" not in own and "load_model" not in own, own[-3000:]
    assert "tiny:latest ready on port" in own
    engine = daemon.engine_log("tiny")
    assert "tiny:latest | " in engine and "load_model" in engine  # from its start on
