"""
An api = "anthropic" remote's answer on the way back
(L{blazar.gateway.translated.FromAnthropic}): a Messages answer read whole becomes
an OpenAI chat completion; its stream, however the reads split it,
becomes OpenAI chunks (the byte relay's SSE ends with [DONE] after the
usage chunk); an error event or a body that is no message is the
remote's fault (502).
"""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.lease import InstanceLease
from blazar.gateway.engine_proxy import EngineProxy
from blazar.gateway.errors import EngineRejected
from blazar.gateway.remotewire import AnthropicStream
from blazar.gateway.reply import Reply
from blazar.gateway.translated import FromAnthropic, Renamed, scrubber
from tests.gateway.test_remotewire import STREAM


def reply(include_usage: bool = True) -> FromAnthropic:
    # the translation steps read only the translator: the rest of a Reply is a lease's
    return FromAnthropic(AnthropicStream("claude:m", 7, include_usage), scrubber(None))


def sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


class AnthropicReplyTests(SynchronousTestCase):
    def test_a_message_read_whole(self) -> None:
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "stop_reason": "max_tokens",
            "content": [{"type": "text", "text": "hello"}],
            "usage": {"input_tokens": 3, "output_tokens": 2},
        }
        out = json.loads(reply().whole(json.dumps(message).encode()))
        self.assertEqual(out["object"], "chat.completion")
        self.assertEqual(out["model"], "claude:m")
        self.assertEqual(out["choices"][0]["message"]["content"], "hello")
        self.assertEqual(out["choices"][0]["finish_reason"], "length")
        self.assertEqual(out["usage"]["completion_tokens"], 2)
        with self.assertRaises(EngineRejected) as caught:
            reply().whole(b"[1]")
        self.assertEqual(caught.exception.status, 502)

    def test_a_stream_split_anywhere(self) -> None:
        data = sse(STREAM)
        whole: list[bytes] = []
        feed = reply().sse(whole.append)
        feed(data)
        for step in (1, 7, 64):
            parts: list[bytes] = []
            feed = reply().sse(parts.append)
            for i in range(0, len(data), step):
                feed(data[i : i + step])
            self.assertEqual(b"".join(parts), b"".join(whole), step)
        events = b"".join(whole).split(b"\n\n")[:-1]
        self.assertEqual(events[-1], b"data: [DONE]")
        chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
        self.assertEqual(chunks[0]["choices"][0]["delta"]["role"], "assistant")
        self.assertEqual(
            "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), "Let me check."
        )
        calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
        self.assertEqual([t["function"]["name"] for t in calls if "id" in t], ["get_weather", "get_time"])
        self.assertEqual([c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1], "tool_calls")
        self.assertEqual(chunks[-1]["choices"], [])
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 89)

    def test_without_usage_the_finish_chunk_ends_it(self) -> None:
        out: list[bytes] = []
        reply(include_usage=False).sse(out.append)(sse(STREAM))
        events = b"".join(out).split(b"\n\n")[:-1]
        self.assertEqual(events[-1], b"data: [DONE]")
        self.assertNotIn(b'"usage"', events[-2])

    def test_an_error_event(self) -> None:
        chunks: list[Any] = []
        feed = reply().events(chunks.append)
        with self.assertRaises(EngineRejected) as caught:
            feed(sse([("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})]))
        self.assertEqual(caught.exception.status, 502)
        self.assertIn("overloaded_error", str(caught.exception))


class JSONAnswerToAStreamTests(SynchronousTestCase):
    """
    A remote that answers a stream request with one JSON answer
    (C{application/json}, issue 36: the client got an empty 200): the
    answer becomes the stream (L{Reply._remote_json}); JSON that is no
    answer is a 502 naming the remote.
    """

    def reply(self, body: bytes, kind: bytes = b"application/json", anthropic: bool = False) -> Reply:
        from pathlib import Path

        from twisted.internet.defer import succeed
        from twisted.web.http_headers import Headers

        from blazar.config import RemoteConfig
        from blazar.engines.remote import RemoteInstance
        from blazar.models.registry import ModelEntry

        class Proxy:
            def read(self, instance: Any, response: Any) -> Any:
                return succeed(body)

        class Lease:
            instance = RemoteInstance(
                ModelEntry("peer:m", Path("peer"), format="remote", remote="peer"),
                RemoteConfig("peer", "http://127.0.0.1:9/v1"),
            )

        class Response:
            headers = Headers({b"content-type": [kind]})

        scrub = scrubber(Lease.instance)
        translated = (
            FromAnthropic(AnthropicStream("peer:m", 7, True), scrub)
            if anthropic
            else Renamed("peer:m", Lease.instance.server, scrub)
        )
        return Reply(
            cast(EngineProxy, Proxy()),
            None,
            cast(InstanceLease, Lease()),
            Response(),
            None,
            0.0,
            0.0,
            translated=translated,
            wants_usage=True,
        )

    def events(self, made: Reply) -> list[Any]:
        from twisted.internet.defer import ensureDeferred

        self.successResultOf(ensureDeferred(made._remote_json()))
        assert made.made is not None
        events = made.made.split(b"\n\n")[:-1]
        self.assertEqual(events[-1], b"data: [DONE]")
        return [json.loads(e[len(b"data: ") :]) for e in events[:-1]]

    def test_a_chat_completion(self) -> None:
        answer = {
            "id": "c1",
            "object": "chat.completion",
            "created": 5,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": "hi",
                        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
        chunks = self.events(self.reply(json.dumps(answer).encode()))
        self.assertEqual({c["model"] for c in chunks}, {"peer:m"})
        self.assertEqual({c["object"] for c in chunks}, {"chat.completion.chunk"})
        self.assertEqual(chunks[0]["choices"][0]["delta"], {"role": "assistant", "content": "hi"})
        self.assertEqual(chunks[1]["choices"][0]["delta"]["tool_calls"][0]["index"], 0)
        self.assertEqual(chunks[2]["choices"][0]["finish_reason"], "tool_calls")
        self.assertEqual((chunks[3]["choices"], chunks[3]["usage"]["total_tokens"]), ([], 5))

    def test_a_text_completion(self) -> None:
        answer = {
            "id": "c2",
            "object": "text_completion",
            "model": "m",
            "choices": [{"index": 0, "text": "once", "finish_reason": "length"}],
        }
        chunks = self.events(self.reply(json.dumps(answer).encode()))
        self.assertEqual([c["choices"][0]["text"] for c in chunks], ["once", ""])
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "length")

    def test_an_anthropic_message(self) -> None:
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "stop_reason": "end_turn",
            "content": [{"type": "text", "text": "hello"}],
            "usage": {"input_tokens": 3, "output_tokens": 2},
        }
        chunks = self.events(self.reply(json.dumps(message).encode(), anthropic=True))
        self.assertEqual(chunks[0]["choices"][0]["delta"]["content"], "hello")
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 2)

    def test_no_answer_is_a_502_naming_the_remote(self) -> None:
        from twisted.internet.defer import ensureDeferred

        failure = self.failureResultOf(ensureDeferred(self.reply(b'{"status": "ok"}')._remote_json()), EngineRejected)
        self.assertEqual(failure.value.status, 502)
        self.assertIn("remote 'peer' answered a stream request with JSON", str(failure.value))

    def test_a_stream_is_left_to_the_relay(self) -> None:
        from twisted.internet.defer import ensureDeferred

        made = self.reply(b"data: {}\n\n", kind=b"text/event-stream")
        self.successResultOf(ensureDeferred(made._remote_json()))
        self.assertIsNone(made.made)
