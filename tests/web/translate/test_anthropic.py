"""
Table tests of the Anthropic translator on recorded llama-server streams.
"""

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.sse import SSEEvents
from blazar.web.translate import anthropic as tr


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    c: dict = {
        "created": 1,
        "id": "chatcmpl-x",
        "model": "m:latest",
        "object": "chat.completion.chunk",
        "choices": []
        if delta is None and finish is None
        else [{"index": 0, "finish_reason": finish, "delta": delta or {}}],
    }
    if usage:
        c["usage"] = usage
    return c


def sse(*chunks: dict) -> bytes:
    return (
        b"".join(
            b"data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for c in chunks
        )
        + b"data: [DONE]\n\n"
    )


USAGE = chunk(usage={"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18})

TEXT = sse(
    chunk({"role": "assistant", "content": None}),  # empty first chunk, role only
    chunk({"content": "h€llo"}),
    chunk({"content": " wörld 😀"}),
    chunk(finish="stop"),
    USAGE,  # usage-only final chunk
)

TOOLS = sse(
    chunk({"content": None}),  # empty first chunk, no role
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"ci'},
                }
            ]
        }
    ),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz":'},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "function": {"arguments": '"UTC"}'}}]}),
    chunk(finish="tool_calls"),
    USAGE,
)


def run(stream: bytes, splits: list[int] = [], stops: list[str] | None = None) -> tuple[list[dict], tr.AnthropicStream]:
    t = tr.AnthropicStream("msg_1", "m", stops or [])
    events = list(t.start())

    def on_event(data: bytes) -> None:
        if data != b"[DONE]" and not t.stopped:
            events.extend(t.feed(json.loads(data)))

    parser = SSEEvents(on_event)
    cuts = [0, *sorted(splits), len(stream)]
    for a, b in zip(cuts, cuts[1:]):
        parser.feed(stream[a:b])
    events.extend(t.finish())
    return [payload for _, payload in events], t


