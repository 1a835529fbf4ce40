"""
The sentinel's findings (L{blazar.gateway.sentinel}), on answers as the
engine writes them.
"""

from __future__ import annotations

import json

from blazar.gateway.sentinel import StreamWatch, inspect, inspect_reply

TOOLS = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            },
        }
    ]
}


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
    schema = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": {"type": "object", "required": ["a"]}},
        }
    }
    assert codes(inspect(schema, "stop", '{"b": 1}', "", [])) == ["format_invalid"]
    assert codes(inspect(schema, "stop", '{"a": 1}', "", [])) == []
    # a number beyond a double is no JSON a client can read (Python reads it as inf)
    assert codes(inspect(schema, "stop", '{"a": 80e2802731807777318}', "", [])) == ["format_invalid"]
    assert codes(inspect(TOOLS, "tool_calls", "", "", [("f", '{"x": 1e999}')])) == ["tool_args_invalid"]
    assert codes(inspect({}, "stop", "  ", "", [])) == ["empty"]
    assert codes(inspect({}, "stop", "", "thinking...", [])) == ["reasoning_only"]
    assert codes(inspect({}, "stop", "fine", "", [])) == []


def test_a_reply_and_a_stream_give_the_same_findings() -> None:
    reply = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": "no"}'}}
                    ],
                },
            }
        ]
    }
    assert codes(inspect_reply(TOOLS, json.dumps(reply).encode())) == ["truncated", "tool_args_schema"]
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x"'}}]},
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': "no"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    ]
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    watch = StreamWatch(TOOLS)
    for i in range(0, len(data), 7):  # split anywhere
        watch.events(data[i : i + 7])
    assert codes(watch.findings()) == ["truncated", "tool_args_schema"]


def test_call_syntax_left_in_the_text_is_judged_as_a_call() -> None:
    """
    Text that still holds tool-call syntax after the engine's parse (auto
    tool choice, tool_choice none; not inside code): a C{<tool_call>} with a
    JSON call is judged by name and arguments; one that does not parse, or
    another engine's marker, is tool_args_invalid.
    """
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    assert codes(inspect(TOOLS, "stop", call.format("nope", "{}"), "", [])) == ["tool_name_unknown"]
    assert codes(inspect(TOOLS, "stop", call.format("f", '{"x": "one"}'), "", [])) == ["tool_args_schema"]
    assert codes(inspect(TOOLS, "stop", call.format("f", '"x"'), "", [])) == ["tool_args_invalid"]
    assert codes(inspect(TOOLS, "stop", "ok " + call.format("f", '{"x": 1}'), "", [])) == []
    assert codes(inspect(TOOLS, "length", '<tool_call>\n{"name": "f", "argu', "", [])) == [
        "truncated",
        "tool_args_invalid",
    ]
    two = call.format("f", '{"x": 1}') + "\n" + call.format("g", "{}")
    assert codes(inspect(TOOLS, "stop", two, "", [])) == ["tool_name_unknown"]
    # without tools offered, call syntax is prose about it; with them, only
    # a marker outside code is a call
    assert codes(inspect({}, "stop", call.format("f", "{}"), "", [])) == []
    assert codes(inspect(TOOLS, "stop", "Use `<tool_call>` tags, or `<function=f>` inline.", "", [])) == []
    assert codes(inspect(TOOLS, "stop", "```\n" + call.format("nope", "{}") + "\n```", "", [])) == []
    assert codes(inspect(TOOLS, "stop", "Calling:\n  " + call.format("nope", "{}"), "", [])) == ["tool_name_unknown"]
    assert codes(inspect(TOOLS, "stop", '[TOOL_CALLS][{"name": "f"}]', "", [])) == ["tool_args_invalid"]
    assert codes(inspect(TOOLS, "stop", "a < b, and that is all", "", [])) == []


def test_a_stream_sees_call_syntax_split_over_tokens() -> None:
    pieces = ["<tool", "_call>", '\n{"name": "nope", ', '"arguments": {}}', "\n</tool_call>"]
    chunks = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    data = b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks)
    watch = StreamWatch(TOOLS)
    watch.events(data)
    assert codes(watch.findings()) == ["tool_name_unknown"]
    plain = StreamWatch({})
    plain.events(data)
    assert codes(plain.findings()) == []


def test_only_the_engines_own_unparsed_error_event_is_dropped() -> None:
    from blazar.gateway.sentinel import drop_unparsed, ending, is_unparsed

    phrase = "The model produced output that does not match the expected peg-native format"
    text = (
        'data: {"id":"c1","choices":[{"index":0,"delta":{"content":' + json.dumps("Error: " + phrase) + "}}]}"
    ).encode()
    call = (
        'data: {"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":'
        + json.dumps(json.dumps({"title": phrase}))
        + "}}]}}]}"
    ).encode()
    error = ('data: {"error":{"code":500,"message":"' + phrase + '","type":"server_error"}}').encode()
    assert not is_unparsed(text) and not is_unparsed(call) and is_unparsed(error)
    kept, dropped = drop_unparsed(text + b"\n\n" + call + b"\n\n" + error + b"\n\n")
    assert dropped and kept == text + b"\n\n" + call + b"\n\n"
    assert drop_unparsed(text + b"\n\n") == (text + b"\n\n", False)
    last = {"id": "c1", "created": 5, "model": "m"}
    final, usage = ending(last, "length", 7, 3, usage=True)
    assert final["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}] and final["id"] == "c1"
    assert final["timings"] == {"prompt_n": 7, "cache_n": 0, "predicted_n": 3}
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert len(ending(last, "stop", 1, 1, usage=False)) == 1


def test_whitespace_alone_is_an_empty_answer_on_the_bytes_too() -> None:
    """
    Read from the bytes (text events unparsed once text is seen), a stream
    of whitespace alone is still empty, as decoded chunks say; a stream
    whose text starts with whitespace is not.
    """

    def stream(*pieces: str) -> bytes:
        chunks = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        return b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks)

    for pieces, found in ((("\r", "\n "), ["empty"]), (("\n", "Paris", " "), [])):
        on_bytes = StreamWatch({})
        on_bytes.events(stream(*pieces))
        assert codes(on_bytes.findings()) == found, pieces
