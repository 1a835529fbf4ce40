"""
The OpenAI surface end to end: a real `twistd -n blazar` daemon, real
llama-server children, a generated random-weight model.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from blazar.testing import forced_tool_call_request
from tests.integration.harness import Daemon

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Say hello."}]


def chat(daemon: Daemon, **fields: object) -> tuple[int, dict]:
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 16, "seed": 1}
    body.update(fields)
    return daemon.post_json(CHAT, {k: v for k, v in body.items() if v is not None})


def assert_usage(usage: dict) -> None:
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert isinstance(usage[key], int) and not isinstance(usage[key], bool), usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_completion(daemon: Daemon) -> None:
    status, body = chat(daemon)
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in {"stop", "length"}
    assert_usage(body["usage"])


def test_model_echoes_the_requested_spelling(daemon: Daemon) -> None:
    status, body = chat(daemon, model="tiny:latest")
    assert (status, body["model"]) == (200, "tiny:latest")
    status, body = chat(daemon, model="TINY")
    assert (status, body["model"]) == (200, "TINY")


def test_trace_id_on_every_response(daemon: Daemon) -> None:
    for method, path, body in [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", CHAT, {"model": "nope", "messages": HELLO}),
        ("GET", "/nowhere", None),
    ]:
        _, headers, _ = daemon.request(method, path, body)
        assert re.fullmatch(r"plm-[0-9a-f]{8}-\d+", headers.get("x-blazar-trace-id", "")), (path, headers)
    # a well-formed id the client sends is echoed
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    conn.request("GET", "/health", headers={"x-blazar-trace-id": "client-trace-42"})
    assert conn.getresponse().getheader("x-blazar-trace-id") == "client-trace-42"
    conn.close()


def test_cors_and_preflight(engine: str, models: dict, tmp_path: Path) -> None:
    from tests.integration.conftest import daemon_config

    d = Daemon(tmp_path, daemon_config(engine, models) + ('[[keys]]\nname = "k"\nsecret = "cors-secret-0123456789"\n'))
    # a top-level key: it goes before the config's tables
    d.config.write_text('cors_origins = ["https://ok.example"]\n' + d.config.read_text())
    d.start()
    try:
        for origin, allowed in (("https://ok.example", True), ("https://evil.example", False)):
            conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
            conn.request(
                "OPTIONS",
                "/v1/chat/completions",
                headers={
                    "origin": origin,
                    "access-control-request-method": "POST",
                    "access-control-request-headers": "authorization, content-type",
                },
            )
            resp = conn.getresponse()
            assert resp.status == 204  # never gated by keys
            assert (resp.getheader("access-control-allow-origin") == origin) is allowed
            if allowed:
                assert "POST" in (resp.getheader("access-control-allow-methods") or "")
            conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
        conn.request("GET", "/v1/models", headers={"origin": "https://ok.example"})
        resp = conn.getresponse()
        assert resp.status == 401  # no key: the error still carries CORS headers
        assert resp.getheader("access-control-allow-origin") == "https://ok.example"
        assert "x-blazar-trace-id" in (resp.getheader("access-control-expose-headers") or "")
        conn.close()
    finally:
        d.stop()
        d.kill_everything()


def test_max_tokens(daemon: Daemon) -> None:
    status, body = chat(daemon, max_tokens=5)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 5


def parse_stream(daemon: Daemon, body: dict) -> list[dict]:
    events = [data for data, _ in daemon.stream(CHAT, body)]
    assert daemon.last_stream_headers["content-type"].startswith("text/event-stream")
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks:
        assert c["object"] == "chat.completion.chunk", c
        assert c["model"] == body["model"], c
    return chunks


def test_stream_without_usage(daemon: Daemon) -> None:
    chunks = parse_stream(daemon, {"model": "tiny", "messages": HELLO, "max_tokens": 12, "stream": True})
    assert chunks
    assert all("usage" not in c or c["usage"] is None for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}


def test_stream_with_usage(daemon: Daemon) -> None:
    chunks = parse_stream(
        daemon,
        {
            "model": "tiny:latest",
            "messages": HELLO,
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    last = chunks[-1]
    assert last["choices"] == []
    assert_usage(last["usage"])
    assert all(not c.get("usage") for c in chunks[:-1])


def engine_slots(daemon: Daemon, model: str) -> list[dict]:
    """
    Ask the model's llama-server directly for its slots, with the per-child
    key read from the child's environment.
    """
    engine = daemon.engine_for(model)
    argv = engine.cmdline()
    port = argv[argv.index("--port") + 1]
    key = engine.environ()["LLAMA_API_KEY"]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/slots", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_first_chunk_arrives_before_the_engine_finishes(daemon: Daemon) -> None:
    body = {
        # no max_tokens: it runs until the slot's context is full
        "model": "tiny",
        "messages": HELLO,
        "stream": True,
        "ignore_eos": True,
    }
    stream = daemon.stream(CHAT, body)
    first, _ = next(stream)
    assert json.loads(first)["object"] == "chat.completion.chunk"
    # Still generating: the gateway relayed the first chunk without waiting.
    slots = engine_slots(daemon, "tiny:latest")
    assert any(s.get("is_processing") for s in slots), slots
    rest = [data for data, _ in stream]
    assert rest[-1] == "[DONE]"


def test_unknown_model_is_404_streaming_or_not(daemon: Daemon) -> None:
    for stream in (False, True):
        status, body = daemon.post_json(CHAT, {"model": "no-such-model", "messages": HELLO, "stream": stream})
        assert status == 404
        assert body["error"]["code"] == "model_not_found"
        assert "tiny:latest" in body["error"]["message"]


def test_bad_requests_are_400(daemon: Daemon) -> None:
    status, _, data = daemon.request("POST", CHAT, raw=b"{oops")
    assert status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"
    status, body = daemon.post_json(CHAT, {"messages": HELLO})
    assert status == 400 and body["error"]["param"] == "model"
    status, body = daemon.post_json(CHAT, {"model": "tiny"})
    assert status == 400 and body["error"]["param"] == "messages"


def test_models_list(daemon: Daemon) -> None:
    status, _, data = daemon.request("GET", "/v1/models")
    listing = json.loads(data)
    assert status == 200 and listing["object"] == "list"
    ids = {m["id"] for m in listing["data"]}
    assert {"tiny:latest", "tiny-embed:latest", "cold:latest"} <= ids
    status, _, data = daemon.request("GET", "/v1/models/tiny")
    assert status == 200 and json.loads(data)["id"] == "tiny"


def test_completions(daemon: Daemon) -> None:
    status, body = daemon.post_json("/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 5})
    assert status == 200, body
    assert body["model"] == "tiny"
    assert isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] <= 5


def test_embeddings_one_vector_per_input_in_order(daemon: Daemon) -> None:
    inputs = ["hello world", "the test model", "yes"]
    status, body = daemon.post_json("/v1/embeddings", {"model": "tiny-embed", "input": inputs})
    assert status == 200, body
    assert body["model"] == "tiny-embed"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    vectors = [d["embedding"] for d in body["data"]]
    assert all(len(v) == 64 and all(isinstance(x, float) for x in v) for v in vectors)
    assert vectors[0] != vectors[1] != vectors[2]
    # The pinned engine's vectors for one input differ between a batch and a
    # request of its own (cross-sequence effects on the random model), so
    # order is checked by index and by the engine's own per-position output.
    status, again = daemon.post_json("/v1/embeddings", {"model": "tiny-embed", "input": inputs})
    assert status == 200
    for repeated, original in zip((d["embedding"] for d in again["data"]), vectors):
        assert repeated == pytest.approx(original, abs=1e-4)


def test_json_object_response_format(daemon: Daemon) -> None:
    # The random model sometimes stops before the JSON closes; the pinned
    # engine then answers 500 ("does not match the expected peg-native
    # format"), which Blazar must relay as an error, never as a 200.
    # Seeds are tried until one passes; every 200 must be valid JSON.
    passed = 0
    for seed in range(1, 13):
        status, body = chat(daemon, seed=seed, max_tokens=200, response_format={"type": "json_object"})
        if status == 200:
            json.loads(body["choices"][0]["message"]["content"])
            passed += 1
        else:
            assert status == 502, body
            assert body["error"]["type"] == "engine_error" and body["error"]["message"]
        if passed >= 2:
            break
    assert passed >= 1


def test_ten_concurrent_cold_requests_start_one_engine(daemon: Daemon) -> None:
    results: list[int] = []

    def one() -> None:
        status, _ = daemon.post_json(CHAT, {"model": "cold", "messages": HELLO, "max_tokens": 2})
        results.append(status)

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [200] * 10
    log = daemon.log()
    assert log.count("starting cold:latest") == 1, log[-3000:]
    assert len([p for p in daemon.engines() if "cold.gguf" in " ".join(p.cmdline())]) == 1


def test_sigkill_idle_child_then_next_request_respawns(daemon: Daemon) -> None:
    assert chat(daemon)[0] == 200
    victim = daemon.engine_for("tiny:latest")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    status, body = chat(daemon)
    assert status == 200, body
    assert daemon.engine_for("tiny:latest").pid != victim.pid


def test_sigkill_during_stream_ends_stream_with_error(daemon: Daemon) -> None:
    body = {"model": "tiny", "messages": HELLO, "stream": True, "ignore_eos": True}
    stream = daemon.stream(CHAT, body, timeout=30)
    next(stream)
    victim = daemon.engine_for("tiny:latest")
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    rest = [data for data, _ in stream]
    assert time.monotonic() - killed_at < 10
    assert "[DONE]" not in rest
    error = json.loads(rest[-1])["error"]
    assert error["code"] == "engine_crashed"
    assert "killed by signal 9" in error["message"], error
    status, body = chat(daemon)
    assert status == 200, body


def test_forced_tool_call(daemon: Daemon) -> None:
    # forced_tool_call_request's recipe works for seeds 1-4 on the pinned
    # engine; try a few so one unlucky seed cannot fail the test, but
    # every answer must be well-formed.
    for seed in range(1, 6):
        status, body = daemon.post_json(CHAT, forced_tool_call_request("tiny", seed))
        assert status == 200, body
        choice = body["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            break
    else:
        raise AssertionError(f"no seed gave finish_reason tool_calls: {body}")
    calls = choice["message"]["tool_calls"]
    assert calls and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"])["city"] in {"Paris", "Oslo"}
    assert isinstance(calls[0]["id"], str) and calls[0]["id"]


def test_forced_tool_call_streaming(daemon: Daemon) -> None:
    for seed in range(1, 6):
        chunks = parse_stream(daemon, forced_tool_call_request("tiny", seed, stream=True))
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        if finish[-1] == "tool_calls":
            break
    else:
        raise AssertionError("no seed gave finish_reason tool_calls")
    fragments = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert fragments
    assert all(isinstance(f["index"], int) and not isinstance(f["index"], bool) for f in fragments)
    by_call: dict[int, list[dict]] = {}
    for f in fragments:
        by_call.setdefault(f["index"], []).append(f)
    assert sorted(by_call) == list(range(len(by_call)))
    for parts in by_call.values():
        first, rest = parts[0], parts[1:]
        assert first["id"] and first["function"]["name"] == "get_weather", first
        assert all("id" not in f and "name" not in f.get("function", {}) for f in rest), parts
        arguments = "".join(f["function"].get("arguments", "") for f in parts)
        assert json.loads(arguments)["city"] in {"Paris", "Oslo"}


def test_sigkill_during_non_streaming_request_is_502(daemon: Daemon) -> None:
    """
    A child killed while it generates a non-streamed answer gives a 502.
    The tiny model can finish its whole 2k context in well under a second,
    so on a loaded machine the kill may land after the answer: then the
    round proves nothing and is run again (up to five times).
    """
    assert chat(daemon)[0] == 200
    for _ in range(5):
        victim = daemon.engine_for("tiny:latest")
        result: list[tuple[int, dict]] = []
        t = threading.Thread(target=lambda: result.append(chat(daemon, max_tokens=None, ignore_eos=True)))
        t.start()
        deadline = time.monotonic() + 30
        while not any(s.get("is_processing") for s in engine_slots(daemon, "tiny:latest")):
            assert time.monotonic() < deadline, "engine never started the request"
            time.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        t.join(15)
        assert not t.is_alive(), "request hung after its engine died"
        status, body = result[0]
        if status == 200 and body["choices"][0]["finish_reason"] == "length":
            continue  # it finished before the kill landed
        assert status == 502, body
        assert body["error"]["type"] == "engine_error"
        assert "killed by signal 9" in body["error"]["message"]
        assert chat(daemon)[0] == 200
        return
    pytest.fail("the kill never landed while the engine was generating (five rounds)")


def test_wrong_purpose_is_400_naming_the_config_key(daemon: Daemon) -> None:
    status, body = daemon.post_json("/v1/embeddings", {"model": "tiny", "input": "x"})
    assert status == 400 and "embedding = true" in body["error"]["message"]
    status, body = chat(daemon, model="tiny-embed")
    assert status == 400 and "embeddings only" in body["error"]["message"]


def test_stream_after_stream_on_one_connection(daemon: Daemon) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    body = json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 3, "stream": True})
    for _ in range(5):
        conn.request("POST", CHAT, body, {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.read().endswith(b"data: [DONE]\n\n")
    conn.close()


def test_pathological_requests(daemon: Daemon) -> None:
    deep = b'{"model":"tiny","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, _, data = daemon.request("POST", CHAT, raw=deep)
    assert status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"
    status, _, data = daemon.request("POST", "/v1//chat/completions", {"model": "tiny", "messages": HELLO})
    assert status == 404 and "error" in json.loads(data)
    status, body = chat(daemon, tools="x")
    assert status == 400 and body["error"]["param"] == "tools"
    status, body = chat(daemon, stream=None, max_tokens=2)
    assert status == 200 and body["object"] == "chat.completion"


def test_long_embedding_input_fits_a_slot(daemon: Daemon) -> None:
    # ~900 tokens: over llama-server's default 512-token batch, under the 2048 slot
    status, body = daemon.post_json("/v1/embeddings", {"model": "tiny-embed", "input": "hello " * 150})
    assert status == 200, body
    # over the slot: the engine's 500 is the client's fault, answered 400
    status, body = daemon.post_json("/v1/embeddings", {"model": "tiny-embed", "input": "hello " * 600})
    assert status == 400 and "too large" in body["error"]["message"]


def test_prompt_plus_max_tokens_over_context_is_400(daemon: Daemon) -> None:
    # tiny has 2048 tokens per slot
    status, body = chat(daemon, max_tokens=5000)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "5000" in body["error"]["message"] and "2048" in body["error"]["message"]
    assert "ctx_size" in body["error"]["message"]
    long_prompt = [{"role": "user", "content": "hello " * 400}]  # ~2400 tokens
    status, body = chat(daemon, messages=long_prompt, max_tokens=100)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "the prompt is" in body["error"]["message"]
    status, body = chat(daemon, messages=[{"role": "user", "content": "hello " * 200}], max_tokens=100)
    assert status == 200, body  # counted, and it fits
    for path, ask in [
        ("/api/chat", {"model": "tiny", "messages": long_prompt, "options": {"num_predict": 100}}),
        ("/v1/messages", {"model": "tiny", "max_tokens": 100, "messages": long_prompt}),
    ]:
        status, _, data = daemon.request("POST", path, ask)
        assert status == 400 and "ctx_size" in data.decode(), data
