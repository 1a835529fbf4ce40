"""
Per-request metrics (RequestObserver over a DummyRequest on a Clock) and
the cheap token finders used on the hot path.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from blazar.config import KeyConfig
from blazar.engines.supervisor import EngineCrashed
from blazar.gateway.admission import AllSlotsBusy
from blazar.gateway.context import note_error, note_tokens, timing_of
from blazar.gateway.errors import describe
from blazar.metrics import Metrics, label_reason
from blazar.web.client import context_of
from blazar.web.observe import RequestObserver, usage_of_reply, usage_of_timings


class Request(DummyRequest):
    @property
    def code(self) -> int:  # twisted.web's Request.code
        return self.responseCode or 200


class ObserverTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.metrics = Metrics()
        self.observer = RequestObserver(self.metrics, self.clock)

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def request(self) -> DummyRequest:
        request = Request([b"v1"])
        context_of(request).started = self.clock.seconds()
        return request

    def test_success_with_tokens_and_stream_timing(self) -> None:
        request = self.request()
        self.observer.started(request, "openai")
        self.assertEqual(self.value("blazar_requests_in_flight", surface="openai"), 1)
        context_of(request).model = "m:latest"
        context_of(request).key = KeyConfig("me", "x" * 16)
        timing = timing_of(context_of(request))
        assert timing is not None
        for t in (0.5, 0.6, 0.7, 0.8):
            self.clock.advance(t - self.clock.seconds())
            timing.tick(self.clock.seconds())
        note_tokens(context_of(request), 12, 3)
        self.clock.advance(0.2)
        request.finish()
        labels = {"surface": "openai", "model": "m:latest"}
        self.assertEqual(self.value("blazar_requests_total", key="me", status="2xx", **labels), 1)
        self.assertEqual(self.value("blazar_requests_in_flight", surface="openai"), 0)
        self.assertAlmostEqual(self.value("blazar_request_duration_seconds_sum", **labels), 1.0)
        self.assertAlmostEqual(self.value("blazar_time_to_first_token_seconds_sum", **labels), 0.5)
        self.assertAlmostEqual(self.value("blazar_time_per_output_token_seconds_sum", **labels), 0.1)
        self.assertEqual(self.value("blazar_prompt_tokens_total", model="m:latest", key="me"), 12)
        self.assertEqual(self.value("blazar_completion_tokens_total", model="m:latest", key="me"), 3)

    def test_errors_by_kind_then_by_status(self) -> None:
        request = self.request()
        self.observer.started(request, "ollama")
        note_error(context_of(request), AllSlotsBusy("busy", 1.0, 1.0))
        note_error(context_of(request), "5xx")  # the first specific kind wins
        request.setResponseCode(503)
        request.finish()
        self.assertEqual(self.value("blazar_errors_total", surface="ollama", model="", kind="all_slots_busy"), 1)
        plain = self.request()
        self.observer.started(plain, "ollama")
        plain.setResponseCode(400)
        plain.finish()
        self.assertEqual(self.value("blazar_errors_total", surface="ollama", model="", kind="4xx"), 1)

    def test_client_gone(self) -> None:
        request = self.request()
        self.observer.started(request, "anthropic")
        request.processingFailed(Failure(ConnectionError("gone")))
        self.assertEqual(self.value("blazar_requests_total", surface="anthropic", model="", key="", status="gone"), 1)
        self.assertIsNone(self.value("blazar_errors_total", surface="anthropic", model="", kind="gone"))

    def test_kinds(self) -> None:
        self.assertEqual(describe(EngineCrashed("m", "died")).kind, "engine_crash")
        self.assertIsNone(describe(ValueError()).kind)
        self.assertEqual(label_reason("making room for qwen:7b"), "making room")
        self.assertEqual(label_reason("wedged: no response headers"), "wedged")


class TokenFinderTests(SynchronousTestCase):
    def test_usage_of_reply(self) -> None:
        reply = b'{"choices":[{"message":{"content":"\\"usage\\":{"}}],"usage":{"completion_tokens":4,"prompt_tokens":21,"total_tokens":25}}'
        self.assertEqual(usage_of_reply(reply), (21, 4))
        self.assertIsNone(usage_of_reply(b'{"choices":[]}'))
        self.assertIsNone(usage_of_reply(b'{"usage":{"broken'))

    def test_usage_of_timings(self) -> None:
        event = (
            b'data: {"choices":[{"finish_reason":"length","delta":{}}],'
            b'"timings":{"cache_n":20,"prompt_n":1,"predicted_n":3}}\n\ndata: [DONE]\n\n'
        )
        self.assertEqual(usage_of_timings(event), (21, 3))
        self.assertIsNone(usage_of_timings(b"data: {}\n\n"))