def check_order(events: list[dict]) -> None:
    types = [e["type"] for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    assert types.count("message_start") == 1 and types.count("message_delta") == 1
    expected = 0
    open_index = None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == expected
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index, expected = None, expected + 1
    assert open_index is None


class StreamTests(SynchronousTestCase):
    def test_text(self) -> None:
        events, t = run(TEXT)
        check_order(events)
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        self.assertEqual(text, "h€llo wörld 😀")
        delta = events[-2]
        self.assertEqual(delta["delta"], {"stop_reason": "end_turn", "stop_sequence": None})
        self.assertEqual(
            delta["usage"],
            {"input_tokens": 12, "output_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        )
        message = t.message()
        self.assertEqual(message["content"], [{"type": "text", "text": "h€llo wörld 😀"}])
        self.assertEqual(message["stop_reason"], "end_turn")

    def test_multibyte_split_at_every_byte(self) -> None:
        whole, _ = run(TEXT)
        for cut in range(1, len(TEXT)):
            events, _ = run(TEXT, [cut])
            self.assertEqual(events, whole, cut)

    def test_interleaved_tool_fragments(self) -> None:
        for splits in ([], [100], [37, 250, 400]):
            events, t = run(TOOLS, splits)
            check_order(events)
            starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
            self.assertEqual(
                [(b["type"], b["id"], b["name"], b["input"]) for b in starts],
                [("tool_use", "call_a", "get_weather", {}), ("tool_use", "call_b", "get_time", {})],
            )
            for index, expected in [(0, {"city": "Paris"}), (1, {"tz": "UTC"})]:
                partial = "".join(
                    e["delta"]["partial_json"]
                    for e in events
                    if e["type"] == "content_block_delta" and e["index"] == index
                )
                self.assertEqual(json.loads(partial), expected)
            self.assertEqual(events[-2]["delta"]["stop_reason"], "tool_use")
            self.assertEqual([b["input"] for b in t.message()["content"]], [{"city": "Paris"}, {"tz": "UTC"}])

    def test_stop_sequence_matched_across_chunks(self) -> None:
        stream = sse(chunk({"content": "one ST"}), chunk({"content": "OP two"}), chunk(finish="length"), USAGE)
        events, t = run(stream, stops=["STOP"])
        self.assertTrue(t.stopped)
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        self.assertEqual(text, "one ")
        self.assertEqual(events[-2]["delta"], {"stop_reason": "stop_sequence", "stop_sequence": "STOP"})

    def test_partial_stop_prefix_is_released(self) -> None:
        stream = sse(chunk({"content": "a ST"}), chunk({"content": "AY"}), chunk(finish="stop"), USAGE)
        events, t = run(stream, stops=["STOP"])
        text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        self.assertEqual(text, "a STAY")
        self.assertEqual(events[-2]["delta"]["stop_reason"], "end_turn")

    def test_max_tokens_and_thinking(self) -> None:
        stream = sse(chunk({"reasoning_content": "hmm"}), chunk({"content": "ok"}), chunk(finish="length"), USAGE)
        events, t = run(stream)
        check_order(events)
        self.assertEqual([b["type"] for b in t.message()["content"]], ["thinking", "text"])
        self.assertEqual(events[-2]["delta"]["stop_reason"], "max_tokens")


class RequestTests(SynchronousTestCase):
    def test_full_request(self) -> None:
        body = {
            "model": "m",
            "max_tokens": 50,
            "stop_sequences": ["END"],
            "temperature": 0.2,
            "top_k": 3,
            "system": [
                {"type": "text", "text": "be", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "brief"},
            ],
            "metadata": {"user_id": "u"},
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "f"},
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "42"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
        out, stops = tr.request_to_openai(body)
        self.assertEqual(stops, ["END"])
        self.assertNotIn("stop", out)  # matched by the gateway
        self.assertEqual(out["max_tokens"], 50)
        self.assertEqual(out["messages"][0], {"role": "system", "content": "be\n\nbrief"})
        self.assertEqual(out["messages"][1]["content"][1]["image_url"]["url"], "data:image/png;base64,AAA")
        self.assertEqual(out["messages"][2]["tool_calls"][0]["function"], {"name": "f", "arguments": '{"x": 1}'})
        self.assertEqual(out["messages"][3], {"role": "tool", "tool_call_id": "t1", "content": "Error: 42"})
        self.assertEqual(out["messages"][4], {"role": "user", "content": "thanks"})
        self.assertEqual(out["tool_choice"], "required")  # with only the named tool offered
        self.assertEqual([t["function"]["name"] for t in out["tools"]], ["f"])
        self.assertEqual(out["tools"][0]["function"]["parameters"], {"type": "object"})

    def test_system_string_equals_blocks(self) -> None:
        a, _ = tr.request_to_openai(
            {"model": "m", "max_tokens": 1, "system": "x", "messages": [{"role": "user", "content": "q"}]}
        )
        b, _ = tr.request_to_openai(
            {
                "model": "m",
                "max_tokens": 1,
                "system": [{"type": "text", "text": "x"}],
                "messages": [{"role": "user", "content": "q"}],
            }
        )
        self.assertEqual(a, b)

    def test_tool_choice_kinds(self) -> None:
        self.assertEqual(tr.tool_choice_to_openai({"type": "any"}), ("required", None))
        self.assertEqual(tr.tool_choice_to_openai({"type": "auto", "disable_parallel_tool_use": True}), ("auto", False))
        self.assertEqual(tr.tool_choice_to_openai({"type": "none"}), ("none", None))

    def test_errors_name_the_field(self) -> None:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"model": "m", "messages": [{"role": "user", "content": "q"}]}, "max_tokens"),
            ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "q"}]}, "max_tokens"),
            ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
            ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "q"}]}, "messages.0.role"),
            ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "q"}]}, "messages"),
            (
                {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
                "messages.0.content",
            ),
            (
                {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
                "messages.0.content.0.type",
            ),
            (
                {
                    "model": "m",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "q"}],
                    "thinking": {"type": "enabled"},
                },
                "thinking.budget_tokens",
            ),
            (
                {
                    "model": "m",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "q"}],
                    "thinking": {"type": "sometimes"},
                },
                "thinking.type",
            ),
            (
                {
                    "model": "m",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "q"}],
                    "output_config": {"effort": "extreme"},
                },
                "output_config.effort",
            ),
            ({"max_tokens": 5, "messages": [{"role": "user", "content": "q"}]}, "model"),
            (
                {
                    "model": "m",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "q"}],
                    "tool_choice": {"type": "tool"},
                },
                "tool_choice.name",
            ),
        ]
        for body, field in cases:
            with self.assertRaises(tr.AnthropicRequestError, msg=field) as cm:
                tr.request_to_openai(body)
            self.assertTrue(str(cm.exception).startswith(field), str(cm.exception))

    def test_eager_input_streaming_is_named(self) -> None:
        """
        C{eager_input_streaming}, which a TypeScript SDK sets on each tool,
        is accepted and named once as C{tools.eager_input_streaming}
        (nested fields are C{parent.child}); the tool itself is offered.
        """
        tool = {"name": "f", "input_schema": {"type": "object"}}
        ignored: list[str] = []
        out, _ = tr.request_to_openai(
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "q"}],
                "tools": [
                    {**tool, "eager_input_streaming": True},
                    {**tool, "name": "g", "eager_input_streaming": False},
                ],
            },
            ignored=ignored,
        )
        self.assertEqual(set(ignored), {"tools.eager_input_streaming"})
        self.assertEqual(
            [t["function"] for t in out["tools"]],
            [
                {"name": "f", "description": "", "parameters": {"type": "object"}},
                {"name": "g", "description": "", "parameters": {"type": "object"}},
            ],
        )
        ignored = []
        tr.request_to_openai(
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "q"}], "tools": [tool]},
            ignored=ignored,
        )
        self.assertEqual(ignored, [])

    def test_sse_event_line_matches_type(self) -> None:
        raw = tr.sse_event("ping", {"type": "ping"})
        self.assertEqual(raw, b'event: ping\ndata: {"type":"ping"}\n\n')


