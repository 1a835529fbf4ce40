"""
The HTTP site shared by every surface: trace ids, the access log, request
and request body limits.
"""

from __future__ import annotations

import secrets
from typing import Any

from twisted.logger import Logger
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

log = Logger()

TRACE_HEADER = b"x-blazar-trace-id"


class BlazarRequest(Request):
    """
    A request whose body is capped: bytes past C{site.max_body_bytes} are
    dropped, and L{body_too_large} tells the surface to answer 413.

    @ivar trace_id: 16 hex digits naming this request in logs and in the
        C{x-blazar-trace-id} response header.
    """

    body_too_large = False
    trace_id = ""

    def gotLength(self, length: int | None) -> None:
        limit = getattr(getattr(self.channel, "site", None), "max_body_bytes", None)
        if limit is not None and length is not None and length > limit:
            self.body_too_large = True
            length = 0
        super().gotLength(length)

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

    def process(self) -> None:
        self.trace_id = secrets.token_hex(8)
        self.setHeader(TRACE_HEADER, self.trace_id.encode("ascii"))
        super().process()


class BlazarSite(Site):
    """
    The one Site on every listener.

    @ivar max_body_bytes: Request bodies above this are not kept; the
        surface answers 413 in its own error shape.
    """

    requestFactory = BlazarRequest

    def __init__(self, resource: IResource, *, max_body_bytes: int, **kwargs: Any) -> None:
        super().__init__(resource, **kwargs)
        self.max_body_bytes = max_body_bytes

    def log(self, request: Request) -> None:  # type: ignore[override]
        # One structured access line per request (replaces the combined log).
        log.info(
            "{method} {uri} {code} {length} trace={trace_id}",
            method=request.method.decode("ascii", "replace"),
            uri=request.uri.decode("ascii", "replace"),
            code=request.code,
            length=request.sentLength,
            trace_id=getattr(request, "trace_id", ""),
        )
