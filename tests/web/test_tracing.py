"""
Trace spans from a finished request's timestamps, exported in batches on a
Clock through a fake exporter; a failing exporter and a full queue drop
spans and count them.
"""

from __future__ import annotations

from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import KeyConfig
from blazar.gateway.context import RequestContext
from blazar.metrics import Metrics
from blazar.testing import SynchronousThreadPool, fake_process_reactor
from blazar.web import tracing
from blazar.web.tracing import Tracing
from tests.typed import not_none


class Exporter(SpanExporter):
    def __init__(self) -> None:
        self.batches: list[Sequence[ReadableSpan]] = []
        self.fail = False
        self.closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.fail:
            raise ConnectionRefusedError("collector down")
        self.batches.append(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.closed = True


class Request:
    method = b"POST"
    path = b"/v1/chat/completions"
    code = 200

    def __init__(self) -> None:
        self.blazar = RequestContext(
            trace_id="plm-1-1",
            started=100.0,
            model="m:latest",
            key=KeyConfig("me", "x" * 16),
            tokens=(12, 3),
            spans={"queue": (100.0, 100.5), "load": (100.5, 102.0), "generate": (102.0, None)},
        )


class TracingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = fake_process_reactor()
        self.metrics = Metrics()
        self.exporter = Exporter()
        self.tracing = Tracing(
            "http://collector", self.reactor, self.metrics, self.exporter, pool=SynchronousThreadPool()
        )
        self.tracing.startService()

    def dropped(self) -> float:
        return self.metrics.registry.get_sample_value("blazar_otlp_spans_dropped_total") or 0.0

    def test_span_tree_exported_every_ten_seconds(self) -> None:
        self.tracing.record(Request(), "openai", 103.0)
        self.reactor.advance(9.9)
        self.assertEqual(self.exporter.batches, [])
        self.reactor.advance(0.1)
        (batch,) = self.exporter.batches
        spans = {s.name: s for s in batch}
        root = spans["POST /v1/chat/completions"]
        self.assertEqual(set(spans), {root.name, "queue", "load", "generate"})
        for name in ("queue", "load", "generate"):
            self.assertEqual(not_none(spans[name].parent).span_id, not_none(root.context).span_id)
            self.assertEqual(spans[name].context.trace_id, root.context.trace_id)
        self.assertEqual((root.start_time, root.end_time), (100 * 10**9, 103 * 10**9))
        self.assertEqual((spans["load"].start_time, spans["load"].end_time), (int(100.5e9), 102 * 10**9))
        self.assertEqual(spans["generate"].end_time, 103 * 10**9)
        attributes = not_none(root.attributes)
        self.assertEqual(attributes["gen_ai.request.model"], "m:latest")
        self.assertEqual(attributes["gen_ai.usage.output_tokens"], 3)
        self.assertEqual(attributes["blazar.key"], "me")
        self.assertEqual(root.resource.attributes["service.name"], "blazar")
        self.assertEqual(self.dropped(), 0)

    def test_failed_export_drops_and_counts(self) -> None:
        self.exporter.fail = True
        self.tracing.record(Request(), "openai", 103.0)
        self.reactor.advance(10)
        self.assertEqual(self.dropped(), 4)
        # the job goes on
        self.exporter.fail = False
        self.tracing.record(Request(), "openai", 103.0)
        self.reactor.advance(10)
        self.assertEqual(len(self.exporter.batches), 1)

    def test_full_queue_drops_and_counts(self) -> None:
        self.patch(tracing, "MAX_QUEUE", 6)
        small = Tracing("http://collector", self.reactor, self.metrics, self.exporter, pool=SynchronousThreadPool())
        small.record(Request(), "openai", 103.0)
        small.record(Request(), "openai", 103.0)
        self.assertEqual(len(small.queue.spans), 6)
        self.assertEqual(self.dropped(), 2)

    def test_stop_flushes_and_shuts_the_exporter_down(self) -> None:
        self.tracing.record(Request(), "openai", 103.0)
        self.successResultOf(self.tracing.stopService())
        self.assertEqual(len(self.exporter.batches), 1)
        self.assertTrue(self.exporter.closed)
