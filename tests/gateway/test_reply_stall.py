"""
The sentinel's C{stalled} finding on a stream (L{Reply.relay},
L{Reply.chunks}): flagged once no chunk came for C{sentinel_stall_secs},
counted from the last chunk, though a chunk only notes its time (no
delayed call is moved per chunk); the stream goes on.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone

from blazar.gateway.context import RequestContext
from blazar.gateway.engine_proxy import EngineProxy
from blazar.gateway.reply import Reply


def _event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    chunk = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "model": "m",
        "object": "chat.completion.chunk",
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class _Body:
    headers = None
    protocol: Any = None

    def deliverBody(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(SimpleNamespace(pauseProducing=id, resumeProducing=id, stopProducing=id))


class StallTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.body = _Body()
        self.context = RequestContext(started=0.0)
        instance = SimpleNamespace(entry=SimpleNamespace(name="m"), protocol=None, lane="llamacpp")
        self.reply = Reply(
            EngineProxy(cast(Any, None), cast(Any, None), self.clock),
            self.context,
            cast(Any, SimpleNamespace(instance=instance)),
            self.body,
            None,
            0.0,
            0.0,
            watched={"messages": [{"role": "user", "content": "hi"}]},
            clock=self.clock,
            stall=30.0,
        )

    def stream(self, chunks: bool, gaps: list[float]) -> tuple[Deferred[None], list[Any]]:
        got: list[Any] = []
        done = ensureDeferred(self.reply.chunks(got.append) if chunks else self.reply.relay(got.append))
        for gap in gaps:
            self.clock.advance(gap)
            self.body.protocol.dataReceived(_event({"content": "hi"}))
        self.body.protocol.dataReceived(_event({}, "stop") + b"data: [DONE]\n\n")
        self.body.protocol.connectionLost(Failure(ResponseDone()))
        return done, got

    def test_steady_chunks_are_no_stall(self) -> None:
        for chunks in (False, True):
            with self.subTest(chunks=chunks):
                self.setUp()
                done, got = self.stream(chunks, [20.0] * 10)
                self.successResultOf(done)
                self.assertEqual(self.context.sentinel, ())
                self.assertTrue(got)

    def test_silent_for_the_bound_after_a_chunk_is_a_stall(self) -> None:
        for chunks in (False, True):
            with self.subTest(chunks=chunks):
                self.setUp()
                done, got = self.stream(chunks, [20.0, 20.0, 30.0, 1.0])
                self.successResultOf(done)  # the stream goes on
                self.assertEqual(self.context.sentinel, ("stalled",))

    def test_just_short_of_the_bound_is_no_stall(self) -> None:
        done, _ = self.stream(False, [29.0, 29.9, 29.9])
        self.successResultOf(done)
        self.assertEqual(self.context.sentinel, ())

    def test_a_chunk_moves_no_timer(self) -> None:
        ensureDeferred(self.reply.relay(lambda data: None))
        calls = {id(c): c.getTime() for c in self.clock.getDelayedCalls()}
        for _ in range(5):
            self.clock.advance(1)
            self.body.protocol.dataReceived(_event({"content": "hi"}))
        self.assertEqual({id(c): c.getTime() for c in self.clock.getDelayedCalls()}, calls)
        self.body.protocol.connectionLost(Failure(ResponseDone()))
        self.assertEqual(self.clock.getDelayedCalls(), [])  # the timers end with the stream


class TimingsTests(SynchronousTestCase):
    """
    L{Reply}'s C{timed}: llama-server's C{timings} of an answer reach it
    once, from a non-streamed answer, a relayed stream or parsed chunks,
    with the answer's text (C{speculative = "auto"}'s tuner reads
    C{predicted_per_second}; the lookup cache counts the text).
    """

    def make(self) -> tuple[Reply, _Body, list[tuple[dict[str, Any], str]]]:
        body = _Body()
        got: list[tuple[dict[str, Any], str]] = []
        instance = SimpleNamespace(entry=SimpleNamespace(name="m"), protocol=None, lane="llamacpp")
        reply = Reply(
            EngineProxy(cast(Any, None), cast(Any, None), Clock()),
            RequestContext(started=0.0),
            cast(Any, SimpleNamespace(instance=instance)),
            body,
            None,
            0.0,
            0.0,
            timed=lambda timings, text: got.append((timings, text)),
        )
        return reply, body, got

    def last(self) -> bytes:
        chunk = {
            "choices": [{"finish_reason": "stop", "index": 0, "delta": {}}],
            "timings": {"predicted_n": 40, "predicted_per_second": 71.5},
        }
        return b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"

    def test_streams(self) -> None:
        for chunks in (False, True):
            with self.subTest(chunks=chunks):
                reply, body, got = self.make()
                done = ensureDeferred(reply.chunks(lambda c: None) if chunks else reply.relay(lambda d: None))
                body.protocol.dataReceived(_event({"content": "hi"}))
                event = _event({"content": " there"})
                body.protocol.dataReceived(event[:9])  # (an event cut between pieces)
                body.protocol.dataReceived(event[9:])
                last = self.last()
                body.protocol.dataReceived(last[:40])
                body.protocol.dataReceived(last[40:])
                body.protocol.dataReceived(self.last())  # (once only)
                body.protocol.connectionLost(Failure(ResponseDone()))
                self.successResultOf(done)
                self.assertEqual(got, [({"predicted_n": 40, "predicted_per_second": 71.5}, "hi there")])

    def test_an_event_too_long_for_the_notes_still_reaches_the_client(self) -> None:
        from blazar.engines.sse import MAX_EVENT_BYTES

        reply, body, got = self.make()
        seen: list[bytes] = []
        done = ensureDeferred(reply.relay(seen.append))
        huge = b"data: " + b"x" * (MAX_EVENT_BYTES + 10)  # no event end yet
        body.protocol.dataReceived(huge)
        body.protocol.dataReceived(b"\n\n" + self.last())
        body.protocol.connectionLost(Failure(ResponseDone()))
        self.successResultOf(done)
        self.assertEqual(b"".join(seen), huge + b"\n\n" + self.last())
        self.assertEqual(got, [])  # unnoted

    def test_whole_answer(self) -> None:
        reply, body, got = self.make()
        done = ensureDeferred(reply.read())
        body.protocol.dataReceived(
            b'{"choices":[{"index":0,"message":{"role":"assistant","content":"def f():"}}],'
            b'"timings":{"predicted_n":40,"predicted_per_second":9.5}}'
        )
        body.protocol.connectionLost(Failure(ResponseDone()))
        self.successResultOf(done)
        self.assertEqual(got, [({"predicted_n": 40, "predicted_per_second": 9.5}, "def f():")])
