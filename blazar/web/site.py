"""
The HTTP site shared by every surface: trace ids, the access log, and the
door: what is decided from a request's headers, before any of its body is
read.

As soon as a request's headers are in (C{HTTPChannel.allHeadersReceived}
calls L{BlazarRequest.gotLength}), in this order:

 1. a connection over C{max_connections_per_ip} (clients on loopback or a
    UNIX socket are not counted) is answered 503 with C{Retry-After: 1};
 2. the body limit: a C{Content-Length} over C{max_body_bytes} is 413;
 3. the API key (L{AuthGate.authenticate}): C{Authorization} or
    C{x-api-key} sent twice is 400, a missing or wrong key 401; a request
    let in without a key (the open routes) may send L{OPEN_BODY_BYTES}.
    On the private batch listener's site (C{batch_secret} set) it is
    L{AuthGate.authenticate_batch_line} instead: the daemon's own Batch API
    lines, as the key each names.

C{POST /v1/files} (a Batch API upload) may send L{UPLOAD_BODY_BYTES},
OpenAI's 200 MB and its form, whatever C{max_body_bytes}; C{POST
/api/blobs/...} (a model's GGUF for C{/api/create}, with an unscoped key,
or on a gateway without keys from loopback only, as its surface's
L{blazar.web.auth.check_admin} rules) may send C{max_blob_bytes}, and its
body is spooled into the Ollama store's C{blobs/} directory
(L{blazar.models.create.upload_spool}), where it becomes the blob by a
link once its sha256 is checked.

Each is answered in its surface's error shape with the body unread: the
channel is told the body is empty (so the request is handed on at once)
and not to keep the connection, and C{Expect: 100-continue} gets no C{100}.
A body that is read is kept in memory up to L{BODY_IN_MEMORY} bytes and
spooled to a temporary file beyond that, so only requests with a key (or
any, when auth is off) can make Blazar write one. A chunked body is cut as
soon as it passes the limit: 413, and the connection closed.

Deadlines, on the site's reactor: a request's headers must be complete
within C{header_timeout} seconds of its first byte (of the connection's
opening, for its first request; a connection that sends nothing in that
time is closed without an answer), and a body gets C{header_timeout}
seconds plus one more for every C{body_min_rate} bytes it has delivered
(Apache's mod_reqtimeout rule). Missing either is a 408, and the
connection is closed. Idle kept-alive connections are twisted.web's: 60 s.

Headers over L{HEADER_BYTES} in all (or a line over it, or more than 500
of them) get 431, a request line over it 414, and what twisted.web cannot
parse 400, each with a JSON body in the surface's shape when the path is
known. Every status goes out with its reason phrase (L{reason_phrase}).

After a refusal Blazar closes the connection gracefully (RFC 9112, section
9.6): it half-closes it after the answer and discards what the client
still sends, for at most L{LINGER_SECS} seconds and L{LINGER_BYTES} bytes,
so a client still writing its request reads the answer instead of a reset.
"""

from __future__ import annotations

import re
import secrets
import time
from http import HTTPStatus
from io import BytesIO
from tempfile import SpooledTemporaryFile
from typing import IO, Any, Callable, cast

from twisted.internet import tcp
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, HTTPChannel, datetimeToString, unquote
from twisted.web.http_headers import Headers
from twisted.web.resource import IResource, _IEncodingResource
from twisted.web.server import Request, Site
from twisted.web.server import version as SERVER_VERSION

from blazar.config import Config
from blazar.gateway.batch import FILE_MAX_BYTES
from blazar.gateway.context import RequestContext, key_of, trace_id_of
from blazar.gateway.errors import Forbidden, Refused, TooManyConnections, describe
from blazar.logtext import RENDERED
from blazar.models.create import upload_spool
from blazar.web.auth import (
    AuthGate,
    Refusal,
    check_keyless_management,
    is_local,
    render_refusal,
    surface_of,
    ui_headers,
)
from blazar.web.client import context_of
from blazar.web.errors import envelope

log = Logger()

TRACE_HEADER = b"x-blazar-trace-id"
_CLIENT_TRACE = re.compile(rb"[A-Za-z0-9._-]{8,64}")

