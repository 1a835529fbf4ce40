"""
C{GET /api/ps} reads the supervisor's read-only view
(L{blazar.engines.supervisor.InstanceView}), here the fake's.
"""

import json
from pathlib import Path
from typing import Any, cast

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.client import EngineClient
from blazar.engines.hints import EngineHint, EngineHints
from blazar.engines.supervisor import InstanceState, Supervisor
from blazar.metrics import Metrics
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeEngineClient, FakeSupervisor, fake_engine_app, fake_process_reactor
from tests.typed import StubTreq


class PsTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp()).absolute()
        self.gguf = make_test_model(root / "m.gguf").path
        make_test_model(root / "n.gguf", seed=1)
        self.reactor = fake_process_reactor()
        self.supervisor = FakeSupervisor(["m:latest", "n:latest"], clock=self.reactor)
        registry = ModelRegistry(parse_config(f'models_dir = "{root}"'), self.reactor)
        engine = FakeEngineClient(StubTreq(fake_engine_app().resource()))
        self.hints = EngineHints(list, cast(Any, None), self.reactor, Metrics())
        surface = build_gateway(
            registry,
            cast(Supervisor, self.supervisor),
            cast(EngineClient, engine),
            self.reactor,
            wall=lambda: 1000.0,
            hints=self.hints,
        ).ollama
        self.client = StubTreq(surface.app.resource())

    def ps(self) -> list[dict[str, Any]]:
        d = self.client.get("http://localhost/api/ps")
        self.client.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        return json.loads(self.successResultOf(response.content()))["models"]

    def test_lists_live_instances_from_the_view(self) -> None:
        self.assertEqual(self.ps(), [])
        instance = self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))
        instance.path = self.gguf
        self.reactor.advance(10)
        self.supervisor.touch(instance, 60.0)
        self.supervisor.breaker("m:latest").open_until = 99.0  # open
        (row,) = self.ps()
        self.assertEqual((row["name"], row["state"], row["breaker"]), ("m:latest", "ready", "open"))
        self.assertEqual(row["context_length"], 2048)
        # last use at 10 s + 60 s keep_alive, shown on the wall clock (1000 s now)
        self.assertEqual(row["expires_at"], "1970-01-01T00:17:40.000000000Z")
        instance.state = InstanceState.STOPPING
        self.assertEqual(self.ps(), [])

    def test_size_vram_is_what_the_child_holds_on_the_gpus(self) -> None:
        """
        C{size_vram}: the plan's bytes until NVML has measured the child,
        NVML's after (as Ollama reports what its child really took); 0 on
        the CPU.
        """
        from blazar.engines.planner import Plan

        instance = self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))
        instance.path = self.gguf
        self.assertEqual(self.ps()[0]["size_vram"], 0)
        instance.plan = Plan(
            devices=(0, 1),
            gpu_layers=3,
            n_units=3,
            gpu_bytes={0: 3 << 30, 1: 1 << 30},
            ram_bytes=0,
            tensor_split=(3, 1),
            evictions=(),
        )
        self.assertEqual(self.ps()[0]["size_vram"], 4 << 30)
        instance.vram_measured = {0: (3 << 30) + (200 << 20), 1: 1 << 30}
        self.assertEqual(self.ps()[0]["size_vram"], (4 << 30) + (200 << 20))

    def test_speculative_decoding_as_measured(self) -> None:
        """
        Each model's C{speculative}: its mode and its engine's EWMAs of
        draft acceptance and accepted tokens per draft (null until it
        drafted).
        """
        import attrs

        instance = self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))
        instance.path = self.gguf
        self.assertEqual(self.ps()[0]["speculative"], {"mode": "off", "acceptance": None, "accepted_per_draft": None})
        instance.settings = attrs.evolve(instance.entry.settings, speculative="ngram")
        self.hints.hints["m:latest"] = EngineHint(draft_acceptance=0.575, accepted_per_draft=4.6)
        self.assertEqual(self.ps()[0]["speculative"], {"mode": "ngram", "acceptance": 0.575, "accepted_per_draft": 4.6})
