"""
What clients were promised (issue 35), on a real llama-server child: the
client's C{max_tokens} is a limit even for a forced tool call, every answer
is strict JSON, a schema answer is never a 502, logprobs with tools in a
stream are kept, and tools a model cannot see are refused. Every surface,
streamed and not. Items 1-4 run on the random-weight model (it writes the
overflowing numbers and invalid UTF-8 real models rarely do); item 5 needs
a real chat template without tools (SmolLM2-135M-Instruct, from its wheel).
"""

from __future__ import annotations

import json
import signal
from typing import Any, Iterator

import pytest

from blazar import strictjson
from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon

EMIT = {"name": "emit", "description": "Emit a long text",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string", "minLength": 200}},
                         "required": ["text"]}}
MEASURE = {"name": "measure", "description": "Record a measurement",
           "parameters": {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}}
ASK = [{"role": "user", "content": "Write it."}]


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("promises")
    models = root / "models"
    make_test_model(models / "tiny.gguf")
    d = Daemon(root, (
        f'models_dir = "{models}"\n'
        '[models."tiny"]\nparallel = 2\n'
        f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
    ))
    d.start()
    yield d
    code = d.stop()
    d.kill_everything()
    assert code in (0, -signal.SIGTERM)


def strict(data: bytes) -> Any:
    """
    A body as strict JSON (no NaN, no Infinity, no overflowing number).
    """
    try:
        return strictjson.loads(data)
    except ValueError as e:
        raise AssertionError(f"not strict JSON ({e}): {data[:300]!r}") from None


def sse(data: bytes) -> list[Any]:
    """
    The C{data:} payloads of an SSE body, each strict JSON (C{[DONE]} kept
    as the string).
    """
    out: list[Any] = []
    for line in data.decode("utf-8").splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else strict(payload.encode("utf-8")))
    return out


def ndjson(data: bytes) -> list[Any]:
    return [strict(line.encode("utf-8")) for line in data.decode("utf-8").splitlines() if line.strip()]


def openai_tool(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool.get("parameters") or tool["input_schema"]
    return {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": parameters}}


def anthropic_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"name": tool["name"], "description": tool["description"],
            "input_schema": tool.get("input_schema") or tool["parameters"]}


# -- 1. a forced tool call ends within max_tokens -------------------------------


def test_a_forced_call_that_does_not_fit_max_tokens_is_cut_short_on_every_surface(daemon: Daemon) -> None:
    limit = 5
    named = {"type": "function", "function": {"name": "emit"}}
    for stream in (False, True):
        # OpenAI chat
        status, _, data = daemon.request("POST", "/v1/chat/completions", {
            "model": "tiny", "messages": ASK, "tools": [openai_tool(EMIT)], "tool_choice": named,
            "max_tokens": limit, "seed": 1, "stream": stream, "stream_options": {"include_usage": True},
        } if stream else {
            "model": "tiny", "messages": ASK, "tools": [openai_tool(EMIT)], "tool_choice": named,
            "max_tokens": limit, "seed": 1,
        })
        assert status == 200, data
        if stream:
            chunks = [c for c in sse(data) if c != "[DONE]"]
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert [f for f in finishes if f] == ["length"], chunks
            assert not any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks), chunks
            usage = chunks[-1]["usage"]
        else:
            reply = strict(data)
            assert reply["choices"][0]["finish_reason"] == "length", reply
            assert not reply["choices"][0]["message"].get("tool_calls"), reply
            usage = reply["usage"]
        assert 0 < usage["completion_tokens"] <= limit, usage
        # Anthropic Messages
        status, _, data = daemon.request("POST", "/v1/messages", {
            "model": "tiny", "max_tokens": limit, "messages": ASK, "tools": [anthropic_tool(EMIT)],
            "tool_choice": {"type": "tool", "name": "emit"}, "seed": 1, "stream": stream,
        })
        assert status == 200, data
        if stream:
            events = sse(data)
            delta = [e for e in events if e["type"] == "message_delta"]
            assert len(delta) == 1 and delta[0]["delta"]["stop_reason"] == "max_tokens", events
            assert not [e for e in events if e["type"] == "content_block_start"
                        and e["content_block"]["type"] == "tool_use"], events
            assert 0 < delta[0]["usage"]["output_tokens"] <= limit, delta
        else:
            message = strict(data)
            assert message["stop_reason"] == "max_tokens", message
            assert not [b for b in message["content"] if b["type"] == "tool_use"], message
            assert 0 < message["usage"]["output_tokens"] <= limit, message
        # Ollama /api/chat (Blazar takes OpenAI's tool_choice there)
        status, _, data = daemon.request("POST", "/api/chat", {
            "model": "tiny", "messages": ASK, "tools": [openai_tool(EMIT)], "tool_choice": named,
            "stream": stream, "options": {"seed": 1, "num_predict": limit},
        })
        assert status == 200, data
        lines = ndjson(data)
        last = lines[-1]
        assert last["done"] is True and last["done_reason"] == "length", lines
        assert not [line for line in lines if (line.get("message") or {}).get("tool_calls")], lines
        assert 0 < last["eval_count"] <= limit, last
        # Responses
        status, _, data = daemon.request("POST", "/v1/responses", {
            "model": "tiny", "input": "Write it.", "tools": [{"type": "function", **openai_tool(EMIT)["function"]}],
            "tool_choice": {"type": "function", "name": "emit"}, "max_output_tokens": 16, "stream": stream,
        })
        assert status == 200, data
        response = [e for e in sse(data) if e != "[DONE]"][-1]["response"] if stream else strict(data)
        assert response["status"] == "incomplete", response
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}, response
        assert not [i for i in response["output"] if i["type"] == "function_call"], response
        assert 0 < response["usage"]["output_tokens"] <= 16, response


