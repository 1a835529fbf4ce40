"""
Admission through the three surfaces, in memory (StubTreq over the real
surfaces, a fake engine, a Clock): a full model answers 503
all_slots_busy in each surface's own shape with Retry-After; an admitted
request says how long it waited and gives its slot back when it is done;
/api/queue shows who waits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import Supervisor
from blazar.gateway.admission import Admission, Lease
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeSupervisor, StubEngineClient, fake_engine_app, fake_process_reactor
from tests.typed import StubTreq

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
OLLAMA = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}


class AdmissionSurfaceTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "m.gguf")
        self.reactor = fake_process_reactor()
        config = parse_config(f'models_dir = "{root}"\n[models."m"]\nparallel = 1\n')
        self.engine = StubTreq(fake_engine_app("m:latest").resource())
        self.supervisor = FakeSupervisor(["m:latest"])
        registry = ModelRegistry(config, self.reactor)
        self.admission = Admission(self.reactor, lambda: config)
        gateway = build_gateway(
            registry,
            cast(Supervisor, self.supervisor),
            cast(EngineClient, StubEngineClient(self.engine)),
            self.reactor,
            lambda: config,
            admission=self.admission,
            wall=lambda: 0.0,
        )
        self.client = StubTreq(gateway.router())

    def start(self, path: str, body: Any, **headers: str) -> Deferred[Any]:
        return self.client.request(
            "POST",
            "http://localhost" + path,
            data=json.dumps(body).encode(),
            headers={k.replace("_", "-"): v for k, v in headers.items()},
        )

    def pump(self) -> None:
        for _ in range(20):
            self.client.flush()
            self.engine.flush()

    def finish(self, d: Deferred[Any]) -> tuple[int, Any, Any]:
        self.pump()
        response = self.successResultOf(d)
        return response.code, response.headers, json.loads(self.successResultOf(response.content()))

    def hold(self) -> Lease:
        queue = self.admission.queue("m:latest")
        return self.successResultOf(queue.admit(queue.ticket(trace_id="holder"), 1))

    def test_admitted_request_reports_wait_and_frees_its_slot(self) -> None:
        lease = self.hold()
        d = self.start("/v1/chat/completions", CHAT)
        self.pump()
        self.assertNoResult(d)
        self.reactor.advance(0.25)
        lease.release()
        code, headers, body = self.finish(d)
        self.assertEqual(code, 200, body)
        self.assertEqual(headers.getRawHeaders("x-blazar-queue-ms"), ["250"])
        self.assertEqual(self.admission.queue("m:latest").snapshot()["slots"]["busy"], 0)

    def test_openai_all_slots_busy(self) -> None:
        self.hold()
        d = self.start("/v1/chat/completions", CHAT, x_blazar_deadline_ms="500")
        self.pump()
        self.reactor.advance(0.5)
        code, headers, body = self.finish(d)
        self.assertEqual(code, 503)
        self.assertEqual(headers.getRawHeaders("retry-after"), ["1"])
        self.assertEqual(body["error"]["code"], "all_slots_busy")
        self.assertEqual(body["error"]["type"], "server_error")
        self.assertIn("waited 500ms", body["error"]["message"])

    def test_anthropic_all_slots_busy(self) -> None:
        self.hold()
        d = self.start("/v1/messages", ANTHROPIC)
        self.pump()
        self.reactor.advance(30)
        code, headers, body = self.finish(d)
        self.assertEqual(code, 503)
        self.assertIsNotNone(headers.getRawHeaders("retry-after"))
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], "overloaded_error")
        self.assertIn("waited 30s", body["error"]["message"])

    def test_ollama_all_slots_busy_and_queue(self) -> None:
        self.hold()
        d = self.start("/api/chat", OLLAMA, x_blazar_priority="low")
        self.pump()
        self.reactor.advance(1.0)
        queue = self.client.get("http://localhost/api/queue")
        self.pump()
        snapshot = json.loads(self.successResultOf(self.successResultOf(queue).content()))
        (model,) = snapshot["models"]
        self.assertEqual(model["slots"], {"busy": 1, "total": 1})
        self.assertEqual(model["waiting"]["by_priority"]["low"], 1)
        self.assertEqual(model["oldest_wait_ms"], 1000)
        self.assertEqual(
            # (trace ids come from the Site, absent here: the e2e test checks them)
            [(r["position"], r["priority"], r["class"]) for r in model["requests"]],
            [(1, "low", "interactive")],
        )
        self.reactor.advance(119)  # low priority waits 120 s
        code, headers, body = self.finish(d)
        self.assertEqual(code, 503)
        self.assertIsNotNone(headers.getRawHeaders("retry-after"))
        self.assertEqual(list(body), ["error"])
        self.assertIn("all_slots_busy", body["error"])
        self.assertIn("waited 2m00s", body["error"])

    def test_tool_chat_goes_ahead_of_plain_chat(self) -> None:
        lease = self.hold()
        plain = self.start("/v1/chat/completions", CHAT)
        tool = self.start(
            "/v1/chat/completions",
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
        )
        self.pump()
        order = [r["class"] for r in self.admission.queue("m:latest").snapshot()["requests"]]
        self.assertEqual(order, ["tool", "interactive"])
        lease.release()
        for d in (plain, tool):
            self.assertEqual(self.finish(d)[0], 200)
