"""
The Anthropic surface end to end: the official `anthropic` SDK and raw SSE
against a real daemon and llama-server child.
"""

from __future__ import annotations

import http.client
import json
from typing import Any, cast

import anthropic
import jsonschema
import pytest
from anthropic.types import MessageParam, TextBlock, ToolParam

from blazar.testing import forced_tool_call_request
from tests.integration.harness import Daemon

HELLO: list[MessageParam] = [{"role": "user", "content": "Say hello."}]
WEATHER = forced_tool_call_request("tiny")["tools"][0]["function"]
TOOL: ToolParam = {
    "name": WEATHER["name"],
    "description": WEATHER["description"],
    "input_schema": WEATHER["parameters"],
}


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{daemon.port}", api_key="unused", max_retries=0)


def shape(message: Any) -> tuple:
    return (
        message.type,
        message.role,
        message.model,
        [b.type for b in message.content],
        type(message.usage.input_tokens),
        type(message.usage.output_tokens),
        message.stop_reason is not None,
    )


def test_create_and_stream_give_the_same_shape(client: anthropic.Anthropic) -> None:
    created = client.messages.create(model="tiny", max_tokens=12, messages=HELLO)
    assert created.id.startswith("msg_") and created.type == "message" and created.role == "assistant"
    assert created.model == "tiny"
    assert created.content[0].type == "text" and isinstance(created.content[0].text, str)
    assert created.stop_reason in {"end_turn", "max_tokens"}
    assert created.usage.output_tokens <= 12 and created.usage.input_tokens > 0
    with client.messages.stream(model="tiny", max_tokens=12, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert shape(final) == shape(created)
    assert cast(TextBlock, final.content[0]).text == text
    # the prompt is the same; the second time most of it comes from the KV cache
    assert prompt_of(final.usage) == prompt_of(created.usage)
    assert (final.usage.cache_read_input_tokens or 0) > 0


def prompt_of(usage: Any) -> int:
    """
    The whole prompt, as Anthropic reports it: tokens not from the cache
    plus those read from it.
    """
    return int(usage.input_tokens) + int(usage.cache_read_input_tokens or 0)


def forced_tool_call(client: anthropic.Anthropic, seed: int) -> Any:
    recipe = forced_tool_call_request("tiny", seed)
    return client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"logit_bias": recipe["logit_bias"], "seed": seed},
    )


def test_forced_tool_call_then_tool_result(client: anthropic.Anthropic) -> None:
    for seed in range(1, 6):
        message = forced_tool_call(client, seed)
        if message.stop_reason == "tool_use":
            break
    else:
        raise AssertionError(f"no tool_use: {message}")
    use = next(b for b in message.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.id
    assert isinstance(use.input, dict)
    jsonschema.validate(use.input, TOOL["input_schema"])
    follow = client.messages.create(
        model="tiny",
        max_tokens=8,
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C, sunny"}]},
        ],
    )
    assert follow.type == "message" and follow.stop_reason in {"end_turn", "max_tokens", "tool_use"}


def test_count_tokens_matches_usage(client: anthropic.Anthropic) -> None:
    base = client.messages.count_tokens(model="tiny", messages=HELLO).input_tokens
    created = client.messages.create(model="tiny", max_tokens=1, messages=HELLO)
    assert isinstance(base, int) and base == prompt_of(created.usage)
    with_system = client.messages.count_tokens(model="tiny", messages=HELLO, system="Be brief.").input_tokens
    assert with_system > base
    as_blocks = client.messages.count_tokens(
        model="tiny", messages=HELLO, system=[{"type": "text", "text": "Be brief."}]
    ).input_tokens
    assert as_blocks == with_system
    with_tools = client.messages.count_tokens(model="tiny", messages=HELLO, tools=[TOOL]).input_tokens
    assert with_tools > base
    created = client.messages.create(model="tiny", max_tokens=1, messages=HELLO, tools=[TOOL])
    assert prompt_of(created.usage) == with_tools


def raw_events(daemon: Daemon, body: dict) -> list[tuple[str, dict]]:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
    conn.request(
        "POST",
        "/v1/messages?beta=true",
        json.dumps(body),
        {
            "content-type": "application/json",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "tools-2024-04-04",
            "x-api-key": "whatever",
        },
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("content-type") == "text/event-stream"
    assert resp.getheader("request-id", "").startswith("req_")
    raw = resp.read().decode("utf-8")
    conn.close()
    assert "[DONE]" not in raw
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        name, payload = lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])
        assert payload["type"] == name
        events.append((name, payload))
    return events


