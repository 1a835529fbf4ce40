"""
L{blazar.gateway.imagefetch}: which image URLs Blazar fetches, and where
it connects (the fetch itself, over real sockets, is in
C{tests/integration/test_vision_e2e.py}).
"""

from typing import Any, cast

import attrs
from twisted.internet.defer import CancelledError, ensureDeferred
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import ILogObserver, LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import Config, parse_config
from blazar.gateway.imagefetch import ImageFetcher, ImageFetchError, refused_address
from tests.typed import not_none

NOT_PUBLIC = "its host does not resolve to a public address"


async def inline(f: Any, *args: Any) -> Any:
    return f(*args)


class AddressTests(SynchronousTestCase):
    def test_what_is_refused(self) -> None:
        table = {
            "127.0.0.1": "loopback",
            "::1": "loopback",
            "10.1.2.3": "private",
            "172.16.0.1": "private",
            "192.168.1.1": "private",
            "169.254.169.254": "link-local",
            "fe80::1": "link-local",
            "100.64.0.1": "shared",
            "0.0.0.0": "unspecified",
            "224.0.0.1": "multicast",
            "fc00::1": "private",
            "::ffff:127.0.0.1": "loopback",
            "64:ff9b::a00:1": "private",
            "240.0.0.1": "private",
            "8.8.8.8": None,
            "2606:4700:4700::1111": None,
            "64:ff9b::808:808": None,
        }
        self.assertEqual({a: refused_address(a) for a in table}, table)


class FetchRefusalTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.addresses: dict[str, list[str]] = {
            "cdn.example": ["93.184.216.34"],
            "sneaky.example": ["8.8.8.8", "10.0.0.5"],
            "metadata.example": ["169.254.169.254"],
            "lan.example": ["192.168.1.9"],
        }
        self.config = parse_config('image_fetch_private_hosts = ["LAN.example.", "[::1]"]')

    def resolve(self, host: str, port: int) -> list[str]:
        if host not in self.addresses:
            raise OSError("no such host")
        return self.addresses[host]

    def fetcher(self, config: Config | None = None) -> ImageFetcher:
        return ImageFetcher(self.reactor, lambda: config or self.config, inline, self.resolve)

    def refused(self, url: str, *needles: str) -> None:
        failure = self.failureResultOf(
            ensureDeferred(self.fetcher().fetch(url, "messages[0].content[1].image_url", 10 << 20)), ImageFetchError
        )
        for needle in needles:
            self.assertIn(needle, str(failure.value))
        self.assertEqual(failure.value.param, "messages[0].content[1].image_url")
        self.assertEqual(self.reactor.tcpClients, [])  # nothing was connected to

    def test_refused_before_connecting(self) -> None:
        self.refused("ftp://cdn.example/a.png", "http and https")
        self.refused("http://user:pw@cdn.example/a.png", "credentials")
        self.refused("http://nowhere.example/a.png", NOT_PUBLIC)
        self.refused("http://metadata.example/latest", NOT_PUBLIC, "image_fetch_private_hosts")
        self.refused("http://127.0.0.1:8080/a.png", NOT_PUBLIC)
        self.refused("http://[::1]:99999/a.png", "valid")
        # every address a host has must be public
        self.refused("https://sneaky.example/a.png", NOT_PUBLIC)

    def test_a_refusal_does_not_map_the_network(self) -> None:
        # a key holder learns neither whether a name resolves nor to what: the log has it
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(cast(ILogObserver, events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, events.append))
        messages = {}
        for url in ("http://nowhere.example/a.png", "http://metadata.example/latest", "https://sneaky.example/a.png"):
            failure = self.failureResultOf(ensureDeferred(self.fetcher().fetch(url, "x", 1 << 20)), ImageFetchError)
            messages[url] = str(failure.value).replace(url, "URL")
        self.assertEqual(len(set(messages.values())), 1, messages)  # the same answer, whatever the host is
        for needle in ("169.254.169.254", "10.0.0.5", "link-local", "private address", "no such host"):
            self.assertNotIn(needle, str(messages))
        logged = [(e["host"], e.get("address"), e.get("why") or e.get("error")) for e in events if "host" in e]
        self.assertEqual(
            logged,
            [
                ("nowhere.example", None, "no such host"),
                ("metadata.example", "169.254.169.254", "link-local"),
                ("sneaky.example", "10.0.0.5", "private"),
            ],
        )
        self.assertTrue(all(e["log_level"] is LogLevel.info for e in events if "host" in e))

    def test_the_checked_address_is_the_one_connected_to(self) -> None:
        fetching = ensureDeferred(self.fetcher().fetch("http://cdn.example:8080/a.png", "x", 1 << 20))
        self.assertNoResult(fetching)
        ((host, port, *_),) = self.reactor.tcpClients
        self.assertEqual((host, port), ("93.184.216.34", 8080))
        fetching.cancel()  # (the client left)
        self.failureResultOf(fetching, CancelledError)

    def test_a_listed_host_may_be_private(self) -> None:
        fetching = ensureDeferred(self.fetcher().fetch("http://lan.example/a.png", "x", 1 << 20))
        ((host, port, *_),) = self.reactor.tcpClients
        self.assertEqual((host, port), ("192.168.1.9", 80))
        fetching.cancel()
        self.failureResultOf(fetching, CancelledError)

    def test_a_redirect_to_a_private_address_is_refused(self) -> None:
        # an allowed (public) URL that answers with a redirect: the new URL is checked as the first was
        fetching = ensureDeferred(self.fetcher().fetch("http://cdn.example/a.png", "x", 1 << 20))
        ((host, port, factory, *_),) = self.reactor.tcpClients
        self.assertEqual(host, "93.184.216.34")
        protocol = not_none(factory.buildProtocol(None))
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.assertTrue(transport.value().startswith(b"GET /a.png HTTP/1.1\r\n"))
        protocol.dataReceived(
            b"HTTP/1.1 302 Found\r\nLocation: http://metadata.example/latest\r\nContent-Length: 0\r\n\r\n"
        )
        failure = self.failureResultOf(fetching, ImageFetchError)
        self.assertIn(NOT_PUBLIC, str(failure.value))
        self.assertEqual(len(self.reactor.tcpClients), 1)  # the metadata address was never connected to

    def test_the_whole_fetch_has_a_deadline(self) -> None:
        config = attrs.evolve(self.config, image_fetch_timeout=3.0)
        fetching = ensureDeferred(self.fetcher(config).fetch("http://cdn.example/a.png", "x", 1 << 20))
        self.reactor.advance(3.5)
        failure = self.failureResultOf(fetching, ImageFetchError)
        self.assertIn("longer than 3 s", str(failure.value))

    def test_a_requests_fetches_share_one_deadline(self) -> None:
        # what is left of image_fetch_timeout_secs after the request's earlier images, not 3 s again
        config = attrs.evolve(self.config, image_fetch_timeout=3.0)
        fetching = ensureDeferred(self.fetcher(config).fetch("http://cdn.example/a.png", "x", 1 << 20, 1.0))
        self.reactor.advance(1.5)
        failure = self.failureResultOf(fetching, ImageFetchError)
        self.assertIn("longer than 3 s", str(failure.value))
        self.assertIn("together", str(failure.value))
        # none left: refused before connecting
        del self.reactor.tcpClients[:]
        self.failureResultOf(
            ensureDeferred(self.fetcher(config).fetch("http://cdn.example/a.png", "x", 1 << 20, 0.0)), ImageFetchError
        )
        self.assertEqual(self.reactor.tcpClients, [])