BODY_IN_MEMORY = 1024 * 1024
"""Bytes of a request body kept in memory; a longer one is spooled to a temporary file."""

OPEN_BODY_BYTES = 64 * 1024
"""The body limit of a request let in without a key (the open routes, while keys exist)."""

UPLOAD_BODY_BYTES = FILE_MAX_BYTES + 1024 * 1024
"""The body limit of C{POST /v1/files} (a Batch API file of up to 200 MB and its form), whatever C{max_body_bytes}."""

BLOBS_PATH = b"/api/blobs/"
"""Model blob uploads (C{POST /api/blobs/sha256:<hex>}): up to C{max_blob_bytes}, spooled into the store."""

HEADER_BYTES = 16 * 1024
"""The request line and headers together, at most (also the longest line)."""

LINGER_SECS = 2.0
LINGER_BYTES = 1024 * 1024
"""How long, and how much of what a refused client still sends, is read and dropped."""

_REASONS = {499: b"Client Closed Request", 529: b"Overloaded"}

_date: tuple[int, bytes] = (-1, b"")


def http_date() -> bytes:
    """
    The C{Date} header's value now (RFC 9110's IMF-fixdate, as
    L{twisted.web.http.datetimeToString} makes it), made once a second.
    """
    global _date
    second = int(time.time())
    if _date[0] != second:
        _date = (second, datetimeToString(second))
    return _date[1]


def reason_phrase(code: int) -> bytes:
    """
    The reason phrase for status C{code}: RFC 9110's (and 6585's 429 and
    431, which twisted.web's table lacks and sends as C{Unknown Status}),
    nginx's 499 and Anthropic's 529.
    """
    if code in _REASONS:
        return _REASONS[code]
    try:
        return HTTPStatus(code).phrase.encode("ascii")
    except ValueError:
        return RESPONSES.get(code, b"Unknown Status")


def too_large(limit: int, keyed: bool, upload: bool = False, blob: bool = False) -> Refused:
    """
    The 413 for a body over C{limit} bytes.

    @param keyed: Whether C{max_body_bytes} is the limit (else the request
        came without a key to an open route).
    @param upload: A Batch API file upload (C{POST /v1/files}), whose limit
        is OpenAI's 200 MB.
    @param blob: A model blob's upload (C{POST /api/blobs/...}), whose
        limit is C{max_blob_bytes}.
    """
    if blob and keyed:
        return Refused(
            413,
            "too_large",
            (
                f"blob upload too large: the limit is max_blob_bytes = {limit} bytes; raise it in the config if this "
                "is intended"
            ),
            code="request_too_large",
        )
    if upload and keyed:
        return Refused(
            413,
            "too_large",
            (
                f"file upload too large: a file may be at most 200 MB ({FILE_MAX_BYTES} bytes), "
                f"the whole upload at most {limit} bytes"
            ),
            code="file_too_large",
        )
    if keyed:
        message = (
            f"request body too large: the limit is max_body_bytes = {limit} bytes; "
            "raise it in the config if this is intended"
        )
    else:
        message = f"request body too large: a request without an API key may send at most {limit} bytes"
    return Refused(413, "too_large", message, code="request_too_large")


def send_now(transport: Any, data: bytes) -> None:
    """
    Write C{data} to C{transport}, sent at once when nothing written before
    it waits (a stream's chunk: one C{send}, no reactor turn between).

    Twisted's TCP transport buffers every write until the reactor's next
    turn, which costs a poll and two C{epoll_ctl} calls per relayed chunk.
    On a plain TCP or UNIX connection with an empty buffer, this sends
    directly; what the socket does not take, and anything on another
    transport (TLS, a test's), goes through C{transport.write} as before. A
    send that fails is left for the transport to find: the bytes go to its
    buffer, and its own write reports the lost connection.
    """
    if (
        isinstance(transport, tcp.Connection)
        and transport.connected
        and not transport.disconnecting
        and not transport.dataBuffer
        and not transport._tempDataBuffer
    ):
        try:
            sent = transport.socket.send(data)
        except OSError:  # (EAGAIN, or a lost connection the transport reports)
            sent = 0
        if sent == len(data):
            return
        data = data[sent:]
    transport.write(data)


