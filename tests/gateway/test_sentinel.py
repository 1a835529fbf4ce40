"""
The sentinel's findings (L{blazar.gateway.sentinel}), on answers as the
engine writes them.
"""

from __future__ import annotations

import json

from blazar.gateway.sentinel import StreamWatch, inspect, inspect_reply

TOOLS = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]}


def codes(found: list[tuple[str, str]]) -> list[str]:
    return [code for code, _ in found]


def test_each_code() -> None:
    assert codes(inspect({}, "length", "some text", "", [])) == ["truncated"]
    assert codes(inspect(TOOLS, "tool_calls", "", "", [("g", "{}")])) == ["tool_name_unknown"]
    assert codes(inspect(TOOLS, "tool_calls", "", "", [("f", '{"x": 1')])) == ["tool_args_invalid"]
    assert codes(inspect(TOOLS, "tool_calls", "", "", [("f", "[1]")])) == ["tool_args_invalid"]
    assert codes(inspect(TOOLS, "tool_calls", "", "", [("f", '{"x": "one"}')])) == ["tool_args_schema"]
    assert codes(inspect(TOOLS, "tool_calls", "", "", [("f", '{"x": 1}')])) == []
    fmt = {"response_format": {"type": "json_object"}}
    assert codes(inspect(fmt, "length", '{"a": ', "", [])) == ["truncated", "format_invalid"]
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "required": ["a"]}}}}
    assert codes(inspect(schema, "stop", '{"b": 1}', "", [])) == ["format_invalid"]
    assert codes(inspect(schema, "stop", '{"a": 1}', "", [])) == []
    assert codes(inspect({}, "stop", "  ", "", [])) == ["empty"]
    assert codes(inspect({}, "stop", "", "thinking...", [])) == ["reasoning_only"]
    assert codes(inspect({}, "stop", "fine", "", [])) == []


def test_a_reply_and_a_stream_give_the_same_findings() -> None:
    reply = {"choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": "no"}'}}]}}]}
    assert codes(inspect_reply(TOOLS, json.dumps(reply).encode())) == ["truncated", "tool_args_schema"]
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f",
                                                                                              "arguments": '{"x"'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': "no"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    ]
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    watch = StreamWatch(TOOLS)
    for i in range(0, len(data), 7):  # split anywhere
        watch.events(data[i:i + 7])
    assert codes(watch.findings()) == ["truncated", "tool_args_schema"]
