"""
Sessions stay where their KV is (L{blazar.web.sessionroute}, issue 42):
the forward decision from the index's rows, and the forward itself on
two in-memory sites (L{StubTreq}): this node, B, in front of a real
L{AuthGate} with counting quotas, and the holder, A, a resource that
records what it got.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import Protocol
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer

from blazar.config import Config, KeyConfig
from blazar.gateway.quota import IQuotas
from blazar.gateway.sessions import Sessions
from blazar.testing import FakeInstance, FakeSlotBank, FakeSupervisor, fake_engine_app
from blazar.web.auth import AuthGate, KeyHolder
from blazar.web.sessionroute import FORWARDED_BY, SERVED_BY, Route, SessionRoute, route_of
from tests.typed import StubTreq
from tests.web.gateway import MemoryGateway

SECRET = "alice-secret-0123456789"
KEY = KeyConfig("alice", SECRET)
CHAT = b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}]}'


class RouteTests(SynchronousTestCase):
    def test_no_row_or_this_nodes_row_is_served_here(self) -> None:
        self.assertEqual(route_of([], "m", "b", "http://b:2"), Route())
        self.assertEqual(route_of([("m", "b", "http://b:2", 1.0)], "m", "b", "http://b:2"), Route())
        self.assertEqual(route_of([("m", "", "", 1.0)], "m", "b", "http://b:2"), Route())

    def test_another_nodes_row_is_forwarded_to_its_url(self) -> None:
        self.assertEqual(route_of([("m", "a", "http://a:1/", 1.0)], "m", "b", "http://b:2"), Route("a", "http://a:1"))

    def test_the_row_of_the_model_asked_for_else_the_most_recent(self) -> None:
        rows = [("n", "c", "http://c:3", 9.0), ("m", "a", "http://a:1", 5.0)]
        self.assertEqual(route_of(rows, "m", "b", ""), Route("a", "http://a:1"))
        self.assertEqual(route_of(rows, "alias", "b", ""), Route("c", "http://c:3"))

    def test_a_holder_without_an_address_is_taken_over(self) -> None:
        route = route_of([("m", "a", "", 1.0)], "m", "b", "http://b:2")
        self.assertEqual((route.node, route.url), ("a", ""))
        self.assertIn("[cluster] url", route.why)
        route = route_of([("m", "a", "http://b:2", 1.0)], "m", "b", "http://b:2")
        self.assertEqual((route.node, route.url), ("a", ""))
        self.assertIn("own address", route.why)


@implementer(IQuotas)
class CountingQuotas:
    """
    An L{IQuotas} that counts what the door and the pipeline would ask.
    """

    def __init__(self) -> None:
        self.leases = 0

    def take_lease(self, key: KeyConfig) -> Deferred[object]:
        self.leases += 1
        return succeed(object())

    def give_lease(self, key: KeyConfig, lease: object) -> Deferred[None]:
        return succeed(None)

    def check_rates(self, key: KeyConfig) -> Deferred[None]:
        return succeed(None)

    def check_requests(self, key: KeyConfig) -> Deferred[None]:
        return succeed(None)

    def count_tokens(self, key: KeyConfig, tokens: int) -> Deferred[None]:
        return succeed(None)


class Recorder(Resource):
    """
    A node's surfaces: answers C{answer} (chunked, as a stream is) and
    records each request's path, headers and body.
    """

    isLeaf = True

    def __init__(self, name: str, answer: bytes = b"data: one\n\ndata: two\n\n") -> None:
        super().__init__()
        self.name = name
        self.answer = answer
        self.got: list[tuple[bytes, Headers, bytes]] = []

    def render(self, request: Any) -> Any:
        self.got.append((request.uri, request.requestHeaders, request.content.read()))
        request.setResponseCode(201)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"x-node", self.name.encode())
        request.write(self.answer)
        request.finish()
        return NOT_DONE_YET


class StubClient:
    """
    The engine client's C{request} onto another in-memory site.
    """

    def __init__(self, site: StubTreq | None = None, error: Exception | None = None) -> None:
        self.site, self.error = site, error
        self.sent: list[tuple[str, str, dict[bytes, list[bytes]]]] = []

    async def request(
        self, method: str, url: str, body: bytes | None, headers: dict[bytes, list[bytes]], stream: bool = True
    ) -> Any:
        self.sent.append((method, url, headers))
        if self.error is not None:
            raise self.error
        assert self.site is not None
        return await self.site.request(method, url, data=body, headers=Headers(headers), unbuffered=True)


class CutResponse:
    """
    An answer whose body stops after its first event: the holder died.
    """

    code, phrase = 200, b"OK"
    headers = Headers({b"content-type": [b"text/event-stream"]})

    def deliverBody(self, protocol: Protocol) -> None:
        protocol.makeConnection(None)
        protocol.dataReceived(b"data: one\n\n")
        protocol.connectionLost(Failure(ResponseFailed([Failure(ConnectionRefusedError())])))


class CutClient(StubClient):
    async def request(self, *args: Any, **kwargs: Any) -> Any:
        return CutResponse()


class ForwardTests(SynchronousTestCase):
    def setUp(self) -> None:
        # node A, the holder: its own gate and surfaces
        self.a_quotas, self.a_surfaces = CountingQuotas(), Recorder("a")
        a_gate = AuthGate(self.a_surfaces, KeyHolder(Config(keys=(KEY,))), self.a_quotas)
        self.a = SessionRoute(a_gate, a_gate.authenticate, self.holders, StubClient(), "a", "http://a:1", lambda: True)
        # node B, where the client's request arrives
        self.b_quotas, self.b_surfaces = CountingQuotas(), Recorder("b")
        self.b_gate = AuthGate(self.b_surfaces, KeyHolder(Config(keys=(KEY,))), self.b_quotas)
        self.rows: list[tuple[str, str, str, float]] = [("smol", "a", "http://a:1", 5.0)]
        self.asked: list[tuple[str, str]] = []
        self.taken: list[tuple[str, str]] = []
        self.to_a = StubClient(StubTreq(self.a))
        self.enabled = True
        self.logged: list[dict[str, Any]] = []
        observer = cast(ILogObserver, self.logged.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def holders(self, key: str, name: str) -> Deferred[list[tuple[str, str, str, float]]]:
        self.asked.append((key, name))
        return succeed(self.rows)

    def b(self, client: Any = None) -> StubTreq:
        route = SessionRoute(
            self.b_gate,
            self.b_gate.authenticate,
            self.holders,
            client or self.to_a,
            "b",
            "http://b:2",
            lambda: self.enabled,
            lambda key, name: self.taken.append((key, name)),
        )
        return StubTreq(route)

    def post(
        self,
        site: StubTreq,
        headers: dict[str, str] | None = None,
        body: bytes = CHAT,
        path: str = "/v1/chat/completions",
    ) -> tuple[int, Headers, bytes]:
        sent = {"authorization": f"Bearer {SECRET}", **(headers or {})}
        d = site.post(f"http://b:2{path}?x=1", data=body, headers=sent)
        site.flush()
        response = self.successResultOf(d)
        return response.code, response.headers, self.successResultOf(response.content())

    def test_a_session_another_node_holds_is_served_there(self) -> None:
        code, headers, body = self.post(self.b(), {"x-blazar-session": "chat-1"})
        self.assertEqual((code, body), (201, b"data: one\n\ndata: two\n\n"))
        self.assertEqual(headers.getRawHeaders(b"x-node"), [b"a"])
        self.assertEqual(headers.getRawHeaders(SERVED_BY), [b"a"])
        self.assertEqual(self.asked, [("alice", "chat-1")])
        # the client's request as sent: its path and query, its key, its body; and who forwarded it
        [(uri, got, content)] = self.a_surfaces.got
        self.assertEqual((uri, content), (b"/v1/chat/completions?x=1", CHAT))
        self.assertEqual(got.getRawHeaders(b"authorization"), [f"Bearer {SECRET}".encode()])
        self.assertEqual(got.getRawHeaders(b"x-blazar-session"), [b"chat-1"])
        self.assertEqual(got.getRawHeaders(FORWARDED_BY), [b"b"])
        self.assertEqual(self.b_surfaces.got, [])
        # counted where it ran: A's door took its lease, B's none
        self.assertEqual((self.a_quotas.leases, self.b_quotas.leases), (1, 0))
        self.assertEqual(self.to_a.sent[0][:2], ("POST", "http://a:1/v1/chat/completions?x=1"))

    def test_the_holder_never_forwards_again(self) -> None:
        self.rows = [("smol", "b", "http://b:2", 5.0)]  # (what A would read: B holds it)
        code, _, _ = self.post(StubTreq(self.a), {"x-blazar-session": "chat-1", "x-blazar-forwarded-by": "b"})
        self.assertEqual(code, 201)
        self.assertEqual((self.asked, len(self.a_surfaces.got)), ([], 1))

    def test_the_session_named_in_the_body_or_by_an_agent(self) -> None:
        body = json.dumps({"model": "smol", "input": "hi", "prompt_cache_key": "pck"}).encode()
        self.post(self.b(), body=body, path="/v1/responses")
        user = json.dumps({"session_id": "cc-1"})
        body = json.dumps({"model": "smol", "messages": [], "metadata": {"user_id": user}}).encode()
        self.post(self.b(), body=body, path="/v1/messages")
        self.post(self.b(), {"x-session-id": "gie-1"})
        self.assertEqual([name for _, name in self.asked], ["pck", "cc-1", "gie-1"])
        self.assertEqual(len(self.a_surfaces.got), 3)

    def test_served_here_when_held_here_unnamed_or_off(self) -> None:
        self.rows = [("smol", "b", "http://b:2", 5.0)]
        self.post(self.b(), {"x-blazar-session": "mine"})
        self.rows = []
        self.post(self.b(), {"x-blazar-session": "new"})
        self.post(self.b())  # no session
        self.enabled = False
        self.rows = [("smol", "a", "http://a:1", 5.0)]
        self.post(self.b(), {"x-blazar-session": "chat-1"})
        self.assertEqual((len(self.b_surfaces.got), self.a_surfaces.got), (4, []))
        self.assertEqual(self.asked, [("alice", "mine"), ("alice", "new")])
        self.assertEqual(self.b_quotas.leases, 4)
        self.assertEqual(self.taken, [])

    def test_an_unreachable_holder_costs_the_kv_not_the_request(self) -> None:
        code, headers, body = self.post(
            self.b(StubClient(error=ConnectionRefusedError())), {"x-blazar-session": "chat-1"}
        )
        self.assertEqual((code, body, headers.getRawHeaders(b"x-node")), (201, b"data: one\n\ndata: two\n\n", [b"b"]))
        self.assertEqual(self.taken, [("alice", "chat-1")])  # B's pin claims it in the index
        self.assertEqual(self.b_quotas.leases, 1)  # (served here: counted here)

    def test_a_holder_without_an_address_is_taken_over(self) -> None:
        self.rows = [("smol", "a", "", 5.0)]
        code, _, _ = self.post(self.b(), {"x-blazar-session": "chat-1"})
        self.assertEqual((code, len(self.b_surfaces.got), self.taken), (201, 1, [("alice", "chat-1")]))

    def test_a_wrong_key_is_refused_here(self) -> None:
        code, _, _ = self.post(self.b(), {"x-blazar-session": "chat-1", "authorization": "Bearer nope-0123456789"})
        self.assertEqual(code, 401)
        self.assertEqual((self.asked, self.a_surfaces.got), ([], []))

    def test_a_holder_that_dies_mid_answer_ends_the_clients_stream_with_an_error(self) -> None:
        site = self.b(CutClient())
        d = site.post(
            "http://b:2/v1/chat/completions",
            data=CHAT,
            headers={"authorization": f"Bearer {SECRET}", "x-blazar-session": "chat-1"},
        )
        site.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        got: list[bytes] = []

        class Collect(Protocol):
            def dataReceived(self, data: bytes) -> None:
                got.append(data)

            def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
                got.append(b"END:" + type(reason.value).__name__.encode())

        response.deliverBody(Collect())
        site.flush()
        self.assertEqual(got[0], b"data: one\n\n")
        self.assertEqual(got[-1], b"END:ResponseFailed")  # never a clean end
        [event] = [e for e in self.logged if "before its end" in e.get("log_format", "")]
        self.assertEqual((event["node"], event["error"]), ("a", "ConnectionRefusedError"))


class ListingTests(SynchronousTestCase):
    """
    C{GET /api/session} names each session's node: this node's own, and,
    with C{[cluster] database}, the others' from the index.
    """

    def test_the_listing_shows_each_sessions_node(self) -> None:
        gateway = MemoryGateway(self, FakeSupervisor(["m:latest"]), fake_engine_app("m:latest"))
        sessions = Sessions(
            gateway.reactor,
            FakeSlotBank(),
            lambda: Path(self.mktemp()),
            lambda: (900.0, 2.0, 1 << 20, 1 << 30),
            lambda f, *args: succeed(f(*args)),
            node="b",
        )
        gateway.pipeline.sessions = sessions
        pin = self.successResultOf(Deferred.fromCoroutine(sessions.pin("", "mine", FakeInstance("m:latest"))))
        assert pin is not None
        sessions.release(pin, 10)

        def listed() -> list[tuple[str, str]]:
            d = gateway.client.get("http://localhost/api/session")
            gateway.client.flush()
            response = self.successResultOf(d)
            body = json.loads(self.successResultOf(response.content()))
            return [(s["session"], s["node"]) for s in body["sessions"]]

        self.assertEqual(listed(), [("mine", "b")])
        rows = [("", "mine", "m:latest", "b", 3.0), ("", "theirs", "m:latest", "a", 2.0)]
        sessions.index = lambda key: succeed([r for r in rows if r[0] == key])
        self.assertEqual(listed(), [("mine", "b"), ("theirs", "a")])
