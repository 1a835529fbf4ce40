"""
Images a chat names by C{http(s)} URL, fetched by Blazar itself (never by
the engine: llama-server would fetch any URL it is given, from the
daemon's own network) and handed to the engine as C{data:} URLs.

A fetch is bounded: only C{http} and C{https}, at most
C{image_fetch_max_bytes} and C{image_fetch_timeout_secs} for all of one
request's images (connecting, redirects and bodies together; they are
fetched one after another), a C{200} whose C{content-type} is
C{image/*}, at most L{MAX_REDIRECTS} redirects, each checked as the
first URL is. No request reaches a private, loopback, link-local, shared,
reserved or multicast address (server-side request forgery): the host is
resolved first, every address it has must be public, and the connection
goes to the address that was checked (a second lookup could answer
otherwise). The config's C{image_fetch_private_hosts} names hosts exempt
from the address check (an image server on the LAN, a test server on
loopback). A refusal says which rule refused, not what the host resolves
to or whether it resolves (the log says it): a client cannot map the
daemon's network by the answers.
"""

from __future__ import annotations

import base64
import ipaddress
import socket
from typing import Any, Awaitable, Callable
from urllib.parse import urljoin, urlsplit

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.error import ConnectingCancelledError
from twisted.internet.ssl import optionsForClientTLS
from twisted.logger import Logger
from twisted.web.client import URI, Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IResponse
from zope.interface import implementer

from blazar.config import Config
from blazar.gateway.errors import BadRequest
from blazar.httpbody import BodyTooLarge, read_body, relay_body

log = Logger()

MAX_REDIRECTS = 3
REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv4 addresses in IPv6 (RFC 6052)


class ImageFetchError(BadRequest):
    """
    An image URL that Blazar will not or could not fetch (400); the message
    names the URL, the rule that refused it (never what its host resolves
    to, or whether it does: that is logged) and what to send instead.
    """


