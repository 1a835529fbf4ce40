"""
The lean engine client's protocol (L{blazar.engines.wire}): answers split
anywhere, chunked (extensions, trailers), pipelined, truncated and
oversized; what the body's reader gets and controls; the pool (kept
connections, the spare for the next stream); and L{EngineClient}'s
failures on that path. No sockets: C{StringTransport}, C{MemoryReactorClock}.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.error import ConnectingCancelledError, ConnectionDone, ConnectionLost, ConnectionRefusedError
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web._newclient import RequestNotSent, ResponseFailed, ResponseNeverReceived
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse

from blazar.engines.client import EngineClient, NotDelivered, StaleConnection, never_delivered
from blazar.engines.wire import (
    MAX_HEAD_BYTES,
    EngineConnection,
    RequestHeads,
    RequestNotRead,
    ResponseHeadTooLarge,
    WirePool,
    WireResponse,
)
from blazar.httpbody import BodyTooLarge, read_body
from tests.engines.test_client import FakeHandle, HandleTransport

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:1\r\nContent-Length: 2\r\n\r\n{}"


class Collect(Protocol):
    """
    A body's reader: what it got, and how it ended.
    """

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.reason: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.parts.append(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:
        self.reason = reason

    @property
    def body(self) -> bytes:
        return b"".join(self.parts)


class Connected:
    """
    An L{EngineConnection} on a C{StringTransport}, with what it released
    to its pool and whether it told the pool it was lost.
    """

    def __init__(self, transport: StringTransport | None = None) -> None:
        self.released: list[EngineConnection] = []
        self.lost: list[EngineConnection] = []
        self.connection = EngineConnection(self.released.append, self.lost.append)
        self.transport = transport or StringTransport()
        self.connection.makeConnection(self.transport)

    def send(self, keep: bool = True) -> Deferred[WireResponse]:
        return self.connection.request(REQUEST, keep)

    def feed(self, *pieces: bytes) -> None:
        for piece in pieces:
            self.connection.dataReceived(piece)

    def close(self, reason: BaseException | None = None) -> None:
        self.connection.connectionLost(Failure(reason or ConnectionDone()))


@st.composite
def answers(draw: Any) -> tuple[bytes, bytes, bool, int]:
    """
    A whole answer, its body, whether it is chunked, and where its head
    ends: a C{Content-Length} body or a chunked one (chunk extensions,
    maybe a trailer).
    """
    body = draw(st.binary(max_size=200))
    chunked = draw(st.booleans())
    headers = [b"Content-Type: text/event-stream", b"X-Note: " + draw(st.sampled_from([b"", b"a b", b"x" * 90]))]
    if chunked:
        cuts = sorted(set(draw(st.lists(st.integers(0, len(body)), max_size=6))))
        bounds = [0, *cuts, len(body)]
        pieces = [body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
        extension = draw(st.sampled_from([b"", b";name=value", b';q="a b"']))
        trailer = draw(st.sampled_from([b"", b"X-Trailer: 1\r\n"]))
        framed = b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces) + b"0\r\n" + trailer + b"\r\n"
        headers.append(b"Transfer-Encoding: chunked")
    else:
        framed = body
        headers.append(b"Content-Length: %d" % len(body))
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"
    return head + framed, body, chunked, len(head)


def factory(reactor: MemoryReactorClock, index: int = -1) -> Any:
    """
    The connection factory of the C{index}th connection the pool asked of
    C{reactor} (a C{blazar.engines.wire._ConnectFactory}).
    """
    return reactor.tcpClients[index][2]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


class SplitInputTests(SynchronousTestCase):
    @settings(max_examples=300, deadline=None)
    @given(answers(), st.lists(st.integers(0, 10_000), max_size=12), st.booleans())
    def test_any_split_gives_the_same_answer(
        self, answer: tuple[bytes, bytes, bool, int], cuts: list[int], read_early: bool
    ) -> None:
        raw, body, chunked, _ = answer
        c = Connected()
        d = c.send()
        reader = Collect()
        got: list[WireResponse] = []
        d.addCallback(got.append)
        for piece in split(raw, cuts):
            c.feed(piece)
            if read_early and got and reader.transport is None:
                got[0].deliverBody(reader)  # as soon as the headers came
        [response] = got
        if reader.transport is None:
            response.deliverBody(reader)  # once it all came
        self.assertEqual(response.code, 200)
        self.assertEqual(response.phrase, b"OK")
        self.assertEqual(response.version, (b"HTTP", 1, 1))
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        self.assertEqual(response.length, UNKNOWN_LENGTH if chunked else len(body))
        self.assertEqual(reader.body, body)
        assert reader.reason is not None
        self.assertTrue(reader.reason.check(ResponseDone))
        self.assertEqual(c.released, [c.connection])  # kept alive: back to the pool
        self.assertFalse(c.transport.disconnecting)


class ChunkedTests(SynchronousTestCase):
    def test_extensions_and_trailers(self) -> None:
        c = Connected()
        d = c.send()
        c.feed(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n1;a=b;c\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: yes\r\n\r\n"
        )
        response = self.successResultOf(d)
        reader = Collect()
        response.deliverBody(reader)
        self.assertEqual(reader.body, b"hello world")
        assert reader.reason is not None
        self.assertTrue(reader.reason.check(ResponseDone))
        self.assertIsNone(response.headers.getRawHeaders(b"x-trailer"))  # a trailer is no header

    def test_a_bad_chunk_size_fails_the_body(self) -> None:
        c = Connected()
        d = c.send()
        c.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        reader = Collect()
        self.successResultOf(d).deliverBody(reader)
        assert reader.reason is not None
        self.assertTrue(reader.reason.check(ResponseFailed))
        self.assertTrue(c.transport.disconnecting)

    def test_the_body_is_delivered_as_it_comes(self) -> None:
        c = Connected()
        d = c.send()
        c.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        reader = Collect()
        self.successResultOf(d).deliverBody(reader)
        c.feed(b"6\r\ndata: ")
        self.assertEqual(reader.body, b"data: ")
        c.feed(b"\r\n3\r\n1\n\n\r\n")
        self.assertEqual(reader.parts, [b"data: ", b"1\n\n"])
        self.assertIsNone(reader.reason)


class PipelinedTests(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(st.lists(answers(), min_size=2, max_size=4), st.lists(st.integers(0, 10_000), max_size=12))
    def test_answers_back_to_back_split_anywhere(
        self, several: list[tuple[bytes, bytes, bool, int]], cuts: list[int]
    ) -> None:
        """
        Several requests on one connection, their answers back to back and
        split anywhere (an answer's end and the next one's start in one
        read): each request gets its own answer, whole.
        """
        c = Connected()
        sent = [c.send() for _ in several]
        for piece in split(b"".join(raw for raw, _, _, _ in several), cuts):
            c.feed(piece)
        bodies = []
        for d in sent:
            reader = Collect()
            self.successResultOf(d).deliverBody(reader)
            assert reader.reason is not None
            self.assertTrue(reader.reason.check(ResponseDone))
            bodies.append(reader.body)
        self.assertEqual(bodies, [body for _, body, _, _ in several])
        self.assertEqual(c.released, [c.connection])
        self.assertFalse(c.transport.disconnecting)

    def test_two_answers_in_one_read(self) -> None:
        c = Connected()
        first, second = c.send(), c.send()
        c.feed(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none"
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\ntwo\r\n0\r\n\r\n"
        )
        bodies = []
        for d, code in ((first, 200), (second, 201)):
            response = self.successResultOf(d)
            self.assertEqual(response.code, code)
            reader = Collect()
            response.deliverBody(reader)  # (given whole, though it came before this)
            assert reader.reason is not None
            self.assertTrue(reader.reason.check(ResponseDone))
            bodies.append(reader.body)
        self.assertEqual(bodies, [b"one", b"two"])
        self.assertEqual(c.released, [c.connection])  # once both were answered
        self.assertEqual(c.transport.value(), REQUEST * 2)

    def test_a_kept_connection_is_reused(self) -> None:
        reactor = MemoryReactorClock()
        pool = WirePool(reactor, 5.0, 2.0)
        key = ("127.0.0.1", 8080)
        d = pool.take(key, stream=False)
        assert isinstance(d, Deferred)
        self.assertEqual(len(reactor.tcpClients), 1)
        transport = StringTransport()
        factory(reactor, 0).buildProtocol(None).makeConnection(transport)
        connection = self.successResultOf(d)
        answered = connection.request(REQUEST, keep=True)
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        self.successResultOf(answered).deliverBody(Collect())
        again = pool.take(key, stream=False)
        self.assertIs(again, connection)
        self.assertTrue(connection.reused)
        self.assertEqual(len(reactor.tcpClients), 1)  # no new connection


class TruncatedTests(SynchronousTestCase):
    def outcome(self, data: bytes, reason: BaseException | None = None) -> tuple[Deferred[WireResponse], Collect]:
        c = Connected()
        d = c.send()
        if data:
            c.feed(data)
        reader = Collect()
        if d.called and isinstance(d.result, WireResponse):
            d.result.deliverBody(reader)
        c.close(reason)
        self.assertEqual(c.lost, [c.connection])
        return d, reader

    def test_lost_before_any_byte(self) -> None:
        d, _ = self.outcome(b"")
        f = self.failureResultOf(d, ResponseNeverReceived)
        self.assertTrue(f.value.reasons[0].check(ConnectionDone))
        self.assertFalse(never_delivered(f.value))  # a clean close: it may have read it
        d, _ = self.outcome(b"", ConnectionLost())
        self.assertTrue(never_delivered(self.failureResultOf(d).value))  # reset: it did not

    def test_lost_in_the_status_line(self) -> None:
        d, _ = self.outcome(b"HTTP/1.1 2")
        self.failureResultOf(d, ResponseFailed)

    def test_lost_in_the_headers(self) -> None:
        d, _ = self.outcome(b"HTTP/1.1 200 OK\r\nContent-Le")
        self.failureResultOf(d, ResponseFailed)

    def test_lost_mid_chunk(self) -> None:
        d, reader = self.outcome(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc")
        self.assertEqual(self.successResultOf(d).code, 200)
        self.assertEqual(reader.body, b"abc")
        assert reader.reason is not None
        self.assertTrue(reader.reason.check(ResponseFailed))

    def test_lost_before_the_length(self) -> None:
        d, reader = self.outcome(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        assert reader.reason is not None
        self.assertTrue(reader.reason.check(ResponseFailed))

    def test_a_body_without_a_length_ends_with_the_close(self) -> None:
        d, reader = self.outcome(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        response = self.successResultOf(d)
        self.assertEqual((response.version, response.length), ((b"HTTP", 1, 0), UNKNOWN_LENGTH))
        self.assertEqual(reader.body, b"all of it")
        assert reader.reason is not None
        self.assertTrue(reader.reason.check(PotentialDataLoss))  # (httpbody's close_ends reads this)

    @settings(max_examples=300, deadline=None)
    @given(answers(), st.integers(0, 10_000))
    def test_cut_anywhere(self, answer: tuple[bytes, bytes, bool, int], at: int) -> None:
        raw, _, _, head_end = answer
        at = at % len(raw)
        d, reader = self.outcome(raw[:at])
        if at == 0:
            self.failureResultOf(d, ResponseNeverReceived)
        elif at < head_end:
            self.failureResultOf(d, ResponseFailed)
        else:
            self.successResultOf(d)
            assert reader.reason is not None
            self.assertTrue(reader.reason.check(ResponseFailed), reader.reason)


class OversizedTests(SynchronousTestCase):
    @settings(max_examples=100, deadline=None)
    @given(
        st.lists(st.integers(1, 8_000), max_size=20),
        st.integers(1, 8_000),
        st.lists(st.integers(0, 1_000_000), max_size=12),
    )
    def test_any_head_over_the_cap_fails_however_it_comes(self, sizes: list[int], over: int, cuts: list[int]) -> None:
        """
        A head of any header lines whose total passes the cap, split
        anywhere, fails the request and closes the connection; nothing
        after it is read.
        """
        sizes = [*sizes, max(1, MAX_HEAD_BYTES - sum(sizes)) + over]  # the last line passes the cap
        c = Connected()
        d = c.send()
        head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-F%d: %s\r\n" % (i, b"x" * n) for i, n in enumerate(sizes))
        for piece in split(head + b"\r\n", cuts):
            c.feed(piece)
            if d.called:
                break
        f = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(f.value.reasons[0].check(ResponseHeadTooLarge))
        self.assertTrue(c.transport.disconnecting)
        self.assertEqual(c.released, [])

    def test_a_head_over_the_cap_fails_and_closes(self) -> None:
        c = Connected()
        d = c.send()
        c.feed(b"HTTP/1.1 200 OK\r\n")
        line = b"X-Filler: " + b"x" * 1000 + b"\r\n"
        for _ in range(MAX_HEAD_BYTES // len(line) + 2):
            if d.called:
                break
            c.feed(line)
        f = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(f.value.reasons[0].check(ResponseHeadTooLarge))
        self.assertTrue(c.transport.disconnecting)
        c.feed(line)  # (read no more)

    def test_one_endless_header_line(self) -> None:
        c = Connected()
        d = c.send()
        c.feed(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        for _ in range(MAX_HEAD_BYTES // 4096 + 2):
            c.feed(b"y" * 4096)
        self.failureResultOf(d, ResponseFailed)

    def test_garbage_is_malformed(self) -> None:
        c = Connected()
        d = c.send()
        c.feed(b"SSH-2.0-OpenSSH\r\n\r\n")
        self.failureResultOf(d, ResponseFailed)
        self.assertTrue(c.transport.disconnecting)

    def test_a_large_body_is_not_a_large_head(self) -> None:
        c = Connected()
        d = c.send()
        size = MAX_HEAD_BYTES * 3
        c.feed(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"z" * size)
        reader = Collect()
        self.successResultOf(d).deliverBody(reader)
        self.assertEqual(len(reader.body), size)


class ReaderTests(SynchronousTestCase):
    def answered(self, c: Connected) -> WireResponse:
        d = c.send()
        c.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: a/b\r\n\r\n")
        return self.successResultOf(d)

    def test_it_is_an_iresponse(self) -> None:
        response = self.answered(Connected())
        self.assertTrue(IResponse.providedBy(response))
        self.assertEqual(response.headers.getRawHeaders(b"Content-Type"), [b"a/b"])
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["a/b"])
        response.setPreviousResponse(response)
        self.assertIs(response.previousResponse, response)

    def test_pause_resume_stop(self) -> None:
        c = Connected()
        response = self.answered(c)
        reader = Collect()
        response.deliverBody(reader)
        assert reader.transport is not None
        reader.transport.pauseProducing()  # type: ignore[attr-defined]
        self.assertEqual(c.transport.producerState, "paused")
        reader.transport.resumeProducing()  # type: ignore[attr-defined]
        self.assertEqual(c.transport.producerState, "producing")
        reader.transport.stopProducing()  # type: ignore[attr-defined]
        self.assertTrue(c.transport.disconnecting)  # the child stops its work
        self.assertEqual(c.released, [])

    def test_controls_of_an_ended_body_do_nothing(self) -> None:
        c = Connected()
        response = self.answered(c)
        reader = Collect()
        response.deliverBody(reader)
        c.feed(b"0\r\n\r\n")
        assert reader.transport is not None
        reader.transport.stopProducing()  # type: ignore[attr-defined]
        self.assertFalse(c.transport.disconnecting)
        self.assertEqual(c.released, [c.connection])

    def test_a_body_before_the_reader_is_kept_and_bounded(self) -> None:
        c = Connected()
        response = self.answered(c)
        big = b"q" * 300_000
        c.feed(b"%x\r\n" % len(big) + big + b"\r\n")
        self.assertEqual(c.transport.producerState, "paused")  # no more read until it is taken
        reader = Collect()
        response.deliverBody(reader)
        self.assertEqual(reader.body, big)
        self.assertEqual(c.transport.producerState, "producing")

    def test_read_body_bounds_it(self) -> None:
        clock = MemoryReactorClock()
        c = Connected()
        response = self.answered(c)
        reading = ensureDeferred(read_body(response, clock, idle_timeout=5, max_bytes=4))
        c.feed(b"5\r\nabcde\r\n")
        self.failureResultOf(reading, BodyTooLarge)
        self.assertTrue(c.transport.disconnecting)

    def test_interim_answers_are_skipped(self) -> None:
        c = Connected()
        d = c.send()
        c.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nk")
        reader = Collect()
        self.successResultOf(d).deliverBody(reader)
        self.assertEqual(reader.body, b"k")
        self.assertEqual(c.released, [c.connection])

    def test_a_streamed_answer_closes_its_connection(self) -> None:
        c = Connected()
        d = c.send(keep=False)
        c.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nKeep-Alive: timeout=5\r\n\r\nk")
        self.successResultOf(d).deliverBody(Collect())
        self.assertEqual(c.released, [])
        self.assertTrue(c.transport.disconnecting)

    def test_connection_close_is_not_kept(self) -> None:
        c = Connected()
        d = c.send()
        c.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\nk")
        self.successResultOf(d).deliverBody(Collect())
        self.assertEqual(c.released, [])

    def test_bytes_nobody_asked_for_close_it(self) -> None:
        c = Connected()
        c.feed(b"HTTP/1.1 200 OK\r\n")
        self.assertTrue(c.transport.disconnecting)


class RequestSideTests(SynchronousTestCase):
    def test_one_write_and_a_flush(self) -> None:
        transport = HandleTransport(FakeHandle("open"))
        c = Connected(transport)
        c.send()
        self.assertEqual(transport.value(), REQUEST)
        self.assertEqual(transport.flushes, 1)
        self.assertEqual(len(transport.handle.peeks), 2)  # before and after

    def test_a_closed_connection_takes_no_request(self) -> None:
        transport = HandleTransport(FakeHandle("eof"))
        d = Connected(transport).send()
        self.failureResultOf(d, RequestNotSent)
        self.assertEqual(transport.value(), b"")

    def test_closed_as_it_was_sent_the_child_did_not_read_it(self) -> None:
        c = Connected(HandleTransport(FakeHandle("open"), close_on_write=True))
        d = c.send()
        c.close()
        self.failureResultOf(d, RequestNotRead)

    def test_an_answer_after_all_is_an_answer(self) -> None:
        c = Connected(HandleTransport(FakeHandle("open"), close_on_write=True))
        d = c.send()
        c.feed(b"HTTP/1.1 204 No Content\r\n\r\n")
        self.assertEqual(self.successResultOf(d).code, 204)

    def test_cancelled_it_closes_the_connection(self) -> None:
        c = Connected()
        d = c.send()
        d.cancel()
        f = self.failureResultOf(d, ResponseNeverReceived)
        self.assertTrue(f.value.reasons[0].check(CancelledError))
        self.assertTrue(c.transport.disconnecting)

    def test_heads_are_built_once(self) -> None:
        heads = RequestHeads()
        headers = {b"authorization": [b"Bearer k"], b"content-type": [b"application/json"]}
        head = heads.build(b"POST", b"127.0.0.1:9", b"/v1/x", headers, True)
        self.assertEqual(
            head,
            b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:9\r\nauthorization: Bearer k\r\n"
            b"content-type: application/json\r\nContent-Length: ",
        )
        self.assertIs(heads.build(b"POST", b"127.0.0.1:9", b"/v1/x", dict(headers), True), head)
        self.assertTrue(heads.build(b"GET", b"127.0.0.1:9", b"/health", {}, False).endswith(b"\r\n\r\n"))
        self.assertRaises(ValueError, heads.build, b"GET", b"h", b"/", {b"x": [b"a\r\nb"]}, False)


KEY = ("127.0.0.1", 8080)


class PoolTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.pool = WirePool(self.reactor, 5.0, 2.0)

    def accept(self, index: int = -1, handle: FakeHandle | None = None) -> tuple[EngineConnection, StringTransport]:
        transport = HandleTransport(handle) if handle is not None else StringTransport()
        connection = factory(self.reactor, index).buildProtocol(None)
        connection.makeConnection(transport)
        return connection, transport

    def kept(self) -> tuple[EngineConnection, StringTransport]:
        d = self.pool.take(KEY, stream=False)
        assert isinstance(d, Deferred)
        connection, transport = self.accept(handle=FakeHandle("open"))
        self.assertIs(self.successResultOf(d), connection)
        answered = connection.request(REQUEST, keep=True)
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.successResultOf(answered)
        return connection, transport

    def test_a_stream_opens_a_spare_for_the_next(self) -> None:
        d = self.pool.take(KEY, stream=True)
        assert isinstance(d, Deferred)
        self.assertEqual(len(self.reactor.tcpClients), 2)  # its own, and the spare
        first, _ = self.accept(0)
        spare, _ = self.accept(1)
        self.assertIs(self.successResultOf(d), first)
        self.assertIs(self.pool.take(KEY, stream=True), spare)
        self.assertEqual(len(self.reactor.tcpClients), 3)  # the next spare

    def test_a_spare_the_child_closed_is_replaced_quietly(self) -> None:
        self.pool.take(KEY, stream=True)
        self.accept(0)
        handle = FakeHandle("open")
        spare, _ = self.accept(1, handle)
        handle.state = "eof"  # closed, not yet read by the reactor
        d = self.pool.take(KEY, stream=True)
        self.assertIsInstance(d, Deferred)  # a new connection instead
        self.assertNoResult(d)
        spare.connectionLost(Failure(ConnectionDone()))  # (nobody is told)

    def test_a_spare_closed_while_idle_is_forgotten(self) -> None:
        self.pool.take(KEY, stream=True)
        self.accept(0)
        spare, _ = self.accept(1)
        spare.connectionLost(Failure(ConnectionDone()))
        self.assertIsInstance(self.pool.take(KEY, stream=True), Deferred)

    def test_idle_connections_are_dropped_after_idle_secs(self) -> None:
        connection, transport = self.kept()
        self.reactor.advance(1.9)
        self.assertFalse(transport.disconnecting)
        self.reactor.advance(0.2)
        self.assertTrue(transport.disconnecting)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assertIsInstance(self.pool.take(KEY, stream=False), Deferred)

    def test_a_kept_connection_the_child_closed_is_skipped(self) -> None:
        connection, transport = self.kept()
        transport.handle.state = "eof"  # type: ignore[attr-defined]
        self.assertIsInstance(self.pool.take(KEY, stream=False), Deferred)
        self.assertTrue(transport.disconnecting)

    def test_close_drops_everything(self) -> None:
        _, transport = self.kept()
        self.pool.take(KEY, stream=True)  # (took the kept one; a spare is opening)
        self.pool.close()
        self.assertEqual(factory(self.reactor).connected.called, True)

    def test_connect_failures_and_cancels(self) -> None:
        d = self.pool.take(KEY, stream=False)
        assert isinstance(d, Deferred)
        factory(self.reactor, 0).clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        self.failureResultOf(d, ConnectionRefusedError)
        d = self.pool.take(KEY, stream=False)
        assert isinstance(d, Deferred)
        d.cancel()
        self.failureResultOf(d, ConnectingCancelledError)


class EngineClientWireTests(SynchronousTestCase):
    """
    L{EngineClient.request} on the lean path keeps the failure classes of
    the Agent path.
    """

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.client = EngineClient(self.reactor)

    def request(self, stream: bool = False) -> Deferred[Any]:
        return ensureDeferred(self.client.request("POST", "http://127.0.0.1:8080/v1/x", b"{}", {}, stream))

    def accept(self, index: int = -1) -> tuple[EngineConnection, StringTransport]:
        transport = HandleTransport(FakeHandle("open"))
        connection = factory(self.reactor, index).buildProtocol(None)
        connection.makeConnection(transport)
        return connection, transport

    def test_the_request_goes_out_whole(self) -> None:
        d = self.request()
        connection, transport = self.accept()
        self.assertEqual(
            transport.value(), b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Length: 2\r\n\r\n{}"
        )
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(self.successResultOf(d).code, 200)

    def test_refused_is_not_delivered(self) -> None:
        d = self.request()
        factory(self.reactor).clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        self.assertIsInstance(self.failureResultOf(d, NotDelivered).value.error, ConnectionRefusedError)

    def test_a_reset_before_any_answer_is_not_delivered(self) -> None:
        d = self.request(stream=True)
        connection, _ = self.accept(0)  # (1: the spare for the next stream)
        connection.connectionLost(Failure(ConnectionLost()))
        self.failureResultOf(d, NotDelivered)

    def test_a_clean_close_on_a_stream_may_have_been_read(self) -> None:
        d = self.request(stream=True)
        connection, _ = self.accept(0)  # (1: the spare for the next stream)
        self.reactor.advance(1)
        connection.connectionLost(Failure(ConnectionDone()))
        f = self.failureResultOf(d, ResponseNeverReceived)
        self.assertFalse(never_delivered(f.value))

    def test_a_clean_close_at_once_on_a_kept_connection_is_stale(self) -> None:
        first = self.request()
        connection, _ = self.accept()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.successResultOf(first)
        second = self.request()
        self.assertEqual(len(self.reactor.tcpClients), 1)  # on the kept connection
        connection.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(second, StaleConnection)

    def test_cancelled_while_waiting_for_headers(self) -> None:
        d = self.request()
        _, transport = self.accept()
        d.cancel()
        f = self.failureResultOf(d, ResponseNeverReceived)
        self.assertTrue(f.value.reasons[0].check(CancelledError))
        self.assertTrue(transport.disconnecting)

    def test_cancelled_while_connecting(self) -> None:
        d = self.request()
        d.cancel()
        self.failureResultOf(d, ConnectingCancelledError)  # (as the Agent path raised it)
        self.assertTrue(factory(self.reactor).connector.stoppedConnecting)

    def test_get_uses_a_fresh_connection_and_closes_it(self) -> None:
        d = ensureDeferred(self.client.get("http://127.0.0.1:8080/health", {b"authorization": [b"Bearer k"]}))
        connection, transport = self.accept()
        self.assertTrue(transport.value().startswith(b"GET /health HTTP/1.1\r\n"))
        connection.dataReceived(b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}')
        self.assertEqual(self.successResultOf(d), (200, b'{"status":"ok"}'))
        self.assertTrue(transport.disconnecting)

    def test_get_times_out(self) -> None:
        d = ensureDeferred(self.client.get("http://127.0.0.1:8080/health", {}, timeout=2))
        self.accept()
        self.reactor.advance(2)
        self.failureResultOf(d)

    def test_remotes_keep_the_agent(self) -> None:
        self.assertIsNone(self.client._target("https://api.example.com/v1/x"))
        self.assertIsNone(self.client._target("http://localhost:8080/v1/x"))
        self.assertEqual(
            self.client._target("http://127.0.0.1:8080/v1/x?a=1"),
            (("127.0.0.1", 8080), b"127.0.0.1:8080", b"/v1/x?a=1"),
        )
        self.assertEqual(self.client._target("http://127.0.0.1:8080"), (("127.0.0.1", 8080), b"127.0.0.1:8080", b"/"))
