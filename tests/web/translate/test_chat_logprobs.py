"""
Logprobs on streamed chat with tools, on chunks recorded from the pinned
llama-server asked with C{n_probs} (the random test model, the
C{get_weather} tool of L{blazar.testing.forced_tool_call_request}).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.web.translate import chat_logprobs as tr

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chunk(delta: dict, logprobs: object = None, finish: str | None = None) -> dict:
    choice: dict = {"finish_reason": finish, "index": 0, "delta": delta}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {
        "choices": [choice],
        "created": 1,
        "id": "chatcmpl-x",
        "model": "tiny",
        "system_fingerprint": "b0-unknown",
        "object": "chat.completion.chunk",
    }


def entry(token: str, raw: list[int], logprob: float, *top: tuple[str, list[int], float]) -> dict:
    return {
        "id": 1,
        "token": token,
        "bytes": raw,
        "logprob": logprob,
        "top_logprobs": [{"id": 2, "token": t, "bytes": b, "logprob": p} for t, b, p in top],
    }


HELLO = entry(
    " hello",
    [32, 104, 101, 108, 108, 111],
    -1.19,
    ("\x1b", [27], -0.92),
    (" hello", [32, 104, 101, 108, 108, 111], -1.19),
)
# the engine held [245, 173] (an unfinished sequence) and sent it with the next token;
# its parser wrote two U+FFFD for the three bad bytes, its token text three
HELD = entry("\ufffd\ufffd\ufffd\x1b", [245, 173, 193, 27], -2.5, ("?", [63], -1.1))
TOOL_START = entry("<tool_call>", [60, 116, 111, 111, 108, 95, 99, 97, 108, 108, 62], -9.58, ("\ufffd", [255], -1.78))
QUOTE = entry('"', [34], -11.07, ("", [241], -0.37))

LT = entry("<", [60], -2.0)
A = entry("a", [97], -3.0)
# a whole answer with tools, asked with logprobs (not streamed): every
# generated token's logprobs, the tool-call markup's too
ANSWER: dict[str, Any] = {
    "id": "chatcmpl-x",
    "created": 1,
    "model": "tiny",
    "system_fingerprint": "b0-unknown",
    "object": "chat.completion",
    "timings": {"predicted_n": 6},
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": " hello\ufffd\ufffd\x1b<a",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            "logprobs": {"content": [HELLO, HELD, LT, A, TOOL_START, QUOTE]},
        }
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11},
}


class PlanTests(SynchronousTestCase):
    def test_only_what_the_engine_refuses(self) -> None:
        base = {"messages": [], "tools": TOOLS, "stream": True, "logprobs": True}
        self.assertEqual(tr.tool_stream_logprobs({**base, "top_logprobs": 3}), 3)
        self.assertEqual(tr.tool_stream_logprobs(base), 0)
        self.assertIsNone(tr.tool_stream_logprobs({**base, "stream": False}))
        self.assertIsNone(tr.tool_stream_logprobs({**base, "tools": []}))
        self.assertIsNone(tr.tool_stream_logprobs({**base, "logprobs": False}))
        self.assertIsNone(tr.tool_stream_logprobs({k: v for k, v in base.items() if k != "tools"}))

    def test_the_engine_is_asked_for_the_whole_answer(self) -> None:
        body = {
            "messages": [],
            "tools": TOOLS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
        }
        self.assertEqual(tr.whole_body(body), {"messages": [], "tools": TOOLS, "logprobs": True, "top_logprobs": 2})
        self.assertIn("stream", body)  # the client's body is not changed


class StreamTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.chunks = tr.stream_of(ANSWER, 1, include_usage=True)

    def test_every_content_token_keeps_its_logprobs(self) -> None:
        content = [c["choices"][0] for c in self.chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        self.assertEqual("".join(c["delta"]["content"] for c in content), ANSWER["choices"][0]["message"]["content"])
        entries = [e for c in content for e in c["logprobs"]["content"]]
        self.assertEqual([e["token"] for e in entries], [" hello", HELD["token"], "<", "a"])
        self.assertTrue(all(len(e["top_logprobs"]) <= 1 for e in entries))
        self.assertTrue(all(c["logprobs"]["refusal"] is None for c in content))

    def test_replacement_characters_may_differ(self) -> None:
        pieces = tr.content_pieces(" hello\ufffd\ufffd\x1b<a", [HELLO, HELD, LT, A])
        self.assertEqual(pieces[0], (" hello", [HELLO]))
        self.assertEqual(pieces[1], ("\ufffd\ufffd\x1b<a", [HELD, LT, A]))

    def test_the_markup_has_no_logprobs_and_the_rest_is_null(self) -> None:
        shape = [
            (
                list(c["choices"][0]["delta"]) if c["choices"] else "usage",
                c["choices"][0]["logprobs"] is not None if c["choices"] else None,
            )
            for c in self.chunks
        ]
        self.assertEqual(
            shape,
            [
                (["role", "content"], False),
                (["content"], True),
                (["content"], True),
                (["tool_calls"], False),
                ([], False),
                ("usage", None),
            ],
        )
        self.assertEqual(self.chunks[-2]["choices"][0]["finish_reason"], "tool_calls")
        self.assertEqual(self.chunks[-2]["timings"], {"predicted_n": 6})
        self.assertEqual(self.chunks[-1]["usage"]["completion_tokens"], 6)

    def test_every_choice_is_streamed(self) -> None:
        second = {
            **ANSWER["choices"][0],
            "index": 1,
            "finish_reason": "length",
            "message": {"role": "assistant", "content": " hello"},
            "logprobs": {"content": [HELLO]},
        }
        chunks = tr.stream_of({**ANSWER, "choices": [ANSWER["choices"][0], second]}, 2, include_usage=False)
        self.assertEqual(sorted({c["choices"][0]["index"] for c in chunks}), [0, 1])
        ends = [
            (c["choices"][0]["index"], c["choices"][0]["finish_reason"])
            for c in chunks
            if c["choices"][0]["finish_reason"]
        ]
        self.assertEqual(ends, [(0, "tool_calls"), (1, "length")])
        self.assertEqual(
            [
                c["choices"][0]["logprobs"]["content"][0]["token"]
                for c in chunks
                if c["choices"][0]["index"] == 1 and c["choices"][0]["delta"].get("content")
            ],
            [" hello"],
        )

    def test_no_usage_unless_asked_and_done_at_the_end(self) -> None:
        chunks = tr.stream_of(ANSWER, 0, include_usage=False)
        self.assertTrue(all(c["choices"] for c in chunks))
        events = tr.encode(chunks).split(b"\n\n")
        self.assertEqual(events[-2:], [b"data: [DONE]", b""])
        self.assertEqual([json.loads(e[6:]) for e in events[:-2]], chunks)
        self.assertEqual(chunks[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"], [])