def refused_address(address: str) -> str | None:
    """
    Why an image URL may not reach C{address}, or L{None} for a public
    address: C{loopback}, C{private}, C{link-local}, C{shared} (carrier
    NAT, 100.64/10), C{multicast}, C{reserved} or C{unspecified}. An IPv4
    address inside IPv6 (mapped, or NAT64's C{64:ff9b::/96}) is judged as
    the IPv4 address it holds.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip in ipaddress.ip_network("100.64.0.0/10"):
        return "shared"
    if ip.is_private:
        return "private"
    if ip.is_reserved or not ip.is_global:
        return "reserved"
    return None


def thd_resolve(host: str, port: int) -> list[str]:
    """
    The addresses C{host} resolves to (IPv4 and IPv6), in the resolver's
    order. Blocking: call in a thread pool.

    @raise OSError: It does not resolve.
    """
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@implementer(IAgentEndpointFactory)
class _Pinned:
    """
    Connects an L{Agent} to one checked address, whatever the URL's host
    resolves to by then; TLS is verified against the URL's host name.
    """

    def __init__(self, reactor: Any, address: str, hostname: str, timeout: float) -> None:
        self._reactor = reactor
        self._address = address
        self._hostname = hostname
        self._timeout = timeout

    def endpointForURI(self, uri: URI) -> Any:
        kind = TCP6ClientEndpoint if ":" in self._address else TCP4ClientEndpoint
        endpoint = kind(self._reactor, self._address, uri.port, timeout=self._timeout)
        if uri.scheme == b"https":
            return wrapClientTLS(optionsForClientTLS(self._hostname), endpoint)
        return endpoint


class ImageFetcher:
    """
    Fetches chat images named by URL (see the module docstring).

    @ivar _pool: Its own connection pool, not persistent: a fetch's
        connection goes to an address checked for that fetch only, so none
        is kept for another.
    """

    def __init__(
        self,
        reactor: Any,
        config: Callable[[], Config],
        in_thread: Callable[..., Awaitable[Any]],
        resolve: Callable[[str, int], list[str]] = thd_resolve,
    ) -> None:
        """
        @param config: The live config, read per fetch (its C{image_fetch_*}
            keys).
        @param in_thread: Runs a blocking function in the thread pool (the
            resolver, the base64 encoding).
        @param resolve: Host and port to addresses (L{thd_resolve}), in a
            thread.
        """
        self._reactor = reactor
        self._config = config
        self._in_thread = in_thread
        self._resolve = resolve
        self._pool = HTTPConnectionPool(reactor, persistent=False)

    async def fetch(self, url: str, where: str, budget: int, seconds: float | None = None) -> tuple[str, int]:
        """
        The image at C{url} as a C{data:} URL.

        @param where: The field that holds the URL, for the error's C{param}.
        @param budget: Bytes the request's fetched images may still take.
        @param seconds: Seconds the request's fetches may still take (what
            its earlier images left of C{image_fetch_timeout_secs}, which
            bounds them all together); L{None}: all of it.
        @return: The C{data:} URL and the image's size in bytes.
        @raise ImageFetchError: Refused (scheme, host, address, redirect,
            status, type, size) or failed (unreachable, too slow).
        """
        timeout = self._config().image_fetch_timeout
        left = timeout if seconds is None else min(seconds, timeout)
        late = ImageFetchError(
            f"image URL {_shown(url)}: the request's image URLs took longer than {timeout:g} s "
            "to fetch, together (image_fetch_timeout_secs); send the images as base64 data "
            "instead",
            where,
        )
        if left <= 0:
            raise late
        fetching: Deferred[tuple[str, int]] = Deferred.fromCoroutine(self._fetch(url, where, budget))
        fetching.addTimeout(left, self._reactor)
        try:
            return await fetching
        except DeferredTimeout:
            raise late from None

    async def _fetch(self, url: str, where: str, budget: int) -> tuple[str, int]:
        for _ in range(MAX_REDIRECTS + 1):
            response = await self._get(url, where)
            if response.code in REDIRECTS and response.headers.getRawHeaders(b"location"):
                location = response.headers.getRawHeaders(b"location", [b""])[0]
                _discard(response, self._reactor)
                url = urljoin(url, location.decode("latin-1"))
                continue
            return await self._image(response, url, where, budget)
        raise ImageFetchError(f"image URL {_shown(url)} redirects more than {MAX_REDIRECTS} times", where)

    async def _get(self, url: str, where: str) -> IResponse:
        """
        One GET of C{url}, to an address of its host that may be reached.
        """
        config = self._config()
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            wire = url.encode("ascii")
        except (ValueError, UnicodeEncodeError):
            raise ImageFetchError(f"image URL {_shown(url)} is not a valid ASCII http(s) URL", where) from None
        host = parts.hostname
        if parts.scheme not in ("http", "https") or not host:
            raise ImageFetchError(f"image URL {_shown(url)}: Blazar fetches http and https URLs only", where)
        if parts.username is not None or parts.password is not None:
            raise ImageFetchError(f"image URL {_shown(url)} holds credentials; Blazar does not send them", where)
        listed = host.lower().rstrip(".") in config.image_fetch_private_hosts
        # the answer says which rule refused, never what the host resolves to (or that it does not):
        # the client must not map the daemon's network by it; the log says it
        not_public = ImageFetchError(
            f"image URL {_shown(url)}: its host does not resolve to a public address, and Blazar fetches image "
            "URLs only from public addresses. Send the image as base64 data, or allow the host with "
            "image_fetch_private_hosts in the gateway's config",
            where,
        )
        try:
            addresses = (
                [str(ipaddress.ip_address(host))]
                if _is_address(host)
                else await self._in_thread(self._resolve, host, port)
            )
        except OSError as e:
            log.info(
                "image URL host {host!r} ({where}) does not resolve: {error}", host=host, where=where, error=str(e)
            )
            if listed:
                raise ImageFetchError(f"image URL {_shown(url)}: its host does not resolve", where) from None
            raise not_public from None
        if not addresses:
            log.info("image URL host {host!r} ({where}) has no address", host=host, where=where, error="no address")
            raise not_public
        if not listed:
            for address in addresses:
                why = refused_address(address)
                if why is not None:
                    log.info(
                        "image URL host {host!r} ({where}) refused: a {why} address ({address})",
                        host=host,
                        where=where,
                        why=why,
                        address=address,
                    )
                    raise not_public
        agent = Agent.usingEndpointFactory(
            self._reactor, _Pinned(self._reactor, addresses[0], host, config.image_fetch_timeout), pool=self._pool
        )
        headers = Headers({b"user-agent": [b"blazar"], b"accept": [b"image/*"]})
        try:
            response: IResponse = await agent.request(b"GET", wire, headers)
        except Exception as e:
            if _cancelled(e):
                raise CancelledError() from None
            raise ImageFetchError(
                f"image URL {_shown(url)} could not be fetched ({type(e).__name__}: {str(e)[:200]})", where
            ) from None
        return response

    async def _image(self, response: IResponse, url: str, where: str, budget: int) -> tuple[str, int]:
        """
        The body of a response that should be an image, as a C{data:} URL.
        """
        config = self._config()
        if response.code != 200:
            _discard(response, self._reactor)
            raise ImageFetchError(f"image URL {_shown(url)} answered HTTP {response.code}", where)
        kind = (response.headers.getRawHeaders(b"content-type") or [b""])[0].decode("latin-1")
        kind = kind.split(";", 1)[0].strip().lower()
        if not kind.startswith("image/") or not kind[len("image/") :]:
            _discard(response, self._reactor)
            raise ImageFetchError(f"image URL {_shown(url)} is not an image (content-type {kind or 'none'!r})", where)
        limit = min(budget, config.image_fetch_max_bytes)
        too_big = ImageFetchError(
            f"image URL {_shown(url)}: the images of one request may take {config.image_fetch_max_bytes} bytes in "
            "all (image_fetch_max_bytes), and this one is more than what is left; send a smaller image",
            where,
        )
        if isinstance(response.length, int) and response.length > limit:
            _discard(response, self._reactor)
            raise too_big
        try:
            data = await read_body(
                response, self._reactor, idle_timeout=config.image_fetch_timeout, max_bytes=limit, close_ends=True
            )
        except BodyTooLarge:
            raise too_big from None
        except Exception as e:
            if _cancelled(e):
                raise CancelledError() from None
            raise ImageFetchError(f"image URL {_shown(url)}: its body broke off ({type(e).__name__})", where) from None
        encoded = await self._in_thread(base64.b64encode, data)
        return f"data:{kind};base64,{encoded.decode('ascii')}", len(data)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _cancelled(error: BaseException) -> bool:
    """
    Whether a client error is a cancellation (the fetch's deadline, or the
    request's client gone), however the client wrapped it.
    """
    if isinstance(error, (CancelledError, ConnectingCancelledError)):
        return True
    return any(reason.check(CancelledError) for reason in getattr(error, "reasons", None) or [])


def _discard(response: IResponse, clock: Any) -> None:
    """
    Close a response's connection without reading its body.
    """
    reading = relay_body(response, lambda data: None, clock, idle_timeout=1.0, max_bytes=0)
    reading.addErrback(lambda _: None)
    reading.cancel()


def _shown(url: str) -> str:
    """
    A URL as an error message shows it: at most 120 characters.
    """
    return repr(url if len(url) <= 120 else url[:117] + "...")
