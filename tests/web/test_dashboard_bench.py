"""
The dashboard's bench history (C{GET /ui/api/bench}, the Performance
page): the runs newest first, each model's latest against its previous
one, one model's only with C{model=}; an admin's page. Through StubTreq.
"""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import Config
from blazar.engines import bench
from blazar.gateway.operations import ModelOperations
from blazar.gateway.pipeline import Pipeline
from blazar.models.registry import ModelRegistry
from blazar.web.dashboard import Dashboard
from tests.typed import StubTreq


def a_run(id_: int, model: str, gen_tps: float) -> dict[str, Any]:
    level = {**bench.summarise(1, [], 1.0).to_json(), "gen_tps": gen_tps}
    return {
        "id": id_,
        "model": model,
        "created": float(id_),
        "engine": "llamacpp@a",
        "profile": {"argv": ["x"]},
        "hardware": {},
        "settings": {},
        "levels": [level],
    }


class DashboardBenchTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.asked: list[tuple[str | None, int]] = []
        runs = [
            a_run(4, "a:latest", 90.0),
            a_run(3, "b:latest", 10.0),
            a_run(2, "a:latest", 100.0),
            a_run(1, "a:latest", 50.0),
        ]

        async def history(model: str | None, limit: int) -> list[dict[str, Any]]:
            self.asked.append((model, limit))
            return [r for r in runs if model is None or r["model"] == model]

        dashboard = Dashboard(
            cast(ModelRegistry, None),
            cast(Pipeline, None),
            cast(ModelOperations, None),
            Clock(),
            lambda: 0.0,
            lambda: cast(Config, None),
            bench=history,
        )
        self.client = StubTreq(dashboard.app.resource())

    def get(self, url: str) -> Any:
        response = self.successResultOf(self.client.get(url))
        self.assertEqual(response.code, 200)
        return json.loads(self.successResultOf(response.content()))

    def test_runs_and_each_models_latest_against_its_previous(self) -> None:
        data = self.get("http://127.0.0.1/ui/api/bench")
        self.assertEqual([r["id"] for r in data["runs"]], [4, 3, 2, 1])
        self.assertEqual(list(data["comparisons"]), ["a:latest"])  # b has one run only
        comparison = data["comparisons"]["a:latest"]
        self.assertEqual((comparison["before"], comparison["after"]), (2, 4))
        self.assertEqual(comparison["levels"][0]["gen_tps"]["delta_percent"], -10.0)
        self.assertEqual(self.asked, [(None, 200)])

    def test_one_models_runs(self) -> None:
        data = self.get("http://127.0.0.1/ui/api/bench?model=b:latest")
        self.assertEqual([r["id"] for r in data["runs"]], [3])
        self.assertEqual(self.asked, [("b:latest", 200)])
