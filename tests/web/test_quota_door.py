"""
The door (L{AuthGate}) with limits that answer later (C{[cluster] redis}:
L{blazar.gateway.redisquota.RedisQuotas}): the request waits for its
lease, then runs; a refusal is the 429, an unreachable counter the 503
C{store_unavailable} naming it; a client that left while the lease was
taken gives it back. The in-memory path (fired Deferreds) is
tests/web/test_files_limits.py's and the surfaces' own tests'.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest
from zope.interface import implementer

from blazar.config import Config, KeyConfig
from blazar.gateway.quota import IQuotas, QuotaExceeded
from blazar.postgres import StoreUnavailable
from blazar.web.auth import AuthGate, KeyHolder
from tests.typed import StubTreq

SECRET = "alice-secret-0123456789"
KEY = KeyConfig("alice", SECRET, max_concurrent=1)


@implementer(IQuotas)
class HeldQuotas:
    """
    An L{IQuotas} whose leases wait until the test settles them
    (C{pending}); it records the leases handed back.
    """

    def __init__(self) -> None:
        self.pending: list[Deferred[object]] = []
        self.given: list[object] = []

    def take_lease(self, key: KeyConfig) -> Deferred[object]:
        d: Deferred[object] = Deferred()
        self.pending.append(d)
        return d

    def give_lease(self, key: KeyConfig, lease: object) -> Deferred[None]:
        self.given.append(lease)
        return succeed(None)

    def check_rates(self, key: KeyConfig) -> Deferred[None]:
        return succeed(None)

    def check_requests(self, key: KeyConfig) -> Deferred[None]:
        return succeed(None)

    def count_tokens(self, key: KeyConfig, tokens: int) -> Deferred[None]:
        return succeed(None)


@implementer(IQuotas)
class DownQuotas(HeldQuotas):
    """
    An L{IQuotas} whose counter cannot be reached, failing at once.
    """

    def take_lease(self, key: KeyConfig) -> Deferred[object]:
        return fail(StoreUnavailable("Redis at 127.0.0.1:1 is unreachable: Connection refused"))


class Inner(Resource):
    isLeaf = True

    def render(self, request: Any) -> bytes:
        return b"ran"


class QuotaDoorTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.quotas = HeldQuotas()
        self.gate = AuthGate(Inner(), KeyHolder(Config(keys=(KEY,))), self.quotas)
        self.client = StubTreq(self.gate)

    def request(self) -> Deferred[Any]:
        return self.client.post(
            "http://x/v1/chat/completions", headers={"authorization": f"Bearer {SECRET}"}, data=b"{}"
        )

    def body(self, d: Deferred[Any]) -> tuple[int, bytes, Any]:
        self.client.flush()
        response = self.successResultOf(d)
        return response.code, self.successResultOf(response.content()), response.headers

    def test_waits_for_its_lease(self) -> None:
        d = self.request()
        self.assertNoResult(d)
        self.quotas.pending[0].callback("lease-1")
        code, body, _ = self.body(d)
        self.assertEqual((code, body), (200, b"ran"))
        self.assertEqual(self.quotas.given, ["lease-1"])  # handed back once the answer was sent

    def test_refused(self) -> None:
        d = self.request()
        self.quotas.pending[0].errback(QuotaExceeded("key 'alice' already has 1 request(s) running", 1.0))
        code, body, headers = self.body(d)
        self.assertEqual(code, 429)
        self.assertIn("already has 1 request", json.loads(body)["error"]["message"])
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
        self.assertEqual(self.quotas.given, [])

    def test_counter_unreachable_later(self) -> None:
        d = self.request()
        self.quotas.pending[0].errback(StoreUnavailable("Redis at 127.0.0.1:1 is unreachable: Connection refused"))
        code, body, _ = self.body(d)
        self.assertEqual(code, 503)
        error = json.loads(body)["error"]
        self.assertEqual(error["code"], "store_unavailable")
        self.assertIn("Redis at 127.0.0.1:1 is unreachable", error["message"])

    def test_counter_unreachable_at_once(self) -> None:
        client = StubTreq(AuthGate(Inner(), KeyHolder(Config(keys=(KEY,))), DownQuotas()))
        code, body, _ = self.body(
            client.post("http://x/v1/chat/completions", headers={"authorization": f"Bearer {SECRET}"}, data=b"{}")
        )
        self.assertEqual(code, 503)
        self.assertIn("Redis at 127.0.0.1:1 is unreachable", json.loads(body)["error"]["message"])

    def test_client_left_while_waiting(self) -> None:
        request: Any = DummyRequest([b"v1", b"chat", b"completions"])
        request.method = b"POST"
        request.path = b"/v1/chat/completions"
        request.requestHeaders.setRawHeaders(b"authorization", [f"Bearer {SECRET}".encode()])
        self.assertIs(self.gate.render(request), NOT_DONE_YET)
        request._disconnected = True  # (the client went away)
        self.quotas.pending[0].callback("lease-2")
        self.assertEqual(self.quotas.given, ["lease-2"])
        self.assertEqual(request.written, [])
