"""
The site's door (connection cap, auth and body limit from the headers),
its deadlines, oversized heads and reason phrases, driven byte by byte
through a real HTTPChannel on a StringTransport with a Clock (no sockets,
no reactor, no time).
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.address import IPv4Address, UNIXAddress
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from blazar.config import Config, KeyConfig
from blazar.gateway.context import key_of
from blazar.web.auth import AuthGate, KeyHolder, is_local
from blazar.web.client import context_of
from blazar.web.site import LINGER_BYTES, LINGER_SECS, OPEN_BODY_BYTES, BlazarSite, reason_phrase

LIMIT = 1000
SECRET = "door-secret-0123456789"


class Recorder(Resource):
    """
    Stands for auth and the surfaces: records what reached it.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bytes] = []
        self.keys: list[Any] = []  # the key each request was let in with

    def render(self, request):
        self.seen.append(request.content.read())
        self.keys.append(key_of(context_of(request)))
        return b"reached"


def head(path: bytes, length: int, *extra: bytes) -> bytes:
    return b"\r\n".join(
        [
            b"POST " + path + b" HTTP/1.1",
            b"Host: x",
            b"Content-Type: application/json",
            b"Content-Length: " + str(length).encode(),
            *extra,
            b"",
            b"",
        ]
    )


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
            + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2
            + b"0\r\n\r\n"
        )
        status, _, body = self.response()
        self.assertEqual(status.split(b" ")[1], b"413")
        self.assertEqual(self.inner.seen, [])

    def test_a_chunked_body_is_cut_as_soon_as_it_passes_the_limit(self) -> None:
        # no last chunk: the answer may not wait for one
        self.channel.dataReceived(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % (LIMIT + 1)
            + b"x" * (LIMIT + 1)
        )
        status, headers, _ = self.response()
        self.assertEqual(status.split(b" ")[1], b"413")
        self.assertEqual(headers[b"connection"], b"close")
        self.assertTrue(self.transport.disconnecting)
        self.channel.dataReceived(b"\r\n" + (b"10\r\n" + b"y" * 16 + b"\r\n") * 10)
        self.assertEqual(self.transport.value().count(b"HTTP/1.1"), 1)
        self.assertEqual(self.inner.seen, [])


