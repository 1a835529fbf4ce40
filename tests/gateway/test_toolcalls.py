"""
Forced tool calls (L{blazar.gateway.toolcalls}) and the grammar they are
decoded under (L{blazar.gateway.grammar}): pure functions.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from blazar.gateway.grammar import Unsupported, to_gbnf
from blazar.gateway.toolcalls import (
    Forced,
    ToolChoiceError,
    ToolSchemaError,
    call_grammar,
    chat_completion,
    chat_stream,
    forced_call,
    needed_tokens,
    parse_calls,
    tool_calls,
)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
                "units": {"enum": ["metric", "imperial"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_what_forces_a_call() -> None:
    assert forced_call({"tools": [WEATHER], "tool_choice": "auto"}) is None
    assert forced_call({"tools": [WEATHER]}) is None
    forced = forced_call({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert forced is not None and len(forced.tools) == 2 and forced.parallel
    named = forced_call(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False,
        }
    )
    assert named == Forced((TIME,), False, named=True)
    with pytest.raises(ToolChoiceError, match="nope"):
        forced_call({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    with pytest.raises(ToolChoiceError):
        forced_call({"tools": [], "tool_choice": "required"})


def test_the_grammar_is_compact_and_bounded() -> None:
    grammar = to_gbnf(WEATHER["function"]["parameters"], 16)
    assert "char{0,16}" in grammar  # the unbounded string got a bound
    assert '("1" | "2" | "3")' in grammar  # a small integer range, enumerated
    assert '"\\"metric\\""' in grammar
    assert " space" not in grammar and "[ \\t\\n]" not in grammar  # no whitespace anywhere
    assert to_gbnf({"type": "object", "properties": {}}, 8).startswith('root ::= "{}"')


@pytest.mark.parametrize(
    ("schema", "construct"),
    [
        ({"type": "string", "pattern": "^a"}, "pattern"),
        ({"allOf": [{"type": "string"}]}, "allOf"),
        ({"$ref": "https://example.com/s.json"}, "only local references"),
        ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ],
)
def test_what_the_grammar_cannot_express_is_named(schema: dict, construct: str) -> None:
    with pytest.raises(Unsupported, match=construct):
        to_gbnf(schema, 8)


def test_a_tool_the_grammar_cannot_express_is_named() -> None:
    odd = {
        "type": "function",
        "function": {
            "name": "odd",
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "^x"}}},
        },
    }
    with pytest.raises(ToolSchemaError, match="'odd'.*pattern"):
        call_grammar(Forced((odd,), False), 200)


def test_local_refs_resolve_per_tool() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "t",
            "parameters": {
                "type": "object",
                "$defs": {"p": {"type": "boolean"}},
                "properties": {"a": {"$ref": "#/$defs/p"}},
                "required": ["a"],
            },
        },
    }
    assert "boolean" in call_grammar(Forced((tool, WEATHER), True), 400)


def test_parallel_calls_fit_the_budget() -> None:
    forced = Forced((WEATHER, TIME), True)
    assert "{0,0}" in call_grammar(forced, needed_tokens(forced))  # room for one call only
    assert "{0,3}" in call_grammar(forced, 4000)


def test_calls_are_parsed_and_checked() -> None:
    forced = Forced((WEATHER, TIME), True)
    assert parse_calls('[{"name":"get_time","arguments":{}}]', forced) == [("get_time", {})]
    with pytest.raises(ValueError):
        parse_calls('{"name":"get_weather","arguments":{"city":"Par', forced)
    with pytest.raises(ValueError):
        parse_calls('{"name":"rm_rf","arguments":{}}', forced)
    one = Forced((WEATHER,), False)
    assert parse_calls('{"name":"get_weather","arguments":{"city":"Paris"}}', one) == [
        ("get_weather", {"city": "Paris"})
    ]


def test_the_answer_in_openai_shape() -> None:
    calls = tool_calls([("get_weather", {"city": "Paris"}), ("get_time", {})])
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    reply = json.loads(chat_completion("m:latest", calls, usage))
    message = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}, {}]
    assert b'"model":"m:latest"' in chat_completion("m:latest", calls, usage)  # compact, for the renamer
    events = [e for e in chat_stream("m:latest", calls, usage, {"predicted_n": 5}).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    fragments = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []]
    assert [f["index"] for f in fragments] == [0, 1] and all(f["id"] and f["type"] == "function" for f in fragments)
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-2]["timings"] == {"predicted_n": 5}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    assert all(c["choices"] for c in chunks[:-1]) and "usage" not in chat_stream("m", calls, None).decode()


def test_nested_refs_each_get_their_rule_and_recursion_is_refused() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/A"}},
        "required": ["a"],
        "$defs": {
            "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
            "B": {"type": "boolean"},
        },
    }
    grammar = to_gbnf(schema, 8)
    assert "boolean" in grammar and grammar.count("ref") >= 2
    with pytest.raises(Unsupported, match="recursive"):
        to_gbnf(
            {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}}, "$ref": "#/$defs/N"}, 8
        )


def test_integer_bounds_are_kept() -> None:
    from blazar.gateway.grammar import int_range

    assert int_range(1, 3) == '("1" | "2" | "3")'
    wide = int_range(1, 1000)  # only values that are inside
    assert '"0"' not in wide and "{1,2}" in wide
    grammar = to_gbnf({"type": "integer", "exclusiveMinimum": 0}, 8)
    assert '"0"' not in grammar.split("\n")[0] and '"-"' not in grammar
    with pytest.raises(Unsupported):
        to_gbnf({"type": "number", "exclusiveMaximum": 1.5}, 8)


def test_a_tool_that_cannot_be_expressed_is_left_out_of_any_but_named_is_refused() -> None:
    from blazar.gateway.toolcalls import expressible

    odd = {
        "type": "function",
        "function": {
            "name": "odd",
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "^x"}}},
        },
    }
    kept, dropped = expressible(Forced((WEATHER, odd), True))
    assert [t["function"]["name"] for t in kept.tools] == ["get_weather"] and "odd" in dropped[0]
    assert expressible(Forced((odd,), False, named=True)) == (Forced((odd,), False, named=True), [])


def test_min_lengths_get_their_tokens() -> None:
    long = {
        "type": "function",
        "function": {
            "name": "w",
            "parameters": {
                "type": "object",
                "properties": {"s": {"type": "string", "minLength": 300}},
                "required": ["s"],
            },
        },
    }
    assert needed_tokens(Forced((long,), False)) > 6 * 300