def flush_now(transport: Any) -> None:
    """
    Send what C{transport} holds now (a finished answer), not on the
    reactor's next turn: a plain TCP or UNIX connection that is not
    closing; anything else is left to the reactor. A failed send stays
    with the transport, which reports it on the reactor's next turn.
    """
    if (
        isinstance(transport, tcp.Connection)
        and transport.connected
        and not transport.disconnecting
        and not transport._writeDisconnecting
        and (transport.dataBuffer or transport._tempDataBuffer)
    ):
        transport.doWrite()


class BlazarRequest(Request):
    """
    A request decided at the door (see the module docstring).

    @ivar blazar: The request's L{RequestContext}; its C{trace_id} is
        C{plm-<hex>-<seq>} (or a well-formed id the client sent in
        C{x-blazar-trace-id}) naming this request in logs and in the
        C{x-blazar-trace-id} response header.
    @ivar refusal: Set at the door, or when the body broke a limit or a
        deadline: L{process} answers it instead of passing the request on.
    @ivar body_limit: Bytes this request's body may have (L{None}: no
        limit, on a channel that is not a L{BlazarChannel}).
    """

    client_gone = False
    refusal: Refusal | None = None
    body_limit: int | None = None
    _keyed = True
    _upload = False
    _blob = False  # a model blob's upload (POST /api/blobs/...): max_blob_bytes, spooled into the store

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blazar = RequestContext()

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        super().setResponseCode(code, reason_phrase(code) if message is None else message)

    def write(self, data: bytes) -> None:
        """
        Once the headers are out, a chunk of a chunked body is one write of
        one C{bytes}; else L{Request.write}. (Twisted writes a chunk as a
        sequence of four, each checked and buffered: a stream writes one
        per relayed event.)
        """
        if (
            self.startedWriting
            and self.chunked
            and data
            and not self.finished
            and not self._disconnected
            and self._encoder is None
        ):
            self.sentLength += len(data)
            send_now(self.channel.transport, b"%x\r\n%b\r\n" % (len(data), data))
            return
        super().write(data)

    def finish(self) -> None:
        """
        L{Request.finish}, and what it leaves unsent sent now (L{flush_now}),
        not on the reactor's next turn.
        """
        channel = self.channel
        super().finish()
        if channel is not None:
            flush_now(channel.transport)

    def gotLength(self, length: int | None) -> None:
        channel = self.channel
        if not isinstance(channel, BlazarChannel):
            super().gotLength(length)
            return
        refusal, spool = self._at_the_door(channel, length)
        if refusal is not None:
            self.refusal = refusal
            channel.refuse_body(self)
            length = 0
        if spool and (length is None or length > BODY_IN_MEMORY):
            # a blob goes into the store's own directory, so that naming it is a link, not a copy
            store = upload_spool(channel.site.config().resolved_ollama_models) if self._blob else None
            self.content = store or cast(IO[bytes], SpooledTemporaryFile(max_size=BODY_IN_MEMORY))
        else:
            self.content = BytesIO()

    def _at_the_door(self, channel: BlazarChannel, length: int | None) -> tuple[Refusal | None, bool]:
        """
        The connection cap, C{max_body_bytes}, auth, then the open routes'
        smaller limit, from the headers. (A body over C{max_body_bytes} is
        a 413 before auth, as it was before auth moved to the headers: a
        client without a key gets no further than one with a key.)

        @return: The refusal, if any, and whether the body may be spooled.
        """
        site = channel.site
        # what requestReceived sets, known since the request line
        self.method, self.uri = channel.request_line()
        self.path = self.uri.split(b"?", 1)[0]
        if channel.over_cap:
            return TooManyConnections(
                f"too many connections from {channel.counted_as}: at most max_connections_per_ip = "
                f"{site.max_connections_per_ip} at once; reuse or close idle ones"
            ), False
        self.body_limit = site.max_body_bytes
        if self.method == b"POST" and self.path == b"/v1/files":
            self.body_limit, self._upload = max(self.body_limit, UPLOAD_BODY_BYTES), True
        elif (
            self.method == b"POST"
            and self.path.startswith(BLOBS_PATH)
            and ((site.gate is not None and site.gate.active) or self._manages_keyless())
        ):
            self.body_limit, self._blob = max(self.body_limit, site.config().max_blob_bytes), True
        if length is not None and length > self.body_limit:
            return too_large(self.body_limit, True, self._upload, self._blob), False
        if site.gate is None:
            return None, True
        secret = site.batch_secret
        found = site.gate.authenticate(self) if secret is None else site.gate.authenticate_batch_line(self, secret)
        self.blazar.door, self.blazar.door_asked = found, True
        self.blazar.batch_line = secret is not None
        if isinstance(found, Refusal):
            return found, False
        if self._blob and found is not None and not found.admin:
            # (a scoped key may not upload blobs: no more than any request, then the 403)
            self.body_limit, self._blob = site.max_body_bytes, False
            if length is not None and length > self.body_limit:
                return too_large(self.body_limit, True), False
        if found is None and site.gate.active:  # an open route, without a key
            self.body_limit, self._keyed = min(site.max_body_bytes, OPEN_BODY_BYTES), False
            if length is not None and length > self.body_limit:
                return too_large(self.body_limit, False), False
        return None, self._keyed

    def _manages_keyless(self) -> bool:
        """
        Whether a request to a gateway without keys may manage it
        (L{check_keyless_management}, as its surface will ask): only such
        a blob upload gets C{max_blob_bytes} and the store's spool; one
        from the network is refused there, and must not fill the disk
        before it is.
        """
        try:
            check_keyless_management(self, "take model blobs")
        except Forbidden:
            return False
        return True

    def handleContentChunk(self, data: bytes) -> None:
        if self.refusal is not None:
            return
        limit = self.body_limit
        if limit is not None and self.content is not None and self.content.tell() + len(data) > limit:
            # a chunked body past the limit: answered as soon as this read is parsed
            self.refusal = too_large(limit, self._keyed, self._upload, self._blob)
            self.content.seek(0)
            self.content.truncate()
            if isinstance(self.channel, BlazarChannel):
                self.channel.end_body_after_this_read()
            return
        super().handleContentChunk(data)

    def connectionLost(self, reason: Any) -> None:
        # a client that left before its response was finished still gets
        # its access-log (and audit) line, with nginx's 499 "client closed
        # request" as its status
        if not self.finished and self.blazar.started is not None:
            self.client_gone = True
            site = getattr(self.channel, "site", None)
            if site is not None:
                site.log(self)
        super().connectionLost(reason)

    def process(self) -> None:
        site = self.channel.site  # type: ignore[attr-defined]
        context = self.blazar
        context.started = site.reactor.seconds()
        offered = self.getHeader(TRACE_HEADER)
        if offered is not None and offered.startswith(b"batch_") and getattr(site, "batch_secret", None) is None:
            offered = None  # the Batch API's lines' ids (batch_ID.LINE) come from the private listener only
        if offered is not None and _CLIENT_TRACE.fullmatch(offered):
            context.trace_id = offered.decode("ascii")  # a well-formed client id is echoed
        else:
            context.trace_id = site.new_trace_id()
        self.setHeader(TRACE_HEADER, context.trace_id.encode("ascii"))
        if surface_of(self.path) == "ui":
            ui_headers(self)  # on every dashboard response: its page, data, errors, refusals, preflights
        refusal = self.refusal
        origin = self.getHeader(b"origin")
        allowed = getattr(site, "cors_origins", ())
        if origin is not None and allowed and ("*" in allowed or origin.decode("latin-1") in allowed):
            # on every response, errors included
            self.setHeader(b"access-control-allow-origin", b"*" if "*" in allowed else origin)
            self.setHeader(b"vary", b"Origin")
            self.setHeader(
                b"access-control-expose-headers",
                TRACE_HEADER + b", request-id, retry-after, "
                b"x-blazar-cache, x-blazar-sentinel, x-blazar-ignored, x-blazar-queue-ms",
            )
            if self.method == b"OPTIONS" and refusal is None:
                self.setHeader(b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS")
                requested = self.getHeader(b"access-control-request-headers")
                self.setHeader(b"access-control-allow-headers", requested or b"authorization, content-type, x-api-key")
                self.setHeader(b"access-control-max-age", b"600")
                self.setResponseCode(204)
                self.finish()
                return
        if self.method == b"OPTIONS" and refusal is None:
            self.setResponseCode(204)
            self.finish()
            return
        observer = site.observer
        if observer is not None and self.path.startswith((b"/v1/", b"/api/", b"/ui/api/")):
            observer.started(self, surface_of(self.path))
        if refusal is not None:
            body = render_refusal(self, refusal)
            self.setHeader(b"content-length", b"%d" % len(body))
            self.write(body)
            self.finish()
            return
        self._render_resource(site)

    def _render_resource(self, site: Any) -> None:
        """
        L{twisted.web.server.Request.process}, with the C{Date} header made
        once a second (L{http_date}), not formatted per request: find the
        resource and render it.
        """
        self.site = site
        self.setHeader(b"server", SERVER_VERSION)
        self.setHeader(b"date", http_date())
        self.prepath = []
        self.postpath = list(map(unquote, self.path[1:].split(b"/")))
        if self.path == b"*":
            self._handleStar()
            return
        try:
            found = site.getResourceFor(self)
            if _IEncodingResource.providedBy(found):
                encoder = found.getEncoder(self)
                if encoder is not None:
                    self._encoder = encoder
            self.render(found)
        except BaseException:
            self.processingFailed(Failure())


class BlazarChannel(HTTPChannel):
    """
    HTTP/1.1 with the door's deadlines, the connection cap, 431 and 414 for
    oversized heads, and a graceful close after a refusal.

    @ivar over_cap: This connection was over C{max_connections_per_ip} when
        it opened: its request is answered 503.
    @ivar counted_as: The client address this connection counts against,
        or L{None} (loopback, UNIX socket, no cap).
    """

    site: BlazarSite  # set by Site.buildProtocol
    totalHeadersSize = HEADER_BYTES
    MAX_LENGTH = HEADER_BYTES
    over_cap = False
    counted_as: str | None = None
    _deadline: IDelayedCall | None = None
    _body_started = 0.0
    _body_bytes = 0
    _end_body = False
    _refused = False
    _lingering: IDelayedCall | None = None
    _lingered = 0

    def request_line(self) -> tuple[bytes, bytes]:
        """
        The method and URI of the request being received.
        """
        return self._command, self._path

    def writeHeaders(self, version: bytes, code: bytes, reason: bytes, headers: Any) -> None:
        """
        The response head as L{HTTPChannel.writeHeaders} makes it, written
        as one C{bytes} (Twisted writes it as a sequence of four pieces per
        header, each checked and buffered).
        """
        if not isinstance(headers, Headers):
            super().writeHeaders(version, code, reason, headers)
            return
        parts = [version, b" ", code, b" ", reason, b"\r\n"]
        for name, values in headers.getAllRawHeaders():
            for value in values:
                parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        self.transport.write(b"".join(parts))  # type: ignore[union-attr]

    # -- what a connection's requests ask of it again and again ---------------

    _host: Any = None
    _peer: Any = None
    _secure: bool | None = None

    def getHost(self) -> Any:
        """
        The local address, asked of the socket once per connection (each
        request asks: a system call and a new address object each time).
        """
        if self._host is None:
            self._host = super().getHost()
        return self._host

    def getPeer(self) -> Any:
        """
        The client's address, made once per connection.
        """
        if self._peer is None:
            self._peer = super().getPeer()
        return self._peer

    def isSecure(self) -> bool:
        """
        Whether the connection is TLS, decided once per connection (an
        interface adaptation per ask: Klein asks for every request).
        """
        if self._secure is None:
            self._secure = bool(super().isSecure())
        return self._secure

    # -- connections and deadlines -----------------------------------------

    def connectionMade(self) -> None:
        super().connectionMade()
        site = self.site
        peer = self.transport.getPeer()  # type: ignore[union-attr]
        if site.max_connections_per_ip and not is_local(peer):
            self.counted_as = str(getattr(peer, "host", peer))
            self.over_cap = site.connection_opened(self.counted_as) > site.max_connections_per_ip
        self._expect_headers()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_deadline()
        if self._lingering is not None and self._lingering.active():
            self._lingering.cancel()
        if self.counted_as is not None:
            self.site.connection_closed(self.counted_as)
            self.counted_as = None
        super().connectionLost(reason)

    def dataReceived(self, data: bytes) -> None:
        if self._deadline is None and self.line_mode and not self._handlingRequest:
            self._expect_headers()  # the first bytes of a next request on a kept connection
        super().dataReceived(data)

    def requestDone(self, request: Any) -> None:
        super().requestDone(request)
        # a pipelined request whose first bytes came while this one was served
        if (
            self.persistent
            and self._deadline is None
            and self.line_mode
            and not self._handlingRequest
            and (self._buffer or self.requests)
        ):
            self._expect_headers()

    def _arm(self, delay: float, call: Callable[[], None]) -> None:
        self._cancel_deadline()
        self._deadline = self.site.reactor.callLater(delay, call)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            if self._deadline.active():
                self._deadline.cancel()
            self._deadline = None

    def _expect_headers(self) -> None:
        self._arm(self.site.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._deadline = None
        if not self.requests and not self._buffer:
            self.timeoutConnection()  # not a byte of a request: nothing to answer
            return
        self._refuse_now(
            Refused(
                408,
                "timeout",
                (f"the request's headers did not arrive within header_timeout_secs = {self.site.header_timeout:g} s"),
                code="request_timeout",
            )
        )

    def allHeadersReceived(self) -> None:
        self._cancel_deadline()
        super().allHeadersReceived()
        if self.length != 0 and not self._refused:  # a body follows
            self._body_started = self.site.reactor.seconds()
            self._body_bytes = 0
            self._arm(self.site.header_timeout, self._body_check)

    def allContentReceived(self) -> None:
        self._cancel_deadline()
        self._end_body = False
        super().allContentReceived()

    def _body_check(self) -> None:
        self._deadline = None
        site = self.site
        due = self._body_started + site.header_timeout + self._body_bytes / site.body_min_rate
        now = site.reactor.seconds()
        if now < due:
            self._deadline = site.reactor.callLater(due - now, self._body_check)
            return
        self._refuse_now(
            Refused(
                408,
                "timeout",
                (
                    f"the request body came slower than body_min_bytes_per_sec = {site.body_min_rate} "
                    f"(after the first header_timeout_secs = {site.header_timeout:g} s)"
                ),
                code="request_timeout",
            )
        )

    def rawDataReceived(self, data: bytes) -> None:
        if not self._handlingRequest:
            self._body_bytes += len(data)
        super().rawDataReceived(data)
        if self._end_body and not self._handlingRequest and not self._refused:
            self._end_body_now()

    # -- oversized and malformed heads -------------------------------------

    def lineReceived(self, line: bytes) -> None:
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._head_too_large()
            return
        super().lineReceived(line)

    def headerReceived(self, line: bytes) -> bool:
        if self._receivedHeaderCount >= self.maxHeaders:
            self._head_too_large()
            return False
        return bool(super().headerReceived(line))

    def lineLengthExceeded(self, line: bytes) -> None:
        self._head_too_large()

    def _head_too_large(self) -> None:
        if self.requests and hasattr(self, "_command"):
            self._refuse_now(
                Refused(
                    431,
                    "headers_too_large",
                    (
                        f"request headers too large: at most {self.totalHeadersSize} bytes "
                        f"and {self.maxHeaders} header lines"
                    ),
                    code="request_header_fields_too_large",
                )
            )
        else:
            self._answer_raw(
                Refused(
                    414,
                    "headers_too_large",
                    (f"request line too long: at most {self.MAX_LENGTH} bytes"),
                    code="uri_too_long",
                )
            )

    def _respondToBadRequestAndDisconnect(self) -> None:
        # twisted.web's own refusals (a malformed request line, header or
        # chunk, two Content-Lengths, ...): a bare 400 before
        self._answer_raw(Refused(400, "bad_request", "malformed HTTP request", code="bad_request"))

    # -- refusing ------------------------------------------------------------

    def refuse_body(self, request: BlazarRequest) -> None:
        """
        C{request}'s body will not be read: the channel takes it as empty,
        closes the connection after the answer and sends no C{100 Continue}.
        """
        self._refused = True
        self.length = 0
        self.persistent = False
        request.requestHeaders.removeHeader(b"expect")
        request.responseHeaders.setRawHeaders(b"connection", [b"close"])

    def end_body_after_this_read(self) -> None:
        """
        The request's body broke its limit: once the bytes in hand are
        parsed, the request is answered as if its body had ended.
        """
        self._end_body = True

    def _refuse_now(self, refusal: Refusal) -> None:
        """
        Answer the request being received with C{refusal} and close: through
        the request (trace id, access log, the surface's shape) once its
        request line is known, else on the bare connection.
        """
        if self._refused:
            return
        if self.requests and hasattr(self, "_command") and not self._handlingRequest:
            request = cast(BlazarRequest, self.requests[-1])
            request.refusal = refusal
            self._end_body_now()
        else:
            self._answer_raw(refusal)

    def _end_body_now(self) -> None:
        request = cast(BlazarRequest, self.requests[-1])
        self.refuse_body(request)
        if request.content is None:  # refused before its headers were complete
            request.content = BytesIO()
        self.allContentReceived()

    def _answer_raw(self, refusal: Refusal) -> None:
        """
        Answer C{refusal} on the connection itself (no request to answer it
        through), in the surface's shape if the path is known, and close.
        """
        if self._refused:
            return
        self._refused = True
        self.persistent = False
        self._cancel_deadline()
        path = getattr(self, "_path", b"").split(b"?", 1)[0]
        problem = describe(refusal)
        status, body = envelope(surface_of(path), problem)
        assert self.transport is not None  # a request being read has its connection
        self.transport.write(
            b"".join(
                [
                    b"HTTP/1.1 %d %s\r\n" % (status, reason_phrase(status)),
                    b"Content-Type: application/json\r\n",
                    TRACE_HEADER + b": " + self.site.new_trace_id().encode("ascii") + b"\r\n",
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body),
                    body,
                ]
            )
        )
        log.info(
            "{status} before a request: {why} (client {peer})",
            status=status,
            why=problem.message,
            peer=str(self.transport.getPeer()),
        )
        self.loseConnection()

    def loseConnection(self) -> None:
        if self._lingering is not None:
            return  # already closing
        transport = self.transport
        # TCP and UNIX transports can half-close; TLS cannot (and its
        # wrapper only forwards the attribute, which the class lookup skips)
        if not self._refused or not hasattr(type(transport), "loseWriteConnection"):
            super().loseConnection()
            return
        self.setTimeout(None)
        # what is still parsed of the last read, and what comes after, is dropped
        self.dataReceived = self.lineReceived = self.rawDataReceived = self._discard  # type: ignore[method-assign,assignment]
        transport.unregisterProducer()  # type: ignore[union-attr]  # so the half-close is not held up
        transport.resumeProducing()  # type: ignore[union-attr]
        transport.loseWriteConnection()  # type: ignore[union-attr]  # FIN once the answer is out
        self._lingering = self.site.reactor.callLater(LINGER_SECS, self._stop_lingering)

    def _discard(self, data: bytes) -> None:
        self._lingered += len(data)
        if self._lingered > LINGER_BYTES:
            self._stop_lingering()

    def _stop_lingering(self) -> None:
        if self._lingering is not None and self._lingering.active():
            self._lingering.cancel()
        self.transport.abortConnection()  # type: ignore[union-attr]


class BlazarSite(Site):
    """
    The one Site on every listener.

    @ivar max_body_bytes: Request bodies above this are refused with 413.
    @ivar gate: Decides each request's key from its headers, before its body
        is read (L{None}: no auth at the door, as in tests of the site alone).
    @ivar header_timeout: Seconds a request's headers may take (and the
        head start of its body).
    @ivar body_min_rate: Bytes a second a body must keep up, on average.
    @ivar max_connections_per_ip: Open connections per client address (0:
        no limit); loopback and UNIX-socket clients are not counted.
    @ivar batch_secret: Set only on the site of the private batch listener
        (L{blazar.gateway.batch}): every request there must carry it, and
        runs as the key its batch line names
        (L{AuthGate.authenticate_batch_line}). L{None} on every public
        listener's site, where the batch headers are not honoured.
    """

    requestFactory = BlazarRequest
    protocol = BlazarChannel  # type: ignore[assignment]  # HTTP/1.1 only (no h2 here)

    def __init__(
        self,
        resource: IResource,
        *,
        max_body_bytes: int = 50 * 1024 * 1024,
        cors_origins: tuple[str, ...] = (),
        gate: AuthGate | None = None,
        header_timeout: float = 10.0,
        body_min_rate: int = 4096,
        max_connections_per_ip: int = 64,
        config: Callable[[], Config] | None = None,
        **kwargs: Any,
    ) -> None:
        """
        @param config: The live config (L{blazar.config.LiveConfig}), read
            per connection and per request; without it, a fixed one from the
            other keywords (for a site built alone).
        """
        # every surface takes JSON: no form parsing (twisted.web would parse
        # each POST's content-type with the email package to look for forms)
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(resource, **kwargs)
        if config is None:
            fixed = Config(
                max_body_bytes=max_body_bytes,
                cors_origins=cors_origins,
                header_timeout=header_timeout,
                body_min_bytes_per_sec=body_min_rate,
                max_connections_per_ip=max_connections_per_ip,
            )
            config = lambda: fixed  # noqa: E731
        self.config = config
        self.gate = gate
        self._connections: dict[str, int] = {}
        self.trace_prefix = secrets.token_hex(4)
        self.trace_seq = 0
        self.audit: Any = None
        self.observer: Any = None  # a blazar.web.observe.RequestObserver
        self.batch_secret: bytes | None = None

    @property
    def max_body_bytes(self) -> int:
        return self.config().max_body_bytes

    @property
    def cors_origins(self) -> tuple[str, ...]:
        return self.config().cors_origins

    @property
    def header_timeout(self) -> float:
        return self.config().header_timeout

    @property
    def body_min_rate(self) -> int:
        return self.config().body_min_bytes_per_sec

    @property
    def max_connections_per_ip(self) -> int:
        return self.config().max_connections_per_ip

    def new_trace_id(self) -> str:
        """
        The next C{plm-<hex>-<seq>} trace id.
        """
        self.trace_seq += 1
        return f"plm-{self.trace_prefix}-{self.trace_seq}"

    def connection_opened(self, address: str) -> int:
        """
        Count a connection from C{address}; return how many are open from it.
        """
        count = self._connections[address] = self._connections.get(address, 0) + 1
        return count

    def connection_closed(self, address: str) -> None:
        count = self._connections.pop(address, 1) - 1
        if count > 0:
            self._connections[address] = count

    def log(self, request: Request) -> None:  # type: ignore[override]
        # One structured access event per request (replaces the combined log).
        context = context_of(request)
        started = context.started
        ms = (self.reactor.seconds() - started) * 1000 if started is not None else 0.0
        key = key_of(context)
        event = {
            "method": request.method.decode("ascii", "replace"),
            "path": request.path.decode("ascii", "replace"),
            "status": 499 if getattr(request, "client_gone", False) else request.code,
            "ms": round(ms, 1),
            "bytes": request.sentLength,
            "key": key.name if key is not None else "",
            "trace": trace_id_of(context),
            "model": context.model or "",
        }
        if context.sentinel:
            event["sentinel"] = list(context.sentinel)
        if context.audio_seconds is not None:
            event["audio_seconds"] = round(context.audio_seconds or 0.0, 2)
        if context.images:
            event["images"] = context.images
        if context.remote is not None:
            event["remote"] = context.remote
        if context.cache is not None:
            event["cache"] = context.cache  # the semantic cache: hit, miss, bypass, error
        # made once here: formatting it field by field in every observer
        # was a tenth of the daemon's CPU per request (blazar.logtext)
        log.info(
            RENDERED,
            rendered=f"{event['method']} {event['path']} {event['status']} {event['bytes']} "
            f"{event['ms']}ms model={event['model']} key={event['key']} trace={event['trace']}",
            **event,
        )
        if self.audit is not None:
            self.audit.submit(event)