def parse(raw: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    top, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = top.split(b"\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
    return status, headers, body


class HalfCloseTransport(StringTransport):
    """
    A StringTransport that half-closes, as TCP and UNIX sockets do.
    """

    write_closed = False
    aborted = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True

    def abortConnection(self) -> None:
        self.aborted = True
        super().abortConnection()


class SiteCase(SynchronousTestCase):
    """
    A site with keys at the door (unless C{keys} says otherwise), on a Clock.
    """

    keys: tuple[KeyConfig, ...] = (KeyConfig("k", SECRET),)
    config_extra: dict[str, Any] = {}

    def setUp(self) -> None:
        self.clock = MemoryReactorClock()
        self.inner = Recorder()
        self.gate = AuthGate(self.inner, KeyHolder(Config(keys=self.keys, **self.config_extra)))
        self.site = self.make_site()
        self.tempfiles: list[dict[str, Any]] = []

        def temporary_file(**kwargs: Any) -> io.BytesIO:
            self.tempfiles.append(kwargs)
            return io.BytesIO()

        self.patch(tempfile, "TemporaryFile", temporary_file)

    def make_site(self, **kwargs: Any) -> BlazarSite:
        return BlazarSite(self.gate, max_body_bytes=50 * 1024 * 1024, gate=self.gate, reactor=self.clock, **kwargs)

    def connect(self, host: str = "10.1.2.3", kind: type[StringTransport] = StringTransport) -> tuple[Any, Any]:
        transport = kind(peerAddress=IPv4Address("TCP", host, 40000))
        channel = self.site.buildProtocol(None)
        channel.makeConnection(transport)
        return channel, transport

    def send(self, data: bytes, host: str = "10.1.2.3") -> tuple[Any, StringTransport]:
        channel, transport = self.connect(host)
        channel.dataReceived(data)
        return channel, transport


class DoorTests(SiteCase):
    def test_a_client_trace_id_is_echoed_but_never_a_batch_lines(self) -> None:
        for offered, echoed in ((b"my-trace-1", True), (b"batch_abc.0", False)):
            _, transport = self.send(
                head(
                    b"/v1/chat/completions",
                    2,
                    b"Authorization: Bearer " + SECRET.encode(),
                    b"x-blazar-trace-id: " + offered,
                )
                + b"{}"
            )
            _, headers, _ = parse(transport.value())
            self.assertEqual(headers[b"x-blazar-trace-id"] == offered, echoed, offered)

    def test_no_key_is_401_at_the_headers_with_the_body_unread(self) -> None:
        _, transport = self.send(head(b"/v1/chat/completions", 45 * 1024 * 1024) + b"x" * 3000)
        status, headers, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 401 Unauthorized")
        self.assertEqual(json.loads(body)["error"]["code"], "invalid_api_key")
        self.assertIn(b"missing API key", body)
        self.assertEqual(headers[b"www-authenticate"], b'Bearer realm="blazar"')
        self.assertEqual(headers[b"connection"], b"close")
        self.assertTrue(headers[b"x-blazar-trace-id"].startswith(b"plm-"))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.inner.seen, [])
        self.assertEqual(self.tempfiles, [])  # nothing spooled

    def test_each_surface_has_its_shape(self) -> None:
        for path, check in [
            (b"/v1/messages", lambda b: b["error"]["type"] == "authentication_error"),
            (b"/api/chat", lambda b: "invalid API key" in b["error"]),
            (b"/v1/responses", lambda b: b["error"]["code"] == "invalid_api_key"),
        ]:
            _, transport = self.send(head(path, 10, b"x-api-key: wrong-wrong-wrong") + b"{}")
            status, _, body = parse(transport.value())
            self.assertEqual(status.split(b" ")[1], b"401", path)
            self.assertTrue(check(json.loads(body)), (path, body))

    def test_no_100_continue_without_a_key(self) -> None:
        _, transport = self.send(head(b"/v1/messages", 4096, b"Expect: 100-continue"))
        self.assertNotIn(b"100 Continue", transport.value())
        status, headers, _ = parse(transport.value())
        self.assertEqual(status.split(b" ")[1], b"401")
        self.assertTrue(headers[b"request-id"].startswith(b"req_plm-"))

    def test_a_key_lets_the_body_in(self) -> None:
        for header in (b"Authorization: Bearer " + SECRET.encode(), b"x-api-key: " + SECRET.encode()):
            _, transport = self.send(head(b"/v1/chat/completions", 2, header) + b"{}")
            self.assertIn(b"200 OK", transport.value())
        self.assertEqual(self.inner.seen, [b"{}", b"{}"])
        self.assertEqual([k.name for k in self.inner.keys], ["k", "k"])

    def test_the_body_limit_comes_before_auth(self) -> None:
        # without a key or with one, a body over max_body_bytes is the same 413
        for extra in ((), (b"x-api-key: " + SECRET.encode(),)):
            _, transport = self.send(head(b"/v1/chat/completions", 60 * 1024 * 1024, *extra))
            status, _, body = parse(transport.value())
            self.assertEqual(status.split(b" ")[1], b"413")
            self.assertIn(b"max_body_bytes = 52428800", body)

    def test_spooled_only_past_the_memory_bound_and_only_with_a_key(self) -> None:
        big = 2 * 1024 * 1024
        channel, _ = self.send(head(b"/v1/chat/completions", big, b"x-api-key: " + SECRET.encode()))
        channel.dataReceived(b"y" * (1024 * 1024))
        self.assertEqual(self.tempfiles, [])  # the first MiB is in memory
        channel.dataReceived(b"y" * (big - 1024 * 1024))
        self.assertEqual(len(self.tempfiles), 1)
        self.assertEqual(self.inner.seen, [b"y" * big])
        # chunked, without a key, to an open route: never spooled, cut at 64 KiB
        channel, transport = self.send(
            b"POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"%x\r\n" % 4096 + b"z" * 4096 + b"\r\n") * 20
        )
        status, _, body = parse(transport.value())
        self.assertEqual(status.split(b" ")[1], b"413")
        self.assertIn(b"without an API key may send at most %d bytes" % OPEN_BODY_BYTES, body)
        self.assertEqual(len(self.tempfiles), 1)

    def test_open_routes_need_no_key(self) -> None:
        _, transport = self.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"200 OK", transport.value())
        _, transport = self.send(head(b"/healthz", OPEN_BODY_BYTES + 1))
        self.assertIn(b"413", transport.value().split(b"\r\n")[0])

    def test_credentials_sent_twice_are_400(self) -> None:
        key = SECRET.encode()
        for extra in (
            (b"Authorization: Bearer " + key, b"Authorization: Bearer other-other-other"),
            (b"x-api-key: " + key, b"X-Api-Key: " + key),
        ):
            _, transport = self.send(head(b"/v1/messages", 2, *extra) + b"{}")
            status, headers, body = parse(transport.value())
            self.assertEqual(status, b"HTTP/1.1 400 Bad Request")
            self.assertIn(b"sent 2 times", body)
            self.assertEqual(json.loads(body)["error"]["type"], "invalid_request_error")
            self.assertEqual(headers[b"connection"], b"close")
        self.assertEqual(self.inner.seen, [])

    def test_different_keys_in_authorization_and_x_api_key_are_400(self) -> None:
        other = KeyConfig("other", "other-secret-0123456789")
        self.gate = AuthGate(self.inner, KeyHolder(Config(keys=(*self.keys, other))))
        self.site = self.make_site()
        a, b = b"Authorization: Bearer " + SECRET.encode(), b"x-api-key: " + other.secret.encode()
        for path, check in [
            (b"/v1/chat/completions", lambda e: e["error"]["type"] == "invalid_request_error"),
            (b"/v1/messages", lambda e: e["error"]["type"] == "invalid_request_error"),
            (b"/api/chat", lambda e: isinstance(e["error"], str)),
        ]:
            for extra in ((a, b), (b, a), (a, b"x-api-key: not-a-key-at-all")):
                _, transport = self.send(head(path, 2, *extra) + b"{}")
                status, headers, body = parse(transport.value())
                self.assertEqual(status, b"HTTP/1.1 400 Bad Request", (path, extra))
                self.assertIn(b"carry different keys", body)
                self.assertTrue(check(json.loads(body)), body)
                self.assertEqual(headers[b"connection"], b"close")
        self.assertEqual(self.inner.seen, [])
        # another scheme beside x-api-key: a proxy checking it would see another identity (issue 36)
        basic = b"Authorization: Basic dXNlcjpwYXNz"
        _, transport = self.send(head(b"/v1/chat/completions", 2, basic, b"x-api-key: " + SECRET.encode()) + b"{}")
        status, _, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 400 Bad Request")
        self.assertIn(b"Authorization: Basic and x-api-key were both sent", body)
        self.assertEqual(self.inner.seen, [])
        # the same key in both is one identity
        _, transport = self.send(head(b"/v1/messages", 2, a, b"x-api-key:  " + SECRET.encode()) + b"{}")
        self.assertIn(b"200 OK", transport.value())
        self.assertEqual([k.name for k in self.inner.keys], ["k"])

    def test_metrics_need_a_key_by_default_from_loopback_too(self) -> None:
        """
        C{/metrics} names every model and key: with keys on and
        C{metrics_require_key} unset, a caller without a key is refused
        from loopback too (issue 36: a scoped key's holder read it by
        leaving its key out); an admin key reads it.
        """
        for host in ("10.1.2.3", "127.0.0.1", "::1", "::ffff:127.0.0.1"):
            _, transport = self.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", host=host)
            self.assertIn(b"401", transport.value().split(b"\r\n")[0], host)
            _, transport = self.send(
                b"GET /metrics HTTP/1.1\r\nHost: x\r\nx-api-key: " + SECRET.encode() + b"\r\n\r\n", host=host
            )
            self.assertIn(b"200 OK", transport.value(), host)

    def test_is_local(self) -> None:
        self.assertTrue(is_local(IPv4Address("TCP", "127.0.0.2", 1)))
        self.assertTrue(is_local(UNIXAddress(b"/tmp/x.sock")))
        self.assertFalse(is_local(IPv4Address("TCP", "10.0.0.1", 1)))
        self.assertFalse(is_local(IPv4Address("TCP", "::ffff:10.0.0.1", 1)))
        self.assertFalse(is_local(None))


