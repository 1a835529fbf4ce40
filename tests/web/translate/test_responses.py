"""
The Responses translator: requests to chat bodies (and their errors), and
recorded child streams to Responses events and the final response.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.web.translate import responses as tr


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    c: dict[str, Any] = {"choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        c["usage"] = usage
    return c


USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 4}}


def run(
    chunks: list[dict[str, Any]], body: dict[str, Any] | None = None
) -> tuple[tr.ResponsesStream, list[dict[str, Any]]]:
    stream = tr.ResponsesStream(tr.response_object(body or {"model": "m"}, "m", 1, None))
    events = stream.start()
    for c in chunks:
        events += stream.feed(c)
    events += stream.finish()
    return stream, [payload for _, payload in events]


class RequestTests(SynchronousTestCase):
    def test_string_input_and_instructions(self) -> None:
        chat = tr.request_to_chat({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 5})
        self.assertEqual(
            chat["messages"], [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        )
        self.assertEqual(
            (chat["max_tokens"], chat["stream"], chat["stream_options"]), (5, True, {"include_usage": True})
        )

    def test_items_function_calls_and_outputs(self) -> None:
        chat = tr.request_to_chat(
            {
                "model": "m",
                "input": [
                    {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                    {"type": "message", "role": "user", "content": "weather?"},
                    {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "get", "arguments": '{"a":1}'},
                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                    {"type": "reasoning", "id": "rs_1", "summary": []},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                ],
            }
        )
        roles = [m["role"] for m in chat["messages"]]
        self.assertEqual(roles, ["developer", "user", "assistant", "tool", "assistant"])
        self.assertEqual([c["id"] for c in chat["messages"][2]["tool_calls"]], ["c1", "c2"])
        self.assertEqual(chat["messages"][3], {"role": "tool", "tool_call_id": "c1", "content": "sunny"})

    def test_image_part(self) -> None:
        chat = tr.request_to_chat(
            {
                "model": "m",
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "what is this"},
                            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                        ],
                    }
                ],
            }
        )
        self.assertEqual(
            chat["messages"][0]["content"][1], {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        )

    def test_tools_choice_and_formats(self) -> None:
        chat = tr.request_to_chat(
            {
                "model": "m",
                "input": "x",
                "tools": [
                    {
                        "type": "function",
                        "name": "f",
                        "description": "d",
                        "parameters": {"type": "object"},
                        "strict": True,
                    }
                ],
                "tool_choice": {"type": "function", "name": "f"},
                "parallel_tool_calls": False,
                "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
            }
        )
        self.assertEqual(
            chat["tools"][0]["function"],
            {"name": "f", "parameters": {"type": "object"}, "description": "d", "strict": True},
        )
        # llama-server has no named choice: only that tool, and a call required
        self.assertEqual((chat["tool_choice"], [t["function"]["name"] for t in chat["tools"]]), ("required", ["f"]))
        self.assertEqual(
            chat["response_format"]["json_schema"], {"name": "s", "schema": {"type": "object"}, "strict": True}
        )
        self.assertFalse(chat["parallel_tool_calls"])
        chat = tr.request_to_chat({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}})
        self.assertEqual(chat["response_format"], {"type": "json_object"})

    def test_errors_name_the_field(self) -> None:
        cases: list[tuple[dict[str, Any], str]] = [
            (
                {
                    "model": "m",
                    "input": [{"role": "user", "content": "a"}, {"type": "message", "role": "robot", "content": "b"}],
                },
                "input[1]",
            ),
            ({"model": "m", "input": [{"foo": "bar"}]}, "input[0]"),
            ({"model": "m", "input": "x", "tools": [{"name": "f"}]}, "tools[0]"),
            ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
            ({"model": "m", "input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
            ({"model": "m", "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning"),
            ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice"),
            ({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "ghost"}}, "tool_choice"),
            ({"model": "m", "input": "x", "background": True}, "background"),
            ({"model": "m", "input": 5}, "input"),
            ({"input": "x"}, "model"),
            ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
            (
                {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
                "input[0].content[0]",
            ),
            ({"model": "m", "input": [{"type": "message", "role": ["user"], "content": "x"}]}, "input[0]"),
            ({"model": "m", "input": "x", "metadata": {"k": "v" * 600}}, "metadata"),
            ({"model": "m", "input": "x", "metadata": [[[]]]}, "metadata"),
            ({"model": "m", "input": "x", "store": "no"}, "store"),
            ({"model": "m", "input": "x", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
            ({"model": "m", "input": "x", "previous_response_id": ""}, "previous_response_id"),
            ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice"),
            ({"model": "m", "input": "x", "reasoning": "high"}, "reasoning"),
            ({"model": "m", "input": "x", "logit_bias": "x"}, "logit_bias"),
        ]
        for body, param in cases:
            with self.assertRaises(tr.ResponsesRequestError) as caught:
                tr.request_to_chat(body)
            self.assertEqual(caught.exception.param, param, body)
            self.assertIn(param.split("[")[0], str(caught.exception))

    def test_history_comes_first(self) -> None:
        history = [{"type": "message", "role": "user", "content": "one"}] + tr.output_as_input(
            [
                {"type": "message", "content": [{"type": "output_text", "text": "two"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            ]
        )
        chat = tr.request_to_chat({"model": "m", "input": "three", "instructions": "sys"}, history)
        self.assertEqual(
            [(m["role"], m.get("content")) for m in chat["messages"]],
            [("system", "sys"), ("user", "one"), ("assistant", "two"), ("assistant", None), ("user", "three")],
        )


class StreamTests(SynchronousTestCase):
    def test_text_answer_events_and_final_response(self) -> None:
        stream, events = run(
            [
                chunk({"role": "assistant", "content": None}),
                chunk({"content": "Hel"}),
                chunk({"content": "lo ✓"}),
                chunk({}, "stop"),
                chunk(None, usage=USAGE),
            ]
        )
        types = [e["type"] for e in events]
        self.assertEqual(
            types,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ],
        )
        self.assertEqual([e["sequence_number"] for e in events], list(range(len(events))))
        final = events[-1]["response"]
        self.assertEqual(final["status"], "completed")
        self.assertEqual(final["output"][0]["content"][0]["text"], "Hello ✓")
        self.assertEqual(
            stream.output_text, "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        )
        self.assertEqual(
            final["usage"],
            {
                "input_tokens": 12,
                "input_tokens_details": {"cached_tokens": 4},
                "output_tokens": 3,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 15,
            },
        )
        self.assertEqual(events[0]["response"]["output"], [])
        json.dumps(events)  # all of it serializable

    def test_tool_call_fragments_over_chunks(self) -> None:
        _, events = run(
            [
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get", "arguments": ""},
                            }
                        ]
                    }
                ),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Oslo"}'}}]}),
                chunk({"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "time", "arguments": "{}"}}]}),
                chunk({}, "tool_calls"),
                chunk(None, usage=USAGE),
            ]
        )
        final = events[-1]["response"]
        calls = final["output"]
        self.assertEqual(
            [(c["type"], c["call_id"], c["name"]) for c in calls],
            [("function_call", "call_1", "get"), ("function_call", "call_2", "time")],
        )
        self.assertEqual(json.loads(calls[0]["arguments"]), {"city": "Oslo"})
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
        self.assertEqual(deltas, ['{"ci', 'ty":"Oslo"}', "{}"])
        done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        self.assertEqual([d["arguments"] for d in done], [calls[0]["arguments"], "{}"])
        self.assertEqual(final["status"], "completed")

    def test_length_is_incomplete(self) -> None:
        _, events = run([chunk({"content": "abc"}), chunk({}, "length"), chunk(None, usage=USAGE)])
        self.assertEqual(events[-1]["type"], "response.incomplete")
        self.assertEqual(events[-1]["response"]["incomplete_details"], {"reason": "max_output_tokens"})
        self.assertEqual(events[-1]["response"]["output"][0]["status"], "incomplete")

    def test_reasoning_then_text(self) -> None:
        _, events = run(
            [
                chunk({"reasoning_content": "think"}),
                chunk({"reasoning_content": "ing"}),
                chunk({"content": "answer"}),
                chunk({}, "stop"),
            ]
        )
        output = events[-1]["response"]["output"]
        self.assertEqual([o["type"] for o in output], ["reasoning", "message"])
        self.assertEqual(output[0]["content"][0]["text"], "thinking")
        self.assertIn("response.reasoning_text.delta", [e["type"] for e in events])

    def test_usage_only_final_chunk_and_no_text(self) -> None:
        _, events = run([chunk({}, "stop"), chunk(None, usage=USAGE)])
        self.assertEqual(events[-1]["response"]["output"], [])
        self.assertEqual(events[-1]["response"]["usage"]["input_tokens"], 12)

    def test_failure_is_one_terminal_event(self) -> None:
        stream = tr.ResponsesStream(tr.response_object({"model": "m"}, "m", 1, None))
        events = stream.start() + stream.feed(chunk({"content": "x"})) + stream.fail("engine died")
        self.assertEqual(events[-1][0], "response.failed")
        self.assertEqual(events[-1][1]["response"]["error"]["message"], "engine died")
        self.assertEqual(
            sum(1 for k, _ in events if k in ("response.completed", "response.failed", "response.incomplete")), 1
        )

    def test_lone_surrogates_are_escaped_not_fatal(self) -> None:
        data = tr.dump({"user": "\ud800"})
        self.assertEqual(json.loads(data), {"user": "\ud800"})
        self.assertIn(b"event: x", tr.sse("x", {"metadata": {"k": "\udfff"}}))

    def test_sse_event_line_equals_type(self) -> None:
        data = tr.sse("response.created", {"type": "response.created", "sequence_number": 0})
        self.assertTrue(data.startswith(b"event: response.created\ndata: {"))
