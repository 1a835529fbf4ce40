"""
A streamed request that waits for its model to load gets its headers at
once and an SSE C{: loading} comment every L{LOADING_PING} seconds until
the child answers (README, "Cold starts"), on the OpenAI surface and on
the Responses API alike: a client with a read timeout does not give up on
a long load. On a clock, through the real surfaces in memory.
"""

from __future__ import annotations

import json
from typing import Any

from treq import collect
from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from blazar.testing import FakeInstance, FakeSupervisor, fake_engine_app
from blazar.web.sse import LOADING, LOADING_PING
from tests.web.gateway import MemoryGateway

HELLO = [{"role": "user", "content": "hi"}]
STREAMS: list[tuple[str, dict[str, Any], bytes]] = [
    ("/v1/chat/completions", {"model": "m", "messages": HELLO, "stream": True}, b"data: [DONE]"),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}, b"event: response.completed"),
]


class SlowLoad(FakeSupervisor):
    """
    A supervisor whose load takes until C{loaded_now} fires.
    """

    loaded_now: Deferred[None] | None = None

    async def instance_for(self, name: str, ctx_size: int | None = None) -> FakeInstance:
        await (self.loaded_now or succeed(None))
        return await super().instance_for(name, ctx_size)


class LoadingCommentTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.supervisor = SlowLoad(["m:latest"])
        self.gateway = MemoryGateway(self, self.supervisor, fake_engine_app("m:latest"))

    def pump(self) -> None:
        for _ in range(20):
            self.gateway.client.flush()
            self.gateway.engine.flush()

    def test_comments_while_the_model_loads_and_none_after(self) -> None:
        for path, body, end in STREAMS:
            self.supervisor.table.clear()  # cold again
            self.supervisor.loaded_now = Deferred()
            d = self.gateway.client.request("POST", "http://localhost" + path, data=json.dumps(body).encode())
            self.pump()
            response = self.successResultOf(d)  # the headers are out before the load ends
            self.assertEqual(response.code, 200, path)
            received: list[bytes] = []
            done = collect(response, received.append)
            self.pump()
            self.assertEqual(b"".join(received).count(LOADING), 1, path)
            for _ in range(3):
                self.gateway.reactor.advance(LOADING_PING)
                self.pump()
            self.assertEqual(b"".join(received).count(LOADING), 4, path)
            self.supervisor.loaded_now.callback(None)
            self.pump()
            self.successResultOf(done)
            self.gateway.reactor.advance(10 * LOADING_PING)
            data = b"".join(received)
            self.assertEqual(data.count(LOADING), 4, path)  # none once the child answered
            self.assertIn(end, data, path)
