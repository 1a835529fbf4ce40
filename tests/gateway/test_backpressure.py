"""
Backpressure from a streaming client to the engine (L{ClientPacer} through
L{EngineProxy.relay}), in memory: a real twisted.web request on an
HTTPChannel over a StringTransport, an engine body over another, a Clock.
The client's transport is driven as Twisted's TCP transport drives it:
C{pauseProducing}/C{resumeProducing} on the channel when its write buffer
fills and drains, and on loss the producer's C{stopProducing} before the
protocol's C{connectionLost}.
"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionAborted, ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone
from twisted.web.http import HTTPChannel
from twisted.web.iweb import IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from blazar.config import Config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import Instance
from blazar.engines.supervisor import Supervisor as RealSupervisor
from blazar.gateway.admission import Admission, WorkClass, admit_request
from blazar.gateway.backpressure import ClientPacer
from blazar.gateway.engine_proxy import STREAM_IDLE_TIMEOUT, EngineProxy
from blazar.httpbody import BodyIdleTimeout, BodyValve, relay_body
from blazar.testing import FakeInstance, FakeSupervisor
from blazar.web.client import context_of

STALL = 3.0
EVENT = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'


class ClientTransport(StringTransport):
    """
    The client's connection; losing it runs as in C{twisted.internet.tcp}:
    the registered producer's C{stopProducing}, then the protocol's
    C{connectionLost}.
    """

    protocol: HTTPChannel

    def __init__(self) -> None:
        super().__init__()
        self.aborted = False

    def abortConnection(self) -> None:
        self.aborted = True
        self.lose(ConnectionAborted())

    def lose(self, reason: Exception) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        producer, self.producer = self.producer, None
        if producer is not None:
            producer.stopProducing()
        self.protocol.connectionLost(Failure(reason))


class Capture(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []

    def render_POST(self, request: Request) -> Any:
        self.requests.append(request)
        return NOT_DONE_YET


class EngineBody:
    """
    An engine response whose body arrives over a StringTransport (its
    C{producerState} shows whether Blazar reads the engine's connection).
    """

    code = 200

    def __init__(self) -> None:
        self.transport = StringTransport()
        self.protocol: Any = None

    def deliverBody(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)

    def send(self, data: bytes) -> None:
        self.protocol.dataReceived(data)

    def end(self) -> None:
        self.protocol.connectionLost(Failure(ResponseDone()))


class Supervisor(FakeSupervisor):
    def __init__(self) -> None:
        super().__init__([])

    async def explain_failure(self, instance: Any, error: BaseException) -> Any:  # passes the error on as it is
        return error


def connect(clock: Clock) -> tuple[Request, ClientTransport, HTTPChannel]:
    """
    A streaming request as a surface holds it: on a live channel, headers
    not yet written.
    """
    resource = Capture()
    site = Site(resource, reactor=clock)
    # HTTP/1.1 only, without the HTTP/2 negotiating wrapper (typed as a factory method, a class is one)
    site.protocol = HTTPChannel  # type: ignore[method-assign, assignment]
    channel = site.buildProtocol(None)
    assert isinstance(channel, HTTPChannel)
    transport = ClientTransport()
    transport.protocol = channel
    channel.makeConnection(transport)
    channel.dataReceived(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    [request] = resource.requests
    return request, transport, channel


class RelayBackpressureTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.request, self.client, self.channel = connect(self.clock)
        self.admission = Admission(self.clock, lambda: Config())
        self.lease = self.successResultOf(
            Deferred.fromCoroutine(
                admit_request(self.admission, context_of(self.request), "m", 1, WorkClass.INTERACTIVE, 0)
            )
        )
        self.engine = EngineBody()
        self.instance = FakeInstance("m")
        proxy = EngineProxy(
            cast(RealSupervisor, Supervisor()),
            cast(EngineClient, None),
            self.clock,
            config=lambda: Config(stream_stall_close=STALL),
        )
        self.relayed = Deferred.fromCoroutine(
            proxy.relay(cast(Instance, self.instance), self.engine, self.request.write, context_of(self.request))
        )
        self.engine.send(EVENT)

    def busy(self) -> int:
        return len(self.admission.queue("m").running)

    def test_the_relay_is_the_requests_producer(self) -> None:
        self.assertIsInstance(self.request.producer, ClientPacer)
        self.assertIn(EVENT, self.client.value())
        self.engine.end()
        self.successResultOf(self.relayed)
        self.assertIsNone(self.request.producer)
        self.assertIsNone(self.channel._requestProducer)

    def test_a_paused_client_pauses_the_engine_and_holds_the_slot(self) -> None:
        self.channel.pauseProducing()  # the client's write buffer is full
        self.assertEqual(self.engine.transport.producerState, "paused")
        self.clock.advance(STALL - 0.1)
        self.assertEqual(self.engine.transport.producerState, "paused")
        self.assertNoResult(self.relayed)
        self.assertEqual(self.busy(), 1)
        self.assertFalse(self.client.aborted)

    def test_resume_resumes_the_engine(self) -> None:
        self.channel.pauseProducing()
        self.channel.resumeProducing()
        self.assertEqual(self.engine.transport.producerState, "producing")
        self.engine.send(EVENT)
        self.engine.end()
        self.successResultOf(self.relayed)

    def test_a_reader_that_keeps_up_now_and_then_is_not_cut_off(self) -> None:
        for _ in range(5):
            self.channel.pauseProducing()
            self.channel.pauseProducing()  # again on every write while full: no new timer
            self.clock.advance(STALL - 0.5)
            self.channel.resumeProducing()
        self.assertFalse(self.client.aborted)
        self.engine.end()
        self.successResultOf(self.relayed)

    def test_a_stall_closes_both_and_frees_the_slot(self) -> None:
        self.channel.pauseProducing()
        self.clock.advance(STALL)
        self.assertTrue(self.client.aborted)
        self.assertTrue(self.lease.released)
        self.assertEqual(self.busy(), 0)
        self.clock.advance(0)
        self.assertEqual(self.engine.transport.producerState, "stopped")
        self.failureResultOf(self.relayed, CancelledError)
        self.assertEqual(context_of(self.request).error, "client_stalled")
        self.assertEqual(len(self.flushLoggedErrors()), 0)

    def test_a_client_that_leaves_frees_at_once(self) -> None:
        self.client.lose(ConnectionDone())
        self.assertTrue(self.lease.released)
        self.assertEqual(self.busy(), 0)
        self.clock.advance(0)
        self.assertEqual(self.engine.transport.producerState, "stopped")
        self.failureResultOf(self.relayed, CancelledError)

    def test_a_client_that_leaves_while_paused_frees_at_once(self) -> None:
        self.channel.pauseProducing()
        self.client.lose(ConnectionDone())
        self.assertEqual(self.busy(), 0)
        self.clock.advance(0)
        self.assertEqual(self.engine.transport.producerState, "stopped")
        self.failureResultOf(self.relayed, CancelledError)
        self.clock.advance(STALL)
        self.assertFalse(self.client.aborted)

    def test_klein_cancelling_the_handler_closes_the_engine_at_once(self) -> None:
        # Klein cancels the handler's Deferred from the request's
        # notifyFinish errback: no reactor turn needed
        self.request.notifyFinish().addErrback(lambda _: self.relayed.cancel())
        self.client.lose(ConnectionDone())
        self.assertEqual(self.engine.transport.producerState, "stopped")
        self.failureResultOf(self.relayed, CancelledError)

    def test_the_slot_is_held_until_the_client_took_the_end(self) -> None:
        self.channel.pauseProducing()
        self.engine.end()
        self.assertNoResult(self.relayed)  # the last bytes still wait in Blazar's buffer
        self.channel.resumeProducing()
        self.successResultOf(self.relayed)

    def test_a_stall_after_the_engine_finished_frees_the_slot(self) -> None:
        self.channel.pauseProducing()
        self.engine.end()
        self.clock.advance(STALL)
        self.assertTrue(self.client.aborted)
        self.assertEqual(self.busy(), 0)
        self.clock.advance(0)
        self.failureResultOf(self.relayed, CancelledError)

    def test_a_paused_stream_ends_by_the_stall_not_the_idle_timeout(self) -> None:
        self.channel.pauseProducing()
        self.clock.advance(STREAM_IDLE_TIMEOUT + 1)
        self.failureResultOf(self.relayed, CancelledError)


class NoStallBoundTests(SynchronousTestCase):
    def test_zero_never_cuts_a_client_off(self) -> None:
        clock = Clock()
        request, client, channel = connect(clock)
        valve = BodyValve()
        pacer = ClientPacer(request, valve, clock, 0)
        self.assertTrue(pacer.register())
        channel.pauseProducing()
        clock.advance(3600)
        self.assertTrue(valve.paused)
        self.assertFalse(client.aborted)

    def test_a_request_without_a_channel_gets_no_producer(self) -> None:
        clock = Clock()
        request, client, channel = connect(clock)
        client.lose(ConnectionDone())
        self.assertFalse(ClientPacer(request, BodyValve(), clock, 1).register())


class BodyValveTests(SynchronousTestCase):
    """
    L{BodyValve} on L{relay_body}: pausing stops reading the engine's
    connection, and the idle timeout does not run meanwhile.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.engine = EngineBody()
        self.valve = BodyValve()
        self.chunks: list[bytes] = []
        self.d = relay_body(
            cast(IResponse, self.engine), self.chunks.append, self.clock, idle_timeout=10, valve=self.valve
        )

    def test_pause_and_resume(self) -> None:
        self.valve.pause()
        self.assertEqual(self.engine.transport.producerState, "paused")
        self.engine.send(b"rest of a read")  # still delivered
        self.assertEqual(self.chunks, [b"rest of a read"])
        self.valve.resume()
        self.assertEqual(self.engine.transport.producerState, "producing")
        self.engine.end()
        self.successResultOf(self.d)

    def test_no_idle_timeout_while_paused(self) -> None:
        self.valve.pause()
        self.engine.send(b"x")
        self.clock.advance(100)
        self.assertNoResult(self.d)
        self.valve.resume()
        self.clock.advance(10)
        self.failureResultOf(self.d, BodyIdleTimeout)

    def test_paused_before_the_body_is_delivered(self) -> None:
        class Buffered(EngineBody):
            def deliverBody(self, protocol: Any) -> None:
                # as twisted.web's Response: buffered data, then a resume
                super().deliverBody(protocol)
                protocol.dataReceived(b"buffered")
                self.transport.resumeProducing()

        engine = Buffered()
        valve = BodyValve()

        def on_chunk(data: bytes) -> None:
            valve.pause()  # the client's buffer filled on the first write

        relay_body(cast(IResponse, engine), on_chunk, self.clock, idle_timeout=10, valve=valve)
        self.assertEqual(engine.transport.producerState, "paused")


class QuietTests(SynchronousTestCase):
    """
    L{relay_body}'s C{quiet}: a body silent for the quiet time asks whether
    its sender is alive; a child stopped mid-way (SIGSTOP) fails the relay
    then, not after the idle timeout.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.engine = EngineBody()
        self.asked: list[Deferred[bool]] = []
        self.chunks: list[bytes] = []

        def alive() -> Deferred[bool]:
            d: Deferred[bool] = Deferred()
            self.asked.append(d)
            return d

        self.d = relay_body(
            cast(IResponse, self.engine), self.chunks.append, self.clock, idle_timeout=600, quiet=(5, alive)
        )

    def test_a_silent_sender_that_answers_is_waited_for(self) -> None:
        self.engine.send(b"a")
        self.clock.advance(5)
        self.assertEqual(len(self.asked), 1)
        self.asked[0].callback(True)
        self.clock.advance(4)
        self.engine.send(b"b")
        self.clock.advance(4)
        self.assertEqual(len(self.asked), 1)  # the wait began again with the data
        self.engine.end()
        self.successResultOf(self.d)
        self.assertEqual(self.chunks, [b"a", b"b"])

    def test_a_silent_sender_that_does_not_answer_fails_the_relay(self) -> None:
        from blazar.httpbody import BodyStalled

        self.clock.advance(5)
        self.asked[0].callback(False)
        f = self.failureResultOf(self.d, BodyStalled)
        self.assertIn("did not answer its health check", str(f.value))
        self.assertEqual(self.engine.transport.producerState, "stopped")

    def test_data_while_asking_goes_on(self) -> None:
        self.clock.advance(5)
        self.engine.send(b"late")
        self.assertTrue(self.asked[0].called)  # the question was withdrawn
        self.clock.advance(4.9)
        self.assertNoResult(self.d)
        self.clock.advance(0.1)
        self.assertEqual(len(self.asked), 2)

    def test_the_idle_timeout_still_bounds_it(self) -> None:
        for _ in range(200):
            self.clock.advance(5)
            if self.asked and not self.asked[-1].called:
                self.asked[-1].callback(True)
            if self.d.called:
                break
        self.failureResultOf(self.d, BodyIdleTimeout)

    def test_the_question_waits_for_the_quiet_time_after_the_last_byte(self) -> None:
        self.clock.advance(3)
        self.engine.send(b"a")
        self.clock.advance(4.9)
        self.assertEqual(self.asked, [])
        self.clock.advance(0.1)
        self.assertEqual(len(self.asked), 1)


class IdleTimeoutTests(SynchronousTestCase):
    """
    L{relay_body}'s idle timeout counts from the last byte, though a chunk
    only notes its time (no delayed call is moved per chunk): the timer,
    fired early, waits on for the rest.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.engine = EngineBody()
        self.valve = BodyValve()
        self.d = relay_body(
            cast(IResponse, self.engine), lambda data: None, self.clock, idle_timeout=10, valve=self.valve
        )

    def test_a_sender_that_keeps_sending_is_never_cut(self) -> None:
        for _ in range(50):
            self.clock.advance(6)
            self.engine.send(b"x")
        self.assertNoResult(self.d)
        self.engine.end()
        self.successResultOf(self.d)

    def test_silent_for_the_bound_after_the_last_byte_fails(self) -> None:
        self.clock.advance(7)
        self.engine.send(b"x")
        self.clock.advance(9.9)
        self.assertNoResult(self.d)
        self.clock.advance(0.1)
        self.failureResultOf(self.d, BodyIdleTimeout)
        self.assertEqual(self.engine.transport.producerState, "stopped")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_chunk_moves_no_timer(self) -> None:
        (call,) = self.clock.getDelayedCalls()
        at = call.getTime()
        for _ in range(5):
            self.clock.advance(1)
            self.engine.send(b"x")
        self.assertEqual(self.clock.getDelayedCalls(), [call])
        self.assertEqual(call.getTime(), at)

    def test_a_pause_between_counts_nothing(self) -> None:
        self.clock.advance(8)
        self.engine.send(b"x")
        self.valve.pause()
        self.clock.advance(100)
        self.valve.resume()
        self.clock.advance(9.9)
        self.assertNoResult(self.d)
        self.clock.advance(0.1)
        self.failureResultOf(self.d, BodyIdleTimeout)
