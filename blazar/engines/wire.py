"""
HTTP/1.1 to engine children at the protocol level: the lean path of
L{blazar.engines.client.EngineClient} for plain C{http} to an IPv4 address
(a child on loopback).

A request is one C{transport.write} of a head built once per child and
path (only its C{Content-Length} is per request) and its body; the answer's
status line, headers and framing (C{Content-Length}, chunked with its
extensions and trailers, or a body ended by the close) are parsed by
llhttp (C{httptools}), and the body goes to the reader as it comes, without
a copy. A small pool per child keeps idle connections for reuse and one
connection opened ahead for the next stream.

What the reader sees is L{twisted.web.iweb.IResponse} as Twisted's client
gives it (L{WireResponse}), and a request fails with the exceptions
Twisted's client raises for the same thing (L{ResponseNeverReceived},
L{ResponseFailed}, L{RequestNotSent}, C{ConnectError}, and
L{RequestNotRead}), with the same C{reasons}: what
L{blazar.engines.client.never_delivered} reads to tell a request the
child cannot have taken.
"""

from __future__ import annotations

import socket
from collections import deque
from typing import Any, Callable

import httptools
from OpenSSL import SSL
from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.internet.error import ConnectingCancelledError
from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.internet.protocol import ClientFactory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web._newclient import RequestNotSent, ResponseFailed, ResponseNeverReceived, _DataLoss
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers, _nameEncoder
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse
from zope.interface import implementer

#: the most bytes of status line and headers an answer may have
MAX_HEAD_BYTES = 64 * 1024

#: bytes of a body kept for a reader that has not called deliverBody yet,
#: past which the connection is no longer read until it does
MAX_EARLY_BODY = 256 * 1024


def peer_closed(transport: Any) -> bool:
    """
    Whether the other end of C{transport}'s TCP connection has closed or
    reset it although the reactor may not have read that yet (it is in the
    kernel): one non-blocking C{MSG_PEEK} read of the socket
    (C{getHandle()}). Bytes nobody asked for count as closed too: the
    connection is not at a request boundary.
    """
    handle = getattr(transport, "getHandle", lambda: None)()
    if isinstance(handle, SSL.Connection):
        return False  # a TLS connection's handle (to a remote) is OpenSSL's: peeking it reads TLS records
    recv = getattr(handle, "recv", None)
    if recv is None:
        return False
    try:
        recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False  # open, and quiet
    except OSError:
        return True  # reset
    return True  # end of stream, or stray bytes


class RequestNotRead(Exception):
    """
    The child had closed the connection before the request reached it: a
    close was in the kernel right after the request was sent (on loopback
    a send arrives at once), and no byte of an answer came.
    """


class ResponseHeadTooLarge(Exception):
    """
    The answer's status line and headers were over L{MAX_HEAD_BYTES}.
    """


def _probe_headers() -> bool:
    # Headers keeps its values by the name as _nameEncoder writes it (Twisted
    # 24-26); filled directly, a response's Headers costs one dict
    probe = Headers()
    probe.addRawHeader(b"x-probe", b"1")
    return probe._rawHeaders == {_nameEncoder.encode(b"x-probe"): [b"1"]}


_DIRECT_HEADERS = _probe_headers()


def _headers(raw: list[tuple[bytes, bytes]]) -> Headers:
    """
    A L{Headers} of C{raw} (name, value) pairs, as cheaply as this Twisted
    allows.
    """
    headers = Headers()
    if not _DIRECT_HEADERS:
        for name, value in raw:
            headers.addRawHeader(name, value)
        return headers
    encode, values = _nameEncoder.encode, headers._rawHeaders
    for name, value in raw:
        key = encode(name)
        have = values.get(key)
        if have is None:
            values[key] = [value]
        else:
            have.append(value)
    return headers


@implementer(IPushProducer)
class _BodyTransport:
    """
    What a reader of a L{WireResponse}'s body gets as its transport:
    pausing stops reading the connection, stopping closes it (the child
    stops its work). Once the body ended, all three do nothing.
    """

    def __init__(self, response: WireResponse) -> None:
        self._response = response

    def pauseProducing(self) -> None:
        response = self._response
        if response._connection is not None and not response._ended:
            response._connection._pause_reader(True)

    def resumeProducing(self) -> None:
        response = self._response
        if response._connection is not None and not response._ended:
            response._connection._pause_reader(False)

    def stopProducing(self) -> None:
        response = self._response
        if response._connection is not None and not response._ended:
            response._connection._stop(response)


