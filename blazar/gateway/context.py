"""
What the gateway learns about one request while it runs, in one typed
object (L{RequestContext}) instead of attributes scattered over the
twisted request: the key it was admitted with, the model it used, why it
failed, its tokens, its trace spans and its stream timing. The site makes
it when the request arrives (L{blazar.web.site.BlazarRequest}); the access
log, the metrics, the audit line and the trace read it when it ends.

The gateway never sees the HTTP request itself: the web layer hands it
this context, whose L{IClient} (the web layer's own adapter) follows the
response (L{blazar.web.client.context_of} makes both); what the client
asked in its headers comes decoded on the call
(L{blazar.gateway.call.Asked}), and the response headers the gateway
decides go back as data (L{blazar.gateway.reply.Reply.headers} and
C{verdict}, L{RequestContext.ignored}) that the web layer writes.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
from twisted.internet.defer import Deferred
from zope.interface import Interface

from blazar.config import KeyConfig
from blazar.gateway.errors import describe


class StreamTiming:
    """
    When a child's streamed events arrived, for TTFT and TPOT.

    @ivar first: Clock seconds of the first bytes, or L{None}.
    @ivar last: Clock seconds of the latest bytes.
    @ivar chunks: How many SSE events arrived (counted by their blank-line
        ends, so TPOT does not depend on how TCP cut the stream).
    """

    __slots__ = ("first", "last", "chunks")

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.chunks = 0

    def tick(self, now: float, events: int = 1) -> None:
        """
        C{events} SSE events arrived at C{now} (several may share one read).
        """
        if self.first is None:
            self.first = now
        self.last = now
        self.chunks += events


class IClient(Interface):
    """
    The client's end of one request, as the web layer shows it to the
    gateway: who sent it and how big it is, a signal of the response's
    end, and whether the response has started. What the client asked
    (priority, deadline, session) is not here: the surface decodes it
    into its call (L{blazar.gateway.call.Asked}); nor are the response
    headers the gateway decides: they are data the web layer writes.
    Only C{blazar.web} implements it.
    """

    def agent() -> str:
        """
        The first product of the C{User-Agent} (at most 60 characters), or
        C{""}.
        """

    def body_size() -> int:
        """
        Bytes of the request's body, as received.
        """

    def finished() -> Deferred[None]:
        """
        A new Deferred that fires when the response is finished and fails
        when the client leaves first.
        """

    def writing() -> bool:
        """
        Whether the response has started (its headers are out).
        """

    def consumer() -> Any:
        """
        The response as a Twisted consumer a streaming relay may register
        its push producer with (L{blazar.gateway.backpressure}), or
        L{None} when it cannot have one.
        """


@attrs.define
class RequestContext:
    """
    One request's state in the gateway.

    @ivar trace_id: The request's trace id (C{x-blazar-trace-id}).
    @ivar started: Clock seconds when its headers were in; L{None} for a
        request no site observes (unit tests), which gets no timing.
    @ivar key: The API key it was admitted with (L{None}: auth is off, or
        an open route).
    @ivar keys_active: Whether the gateway has keys at all.
    @ivar model: The canonical model it used, once resolved.
    @ivar error: Why it failed, as a C{blazar_errors_total} kind; the
        first specific kind recorded wins.
    @ivar tokens: C{(prompt, completion)} tokens the engine reported.
    @ivar spans: Trace phases: name -> (start, end or L{None} for the
        response's end), clock seconds.
    @ivar timing: When streamed events arrived (observed requests only).
    @ivar rates: Checks the key's rate limits (L{blazar.gateway.quota};
        a Deferred, fired already when the limits are counted in memory).
    @ivar requests: Checks the key's C{rpm} alone, for a route that names
        no model (L{count_request}).
    @ivar usage: Counts tokens against the key's token limits, if it has any.
    @ivar door: What the site's door decided from the headers (a key, a
        refusal or L{None}); L{NOT_ASKED} until it asked.
    @ivar sentinel: What the sentinel found wrong with the answer (codes).
    """

    trace_id: str = ""
    started: float | None = None
    key: KeyConfig | None = None
    keys_active: bool = False
    model: str | None = None
    error: str | None = None
    tokens: tuple[int, int] | None = None
    spans: dict[str, tuple[float, float | None]] = attrs.Factory(dict)
    timing: StreamTiming | None = None
    rates: Callable[[], Deferred[None]] | None = None
    requests: Callable[[], Deferred[None]] | None = None
    usage: Callable[[int], None] | None = None
    door: Any = None
    door_asked: bool = False
    sentinel: tuple[str, ...] = ()  # the sentinel's codes on the answer (blazar.gateway.sentinel)
    audio_seconds: float | None = None  # a transcription's audio, decoded (metrics, audit)
    images: int | None = None  # images an image request made (metrics, audit)
    remote: str | None = None  # the [[remotes]] name that answered it (metrics, audit)
    cache: str | None = None  # the semantic cache's outcome: hit, miss, bypass, error (None: not enabled)
    batch_line: bool = False  # it came over the private batch listener (the daemon's own Batch API runner)
    client: Any = None  # the web layer's IClient for it (None: a request no web layer made, e.g. a unit test's)
    ignored: tuple[str, ...] = ()  # what x-blazar-ignored lists, as the web layer writes it (blazar.gateway.ignored)


async def count_request(context: RequestContext) -> None:
    """
    Check and count a request of a route that names no model and spends
    no tokens (the Files and Batch APIs) against its key's C{rpm}, once;
    nothing for a request without a key.

    @raise blazar.gateway.quota.QuotaExceeded: Over rpm.
    """
    requests, context.requests, context.rates = context.requests, None, None
    if requests is not None:
        await requests()


def trace_id_of(context: RequestContext | None) -> str:
    """
    The request's trace id (C{""} before the site gave it one).
    """
    return context.trace_id if context is not None else ""


def note_error(context: RequestContext | None, error: BaseException | str | None) -> None:
    """
    Record why the request failed (an exception, or a kind), for
    C{blazar_errors_total}. The first specific kind recorded wins.
    """
    kind = error if isinstance(error, str) or error is None else describe(error).kind
    if context is not None and kind is not None and context.error is None:
        context.error = kind


def note_tokens(context: RequestContext | None, prompt: int, completion: int) -> None:
    """
    Record the engine's prompt and completion token counts for the request.
    """
    if context is not None:
        context.tokens = (prompt, completion)


def note_span(context: RequestContext | None, name: str, start: float, end: float | None = None) -> None:
    """
    Record a phase of the request for its trace (C{queue}, C{load},
    C{generate}): clock seconds; an end of L{None} means the response's end.
    """
    if context is not None:
        context.spans[name] = (start, end)


def timing_of(context: RequestContext | None) -> StreamTiming | None:
    """
    The request's L{StreamTiming}, made on first use (L{None} for a
    request that is not observed, e.g. in unit tests without a site).
    """
    if context is None or context.started is None:
        return None
    if context.timing is None:
        context.timing = StreamTiming()
    return context.timing


def key_of(context: RequestContext | None) -> KeyConfig | None:
    """
    The key a request was admitted with (L{None}: auth is off).
    """
    return context.key if context is not None else None


def wants_usage(context: RequestContext | None) -> bool:
    """
    Whether this request's key has token limits, so its usage must be
    counted (the OpenAI surface parses replies only then).
    """
    return context is not None and context.usage is not None


def record_usage(context: RequestContext | None, tokens: int) -> None:
    """
    Count C{tokens} (prompt + completion, from the child) against the
    request's key, if it has token limits.
    """
    record = context.usage if context is not None else None
    if record is not None:
        record(tokens)
