"""
What the gateway learns about one request while it runs, in one typed
object (L{RequestContext}) instead of attributes scattered over the
twisted request: the key it was admitted with, the model it used, why it
failed, its tokens, its trace spans and its stream timing. The site makes
it when the request arrives (L{blazar.web.site.BlazarRequest}); the access
log, the metrics, the audit line and the trace read it when it ends.

The functions here are the one way to read and write it, so a request
made another way (C{StubTreq}, a test's C{DummyRequest}) gets one on first
use.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

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
    @ivar rates: Checks the key's rate limits (L{blazar.gateway.quota}).
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
    rates: Callable[[], None] | None = None
    requests: Callable[[], None] | None = None
    usage: Callable[[int], None] | None = None
    door: Any = None
    door_asked: bool = False
    sentinel: tuple[str, ...] = ()  # the sentinel's codes on the answer (blazar.gateway.sentinel)
    audio_seconds: float | None = None  # a transcription's audio, decoded (metrics, audit)
    images: int | None = None  # images an image request made (metrics, audit)
    remote: str | None = None  # the [[remotes]] name that answered it (metrics, audit)
    cache: str | None = None  # the semantic cache's outcome: hit, miss, bypass, error (None: not enabled)
    batch_line: bool = False  # it came over the private batch listener (the daemon's own Batch API runner)


def context_of(request: Any) -> RequestContext:
    """
    The request's L{RequestContext}, made on first use.
    """
    context = getattr(request, "blazar", None)
    if context is None:
        context = request.blazar = RequestContext()
    return context


def count_request(request: Any) -> None:
    """
    Check and count a request of a route that names no model and spends
    no tokens (the Files and Batch APIs) against its key's C{rpm}, once;
    nothing for a request without a key.

    @raise blazar.gateway.quota.QuotaExceeded: Over rpm.
    """
    context = context_of(request)
    requests, context.requests, context.rates = context.requests, None, None
    if requests is not None:
        requests()


def trace_id_of(request: Any) -> str:
    """
    The request's trace id (C{""} before the site gave it one).
    """
    return context_of(request).trace_id if request is not None else ""


def note_error(request: Any, error: BaseException | str | None) -> None:
    """
    Record why C{request} failed (an exception, or a kind), for
    C{blazar_errors_total}. The first specific kind recorded wins.
    """
    kind = error if isinstance(error, str) or error is None else describe(error).kind
    context = context_of(request)
    if kind is not None and context.error is None:
        context.error = kind


def note_tokens(request: Any, prompt: int, completion: int) -> None:
    """
    Record the engine's prompt and completion token counts for C{request}.
    """
    context_of(request).tokens = (prompt, completion)


def note_span(request: Any, name: str, start: float, end: float | None = None) -> None:
    """
    Record a phase of C{request} for its trace (C{queue}, C{load},
    C{generate}): clock seconds; an end of L{None} means the response's end.
    """
    if request is not None:
        context_of(request).spans[name] = (start, end)


def timing_of(request: Any) -> StreamTiming | None:
    """
    The request's L{StreamTiming}, made on first use (L{None} for a
    request that is not observed, e.g. in unit tests without a site).
    """
    if request is None:
        return None
    context = context_of(request)
    if context.started is None:
        return None
    if context.timing is None:
        context.timing = StreamTiming()
    return context.timing


def key_of(request: Any) -> KeyConfig | None:
    """
    The key a request was admitted with (L{None}: auth is off).
    """
    return context_of(request).key


def wants_usage(request: Any) -> bool:
    """
    Whether this request's key has token limits, so its usage must be
    counted (the OpenAI surface parses replies only then).
    """
    return context_of(request).usage is not None


def record_usage(request: Any, tokens: int) -> None:
    """
    Count C{tokens} (prompt + completion, from the child) against the
    request's key, if it has token limits.
    """
    record = context_of(request).usage
    if record is not None:
        record(tokens)
