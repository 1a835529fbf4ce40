"""
The dashboard's Models data (C{GET /ui/api/models}) with the GPUs: each
GPU of the latest hardware census with its memory, and each loaded model's
memory per GPU (planned, and measured once ready), or the CPU. Against
blazar.testing.FakeNVML, through StubTreq.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.hardware import HardwareCensus
from blazar.engines.supervisor import Supervisor
from blazar.gateway.operations import ModelOperations
from blazar.gateway.pipeline import Pipeline
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.testing import GIB, FakeNVML, fake_process_reactor
from blazar.web.dashboard import Dashboard
from tests.typed import StubTreq, not_none


class DashboardGPUTests(SynchronousTestCase):
    def serve(self, nvml: Any, model_config: str = "", hardware: bool = True) -> None:
        root = Path(self.mktemp()).absolute()
        make_test_model(root / "models" / "m.gguf")
        self.reactor = fake_process_reactor()
        self.health = 200

        async def probe(url: str) -> int:
            return self.health

        config = parse_config(
            f'models_dir = "{root / "models"}"\n[models."m"]\n{model_config}[engines.llamacpp]\nbinary = "/bin/true"\n'
        )
        registry = ModelRegistry(config, self.reactor)
        self.supervisor = Supervisor(config, registry, self.reactor, probe, {}, port_finder=lambda: 5555)
        census = HardwareCensus(nvml, self.reactor)
        census.refresh()
        self.supervisor.hardware = census.fresh
        self.supervisor.on_hardware_change = census.invalidate
        self.supervisor.engine_devices = lambda binary, known: ((str(binary), 0.0), ["CUDA0: fake"])  # a cuda build
        dashboard = Dashboard(
            registry,
            cast(Pipeline, None),
            ModelOperations(registry, self.supervisor, None, self.reactor),
            self.reactor,
            lambda: 0.0,
            lambda: config,
            hardware=census if hardware else None,
        )
        self.client = StubTreq(dashboard.app.resource())

    def models(self) -> Any:
        response = self.successResultOf(self.client.get("http://127.0.0.1/ui/api/models"))
        self.assertEqual(response.code, 200)
        return json.loads(self.successResultOf(response.content()))

    def test_one_gpu(self) -> None:
        nvml = FakeNVML.with_gpus(24 * GIB)
        self.serve(nvml)
        self.health = 503
        d = ensureDeferred(self.supervisor.instance_for("m"))
        instance = self.supervisor.instances()[0]
        planned = instance.plan.gpu_bytes[0]
        data = self.models()
        self.assertEqual(
            data["gpus"],
            [
                {
                    "index": 0,
                    "name": "NVIDIA GeForce RTX 4090",
                    "memory_total": 24 * GIB,
                    "memory_used": 0,
                    "memory_free": 24 * GIB,
                }
            ],
        )
        (row,) = data["loaded"]
        self.assertEqual((row["vram"], row["gpus"]), (planned, [{"gpu": 0, "planned": planned, "measured": None}]))
        nvml.set_process_memory(not_none(instance.pid), 0, planned - 2**20)
        self.health = 200
        self.reactor.advance(0.05)
        self.successResultOf(d)
        data = self.models()
        self.assertEqual(data["gpus"][0]["memory_used"], planned - 2**20)  # the census read again
        (row,) = data["loaded"]
        self.assertEqual(row["gpus"], [{"gpu": 0, "planned": planned, "measured": planned - 2**20}])

    def test_two_gpus(self) -> None:
        self.serve(FakeNVML.with_gpus(24 * GIB, 24 * GIB), "tensor_split = [1, 1]\n")
        self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))
        data = self.models()
        self.assertEqual([g["index"] for g in data["gpus"]], [0, 1])
        (row,) = data["loaded"]
        self.assertEqual([g["gpu"] for g in row["gpus"]], [0, 1])
        self.assertTrue(all(g["planned"] > 0 and g["measured"] is None for g in row["gpus"]))
        self.assertEqual(row["vram"], sum(g["planned"] for g in row["gpus"]))

    def test_no_gpu(self) -> None:
        self.serve(FakeNVML(gpu_note="NVML sees no GPU"))
        self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))
        data = self.models()
        self.assertEqual((data["gpus"], data["gpu_note"]), ([], "NVML sees no GPU"))
        (row,) = data["loaded"]
        self.assertEqual((row["vram"], row["gpus"]), (0, []))

    def test_no_census_yet(self) -> None:
        self.serve(FakeNVML(), hardware=False)
        self.assertEqual(self.models()["gpus"], None)
