"""
The HTTP site shared by every surface: trace ids, the access log, request
and request body limits.

The body limit comes before auth and before any surface: a request whose
C{Content-Length} is over C{max_body_bytes} is answered 413 (in its
surface's error shape) as soon as its headers are in, and its connection is
closed after that answer without reading the body (a client that sent
C{Expect: 100-continue} gets no C{100} and never sends it). A chunked body
that grows past the limit is dropped as it arrives and answered 413 once it
ends.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from twisted.logger import Logger
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from blazar.web.auth import error_body, surface_of

log = Logger()

TRACE_HEADER = b"x-blazar-trace-id"
_CLIENT_TRACE = re.compile(rb"[A-Za-z0-9._-]{8,64}")


class BlazarRequest(Request):
    """
    A request whose body is capped: bytes past C{site.max_body_bytes} are
    dropped, and L{body_too_large} tells the surface to answer 413.

    @ivar trace_id: C{plm-<hex>-<seq>} (or a well-formed id the client sent
        in C{x-blazar-trace-id}) naming this request in logs and in the
        C{x-blazar-trace-id} response header.
    """

    body_too_large = False
    client_gone = False
    trace_id = ""
    started: float | None = None

    def gotLength(self, length: int | None) -> None:
        limit = getattr(getattr(self.channel, "site", None), "max_body_bytes", None)
        if limit is not None and length is not None and length > limit:
            self.body_too_large = True
            length = 0
            self._refuse_body()
        super().gotLength(length)

    def _refuse_body(self) -> None:
        """
        The headers announced a body over the limit (called from
        C{HTTPChannel.allHeadersReceived}, before it looks at the length
        and at C{Expect}): the channel is told the body is empty, so it
        hands the request on at once (L{process} answers 413), and not to
        keep the connection, so it closes after the answer with the body
        unread. Dropping C{Expect: 100-continue} keeps the channel from
        inviting the body.
        """
        channel = self.channel
        if not isinstance(channel, HTTPChannel):
            return  # HTTP/2: the body is dropped as it arrives (handleContentChunk)
        channel.length = 0
        channel.persistent = False
        self.requestHeaders.removeHeader(b"expect")
        self.responseHeaders.setRawHeaders(b"connection", [b"close"])

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_too_large:
            return
        limit = getattr(getattr(self.channel, "site", None), "max_body_bytes", None)
        if limit is not None and self.content is not None:
            if self.content.tell() + len(data) > limit:
                self.body_too_large = True
                self.content.seek(0)
                self.content.truncate()
                return
        super().handleContentChunk(data)

    def connectionLost(self, reason: Any) -> None:
        # a client that left before its response was finished still gets
        # its access-log (and audit) line, with nginx's 499 "client closed
        # request" as its status
        if not self.finished and self.started is not None:
            self.client_gone = True
            site = getattr(self.channel, "site", None)
            if site is not None:
                site.log(self)
        super().connectionLost(reason)

    def process(self) -> None:
        site = self.channel.site  # type: ignore[union-attr,attr-defined]
        self.started = site.reactor.seconds()
        offered = self.getHeader(TRACE_HEADER)
        if offered is not None and _CLIENT_TRACE.fullmatch(offered):
            self.trace_id = offered.decode("ascii")  # a well-formed client id is echoed
        else:
            site.trace_seq += 1
            self.trace_id = f"plm-{site.trace_prefix}-{site.trace_seq}"
        self.setHeader(TRACE_HEADER, self.trace_id.encode("ascii"))
        origin = self.getHeader(b"origin")
        allowed = getattr(site, "cors_origins", ())
        if origin is not None and allowed and ("*" in allowed or origin.decode("latin-1") in allowed):
            # on every response, errors included
            self.setHeader(b"access-control-allow-origin", b"*" if "*" in allowed else origin)
            self.setHeader(b"vary", b"Origin")
            self.setHeader(b"access-control-expose-headers", TRACE_HEADER + b", request-id, retry-after")
            if self.method == b"OPTIONS":
                self.setHeader(b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS")
                requested = self.getHeader(b"access-control-request-headers")
                self.setHeader(b"access-control-allow-headers", requested or b"authorization, content-type, x-api-key")
                self.setHeader(b"access-control-max-age", b"600")
                self.setResponseCode(204)
                self.finish()
                return
        if self.method == b"OPTIONS":
            self.setResponseCode(204)
            self.finish()
            return
        observer = site.observer
        if observer is not None and (self.path.startswith(b"/v1/") or self.path.startswith(b"/api/")):
            observer.started(self, surface_of(self.path))
        if self.body_too_large:
            self._too_large(site.max_body_bytes)
            return
        super().process()

    def _too_large(self, limit: int) -> None:
        """
        Answer 413 in the surface's error shape, before auth: a client
        without a key gets no further than one with a key.
        """
        surface = surface_of(self.path)
        self.blazar_error = "too_large"
        self.setResponseCode(413)
        self.setHeader(b"content-type", b"application/json")
        if surface == "anthropic":
            self.setHeader(b"request-id", ("req_" + self.trace_id).encode("ascii"))
        body = error_body(surface, 413, (
            f"request body too large: the limit is max_body_bytes = {limit} bytes; "
            "raise it in the config if this is intended"
        ))
        self.setHeader(b"content-length", b"%d" % len(body))
        self.write(body)
        self.finish()


class BlazarSite(Site):
    """
    The one Site on every listener.

    @ivar max_body_bytes: Request bodies above this are not kept; the
        surface answers 413 in its own error shape.
    """

    requestFactory = BlazarRequest

    def __init__(
        self, resource: IResource, *, max_body_bytes: int, cors_origins: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        # every surface takes JSON: no form parsing (twisted.web would parse
        # each POST's content-type with the email package to look for forms)
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(resource, **kwargs)
        self.max_body_bytes = max_body_bytes
        self.cors_origins = cors_origins
        self.trace_prefix = secrets.token_hex(4)
        self.trace_seq = 0
        self.audit: Any = None
        self.observer: Any = None  # a blazar.web.observe.RequestObserver

    def log(self, request: Request) -> None:  # type: ignore[override]
        # One structured access event per request (replaces the combined log).
        started = getattr(request, "started", None)
        ms = (self.reactor.seconds() - started) * 1000 if started is not None else 0.0
        key = getattr(request, "blazar_key", None)
        event = {
            "method": request.method.decode("ascii", "replace"),
            "path": request.path.decode("ascii", "replace"),
            "status": 499 if getattr(request, "client_gone", False) else request.code,
            "ms": round(ms, 1), "bytes": request.sentLength,
            "key": key.name if key is not None else "", "trace": getattr(request, "trace_id", ""),
            "model": getattr(request, "blazar_model", None) or "",
        }
        log.info(
            "{method} {path} {status} {bytes} {ms}ms model={model} key={key} trace={trace}", **event,
        )
        if self.audit is not None:
            self.audit.submit(event)
