"""
The engine client's failure classes: which failed requests the child
cannot have taken (L{NotDelivered}), and a connection (the Agent path's,
for remotes) that checks its peer before and right after a request is
written.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, fail
from twisted.internet.error import (
    ConnectionAborted,
    ConnectionDone,
    ConnectionLost,
    ConnectionRefusedError,
    TCPTimedOutError,
)
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web._newclient import (
    Request,
    RequestNotSent,
    RequestTransmissionFailed,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers

from blazar.engines.client import (
    EngineClient,
    NotDelivered,
    RequestNotRead,
    StaleConnection,
    _CheckedClientProtocol,
    never_delivered,
    peer_closed,
)


def lost(*reasons: BaseException) -> list[Failure]:
    return [Failure(r) for r in reasons]


class NeverDeliveredTests(SynchronousTestCase):
    def test_what_proves_the_child_never_took_the_request(self) -> None:
        proofs = [
            ConnectionRefusedError(),
            TCPTimedOutError(),
            RequestNotSent(),
            RequestNotRead(),
            RequestTransmissionFailed(lost(ConnectionDone())),
            ResponseNeverReceived(lost(ConnectionLost())),  # reset before any answer
        ]
        for error in proofs:
            self.assertTrue(never_delivered(error), error)

    def test_what_does_not(self) -> None:
        others = [
            ResponseNeverReceived(lost(ConnectionDone())),  # it may have read it, then died
            ResponseNeverReceived(lost(ConnectionAborted())),  # closed here, not by the child
            ResponseNeverReceived(lost(CancelledError())),
            RequestTransmissionFailed(lost(ConnectionAborted())),
            ResponseFailed(lost(ConnectionLost())),  # the answer had begun
            ValueError("x"),
        ]
        for error in others:
            self.assertFalse(never_delivered(error), error)


class FakeHandle:
    """
    A socket as C{peer_closed} sees it: C{state} is C{"open"}, C{"eof"},
    C{"reset"} or C{"data"}.
    """

    def __init__(self, state: str = "open") -> None:
        self.state = state
        self.peeks: list[int] = []

    def recv(self, size: int, flags: int) -> bytes:
        self.peeks.append(flags)
        if self.state == "open":
            raise BlockingIOError()
        if self.state == "reset":
            raise ConnectionResetError()
        return b"" if self.state == "eof" else b"H"


class HandleTransport(StringTransport):
    """
    A transport with a socket handle, and a C{doWrite} that counts flushes;
    C{close_on_write} closes the peer as the request goes out.
    """

    def __init__(self, handle: FakeHandle, close_on_write: bool = False) -> None:
        super().__init__()
        self.handle = handle
        self.close_on_write = close_on_write
        self.flushes = 0

    def getHandle(self) -> FakeHandle:
        return self.handle

    def doWrite(self) -> None:
        self.flushes += 1
        if self.close_on_write:
            self.handle.state = "eof"


class PeerClosedTests(SynchronousTestCase):
    def test_states(self) -> None:
        for state, closed in [("open", False), ("eof", True), ("reset", True), ("data", True)]:
            handle = FakeHandle(state)
            self.assertEqual(peer_closed(HandleTransport(handle)), closed, state)
            self.assertEqual(handle.peeks, [socket.MSG_PEEK | socket.MSG_DONTWAIT])

    def test_no_socket_is_not_closed(self) -> None:
        self.assertFalse(peer_closed(StringTransport()))


def post() -> Request:
    return Request(b"POST", b"/v1/chat/completions", Headers({b"host": [b"127.0.0.1"]}), None, persistent=True)


class CheckedProtocolTests(SynchronousTestCase):
    def connect(self, transport: StringTransport) -> _CheckedClientProtocol:
        protocol = _CheckedClientProtocol(lambda p: None)
        protocol.makeConnection(transport)
        return protocol

    def test_a_closed_connection_takes_no_request(self) -> None:
        transport = HandleTransport(FakeHandle("eof"))
        d = self.connect(transport).request(post())
        self.failureResultOf(d, RequestNotSent)
        self.assertEqual(transport.value(), b"")
        self.assertTrue(transport.disconnecting)

    def test_the_request_is_sent_at_once(self) -> None:
        transport = HandleTransport(FakeHandle("open"))
        self.connect(transport).request(post())
        self.assertTrue(transport.value().startswith(b"POST /v1/chat/completions"))
        self.assertEqual(transport.flushes, 1)
        self.assertEqual(len(transport.handle.peeks), 2)  # before and after

    def test_closed_as_it_was_sent_the_child_did_not_read_it(self) -> None:
        transport = HandleTransport(FakeHandle("open"), close_on_write=True)
        protocol = self.connect(transport)
        d = protocol.request(post())
        protocol.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(d, RequestNotRead)

    def test_closed_later_without_an_answer_may_have_been_read(self) -> None:
        transport = HandleTransport(FakeHandle("open"))
        protocol = self.connect(transport)
        d = protocol.request(post())
        transport.handle.state = "eof"  # the child read it, then died
        protocol.connectionLost(Failure(ConnectionDone()))
        f = self.failureResultOf(d, ResponseNeverReceived)
        self.assertFalse(never_delivered(f.value))

    def test_an_answer_after_all_is_an_answer(self) -> None:
        transport = HandleTransport(FakeHandle("open"), close_on_write=True)
        protocol = self.connect(transport)
        d = protocol.request(post())
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(self.successResultOf(d).code, 200)


class FakeAgent:
    """
    An Agent whose requests fail with C{error}, after C{takes} seconds on
    C{clock}.
    """

    def __init__(self, clock: MemoryReactorClock, error: BaseException, takes: float = 0.0) -> None:
        self.clock, self.error, self.takes = clock, error, takes

    def request(self, *args: Any) -> Deferred[Any]:
        self.clock.advance(self.takes)
        return fail(self.error)


class RequestFailureTests(SynchronousTestCase):
    """
    The Agent path (a remote's URL: a host name); the lean path to children
    keeps the same classes (tests/engines/test_wire.py, EngineClientWireTests).
    """

    def outcome(self, error: BaseException, stream: bool, takes: float = 0.0) -> Failure:
        reactor = MemoryReactorClock()
        client = EngineClient(reactor)
        agent = FakeAgent(reactor, error, takes)
        client._fresh = client._kept = agent
        d = ensureDeferred(client.request("POST", "http://engine.example:1/x", b"{}", {}, stream))
        return self.failureResultOf(d)

    def test_never_delivered_on_any_connection(self) -> None:
        for stream in (True, False):
            for error in (
                ConnectionRefusedError(),
                ResponseNeverReceived(lost(ConnectionLost())),
                RequestNotSent(),
                RequestNotRead(),
            ):
                value = self.outcome(error, stream).value
                assert isinstance(value, NotDelivered), (error, stream)
                self.assertIs(value.error, error)

    def test_a_clean_close_at_once_on_a_kept_connection_is_stale(self) -> None:
        clean = ResponseNeverReceived(lost(ConnectionDone()))
        f = self.outcome(clean, stream=False)
        self.assertIsInstance(f.value, StaleConnection)
        # later, or on a connection of its own: the child may have read it
        self.assertIs(self.outcome(clean, stream=False, takes=1.0).value, clean)
        self.assertIs(self.outcome(clean, stream=True).value, clean)

    def test_a_cancellation_stays_one(self) -> None:
        cancelled = ResponseNeverReceived(lost(CancelledError()))
        self.assertIs(self.outcome(cancelled, stream=False).value, cancelled)


class PeerClosedOnARealSocketTests(SynchronousTestCase):
    """
    What L{peer_closed} claims of the kernel, on a real loopback socket
    pair (no reactor): quiet and open is not closed; a close, a reset or
    stray bytes are.
    """

    def pair(self) -> tuple[Any, Any]:
        import socket

        a, b = socket.socketpair()
        self.addCleanup(a.close)
        self.addCleanup(b.close)
        return a, b

    def transport(self, sock: Any) -> Any:
        return type("T", (), {"getHandle": lambda self: sock})()

    def test_open_and_quiet(self) -> None:
        ours, _theirs = self.pair()
        self.assertFalse(peer_closed(self.transport(ours)))

    def test_closed_by_the_peer(self) -> None:
        ours, theirs = self.pair()
        theirs.close()
        self.assertTrue(peer_closed(self.transport(ours)))

    def test_stray_bytes(self) -> None:
        ours, theirs = self.pair()
        theirs.sendall(b"x")
        self.assertTrue(peer_closed(self.transport(ours)))