@implementer(IResponse)
class WireResponse:
    """
    An answer's status and headers; its body goes to the protocol given
    to L{deliverBody} (what came before is kept and given first).

    @ivar length: The body's C{Content-Length}, or C{UNKNOWN_LENGTH}
        (chunked, or ended by the close).
    """

    request: object = None  # (the client-side IClientRequest: none kept)
    previousResponse: IResponse | None = None

    def __init__(
        self,
        connection: EngineConnection,
        version: tuple[bytes, int, int],
        code: int,
        phrase: bytes,
        headers: Headers,
        length: int | object,
        close_delimited: bool,
    ) -> None:
        self.version = version
        self.code = code
        self.phrase = phrase
        self.headers = headers
        self.length = length
        self._close_delimited = close_delimited
        self._connection: EngineConnection | None = connection
        self._reader: Any = None
        self._early: list[bytes] = []
        self._early_bytes = 0
        self._ended = False
        self._end: Failure | None = None

    def setPreviousResponse(self, response: IResponse) -> None:
        self.previousResponse = response

    def deliverBody(self, protocol: Any) -> None:
        """
        Give the body to C{protocol}: C{makeConnection} with a transport
        that pauses, resumes and stops the reading
        (L{twisted.internet.interfaces.IPushProducer}), the body by
        C{dataReceived}, then C{connectionLost}: L{ResponseDone} when it is
        whole, L{PotentialDataLoss} for a body that ended by a close, else
        L{ResponseFailed}.
        """
        if self._reader is not None:
            raise RuntimeError("the body of a response is delivered once")
        protocol.makeConnection(_BodyTransport(self))
        early, self._early = self._early, []
        for data in early:
            protocol.dataReceived(data)
        self._reader = protocol
        if self._ended:
            end, self._end = self._end, None
            protocol.connectionLost(end)
        elif self._connection is not None and self._early_bytes > MAX_EARLY_BODY:
            self._connection._hold(False)

    def _data(self, data: bytes) -> None:
        reader = self._reader
        if reader is not None:
            reader.dataReceived(data)
            return
        self._early.append(data)
        self._early_bytes += len(data)
        if self._early_bytes > MAX_EARLY_BODY and self._connection is not None:
            self._connection._hold(True)

    def _finish(self, reason: Failure) -> None:
        if self._ended:
            return
        self._ended = True
        self._connection = None
        reader = self._reader
        if reader is None:
            self._end = reason
        else:
            self._reader = _Done
            reader.connectionLost(reason)


class _Done:
    @staticmethod
    def dataReceived(data: bytes) -> None:
        pass


