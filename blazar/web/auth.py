"""
API keys at the door: which key a request carries, in each surface's own
401 shape when it carries none or a wrong one, and the check that model
management needs an unscoped key (403). What a scoped key may see of models
is decided in L{blazar.web.scope}.

Keys come from C{[[keys]]} in the config (L{blazar.config.KeyConfig}). Auth
is on iff at least one key exists; without keys the gateway trusts its
(loopback, by default) network. Secrets are compared in constant time and
never logged.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from blazar.config import Config, KeyConfig
from blazar.web.quota import QuotaExceeded, Quotas, retry_after

OPEN_PATHS = {b"/health", b"/healthz"}


class Forbidden(Exception):
    """
    The request's key may not do this operation (model management with a
    scoped key, or from the network without keys). A model outside a key's
    scope is not this but L{blazar.models.registry.ModelNotFound}
    (L{blazar.web.scope}).
    """


class KeyHolder:
    """
    The live config's keys; swapped whole when keys change at runtime.
    """

    def __init__(self, config: Config, extra: tuple[KeyConfig, ...] = ()) -> None:
        self._extra = extra
        self.set(config)

    def set(self, config: Config) -> None:
        self.config = config
        self._keys = [(k.secret.encode("utf-8"), k) for k in (*config.keys, *self._extra)]

    @property
    def active(self) -> bool:
        return bool(self._keys)

    def find(self, presented: bytes) -> KeyConfig | None:
        """
        The key whose secret is C{presented}; every key is compared, in
        constant time, so timing says nothing about which one nearly matched.
        """
        found = None
        for secret, key in self._keys:
            if hmac.compare_digest(secret, presented):
                found = key
        return found


def surface_of(path: bytes) -> str:
    """
    Which surface answers C{path}: C{"ollama"}, C{"anthropic"}, C{"responses"}
    (OpenAI's Responses API) or C{"openai"}.
    """
    if path == b"/" or path.startswith(b"/api/") or path == b"/api":
        return "ollama"
    if path == b"/v1/messages" or path.startswith(b"/v1/messages/"):
        return "anthropic"
    if path == b"/v1/responses" or path.startswith(b"/v1/responses/"):
        return "responses"  # OpenAI's error shape, its own metrics label
    return "openai"


def error_body(surface: str, status: int, message: str) -> bytes:
    """
    An error in the surface's own shape.
    """
    if surface == "ollama":
        return json.dumps({"error": message}).encode()
    if surface == "anthropic":
        kind = {401: "authentication_error", 403: "permission_error", 413: "request_too_large",
                429: "rate_limit_error"}.get(status, "invalid_request_error")
        return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
    code = {401: "invalid_api_key", 403: "model_not_allowed", 413: "request_too_large",
            429: "rate_limit_exceeded"}.get(status)
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind,
                                 "param": None, "code": code}}).encode()


def presented_secret(request: IRequest) -> bytes | None:
    """
    C{Authorization: Bearer <secret>}, else C{x-api-key}.
    """
    header = request.getHeader(b"authorization")
    if header and header[:7].lower() == b"bearer ":
        return header[7:].strip()
    api_key = request.getHeader(b"x-api-key")
    return api_key.strip() if api_key else None


class AuthGate(Resource):
    """
    Checks the key, then hands the request to the surfaces. The key found
    is left on the request as C{blazar_key} (L{None} when auth is off).
    """

    isLeaf = True

    def __init__(self, inner: IResource, keys: KeyHolder, quotas: Quotas | None = None) -> None:
        super().__init__()
        self._inner = inner
        self._keys = keys
        self._quotas = quotas

    def render(self, request: IRequest) -> Any:  # type: ignore[override]
        request.blazar_key = None  # type: ignore[attr-defined]
        request.blazar_keys_active = self._keys.active  # type: ignore[attr-defined]
        open_route = (
            request.path in OPEN_PATHS
            or (request.path == b"/metrics" and not self._keys.config.metrics_require_key)
            or request.method == b"OPTIONS"
            or (request.path == b"/" and request.method in (b"GET", b"HEAD"))
        )
        if self._keys.active and not open_route:
            secret = presented_secret(request)
            key = self._keys.find(secret) if secret else None
            if key is None:
                surface = surface_of(request.path)
                request.setResponseCode(401)
                request.setHeader(b"content-type", b"application/json")
                request.setHeader(b"www-authenticate", b'Bearer realm="blazar"')
                if surface == "anthropic":
                    request.setHeader(b"request-id", ("req_" + getattr(request, "trace_id", "")).encode())
                request.blazar_error = "auth"  # type: ignore[attr-defined]
                what = "missing" if not secret else "invalid"
                return error_body(surface, 401, (
                    f"{what} API key: send it as `Authorization: Bearer <key>` or `x-api-key` "
                    "(keys are listed with `blazar keys list`)"
                ))
            request.blazar_key = key  # type: ignore[attr-defined]
            if self._quotas is not None:
                try:
                    self._quotas.lease(key)
                except QuotaExceeded as e:
                    request.blazar_error = "quota"  # type: ignore[attr-defined]
                    surface = surface_of(request.path)
                    request.setResponseCode(429)
                    request.setHeader(b"content-type", b"application/json")
                    retry_after(request, e.retry_after)
                    if surface == "anthropic":
                        request.setHeader(b"request-id", ("req_" + getattr(request, "trace_id", "")).encode())
                    return error_body(surface, 429, str(e))
                # the lease rides the response: released when it is fully
                # sent, or when the client goes away
                quotas = self._quotas
                request.notifyFinish().addBoth(lambda _: quotas.release(key))  # type: ignore[attr-defined]
                # rpm / tpm / daily come after the scope check (scope.resolve_in_scope)
                request.blazar_rates = lambda: quotas.rates(key)  # type: ignore[attr-defined]
                if key.tpm is not None or key.daily_tokens is not None:
                    request.blazar_usage = lambda tokens: quotas.record(key, tokens)  # type: ignore[attr-defined]
        return self._inner.render(request)


def key_of(request: IRequest) -> KeyConfig | None:
    """
    The key a request was admitted with (L{None}: auth is off).
    """
    return getattr(request, "blazar_key", None)


def check_admin(request: IRequest, what: str) -> None:
    """
    Management over HTTP (pull, copy, delete) needs an unscoped key. On a
    gateway without keys it is allowed from loopback only (what local
    Ollama clients do), and refused from the network.

    @raise Forbidden: A scoped key, or a keyless request from the network.
    """
    key = key_of(request)
    if key is not None and not key.admin:
        raise Forbidden(f"key {key.name!r} is scoped to models and may not {what}; use an unscoped key")
    if key is None and not getattr(request, "blazar_keys_active", False):
        peer = request.getClientAddress()
        host = getattr(peer, "host", None)
        if host is not None and host not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
            raise Forbidden(
                f"this gateway has no API keys, so it does not {what} for clients on the network; "
                "add a key first (`blazar keys add admin`) and send it as a Bearer token"
            )


def wants_usage(request: IRequest) -> bool:
    """
    Whether this request's key has token limits, so its usage must be
    counted (the OpenAI surface parses replies only then).
    """
    return getattr(request, "blazar_usage", None) is not None


def record_usage(request: IRequest, tokens: int) -> None:
    """
    Count C{tokens} (prompt + completion, from the child) against the
    request's key, if it has token limits.
    """
    record = getattr(request, "blazar_usage", None)
    if record is not None:
        record(tokens)


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
