"""
The door's two Batch API rules (L{blazar.web.site}, L{blazar.web.auth}):
the batch secret is honoured only on the private listener's site, where a
line runs as the key it names; and C{POST /v1/files} may carry OpenAI's
200 MB, whatever C{max_body_bytes}, with a 413 naming that limit above it.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.address import UNIXAddress
from twisted.internet.testing import StringTransport

from blazar.config import KeyConfig
from blazar.web.site import UPLOAD_BODY_BYTES, BlazarSite
from tests.web.test_site import SECRET, SiteCase, head, parse

BATCH_SECRET = b"the-daemons-batch-secret"


def line_headers(secret: bytes = BATCH_SECRET, key: bytes = b"k") -> tuple[bytes, ...]:
    return (b"x-blazar-batch-secret: " + secret, b"x-blazar-batch-key: " + key)


class BatchDoorTests(SiteCase):
    keys = (KeyConfig("k", SECRET), KeyConfig("scoped", "scoped-secret-0123456789", models=("m",)))

    def batch_site(self) -> BlazarSite:
        site = self.make_site()
        site.batch_secret = BATCH_SECRET
        return site

    def send_to(self, site: BlazarSite, data: bytes) -> StringTransport:
        transport = StringTransport(peerAddress=UNIXAddress(None))
        channel = site.buildProtocol(None)
        channel.makeConnection(transport)
        channel.dataReceived(data)
        return transport

    def status(self, transport: StringTransport) -> bytes:
        return parse(transport.value())[0].split(b" ")[1]

    def test_on_the_private_site_a_line_runs_as_its_key(self) -> None:
        site = self.batch_site()
        for name in (b"k", b"scoped"):
            transport = self.send_to(site, head(b"/v1/chat/completions", 2, *line_headers(key=name)) + b"{}")
            self.assertEqual(self.status(transport), b"200")
        self.assertEqual([k.name for k in self.inner.keys], ["k", "scoped"])
        self.assertEqual(self.inner.keys[1].models, ("m",))  # its scope comes with it

    def test_on_the_private_site_the_secret_is_required(self) -> None:
        site = self.batch_site()
        for extra in [
            (),
            line_headers(secret=b"wrong"),
            (b"Authorization: Bearer " + SECRET.encode(),),
            line_headers(key=b"deleted-key"),
        ]:
            transport = self.send_to(site, head(b"/v1/chat/completions", 2, *extra) + b"{}")
            self.assertEqual(self.status(transport), b"401", extra)
            self.assertNotIn(BATCH_SECRET, transport.value())
        self.assertEqual(self.inner.seen, [])

    def test_on_a_public_site_the_batch_headers_mean_nothing(self) -> None:
        _, transport = self.send(head(b"/v1/chat/completions", 2, *line_headers()) + b"{}")
        self.assertEqual(self.status(transport), b"401")
        self.assertEqual(self.inner.seen, [])
        # from a UNIX socket too (a public unix: listener)
        transport = self.send_to(self.site, head(b"/v1/chat/completions", 2, *line_headers()) + b"{}")
        self.assertEqual(self.status(transport), b"401")

    def test_an_upload_may_pass_max_body_bytes_up_to_200_mb(self) -> None:
        key = b"Authorization: Bearer " + SECRET.encode()
        _, transport = self.send(head(b"/v1/files", 60 * 1024 * 1024, key))
        self.assertEqual(transport.value(), b"")  # waiting for the body, not refused
        _, transport = self.send(head(b"/v1/files", UPLOAD_BODY_BYTES + 1, key))
        status, _, body = parse(transport.value())
        error = json.loads(body)["error"]
        self.assertEqual(
            (status.split(b" ")[1], error["code"], error["type"]), (b"413", "file_too_large", "invalid_request_error")
        )
        self.assertIn("200 MB", error["message"])
        # other paths keep max_body_bytes
        _, transport = self.send(head(b"/v1/chat/completions", 60 * 1024 * 1024, key))
        self.assertIn(b"max_body_bytes", transport.value())


class KeylessBatchDoorTests(SiteCase):
    keys: tuple[KeyConfig, ...] = ()

    def test_without_keys_a_line_has_no_key_but_still_needs_the_secret(self) -> None:
        site = self.make_site()
        site.batch_secret = BATCH_SECRET
        seen: list[Any] = []
        for extra in (line_headers(key=b""), ()):
            transport = StringTransport(peerAddress=UNIXAddress(None))
            channel = site.buildProtocol(None)
            channel.makeConnection(transport)
            channel.dataReceived(head(b"/v1/chat/completions", 2, *extra) + b"{}")
            seen.append(parse(transport.value())[0].split(b" ")[1])
        self.assertEqual(seen, [b"200", b"401"])
        self.assertEqual(self.inner.keys, [None])
