"""
Routable by Kubernetes' Gateway API Inference Extension (issue 42, part
3): GIE's request headers decoded onto admission (objective, fairness id,
SLO deadline, session), the fairness id as its own flow in weighted fair
queuing, and the vLLM-named gauges (waiting, running, KV-cache share from
the children's /slots) on /metrics and /metrics/models/NAME.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyRequest

from blazar.config import Config, QueueConfig
from blazar.engines.instance import InstanceState
from blazar.gateway.admission import Admission, AllSlotsBusy, Lease, ModelQueue, Priority
from blazar.gateway.call import Asked
from blazar.gateway.gie import ModelServerGauges, kv_of_slots
from blazar.metrics import Metrics
from blazar.models.registry import ModelNotFound
from blazar.web.client import asked_of
from blazar.web.observe import MetricsResource


def asked(**headers: str) -> Asked:
    request = DummyRequest([b"v1"])
    for name, value in headers.items():
        request.requestHeaders.setRawHeaders(name.replace("_", "-"), [value])
    return asked_of(cast(IRequest, request))


class HeaderTests(SynchronousTestCase):
    def test_objective_sets_the_tier(self) -> None:
        self.assertEqual(asked(x_gateway_inference_objective="Critical").priority, Priority.HIGH)
        self.assertEqual(asked(x_gateway_inference_objective=" standard ").priority, Priority.NORMAL)
        self.assertEqual(asked(x_gateway_inference_objective="sheddable").priority, Priority.LOW)
        # a client's batch is low, as x-blazar-priority: batch becomes in admission
        self.assertEqual(asked(x_gateway_inference_objective="batch").priority, Priority.LOW)
        self.assertEqual(asked(x_gateway_inference_objective="high").ignored, ())

    def test_unknown_objective_is_normal_and_named(self) -> None:
        found = asked(x_gateway_inference_objective="gold-tier")
        self.assertEqual(found.priority, Priority.NORMAL)
        self.assertEqual(found.ignored, ("x-gateway-inference-objective",))

    def test_blazar_priority_wins(self) -> None:
        found = asked(x_blazar_priority="low", x_gateway_inference_objective="critical")
        self.assertEqual(found.priority, Priority.LOW)
        self.assertEqual(found.ignored, ("x-gateway-inference-objective",))
        # a bad value of Blazar's own is normal, as ever, and still wins
        self.assertEqual(
            asked(x_blazar_priority="urgent", x_gateway_inference_objective="critical").priority, Priority.NORMAL
        )

    def test_ttft_is_the_deadline(self) -> None:
        self.assertEqual(asked(x_slo_ttft_ms="1500").deadline, 1.5)
        self.assertEqual(asked(x_slo_ttft_ms="1500", x_blazar_deadline_ms="250").deadline, 0.25)
        # unparseable: absent, as a bad x-blazar-deadline-ms is
        self.assertIsNone(asked(x_slo_ttft_ms="soon").deadline)
        self.assertIsNone(asked(x_slo_ttft_ms="-3").deadline)
        self.assertIsNone(asked(x_slo_ttft_ms="nan").deadline)

    def test_tpot_is_named_ignored(self) -> None:
        found = asked(x_slo_tpot_ms="50")
        self.assertIsNone(found.deadline)
        self.assertEqual(found.ignored, ("x-slo-tpot-ms",))

    def test_fairness_id(self) -> None:
        self.assertEqual(asked(x_gateway_inference_fairness_id=" tenant-a ").fairness, "tenant-a")
        self.assertIsNone(asked(x_gateway_inference_fairness_id="  ").fairness)
        self.assertIsNone(asked().fairness)
        self.assertEqual(len(asked(x_gateway_inference_fairness_id="x" * 500).fairness or ""), 100)

    def test_session_id(self) -> None:
        self.assertEqual(asked(x_session_id="conv-1").session, "conv-1")
        self.assertEqual(asked(x_session_id="conv-1", x_blazar_session="mine").session, "mine")
        # before the coding agents' own headers
        self.assertEqual(asked(x_session_id="conv-1", session_id="codex").session, "conv-1")

    def test_nothing_sent_is_nothing_asked(self) -> None:
        self.assertEqual(asked(), Asked())


class FairnessFlowTests(SynchronousTestCase):
    """
    One API key (a gateway's) with two fairness ids: the ids share the
    slot as two keys would, and the key's cap on waiters stays the key's.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.queue = ModelQueue("m:latest", self.clock, QueueConfig(max_waiting=8))
        self.admitted: list[str] = []
        self.leases: list[Lease] = []

    def enqueue(self, label: str, fairness: str | None) -> Deferred[Lease]:
        d = self.queue.admit(self.queue.ticket(key="gateway", fairness=fairness, trace_id=label), 1)

        def got(lease: Lease) -> Lease:
            self.admitted.append(label)
            self.leases.append(lease)
            return lease

        return d.addCallback(got)

    def test_fairness_ids_alternate(self) -> None:
        self.enqueue("first", "a")
        for i in range(3):
            self.enqueue(f"a{i}", "a")
        self.enqueue("b0", "b")
        while self.leases:
            self.leases.pop(0).release()
        # b starts level with a (no banked credit), then the two alternate;
        # without the fairness id, b0 would wait behind a0..a2 (one key, deadline order)
        self.assertEqual(self.admitted, ["first", "a0", "b0", "a1", "a2"])

    def test_cap_is_the_keys(self) -> None:
        self.enqueue("running", "a")
        waiting = [self.enqueue(f"w{i}", f"tenant-{i}") for i in range(4)]
        self.assertEqual(len(self.queue.waiting), 4)
        # half of max_waiting = 4 for the key, whatever the fairness ids
        self.assertRaises(AllSlotsBusy, self.enqueue, "over", "tenant-new")
        for d in waiting:
            d.cancel()
            self.failureResultOf(d)


def instance(name: str, pid: int, state: InstanceState = InstanceState.READY, lane: str = "llamacpp") -> Any:
    return SimpleNamespace(
        entry=SimpleNamespace(name=name),
        pid=pid,
        state=state,
        lane=lane,
        base_url=f"http://127.0.0.1:{pid}",
        auth_headers={b"authorization": [b"Bearer k"]},
    )


SLOTS_A = [
    {"id": 0, "n_ctx": 1000, "is_processing": True, "n_prompt_tokens": 300},
    {"id": 1, "n_ctx": 1000, "is_processing": False, "n_prompt_tokens": 900},  # an idle slot's cache: free
]
SLOTS_B = [{"id": 0, "n_ctx": 2000, "is_processing": True, "n_prompt_tokens": 500}]


class GaugeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.admission = Admission(self.clock, lambda: Config())
        self.children = [instance("m:latest", 1), instance("m:latest", 2), instance("n:latest", 3)]
        self.answers: dict[str, tuple[int, bytes]] = {
            "http://127.0.0.1:1/slots": (200, json.dumps(SLOTS_A).encode()),
            "http://127.0.0.1:2/slots": (200, json.dumps(SLOTS_B).encode()),
            "http://127.0.0.1:3/slots": (503, b"{}"),
        }
        self.asked: list[tuple[str, dict[bytes, list[bytes]], float]] = []
        self.gauges = ModelServerGauges(self.admission, lambda: self.children, self.fetch)

    async def fetch(
        self, url: str, headers: dict[bytes, list[bytes]], timeout: float = 5.0, max_bytes: int = 0
    ) -> tuple[int, bytes]:
        self.asked.append((url, headers, timeout))
        return self.answers[url]

    def scrape(self, model: str | None = None) -> dict[tuple[str, str], float]:
        self.successResultOf(Deferred.fromCoroutine(self.gauges.refresh(model)))
        return {
            (family.name, sample.labels["model_name"]): sample.value
            for family in self.gauges.families(model)
            for sample in family.samples
        }

    def test_kv_of_slots(self) -> None:
        self.assertEqual(kv_of_slots(SLOTS_A), (300, 2000))
        self.assertEqual(kv_of_slots([{"id": 0, "n_ctx": 10, "is_processing": True}]), (0, 10))
        self.assertEqual(kv_of_slots([{"id": 0, "n_ctx": 10, "is_processing": True, "n_prompt_tokens": 99}]), (10, 10))
        self.assertRaises(ValueError, kv_of_slots, {"slots": []})
        self.assertRaises(ValueError, kv_of_slots, [{"id": 0}])

    def test_kv_is_summed_over_a_models_children(self) -> None:
        values = self.scrape()
        self.assertEqual(values[("vllm:kv_cache_usage_perc", "m:latest")], (300 + 500) / (2000 + 2000))
        # a child that does not answer is left out, and so is its model (no invented 0)
        self.assertNotIn(("vllm:kv_cache_usage_perc", "n:latest"), values)
        self.assertEqual(values[("vllm:num_requests_running", "n:latest")], 0.0)
        self.assertEqual({a[2] for a in self.asked}, {1.0})
        self.assertEqual(self.asked[0][1], {b"authorization": [b"Bearer k"]})

    def test_values_are_the_scrapes_own(self) -> None:
        self.assertEqual(self.scrape()[("vllm:kv_cache_usage_perc", "m:latest")], 0.2)
        self.answers["http://127.0.0.1:1/slots"] = (200, json.dumps([{"n_ctx": 1000}, {"n_ctx": 1000}]).encode())
        self.answers["http://127.0.0.1:2/slots"] = (200, json.dumps([{"n_ctx": 2000}]).encode())
        self.assertEqual(self.scrape()[("vllm:kv_cache_usage_perc", "m:latest")], 0.0)

    def test_children_not_ready_or_not_llamacpp_are_not_asked(self) -> None:
        self.children = [
            instance("m:latest", 1, InstanceState.STARTING),
            instance("w:latest", 4, lane="whisper"),
        ]
        values = self.scrape()
        self.assertEqual(self.asked, [])
        # a model with no ready llama-server child holds no KV cache
        self.assertEqual(values[("vllm:kv_cache_usage_perc", "m:latest")], 0.0)
        self.assertEqual(values[("vllm:kv_cache_usage_perc", "w:latest")], 0.0)

    def test_waiting_and_running_from_admission(self) -> None:
        queue = self.admission.queue("m:latest")
        first = queue.admit(queue.ticket(), 1)
        second = queue.admit(queue.ticket(), 1)
        third = queue.admit(queue.ticket(), 1)
        values = self.scrape()
        self.assertEqual(values[("vllm:num_requests_running", "m:latest")], 1.0)
        self.assertEqual(values[("vllm:num_requests_waiting", "m:latest")], 2.0)
        self.successResultOf(first).release()
        values = self.scrape()
        self.assertEqual(values[("vllm:num_requests_running", "m:latest")], 1.0)
        self.assertEqual(values[("vllm:num_requests_waiting", "m:latest")], 1.0)
        self.successResultOf(second).release()
        self.successResultOf(third).release()

    def test_one_model(self) -> None:
        values = self.scrape("m:latest")
        self.assertEqual({m for _, m in values}, {"m:latest"})
        self.assertEqual({a[0] for a in self.asked}, {"http://127.0.0.1:1/slots", "http://127.0.0.1:2/slots"})
        # a model that exists and has no child yet: zeros (a pool is routable before the first load)
        self.assertEqual(
            self.scrape("cold:latest"),
            {
                ("vllm:num_requests_waiting", "cold:latest"): 0.0,
                ("vllm:num_requests_running", "cold:latest"): 0.0,
                ("vllm:kv_cache_usage_perc", "cold:latest"): 0.0,
            },
        )


class MetricsResourceTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.metrics = Metrics()
        self.admission = Admission(Clock(), lambda: Config(), self.metrics)
        slots = [{"id": 0, "n_ctx": 100, "is_processing": True, "n_prompt_tokens": 25}]
        self.slots_answer = (200, json.dumps(slots).encode())

        async def fetch(url: str, headers: Any, timeout: float = 5.0, max_bytes: int = 0) -> tuple[int, bytes]:
            return self.slots_answer

        self.gauges = ModelServerGauges(self.admission, lambda: [instance("m:latest", 1)], fetch)
        self.metrics.gauges(self.gauges.collect)

        def resolve(name: str) -> Deferred[str]:
            if name in ("m", "m:latest"):
                return succeed("m:latest")
            raise ModelNotFound(name, ["m:latest"])

        async def canonical(name: str) -> str:
            return await resolve(name)

        self.resource = MetricsResource(self.metrics, self.gauges, canonical)

    def get(self, path: bytes) -> tuple[int, str]:
        request = DummyRequest(path.lstrip(b"/").split(b"/"))
        request.path = path  # type: ignore[attr-defined]
        result = self.resource.render_GET(cast(IRequest, request))
        if isinstance(result, bytes):
            return request.responseCode or 200, result.decode()
        self.assertTrue(request.finished)
        return request.responseCode or 200, b"".join(request.written).decode()

    def samples(self, text: str) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("model_name", "")): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("vllm:")
        }

    def test_metrics_has_the_gauges_as_of_the_scrape(self) -> None:
        status, text = self.get(b"/metrics")
        self.assertEqual(status, 200)
        self.assertIn("blazar_requests_in_flight", text)  # Blazar's own series are still there
        self.assertEqual(self.samples(text)[("vllm:kv_cache_usage_perc", "m:latest")], 0.25)
        self.slots_answer = (200, json.dumps([{"id": 0, "n_ctx": 100, "is_processing": False}]).encode())
        self.assertEqual(self.samples(self.get(b"/metrics")[1])[("vllm:kv_cache_usage_perc", "m:latest")], 0.0)

    def test_a_models_own_path(self) -> None:
        status, text = self.get(b"/metrics/models/m")
        self.assertEqual(status, 200)
        self.assertEqual(
            self.samples(text),
            {
                ("vllm:num_requests_waiting", "m:latest"): 0.0,
                ("vllm:num_requests_running", "m:latest"): 0.0,
                ("vllm:kv_cache_usage_perc", "m:latest"): 0.25,
            },
        )
        self.assertNotIn("blazar_", text)
        self.assertEqual(self.get(b"/metrics/models/m%3Alatest")[0], 200)

    def test_unknown_model_and_path(self) -> None:
        self.assertEqual(self.get(b"/metrics/models/nope")[0], 404)
        self.assertEqual(self.get(b"/metrics/models/")[0], 404)
        self.assertEqual(self.get(b"/metrics/other")[0], 404)
