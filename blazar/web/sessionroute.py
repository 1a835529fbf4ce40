"""
Sessions stay where their KV is (issue 42): with C{[cluster] database},
several nodes share the sessions' table, which is the KV bank's index
(L{blazar.gateway.sessions}: each row names the node that holds the
session's slot or bank file, and the URL other nodes reach it at). A
request that names a session (L{blazar.gateway.sessions.session_name}:
C{x-blazar-session}, C{x-session-id}, the agents' headers, C{prompt_cache_key},
Anthropic's C{metadata.user_id}) that the index says another node holds
is forwarded there as the client sent it (method, path, headers with its
C{Authorization}, body), with L{FORWARDED_BY} naming this node, and that
node's answer is relayed back as it comes (status, headers, the streamed
body). The holder serves a request that carries L{FORWARDED_BY} itself,
never forwarding it again, and says so in L{SERVED_BY}.

Keys and quotas: the key is checked here at the door, as on any request,
and again by the holder (the same shared keys). A forwarded request is
counted where it runs: this node takes no C{max_concurrent} lease and
counts no C{rpm}, C{tpm} or C{daily_tokens} for it (it never reaches
L{blazar.web.auth.AuthGate.render} nor the pipeline here); the holder
does, as for any request.

A holder that cannot be reached (its connection refused, or no answer
before its headers), or whose row gives no URL (or this node's own), costs
the KV, never the request: this node serves the session itself, a fresh
prefill, and its pin takes the session over in the index (logged, with
why). A holder that dies while its answer is relayed ends the client's
connection without the answer's end (an incomplete chunked or
C{Content-Length} body: an error to every HTTP client, never a silent
clean end).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.iweb import IRequest, IResponse
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from blazar.gateway.context import RequestContext
from blazar.gateway.sessions import anthropic_hint, session_name

log = Logger()

FORWARDED_BY = b"x-blazar-forwarded-by"
"""The request header a forwarding node adds (its name): the holder serves the request itself."""
SERVED_BY = b"x-blazar-served-by"
"""The response header of a forwarded request: the name of the node that served it."""
TRACE_HEADER = b"x-blazar-trace-id"

#: the routes whose requests may pin a session's slot (chat and completions, on every surface)
SESSION_PATHS = frozenset(
    {
        b"/v1/chat/completions",
        b"/v1/completions",
        b"/v1/responses",
        b"/v1/messages",
        b"/api/chat",
        b"/api/generate",
    }
)

#: headers of one hop (RFC 9110, section 7.6.1), never passed on either way
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
    }
)


@attrs.frozen
class Route:
    """
    Where a session's request is served.

    @ivar node: The node the index names as the session's holder (C{""}:
        none, or this one).
    @ivar url: Where to forward the request (C{http://host:port}); C{""}:
        serve it here.
    @ivar why: Why it is served here though another node holds it (the
        session is taken over; C{""}: it is not).
    """

    node: str = ""
    url: str = ""
    why: str = ""


def route_of(rows: Sequence[tuple[str, str, str, float]], model: str | None, me: str, my_url: str) -> Route:
    """
    The forward decision, from the index's rows of one key's sessions of
    one name (L{blazar.store.thd_session_holders}: C{(model, node, url,
    last_used)}, the most recently used first): the row of the model the
    request names, else the most recently used (a name that is an alias of
    the canonical one the row has).

    @param me: This node's name; C{my_url}: its own URL.
    """
    if not rows:
        return Route()
    row = next((r for r in rows if r[0] == model), rows[0])
    _, node, url, _ = row
    if not node or node == me:
        return Route()
    if not url:
        return Route(node, "", f"node {node!r} has no address (its [cluster] url)")
    if my_url and url.rstrip("/") == my_url.rstrip("/"):
        return Route(node, "", f"node {node!r} is listed at this node's own address {url}")
    return Route(node, url.rstrip("/"))


def forwarded_headers(request: IRequest, me: str, trace_id: str | None) -> dict[bytes, list[bytes]]:
    """
    The client's headers as the holder gets them: all but one hop's
    (L{HOP_BY_HOP}), with L{FORWARDED_BY} naming this node and this
    request's trace id (the holder echoes it, so one id names the request
    on both nodes).
    """
    headers = {
        name.lower(): list(values)
        for name, values in request.requestHeaders.getAllRawHeaders()
        if name.lower() not in HOP_BY_HOP
    }
    headers[FORWARDED_BY] = [me.encode("utf-8")]
    if trace_id:
        headers[TRACE_HEADER] = [trace_id.encode("ascii")]
    return headers


def what_it_names(request: IRequest, body: bytes) -> tuple[str | None, str | None]:
    """
    The session a request names and the model it asks for, as the surface
    will read them (L{blazar.web.client.asked_of}): a header, else the
    body's C{prompt_cache_key} or Anthropic's C{metadata.user_id}.
    """

    def header(name: str) -> str | None:
        raw = request.requestHeaders.getRawHeaders(name.encode("ascii"))
        return raw[0].decode("utf-8", "replace") if raw else None

    parsed: Any = None
    if body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the surface answers it
    if not isinstance(parsed, dict):
        parsed = {}
    hint = parsed.get("prompt_cache_key")
    if request.path == b"/v1/messages":
        hint = anthropic_hint(parsed)
    model = parsed.get("model")
    return session_name(header, hint if isinstance(hint, str) else None), model if isinstance(model, str) else None


def ended_by(error: BaseException) -> str:
    """
    What ended a relayed body, in words: the reasons a
    L{ResponseFailed} carries, else the error's own text.
    """
    reasons = getattr(error, "reasons", None)
    if reasons:
        return "; ".join(type(r.value).__name__ for r in reasons)
    return str(error) or type(error).__name__


class _Relay(Protocol):
    """
    The holder's answer's body, written to the client as it comes; C{done}
    fires with L{None} at its clean end, else with the error that ended it
    (as a result: the end of a relay is no failure of the relay's own). The body's
    transport is the client connection's producer: a client that reads
    slowly pauses the reading from the holder (nothing piles up here).
    """

    def __init__(self, request: IRequest, done: Deferred[BaseException | None]) -> None:
        self._request = request
        self._done = done
        self._registered = False

    def connectionMade(self) -> None:
        request: Any = self._request
        if (
            self.transport is not None
            and getattr(request, "channel", None) is not None
            and getattr(request, "producer", None) is None
        ):
            request.registerProducer(self.transport, True)
            self._registered = True

    def dataReceived(self, data: bytes) -> None:
        if not getattr(self._request, "_disconnected", False):
            self._request.write(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        request: Any = self._request
        if self._registered:
            self._registered = False
            if getattr(request, "channel", None) is not None:
                request.unregisterProducer()
        if not self._done.called:
            self._done.callback(None if reason.check(ResponseDone) else reason.value)

    def stop(self) -> None:
        transport: Any = self.transport
        if transport is not None:
            transport.stopProducing()  # (the body's transport: the connection to the holder closed)


class SessionRoute(Resource):
    """
    The public site's root: a session's request goes to the node that
    holds the session (see the module docstring); every other request, and
    every one when forwarding is off, to C{inner} (the L{AuthGate}).

    @param inner: The resource that serves requests here.
    @param authenticate: The door's key check, for a request that did not
        pass the site's door (as through C{StubTreq}): C{AuthGate.authenticate}.
    @param holders: C{holders(key, name)}: the index's rows of C{key}'s
        sessions named C{name} (L{blazar.store.thd_session_holders}).
    @param client: Sends the request on: C{request(method, url, body,
        headers, stream)} answering an C{IResponse} once its headers are in
        (L{blazar.engines.client.EngineClient}, its own pools).
    @param node: This node's name; C{url}: its own address.
    @param enabled: Whether forwarding is on: C{[cluster] database} set and
        sessions on.
    @param taken_over: C{taken_over(key, name)}: this node serves a session
        the index gives to another (L{blazar.gateway.sessions.Sessions.disown}).
    """

    isLeaf = True

    def __init__(
        self,
        inner: IResource,
        authenticate: Callable[[IRequest], Any] | None,
        holders: Callable[[str, str], Deferred[list[tuple[str, str, str, float]]]],
        client: Any,
        node: str,
        url: str,
        enabled: Callable[[], bool],
        taken_over: Callable[[str, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.authenticate = authenticate
        self.holders = holders
        self.client = client
        self.node = node
        self.url = url
        self.enabled = enabled
        self.taken_over = taken_over or (lambda key, name: None)

    def render(self, request: IRequest) -> Any:
        by = request.getHeader(FORWARDED_BY)
        if by is not None:
            # the holder: served here, never forwarded again
            request.setHeader(SERVED_BY, self.node.encode("utf-8"))
            return self.inner.render(request)
        if request.method != b"POST" or request.path not in SESSION_PATHS or not self.enabled():
            return self.inner.render(request)
        context: RequestContext | None = getattr(request, "blazar", None)
        if context is not None and context.door_asked:
            found = context.door
        else:
            found = self.authenticate(request) if self.authenticate is not None else None
        if found is not None and not hasattr(found, "owner"):
            return self.inner.render(request)  # a refusal: the gate answers it
        content = request.content
        if content is None:
            return self.inner.render(request)
        content.seek(0)
        body = content.read()
        content.seek(0)
        name, model = what_it_names(request, body)
        if name is None:
            return self.inner.render(request)
        key = found.owner if found is not None else ""
        if context is not None:
            context.key = found  # (for this node's access and audit lines; the gate sets it again if it runs)
        trace = context.trace_id if context is not None else None
        d = Deferred.fromCoroutine(self._route(request, key, name, model, body, trace))
        request.notifyFinish().addErrback(lambda _: d.cancel())  # type: ignore[attr-defined]

        def failed(failure: Failure) -> None:
            if failure.check(CancelledError):
                return
            log.failure("routing session {session}'s request failed", failure, session=name)
            if not request.startedWriting and not getattr(request, "_disconnected", False):  # type: ignore[attr-defined]
                request.setResponseCode(500)
                request.finish()
            elif not getattr(request, "finished", False):
                request.loseConnection()  # type: ignore[attr-defined]

        d.addErrback(failed)
        return NOT_DONE_YET

    async def _route(
        self, request: IRequest, key: str, name: str, model: str | None, body: bytes, trace: str | None
    ) -> None:
        try:
            rows = await self.holders(key, name)
        except CancelledError:
            raise
        except Exception as e:
            log.warn(
                "looking up which node holds session {session} failed ({error}); serving it here",
                session=name,
                error=str(e) or type(e).__name__,
            )
            rows = []
        route = route_of(rows, model, self.node, self.url)
        if not route.url:
            if route.why:
                log.warn(
                    "session {session} is held by node {node}, but {why}: this node takes it over (a fresh prefill)",
                    session=name,
                    node=route.node,
                    why=route.why,
                )
                self.taken_over(key, name)
            self._here(request)
            return
        try:
            response: IResponse = await self.client.request(
                request.method.decode("ascii"),
                route.url + request.uri.decode("latin-1"),
                body,
                forwarded_headers(request, self.node, trace),
                True,
            )
        except CancelledError:
            raise
        except Exception as e:
            log.warn(
                "session {session} is held by node {node} at {url}, which could not be reached ({error}): "
                "this node takes it over (a fresh prefill)",
                session=name,
                node=route.node,
                url=route.url,
                error=str(e) or type(e).__name__,
            )
            self.taken_over(key, name)
            self._here(request)
            return
        await self._relay(request, response, route, name)

    def _here(self, request: IRequest) -> None:
        """
        Serve the request on this node (as L{AuthGate} does after a wait).
        """
        if getattr(request, "_disconnected", False):
            return
        answer = self.inner.render(request)
        if answer is not NOT_DONE_YET:
            request.write(answer)
            request.finish()

    async def _relay(self, request: IRequest, response: IResponse, route: Route, name: str) -> None:
        """
        The holder's answer to the client, unchanged but for one hop's
        headers; the body as it comes. An answer cut short ends the
        client's connection without its end.
        """
        request.setResponseCode(response.code, response.phrase)
        for header, values in response.headers.getAllRawHeaders():
            if header.lower() not in HOP_BY_HOP:
                request.responseHeaders.setRawHeaders(header, values)
        length = response.headers.getRawHeaders(b"content-length")
        if length:
            request.responseHeaders.setRawHeaders(b"content-length", length[-1:])
        relay: _Relay
        done: Deferred[BaseException | None] = Deferred(lambda _: relay.stop())
        relay = _Relay(request, done)
        response.deliverBody(relay)
        ended = await done
        if ended is None:
            if not getattr(request, "_disconnected", False):
                request.finish()
            return
        log.error(
            "node {node} at {url} stopped answering session {session}'s request before its end ({error}): "
            "the client's connection is closed without the answer's end",
            node=route.node,
            url=route.url,
            session=name,
            error=ended_by(ended),
        )
        if not getattr(request, "_disconnected", False):
            request.loseConnection()  # type: ignore[attr-defined]
