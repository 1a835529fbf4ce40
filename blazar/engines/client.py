"""
HTTP/1.1 to engine children, over Blazar's own connection pool.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectError, ConnectionAborted, ConnectionLost
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web._newclient import (
    HTTP11ClientProtocol,
    Request,
    RequestNotSent,
    RequestTransmissionFailed,
    ResponseNeverReceived,
)
from twisted.web.client import Agent, HTTPConnectionPool, _HTTP11ClientFactory
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import Interface, implementer

from blazar.engines.wire import RequestHeads, RequestNotRead, WirePool, peer_closed
from blazar.httpbody import read_body

__all__ = ["EngineClient", "IEngineClient", "NotDelivered", "RequestNotRead", "StaleConnection", "peer_closed"]


class _CheckedClientProtocol(HTTP11ClientProtocol):
    """
    An HTTP/1.1 client connection that tells a request its child can no
    longer read from one it may have read.

    Written onto the connection of a child that has closed it (it exited),
    a request fails with the same clean close as one the child read and
    then died on. So a connection whose peer has closed it takes no request
    (L{RequestNotSent}, the connection is dropped); otherwise the request
    is sent at once, not on the reactor's next turn, and the connection
    looked at again: closed already, the child closed it before the request
    arrived, and a failure without an answer is L{RequestNotRead}. A close
    that comes later is a reset if the child never read the request (the
    kernel resets a socket closed with bytes unread) and clean if it did.
    """

    def request(self, request: Request) -> Deferred[IResponse]:
        transport = self.transport
        if self.state != "QUIESCENT" or transport is None:
            return super().request(request)
        if peer_closed(transport):
            transport.loseConnection()
            return fail(RequestNotSent())
        d = super().request(request)
        flush = getattr(transport, "doWrite", None)  # IWriteDescriptor
        if flush is not None:
            flush()  # (a failed send is the reactor's to report, on its next turn)
        if peer_closed(transport):

            def not_read(failure: Failure) -> None:
                failure.trap(ResponseNeverReceived)
                raise RequestNotRead("the child had closed the connection") from None

            d.addErrback(not_read)
        return d


class QuietConnectionPool(HTTPConnectionPool):
    """
    A connection pool whose connection factories do not log "Starting
    factory" / "Stopping factory" for every new connection, and whose
    connections check that the child has not closed them before each
    request (L{_CheckedClientProtocol}).
    """

    class _factory(_HTTP11ClientFactory):
        noisy = False

        def buildProtocol(self, addr: Any) -> HTTP11ClientProtocol:
            return _CheckedClientProtocol(self._quiescentCallback)


class StaleConnection(Exception):
    """
    A request on a kept-alive connection failed at once, before any
    answer: the connection was closed under it.

    @ivar error: What the HTTP client raised.
    """

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(str(error))


class NotDelivered(Exception):
    """
    A request failed in a way that proves the engine cannot have taken it
    (L{never_delivered}): the connection was refused, or never written
    to, or reset before any answer.

    @ivar error: What the HTTP client raised.
    """

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(str(error))


def never_delivered(error: BaseException) -> bool:
    """
    Whether a request that failed with C{error} cannot have been read whole
    by the engine: the connect failed (C{ConnectError}: refused, timed
    out), the request was never written (L{RequestNotSent}), reached a
    connection the child had closed (L{RequestNotRead}) or was not written
    whole (L{RequestTransmissionFailed}), or its connection was reset
    before any response byte (L{ResponseNeverReceived} for a
    C{ConnectionLost}): the kernel resets a socket that is closed with
    bytes unread, or that is already closed when bytes arrive, while a
    child that read the request and then died closes cleanly
    (C{ConnectionDone}). A local abort (C{ConnectionAborted}: a timeout, a
    cancellation) proves nothing.
    """
    if isinstance(error, ConnectError):
        return True
    reasons = getattr(error, "reasons", None) or []
    if any(r.check(CancelledError, ConnectionAborted) for r in reasons):
        return False
    if isinstance(error, (RequestNotSent, RequestNotRead, RequestTransmissionFailed)):
        return True
    if isinstance(error, ResponseNeverReceived):
        return any(r.check(ConnectionLost) for r in reasons)
    return False


@implementer(IAgentEndpointFactory)
class _LoopbackEndpoints:
    """
    Endpoints for the URLs the gateway asks: a plain TCP endpoint for
    C{http://127.0.0.1:<port>} (engine children: no name resolution
    thread, no Happy Eyeballs); for a remote (C{[[remotes]]}), a host name
    endpoint, wrapped in TLS (the system's trust roots, the host name
    checked) for C{https}.
    """

    def __init__(self, reactor: Any, timeout: float) -> None:
        self._reactor = reactor
        self._timeout = timeout

    def endpointForURI(self, uri: Any) -> Any:
        host = uri.host.decode("ascii")
        if uri.scheme == b"https":
            from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
            from twisted.internet.ssl import optionsForClientTLS

            return wrapClientTLS(
                optionsForClientTLS(host), HostnameEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
            )
        if _is_ipv4(host):
            return TCP4ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        from twisted.internet.endpoints import HostnameEndpoint

        return HostnameEndpoint(self._reactor, host, uri.port, timeout=self._timeout)


def _is_ipv4(host: str) -> bool:
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return host.count(".") == 3


@implementer(IBodyProducer)
class _BytesProducer:
    """
    A request body that is all in memory: written at once.
    """

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(self._body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class IEngineClient(Interface):
    """
    HTTP requests from the gateway to its engine children on 127.0.0.1.
    """

    async def get_status(url: str, timeout: float = 2.0) -> int:
        """
        GET C{url}, discard the body, return the status code.

        @raise Exception: Connection errors, or a cancellation after
            C{timeout} seconds.
        """

    async def get(
        url: str,
        headers: dict[bytes, list[bytes]],
        timeout: float = 5.0,
        max_bytes: int = 1 << 20,
    ) -> tuple[int, bytes]:
        """
        GET C{url} (a child's C{/health}, C{/metrics}): its status and body
        (at most C{max_bytes}).
        """

    async def request(
        method: str,
        url: str,
        body: bytes | None,
        headers: dict[bytes, list[bytes]],
        stream: bool = True,
    ) -> IResponse:
        """
        Send one request; return as soon as the response headers arrive
        (the caller reads or discards the body). C{stream}: the child
        streams its answer (a connection of its own).

        @raise NotDelivered: The child cannot have taken it.
        @raise StaleConnection: A kept connection failed at once.
        """

    async def close() -> None:
        """
        Drop every cached connection (on daemon stop).
        """


@implementer(IEngineClient)
class EngineClient:
    """
    Requests to children on 127.0.0.1, and to remotes.

    Non-streamed requests go over kept-alive connections (llama-server
    keeps them for 5 s and 100 requests; Blazar drops its idle ones after
    L{IDLE_CONNECTION_SECS}, before the child does): a new connection per
    request was Blazar's largest cost per request. A request that fails on
    a kept connection at once, before any answer, raises L{StaleConnection}:
    the caller resends it on a fresh connection if the child is alive (it
    closed an idle connection, so it never saw the request), and reports a
    crash if not. A request the engine cannot have taken (L{never_delivered})
    raises L{NotDelivered}, whatever the connection: the caller may send
    it again, to a fresh child if this one has exited. Neither is raised
    once any byte of the answer has come.

    Streamed requests do not leave their connection to another request:
    llama-server closes a connection after a streamed reply while
    announcing keep-alive. A stream takes the connection opened ahead for
    it (and one is opened for the next), else a kept one, else a new one.

    Children (C{http://} to an IPv4 address) are spoken to by
    L{blazar.engines.wire}: one write per request, llhttp's parser, a pool
    of its own. Remotes (C{https}, host names) go through Twisted's
    C{Agent}. Responses are unbuffered so that streams can be relayed as
    they arrive.
    """

    IDLE_CONNECTION_SECS = 2
    # a kept connection the child had closed fails at once
    STALE_WINDOW_SECS = 0.05

    def __init__(self, reactor: Any, connect_timeout: float = 5.0) -> None:
        self._reactor: IReactorTime = reactor
        self._pool = QuietConnectionPool(reactor, persistent=False)
        self._pool.retryAutomatically = False
        # remotes: a host name endpoint (TLS for https) and the bare Agent
        # (no cookie, redirect or decoding wrappers)
        endpoints = _LoopbackEndpoints(reactor, connect_timeout)
        self._fresh = Agent.usingEndpointFactory(reactor, endpoints, pool=self._pool)
        self._kept_pool = QuietConnectionPool(reactor, persistent=True)
        self._kept_pool.retryAutomatically = False
        self._kept_pool.maxPersistentPerHost = 64
        self._kept_pool.cachedConnectionTimeout = self.IDLE_CONNECTION_SECS
        self._kept = Agent.usingEndpointFactory(reactor, endpoints, pool=self._kept_pool)
        # children
        self._wire = WirePool(reactor, connect_timeout, self.IDLE_CONNECTION_SECS)
        self._heads = RequestHeads()
        self._targets: dict[str, tuple[tuple[str, int], bytes] | None] = {}

    def _target(self, url: str) -> tuple[tuple[str, int], bytes, bytes] | None:
        """
        C{((host, port), Host header, path)} of a child's C{url}
        (C{http://<IPv4>:<port>/...}), or L{None} for a remote's.
        """
        end = url.find("/", 8)
        base = url if end < 0 else url[:end]
        try:
            known = self._targets[base]
        except KeyError:
            known = None
            if base.startswith("http://"):
                host, _, port = base[7:].partition(":")
                if _is_ipv4(host) and port.isdigit():
                    known = ((host, int(port)), base[7:].encode("ascii"))
            if len(self._targets) > 1024:
                self._targets.clear()
            self._targets[base] = known
        if known is None:
            return None
        return known[0], known[1], url[len(base) :].encode("utf-8") or b"/"

    async def get_status(self, url: str, timeout: float = 2.0) -> int:
        """
        GET C{url}, discard the body, return the status code.

        @raise Exception: Connection errors, or C{CancelledError} after
            C{timeout} seconds.
        """
        return (await self.get(url, {}, timeout, max_bytes=1 << 16))[0]

    async def get(
        self,
        url: str,
        headers: dict[bytes, list[bytes]],
        timeout: float = 5.0,
        max_bytes: int = 1 << 20,
    ) -> tuple[int, bytes]:
        """
        GET C{url} (a child's C{/health}, C{/metrics}) over a fresh
        connection (a probe never meets a stale one): its status and body
        (at most C{max_bytes}).

        @raise Exception: Connection errors, L{BodyTooLarge}, or
            C{CancelledError} after C{timeout} seconds without headers.
        """
        target = self._target(url)
        d: Deferred[IResponse]
        if target is None:
            d = self._fresh.request(b"GET", url.encode("ascii"), Headers(headers), None)
        else:
            d = Deferred.fromCoroutine(self._send(target, b"GET", None, headers, stream=False, fresh=True))
        timer = self._reactor.callLater(timeout, d.cancel)
        try:
            response: IResponse = await d
        finally:
            if timer.active():
                timer.cancel()
        try:
            body = await read_body(response, self._reactor, idle_timeout=timeout, max_bytes=max_bytes)
        except PotentialDataLoss:
            # an HTTP/1.0 server that ends its body by closing (Python's
            # http.server: mlx_lm.server): the status stands, the body is
            # not trusted (a probe needs only the status)
            body = b""
        return int(response.code), body

    async def _send(
        self,
        target: tuple[tuple[str, int], bytes, bytes],
        method: bytes,
        body: bytes | None,
        headers: dict[bytes, list[bytes]],
        stream: bool,
        fresh: bool = False,
    ) -> IResponse:
        """
        One request to a child over L{blazar.engines.wire}; on a new
        connection, closed after it, when C{fresh}.

        @raise StaleConnection: It failed at once, before any answer, on a
            kept connection (or on any, for a reply read whole: as the
            Agent-based client did, which could not tell).
        """
        key, host, path = target
        has_body = body is not None or method == b"POST"
        head = self._heads.build(method, host, path, headers, has_body)
        if body is not None:
            data = b"".join((head, b"%d\r\n\r\n" % len(body), body))
        elif has_body:
            data = head + b"0\r\n\r\n"
        else:
            data = head
        taken = self._wire.connect(key) if fresh else self._wire.take(key, stream)
        connection = await taken if isinstance(taken, Deferred) else taken
        sent = self._reactor.seconds()
        try:
            return await connection.request(data, keep=not stream and not fresh)
        except (ResponseNeverReceived, RequestNotSent, RequestNotRead) as e:
            if (
                (connection.reused or not stream)
                and not fresh
                and self._reactor.seconds() - sent < self.STALE_WINDOW_SECS
                and not never_delivered(e)
                and not any(r.check(CancelledError) for r in getattr(e, "reasons", []))
            ):
                if connection.reused:
                    self._wire.forget(key)  # (the others kept as long may be closed too)
                raise StaleConnection(e) from None
            raise

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: dict[bytes, list[bytes]],
        stream: bool = True,
    ) -> IResponse:
        """
        Send one request and return as soon as the response headers arrive;
        the caller reads (or discards) the body.

        @param stream: The child will stream its answer (its connection
            serves no other request); L{False} for a reply read whole (a
            kept connection).
        """
        target = self._target(url)
        sent = self._reactor.seconds()
        try:
            if target is not None:
                return await self._send(target, method.encode("ascii"), body, headers, stream)
            agent = self._fresh if stream else self._kept
            return await agent.request(
                method.encode("ascii"),
                url.encode("utf-8"),
                Headers(headers),
                _BytesProducer(body) if body is not None else None,
            )
        except (
            ConnectError,
            ResponseNeverReceived,
            RequestTransmissionFailed,
            RequestNotSent,
            RequestNotRead,
        ) as e:
            if any(r.check(CancelledError) for r in getattr(e, "reasons", [])):
                raise
            if never_delivered(e):
                raise NotDelivered(e) from None
            if target is None and not stream and self._reactor.seconds() - sent < self.STALE_WINDOW_SECS:
                raise StaleConnection(e) from None
            raise

    async def close(self) -> None:
        """
        Drop every cached connection (on daemon stop).
        """
        self._wire.close()
        await self._pool.closeCachedConnections()
        await self._kept_pool.closeCachedConnections()
