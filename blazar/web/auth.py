"""
API keys at the door: which key a request carries, in each surface's own
401 shape when it carries none or a wrong one, and the check that model
management needs an unscoped key (403). What a scoped key may see of models
is decided in L{blazar.gateway.scope}.

Keys come from C{[[keys]]} in the config (L{blazar.config.KeyConfig}), and
with C{[cluster] database} from the store the nodes share too
(L{KeyHolder}). Auth
is on iff at least one key exists; without keys the gateway trusts its
(loopback, by default) network. Secrets are compared in constant time and
never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
from typing import Any, Callable

from twisted.internet.address import UNIXAddress
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from blazar.config import Config, KeyConfig, LiveConfig, SharedKey, live_config
from blazar.gateway.batch import KEY_HEADER, SECRET_HEADER
from blazar.gateway.context import RequestContext, key_of, trace_id_of
from blazar.gateway.errors import Forbidden, Refused, Unauthorized
from blazar.gateway.quota import IQuotas, QuotaExceeded
from blazar.postgres import StoreUnavailable
from blazar.web.client import context_of
from blazar.web.errors import answer, envelope

log = Logger()

OPEN_PATHS = {b"/health", b"/healthz"}
# images made with response_format "url": the unguessable address is the capability (blazar.web.openai)
HELD_IMAGES = b"/v1/images/files/"
# the dashboard's page and assets (blazar.web.dashboard): the page asks for the key; its data needs one
UI_PAGE = (b"/ui", b"/ui/", b"/ui/api/door")
UI_ASSETS = b"/ui/static/"


class KeyHolder:
    """
    The keys of the live config (L{blazar.config.LiveConfig}), of
    C{BLAZAR_KEYS}, and of the cluster's shared store (C{[cluster]
    database}: L{blazar.storeservice.SharedKeys}), read from the live
    config's current object and the shared keys' current tuple at each
    lookup; the lookup tables are made again only when either changes.

    A shared key whose name a config-file key has is left out (the node's
    own key wins; adding one is refused, so only a hand edit makes one).
    """

    def __init__(
        self,
        config: Config | LiveConfig,
        extra: tuple[KeyConfig, ...] = (),
        shared: Callable[[], tuple[SharedKey, ...]] | None = None,
    ) -> None:
        """
        @param shared: The shared keys last read (a new tuple at each
            change); L{None} without a cluster.
        """
        self._extra = extra
        self._shared = shared
        self.live = live_config(config)
        self._seen: Config | None = None
        self._shared_seen: tuple[SharedKey, ...] | None = None
        self._all: list[KeyConfig] = []
        # sha256 of each secret -> (secret, key): one lookup per request, not a compare per key
        self._by_digest: dict[bytes, tuple[bytes, KeyConfig]] = {}
        # a shared key's sha256 -> the key: only the digest is stored, never the secret
        self._shared_by_digest: dict[bytes, KeyConfig] = {}

    @property
    def config(self) -> Config:
        """
        The live config's current object.
        """
        return self.live.current

    def set(self, config: Config) -> None:
        """
        Swap C{config} into the live config (everything that reads it sees
        it).
        """
        self.live.swap(config)

    @property
    def _keys(self) -> list[KeyConfig]:
        self._refresh()
        return self._all

    def _refresh(self) -> None:
        current = self.live.current
        shared = self._shared() if self._shared is not None else ()
        if current is not self._seen or shared is not self._shared_seen:
            local = (*current.keys, *self._extra)
            encoded = [(k.secret.encode("utf-8"), k) for k in local]
            # (the last key of a secret wins, as the scan that compared every key did)
            self._by_digest = {hashlib.sha256(secret).digest(): (secret, k) for secret, k in encoded}
            names = {k.name for k in local}
            kept = [s for s in shared if s.key.name not in names]
            for clash in sorted({s.key.name for s in shared} & names):
                log.warn(
                    "the shared key {name!r} is not used on this node: its config file has a key of that name "
                    "(rename or remove one of them)",
                    name=clash,
                )
            self._shared_by_digest = {s.digest: s.key for s in kept}
            self._all = [*local, *(s.key for s in kept)]
            self._seen, self._shared_seen = current, shared

    @property
    def active(self) -> bool:
        return bool(self._keys)

    def named(self, name: str) -> KeyConfig | None:
        """
        The key whose L{KeyConfig.owner} is C{name} (a batch line runs as
        the key that made its batch; a key removed since, and one added
        under its name, is not it).
        """
        for key in self._keys:
            if key.owner == name:
                return key
        return None

    def find(self, presented: bytes) -> KeyConfig | None:
        """
        The key whose secret is C{presented}: one dict lookup by the
        presented bytes' SHA-256 (which says nothing about how near a
        guess came to a secret), then that secret compared in constant
        time; a shared key, whose secret is not kept, by its SHA-256 alone.
        """
        self._refresh()
        digest = hashlib.sha256(presented).digest()
        candidate = self._by_digest.get(digest)
        if candidate is None:
            return self._shared_by_digest.get(digest)
        secret, key = candidate
        return key if hmac.compare_digest(secret, presented) else None


def surface_of(path: bytes) -> str:
    """
    Which surface answers C{path}: C{"ollama"}, C{"anthropic"}, C{"responses"}
    (OpenAI's Responses API) or C{"openai"}.
    """
    if path == b"/ui" or path.startswith(b"/ui/") or path == b"/api/logs":
        return "ui"  # the dashboard (blazar.web.dashboard)
    if path == b"/" or path.startswith(b"/api/") or path == b"/api":
        return "ollama"
    if path == b"/v1/messages" or path.startswith(b"/v1/messages/"):
        return "anthropic"
    if path == b"/v1/responses" or path.startswith(b"/v1/responses/"):
        return "responses"  # OpenAI's error shape, its own metrics label
    return "openai"


UI_CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    b"font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def ui_headers(request: IRequest) -> None:
    """
    The security headers of every dashboard response (errors and
    preflights included): a strict CSP, no framing, no sniffing.
    """
    request.setHeader(b"content-security-policy", UI_CSP)
    request.setHeader(b"x-frame-options", b"DENY")
    request.setHeader(b"x-content-type-options", b"nosniff")
    request.setHeader(b"referrer-policy", b"no-referrer")
    request.setHeader(b"cache-control", b"no-store")


def _host_name(host: str) -> str:
    if host.startswith("["):
        return host[1:].split("]", 1)[0].lower()
    return (host.rsplit(":", 1)[0] if host.count(":") == 1 else host).lower().rstrip(".")


def _local_name(host: str) -> bool:
    """
    Whether C{host} (C{name[:port]}, C{[v6][:port]}) names this machine:
    C{localhost} (and C{*.localhost}) or a loopback address.
    """
    name = _host_name(host)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


_UNREBINDABLE: dict[str, bool] = {}
_UNREBINDABLE_MAX = 256  # Host values remembered (clients send a handful; a scanner's are not all kept)


def _unrebindable(host: str) -> bool:
    """
    Whether a C{Host} cannot be a DNS-rebound name (as Ollama allows
    them): an IP address, this machine's names, or a name under
    C{.localhost}, C{.local} or C{.internal}. Remembered per value (a
    client sends the same C{Host} on every request).
    """
    known = _UNREBINDABLE.get(host)
    if known is None:
        known = _unrebindable_now(host)
        if len(_UNREBINDABLE) >= _UNREBINDABLE_MAX:
            _UNREBINDABLE.clear()
        _UNREBINDABLE[host] = known
    return known


def _unrebindable_now(host: str) -> bool:
    name = _host_name(host)
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return _local_name(host) or name == socket.gethostname().lower() or name.endswith((".local", ".internal"))


def check_same_machine_page(request: IRequest, host_too: bool = False) -> None:
    """
    On a gateway without keys, what a request may do rests on it coming
    from this machine; a web page on this machine is not the user,
    though. A browser names the page's origin (C{Origin}) on cross-site
    requests and on every POST, which must be this machine's; with
    C{host_too}, the C{Host} a DNS-rebinding page reaches the daemon
    under (for reads, which carry no C{Origin}) must not be a name that
    could have been rebound.

    @raise Forbidden: Another site's page, or a rebound name.
    """
    origin = request.getHeader(b"origin")
    if origin is not None:
        text = origin.decode("latin-1") if isinstance(origin, bytes) else str(origin)
        if text == "null":
            raise Forbidden(
                "this gateway has no API keys, so a page of no origin (a sandboxed frame, a file) may not manage it"
            )
        if not _local_name(text.split("://", 1)[-1]):
            raise Forbidden(
                f"this gateway has no API keys, so it takes management only from this machine's own pages and "
                f"tools; the page at {text!r} is not one (add a key: `blazar keys add admin`)"
            )
    if host_too:
        host = request.getHeader(b"host")
        text = host.decode("latin-1") if isinstance(host, bytes) else str(host or "")
        if text and not _unrebindable(text):
            raise Forbidden(
                f"this gateway has no API keys, so its dashboard answers only under this machine's own names; "
                f"host {text!r} is not one (add a key: `blazar keys add admin`)"
            )


def keyless_refusal(request: IRequest, config: Any) -> Forbidden | None:
    """
    On a gateway without keys, whoever can reach it may use it; a web page
    must not be able to (issue 36; Ollama's CVE-2024-28224). A DNS-rebinding
    page reaches the daemon under its own name (C{Host}), and a cross-site
    "simple" POST (C{text/plain}, a form) names its page (C{Origin}); a
    browser cannot forge either. So every route but C{/} and C{/health}
    answers only under this machine's names (L{_unrebindable}: loopback
    names and addresses, any IP, its hostname, C{*.local}, C{*.internal})
    or C{allowed_hosts}, and to pages of this machine, of the same origin
    (the dashboard opened from another machine), or of C{cors_origins}.
    Clients that are not browsers (curl, the SDKs) send no C{Origin} and
    the address they dialled as C{Host}: they pass.

    @return: A L{Forbidden} (403) naming the fix, or L{None}.
    """
    host_raw = request.getHeader(b"host")
    host = host_raw.decode("latin-1") if isinstance(host_raw, bytes) else str(host_raw or "")
    allowed = tuple(getattr(config, "allowed_hosts", ()))
    if host and not _unrebindable(host) and _host_name(host) not in allowed:
        return Forbidden(
            (
                f"this gateway has no API keys, so it answers only under this machine's own names; host "
                f"{_host_name(host)!r} is not one: add it to allowed_hosts in the config, or add a key "
                "(`blazar keys add admin`)"
            ),
            code="host_not_allowed",
        )
    origin_raw = request.getHeader(b"origin")
    if origin_raw is None:
        return None
    origin = origin_raw.decode("latin-1") if isinstance(origin_raw, bytes) else str(origin_raw)
    cors = tuple(getattr(config, "cors_origins", ()))
    page = origin.split("://", 1)[-1]
    if origin != "null" and (
        "*" in cors
        or origin in cors
        or _local_name(page)
        or (host and page.lower() == host.lower())
        or _host_name(page) in allowed
    ):
        return None
    return Forbidden(
        (
            f"this gateway has no API keys, so web pages of other sites may not use it; the page at {origin!r} "
            "is not this machine's: list it in cors_origins to let it, or add a key (`blazar keys add admin`)"
        ),
        code="origin_not_allowed",
    )


def bearer_secret(request: IRequest) -> bytes | None:
    """
    The secret in C{Authorization: Bearer <secret>}, if that is there.
    """
    header = request.getHeader(b"authorization")
    if header and header[:7].lower() == b"bearer ":
        return header[7:].strip()
    return None


def presented_secret(request: IRequest) -> bytes | None:
    """
    C{Authorization: Bearer <secret>}, else C{x-api-key}.
    """
    bearer = bearer_secret(request)
    if bearer is not None:
        return bearer
    api_key = request.getHeader(b"x-api-key")
    return api_key.strip() if api_key else None


Refusal = Exception
"""
What the door answers a request with instead of passing it on: a domain
error of L{blazar.gateway.errors} (L{Unauthorized}, L{Forbidden},
L{Refused}, L{TooManyConnections}, L{QuotaExceeded}), by the one table.
"""


def render_refusal(request: IRequest, refusal: Refusal) -> bytes:
    """
    Set C{request}'s status and headers for C{refusal} (C{WWW-Authenticate}
    on a 401, C{Retry-After} when it has one, Anthropic's C{request-id}),
    note its kind for the metrics, and return the body, in the surface's
    shape (L{blazar.web.errors.envelope}).
    """
    surface = surface_of(request.path or b"")
    problem = answer(request, refusal, surface)
    assert problem is not None  # (a domain error, not a departure)
    status, body = envelope(surface, problem)
    request.setResponseCode(status)
    if status == 401:
        request.setHeader(b"www-authenticate", b'Bearer realm="blazar"')
    if surface == "anthropic":
        request.setHeader(b"request-id", ("req_" + trace_id_of(context_of(request))).encode())
    return body


def is_local(address: object) -> bool:
    """
    Whether a client address is this machine: a loopback IPv4 or IPv6
    address (IPv4-mapped ones included), or the peer of a UNIX socket.
    """
    if isinstance(address, UNIXAddress):
        return True
    host = getattr(address, "host", None)
    if not isinstance(host, str):
        return False
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")


class AuthGate(Resource):
    """
    Checks the key, then hands the request to the surfaces. The key found
    is left on the request as C{blazar_key} (L{None} when auth is off).

    The site (L{blazar.web.site}) asks L{authenticate} as soon as a
    request's headers are in, before any of its body is read, answers a
    refusal itself and leaves the answer in the request's context (C{door});
    L{render} goes by that answer (and asks for a request that came another
    way, such as through C{StubTreq}).
    """

    isLeaf = True

    def __init__(self, inner: IResource, keys: KeyHolder, quotas: IQuotas | None = None) -> None:
        super().__init__()
        self._inner = inner
        self._keys = keys
        self._quotas = quotas

    @property
    def active(self) -> bool:
        """
        Whether auth is on (at least one key exists).
        """
        return self._keys.active

    def authenticate(self, request: IRequest) -> KeyConfig | Refusal | None:
        """
        Who C{request} is, from its method, path, client address and
        headers alone (the body need not have arrived).

        @return: The key it presents; L{None} when it needs none (auth is
            off, or an open route: C{/health}, C{/healthz}, C{GET /},
            C{OPTIONS}, and C{/metrics} as C{metrics_require_key} says); or
            a L{Refusal}: 400 for C{Authorization} or C{x-api-key} sent more
            than once (a front proxy that checks the first would see another
            identity than the last) or for C{Authorization: Bearer} and
            C{x-api-key} with different keys (one checked, the other
            used), 401 for a missing or wrong key, 403
            for a scoped key asking for C{/metrics} (where it needs a key).
        """
        for name in CREDENTIAL_HEADERS:
            given = request.requestHeaders.getRawHeaders(name) or []
            if len(given) > 1:
                return Refused(
                    400, "bad_request", (f"the {name.decode('ascii')} header was sent {len(given)} times; send it once")
                )
        if not self._keys.active:
            return None if self._page_route(request) else keyless_refusal(request, self._keys.config)
        if self._open_route(request):
            return None
        bearer, api_key = bearer_secret(request), request.getHeader(b"x-api-key")
        authorization = request.getHeader(b"authorization")
        if api_key and authorization and bearer is None:
            # (a front proxy that checks the Authorization would see another
            # identity than the x-api-key used here: issue 36)
            scheme = authorization.split(b" ", 1)[0].decode("latin-1")[:20]
            return Refused(
                400,
                "bad_request",
                (
                    f"Authorization: {scheme} and x-api-key were both sent: send the key once, as "
                    "`Authorization: Bearer <key>` or as `x-api-key`"
                ),
            )
        if bearer and api_key and not hmac.compare_digest(bearer, api_key.strip()):
            return Refused(
                400,
                "bad_request",
                (
                    "Authorization: Bearer and x-api-key carry different keys; send one key, "
                    "in one of them (or the same key in both)"
                ),
            )
        secret = presented_secret(request)
        key = self._keys.find(secret) if secret else None
        if key is None:
            what = "missing" if not secret else "invalid"
            return Unauthorized(
                f"{what} API key: send it as `Authorization: Bearer <key>` or `x-api-key` "
                "(keys are listed with `blazar keys list`)"
            )
        if is_metrics(request.path) and not key.admin:
            # the series name every model and key: to a scoped key, models
            # outside its scope do not exist
            return Forbidden(
                f"key {key.name!r} is scoped to models and may not read /metrics, which names "
                "every model and key: scrape with an unscoped (admin) key, or set "
                "metrics_require_key = false to open /metrics to everyone"
            )
        return key

    def authenticate_batch_line(self, request: IRequest, secret: bytes) -> KeyConfig | Refusal | None:
        """
        Who a request on the private batch listener is
        (L{blazar.gateway.batch}): only the daemon's own batch runner,
        which sends the per-daemon C{secret} in L{SECRET_HEADER} and the
        name of the key that made the batch in L{KEY_HEADER}; the line is
        then that key's request (its scope, quotas and weight). The public
        listeners never call this: there the two headers mean nothing.

        @return: The batch's key (L{None} on a gateway without keys), or a
            401 L{Refusal}: no or a wrong secret, or a key that no longer
            exists.
        """
        given = request.getHeader(SECRET_HEADER)
        if not given or not hmac.compare_digest(given, secret):
            return Unauthorized("this listener serves only the daemon's own Batch API lines")
        if not self._keys.active:
            return None
        raw = request.getHeader(KEY_HEADER) or b""
        name = raw.decode("utf-8", "replace")
        key = self._keys.named(name)
        if key is None:
            return Unauthorized(f"the API key {name!r} that made this batch no longer exists")
        return key

    def _page_route(self, request: IRequest) -> bool:
        """
        The routes a keyless gateway answers whatever the Host and Origin
        (nothing in them to take or to do): C{/}, C{/health}, C{/healthz},
        and C{OPTIONS} (a CORS preflight; the request itself is checked).
        """
        return request.path in OPEN_PATHS or request.method == b"OPTIONS" or request.path == b"/"

    def _open_route(self, request: IRequest) -> bool:
        path, method = request.path, request.method
        if (
            path in OPEN_PATHS
            or method == b"OPTIONS"
            or (path == b"/" and method in (b"GET", b"HEAD"))
            or (path.startswith(HELD_IMAGES) and method in (b"GET", b"HEAD"))
            or (method in (b"GET", b"HEAD") and (path in UI_PAGE or path.startswith(UI_ASSETS)))
        ):
            return True
        if is_metrics(path):
            # it names every model and key: once keys exist, an admin key from everywhere (a
            # scoped key must not read it by leaving its key out, on loopback too: issue 36),
            # unless metrics_require_key = false opens it
            return self._keys.config.metrics_require_key is False
        return False

    def render(self, request: IRequest) -> Any:
        context = context_of(request)
        context.key, context.keys_active = None, self._keys.active
        # the site asked at the headers
        found = context.door if context.door_asked else self.authenticate(request)
        if isinstance(found, Refusal):
            return render_refusal(request, found)
        if found is not None:
            key: KeyConfig = found
            context.key = key
            quotas = self._quotas
            if quotas is not None:
                taken = quotas.take_lease(key)
                if not taken.called:
                    # (a shared counter, C{[cluster] redis}: the request waits for its answer)
                    taken.addCallbacks(
                        self._leased, self._not_leased, callbackArgs=(request, context, key), errbackArgs=(request,)
                    )
                    taken.addErrback(lambda f: log.failure("answering after the quota check failed", f))
                    return NOT_DONE_YET
                result = taken.result
                if isinstance(result, Failure):
                    taken.addErrback(lambda _: None)
                    result.trap(QuotaExceeded, StoreUnavailable)
                    return render_refusal(request, result.value)  # type: ignore[arg-type]
                self._admit(request, context, key, quotas, result)
        return self._inner.render(request)

    def _admit(
        self, request: IRequest, context: RequestContext, key: KeyConfig, quotas: IQuotas, lease: object
    ) -> None:
        """
        Hang the key's limits on the request: its C{lease} rides the
        response (handed back when it is fully sent, or when the client
        goes away), and the rate checks wait for the scope check
        (L{blazar.gateway.scope.resolve_in_scope}) or, for routes that name
        no model (the Files and Batch APIs), for the route (rpm alone).
        """
        request.notifyFinish().addBoth(lambda _: _logged(quotas.give_lease(key, lease)))  # type: ignore[attr-defined]
        context.rates = lambda: quotas.check_rates(key)
        context.requests = lambda: quotas.check_requests(key)
        if key.tpm is not None or key.daily_tokens is not None:
            context.usage = lambda tokens: _logged(quotas.count_tokens(key, tokens))

    def _leased(self, lease: object, request: IRequest, context: RequestContext, key: KeyConfig) -> None:
        quotas = self._quotas
        assert quotas is not None
        if getattr(request, "_disconnected", False) or getattr(request, "finished", False):
            _logged(quotas.give_lease(key, lease))  # (the client left while the lease was taken)
            return
        self._admit(request, context, key, quotas, lease)
        body = self._inner.render(request)
        if body is not NOT_DONE_YET:
            request.write(body)
            request.finish()

    def _not_leased(self, failure: Failure, request: IRequest) -> None:
        failure.trap(QuotaExceeded, StoreUnavailable)
        if getattr(request, "_disconnected", False):
            return
        request.write(render_refusal(request, failure.value))  # type: ignore[arg-type]
        request.finish()


def _logged(d: Deferred[None]) -> None:
    """
    Log a failure of a quota count or lease hand-back that no request
    waits for (a lease not handed back expires by itself).
    """
    if not d.called or isinstance(d.result, Failure):
        d.addErrback(lambda f: log.error("a quota count failed: {why}", why=f.getErrorMessage()))


def check_admin(request: IRequest, what: str) -> None:
    """
    Management over HTTP (pull, copy, delete) needs an unscoped key. On a
    gateway without keys it is allowed from loopback only (what local
    Ollama clients do), and refused from the network.

    @raise Forbidden: A scoped key, or a keyless request from the network.
    """
    key = key_of(context_of(request))
    if key is not None and not key.admin:
        raise Forbidden(f"key {key.name!r} is scoped to models and may not {what}; use an unscoped key")
    if key is None and not context_of(request).keys_active:
        check_keyless_management(request, what)


def check_keyless_management(request: IRequest, what: str) -> None:
    """
    On a gateway without keys, management is for this machine only: its
    loopback peers (or a UNIX socket), not for another site's page
    (L{check_same_machine_page}). The site's door asks it from the headers
    too, so that a blob upload it refuses is not given C{max_blob_bytes}.

    @raise Forbidden: A request from the network, or from another page.
    """
    peer = request.getClientAddress()
    host = getattr(peer, "host", None)
    if host is not None and host not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        raise Forbidden(
            f"this gateway has no API keys, so it does not {what} for clients on the network; "
            "add a key first (`blazar keys add admin`) and send it as a Bearer token"
        )
    check_same_machine_page(request, host_too=True)


def keys_from_env(value: str | None) -> tuple[KeyConfig, ...]:
    """
    Unscoped keys from C{BLAZAR_KEYS}: C{name:secret} pairs separated by
    commas (for containers and service managers that pass secrets in the
    environment; they are not written to the config file).

    @raise ValueError: Malformed, or a secret under 16 characters.
    """
    if not value:
        return ()
    keys = []
    for item in value.split(","):
        name, sep, secret = item.strip().partition(":")
        if not sep or not name or len(secret) < 16:
            raise ValueError(
                "BLAZAR_KEYS must be name:secret pairs separated by commas, secrets of at least 16 characters"
            )
        keys.append(KeyConfig(name, secret))
    return tuple(keys)


def is_metrics(path: bytes) -> bool:
    """
    C{/metrics} or a model's own (C{/metrics/models/NAME}): an admin key's
    once keys exist, unless C{metrics_require_key = false}.
    """
    return path == b"/metrics" or path.startswith(b"/metrics/")
