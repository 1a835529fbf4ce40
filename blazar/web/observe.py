"""
What the web layer tells L{blazar.metrics}: per request (surface, model,
key, status, duration, error kind, tokens, stream timing) and
C{GET /metrics}.

Surfaces leave facts on the request as they learn them (L{note_error},
L{note_tokens}, L{StreamTiming}); the site reads them once, when the
response is finished or the client has gone (L{RequestObserver}), so the
hot path only sets attributes.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource

from blazar.engines.supervisor import BreakerOpen, EngineCrashed, EngineError, EngineTimeout, NoCapacity
from blazar.metrics import CONTENT_TYPE, Metrics
from blazar.models.registry import ModelNotFound
from blazar.web.admission import AllSlotsBusy
from blazar.web.quota import QuotaExceeded

log = Logger()

# most specific first
_KINDS: list[tuple[type[BaseException], str]] = [
    (AllSlotsBusy, "all_slots_busy"),
    (QuotaExceeded, "quota"),
    (BreakerOpen, "breaker_open"),
    (NoCapacity, "no_capacity"),
    (EngineTimeout, "wedge"),
    (EngineCrashed, "engine_crash"),
    (EngineError, "engine_error"),
    (ModelNotFound, "model_not_found"),
]


def error_kind(error: BaseException) -> str | None:
    """
    The C{kind} label for a domain error, or L{None} for others (counted
    by status class).
    """
    for cls, kind in _KINDS:
        if isinstance(error, cls):
            return kind
    return None


def note_error(request: IRequest, error: BaseException | str | None) -> None:
    """
    Record why C{request} failed (an exception, or a kind), for
    C{blazar_errors_total}. The first specific kind recorded wins.
    """
    kind = error if isinstance(error, str) or error is None else error_kind(error)
    if kind is not None and getattr(request, "blazar_error", None) is None:
        request.blazar_error = kind  # type: ignore[attr-defined]


def note_tokens(request: IRequest, prompt: int, completion: int) -> None:
    """
    Record the engine's prompt and completion token counts for
    C{request}.
    """
    request.blazar_tokens = (prompt, completion)  # type: ignore[attr-defined]


def _object_after(data: bytes, marker: bytes) -> dict[str, Any] | None:
    """
    The JSON object that follows the last C{marker} (C{b'"usage":{'}-like,
    ending in its opening brace) in C{data}, parsed alone.
    """
    import json

    at = data.rfind(marker)
    if at < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(data[at + len(marker) - 1:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def usage_of_reply(payload: bytes) -> tuple[int, int] | None:
    """
    C{(prompt_tokens, completion_tokens)} from a non-streamed OpenAI
    reply's C{usage} object, found without parsing the rest of the reply.
    """
    usage = _object_after(payload, b'"usage":{')
    if usage is None:
        return None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def usage_of_timings(event: bytes) -> tuple[int, int] | None:
    """
    C{(prompt tokens, completion tokens)} from the C{timings} object
    llama-server puts in a stream's last chunk (C{prompt_n} + C{cache_n},
    C{predicted_n}), found without parsing the rest of the event.
    """
    timings = _object_after(event, b'"timings":{')
    if timings is None:
        return None
    prompt = int(timings.get("prompt_n") or 0) + int(timings.get("cache_n") or 0)
    return prompt, int(timings.get("predicted_n") or 0)


def note_span(request: Any, name: str, start: float, end: float | None = None) -> None:
    """
    Record a phase of C{request} for its trace (C{queue}, C{load},
    C{generate}): clock seconds; an end of L{None} means the response's end.
    """
    if request is None:
        return
    spans = getattr(request, "blazar_spans", None)
    if spans is None:
        spans = request.blazar_spans = {}
    spans[name] = (start, end)


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


def timing_of(request: Any) -> StreamTiming | None:
    """
    The request's L{StreamTiming}, made on first use (L{None} for a
    request that is not observed, e.g. in unit tests without a site).
    """
    if request is None or getattr(request, "started", None) is None:
        return None
    timing = getattr(request, "blazar_timing", None)
    if timing is None:
        timing = request.blazar_timing = StreamTiming()
    return timing  # type: ignore[no-any-return]


class RequestObserver:
    """
    Counts one finished request into L{Metrics}.
    """

    def __init__(self, metrics: Metrics, clock: Any, tracing: Any = None) -> None:
        self.metrics = metrics
        self._clock = clock
        self.tracing = tracing  # a blazar.web.tracing.Tracing

    def started(self, request: Any, surface: str) -> None:
        self.metrics.in_flight.labels(surface).inc()
        request.notifyFinish().addBoth(self._finished, request, surface).addErrback(
            lambda f: log.failure("counting a finished request failed", f)
        )

    def _finished(self, result: Any, request: Any, surface: str) -> None:
        m = self.metrics
        m.in_flight.labels(surface).dec()
        gone = isinstance(result, Failure)
        code = int(request.code or 200)
        status = "gone" if gone else f"{code // 100}xx"
        model = getattr(request, "blazar_model", None) or ""
        key = getattr(request, "blazar_key", None)
        key_name = key.name if key is not None else ""
        m.requests.labels(surface, model, key_name, status).inc()
        started = request.started
        end = self._clock.seconds()
        m.duration.labels(surface, model).observe(max(0.0, end - started))
        kind = getattr(request, "blazar_error", None)
        if kind is None and not gone and code >= 400:
            kind = status
        if kind is not None:
            m.errors.labels(surface, model, kind).inc()
        tokens = getattr(request, "blazar_tokens", None)
        if tokens is not None and model:
            m.prompt_tokens.labels(model, key_name).inc(tokens[0])
            m.completion_tokens.labels(model, key_name).inc(tokens[1])
        timing = getattr(request, "blazar_timing", None)
        if timing is not None and timing.first is not None:
            m.ttft.labels(surface, model).observe(max(0.0, timing.first - started))
            if timing.chunks > 1:
                m.tpot.labels(surface, model).observe((timing.last - timing.first) / (timing.chunks - 1))
        if self.tracing is not None:
            self.tracing.record(request, surface, end)


class MetricsResource(Resource):
    """
    C{GET /metrics}: every series, Prometheus text format.
    """

    isLeaf = True

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self._metrics = metrics

    def render_GET(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE)
        return self._metrics.render()
