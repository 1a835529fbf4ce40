"""
What the web layer tells L{blazar.metrics}: per request (surface, model,
key, status, duration, error kind, tokens, stream timing) and
C{GET /metrics}.

The pipeline and the surfaces leave facts in the request's context as they
learn them (L{blazar.gateway.context}); the site reads them once, when the
response is finished or the client has gone (L{RequestObserver}), so the
hot path only sets attributes.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import unquote

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from blazar.gateway.gie import ModelServerGauges
from blazar.metrics import CONTENT_TYPE, Metrics
from blazar.models.registry import ModelNotFound
from blazar.web.activity import Activity, Finished, Performance
from blazar.web.client import context_of

log = Logger()


_DECODER = json.JSONDecoder()


def _object_after(data: bytes, marker: bytes) -> dict[str, Any] | None:
    """
    The JSON object that follows the last C{marker} (C{b'"usage":{'}-like,
    ending in its opening brace) in C{data}, parsed alone.
    """
    at = data.rfind(marker)
    if at < 0:
        return None
    try:
        value, _ = _DECODER.raw_decode(data[at + len(marker) - 1 :].decode("utf-8", "replace"))
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


def _counting_failed(failure: Failure) -> None:
    log.failure("counting a finished request failed", failure)


class RequestObserver:
    """
    Counts one finished request into L{Metrics}.
    """

    def __init__(self, metrics: Metrics, clock: Any, tracing: Any = None) -> None:
        self.metrics = metrics
        self._clock = clock
        self.tracing = tracing  # a blazar.web.tracing.Tracing
        # the dashboard's Activity and Performance pages (blazar.web.activity)
        self.activity = Activity()
        self.performance = Performance()
        # labelled children, bound once per label values: prometheus_client's
        # labels() validates and locks on every call (seven per request)
        self._bound: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._bound.get(key)
        if child is None:
            child = self._bound[key] = metric.labels(*values)
        return child

    def started(self, request: Any, surface: str) -> None:
        self._child(self.metrics.in_flight, surface).inc()
        request.notifyFinish().addBoth(self._finished, request, surface).addErrback(_counting_failed)

    def _finished(self, result: Any, request: Any, surface: str) -> None:
        m, child = self.metrics, self._child
        child(m.in_flight, surface).dec()
        gone = isinstance(result, Failure)
        code = int(request.code or 200)
        status = "gone" if gone else f"{code // 100}xx"
        context = context_of(request)
        model = context.model or ""
        key_name = context.key.name if context.key is not None else ""
        child(m.requests, surface, model, key_name, status).inc()
        if context.remote is not None:
            child(m.remote_requests, context.remote, model, key_name, status).inc()
        started = context.started if context.started is not None else 0.0
        end = self._clock.seconds()
        child(m.duration, surface, model).observe(max(0.0, end - started))
        kind = context.error
        if kind is None and not gone and code >= 400:
            kind = status
        if kind is not None:
            child(m.errors, surface, model, kind).inc()
        for flagged in context.sentinel:
            child(m.sentinel, model, flagged).inc()
        if context.cache is not None:
            child(m.cache, model, context.cache).inc()
        tokens = context.tokens
        if tokens is not None and model:
            child(m.prompt_tokens, model, key_name).inc(tokens[0])
            child(m.completion_tokens, model, key_name).inc(tokens[1])
        if context.audio_seconds is not None and model and not gone and code < 400:
            child(m.audio_seconds, model, key_name).inc(context.audio_seconds)
        if context.images and model:
            child(m.images, model, key_name).inc(context.images)
        timing = context.timing
        ttft = tpot = None
        if timing is not None and timing.first is not None:
            ttft = max(0.0, timing.first - started)
            child(m.ttft, surface, model).observe(ttft)
            if timing.chunks > 1:
                tpot = (timing.last - timing.first) / (timing.chunks - 1)
                child(m.tpot, surface, model).observe(tpot)
        if model and surface != "ui":  # a model's request (not a poll of /api/ps, /metrics or the dashboard)
            seconds = max(0.0, end - started)
            self.activity.add(
                Finished(
                    at=end,
                    surface=surface,
                    method=(getattr(request, "method", b"") or b"").decode("ascii", "replace"),
                    path=(getattr(request, "path", b"") or b"").decode("ascii", "replace")[:200],
                    model=model,
                    key=key_name,
                    status=status,
                    code=code,
                    ms=round(seconds * 1000, 1),
                    prompt_tokens=tokens[0] if tokens else None,
                    completion_tokens=tokens[1] if tokens else None,
                    ttft=ttft,
                    tpot=tpot,
                    trace=context.trace_id,
                )
            )
            self.performance.add(end, seconds, tokens[1] if tokens else 0, not gone and code >= 500)
        if self.tracing is not None:
            self.tracing.record(request, surface, end)


MODEL_METRICS = b"/metrics/models/"


class MetricsResource(Resource):
    """
    C{GET /metrics}: every series, Prometheus text format. With
    C{model_server} (L{blazar.gateway.gie.ModelServerGauges}), the
    children's slots are read first, so that C{vllm:kv_cache_usage_perc}
    is as of this scrape, and C{GET /metrics/models/NAME} answers the
    vLLM-named gauges of that one model (GIE's endpoint picker reads one
    model per scrape target; NAME as a client names the model, 404 for a
    model that does not exist).

    @param resolve: A model's canonical name from a client's name.
    @raise ModelNotFound: (from C{resolve}) No such model.
    """

    isLeaf = True

    def __init__(
        self,
        metrics: Metrics,
        model_server: ModelServerGauges | None = None,
        resolve: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        super().__init__()
        self._metrics = metrics
        self._model_server = model_server
        self._resolve = resolve

    def render_GET(self, request: IRequest) -> Any:
        if self._model_server is None:
            if request.path != b"/metrics":
                request.setResponseCode(404)
                return b""
            request.setHeader(b"content-type", CONTENT_TYPE)
            return self._metrics.render()
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))  # type: ignore[attr-defined]

        def answer(result: tuple[int, bytes]) -> None:
            if gone:
                return
            status, body = result
            request.setResponseCode(status)
            request.setHeader(b"content-type", CONTENT_TYPE if status == 200 else b"text/plain; charset=utf-8")
            request.write(body)
            request.finish()

        def failed(failure: Failure) -> None:
            log.failure("rendering {path}", failure, path=request.path.decode("latin-1"))
            answer((500, b"cannot render the metrics\n"))

        Deferred.fromCoroutine(self._render(request.path)).addCallbacks(answer, failed)
        return NOT_DONE_YET

    async def _render(self, path: bytes) -> tuple[int, bytes]:
        model_server = self._model_server
        assert model_server is not None
        if path == b"/metrics":
            await model_server.refresh()
            return 200, self._metrics.render()
        name = unquote(path.removeprefix(MODEL_METRICS).decode("utf-8", "replace"))
        if not path.startswith(MODEL_METRICS) or not name or self._resolve is None:
            return 404, b"no such metrics path: /metrics or /metrics/models/NAME\n"
        try:
            canonical = await self._resolve(name)
        except ModelNotFound:
            return 404, f"model {name!r} not found\n".encode("utf-8", "replace")
        await model_server.refresh(canonical)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(lambda: model_server.families(canonical)))
        return 200, bytes(generate_latest(registry))


class _Families:
    """
    A one-off collector over a callback's families.
    """

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families()
