"""
The dashboard's Nodes page data (C{GET /ui/api/nodes}): the listing
C{blazar cluster --json} gives (to a scoped key, without the nodes' URLs
and versions, and only its own models), and an unreachable shared store
answered 503 C{store_unavailable}, naming it. Through StubTreq.
"""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import Config, KeyConfig
from blazar.gateway.operations import ModelOperations
from blazar.gateway.pipeline import Pipeline
from blazar.models.registry import ModelRegistry
from blazar.postgres import StoreUnavailable
from blazar.web.dashboard import Dashboard
from tests.typed import StubTreq
from tests.web.gateway import Capture

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


def client(nodes: Any, key: KeyConfig | None = None) -> StubTreq:
    """
    The dashboard, its requests let in with C{key} (L{None}: a keyless
    gateway asked from this machine).
    """
    dashboard = Dashboard(
        cast(ModelRegistry, None),
        cast(Pipeline, None),
        cast(ModelOperations, None),
        Clock(),
        lambda: 0.0,
        lambda: cast(Config, None),
        nodes=nodes,
    )
    gate = Capture(dashboard.app.resource())
    gate.key = key
    return StubTreq(gate)


class DashboardNodesTests(SynchronousTestCase):
    def get(self, treq: StubTreq) -> tuple[int, Any]:
        response = self.successResultOf(treq.get("http://127.0.0.1/ui/api/nodes"))
        return response.code, json.loads(self.successResultOf(response.content()))

    def test_the_listing(self) -> None:
        async def nodes() -> dict[str, Any]:
            return json.loads(json.dumps(LISTING))

        self.assertEqual(self.get(client(nodes)), (200, LISTING))

    def test_an_admin_key_sees_urls_and_versions(self) -> None:
        async def nodes() -> dict[str, Any]:
            return json.loads(json.dumps(LISTING))

        admin = KeyConfig("root", "root-secret-0123456789")
        self.assertEqual(self.get(client(nodes, admin)), (200, LISTING))

    def test_a_scoped_key_sees_no_url_no_version_and_its_models_only(self) -> None:
        """
        The nodes' internal addresses and Blazar versions are the
        operator's (found in review: a scoped key saw them all).
        """

        async def nodes() -> dict[str, Any]:
            listing = json.loads(json.dumps(LISTING))
            listing["nodes"][0]["models"].append({**listing["nodes"][0]["models"][0], "model": "other:latest"})
            return listing

        scoped = KeyConfig("team", "team-secret-0123456789", models=("m:latest",))
        code, body = self.get(client(nodes, scoped))
        self.assertEqual(code, 200)
        (node,) = body["nodes"]
        self.assertNotIn("url", node)
        self.assertNotIn("version", node)
        self.assertNotIn("http://a:11434", json.dumps(body))
        (listed,) = cast(list[dict[str, Any]], LISTING["nodes"])
        expected = {k: v for k, v in listed.items() if k not in ("url", "version")}
        self.assertEqual(node, expected)

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
