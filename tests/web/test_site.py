"""
The site's body limit, driven byte by byte through a real HTTPChannel on a
StringTransport (no sockets, no reactor).
"""

from __future__ import annotations

import json

from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from blazar.web.site import BlazarSite

LIMIT = 1000


class Recorder(Resource):
    """
    Stands for auth and the surfaces: records what reached it.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bytes] = []

    def render(self, request):  # type: ignore[no-untyped-def]
        self.seen.append(request.content.read())
        return b"reached"


def head(path: bytes, length: int, *extra: bytes) -> bytes:
    return b"\r\n".join([
        b"POST " + path + b" HTTP/1.1", b"Host: x", b"Content-Type: application/json",
        b"Content-Length: " + str(length).encode(), *extra, b"", b"",
    ])


class BodyLimitTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.inner = Recorder()
        self.site = BlazarSite(self.inner, max_body_bytes=LIMIT, reactor=MemoryReactorClock())
        self.transport = StringTransport()
        self.channel = self.site.buildProtocol(None)
        self.channel.makeConnection(self.transport)

    def response(self) -> tuple[bytes, dict[bytes, bytes], bytes]:
        raw = self.transport.value()
        top, _, body = raw.partition(b"\r\n\r\n")
        status, *lines = top.split(b"\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
        return status, headers, body

    def test_answered_at_the_headers_and_closed(self) -> None:
        self.channel.dataReceived(head(b"/v1/chat/completions", LIMIT + 1))
        status, headers, body = self.response()
        self.assertEqual(status, b"HTTP/1.1 413 Request Entity Too Large")
        self.assertEqual(headers[b"connection"], b"close")
        self.assertEqual(json.loads(body)["error"]["code"], "request_too_large")
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(self.inner.seen, [])  # neither auth nor a surface saw it

    def test_body_bytes_after_the_headers_are_not_read(self) -> None:
        # the first bytes of the body came in the same read as the headers
        self.channel.dataReceived(head(b"/api/chat", 10 * LIMIT) + b"x" * 500)
        self.channel.dataReceived(b"x" * 5000)
        status, _, body = self.response()
        self.assertEqual(status.split(b" ")[1], b"413")
        self.assertEqual(list(json.loads(body)), ["error"])  # Ollama's shape
        self.assertEqual(self.transport.value().count(b"HTTP/1.1"), 1)
        self.assertEqual(self.inner.seen, [])

    def test_no_100_continue_for_a_body_that_is_refused(self) -> None:
        self.channel.dataReceived(head(b"/v1/messages", LIMIT + 1, b"Expect: 100-continue"))
        self.assertNotIn(b"100 Continue", self.transport.value())
        status, headers, body = self.response()
        self.assertEqual(status.split(b" ")[1], b"413")
        self.assertEqual(json.loads(body)["error"]["type"], "request_too_large")
        self.assertTrue(headers[b"request-id"].startswith(b"req_"))

    def test_each_surface_has_its_shape(self) -> None:
        for path, check in [
            (b"/v1/completions", lambda b: b["error"]["type"] == "invalid_request_error"),
            (b"/v1/responses", lambda b: b["error"]["code"] == "request_too_large"),
            (b"/v1/messages", lambda b: b["type"] == "error"),
            (b"/api/generate", lambda b: isinstance(b["error"], str)),
        ]:
            self.setUp()
            self.channel.dataReceived(head(path, LIMIT + 1))
            status, _, body = self.response()
            self.assertEqual(status.split(b" ")[1], b"413", path)
            self.assertTrue(check(json.loads(body)), (path, body))

    def test_a_body_at_the_limit_is_served(self) -> None:
        self.channel.dataReceived(head(b"/v1/chat/completions", LIMIT) + b"y" * LIMIT)
        self.assertEqual(self.inner.seen, [b"y" * LIMIT])
        self.assertIn(b"200 OK", self.transport.value())
        self.assertFalse(self.transport.disconnecting)

    def test_a_chunked_body_over_the_limit_is_dropped(self) -> None:
        chunk = b"x" * 600
        self.channel.dataReceived(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2 + b"0\r\n\r\n"
        )
        status, _, body = self.response()
        self.assertEqual(status.split(b" ")[1], b"413")
        self.assertEqual(self.inner.seen, [])
