"""
Opt-in OpenTelemetry traces (C{otlp_endpoint} in the config): one span per
request, with child spans for its queue wait, the engine load it waited for
and the generation, exported over OTLP/HTTP (protobuf, to
C{<otlp_endpoint>/v1/traces}) by the official SDK's exporter.

Nothing here slows a request: spans are built from timestamps the request
already carries, once it has finished; they wait in a bounded queue
(L{MAX_QUEUE}) and leave in batches of at most L{MAX_BATCH} every
L{INTERVAL} seconds from a thread of their own. A full queue or a failed
export (an unreachable collector) drops spans and counts them in
C{blazar_otlp_spans_dropped_total}.

Span names and attributes follow OpenTelemetry's HTTP and GenAI semantic
conventions where they have a term (C{http.request.method}, C{url.path},
C{http.response.status_code}, C{gen_ai.request.model},
C{gen_ai.usage.input_tokens}, C{gen_ai.usage.output_tokens}); Blazar's
own are C{blazar.*}.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from blazar import __version__
from blazar.gateway.context import key_of, trace_id_of
from blazar.metrics import Metrics
from blazar.web.client import context_of

log = Logger()

INTERVAL = 10.0
MAX_QUEUE = 4096
MAX_BATCH = 512
EXPORT_TIMEOUT = 5.0


class BoundedQueue(SpanProcessor):
    """
    Keeps ended spans for L{Tracing} to export; past C{size}, new spans
    are dropped and counted.
    """

    def __init__(self, size: int, metrics: Metrics) -> None:
        self.spans: deque[ReadableSpan] = deque()
        self._size = size
        self._metrics = metrics

    def on_end(self, span: ReadableSpan) -> None:
        if len(self.spans) >= self._size:
            self._metrics.spans_dropped.inc()
            return
        self.spans.append(span)

    def take(self, count: int) -> list[ReadableSpan]:
        return [self.spans.popleft() for _ in range(min(count, len(self.spans)))]


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Tracing(Service):
    """
    The tracer and its export job.

    @param exporter: Where spans go (default: OTLP/HTTP to C{endpoint}).
    """

    def __init__(
        self,
        endpoint: str,
        reactor: Any,
        metrics: Metrics,
        exporter: SpanExporter | None = None,
        interval: float = INTERVAL,
        pool: Any = None,
    ) -> None:
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint + "/v1/traces", timeout=EXPORT_TIMEOUT)
        self._exporter = exporter
        self._reactor = reactor
        self._metrics = metrics
        self._interval = interval
        self.queue = BoundedQueue(MAX_QUEUE, metrics)
        provider = TracerProvider(resource=Resource.create({"service.name": "blazar", "service.version": __version__}))
        provider.add_span_processor(self.queue)
        self._tracer = provider.get_tracer("blazar", __version__)
        self._pool = pool if pool is not None else ThreadPool(1, 1, name="blazar-otlp")
        self._job: LoopingCall | None = None
        self._exporting: Deferred[Any] | None = None

    # -- spans ---------------------------------------------------------------

    def record(self, request: Any, surface: str, end: float) -> None:
        """
        The span tree of one finished request: C{"<METHOD> <path>"} from
        arrival to C{end} (clock seconds), and a child per entry of the
        request context's C{spans} (C{queue}, C{load}, C{generate}: start
        and end seconds).
        """
        started = context_of(request).started or 0.0
        key = key_of(context_of(request))
        attributes: dict[str, Any] = {
            "http.request.method": request.method.decode("ascii", "replace"),
            "url.path": request.path.decode("ascii", "replace"),
            "http.response.status_code": int(getattr(request, "code", 200) or 200),
            "blazar.surface": surface,
            "blazar.trace_id": trace_id_of(context_of(request)),
        }
        model = context_of(request).model
        if model:
            attributes["gen_ai.request.model"] = model
        if key is not None:
            attributes["blazar.key"] = key.name
        tokens = context_of(request).tokens
        if tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = tokens[0]
            attributes["gen_ai.usage.output_tokens"] = tokens[1]
        kind = context_of(request).error
        if kind is not None:
            attributes["error.type"] = kind
        root = self._tracer.start_span(
            f"{attributes['http.request.method']} {attributes['url.path']}",
            kind=trace.SpanKind.SERVER,
            start_time=_ns(started),
            attributes=attributes,
        )
        context = trace.set_span_in_context(root)
        for name, (start, stop) in context_of(request).spans.items():
            child = self._tracer.start_span(name, context=context, start_time=_ns(start))
            child.end(end_time=_ns(stop if stop is not None else end))
        root.end(end_time=_ns(end))

    # -- export ----------------------------------------------------------------

    def startService(self) -> None:
        Service.startService(self)
        self._pool.start()
        self._job = LoopingCall(self.export)
        self._job.clock = self._reactor
        self._job.start(self._interval, now=False).addErrback(lambda f: log.failure("trace export job stopped", f))

    def export(self) -> Deferred[Any]:
        """
        Send one batch (if the previous one is done). Never fails.
        """
        if self._exporting is not None or not self.queue.spans:
            return succeed(None)
        batch = self.queue.take(MAX_BATCH)
        d = self._exporting = deferToThreadPool(self._reactor, self._pool, self._thd_export, batch)

        def done(result: Any) -> None:
            self._exporting = None
            if result is not SpanExportResult.SUCCESS:
                self._metrics.spans_dropped.inc(len(batch))

        d.addBoth(done)
        d.addErrback(lambda f: log.failure("trace export bookkeeping failed", f))
        return d

    def _thd_export(self, batch: Sequence[ReadableSpan]) -> Any:
        try:
            return self._exporter.export(batch)
        except Exception:
            return SpanExportResult.FAILURE

    def stopService(self) -> Deferred[Any]:
        Service.stopService(self)
        if self._job is not None and self._job.running:
            self._job.stop()
        pending = self._exporting or self.export()

        def close(_: Any) -> Any:
            return deferToThreadPool(self._reactor, self._pool, self._exporter.shutdown)

        def stop_pool(_: Any) -> None:
            self._pool.stop()

        d = pending.addBoth(close)
        d.addBoth(stop_pool)
        return d
