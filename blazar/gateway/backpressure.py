"""
Backpressure from a streaming client to the engine child it streams from.

A relayed stream registers a L{ClientPacer} as the push producer of the
client's response (the consumer the web layer's
L{blazar.gateway.context.IClient} gives: C{registerProducer}): when the client stops
reading and the transport's write buffer fills, Twisted pauses it, and it
pauses reading the child's connection (L{blazar.engines.client.BodyValve}),
so TCP backpressure reaches llama-server and the bytes in Blazar's memory
stay bounded by one socket read per connection beyond the transport's
buffer. The client's socket gets a fixed kernel send buffer
(L{pin_send_buffer}), set when the relay starts: Linux would otherwise grow
it before the first pause enough to take a whole stream the client never
reads, and the slot would be given back as if it had been delivered. The
slot stays held while paused: the request is still running.

A client that stays paused for C{stream_stall_close_secs} is cut off: its
connection is aborted, and the client-gone path does the rest (the handler
is cancelled, which closes the engine connection so the child stops
generating; the admission lease is released; the child's C{in_flight}
drops).
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.logger import Logger
from zope.interface import implementer

from blazar.gateway.context import RequestContext, note_error, trace_id_of
from blazar.httpbody import BodyValve

log = Logger()

# the kernel send buffer of a streaming client's socket (Linux doubles it
# for its bookkeeping): 32 KiB in flight is ~640 KB/s at 50 ms round trips,
# far more than a token stream needs
STREAM_SEND_BUFFER = 32 * 1024


def pin_send_buffer(transport: Any, size: int = STREAM_SEND_BUFFER) -> bool:
    """
    Fix the kernel send buffer of the socket under C{transport} (TCP or
    UNIX, also beneath TLS) at C{size} bytes.

    Linux grows a TCP send buffer on its own (up to C{tcp_wmem}'s maximum,
    4 MiB by default) even while the peer's receive window is closed: a
    client that reads nothing keeps taking some kilobytes a second for
    minutes, so Twisted's buffer drains and refills, and the stream never
    looks stalled. A fixed size turns that off for this socket.

    @return: Whether a socket was found and set.
    """
    for _ in range(4):
        if transport is None:
            return False
        handle = getattr(transport, "getHandle", None)
        sock = handle() if handle is not None else None
        if isinstance(sock, socket.socket):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            except OSError:
                return False
            return True
        transport = getattr(transport, "transport", None)  # beneath TLS
    return False


@implementer(IPushProducer)
class ClientPacer:
    """
    The producer of one streamed response: the client's transport pauses
    and resumes it, and it pauses and resumes the engine's body.

    @ivar paused: The client's transport asked us to stop writing.
    @ivar stalled: The client stayed paused past the stall bound and its
        connection was aborted.
    @ivar gone: The client's connection is gone (C{stopProducing}).
    """

    def __init__(
        self,
        consumer: Any,
        valve: BodyValve,
        clock: Any,
        stall_close_secs: float,
        model: str = "",
        context: RequestContext | None = None,
    ) -> None:
        """
        @param consumer: The client's response, as a consumer on an HTTP
            channel (L{blazar.gateway.context.IClient.consumer}; headers
            may be out already).
        @param valve: The engine body's valve.
        @param clock: C{IReactorTime} for the stall timer.
        @param stall_close_secs: Seconds a client may stay paused before
            its connection is aborted; 0 or less never aborts.
        @param model: For the log line.
        @param context: The request's context (its error kind, trace id).
        """
        self._request = consumer
        self._context = context
        self._valve = valve
        self._clock = clock
        self._stall_close_secs = stall_close_secs
        self._model = model
        self._timer: IDelayedCall | None = None
        self._drain_waiters: list[Deferred[None]] = []
        self._reading: Deferred[None] | None = None
        self._registered = False
        self.paused = False
        self.stalled = False
        self.gone = False

    def register(self) -> bool:
        """
        Become the request's producer, if it can have one (a request on a
        live HTTP channel, with no producer yet).

        @return: Whether it registered.
        """
        request = self._request
        if getattr(request, "channel", None) is None or getattr(request, "producer", None) is not None:
            return False
        request.registerProducer(self, True)
        self._registered = True
        pin_send_buffer(getattr(request, "transport", None))
        return True

    def unregister(self) -> None:
        """
        The stream is over: stop being the request's producer and drop the
        stall timer (idempotent).
        """
        self._cancel_timer()
        if self._registered:
            self._registered = False
            if getattr(self._request, "channel", None) is not None:
                self._request.unregisterProducer()

    def follow(self, reading: Deferred[None]) -> None:
        """
        The relay of the engine's body (L{blazar.engines.client.relay_body}):
        cancelled, which closes the engine connection, if the client's
        connection is lost and nothing else has cancelled it a reactor turn
        later (Klein cancels the handler at once).
        """
        self._reading = reading

    def drained(self) -> Deferred[None]:
        """
        Fires once the client has taken what was written (at once unless
        paused); a stall aborts the connection instead, and the handler's
        cancellation cancels this.
        """
        waiter: Deferred[None] = Deferred()
        if not self.paused or self.gone:
            waiter.callback(None)
        else:
            self._drain_waiters.append(waiter)
        return waiter

    # -- IPushProducer, called by the client's transport ----------------------

    def pauseProducing(self) -> None:
        # called again on every write while the buffer is full: the stall
        # timer runs from the first
        if self.paused or self.gone:
            return
        self.paused = True
        self._valve.pause()
        if self._stall_close_secs > 0:
            self._timer = self._clock.callLater(self._stall_close_secs, self._stall)

    def resumeProducing(self) -> None:
        if not self.paused or self.gone:
            return
        self.paused = False
        self._cancel_timer()
        self._valve.resume()
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.called:  # (one whose relay was cancelled)
                waiter.callback(None)

    def stopProducing(self) -> None:
        # the connection is lost; the client's finished signal (IClient.finished) errback
        # (delivered right after this) cancels the handler, which closes
        # the engine connection. Until then, read nothing more.
        if self.gone:
            return
        self.gone = True
        self._cancel_timer()
        self._valve.pause()
        self._clock.callLater(0, self._client_gone)

    # -- internals --------------------------------------------------------------

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _client_gone(self) -> None:
        reading, self._reading = self._reading, None
        if reading is not None and not reading.called:
            reading.cancel()
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.called:
                waiter.cancel()

    def _stall(self) -> None:
        self._timer = None
        if self.gone:
            return
        self.stalled = True
        request = self._request
        note_error(self._context, "client_stalled")
        log.warn(
            "client stopped reading the {model} stream for stream_stall_close_secs = {secs} s; "
            "closing its connection and freeing the slot",
            model=self._model,
            secs=f"{self._stall_close_secs:g}",
            trace_id=trace_id_of(self._context),
        )
        transport = getattr(request, "transport", None)
        if transport is None:
            return
        abort = getattr(transport, "abortConnection", None)
        if abort is not None:
            abort()
        else:
            transport.loseConnection()