def test_a_forced_call_that_fits_is_still_made(daemon: Daemon) -> None:
    status, reply = daemon.post_json("/v1/chat/completions", {
        "model": "tiny", "messages": ASK, "tools": [openai_tool(MEASURE)], "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 100, "seed": 2,
    })
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "tool_calls", reply
    assert reply["usage"]["completion_tokens"] <= 100, reply


# -- 2. numbers in forced calls are finite JSON numbers --------------------------


def test_forced_number_arguments_are_strict_json_on_every_surface(daemon: Daemon) -> None:
    named = {"type": "function", "function": {"name": "measure"}}
    for seed in range(1, 41):
        stream = seed % 2 == 0
        status, _, data = daemon.request("POST", "/v1/chat/completions", {
            "model": "tiny", "messages": ASK, "tools": [openai_tool(MEASURE)], "tool_choice": named,
            "parallel_tool_calls": False, "max_tokens": 120, "seed": seed, "stream": stream,
        })
        assert status == 200, data
        if stream:
            chunks = [c for c in sse(data) if c != "[DONE]"]
            arguments = "".join(tc["function"].get("arguments") or "" for c in chunks if c["choices"]
                                for tc in c["choices"][0]["delta"].get("tool_calls") or [])
        else:
            arguments = strict(data)["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        value = strict(arguments.encode("utf-8"))["value"]
        assert isinstance(value, (int, float)), value
        status, _, data = daemon.request("POST", "/v1/messages", {
            "model": "tiny", "max_tokens": 120, "messages": ASK, "tools": [anthropic_tool(MEASURE)],
            "tool_choice": {"type": "tool", "name": "measure"}, "seed": seed, "stream": stream,
        })
        assert status == 200, data
        if stream:
            sse(data)
        else:
            strict(data)
        status, _, data = daemon.request("POST", "/api/chat", {
            "model": "tiny", "messages": ASK, "tools": [openai_tool(MEASURE)], "tool_choice": named,
            "stream": stream, "options": {"seed": seed, "num_predict": 120},
        })
        assert status == 200, data
        ndjson(data)
        status, _, data = daemon.request("POST", "/v1/responses", {
            "model": "tiny", "input": "Write it.", "tools": [{"type": "function", **openai_tool(MEASURE)["function"]}],
            "tool_choice": "required", "max_output_tokens": 120, "stream": stream,
            "parallel_tool_calls": False, "seed": seed,
        })
        assert status == 200, data
        if stream:
            sse(data)
        else:
            strict(data)


def test_a_request_with_a_number_beyond_a_double_is_a_400(daemon: Daemon) -> None:
    status, _, data = daemon.request("POST", "/v1/chat/completions", raw=(
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}'))
    assert status == 400, data
    assert b"out of range" in data, data