def assert_anthropic_order(events: list[tuple[str, dict]]) -> None:
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert names.count("message_start") == names.count("message_delta") == names.count("message_stop") == 1
    start = events[0][1]["message"]
    assert start["content"] == [] and set(start["usage"]) >= {"input_tokens", "output_tokens"}
    index, open_ = 0, False
    for name, p in events[1:-2]:
        if name == "content_block_start":
            assert not open_ and p["index"] == index
            open_ = True
        elif name == "content_block_delta":
            assert open_ and p["index"] == index
        elif name == "content_block_stop":
            assert open_ and p["index"] == index
            open_, index = False, index + 1
        else:
            assert name == "ping", name
    assert not open_
    delta = events[-2][1]
    assert isinstance(delta["usage"]["output_tokens"], int)
    assert "stop_reason" in delta["delta"] and "stop_sequence" in delta["delta"]


def test_raw_sse_text(daemon: Daemon) -> None:
    events = raw_events(daemon, {"model": "tiny", "max_tokens": 10, "stream": True, "messages": HELLO})
    assert_anthropic_order(events)
    deltas = [p["delta"]["type"] for n, p in events if n == "content_block_delta"]
    assert deltas and set(deltas) == {"text_delta"}


def test_raw_sse_tool_use(daemon: Daemon) -> None:
    for seed in range(1, 6):
        recipe = forced_tool_call_request("tiny", seed)
        events = raw_events(
            daemon,
            {
                "model": "tiny",
                "max_tokens": 200,
                "stream": True,
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [TOOL],
                "tool_choice": {"type": "any"},
                "logit_bias": recipe["logit_bias"],
                "seed": seed,
            },
        )
        assert_anthropic_order(events)
        if events[-2][1]["delta"]["stop_reason"] == "tool_use":
            break
    else:
        raise AssertionError("no tool_use answer")
    starts = [p["content_block"] for n, p in events if n == "content_block_start"]
    assert starts[0]["type"] == "tool_use" and starts[0]["input"] == {}
    partial = "".join(p["delta"]["partial_json"] for n, p in events if n == "content_block_delta" and p["index"] == 0)
    jsonschema.validate(json.loads(partial), TOOL["input_schema"])


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    # The random model writes byte noise; stop on a very common character.
    for seed in range(1, 20):
        message = client.messages.create(
            model="tiny", max_tokens=60, messages=HELLO, stop_sequences=["a", "e", "o"], extra_body={"seed": seed}
        )
        if message.stop_reason == "stop_sequence":
            assert message.stop_sequence in {"a", "e", "o"}
            text = "".join(b.text for b in message.content if b.type == "text")
            assert not any(s in text for s in ("a", "e", "o"))
            return
    raise AssertionError("no stop_sequence in 19 seeds")


@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"model": "tiny", "messages": HELLO}, 400, "invalid_request_error"),
        ({"model": "nope", "max_tokens": 5, "messages": HELLO}, 404, "not_found_error"),
        ({"model": "tiny", "max_tokens": 5, "messages": "hi"}, 400, "invalid_request_error"),
    ],
)
def test_error_shapes(daemon: Daemon, body: dict, status: int, kind: str) -> None:
    code, headers, data = daemon.request("POST", "/v1/messages", body)
    assert code == status
    parsed = json.loads(data)
    assert parsed["type"] == "error" and parsed["error"]["type"] == kind and parsed["error"]["message"]
    assert headers["request-id"].startswith("req_")


def test_too_large_is_413(daemon: Daemon) -> None:
    import httpx

    # the daemon answers at the headers and closes without reading the body:
    # httpx (the SDKs' client) reads that answer; bare http.client would
    # fail writing the rest of the body (EPIPE) before it looks
    big = b'{"model":"tiny","max_tokens":1,"messages":[{"role":"user","content":"' + b"x" * (51 * 1024 * 1024) + b'"}]}'
    r = httpx.post(
        f"http://127.0.0.1:{daemon.port}/v1/messages",
        content=big,
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_sdk_raises_typed_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "system", "content": "x"}])


def test_engine_killed_mid_stream_gives_error_event(daemon: Daemon) -> None:
    import signal
    import time

    from blazar.models.testmodel import vocabulary

    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    conn.request(
        "POST",
        "/v1/messages",
        json.dumps(
            {
                "model": "tiny",
                "max_tokens": 1900,
                "stream": True,
                "messages": HELLO,
                # the random model ends its turn on </s> as well as <|im_end|>
                "logit_bias": {str(vocabulary()[0].index(t)): -100 for t in ("<|im_end|>", "</s>")},
            }
        ),
        {"content-type": "application/json"},
    )
    resp = conn.getresponse()
    seen = []
    while True:
        line = resp.readline().decode()
        if line.startswith("event: "):
            seen.append(line[len("event: ") :].strip())
        if "content_block_delta" in seen:
            break
    daemon.engine_for("tiny:latest").send_signal(signal.SIGKILL)
    killed = time.monotonic()
    rest = resp.read().decode()
    conn.close()
    assert time.monotonic() - killed < 10
    events = [b for b in rest.split("\n\n") if b.strip()]
    last = events[-1].split("\n")
    assert last[0] == "event: error"
    error = json.loads(last[1][len("data: ") :])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "killed by signal 9" in error["error"]["message"]
    assert "message_stop" not in rest
