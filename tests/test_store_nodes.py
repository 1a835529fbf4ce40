"""
The cluster's node registry (issue 42): the C{nodes} table's functions
(L{blazar.store.thd_put_node}, L{blazar.store.thd_nodes}) the same on
SQLite and PostgreSQL, two nodes seeing each other's rows on one
PostgreSQL; each node's heartbeat (L{blazar.storeservice.NodeHeartbeat})
driven by a L{Clock}: a row at start, again every
L{blazar.gateway.nodes.HEARTBEAT_SECS}, a beat that fails logged and the
next one written, stopped on a clean stop; and the listing
(L{blazar.gateway.nodes.ClusterNodes}) that tells up, stopped and
unreachable apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.python.threadpool import ThreadPool
from twisted.trial.unittest import SynchronousTestCase

from blazar import __version__, store
from blazar.gateway.nodes import HEARTBEAT_SECS, UNREACHABLE_SECS, ClusterNodes
from blazar.storeservice import NodeHeartbeat, StoreService
from blazar.testing import SynchronousThreadPool, fake_process_reactor
from tests.postgres import PostgresStore, SQLiteStore, StoreMixin

MODELS = [{"model": "m:latest", "state": "ready", "slots": 2, "busy": 1, "waiting": 3, "running": 1}]


def row(name: str, heartbeat: float, stopped: bool = False, models: str = "[]") -> store.NodeRow:
    return (name, f"http://{name}:11434", "1.0", 100.0, heartbeat, stopped, models)


class NodeStoreContract(StoreMixin):
    def test_a_row_is_written_then_replaced(self) -> None:
        db = self.open_store()
        store.thd_put_node(db, row("b", 110.0))
        store.thd_put_node(db, row("a", 105.0, models=json.dumps(MODELS)))
        store.thd_put_node(db, ("b", "http://b2:1", "1.1", 200.0, 210.0, True, "[]"))
        self.assertEqual(
            store.thd_nodes(db),
            [row("a", 105.0, models=json.dumps(MODELS)), ("b", "http://b2:1", "1.1", 200.0, 210.0, True, "[]")],
        )
        self.assertEqual(store.thd_nodes(db, "a"), [row("a", 105.0, models=json.dumps(MODELS))])
        self.assertEqual(store.thd_nodes(db, "c"), [])

    def test_two_nodes_see_each_others_rows(self) -> None:
        a, b = self.open_stores(2)
        store.thd_put_node(a, row("node-a", 1.0))
        store.thd_put_node(b, row("node-b", 2.0))
        self.assertEqual([r[0] for r in store.thd_nodes(a)], ["node-a", "node-b"])
        self.assertEqual(store.thd_nodes(b), store.thd_nodes(a))


class SQLiteNodeStoreTests(SQLiteStore, NodeStoreContract, SynchronousTestCase):
    pass


class PostgresNodeStoreTests(PostgresStore, NodeStoreContract, SynchronousTestCase):
    pass


class HeartbeatTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = fake_process_reactor()
        self.clock.advance(1000.0)
        self.database = StoreService(
            Path(self.mktemp()) / "blazar.db", self.clock, cast(ThreadPool, SynchronousThreadPool())
        )
        self.database.startService()
        self.addCleanup(self.database.stopService)
        self.models: list[dict[str, Any]] = []
        self.heartbeat = NodeHeartbeat(
            self.database, "node-a", "http://a:11434", lambda: self.models, self.clock, wall=self.clock.seconds
        )

    def rows(self) -> list[store.NodeRow]:
        return self.database.run_db_now(store.thd_nodes)

    def test_a_row_at_start_then_every_beat_then_stopped(self) -> None:
        self.heartbeat.startService()
        self.assertEqual(self.rows(), [("node-a", "http://a:11434", __version__, 1000.0, 1000.0, False, "[]")])
        self.models = MODELS
        self.clock.advance(HEARTBEAT_SECS - 0.5)
        self.assertEqual(self.rows()[0][4], 1000.0)  # not yet
        self.clock.advance(0.5)
        (beaten,) = self.rows()
        self.assertEqual((beaten[3], beaten[4], beaten[5]), (1000.0, 1000.0 + HEARTBEAT_SECS, False))
        self.assertEqual(json.loads(beaten[6]), MODELS)
        self.clock.advance(2.0)
        self.successResultOf(self.heartbeat.stopService())
        self.assertEqual(self.rows(), [("node-a", "http://a:11434", __version__, 1000.0, 1007.0, True, "[]")])
        self.clock.advance(HEARTBEAT_SECS * 3)
        self.assertTrue(self.rows()[0][5])  # no beat after the stop

    def test_a_failed_beat_is_logged_and_the_next_one_written(self) -> None:
        self.heartbeat.startService()
        broken = [True]

        def models() -> list[dict[str, Any]]:
            if broken.pop() if broken else False:
                raise RuntimeError("the supervisor's snapshot failed")
            return MODELS

        self.heartbeat._models = models
        self.clock.advance(HEARTBEAT_SECS)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(self.rows()[0][4], 1000.0)
        self.clock.advance(HEARTBEAT_SECS)
        self.assertEqual(self.rows()[0][4], 1000.0 + 2 * HEARTBEAT_SECS)
        self.assertEqual(json.loads(self.rows()[0][6]), MODELS)
        self.successResultOf(self.heartbeat.stopService())

    def test_an_unreachable_store_is_logged_once_until_a_beat_is_written(self) -> None:
        events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        self.heartbeat.startService()
        put = store.thd_put_node

        def unreachable(db: Any, row: Any) -> None:
            raise store.StoreUnavailable("PostgreSQL at db.lan:5432 is unreachable: refused")

        self.patch(store, "thd_put_node", unreachable)
        self.clock.advance(HEARTBEAT_SECS)
        self.clock.advance(HEARTBEAT_SECS)
        said = [e["log_format"] for e in events if e.get("log_namespace") == "blazar.storeservice"]
        self.assertEqual(len([s for s in said if "cannot be written" in s]), 1)
        self.assertEqual(self.rows()[0][4], 1000.0)
        self.patch(store, "thd_put_node", put)
        self.clock.advance(HEARTBEAT_SECS)
        self.assertEqual(self.rows()[0][4], 1000.0 + 3 * HEARTBEAT_SECS)
        said = [e["log_format"] for e in events if e.get("log_namespace") == "blazar.storeservice"]
        self.assertIn("this node's heartbeat is written again", said)
        self.successResultOf(self.heartbeat.stopService())

    def test_the_store_closes_only_after_the_stop_is_written(self) -> None:
        self.heartbeat.startService()
        stopped = self.heartbeat.stopService()
        self.successResultOf(stopped)
        self.successResultOf(self.database.stopService())
        self.assertFalse(self.database.is_open)
        again = StoreService(self.database.path, self.clock, cast(ThreadPool, SynchronousThreadPool()))
        again.startService()
        self.assertTrue(again.run_db_now(store.thd_nodes)[0][5])
        self.successResultOf(again.stopService())


class NamesakeTests(SynchronousTestCase):
    """
    Two nodes given one C{[cluster] node} name (found in review: the
    second's start failed the first's batch lines in flight, and both
    overwrote one row): the second refuses to start at the store's open,
    naming the key, while the first is up at another URL.
    """

    def setUp(self) -> None:
        self.clock = fake_process_reactor()
        self.clock.advance(1000.0)
        self.path = Path(self.mktemp()) / "blazar.db"

    def start(self, *rows: store.NodeRow) -> StoreService:
        """
        Node C{node-a} at C{http://a:11434} starting on a store that
        holds C{rows}: its store, started with the heartbeat's check.
        """
        db = store.thd_open(self.path)
        for r in rows:
            store.thd_put_node(db, r)
        db.close()
        database = StoreService(self.path, self.clock, cast(ThreadPool, SynchronousThreadPool()))
        heartbeat = NodeHeartbeat(database, "node-a", "http://a:11434", list, self.clock, wall=self.clock.seconds)
        database.add_start_check(heartbeat.thd_refuse_a_live_namesake)
        database.startService()
        self.addCleanup(database.stopService)
        return database

    def test_a_live_namesake_at_another_url_stops_the_start_naming_the_key(self) -> None:
        from blazar.storeservice import NodeNameTaken

        live = ("node-a", "http://b:11434", "9.9", 900.0, 1000.0 - UNREACHABLE_SECS + 1, False, "[]")
        with self.assertRaises(NodeNameTaken) as cm:
            self.start(live)
        message = str(cm.exception)
        self.assertIn("another node named 'node-a' is up at http://b:11434", message)
        self.assertIn('[cluster] node = "..."', message)
        self.assertIn("start it again in 1 s", message)
        database = StoreService(self.path, self.clock, cast(ThreadPool, SynchronousThreadPool()))
        database.startService()  # the refused start wrote nothing: the live node's row is as it was
        self.assertEqual(database.run_db_now(store.thd_nodes), [live])
        self.successResultOf(database.stopService())

    def test_the_refused_store_is_closed_and_its_thread_stopped(self) -> None:
        from blazar.storeservice import NodeNameTaken

        class Pool(SynchronousThreadPool):
            started = False

            def start(self) -> None:
                self.started = True

            def stop(self) -> None:
                self.started = False

        pool = Pool()
        database = StoreService(self.path, self.clock, cast(ThreadPool, pool))
        heartbeat = NodeHeartbeat(database, "node-a", "http://a:11434", list, self.clock, wall=self.clock.seconds)
        database.add_start_check(heartbeat.thd_refuse_a_live_namesake)
        db = store.thd_open(self.path)
        store.thd_put_node(db, ("node-a", "http://b:11434", "1", 900.0, 999.0, False, "[]"))
        db.close()
        self.assertRaises(NodeNameTaken, database.startService)
        self.assertFalse(database.is_open)
        self.assertFalse(database.running)
        self.assertFalse(pool.started)

    def test_its_own_row_a_stopped_or_an_unreachable_namesake_and_other_names_start(self) -> None:
        for rows in [
            (),
            (("node-a", "http://a:11434", "1", 900.0, 999.0, False, "[]"),),  # its own earlier life (killed)
            (("node-a", "http://b:11434", "1", 900.0, 999.0, True, "[]"),),  # stopped cleanly
            (("node-a", "http://b:11434", "1", 900.0, 1000.0 - UNREACHABLE_SECS - 1, False, "[]"),),  # dead
            (("node-b", "http://b:11434", "1", 900.0, 999.0, False, "[]"),),  # another name
        ]:
            self.path = Path(self.mktemp()) / "blazar.db"
            self.assertTrue(self.start(*rows).is_open, rows)


class ListingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.db = store.thd_open(Path(self.mktemp()) / "blazar.db")
        self.addCleanup(self.db.close)
        self.now = 1000.0

    def listing(self, clustered: bool) -> dict[str, Any]:
        def run_db(f: Any, *args: Any) -> Deferred[Any]:
            return maybeDeferred(f, self.db, *args)

        nodes = ClusterNodes(run_db, lambda: self.now, "node-a", clustered)
        return cast(dict[str, Any], self.successResultOf(Deferred.fromCoroutine(nodes.listing())))

    def test_up_stopped_and_unreachable(self) -> None:
        store.thd_put_node(self.db, row("node-a", 998.0, models=json.dumps(MODELS)))
        store.thd_put_node(self.db, row("node-b", 900.0, stopped=True))
        store.thd_put_node(self.db, row("node-c", self.now - UNREACHABLE_SECS))
        store.thd_put_node(self.db, row("node-d", self.now - UNREACHABLE_SECS - 0.1))
        listing = self.listing(clustered=True)
        self.assertEqual((listing["clustered"], listing["node"], listing["hint"]), (True, "node-a", ""))
        nodes = listing["nodes"]
        self.assertEqual(
            [(n["name"], n["state"], n["seen_ago"], n["this"]) for n in nodes],
            [
                ("node-a", "up", 2.0, True),
                ("node-b", "stopped", 100.0, False),
                ("node-c", "up", UNREACHABLE_SECS, False),
                ("node-d", "unreachable", UNREACHABLE_SECS + 0.1, False),
            ],
        )
        self.assertEqual(nodes[0]["models"], MODELS)
        self.assertEqual(
            {k: nodes[0][k] for k in ("url", "version", "started", "last_seen")},
            {"url": "http://node-a:11434", "version": "1.0", "started": 100.0, "last_seen": 998.0},
        )

    def test_without_a_shared_store_this_node_only_and_how_to_join(self) -> None:
        store.thd_put_node(self.db, row("node-a", 999.0))
        store.thd_put_node(self.db, row("old-name", 999.0))  # this data_dir's earlier [cluster] node
        listing = self.listing(clustered=False)
        self.assertEqual([n["name"] for n in listing["nodes"]], ["node-a"])
        for key in ("[cluster] database", "[cluster] node", "[cluster] url"):
            self.assertIn(key, listing["hint"])

    def test_a_row_whose_models_are_not_a_list_shows_none(self) -> None:
        store.thd_put_node(self.db, row("node-a", 999.0, models='{"not": "a list"}'))
        store.thd_put_node(self.db, row("node-b", 999.0, models="not json"))
        self.assertEqual([n["models"] for n in self.listing(clustered=True)["nodes"]], [[], []])
