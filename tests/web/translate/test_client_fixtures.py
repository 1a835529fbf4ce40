"""
The recorded first and tool-result requests of Claude Code and Codex CLI
(tests/fixtures/clients, recorded by scripts/record_clients.py) translate
without error, keep their system/developer messages in place, and leave
out only what a local model cannot use, named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from blazar.gateway import placement
from blazar.web.translate import anthropic, leniency, responses

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "clients"


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["claude-code-first", "claude-code-tool-result", "claude-code-interactive-first"])
def test_claude_code_translates(name: str) -> None:
    body = load(name)["body"]
    ignored = leniency.screen("anthropic", body)
    chat, stops = anthropic.request_to_openai(body, ignored=ignored)
    assert {"metadata", "context_management"} <= set(ignored)
    assert "thinking" not in ignored and "output_config" not in ignored
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}  # thinking: adaptive
    assert chat["reasoning_effort"] == "high"  # output_config.effort
    assert chat["max_tokens"] == body["max_tokens"]
    # the top-level system first, then the messages with the mid-conversation
    # system message where Claude Code put it
    assert chat["messages"][0]["role"] == "system"
    at = [m["role"] for m in body["messages"]].index("system")
    assert chat["messages"][1 + at]["role"] == "system"
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names == [t["name"] for t in body["tools"] if t.get("type") in (None, "custom")]


def test_claude_code_tool_result_turn() -> None:
    body = load("claude-code-tool-result")["body"]
    chat, _ = anthropic.request_to_openai(body, ignored=[])
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "system", "assistant", "tool"]
    call = chat["messages"][3]["tool_calls"][0]
    assert call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"])["command"] == "echo hi"
    assert chat["messages"][4]["content"] == "hi"


@pytest.mark.parametrize("mid_ok", [True, False])
@pytest.mark.parametrize(
    "name",
    [
        "claude-code-first",
        "claude-code-tool-result",
        "claude-code-interactive-first",
        "codex-first",
        "codex-tool-result",
    ],
)
def test_placed_for_either_kind_of_template(name: str, mid_ok: bool) -> None:
    fixture = load(name)
    body = fixture["body"]
    if fixture["path"].startswith("/v1/messages"):
        chat, _ = anthropic.request_to_openai(body, ignored=[])
    else:
        chat = responses.request_to_chat(body, ignored=[])
    placed = placement.place(chat["messages"], mid_ok)
    assert placed[0]["role"] == "system"
    if not mid_ok:
        assert all(m["role"] not in ("system", "developer") for m in placed[1:])
    # a turn's translation is a prefix of the next turn's
    for cut, m in enumerate(chat["messages"]):
        if m["role"] == "assistant":
            assert placed[: len(placement.place(chat["messages"][:cut], mid_ok))] == placement.place(
                chat["messages"][:cut], mid_ok
            )


@pytest.mark.parametrize("name", ["codex-first", "codex-tool-result"])
def test_codex_translates(name: str) -> None:
    body = load(name)["body"]
    ignored: list[str] = []
    tools = responses.ToolNames()
    chat = responses.request_to_chat(body, ignored=ignored, names=tools)
    assert {"client_metadata", "include", "tools:web_search"} <= set(ignored)
    assert "prompt_cache_key" not in ignored  # it names the session (blazar.gateway.sessions)
    assert "store" not in ignored and "reasoning" not in ignored
    assert [m["role"] for m in chat["messages"][:2]] == ["developer", "developer"]
    names = [t["function"]["name"] for t in chat["tools"]]
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    for inner in namespace["tools"]:
        assert f"{namespace['name']}__{inner['name']}" in names
    assert "exec_command" in names
    assert all(t["type"] == "function" for t in chat["tools"])


def test_codex_namespaced_call_round_trips() -> None:
    body = load("codex-first")["body"]
    tools = responses.ToolNames()
    responses.request_to_chat(body, ignored=[], names=tools)
    stream = responses.ResponsesStream(responses.response_object(body, "tiny", 1, None), tools)
    stream.start()
    events = stream.feed(
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"message": "x"}'},
                            }
                        ]
                    }
                }
            ]
        }
    )
    events += stream.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    events += stream.finish()
    added = next(e for k, e in events if k == "response.output_item.added")["item"]
    assert (added["name"], added["namespace"]) == ("spawn_agent", "multi_agent_v1")
    (item,) = stream.response["output"]
    assert item["type"] == "function_call"
    assert (item["name"], item["namespace"], item["arguments"]) == ("spawn_agent", "multi_agent_v1", '{"message": "x"}')
    # and as the next turn's history, back to the engine's name
    again = responses.items_to_messages(responses.output_as_input(stream.response["output"]))
    assert again[0]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"


def test_custom_tool_round_trips() -> None:
    body = {
        "model": "m",
        "input": "patch it",
        "tools": [{"type": "custom", "name": "apply_patch", "description": "d", "format": {"type": "grammar"}}],
    }
    tools = responses.ToolNames()
    chat = responses.request_to_chat(body, ignored=[], names=tools)
    assert chat["tools"][0]["function"]["parameters"]["required"] == ["input"]
    stream = responses.ResponsesStream(responses.response_object(body, "m", 1, None), tools)
    stream.feed(
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c",
                                "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch"}'},
                            }
                        ]
                    }
                }
            ]
        }
    )
    stream.finish()
    (item,) = stream.response["output"]
    assert (item["type"], item["input"]) == ("custom_tool_call", "*** Begin Patch")
    history = responses.items_to_messages(
        responses.output_as_input(stream.response["output"])
        + [{"type": "custom_tool_call_output", "call_id": "c", "output": "done"}]
    )
    assert json.loads(history[0]["tool_calls"][0]["function"]["arguments"]) == {"input": "*** Begin Patch"}
    assert history[1] == {"role": "tool", "tool_call_id": "c", "content": "done"}


@pytest.mark.parametrize(
    "tools",
    [
        [
            {"type": "function", "name": "ns__spawn"},
            {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "spawn"}]},
        ],
        [
            {"type": "namespace", "name": "a__b", "tools": [{"type": "function", "name": "c"}]},
            {"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "b__c"}]},
        ],
        [{"type": "function", "name": "x"}, {"type": "custom", "name": "x"}],
    ],
)
def test_tool_names_that_collide_for_the_engine_are_refused(tools: list[dict[str, Any]]) -> None:
    with pytest.raises(responses.ResponsesRequestError) as caught:
        responses.request_to_chat({"model": "m", "input": "x", "tools": tools})
    assert "offered twice" in str(caught.value)


def test_anthropic_mcp_toolset_and_tool_result_blocks() -> None:
    ignored: list[str] = []
    chat, _ = anthropic.request_to_openai(
        {
            "model": "m",
            "max_tokens": 4,
            "tools": [{"type": "mcp_toolset", "mcp_server_name": "x"}],
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [
                                {
                                    "type": "search_result",
                                    "source": "s",
                                    "title": "t",
                                    "content": [{"type": "text", "text": "found"}],
                                },
                                {
                                    "type": "document",
                                    "source": {"type": "text", "media_type": "text/plain", "data": "doc"},
                                },
                            ],
                        }
                    ],
                },
            ],
        },
        ignored=ignored,
    )
    assert ignored == ["tools:mcp_toolset"] and "tools" not in chat
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "t", "content": "found\ndoc"}


def test_claude_codes_billing_block_stays_out_of_the_prompt() -> None:
    """
    Claude Code's first system block (C{x-anthropic-billing-header:
    cc_version=...}) differs from request to request: kept, no turn's
    prompt would extend the last one's. Left out, the two recorded
    requests render the same system prompt.
    """
    systems = []
    for name in ("claude-code-first", "claude-code-tool-result"):
        body = load(name)["body"]
        assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
        ignored: list[str] = []
        chat, _ = anthropic.request_to_openai(body, ignored=ignored)
        assert "system:x-anthropic-billing-header" in ignored
        assert "x-anthropic-billing-header" not in chat["messages"][0]["content"]
        systems.append(chat["messages"][0]["content"])
    assert load("claude-code-first")["body"]["system"][0] != load("claude-code-tool-result")["body"]["system"][0]
    # (the two were recorded in different temporary directories)
    import re

    same = [re.sub(r"blazar-rec-claude-code-\w+", "DIR", s) for s in systems]
    assert same[0] == same[1]