class ReasoningAndSystemTests(SynchronousTestCase):
    BASE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]}

    def test_thinking_maps_to_the_engine_switches(self) -> None:
        enabled, _ = tr.request_to_openai({**self.BASE, "thinking": {"type": "enabled", "budget_tokens": 1024}})
        self.assertEqual(
            (enabled["chat_template_kwargs"], enabled["thinking_budget_tokens"]), ({"enable_thinking": True}, 1024)
        )
        adaptive, _ = tr.request_to_openai({**self.BASE, "thinking": {"type": "adaptive"}})
        self.assertEqual(adaptive["chat_template_kwargs"], {"enable_thinking": True})
        self.assertNotIn("thinking_budget_tokens", adaptive)
        disabled, _ = tr.request_to_openai(
            {**self.BASE, "thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}
        )
        self.assertEqual(disabled["chat_template_kwargs"], {"enable_thinking": False})
        self.assertNotIn("reasoning_effort", disabled)  # no thinking: no effort to set

    def test_output_config(self) -> None:
        out, _ = tr.request_to_openai(
            {
                **self.BASE,
                "output_config": {"effort": "max", "format": {"type": "json_schema", "schema": {"type": "object"}}},
            }
        )
        self.assertEqual(out["reasoning_effort"], "high")
        self.assertEqual(
            out["response_format"],
            {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}},
        )

    def test_system_messages_stay_in_place_and_server_blocks_are_named(self) -> None:
        ignored: list[str] = []
        out, _ = tr.request_to_openai(
            {
                **self.BASE,
                "system": "top",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}],
                    },
                    {"role": "system", "content": [{"type": "text", "text": "mid"}]},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}},
                            {"type": "text", "text": "a"},
                        ],
                    },
                    {"role": "user", "content": "again"},
                ],
            },
            ignored=ignored,
        )
        self.assertEqual(
            [(m["role"], m["content"]) for m in out["messages"]],
            [("system", "top"), ("user", "q"), ("system", "mid"), ("assistant", "a"), ("user", "again")],
        )
        self.assertEqual(ignored, ["cache_control", "content:server_tool_use"])


class CacheUsageTests(SynchronousTestCase):
    def test_cached_prompt_tokens_are_cache_reads(self) -> None:
        """
        Anthropic's C{input_tokens} excludes what was read from the cache
        (C{cache_read_input_tokens}); the two add up to the prompt.
        """
        translator = tr.AnthropicStream("msg_1", "m")
        translator.feed(chunk({"content": "hi"}))
        translator.feed(chunk(finish="stop"))
        translator.feed(
            chunk(
                usage={
                    "prompt_tokens": 100,
                    "completion_tokens": 2,
                    "total_tokens": 102,
                    "prompt_tokens_details": {"cached_tokens": 90},
                }
            )
        )
        translator.finish()
        self.assertEqual(
            translator.message()["usage"],
            {
                "input_tokens": 10,
                "output_tokens": 2,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 90,
            },
        )
        self.assertEqual(translator.total_tokens(), 102)  # Blazar's own count: the whole prompt
