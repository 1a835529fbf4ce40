"""
L{blazar.web.site.send_now} and L{flush_now} on a real TCP transport
over a socket pair: sent at once when nothing waits, buffered behind what
does, never on another transport.
"""

from __future__ import annotations

import socket

from twisted.internet import tcp
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.trial.unittest import SynchronousTestCase

from blazar.web.site import flush_now, send_now


class SendNowTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.addCleanup(self.ours.close)
        self.addCleanup(self.theirs.close)
        self.theirs.settimeout(1)
        self.reactor = MemoryReactor()
        self.transport = tcp.Connection(self.ours, Protocol(), self.reactor)
        self.transport.connected = 1

    def test_sent_at_once(self) -> None:
        """
        With nothing buffered, the bytes are on the socket before the
        reactor's next turn, and the transport holds nothing.
        """
        send_now(self.transport, b"data: 1\n\n")
        self.assertEqual(self.theirs.recv(100), b"data: 1\n\n")
        self.assertEqual(self.transport._tempDataBuffer, [])
        self.assertNotIn(self.transport, self.reactor.getWriters())

    def test_behind_what_waits(self) -> None:
        """
        Bytes already waiting in the transport's buffer go first: the new
        ones queue behind them, in order.
        """
        self.transport.write(b"head ")
        send_now(self.transport, b"chunk")
        self.theirs.setblocking(False)
        with self.assertRaises(BlockingIOError):
            self.theirs.recv(100)
        flush_now(self.transport)
        self.theirs.setblocking(True)
        self.assertEqual(self.theirs.recv(100), b"head chunk")
        self.assertNotIn(self.transport, self.reactor.getWriters())

    def test_rest_buffered(self) -> None:
        """
        What the socket does not take now is buffered, in order, for the
        reactor to send once the socket drains.
        """
        self.ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        big = bytes(range(256)) * 4096
        send_now(self.transport, big)
        self.assertTrue(self.transport._tempDataBuffer)
        self.assertIn(self.transport, self.reactor.getWriters())
        got = b""
        while len(got) < len(big):
            self.theirs.setblocking(False)
            try:
                got += self.theirs.recv(1 << 20)
            except BlockingIOError:
                flush_now(self.transport)
        self.assertEqual(got, big)

    def test_closing_left_to_reactor(self) -> None:
        """
        A transport that is closing is not flushed here: its close is the
        reactor's to finish.
        """
        self.transport.write(b"last")
        self.transport.disconnecting = True
        flush_now(self.transport)
        self.assertEqual(self.transport._tempDataBuffer, [b"last"])

    def test_other_transport(self) -> None:
        """
        Another transport (TLS, a test's) gets a plain write.
        """
        other = StringTransport()
        send_now(other, b"x")
        flush_now(other)
        self.assertEqual(other.value(), b"x")
