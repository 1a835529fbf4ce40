"""
Logprobs on streamed chat with tools, on chunks recorded from the pinned
llama-server asked with C{n_probs} (the random test model, the
C{get_weather} tool of L{blazar.testing.forced_tool_call_request}).
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from blazar.web.sse import SSERewriter
from blazar.web.translate import chat_logprobs as tr

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chunk(delta: dict, logprobs: object = None, finish: str | None = None) -> dict:
    choice: dict = {"finish_reason": finish, "index": 0, "delta": delta}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"choices": [choice], "created": 1, "id": "chatcmpl-x", "model": "tiny",
            "system_fingerprint": "b0-unknown", "object": "chat.completion.chunk"}


def entry(token: str, raw: list[int], logprob: float, *top: tuple[str, list[int], float]) -> dict:
    return {"id": 1, "token": token, "bytes": raw, "logprob": logprob,
            "top_logprobs": [{"id": 2, "token": t, "bytes": b, "logprob": p} for t, b, p in top]}


HELLO = entry(" hello", [32, 104, 101, 108, 108, 111], -1.19, ("\x1b", [27], -0.92), (" hello", [32, 104, 101, 108, 108, 111], -1.19))
# the engine held [245, 173] (an unfinished sequence) and sent it with the next token;
# its parser wrote two U+FFFD for the three bad bytes, its token text three
HELD = entry("\ufffd\ufffd\ufffd\x1b", [245, 173, 193, 27], -2.5, ("?", [63], -1.1))
TOOL_START = entry("<tool_call>", [60, 116, 111, 111, 108, 95, 99, 97, 108, 108, 62], -9.58, ("\ufffd", [255], -1.78))
QUOTE = entry('"', [34], -11.07, ("", [241], -0.37))

STREAM = [
    chunk({"role": "assistant", "content": None}),
    chunk({"content": " hello"}, {"content": [HELLO]}),
    chunk({"content": "\ufffd\ufffd\x1b"}, {"content": [HELD]}),
    # text released by the parser: "<" was held (its logprobs never sent), then "a"
    chunk({"content": "<a"}, {"content": [entry("a", [97], -3.0)]}),
    chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                           "function": {"name": "get_weather", "arguments": "{"}}]},
          {"content": [TOOL_START]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]}, {"content": [QUOTE]}),
    chunk({}, finish="tool_calls"),
]


class PlanTests(SynchronousTestCase):
    def test_only_what_the_engine_refuses(self) -> None:
        base = {"messages": [], "tools": TOOLS, "stream": True, "logprobs": True}
        self.assertEqual(tr.tool_stream_logprobs({**base, "top_logprobs": 3}), 3)
        self.assertEqual(tr.tool_stream_logprobs(base), 0)
        self.assertIsNone(tr.tool_stream_logprobs({**base, "stream": False}))
        self.assertIsNone(tr.tool_stream_logprobs({**base, "tools": []}))
        self.assertIsNone(tr.tool_stream_logprobs({**base, "logprobs": False}))
        self.assertIsNone(tr.tool_stream_logprobs({k: v for k, v in base.items() if k != "tools"}))

    def test_engine_body(self) -> None:
        body = {"messages": [], "tools": TOOLS, "stream": True, "logprobs": True, "top_logprobs": 0}
        self.assertEqual(tr.engine_body(body, 0), {"messages": [], "tools": TOOLS, "stream": True, "n_probs": 1})
        self.assertIn("logprobs", body)  # the client's body is not changed


class ChunkTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fix = tr.ToolStreamLogprobs(1)
        self.out = [self.fix.chunk(c)["choices"][0]["logprobs"] for c in STREAM]

    def test_content_chunks_keep_their_tokens(self) -> None:
        self.assertEqual(self.out[1], {"content": [{**HELLO, "top_logprobs": HELLO["top_logprobs"][:1]}],
                                       "refusal": None})

    def test_replacement_characters_may_differ(self) -> None:
        self.assertEqual(self.out[2]["content"][0]["bytes"], [245, 173, 193, 27])

    def test_content_whose_tokens_were_lost_is_null(self) -> None:
        self.assertIsNone(self.out[3])
        self.assertEqual((self.fix.filled, self.fix.unfilled), (2, 1))

    def test_role_tool_call_and_finish_chunks_are_null(self) -> None:
        self.assertEqual([self.out[i] for i in (0, 4, 5, 6)], [None] * 4)
        for c in STREAM:
            self.assertIn("logprobs", self.fix.chunk(c)["choices"][0])

    def test_top_zero(self) -> None:
        out = tr.ToolStreamLogprobs(0).chunk(STREAM[1])["choices"][0]["logprobs"]
        self.assertEqual(out["content"][0]["top_logprobs"], [])

    def test_through_the_rewriter(self) -> None:
        raw = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in STREAM) + b"data: [DONE]\n\n"
        out: list[bytes] = []
        rewriter = SSERewriter(out.append, tr.ToolStreamLogprobs(2).event)
        for i in range(0, len(raw), 7):
            rewriter.feed(raw[i:i + 7])
        rewriter.finish()
        events = b"".join(out).split(b"\n\n")
        self.assertEqual(events[-2:], [b"data: [DONE]", b""])
        chunks = [json.loads(e[6:]) for e in events[:-2]]
        self.assertEqual([c["choices"][0]["delta"] for c in chunks], [c["choices"][0]["delta"] for c in STREAM])
        self.assertEqual([c["choices"][0]["logprobs"] is not None for c in chunks],
                         [False, True, True, False, False, False, False])