class EngineConnection(Protocol):
    """
    One HTTP/1.1 connection to a child: a request at a time
    (L{request}), answers parsed as they come (several in one read are
    each given to their request in turn).

    @ivar reused: Whether it waited in the pool before its current request.
    @ivar idle_since: When it last became idle (clock seconds).
    """

    def __init__(self, released: Callable[[EngineConnection], None], lost: Callable[[EngineConnection], None]) -> None:
        self._released = released
        self._lost = lost
        self._parser = httptools.HttpResponseParser(self)
        self._waiters: deque[Deferred[WireResponse]] = deque()
        self._keep: deque[bool] = deque()
        self._body: WireResponse | None = None  # whose body is being read
        self._phrase: list[bytes] = []
        self._raw: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._received = False  # a byte of the awaited answer came
        self._not_read = False
        self._interim = False
        self._gone = False
        self._held = False  # an unread early body
        self._paused = False  # the reader paused
        self._failed: Failure | None = None
        self.reused = False
        self.idle_since = 0.0
        self._made: Deferred[EngineConnection] | None = None

    def connectionMade(self) -> None:
        made, self._made = self._made, None
        if made is None:
            return
        if made.called:  # (cancelled meanwhile)
            self._abort()
        else:
            made.callback(self)

    # -- the request side

    def usable(self) -> bool:
        """
        Whether a request may be written on it now: connected, at a request
        boundary, and the child has not closed it (L{peer_closed}).
        """
        if self._gone or self.transport is None or self._body is not None or self._waiters:
            return False
        return not peer_closed(self.transport)

    def request(self, data: bytes, keep: bool) -> Deferred[WireResponse]:
        """
        Write one request (head and body, C{data}) at once, and look at
        the connection again right after: a child that had closed it did
        not read the request (L{RequestNotRead}, if no answer comes).
        Requests written while answers are awaited are pipelined: answers
        go to requests in order.

        @param keep: Whether the connection may serve another request once
            this answer is whole (and the child allows it).
        @return: Fires with the answer once its headers came; fails with
            L{RequestNotSent} (the connection was closed: nothing written),
            L{RequestNotRead}, L{ResponseNeverReceived} (closed before any
            byte of an answer, C{reasons} the close) or L{ResponseFailed}
            (closed or malformed mid-head). Cancelled, the connection is
            closed and it fails with C{ResponseNeverReceived([CancelledError])}.
        """
        transport = self.transport
        if self._gone or transport is None or peer_closed(transport):
            if transport is not None:
                transport.loseConnection()
            return fail(RequestNotSent())
        d: Deferred[WireResponse] = Deferred(self._cancel)
        first = not self._waiters and self._body is None
        self._waiters.append(d)
        self._keep.append(keep)
        transport.write(data)
        flush = getattr(transport, "doWrite", None)  # IWriteDescriptor
        if first and flush is not None:
            flush()  # now, not on the reactor's next turn (a failed send is the reactor's to report)
            if peer_closed(transport):
                self._not_read = True
        return d

    def _cancel(self, d: Deferred[WireResponse]) -> None:
        if d in self._waiters:
            self._waiters.remove(d)
            self._abort()
            d.errback(Failure(ResponseNeverReceived([Failure(CancelledError())])))

    def _abort(self) -> None:
        self._gone = True
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    # -- the reader's controls

    def _set_reading(self) -> None:
        if self.transport is None or self._gone:
            return
        if self._held or self._paused:
            self.transport.pauseProducing()  # type: ignore[attr-defined]
        else:
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def _hold(self, held: bool) -> None:
        if self._held != held:
            self._held = held
            self._set_reading()

    def _pause_reader(self, paused: bool) -> None:
        if self._paused != paused:
            self._paused = paused
            self._set_reading()

    def _stop(self, response: WireResponse) -> None:
        # the reader of an unfinished body stops it: close the connection,
        # so that the child stops its work
        self._abort()

    # -- the answer side

    def dataReceived(self, data: bytes) -> None:
        if self._failed is not None:
            return
        if self._body is None:
            if not self._waiters:
                self._malformed(Failure(ValueError("bytes the child sent unasked")))
                return
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__ if isinstance(e.__context__, Exception) else e
            self._malformed(Failure(cause))
            return
        except httptools.HttpParserError as e:
            self._malformed(Failure(e))
            return
        if self._body is None and self._head_bytes > MAX_HEAD_BYTES:
            self._malformed(Failure(ResponseHeadTooLarge(f"an answer's head over {MAX_HEAD_BYTES} bytes")))

    def on_message_begin(self) -> None:
        self._received = True  # (a byte of an answer)
        self._phrase = []
        self._raw = []

    def on_status(self, status: bytes) -> None:
        self._phrase.append(status)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._body is None:  # (else a trailer)
            self._raw.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        code = parser.get_status_code()
        if 100 <= code < 200 and code != 101:
            self._interim = True  # 100 Continue and the like: the answer follows
            return
        raw, self._raw = self._raw, []
        size = sum(len(name) + len(value) + 4 for name, value in raw)
        if size > MAX_HEAD_BYTES:
            raise ResponseHeadTooLarge(f"an answer's headers over {MAX_HEAD_BYTES} bytes")
        length: int | object = UNKNOWN_LENGTH
        chunked = False
        for name, value in raw:
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = chunked or b"chunked" in value.lower()
        if chunked:
            length = UNKNOWN_LENGTH
        if code in (204, 304):
            length = 0
        major, _, minor = parser.get_http_version().partition(".")
        response = WireResponse(
            self,
            (b"HTTP", int(major), int(minor or 0)),
            code,
            b"".join(self._phrase),
            _headers(raw),
            length,
            length is UNKNOWN_LENGTH and not chunked,
        )
        if not self._waiters:
            raise ResponseFailed([Failure(ValueError("an answer to no request"))])
        self._body = response
        self._head_bytes = 0
        self._waiters.popleft().callback(response)

    def on_body(self, body: bytes) -> None:
        if self._body is not None:
            self._body._data(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        response, self._body = self._body, None
        keep = self._keep.popleft() if self._keep else False
        self._received = self._not_read = False
        if self._held or self._paused:  # (the reader's: the next answer is read)
            self._held = self._paused = False
            self._set_reading()
        if response is None:
            return
        if self._waiters:
            pass  # (pipelined: the next answer is awaited)
        elif keep and self._parser.should_keep_alive() and not self._gone:
            self._released(self)
        else:
            # not kept: a streamed answer's. llama-server closes the
            # connection after a stream although it announces keep-alive
            # (seen on llama-server b11434: "Keep-Alive: timeout=5,
            # max=100", the chunked body's end, then its close)
            self._gone = True
            if self.transport is not None:
                self.transport.loseConnection()
        response._finish(Failure(ResponseDone()))

    def _malformed(self, reason: Failure) -> None:
        self._failed = reason
        self._abort()
        failed = Failure(ResponseFailed([reason]))
        self._fail_all(failed, failed)

    def _fail_all(self, waiting: Failure, body: Failure) -> None:
        waiters, self._waiters = self._waiters, deque()
        for d in waiters:
            d.errback(waiting)
        response, self._body = self._body, None
        if response is not None:
            response._finish(body)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._gone = True
        self._lost(self)
        if self._failed is not None:
            return
        response, self._body = self._body, None
        if response is not None:
            if response._close_delimited:
                # a body without a length ends with the connection, as
                # Twisted's client reports it: whole, maybe
                response._finish(Failure(PotentialDataLoss()))
            else:
                response._finish(Failure(ResponseFailed([reason, Failure(_DataLoss())])))
        waiters, self._waiters = self._waiters, deque()
        for d in waiters:
            if self._received:
                d.errback(Failure(ResponseFailed([reason])))
            elif self._not_read:
                d.errback(Failure(RequestNotRead("the child had closed the connection")))
            else:
                d.errback(Failure(ResponseNeverReceived([reason])))


class _ConnectFactory(ClientFactory):
    noisy = False

    def __init__(self, pool: WirePool, key: tuple[str, int]) -> None:
        self._pool = pool
        self._key = key
        self.connected: Deferred[EngineConnection] = Deferred(self._cancel)
        self.connector: Any = None

    def _cancel(self, d: Deferred[EngineConnection]) -> None:
        if self.connector is not None and getattr(self.connector, "state", "connecting") == "connecting":
            self.connector.stopConnecting()  # (clientConnectionFailed after: ignored)
        if not d.called:
            # as Twisted's endpoints report it (the Agent path did)
            d.errback(ConnectingCancelledError(IPv4Address("TCP", *self._key)))

    def buildProtocol(self, addr: Any) -> EngineConnection:
        connection = EngineConnection(self._pool._release, self._pool._drop)
        connection._made = self.connected
        return connection

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        if not self.connected.called:
            self.connected.errback(reason)


class WirePool:
    """
    Connections to children by C{(host, port)}: up to C{max_idle} idle
    ones kept per child for C{idle_secs} (dropped before the child drops
    them: llama-server keeps one 5 s), the most recent used first; and one
    spare opened ahead for the next stream, since the child closes the
    connection of each stream. A kept connection the child has closed is
    seen (L{peer_closed}) and dropped before a request is written on it.
    """

    def __init__(self, reactor: Any, connect_timeout: float, idle_secs: float, max_idle: int = 64) -> None:
        self._reactor = reactor
        self._connect_timeout = connect_timeout
        self._idle_secs = idle_secs
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], list[EngineConnection]] = {}
        self._spares: dict[tuple[str, int], EngineConnection] = {}
        self._opening: dict[tuple[str, int], Deferred[EngineConnection]] = {}
        self._sweeps: dict[tuple[str, int], IDelayedCall] = {}
        self._keys: dict[EngineConnection, tuple[str, int]] = {}
        self._closed = False

    def connect(self, key: tuple[str, int]) -> Deferred[EngineConnection]:
        """
        A new connection to C{key}; fails with C{ConnectError} (refused,
        timed out) or, cancelled, C{ConnectingCancelledError}.
        """
        factory = _ConnectFactory(self, key)
        factory.connector = self._reactor.connectTCP(key[0], key[1], factory, timeout=self._connect_timeout)

        def made(connection: EngineConnection) -> EngineConnection:
            self._keys[connection] = key
            return connection

        return factory.connected.addCallback(made)

    def take(self, key: tuple[str, int], stream: bool) -> EngineConnection | Deferred[EngineConnection]:
        """
        A connection to C{key} for one request: a stream takes the spare
        (and a new spare is opened), then the most recent idle connection;
        else a new one.
        """
        connection = None
        if stream:
            spare = self._spares.pop(key, None)
            if spare is not None and spare.usable() and not self._expired(spare):
                connection = spare
            elif spare is not None:
                spare.transport.loseConnection()  # type: ignore[union-attr]
        if connection is None:
            idle = self._idle.get(key)
            while idle:
                candidate = idle.pop()
                if candidate.usable():
                    connection = candidate
                    break
                candidate.transport.loseConnection()  # type: ignore[union-attr]
        taken: EngineConnection | Deferred[EngineConnection]
        if connection is not None:
            connection.reused = True
            taken = connection
        else:
            taken = self.connect(key)
        if stream and not self._closed:
            self._open_spare(key)
        return taken

    def _expired(self, connection: EngineConnection) -> bool:
        return self._reactor.seconds() - connection.idle_since >= self._idle_secs

    def _open_spare(self, key: tuple[str, int]) -> None:
        if key in self._spares or key in self._opening:
            return
        self._opening[key] = opening = self.connect(key)

        def opened(connection: EngineConnection) -> None:
            del self._opening[key]
            if self._closed or key in self._spares:
                connection.transport.loseConnection()  # type: ignore[union-attr]
                return
            connection.idle_since = self._reactor.seconds()
            self._spares[key] = connection
            self._sweep_later(key)

        def failed(reason: Failure) -> None:
            # (the next stream connects itself, and reports what fails)
            self._opening.pop(key, None)

        opening.addCallbacks(opened, failed)

    def _release(self, connection: EngineConnection) -> None:
        key = self._keys.get(connection)
        if key is None or self._closed:
            connection._gone = True
            connection.transport.loseConnection()  # type: ignore[union-attr]
            return
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self._max_idle:
            connection._gone = True
            connection.transport.loseConnection()  # type: ignore[union-attr]
            return
        connection.idle_since = self._reactor.seconds()
        idle.append(connection)
        self._sweep_later(key)

    def _sweep_later(self, key: tuple[str, int]) -> None:
        if key not in self._sweeps:
            self._sweeps[key] = self._reactor.callLater(self._idle_secs, self._sweep, key)

    def _sweep(self, key: tuple[str, int]) -> None:
        # one timer per child, not per request: drops what idled too long
        del self._sweeps[key]
        now, oldest = self._reactor.seconds(), None
        idle = self._idle.get(key, [])
        while idle and now - idle[0].idle_since >= self._idle_secs:
            idle.pop(0).transport.loseConnection()  # type: ignore[union-attr]
        if idle:
            oldest = idle[0].idle_since
        spare = self._spares.get(key)
        if spare is not None:
            if now - spare.idle_since >= self._idle_secs:
                del self._spares[key]
                spare.transport.loseConnection()  # type: ignore[union-attr]
            else:
                oldest = spare.idle_since if oldest is None else min(oldest, spare.idle_since)
        if oldest is not None:
            self._sweeps[key] = self._reactor.callLater(oldest + self._idle_secs - now, self._sweep, key)
        elif not idle:
            self._idle.pop(key, None)

    def _drop(self, connection: EngineConnection) -> None:
        key = self._keys.pop(connection, None)
        if key is None:
            return
        idle = self._idle.get(key)
        if idle and connection in idle:
            idle.remove(connection)
        if self._spares.get(key) is connection:
            del self._spares[key]

    def forget(self, key: tuple[str, int]) -> None:
        """
        Close C{key}'s idle connections and spare (one of them was found
        closed under a request: the others may be too).
        """
        for connection in self._idle.pop(key, []):
            connection.transport.loseConnection()  # type: ignore[union-attr]
        spare = self._spares.pop(key, None)
        if spare is not None:
            spare.transport.loseConnection()  # type: ignore[union-attr]

    def close(self) -> None:
        """
        Close every idle connection and spare; open no more spares.
        """
        self._closed = True
        for key in list(self._idle) + list(self._spares):
            self.forget(key)
        for opening in list(self._opening.values()):
            opening.cancel()
        for timer in self._sweeps.values():
            if timer.active():
                timer.cancel()
        self._sweeps.clear()


class RequestHeads:
    """
    Request heads built once per child, method, path and headers: the
    request line, C{Host}, the given headers and C{Content-Length: }
    waiting for its number.
    """

    MAX = 512

    def __init__(self) -> None:
        self._heads: dict[Any, bytes] = {}

    def build(
        self, method: bytes, host: bytes, path: bytes, headers: dict[bytes, list[bytes]], has_body: bool
    ) -> bytes:
        """
        The head (ending in C{"Content-Length: "} when C{has_body}, else in
        the blank line).
        """
        key = (method, host, path, has_body, *((name, *values) for name, values in headers.items()))
        head = self._heads.get(key)
        if head is None:
            lines = [method + b" " + path + b" HTTP/1.1", b"Host: " + host]
            for name, values in headers.items():
                if name.lower() in (b"host", b"content-length", b"connection", b"transfer-encoding"):
                    continue
                for value in values:
                    if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name:
                        raise ValueError(f"a header with a line break: {name!r}")
                    lines.append(name + b": " + value)
            head = b"\r\n".join(lines) + (b"\r\nContent-Length: " if has_body else b"\r\n\r\n")
            if len(self._heads) >= self.MAX:
                self._heads.clear()
            self._heads[key] = head
        return head