class MetricsRequireKeyTests(SiteCase):
    def test_false_opens_metrics_to_everyone(self) -> None:
        self.gate = AuthGate(self.inner, KeyHolder(Config(keys=self.keys, metrics_require_key=False)))
        self.site = self.make_site()
        _, transport = self.send(b"GET /metrics HTTP/1.1\r\nHost: 10.0.0.1:11434\r\n\r\n", host="10.1.2.3")
        self.assertIn(b"200 OK", transport.value())

    def test_true_closes_it_to_loopback_too(self) -> None:
        self.gate = AuthGate(self.inner, KeyHolder(Config(keys=self.keys, metrics_require_key=True)))
        self.site = self.make_site()
        _, transport = self.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", host="127.0.0.1")
        self.assertIn(b"401", transport.value().split(b"\r\n")[0])

    def test_a_scoped_key_is_403_where_a_key_is_needed(self) -> None:
        scoped = KeyConfig("webui", "scoped-secret-0123456789", models=("qwen:7b",))
        get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        for required, host in ((None, "10.1.2.3"), (None, "127.0.0.1"), (True, "127.0.0.1")):
            self.gate = AuthGate(self.inner, KeyHolder(Config(keys=(*self.keys, scoped), metrics_require_key=required)))
            self.site = self.make_site()
            _, transport = self.send(get + b"Authorization: Bearer " + scoped.secret.encode() + b"\r\n\r\n", host=host)
            status, _, body = parse(transport.value())
            self.assertEqual(status, b"HTTP/1.1 403 Forbidden", (required, host))
            error = json.loads(body)["error"]
            self.assertEqual(error["type"], "invalid_request_error")
            self.assertEqual(error["code"], "insufficient_permissions")
            self.assertIn("'webui' is scoped", error["message"])
            self.assertIn("metrics_require_key = false", error["message"])
            self.assertIn("admin", error["message"])
            # an admin key reads them
            _, transport = self.send(get + b"x-api-key: " + SECRET.encode() + b"\r\n\r\n", host=host)
            self.assertIn(b"200 OK", transport.value())
        self.assertEqual(len(self.inner.seen), 3)
        # false opens it to scrapes without a key, from anywhere
        for required, host in ((False, "127.0.0.1"), (False, "10.1.2.3")):
            self.gate = AuthGate(self.inner, KeyHolder(Config(keys=(*self.keys, scoped), metrics_require_key=required)))
            self.site = self.make_site()
            _, transport = self.send(get + b"\r\n", host=host)
            self.assertIn(b"200 OK", transport.value(), (required, host))

    def test_a_models_own_metrics_follow_the_same_rule(self) -> None:
        """
        C{/metrics/models/NAME} (the GIE gauges of one model): refused
        without a key, 403 to a scoped key, open with
        C{metrics_require_key = false}.
        """
        scoped = KeyConfig("webui", "scoped-secret-0123456789", models=("qwen:7b",))
        get = b"GET /metrics/models/qwen:7b HTTP/1.1\r\nHost: x\r\n"
        self.gate = AuthGate(self.inner, KeyHolder(Config(keys=(*self.keys, scoped))))
        self.site = self.make_site()
        _, transport = self.send(get + b"\r\n", host="127.0.0.1")
        self.assertIn(b"401", transport.value().split(b"\r\n")[0])
        _, transport = self.send(get + b"Authorization: Bearer " + scoped.secret.encode() + b"\r\n\r\n")
        self.assertIn(b"403", transport.value().split(b"\r\n")[0])
        _, transport = self.send(get + b"x-api-key: " + SECRET.encode() + b"\r\n\r\n")
        self.assertIn(b"200 OK", transport.value())
        self.gate = AuthGate(self.inner, KeyHolder(Config(keys=self.keys, metrics_require_key=False)))
        self.site = self.make_site()
        _, transport = self.send(get + b"\r\n", host="10.1.2.3")
        self.assertIn(b"200 OK", transport.value())

    def test_without_keys_it_is_open(self) -> None:
        self.gate = AuthGate(self.inner, KeyHolder(Config()))
        self.site = self.make_site()
        _, transport = self.send(b"GET /metrics HTTP/1.1\r\nHost: 10.0.0.1:11434\r\n\r\n", host="10.1.2.3")
        self.assertIn(b"200 OK", transport.value())


