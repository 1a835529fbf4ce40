"""
The leniency policy end to end, on real llama-server children: a request
carrying every field its surface's reference defines is served (never a
400) with what was ignored in C{x-blazar-ignored}; each meaning-changing
value is a 400 naming it, in the surface's shape; the recorded Claude Code
and Codex CLI requests are served; system messages after the first turn
work on a model whose template refuses them, and the prompts rendered for
the recorded conversations keep them in place and extend turn by turn.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from blazar.gateway import placement
from blazar.models.testmodel import STRICT_CHAT_TEMPLATE, GeneratedModel, make_test_model
from blazar.web.translate import anthropic, responses
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon, free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clients"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GeneratedModel]:
    root = tmp_path_factory.mktemp("lenient-models")
    return {
        "tiny": make_test_model(root / "tiny.gguf"),
        "tiny-embed": make_test_model(root / "tiny-embed.gguf", seed=1, embedding=True),
        "strict": make_test_model(root / "strict.gguf", seed=3, chat_template=STRICT_CHAT_TEMPLATE),
        # the clients' first requests need a long context (Claude Code asks for max_tokens 32000)
        "big": make_test_model(root / "big.gguf", seed=4, context_length=131072),
    }


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("lenient"),
        daemon_config(engine, models, "[models.big]\nctx_size = 131072\nparallel = 1\n"),
    )
    d.start()
    try:
        yield d
    finally:
        code = d.stop()
        d.kill_everything()
        assert code in (0, -signal.SIGTERM), d.log()[-4000:]


def post(
    daemon: Daemon, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 300.0
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def ignored(headers: dict[str, str]) -> set[str]:
    return set(filter(None, headers.get("x-blazar-ignored", "").split(",")))


def no_tool_call_bias(models: dict[str, GeneratedModel]) -> dict[str, float]:
    # the random model must not start a tool call (its parser would refuse the noise)
    return {str(models["tiny"].token_ids["<tool_call>"]): -100}


# -- every documented field, per surface -----------------------------------------


def test_chat_completions_every_field(daemon: Daemon, models: dict[str, GeneratedModel]) -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "late"},
        ],
        "frequency_penalty": 0,
        "logit_bias": no_tool_call_bias(models),
        "logprobs": False,
        "max_completion_tokens": 4,
        "n": 1,
        "presence_penalty": 0,
        "reasoning_effort": "low",
        "response_format": {"type": "text"},
        "seed": 1,
        "stop": ["zzz"],
        "temperature": 0.5,
        "top_p": 1,
        "modalities": ["text"],
        "metadata": {"a": "b"},
        "store": False,
        "user": "u",
        "safety_identifier": "s",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "verbosity": "low",
        "prediction": {"type": "content", "content": "x"},
        "web_search_options": {},
        "tools": [{"type": "custom", "custom": {"name": "grep"}}],
        "a_field_from_2027": True,
    }
    status, headers, data = post(daemon, "/v1/chat/completions", body)
    assert status == 200, data
    assert json.loads(data)["choices"][0]["message"]["role"] == "assistant"
    assert {
        "metadata",
        "store",
        "user",
        "safety_identifier",
        "service_tier",
        "prompt_cache_retention",
        "verbosity",
        "prediction",
        "web_search_options",
        "tools:custom",
        "a_field_from_2027",
    } == ignored(headers)
    # streamed: the header is on the stream too, and the stream_options extra named
    status, headers, data = post(
        daemon,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    )
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]"), data[-300:]
    assert "stream_options.include_obfuscation" in ignored(headers)


def test_completions_and_embeddings_every_field(daemon: Daemon) -> None:
    status, headers, data = post(
        daemon,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 4,
            "best_of": 1,
            "n": 1,
            "echo": False,
            "suffix": None,
            "logprobs": None,
            "user": "u",
            "frequency_penalty": 0,
            "presence_penalty": 0,
            "seed": 1,
            "stop": None,
            "temperature": 1,
            "top_p": 1,
            "logit_bias": {},
        },
    )
    assert status == 200, data
    assert {"user", "best_of"} <= ignored(headers)
    status, headers, data = post(
        daemon, "/v1/embeddings", {"model": "tiny-embed", "input": "hi", "encoding_format": "float", "user": "u"}
    )
    assert status == 200, data
    assert ignored(headers) == {"user"}


def test_responses_every_field(daemon: Daemon, models: dict[str, GeneratedModel]) -> None:
    status, headers, data = post(
        daemon,
        "/v1/responses",
        {
            "model": "tiny",
            "instructions": "be brief",
            "input": [
                {"type": "message", "role": "developer", "content": "rules"},
                {"type": "message", "role": "user", "content": "hi"},
                {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            ],
            "tools": [
                {"type": "function", "name": "f", "parameters": {"type": "object"}},
                {
                    "type": "namespace",
                    "name": "ns",
                    "description": "d",
                    "tools": [{"type": "function", "name": "g", "parameters": {"type": "object"}}],
                },
                {"type": "web_search"},
                {"type": "file_search", "vector_store_ids": ["vs"]},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "max_output_tokens": 4,
            "temperature": 1,
            "top_p": 1,
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "reasoning": {"effort": "low", "summary": "auto"},
            "metadata": {"a": "b"},
            "store": False,
            "stream": False,
            "user": "u",
            "truncation": "auto",
            "safety_identifier": "s",
            "prompt_cache_key": "k",
            "prompt_cache_retention": "24h",
            "service_tier": "auto",
            "include": ["reasoning.encrypted_content"],
            "client_metadata": {"x": "y"},
            "max_tool_calls": 2,
            "top_logprobs": 0,
            "background": False,
            "logit_bias": no_tool_call_bias(models),
        },
    )
    assert status == 200, data
    assert json.loads(data)["status"] in ("completed", "incomplete")
    assert {
        "user",
        "truncation",
        "safety_identifier",
        "prompt_cache_retention",
        "service_tier",
        "include",
        "client_metadata",
        "max_tool_calls",
        "top_logprobs",
        "tools:web_search",
        "tools:file_search",
        "input:web_search_call",
        "text.verbosity",
    } == ignored(headers)


def test_anthropic_every_field(daemon: Daemon, models: dict[str, GeneratedModel]) -> None:
    status, headers, data = post(
        daemon,
        "/v1/messages",
        {
            "model": "tiny",
            "max_tokens": 4,
            "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "late"},
            ],
            "stop_sequences": ["zzz"],
            "temperature": 1,
            "top_k": 5,
            "top_p": 1,
            "tools": [
                {"name": "t", "input_schema": {"type": "object"}, "eager_input_streaming": True},
                {"type": "web_search_20250305", "name": "web_search"},
            ],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "adaptive"},
            "output_config": {"effort": "low"},
            "metadata": {"user_id": json.dumps({"session_id": "s1"})},
            "service_tier": "auto",
            "context_management": {"edits": []},
            "container": "c",
            "mcp_servers": [],
            "inference_geo": "us",
            "logit_bias": no_tool_call_bias(models),
        },
        {
            "anthropic-beta": "mid-conversation-system-2026-04-07,context-management-2025-06-27",
            "anthropic-version": "2023-06-01",
        },
    )
    assert status == 200, data
    assert json.loads(data)["type"] == "message"
    assert {
        "metadata",
        "service_tier",
        "context_management",
        "container",
        "mcp_servers",
        "inference_geo",
        "cache_control",
        "tools.eager_input_streaming",
        "tools:web_search",
        "anthropic-beta=context-management-2025-06-27",
    } == ignored(headers)


def test_ollama_every_field(daemon: Daemon) -> None:
    status, headers, data = post(
        daemon,
        "/api/chat",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
            "options": {"num_predict": 4, "num_batch": 64, "use_mlock": False},
            "stream": False,
            "keep_alive": "5m",
            "think": False,
            "logprobs": False,
            "top_logprobs": 0,
            "truncate": True,
            "shift": True,
        },
    )
    assert status == 200, data
    assert json.loads(data)["done"] is True
    # (num_gpu, main_gpu, num_thread, use_mmap place the model: tests/integration/test_launch_profile_e2e.py)
    assert {"logprobs", "top_logprobs", "truncate", "shift", "options.num_batch", "options.use_mlock"} == ignored(
        headers
    )
    status, headers, data = post(
        daemon,
        "/api/generate",
        {
            "model": "tiny",
            "prompt": "hi",
            "system": "s",
            "options": {"num_predict": 4},
            "stream": False,
            "raw": False,
            "context": [1, 2],
            "truncate": True,
            "images": [],
        },
    )
    assert status == 200, data
    assert {"context", "truncate"} == ignored(headers)
    status, headers, data = post(daemon, "/api/embed", {"model": "tiny-embed", "input": "hi", "truncate": True})
    assert status == 200, data
    assert ignored(headers) == {"truncate"}


# -- meaning-changing values: a 400 naming the field, in the surface's shape ------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]},
            "modalities",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "functions": [{"name": "f", "parameters": {}}],
            },
            "functions",
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "def f(", "suffix": "return 1"}, "suffix"),
        ("/v1/embeddings", {"model": "tiny-embed", "input": "hi", "dimensions": 8}, "dimensions"),
    ],
)
def test_openai_refusals_name_the_field(daemon: Daemon, path: str, body: dict[str, Any], field: str) -> None:
    status, _, data = post(daemon, path, body)
    assert status == 400, data
    error = json.loads(data)["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}: ")


def test_other_surfaces_refusals_name_the_field(daemon: Daemon) -> None:
    status, _, data = post(daemon, "/v1/responses", {"model": "tiny", "input": "hi", "background": True})
    assert status == 400 and json.loads(data)["error"]["param"] == "background", data
    status, _, data = post(daemon, "/api/generate", {"model": "tiny", "prompt": "hi", "template": "{{ .Prompt }}"})
    assert status == 400 and json.loads(data)["error"].startswith("template: "), data
    status, _, data = post(daemon, "/api/embed", {"model": "tiny-embed", "input": "hi", "dimensions": 8})
    assert status == 400 and json.loads(data)["error"].startswith("dimensions: "), data


# -- system messages after the first turn, on a template that refuses them ------


def test_mid_conversation_system_on_a_strict_template(daemon: Daemon) -> None:
    for path, body in [
        (
            "/v1/messages",
            {
                "model": "strict",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
            },
        ),
        (
            "/v1/chat/completions",
            {
                "model": "strict",
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": "first"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                    {"role": "developer", "content": "late"},
                    {"role": "user", "content": "again"},
                ],
            },
        ),
        (
            "/v1/responses",
            {
                "model": "strict",
                "max_output_tokens": 4,
                "input": [{"role": "user", "content": "hi"}, {"role": "developer", "content": "late"}],
            },
        ),
        (
            "/api/chat",
            {
                "model": "strict",
                "stream": False,
                "options": {"num_predict": 4},
                "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
            },
        ),
    ]:
        status, _, data = post(daemon, path, body)
        assert status == 200, (path, data[:500])
    assert "refuses a system message after the first turn" in daemon.log()


# -- the recorded clients, replayed through Blazar --------------------------------


def replay_headers(recorded: dict[str, Any]) -> dict[str, str]:
    skip = {"host", "content-length", "connection", "accept-encoding", "x-api-key", "authorization"}
    return {k: v for k, v in recorded["headers"].items() if k.lower() not in skip}


# (the tool-result turns: each carries all of its first turn; about a minute
# of prefill each on 2 cores, so the first turns are left to ./dev.sh clients)
@pytest.mark.parametrize(
    ("name", "limit", "first", "last", "named"),
    [
        (
            "claude-code-tool-result",
            {"max_tokens": 16},
            "message_start",
            ("message_stop",),
            {"metadata", "context_management"},
        ),
        (
            "codex-tool-result",
            {"max_output_tokens": 16},
            "response.created",
            ("response.completed", "response.incomplete"),
            {"client_metadata", "include", "tools:web_search"},
        ),
    ],
)
def test_recorded_agent_requests_are_served(
    daemon: Daemon,
    name: str,
    limit: dict[str, int],
    first: str,
    last: tuple[str, ...],
    named: set[str],
) -> None:
    recorded = fixture(name)
    # as recorded, but for the generated model and fewer tokens (random weights
    # may never stop on their own)
    body = {**recorded["body"], "model": "big", **limit}
    status, headers, data = post(daemon, recorded["path"], body, replay_headers(recorded))
    assert status == 200, data[:1000]
    events = [line[7:] for line in data.decode().splitlines() if line.startswith("event: ")]
    assert events[0] == first and events[-1] in last, events
    assert named <= ignored(headers)


# -- the prompts the engine renders for the recorded conversations --------------


@pytest.fixture(scope="module")
def renderers(engine: str, models: dict[str, GeneratedModel]) -> Iterator[dict[str, int]]:
    """
    Bare llama-servers (no Blazar) on the accepting and the strict template,
    to render prompts with C{/apply-template}.
    """
    ports: dict[str, int] = {}
    procs = []
    try:
        for name in ("big", "strict"):
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [
                        engine,
                        "-m",
                        str(models[name].path),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--jinja",
                        "-c",
                        "65536",
                        "--threads",
                        "1",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            ports[name] = port
        deadline = time.monotonic() + 60
        for port in ports.values():
            while True:
                try:
                    if render_raw(port, "/health", None)[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "llama-server did not become ready"
                time.sleep(0.1)
        yield ports
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def render_raw(port: int, path: str, body: Any) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def render(port: int, chat: dict[str, Any], mid_ok: bool) -> str:
    body = {"messages": placement.place(chat["messages"], mid_ok)}
    if chat.get("tools"):
        body["tools"] = chat["tools"]
    status, data = render_raw(port, "/apply-template", body)
    assert status == 200, data[:500]
    return str(json.loads(data)["prompt"])


def translated(name: str) -> dict[str, Any]:
    recorded = fixture(name)
    if recorded["path"].startswith("/v1/messages"):
        return anthropic.request_to_openai(recorded["body"], ignored=[])[0]
    return responses.request_to_chat(recorded["body"], ignored=[])


def mid_ok(port: int) -> bool:
    status, data = render_raw(port, "/apply-template", placement.PROBE)
    return status == 200 and placement.probe_accepts(json.loads(data).get("prompt"))


def test_probe_tells_the_templates_apart(renderers: dict[str, int]) -> None:
    assert mid_ok(renderers["big"]) is True
    assert mid_ok(renderers["strict"]) is False


@pytest.mark.parametrize("model", ["big", "strict"])
def test_claude_code_system_message_stays_in_place(renderers: dict[str, int], model: str) -> None:
    port = renderers[model]
    chat = translated("claude-code-first")
    prompt = render(port, chat, mid_ok(port))
    user = prompt.index("say hi")
    system_text = chat["messages"][2]["content"]
    # after the user's turn, before the generation prompt: where Claude Code put it
    assert user < prompt.find(system_text, user) < prompt.rindex("<|im_start|>assistant")
    # and the top-level system prompt still opens the prompt
    assert prompt.index(chat["messages"][0]["content"][:40]) < user


@pytest.mark.parametrize("model", ["big", "strict"])
@pytest.mark.parametrize("name", ["claude-code-tool-result", "codex-tool-result"])
def test_next_turn_extends_the_prompt_byte_for_byte(renderers: dict[str, int], model: str, name: str) -> None:
    """
    Turn 2 (the recorded tool-result request) against turn 1 (the same
    conversation up to the assistant's tool call): the rendered prompt of
    turn 2 starts with turn 1's, generation prompt included. (The test
    templates do not rewrite history; a model whose template drops old
    reasoning would differ there, and only there.)
    """
    port = renderers[model]
    ok = mid_ok(port)
    turn2 = translated(name)
    cut = max(i for i, m in enumerate(turn2["messages"]) if m["role"] == "assistant")
    turn1 = {**turn2, "messages": turn2["messages"][:cut]}
    first, second = render(port, turn1, ok), render(port, turn2, ok)
    assert second.startswith(first), (first[-300:], second[len(first) - 300 : len(first) + 100])
