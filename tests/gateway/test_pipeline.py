"""
The one request path: every surface's request goes through the same steps
of L{blazar.gateway.pipeline.Pipeline}, in the same order, and so fails the
same way when two steps would refuse it. Through the real surfaces, the
real pipeline and the real registry in memory (StubTreq, a fake engine);
the steps are observed by wrapping them (each wrapper calls the real step
and only notes its name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from blazar.config import KeyConfig, parse_config
from blazar.gateway.admission import Admission
from blazar.gateway.context import context_of
from blazar.gateway.engine_proxy import EngineProxy
from blazar.gateway.operations import ModelOperations
from blazar.gateway.pipeline import Pipeline
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.testing import FakeSupervisor, fake_engine_app, fake_process_reactor
from blazar.web.anthropic import AnthropicSurface
from blazar.web.ollama import OllamaSurface
from blazar.web.openai import OpenAISurface
from blazar.web.responses import Responses
from blazar.web.root import SurfaceRouter

from tests.web.test_openai import StubEngineClient

HELLO = [{"role": "user", "content": "hi"}]


def requests(model: str, max_tokens: int = 8) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "openai": ("/v1/chat/completions", {"model": model, "messages": HELLO, "max_tokens": max_tokens}),
        "responses": ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": max_tokens}),
        "anthropic": ("/v1/messages", {"model": model, "max_tokens": max_tokens, "messages": HELLO}),
        "ollama": ("/api/chat", {"model": model, "messages": HELLO, "stream": False,
                                 "options": {"num_predict": max_tokens}}),
    }


class WithKey(Resource):
    """
    Lets requests in with C{key} (as the site's auth gate would).
    """

    isLeaf = True

    def __init__(self, inner: Resource) -> None:
        super().__init__()
        self._inner = inner
        self.key: KeyConfig | None = None

    def render(self, request: Any) -> Any:
        context_of(request).key = self.key
        return self._inner.render(request)


class OnePathTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp()).absolute()
        make_test_model(root / "m.gguf")
        make_test_model(root / "e.gguf", seed=1)
        reactor = fake_process_reactor()
        config = parse_config(f'models_dir = "{root}"\n[models."e"]\nembedding = true\n')
        self.engine = StubTreq(fake_engine_app("m:latest").resource())
        self.steps: list[str] = []
        steps = self.steps

        class Observed(FakeSupervisor):
            async def instance_for(self, name: str, ctx_size: int | None = None) -> Any:
                steps.append("lease")
                return await super().instance_for(name, ctx_size)

        supervisor = Observed(["m:latest", "e:latest"])
        registry = ModelRegistry(config, reactor)
        self.proxy = EngineProxy(supervisor, StubEngineClient(self.engine), reactor, registry)  # type: ignore[arg-type]
        self.pipeline = Pipeline(self.proxy, reactor, registry, Admission(reactor, lambda: config))
        self.gate = WithKey(SurfaceRouter(
            OpenAISurface(registry, self.pipeline, reactor,
                          Responses(self.pipeline, lambda: config, reactor, None)).app.resource(),
            OllamaSurface(registry, self.pipeline, reactor, lambda: 0.0,
                          ModelOperations(registry, supervisor, None, reactor)).app.resource(),  # type: ignore[arg-type]
            AnthropicSurface(registry, self.pipeline, reactor).app.resource(),
        ))
        self.client = StubTreq(self.gate)
        self.successResultOf(ensureDeferred(registry.refresh()))
        self.observe(self.pipeline, "_scope", "scope")
        self.observe(self.pipeline, "_purpose", "purpose")
        self.observe(self.proxy, "place_system_messages", "placement")
        self.observe(self.proxy, "preflight", "preflight")
        self.observe(self.pipeline, "_admit", "admission")
        self.observe(self.proxy, "send", "send")

    def observe(self, owner: Any, name: str, step: str) -> None:
        real = getattr(owner, name)

        def noted(*args: Any, **kwargs: Any) -> Any:
            self.steps.append(step)
            return real(*args, **kwargs)

        self.patch(owner, name, noted)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        d = self.client.request("POST", "http://blazar" + path, data=json.dumps(body).encode())
        for _ in range(10):
            self.client.flush()
            self.engine.flush()
        response = self.successResultOf(d)
        return response.code, json.loads(self.successResultOf(response.content()))

    def test_every_surface_runs_the_same_steps_in_the_same_order(self) -> None:
        seen = {}
        for surface, (path, body) in requests("m").items():
            del self.steps[:]
            status, answer = self.post(path, body)
            self.assertEqual(status, 200, (surface, answer))
            # the scope step resolves the model, so later steps do not ask for it again
            seen[surface] = list(dict.fromkeys(self.steps))
        expected = ["scope", "purpose", "placement", "preflight", "admission", "lease", "send"]
        self.assertEqual(seen, {surface: expected for surface in seen})

    def test_scope_before_purpose_before_preflight_on_every_surface(self) -> None:
        def statuses(model: str, max_tokens: int = 8) -> dict[str, int]:
            return {surface: self.post(path, body)[0] for surface, (path, body) in requests(model, max_tokens).items()}

        # a chat request for an embedding model: refused by purpose (400) ...
        self.assertEqual(statuses("e"), dict.fromkeys(requests("e"), 400))
        # ... before the preflight would look at its context
        for surface, (path, body) in requests("e", 10 ** 7).items():
            status, answer = self.post(path, body)
            self.assertEqual(status, 400, surface)
            self.assertIn("embedding", json.dumps(answer), surface)
        # a scoped key that may not use it: the model does not exist (404), on every surface
        self.gate.key = KeyConfig("scoped", "x" * 16, models=("m:latest",))
        self.assertEqual(statuses("e"), dict.fromkeys(requests("e"), 404))
        self.assertEqual(statuses("m"), dict.fromkeys(requests("m"), 200))
        # the preflight before admission and the engine: nothing was sent for these
        del self.steps[:]
        for surface, (path, body) in requests("m", 10 ** 7).items():
            self.assertEqual(self.post(path, body)[0], 400, surface)
        self.assertNotIn("admission", self.steps)
        self.assertNotIn("send", self.steps)

    def test_the_preflight_names_each_apis_own_field(self) -> None:
        fields = {"openai": "max_tokens", "responses": "max_output_tokens", "anthropic": "max_tokens",
                  "ollama": "num_predict"}
        for surface, (path, body) in requests("m", 10 ** 7).items():
            status, answer = self.post(path, body)
            self.assertEqual(status, 400, surface)
            message = json.dumps(answer)
            self.assertIn(f"{fields[surface]} = 10000000 does not fit", message, surface)
            if surface in ("openai", "responses"):
                self.assertEqual(answer["error"]["param"], fields[surface], surface)