class DeadlineTests(SiteCase):
    def test_headers_one_byte_a_second_are_408_at_the_deadline(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(b"POST /api/chat HTTP/1.1\r\n")
        for byte in b"Host: example.org\r\nContent-Type: application/json\r\n":
            channel.dataReceived(bytes([byte]))
            self.clock.advance(1)
            if transport.value():
                break
        self.assertEqual(self.clock.seconds(), 10)
        status, headers, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 408 Request Timeout")
        self.assertIn("header_timeout_secs = 10", json.loads(body)["error"])  # Ollama's shape
        self.assertTrue(headers[b"x-blazar-trace-id"].startswith(b"plm-"))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.inner.seen, [])

    def test_before_the_request_line_the_408_is_on_the_bare_connection(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(b"PO")
        self.clock.advance(10)
        status, headers, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 408 Request Timeout")
        self.assertEqual(json.loads(body)["error"]["code"], "request_timeout")
        self.assertEqual(int(headers[b"content-length"]), len(body))
        self.assertTrue(transport.disconnecting)

    def test_a_connection_that_sends_nothing_is_closed_without_an_answer(self) -> None:
        _, transport = self.connect()
        self.clock.advance(9.9)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(0.1)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(transport.value(), b"")

    def test_a_kept_connection_may_idle_then_its_next_request_has_the_deadline(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        self.clock.advance(30)  # idle between requests: twisted.web's 60 s, not the header deadline
        self.assertFalse(transport.disconnecting)
        channel.dataReceived(b"GET /health HTTP/1.1\r\n")
        self.clock.advance(10)
        self.assertIn(b"408 Request Timeout", transport.value())
        self.assertTrue(transport.disconnecting)

    def test_a_pipelined_partial_request_has_the_deadline(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\n")
        self.clock.advance(10)
        self.assertEqual(transport.value().count(b"HTTP/1.1 "), 2)
        self.assertIn(b"408 Request Timeout", transport.value())

    def test_a_stalled_body_is_408(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(head(b"/v1/chat/completions", 100_000, b"x-api-key: " + SECRET.encode()))
        channel.dataReceived(b"y" * 8192)  # two seconds' worth at 4096 bytes/s
        self.clock.advance(11.9)
        self.assertEqual(transport.value(), b"")
        self.clock.advance(0.1)
        status, headers, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 408 Request Timeout")
        self.assertIn(b"body_min_bytes_per_sec = 4096", body)
        self.assertEqual(headers[b"connection"], b"close")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.inner.seen, [])

    def test_a_body_at_the_minimum_rate_is_served(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(head(b"/v1/chat/completions", 100_000, b"x-api-key: " + SECRET.encode()))
        sent = 0
        while sent < 100_000:
            chunk = min(4096, 100_000 - sent)
            channel.dataReceived(b"y" * chunk)
            sent += chunk
            self.clock.advance(1)
        self.assertIn(b"200 OK", transport.value())
        self.assertEqual(self.inner.seen, [b"y" * 100_000])

    def test_the_deadlines_are_the_sites(self) -> None:
        self.site = self.make_site(header_timeout=2.5)
        channel, transport = self.connect()
        channel.dataReceived(b"GET /health HTTP/1.1\r\n")
        self.clock.advance(2.5)
        self.assertIn(b"header_timeout_secs = 2.5", transport.value())


class HeadTests(SiteCase):
    def test_a_header_over_16_kib_is_431(self) -> None:
        _, transport = self.send(head(b"/v1/messages", 2, b"x-junk: " + b"v" * 20_000) + b"{}")
        status, headers, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 431 Request Header Fields Too Large")
        self.assertEqual(json.loads(body)["type"], "error")  # Anthropic's shape
        self.assertTrue(headers[b"request-id"].startswith(b"req_plm-"))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.inner.seen, [])

    def test_a_64_kib_header_in_one_read_is_431(self) -> None:
        _, transport = self.send(head(b"/v1/chat/completions", 2, b"x-junk: " + b"v" * 65536) + b"{}")
        status, _, body = parse(transport.value())
        self.assertEqual(status.split(b" ")[1], b"431")
        self.assertEqual(json.loads(body)["error"]["code"], "request_header_fields_too_large")

    def test_headers_over_16_kib_together_are_431(self) -> None:
        many = [b"x-h%d: %s" % (i, b"v" * 1000) for i in range(20)]
        _, transport = self.send(head(b"/api/chat", 2, *many) + b"{}")
        self.assertIn(b"431", transport.value().split(b"\r\n")[0])

    def test_too_many_header_lines_are_431(self) -> None:
        many = [b"x-h%d: v" % i for i in range(501)]
        _, transport = self.send(head(b"/api/chat", 2, *many) + b"{}")
        self.assertIn(b"431", transport.value().split(b"\r\n")[0])

    def test_a_request_line_over_16_kib_is_414(self) -> None:
        _, transport = self.send(b"GET /v1/models?" + b"q" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 414 Request-URI Too Long")
        self.assertIn(b"request line too long", body)

    def test_what_twisted_cannot_parse_is_400_with_a_body(self) -> None:
        _, transport = self.send(b"POST /api/chat HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        status, headers, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 400 Bad Request")
        self.assertEqual(json.loads(body), {"error": "malformed HTTP request"})
        self.assertEqual(headers[b"connection"], b"close")
        self.assertEqual(transport.value().count(b"HTTP/1.1 "), 1)


class Status(Resource):
    isLeaf = True

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    def render(self, request):
        request.setResponseCode(self.code)
        return b"{}"


class ReasonPhraseTests(SynchronousTestCase):
    def test_every_status_has_its_phrase(self) -> None:
        for code, phrase in [
            (429, b"Too Many Requests"),
            (431, b"Request Header Fields Too Large"),
            (408, b"Request Timeout"),
            (413, b"Request Entity Too Large"),
            (422, b"Unprocessable Entity"),
            (499, b"Client Closed Request"),
            (529, b"Overloaded"),
            (503, b"Service Unavailable"),
            (504, b"Gateway Timeout"),
        ]:
            site = BlazarSite(Status(code), max_body_bytes=LIMIT, reactor=MemoryReactorClock())
            transport = StringTransport()
            channel = site.buildProtocol(None)
            channel.makeConnection(transport)
            channel.dataReceived(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            self.assertTrue(transport.value().startswith(b"HTTP/1.1 %d %s\r\n" % (code, phrase)), code)
            self.assertEqual(reason_phrase(code), phrase)
        self.assertEqual(reason_phrase(599), b"Unknown Status")


class ConnectionCapTests(SiteCase):
    def test_over_the_cap_is_503_with_retry_after(self) -> None:
        self.site = self.make_site(max_connections_per_ip=2)
        first, _ = self.connect("10.0.0.1")
        self.connect("10.0.0.1")
        third, transport = self.connect("10.0.0.1")
        third.dataReceived(head(b"/v1/chat/completions", 2, b"x-api-key: " + SECRET.encode()) + b"{}")
        status, headers, body = parse(transport.value())
        self.assertEqual(status, b"HTTP/1.1 503 Service Unavailable")
        self.assertEqual(headers[b"retry-after"], b"1")
        self.assertIn(b"max_connections_per_ip = 2", body)
        self.assertEqual(json.loads(body)["error"]["code"], "too_many_connections")
        self.assertTrue(transport.disconnecting)
        # another address, and loopback, are not held back
        other, transport = self.connect("10.0.0.2")
        other.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"200 OK", transport.value())
        for _ in range(5):
            local, transport = self.connect("127.0.0.1")
            local.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            self.assertIn(b"200 OK", transport.value())
        # a closed connection frees its place
        third.connectionLost(Failure(Exception("gone")))
        first.connectionLost(Failure(Exception("gone")))
        fourth, transport = self.connect("10.0.0.1")
        fourth.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"200 OK", transport.value())

    def test_zero_is_no_cap(self) -> None:
        self.site = self.make_site(max_connections_per_ip=0)
        for _ in range(100):
            channel, transport = self.connect("10.0.0.1")
        channel.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"200 OK", transport.value())


class LingerTests(SiteCase):
    def refused(self) -> tuple[Any, HalfCloseTransport]:
        channel, transport = self.connect(kind=HalfCloseTransport)
        channel.dataReceived(head(b"/v1/chat/completions", 10_000_000) + b"x" * 1000)
        self.assertIn(b"401", transport.value().split(b"\r\n")[0])
        return channel, transport

    def test_half_closed_after_a_refusal_and_the_rest_dropped(self) -> None:
        channel, transport = self.refused()
        self.assertTrue(transport.write_closed)
        self.assertFalse(transport.disconnecting)
        channel.dataReceived(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 5000)
        self.assertEqual(transport.value().count(b"HTTP/1.1 "), 1)
        self.clock.advance(LINGER_SECS)
        self.assertTrue(transport.aborted)

    def test_at_most_linger_bytes_are_dropped(self) -> None:
        channel, transport = self.refused()
        channel.dataReceived(b"x" * (LINGER_BYTES - 1000))  # the 1000 after the headers count
        self.assertFalse(transport.aborted)
        channel.dataReceived(b"x")
        self.assertTrue(transport.aborted)

    def test_a_client_that_closes_ends_it(self) -> None:
        channel, transport = self.refused()
        channel.connectionLost(Failure(Exception("closed")))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_tls_closes_at_once(self) -> None:
        # a wrapper that only forwards loseWriteConnection (as TLS does) gets a plain close
        _, transport = self.send(head(b"/v1/chat/completions", 10_000_000))
        self.assertTrue(transport.disconnecting)


class BlobUploadDoorTests(SiteCase):
    """
    C{POST /api/blobs/...} (a model's GGUF for C{/api/create}): the limit
    is C{max_blob_bytes}, for an unscoped key only, and a body past the
    memory bound is spooled into the store's C{blobs/} directory, where
    naming it is a link.
    """

    keys = (KeyConfig("k", SECRET), KeyConfig("scoped", "scoped-secret-0123456789", models=("m",)))
    BLOB = b"/api/blobs/sha256:" + b"a" * 64

    def make_site(self, **kwargs: Any) -> BlazarSite:
        self.store = Path(self.mktemp()).absolute()
        config = Config(keys=self.keys, max_body_bytes=LIMIT, max_blob_bytes=4 * 1024 * 1024, ollama_models=self.store)
        self.patch(self.inner, "render", self.keep)
        self.contents: list[Any] = []
        return BlazarSite(self.gate, gate=self.gate, reactor=self.clock, config=lambda: config, **kwargs)

    def keep(self, request: Any) -> bytes:
        self.contents.append((request.content, request.content.read()))
        return b"reached"

    def test_the_limit_is_max_blob_bytes(self) -> None:
        key = b"x-api-key: " + SECRET.encode()
        _, transport = self.send(head(self.BLOB, 5 * 1024 * 1024, key))
        status, _, body = parse(transport.value())
        self.assertEqual(status.split(b" ")[1], b"413")
        self.assertIn(b"max_blob_bytes = 4194304", body)
        # elsewhere the body limit is still max_body_bytes
        _, transport = self.send(head(b"/api/chat", LIMIT + 1, key))
        self.assertIn(b"max_body_bytes = 1000", parse(transport.value())[2])
        # and for a scoped key too (it may not upload blobs: the surface says 403)
        _, transport = self.send(head(self.BLOB, LIMIT + 1, b"x-api-key: scoped-secret-0123456789"))
        self.assertIn(b"max_body_bytes = 1000", parse(transport.value())[2])

    def test_a_big_body_is_spooled_into_the_store(self) -> None:
        size = 2 * 1024 * 1024
        channel, transport = self.send(head(self.BLOB, size, b"x-api-key: " + SECRET.encode()))
        channel.dataReceived(b"g" * size)
        self.assertIn(b"200 OK", transport.value())
        ((content, data),) = self.contents
        self.assertEqual(data, b"g" * size)
        self.assertEqual(Path(content.name).parent, self.store / "blobs")
        self.assertEqual(self.tempfiles, [])  # not the system's temporary directory
        # a small one stays in memory (the surface copies it in)
        channel, _ = self.send(head(self.BLOB, 10, b"x-api-key: " + SECRET.encode()) + b"0123456789")
        self.assertIsInstance(self.contents[-1][0], io.BytesIO)


class KeylessBlobDoorTests(SiteCase):
    """
    On a gateway without keys, blobs are taken from loopback only (as
    L{blazar.web.auth.check_admin} rules): from the network a blob's body
    gets C{max_body_bytes} and is never spooled into the store, so a host
    on the LAN cannot fill the disk before the surface's 403.
    """

    keys = ()
    BLOB = BlobUploadDoorTests.BLOB
    make_site = BlobUploadDoorTests.make_site
    keep = BlobUploadDoorTests.keep
    # set by the borrowed make_site
    store: Path
    contents: list[Any]

    def blob(self, size: int, peer: str, host: bytes) -> tuple[Any, StringTransport]:
        return self.send(head(self.BLOB, size).replace(b"Host: x", b"Host: " + host), peer)

    def test_from_the_network_the_limit_is_max_body_bytes(self) -> None:
        _, transport = self.blob(2 * 1024 * 1024, "10.1.2.3", b"10.0.0.2:11434")
        status, _, body = parse(transport.value())
        self.assertEqual(status.split(b" ")[1], b"413")
        self.assertIn(b"max_body_bytes = 1000", body)
        self.assertFalse((self.store / "blobs").exists() and any((self.store / "blobs").iterdir()))
        # a small one reaches the surface (which refuses it) from memory, not from the store
        channel, _ = self.blob(10, "10.1.2.3", b"10.0.0.2:11434")
        channel.dataReceived(b"0123456789")
        self.assertIsInstance(self.contents[-1][0], io.BytesIO)
        # and one from loopback for a page that is not this machine's (check_admin refuses it too)
        _, transport = self.send(
            head(self.BLOB, 2 * 1024 * 1024, b"Origin: http://10.0.0.2:11434").replace(
                b"Host: x", b"Host: 10.0.0.2:11434"
            ),
            "127.0.0.1",
        )
        self.assertIn(b"max_body_bytes = 1000", parse(transport.value())[2])

    def test_from_loopback_it_is_spooled_into_the_store(self) -> None:
        size = 2 * 1024 * 1024
        channel, transport = self.blob(size, "127.0.0.1", b"127.0.0.1:11434")
        channel.dataReceived(b"g" * size)
        self.assertIn(b"200 OK", transport.value())
        ((content, data),) = self.contents
        self.assertEqual(data, b"g" * size)
        self.assertEqual(Path(content.name).parent, self.store / "blobs")


class KeyLookupTests(SynchronousTestCase):
    """
    L{KeyHolder.find} finds a key by one lookup, and only by its exact
    secret; it follows the live config.
    """

    def test_only_the_exact_secret(self) -> None:
        alice = KeyConfig(name="alice", secret="a" * 20)
        bob = KeyConfig(name="bob", secret="b" * 20, models=("m",))
        holder = KeyHolder(Config(keys=(alice, bob)))
        self.assertEqual(holder.find(b"a" * 20), alice)
        self.assertEqual(holder.find(b"b" * 20), bob)
        for wrong in (b"a" * 19, b"a" * 21, b"a" * 19 + b"b", b"", b"\xff" * 20):
            self.assertIsNone(holder.find(wrong))

    def test_the_last_key_of_a_secret_wins(self) -> None:
        first = KeyConfig(name="first", secret="s" * 20)
        second = KeyConfig(name="second", secret="s" * 20)
        self.assertEqual(KeyHolder(Config(keys=(first, second))).find(b"s" * 20), second)

    def test_follows_the_live_config(self) -> None:
        holder = KeyHolder(Config(keys=(KeyConfig(name="old", secret="o" * 20),)))
        self.assertIsNotNone(holder.find(b"o" * 20))
        new = KeyConfig(name="new", secret="n" * 20)
        holder.set(Config(keys=(new,)))
        self.assertIsNone(holder.find(b"o" * 20))
        self.assertEqual(holder.find(b"n" * 20), new)

    def test_extra_keys_too(self) -> None:
        extra = KeyConfig(name="env", secret="e" * 20)
        holder = KeyHolder(Config(), (extra,))
        self.assertEqual(holder.find(b"e" * 20), extra)


class PerConnectionTests(SiteCase):
    """
    What every request asks of its connection is asked once per
    connection; the C{Date} header is made once a second, as twisted.web
    makes it.
    """

    keys = ()

    def test_addresses_and_tls_asked_once(self) -> None:
        asked: list[str] = []

        class Counting(StringTransport):
            def getHost(self) -> Any:
                asked.append("host")
                return super().getHost()

            def getPeer(self) -> Any:
                asked.append("peer")
                return super().getPeer()

        channel, transport = self.connect(kind=Counting)
        asked.clear()
        for _ in range(3):
            channel.dataReceived(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        self.assertEqual(transport.value().count(b"HTTP/1.1 200 OK"), 3)
        self.assertEqual(sorted(asked), ["host", "peer"])
        self.assertEqual((channel.getHost(), channel.getPeer()), (transport.getHost(), transport.getPeer()))
        self.assertFalse(channel.isSecure())

    def test_the_date_header(self) -> None:
        import time as time_module

        from twisted.web.http import datetimeToString

        from blazar.web.site import http_date

        now = [1_700_000_000.2]
        self.patch(time_module, "time", lambda: now[0])
        self.assertEqual(http_date(), datetimeToString(1_700_000_000))
        now[0] += 0.7
        self.assertEqual(http_date(), datetimeToString(1_700_000_000))
        now[0] += 0.2
        self.assertEqual(http_date(), datetimeToString(1_700_000_001))
        self.assertEqual(http_date(), b"Tue, 14 Nov 2023 22:13:21 GMT")

    def test_responses_carry_date_and_server(self) -> None:
        from twisted.web.server import version

        _, transport = self.send(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n", host="127.0.0.1")
        head_text = transport.value().split(b"\r\n\r\n", 1)[0].lower()
        self.assertIn(b"\r\ndate: ", head_text)
        self.assertIn(b"\r\nserver: " + version.lower(), head_text)

    def test_the_head_as_twisted_writes_it(self) -> None:
        """
        The response head written as one piece has twisted.web's bytes.
        """
        from twisted.web.http import HTTPChannel
        from twisted.web.http_headers import Headers

        headers = Headers({b"content-type": [b"application/json"], b"x-two": [b"a", b"b"]})
        headers.setRawHeaders(b"x-odd", [b"line\r\nbreak"])  # (sanitized as Headers stores it)
        twisted_transport = StringTransport()
        twisted_channel = HTTPChannel()
        twisted_channel.makeConnection(twisted_transport)
        twisted_channel.writeHeaders(b"HTTP/1.1", b"200", b"OK", headers)
        ours, transport = self.connect()
        transport.clear()
        ours.writeHeaders(b"HTTP/1.1", b"200", b"OK", headers)
        heads = [twisted_transport.value(), transport.value()]
        twisted_channel.connectionLost(Failure(Exception("done")))
        self.assertEqual(heads[0], heads[1])
        self.assertTrue(heads[1].startswith(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"))
