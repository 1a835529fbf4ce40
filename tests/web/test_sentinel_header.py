"""
C{x-blazar-sentinel} through the real surfaces: the sentinel's verdict is
data on the reply (L{blazar.gateway.reply.Reply.verdict}) that the surface
writes before its body (L{blazar.web.client.judged}), on an answer not yet
written; a stream that is under way gets none.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.testing import FakeSupervisor
from tests.gateway.test_cache_step import cache_engine
from tests.web.gateway import MemoryGateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "cut short"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "cut short"}]}


class SentinelHeaderTests(SynchronousTestCase):
    def gateway(self, config: str = "") -> MemoryGateway:
        self.app = cache_engine()
        self.app.finish = "length"  # every answer is cut at max_tokens: the sentinel says "truncated"
        return MemoryGateway(self, FakeSupervisor(["m:latest"]), self.app, config=config)

    def sentinel(self, gateway: MemoryGateway, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        status, headers, data = gateway.post(path, body)
        return status, headers.getRawHeaders(b"x-blazar-sentinel")

    def test_a_whole_answer_names_the_verdict(self) -> None:
        gateway = self.gateway()
        self.assertEqual(self.sentinel(gateway, "/v1/chat/completions", CHAT), (200, [b"truncated"]))
        self.assertEqual(gateway.context().sentinel, ("truncated",))

    def test_an_answer_read_from_a_stream_names_it_too(self) -> None:
        # Anthropic's whole answer is made from the engine's stream (Reply.chunks)
        self.assertEqual(self.sentinel(self.gateway(), "/v1/messages", MESSAGES), (200, [b"truncated"]))

    def test_a_stream_under_way_is_counted_not_named(self) -> None:
        gateway = self.gateway()
        self.assertEqual(self.sentinel(gateway, "/v1/chat/completions", {**CHAT, "stream": True}), (200, None))
        self.assertEqual(gateway.context().sentinel, ("truncated",))

    def test_an_enforced_refusal_goes_out_with_it(self) -> None:
        gateway = self.gateway("sentinel_enforce = true\n")
        self.assertEqual(self.sentinel(gateway, "/v1/chat/completions", CHAT), (422, [b"truncated"]))
        self.assertEqual(self.sentinel(gateway, "/v1/messages", MESSAGES), (422, [b"truncated"]))
