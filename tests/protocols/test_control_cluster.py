"""
The AMP C{Cluster} command (C{blazar cluster}): the node listing as JSON,
cut to fit AMP's value limit, and an unreachable shared store answered
as C{ClusterError} naming it (never a dropped connection).
"""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.internet.task import Clock
from twisted.protocols import amp
from twisted.test.iosim import connectedServerAndClient
from twisted.trial.unittest import SynchronousTestCase

from blazar.postgres import StoreUnavailable
from blazar.protocols.control import Cluster, ClusterError, ControlServer, fit_cluster


def listing(nodes: int, models: int) -> dict[str, Any]:
    return {
        "clustered": True,
        "node": "node-0",
        "hint": "",
        "nodes": [
            {
                "name": f"node-{n}",
                "this": n == 0,
                "models": [{"model": f"model-{m}-" + "x" * 200, "waiting": m} for m in range(models)],
            }
            for n in range(nodes)
        ],
    }


class ClusterCommandTests(SynchronousTestCase):
    def server(self, cluster: Any) -> Any:
        client, _, pump = connectedServerAndClient(
            lambda: ControlServer(cast(Any, None), cast(Any, None), lambda: {}, Clock(), cluster=cluster), amp.AMP
        )
        result: list[Any] = []
        client.callRemote(Cluster).addBoth(result.append)
        pump.flush()
        return result[0]

    def test_the_listing(self) -> None:
        async def nodes() -> dict[str, Any]:
            return listing(2, 1)

        answer = self.server(nodes)
        self.assertEqual(json.loads(answer["cluster"]), listing(2, 1))
        self.assertFalse(answer["truncated"])

    def test_an_unreachable_store_is_a_named_error(self) -> None:
        async def nodes() -> dict[str, Any]:
            raise StoreUnavailable("PostgreSQL at db.lan:5432 is unreachable: refused")

        failure = self.server(nodes)
        failure.trap(ClusterError)
        self.assertIn("db.lan:5432", str(failure.value))
        self.assertIn("[cluster] database", str(failure.value))

    def test_without_a_registry(self) -> None:
        self.server(None).trap(ClusterError)

    def test_a_big_listing_is_cut_to_fit(self) -> None:
        async def nodes() -> dict[str, Any]:
            return listing(20, 40)

        answer = self.server(nodes)
        self.assertTrue(answer["truncated"])
        cut = json.loads(answer["cluster"])
        self.assertEqual(len(cut["nodes"]), 20)  # the models go first
        self.assertLess(len(cut["nodes"][0]["models"]), 40)

    def test_nodes_are_cut_last_this_one_kept(self) -> None:
        big = listing(2000, 0)
        big["nodes"].reverse()  # this node last
        text, truncated = fit_cluster(big, budget=4000)
        self.assertTrue(truncated)
        cut = json.loads(text)
        self.assertLessEqual(len(text), 4000)
        self.assertEqual(cut["nodes"][0]["name"], "node-0")
