"""
The one store service (L{blazar.storeservice.StoreService}): one
connection opened at start, every part's writes drained before the close;
on SQLite and on PostgreSQL (C{[cluster] database}).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import cast

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock
from twisted.python.threadpool import ThreadPool
from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.config import KeyConfig, LiveConfig, parse_config
from blazar.engines.client import EngineClient
from blazar.gateway.quota import Quotas
from blazar.gateway.sessions import Session
from blazar.metrics import Metrics
from blazar.storeservice import PeriodicJob, SessionService, StoreService, UsageStore
from blazar.testing import SynchronousThreadPool, fake_process_reactor
from tests import postgres
from tests.typed import TestCaseMixin


class StoreServiceContract(TestCaseMixin):
    url: str | None = None

    def setUp(self) -> None:
        self.path = Path(self.mktemp()) / "blazar.db"
        self.clock = fake_process_reactor()
        self.database = self.service()

    def service(self, pool: ThreadPool | None = None) -> StoreService:
        if pool is None:
            pool = cast(ThreadPool, SynchronousThreadPool())
        return StoreService(self.path, self.clock, pool, url=self.url)

    def test_opened_at_start_and_migrated(self) -> None:
        self.assertFalse(self.database.is_open)
        self.database.startService()
        self.assertTrue(self.database.is_open)
        version = self.successResultOf(
            self.database.run_db(lambda db: db.execute("SELECT version FROM schema_version").fetchone()[0])
        )
        self.assertEqual(version, len(store.MIGRATIONS))
        self.successResultOf(self.database.stopService())
        self.assertFalse(self.database.is_open)

    def test_the_close_waits_for_every_held_stop(self) -> None:
        self.database.startService()
        first: Deferred[str] = Deferred()
        second: Deferred[None] = Deferred()
        self.assertIs(self.database.hold(first), first)
        self.database.hold(second)
        stopped = self.database.stopService()
        first.callback("written")
        self.assertEqual(self.successResultOf(first), "written")  # a part's result is its own
        self.assertNoResult(stopped)
        self.assertTrue(self.database.is_open)
        second.errback(RuntimeError("a part's stop failed"))
        self.failureResultOf(second, RuntimeError)
        self.successResultOf(stopped)
        self.assertFalse(self.database.is_open)

    def test_usage_written_on_stop_is_read_back(self) -> None:
        quotas = Quotas(self.clock, wall=lambda: 86400.0 * 3)
        self.database.startService()
        usage = UsageStore(self.database, quotas, self.clock)
        usage.startService()
        quotas.record(KeyConfig("alice", "alice-secret-0123456789"), 12)
        self.successResultOf(usage.stopService())
        self.successResultOf(self.database.stopService())
        again = self.service()
        again.startService()
        self.assertEqual(again.run_db_now(store.thd_day_usage, quotas.today()), {"alice": 12})
        self.successResultOf(again.stopService())

    def test_day_used_is_the_stores_and_the_unwritten(self) -> None:
        """
        L{UsageStore.day_used} (what a Redis that lost its day counter is
        seeded with): the store's rows for today plus this node's rows not
        yet written.
        """
        quotas = Quotas(self.clock, wall=lambda: 86400.0 * 3)
        self.database.startService()
        usage = UsageStore(self.database, quotas, self.clock)
        alice = KeyConfig("alice", "alice-secret-0123456789")
        quotas.record(alice, 12)
        self.successResultOf(usage.flush())
        quotas.record(alice, 5)
        quotas.record(KeyConfig("bob", "bob-secret-0123456789ab"), 7)
        self.assertEqual(self.successResultOf(usage.day_used("alice")), 17)
        self.assertEqual(self.successResultOf(usage.day_used("carol")), 0)
        self.successResultOf(self.database.stopService())

    def sessions(self, node: str) -> SessionService:
        text = f'[cluster]\nnode = "{node}"\nurl = "http://{node}:1"\n'
        if self.url is not None:
            text += f'database = "{self.url}"\n'
        service = SessionService(
            self.database, LiveConfig(parse_config(text)), EngineClient(self.clock), self.clock, Metrics()
        )
        service.startService()
        return service

    def test_a_sessions_row_names_its_node(self) -> None:
        """
        The KV bank's index (issue 42): a claim writes the node's name and
        address; a node reads back its own rows (on SQLite, every row: one
        node's own database).
        """
        self.database.startService()
        a = self.sessions("a")
        self.assertEqual(a.sessions.node, "a")
        session = Session("k", "chat", "m", 7.0)
        self.successResultOf(a._persist(session, claim=True))
        self.assertEqual(self.successResultOf(a.holders("k", "chat")), [("m", "a", "http://a:1", 7.0)])
        b = self.sessions("b")
        shared = self.url is not None
        self.assertEqual([s.name for s in b.sessions.of_key(None)], [] if shared else ["chat"])
        self.assertEqual(b.sessions.index is not None, shared)
        if shared:
            index = b.sessions.index
            assert index is not None
            self.assertEqual(self.successResultOf(index("k")), [("k", "chat", "m", "a", 7.0)])
        self.successResultOf(a._forget(session))
        self.assertEqual(self.successResultOf(a.holders("k", "chat")), [])

    def test_one_thread(self) -> None:
        database = self.service(ThreadPool(1, 1, name="blazar-store"))
        database.startService()
        try:
            names = {database.run_db_now(lambda db: threading.current_thread().name) for _ in range(3)}
        finally:
            database.run_db_now(lambda db: db.close())
            database._pool.stop()
        self.assertEqual(len(names), 1)


class SQLiteStoreServiceTests(StoreServiceContract, SynchronousTestCase):
    pass


class PostgresStoreServiceTests(StoreServiceContract, SynchronousTestCase):
    def setUp(self) -> None:
        self.url = postgres.shared().new_database()
        super().setUp()

    def test_nothing_is_written_beside_the_data_dir(self) -> None:
        self.database.startService()
        self.successResultOf(self.database.run_db(store.thd_put_file, ("file-a", "k", "a", "batch", 1, b"{}")))
        self.successResultOf(self.database.stopService())
        self.assertFalse(self.path.parent.exists())

    def test_an_unreachable_server_stops_the_start_naming_it(self) -> None:
        """
        The start fails naming the server, and leaves no thread behind (the
        pool's thread kept a daemon whose database was down from exiting:
        found by a README trial).
        """
        self.url = f"postgresql://postgres@127.0.0.1:{postgres.free_port()}/nothing"
        pool = ThreadPool(1, 1, name="blazar-store-test")
        database = self.service(pool)
        with self.assertRaises(store.StoreUnavailable) as cm:
            database.startService()
        self.assertIn("PostgreSQL at 127.0.0.1:", str(cm.exception))
        self.assertIn("is unreachable", str(cm.exception))
        self.assertFalse(pool.started)
        self.assertFalse([t for t in pool.threads if t.is_alive()])
        self.assertFalse(database.running)


class PeriodicJobTests(SynchronousTestCase):
    def test_a_failing_body_is_logged_and_the_job_keeps_running(self) -> None:
        clock = Clock()
        runs: list[int] = []

        def body() -> Deferred[None] | None:
            runs.append(len(runs))
            if len(runs) == 1:
                raise RuntimeError("the disk is gone")
            if len(runs) == 2:
                return fail(ValueError("and again"))
            return None

        job = PeriodicJob(clock, 5.0, body, "the job failed")
        job.start()
        clock.advance(4.9)
        self.assertEqual(runs, [])  # the first run is one interval after start
        for _ in range(3):
            clock.advance(5.0)
        self.assertEqual(runs, [0, 1, 2])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError, ValueError)), 2)
        job.stop()
        clock.advance(50.0)
        self.assertEqual(runs, [0, 1, 2])
