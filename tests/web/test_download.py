"""
L{blazar.web.download.FileProducer}: a file sent in pieces, each read in a
thread, no read ahead of a paused transport, and the file closed however
the sending ends.
"""

from __future__ import annotations

import io
from typing import Any, Callable

from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IConsumer, IProducer, IPushProducer
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from blazar.web.download import FileProducer


@implementer(IConsumer)
class Transport:
    """
    A consumer that pauses its producer once C{high} bytes are buffered,
    as a TCP transport does.
    """

    def __init__(self, high: int) -> None:
        self.high = high
        self.buffered = b""
        self.received = b""
        self.producer: IPushProducer | None = None
        self.registrations = 0

    def registerProducer(self, producer: IProducer, streaming: bool) -> None:
        assert streaming and IPushProducer.providedBy(producer)
        self.producer = producer
        self.registrations += 1

    def unregisterProducer(self) -> None:
        self.producer = None

    def write(self, data: bytes) -> None:
        self.buffered += data
        if len(self.buffered) >= self.high and self.producer is not None:
            self.producer.pauseProducing()

    def drain(self) -> None:
        self.received += self.buffered
        self.buffered = b""
        if self.producer is not None:
            self.producer.resumeProducing()


class Reads:
    """
    An in-thread runner that counts the calls (run at once).
    """

    def __init__(self) -> None:
        self.calls: list[Callable[..., Any]] = []

    def __call__(self, f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        self.calls.append(f)
        return maybeDeferred(f, *args)


class FileProducerTests(SynchronousTestCase):
    def test_reading_waits_for_the_transport(self) -> None:
        content = bytes(range(256)) * 40  # 10,240 bytes
        handle = io.BytesIO(content)
        transport, reads = Transport(high=2048), Reads()
        done = Deferred.fromCoroutine(FileProducer(transport, handle, reads, piece=1024).send())
        # two pieces, then paused: nothing more is read until it drains
        self.assertNoResult(done)
        self.assertEqual((len(transport.buffered), handle.tell()), (2048, 2048))
        while not done.called:
            transport.drain()
            self.assertLessEqual(len(transport.buffered), 2048)
        transport.drain()
        self.assertEqual(self.successResultOf(done), len(content))
        self.assertEqual(transport.received, content)
        self.assertIsNone(transport.producer)  # unregistered
        self.assertTrue(handle.closed)

    def test_a_client_that_leaves_stops_it_and_the_file_is_closed(self) -> None:
        handle = io.BytesIO(b"x" * 10_000)
        transport = Transport(high=1000)
        producer = FileProducer(transport, handle, Reads(), piece=1000)
        done = Deferred.fromCoroutine(producer.send())
        self.assertNoResult(done)
        producer.stopProducing()
        self.assertEqual(self.successResultOf(done), 1000)
        self.assertTrue(handle.closed)
        self.assertIsNotNone(transport.producer)  # (its connection is gone: nothing to unregister from)

    def test_a_cancelled_send_closes_the_file_after_the_read_under_way(self) -> None:
        handle = io.BytesIO(b"x" * 10_000)
        pending: list[tuple[Deferred[Any], Callable[..., Any], tuple[Any, ...]]] = []

        def in_thread(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
            d: Deferred[Any] = Deferred()
            pending.append((d, f, args))
            return d

        done = Deferred.fromCoroutine(FileProducer(Transport(high=10**6), handle, in_thread).send())
        self.assertEqual(len(pending), 1)  # the first read, under way
        done.cancel()
        self.failureResultOf(done, CancelledError)
        # the close was handed to the pool (where it waits for the read's lock), not done here
        self.assertFalse(handle.closed)
        self.assertEqual(len(pending), 2)
        for _, f, args in pending:
            f(*args)
        self.assertTrue(handle.closed)
