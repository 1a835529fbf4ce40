"""
The dashboard's Nodes page data (C{GET /ui/api/nodes}): the listing
C{blazar cluster --json} gives, and an unreachable shared store answered
503 C{store_unavailable}, naming it. Through StubTreq.
"""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import Config
from blazar.gateway.operations import ModelOperations
from blazar.gateway.pipeline import Pipeline
from blazar.models.registry import ModelRegistry
from blazar.postgres import StoreUnavailable
from blazar.web.dashboard import Dashboard
from tests.typed import StubTreq

LISTING = {
    "clustered": True,
    "node": "node-a",
    "hint": "",
    "nodes": [
        {
            "name": "node-a",
            "url": "http://a:11434",
            "version": "1",
            "state": "up",
            "started": 1.0,
            "last_seen": 2.0,
            "seen_ago": 0.5,
            "this": True,
            "models": [{"model": "m:latest", "state": "ready", "slots": 1, "busy": 0, "waiting": 0, "running": 0}],
        }
    ],
}


def client(nodes: Any) -> StubTreq:
    dashboard = Dashboard(
        cast(ModelRegistry, None),
        cast(Pipeline, None),
        cast(ModelOperations, None),
        Clock(),
        lambda: 0.0,
        lambda: cast(Config, None),
        nodes=nodes,
    )
    return StubTreq(dashboard.app.resource())


class DashboardNodesTests(SynchronousTestCase):
    def get(self, treq: StubTreq) -> tuple[int, Any]:
        response = self.successResultOf(treq.get("http://127.0.0.1/ui/api/nodes"))
        return response.code, json.loads(self.successResultOf(response.content()))

    def test_the_listing(self) -> None:
        async def nodes() -> dict[str, Any]:
            return json.loads(json.dumps(LISTING))

        self.assertEqual(self.get(client(nodes)), (200, LISTING))

    def test_no_registry_no_nodes(self) -> None:
        code, body = self.get(client(None))
        self.assertEqual((code, body["nodes"]), (200, []))

    def test_an_unreachable_store_is_a_503_naming_it(self) -> None:
        async def nodes() -> dict[str, Any]:
            raise StoreUnavailable("PostgreSQL at db.lan:5432 is unreachable: refused")

        code, body = self.get(client(nodes))
        self.assertEqual(code, 503)
        self.assertEqual(body["error"]["code"], "store_unavailable")
        self.assertIn("db.lan:5432", body["error"]["message"])
