"""
The OpenAI <-> Anthropic Messages translation for C{api = "anthropic"}
remotes (L{blazar.gateway.remotewire}).
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from blazar.gateway.remotewire import (
    DEFAULT_MAX_TOKENS,
    AnthropicStream,
    RemoteRequestError,
    RemoteStreamError,
    anthropic_error_message,
    from_anthropic,
    to_anthropic,
)
from blazar.web.translate.anthropic import request_to_openai

USER = {"role": "user", "content": "hi"}


def translate(**fields: Any) -> tuple[dict[str, Any], list[str]]:
    body = {"model": "local-name", "messages": [USER], **fields}
    return to_anthropic(body, "claude-x")


class RequestTests(SynchronousTestCase):
    def test_minimal(self) -> None:
        out, ignored = translate()
        self.assertEqual(
            out,
            {"model": "claude-x", "max_tokens": DEFAULT_MAX_TOKENS, "messages": [{"role": "user", "content": "hi"}]},
        )
        self.assertEqual(ignored, [])

    def test_scalar_fields(self) -> None:
        table: list[tuple[dict[str, Any], dict[str, Any], list[str]]] = [
            ({"max_tokens": 10}, {"max_tokens": 10}, []),
            ({"max_completion_tokens": 20, "max_tokens": 10}, {"max_tokens": 20}, []),
            ({"stop": "END"}, {"stop_sequences": ["END"]}, []),
            ({"stop": ["a", "b"]}, {"stop_sequences": ["a", "b"]}, []),
            ({"stop": []}, {}, []),
            ({"temperature": 0.5, "top_p": 0.9, "top_k": 40}, {"temperature": 0.5, "top_p": 0.9, "top_k": 40}, []),
            ({"temperature": 1.7}, {"temperature": 1}, ["temperature:above-1"]),
            ({"stream": True, "stream_options": {"include_usage": True}}, {"stream": True}, []),
            ({"user": "u-1"}, {"metadata": {"user_id": "u-1"}}, []),
            ({"n": 1, "response_format": {"type": "text"}, "logprobs": False}, {}, []),
            (
                {"seed": 3, "presence_penalty": 0.1, "metadata": {"a": "b"}},
                {},
                ["seed", "presence_penalty", "metadata"],
            ),
            (
                {"reasoning_effort": "medium"},
                {"max_tokens": DEFAULT_MAX_TOKENS + 4096, "thinking": {"type": "enabled", "budget_tokens": 4096}},
                [],
            ),
            (
                {"reasoning_effort": "high", "max_tokens": 8000},
                {"max_tokens": 8000, "thinking": {"type": "enabled", "budget_tokens": 7999}},
                [],
            ),
            ({"reasoning_effort": "none"}, {}, []),
        ]
        for fields, extra, ignored in table:
            out, got = translate(**fields)
            expected = {
                "model": "claude-x",
                "max_tokens": DEFAULT_MAX_TOKENS,
                "messages": [{"role": "user", "content": "hi"}],
                **extra,
            }
            self.assertEqual((out, got), (expected, ignored), fields)

    def test_refused(self) -> None:
        table: list[tuple[dict[str, Any], str]] = [
            ({"n": 2}, "n"),
            ({"logprobs": True}, "logprobs"),
            ({"top_logprobs": 3}, "top_logprobs"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
                "response_format",
            ),
            ({"max_tokens": 0}, "max_tokens"),
            ({"max_completion_tokens": "9"}, "max_completion_tokens"),
            ({"stop": 5}, "stop"),
            ({"temperature": float("nan")}, "temperature"),
            ({"reasoning_effort": "huge"}, "reasoning_effort"),
            ({"reasoning_effort": "low", "max_tokens": 1000}, "reasoning_effort"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages.0.role"),
            (
                {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
                "messages.0.content.0.type",
            ),
            (
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "data:image/bmp;base64,AA"}}],
                        }
                    ]
                },
                "messages.0.content.0.image_url.url",
            ),
            ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
            ({"messages": [{"role": "system", "content": "only"}]}, "messages"),
        ]
        for fields, param in table:
            with self.assertRaises(RemoteRequestError, msg=str(fields)) as caught:
                translate(**fields)
            self.assertIsInstance(caught.exception, ValueError)
            self.assertEqual(caught.exception.param, param, fields)

    def test_system_and_developer(self) -> None:
        out, ignored = translate(messages=[{"role": "system", "content": "be brief"}, USER])
        self.assertEqual(out["system"], "be brief")
        out, ignored = translate(
            messages=[
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                USER,
                {"role": "system", "content": "late"},
            ]
        )
        self.assertEqual(
            out["system"],
            [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "text", "text": "late"}],
        )
        self.assertEqual(ignored, ["messages:system-moved-to-top"])

    def test_content_parts(self) -> None:
        out, _ = translate(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO", "detail": "high"}},
                        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE"}},
                    ],
                }
            ]
        )
        self.assertEqual(
            out["messages"],
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
                        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
                        {
                            "type": "document",
                            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"},
                        },
                    ],
                }
            ],
        )

    def test_tool_conversation(self) -> None:
        out, ignored = translate(
            messages=[
                USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{broken"}},
                        {"id": "call_3", "type": "function", "function": {"name": "h", "arguments": ""}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "one"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "two"}]},
                {"role": "tool", "tool_call_id": "call_3", "content": "three"},
                {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "so"},
                {"role": "assistant", "content": [{"type": "text", "text": " there"}]},
            ]
        )
        self.assertEqual(
            out["messages"],
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"x": 1}},
                        {"type": "tool_use", "id": "call_2", "name": "g", "input": {"_raw": "{broken"}},
                        {"type": "tool_use", "id": "call_3", "name": "h", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "call_1", "content": "one"},
                        {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": "two"}]},
                        {"type": "tool_result", "tool_use_id": "call_3", "content": "three"},
                        {"type": "text", "text": "and?"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "so"}, {"type": "text", "text": " there"}]},
            ],
        )
        self.assertEqual(ignored, ["tool_calls:unparsed-arguments"])

    def test_tool_results_first_in_user_turn(self) -> None:
        out, _ = translate(
            messages=[
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "user", "content": "note"},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ]
        )
        self.assertEqual([b["type"] for b in out["messages"][1]["content"]], ["tool_result", "text"])

    def test_tools_and_choice(self) -> None:
        tools = [
            {
                "type": "function",
                "function": {"name": "f", "description": "does f", "parameters": {"type": "object"}, "strict": True},
            },
            {"type": "function", "function": {"name": "g"}},
        ]
        converted = [
            {"name": "f", "description": "does f", "input_schema": {"type": "object"}},
            {"name": "g", "input_schema": {"type": "object", "properties": {}}},
        ]
        table: list[tuple[dict[str, Any], Any]] = [
            ({}, None),
            ({"tool_choice": "auto"}, {"type": "auto"}),
            ({"tool_choice": "none"}, {"type": "none"}),
            ({"tool_choice": "required"}, {"type": "any"}),
            ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, {"type": "tool", "name": "g"}),
            ({"parallel_tool_calls": False}, {"type": "auto", "disable_parallel_tool_use": True}),
            ({"parallel_tool_calls": True}, None),
            (
                {"tool_choice": "required", "parallel_tool_calls": False},
                {"type": "any", "disable_parallel_tool_use": True},
            ),
            (
                {"tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False},
                {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
            ),
            ({"tool_choice": "none", "parallel_tool_calls": False}, {"type": "none"}),
        ]
        for fields, choice in table:
            out, ignored = translate(tools=tools, **fields)
            self.assertEqual(out["tools"], converted)
            self.assertEqual(out.get("tool_choice"), choice, fields)
            self.assertEqual(ignored, ["tools:strict"])
        with self.assertRaises(RemoteRequestError):
            translate(tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})
        with self.assertRaises(RemoteRequestError):
            translate(tools=tools, tool_choice="any")
        with self.assertRaises(RemoteRequestError):
            translate(tools=tools, tool_choice="required", reasoning_effort="low")
        self.assertEqual(translate(tool_choice="auto")[1], ["tool_choice"])
        self.assertEqual(translate(parallel_tool_calls=False)[1], ["parallel_tool_calls"])

    def test_message_fields_noted(self) -> None:
        _, ignored = translate(
            messages=[
                {"role": "user", "content": "x", "name": "ann"},
                {"role": "assistant", "content": "y", "reasoning_content": "hmm"},
            ]
        )
        self.assertEqual(ignored, ["messages:name", "messages:reasoning_content"])

    def test_body_not_modified(self) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
        snapshot = repr(body)
        out, _ = to_anthropic(body, "c")
        self.assertEqual(repr(body), snapshot)
        self.assertEqual(
            out["messages"],
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        )


MESSAGE: dict[str, Any] = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-x",
    "content": [
        {"type": "thinking", "thinking": "let me see", "signature": "sig"},
        {"type": "redacted_thinking", "data": "xx"},
        {"type": "text", "text": "Calling "},
        {"type": "text", "text": "now."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Zürich"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"input_tokens": 10, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 5, "output_tokens": 7},
}


class ResponseTests(SynchronousTestCase):
    def test_full_message(self) -> None:
        self.assertEqual(
            from_anthropic(MESSAGE, "local-name", 1700000000),
            {
                "id": "chatcmpl-msg_01",
                "object": "chat.completion",
                "created": 1700000000,
                "model": "local-name",
                "choices": [
                    {
                        "index": 0,
                        "logprobs": None,
                        "finish_reason": "tool_calls",
                        "message": {
                            "role": "assistant",
                            "content": "Calling now.",
                            "reasoning_content": "let me see",
                            "tool_calls": [
                                {
                                    "id": "toolu_1",
                                    "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                                }
                            ],
                        },
                    }
                ],
                "usage": {
                    "prompt_tokens": 115,
                    "completion_tokens": 7,
                    "total_tokens": 122,
                    "prompt_tokens_details": {"cached_tokens": 100},
                },
            },
        )

    def test_tool_calls_only_has_null_content(self) -> None:
        message = dict(MESSAGE, content=[MESSAGE["content"][4]])
        self.assertIsNone(from_anthropic(message, "m", 0)["choices"][0]["message"]["content"])
        self.assertEqual(
            from_anthropic(dict(MESSAGE, content=[]), "m", 0)["choices"][0]["message"],
            {"role": "assistant", "content": ""},
        )

    def test_finish_reasons(self) -> None:
        table = {
            "end_turn": "stop",
            "stop_sequence": "stop",
            "max_tokens": "length",
            "tool_use": "tool_calls",
            "refusal": "content_filter",
            "pause_turn": "stop",
            "model_context_window_exceeded": "length",
            None: "stop",
            "something_new": "stop",
        }
        for reason, finish in table.items():
            got = from_anthropic(dict(MESSAGE, stop_reason=reason), "m", 0)["choices"][0]["finish_reason"]
            self.assertEqual(got, finish, reason)

    def test_error_message(self) -> None:
        table = {
            b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}': "Overloaded",
            b'{"error": "plain"}': "plain",
            b'{"message": "top"}': "top",
            b"  Bad Gateway\n": "Bad Gateway",
            b"\xff\xfe": "\ufffd\ufffd",
            b"": "",
        }
        for body, message in table.items():
            self.assertEqual(anthropic_error_message(body), message, body)


# A recorded-style stream: thinking, text, one tool_use whose input arrives
# in split fragments, a second tool_use, cumulative usage in message_delta.
STREAM: list[tuple[str, dict[str, Any]]] = [
    (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_7",
                "type": "message",
                "role": "assistant",
                "model": "claude-x",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 25,
                    "cache_read_input_tokens": 3,
                    "cache_creation_input_tokens": 0,
                    "output_tokens": 1,
                },
            },
        },
    ),
    (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}},
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "EqQB"}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("ping", {"type": "ping"}),
    ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Let me check"}},
    ),
    ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "."}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 1}),
    (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "toolu_A", "name": "get_weather", "input": {}},
        },
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": ""}},
    ),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"city": "San'},
        },
    ),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": ' Francisco"}'},
        },
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 2}),
    (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 3,
            "content_block": {"type": "tool_use", "id": "toolu_B", "name": "get_time", "input": {}},
        },
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 3, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 3}),
    (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 89},
        },
    ),
    ("message_stop", {"type": "message_stop"}),
]


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-msg_7",
        "object": "chat.completion.chunk",
        "created": 42,
        "model": "local-name",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


EXPECTED = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "hm"}),
    chunk({"content": "Let me check"}),
    chunk({"content": "."}),
    chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "toolu_A", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "San'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' Francisco"}'}}]}),
    chunk(
        {
            "tool_calls": [
                {"index": 1, "id": "toolu_B", "type": "function", "function": {"name": "get_time", "arguments": ""}}
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}),
    chunk({}, "tool_calls"),
]

USAGE_CHUNK = {
    "id": "chatcmpl-msg_7",
    "object": "chat.completion.chunk",
    "created": 42,
    "model": "local-name",
    "choices": [],
    "usage": {
        "prompt_tokens": 28,
        "completion_tokens": 89,
        "total_tokens": 117,
        "prompt_tokens_details": {"cached_tokens": 3},
    },
}


def run(stream: AnthropicStream, events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for event, data in events:
        out += stream.feed(event, data)
    return out


class StreamTests(SynchronousTestCase):
    def test_recorded_stream_with_usage(self) -> None:
        self.assertEqual(run(AnthropicStream("local-name", 42, include_usage=True), STREAM), EXPECTED + [USAGE_CHUNK])

    def test_recorded_stream_without_usage(self) -> None:
        stream = AnthropicStream("local-name", 42, include_usage=False)
        self.assertEqual(run(stream, STREAM), EXPECTED)
        self.assertEqual(stream.usage()["total_tokens"], 117)
        self.assertTrue(stream.finished)
        self.assertEqual(stream.feed("message_stop", {"type": "message_stop"}), [])

    def test_stop_reasons(self) -> None:
        for reason, finish in [
            ("end_turn", "stop"),
            ("max_tokens", "length"),
            ("refusal", "content_filter"),
            ("stop_sequence", "stop"),
        ]:
            events = [
                STREAM[0],
                ("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason}, "usage": {}}),
                ("message_stop", {"type": "message_stop"}),
            ]
            self.assertEqual(run(AnthropicStream("local-name", 42, False), events)[-1], chunk({}, finish))

    def test_error_event(self) -> None:
        stream = AnthropicStream("m", 0, False)
        stream.feed(*STREAM[0])
        with self.assertRaises(RemoteStreamError) as caught:
            stream.feed("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
        self.assertEqual((str(caught.exception), caught.exception.kind), ("Overloaded", "overloaded_error"))

    def test_unknown_events_and_deltas(self) -> None:
        stream = AnthropicStream("local-name", 42, False)
        stream.feed(*STREAM[0])
        self.assertEqual(stream.feed("content_block_delta", {"index": 0, "delta": {"type": "citations_delta"}}), [])
        self.assertEqual(stream.feed("something_new", {}), [])
        # a delta for a block that is not a tool_use is not a tool call
        self.assertEqual(
            stream.feed(
                "content_block_delta", {"index": 5, "delta": {"type": "input_json_delta", "partial_json": "{}"}}
            ),
            [],
        )


text = st.text(min_size=1, max_size=20).filter(lambda s: not s.startswith("x-anthropic-billing-header:"))


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    turns = draw(st.integers(min_value=1, max_value=6))
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(text)})
    for i in range(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": draw(text)})
    return messages


class RoundTripTests(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(conversations())
    def test_plain_text_round_trip(self, messages: list[dict[str, Any]]) -> None:
        """
        OpenAI -> Anthropic (here) -> OpenAI (Blazar's /v1/messages
        translator) gives back the same plain-text conversation.
        """
        out, ignored = to_anthropic({"model": "m", "messages": messages}, "c")
        self.assertEqual(ignored, [])
        back, _ = request_to_openai(out)
        self.assertEqual(back["messages"], messages)
        self.assertEqual(back["max_tokens"], DEFAULT_MAX_TOKENS)
