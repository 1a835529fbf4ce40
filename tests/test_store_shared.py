"""
The store's functions that key usage, stored Responses, sessions and the
semantic cache use (L{blazar.store}), the same on SQLite and on
PostgreSQL; and what only the shared store must do (issue 42): exact
counters when several nodes add at once, one claim per batch line, a
clear error naming an unreachable server and a reconnect once it is back,
and a migration that nodes starting together run once.
"""

from __future__ import annotations

import threading
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from tests import postgres
from tests.postgres import PostgresStore, SQLiteStore, StoreMixin

RESPONSE = ("resp_1", "alice", 100.0, 200.0, None, '{"id": "resp_1"}', "[]")


class SharedStoreContract(StoreMixin):
    def setUp(self) -> None:
        self.db = self.open_store()

    def test_usage_adds_up_per_day_and_key(self) -> None:
        store.thd_add_usage(self.db, [("2026-01-01", "alice", 3), ("2026-01-01", "bob", 1)])
        store.thd_add_usage(self.db, [("2026-01-01", "alice", 4), ("2026-01-02", "alice", 9)])
        self.assertEqual(store.thd_day_usage(self.db, "2026-01-01"), {"alice": 7, "bob": 1})
        self.assertEqual(store.thd_day_usage(self.db, "2026-01-03"), {})

    def test_a_response_belongs_to_its_key_and_expires(self) -> None:
        store.thd_put_response(self.db, RESPONSE, keep=10)
        self.assertEqual(store.thd_get_response(self.db, "resp_1", "alice", 150.0), ('{"id": "resp_1"}', "[]", None))
        self.assertIsNone(store.thd_get_response(self.db, "resp_1", "bob", 150.0))
        self.assertIsNone(store.thd_get_response(self.db, "resp_1", "alice", 250.0))
        store.thd_put_response(self.db, (*RESPONSE[:5], '{"id": "resp_1", "again": true}', "[]"), keep=10)
        self.assertEqual(
            store.thd_get_response(self.db, "resp_1", "alice", 150.0), ('{"id": "resp_1", "again": true}', "[]", None)
        )
        self.assertFalse(store.thd_delete_response(self.db, "resp_1", "bob"))
        self.assertTrue(store.thd_delete_response(self.db, "resp_1", "alice"))
        self.assertIsNone(store.thd_get_response(self.db, "resp_1", "alice", 150.0))

    def test_each_key_keeps_its_newest_responses(self) -> None:
        for n in range(4):
            store.thd_put_response(self.db, (f"resp_{n}", "alice", 100.0 + n, 900.0, None, "{}", "[]"), keep=2)
        store.thd_put_response(self.db, ("resp_b", "bob", 50.0, 900.0, "resp_0", "{}", "[]"), keep=2)
        alive = [n for n in range(4) if store.thd_get_response(self.db, f"resp_{n}", "alice", 120.0)]
        self.assertEqual(alive, [2, 3])
        self.assertEqual(store.thd_get_response(self.db, "resp_b", "bob", 120.0), ("{}", "[]", "resp_0"))

    def test_sessions_are_written_replaced_and_forgotten(self) -> None:
        row = ("alice", "chat", "m:latest", "f.bin", 12, 4096, "shape", 10.0, 11.0, "a", "http://a:1")
        store.thd_put_session(self.db, row)
        store.thd_put_session(self.db, ("", "chat", "m:latest", None, 0, 0, "", 0.0, 5.0, "a", "http://a:1"))
        store.thd_put_session(self.db, (*row[:8], 20.0, "a", "http://a:1"))
        self.assertEqual(
            sorted(tuple(r) for r in store.thd_sessions(self.db)),
            [("", "chat", "m:latest", None, 0, 0, "", 0.0, 5.0), (*row[:8], 20.0)],
        )
        store.thd_delete_session(self.db, "alice", "chat", "m:latest")
        self.assertEqual([r[0] for r in store.thd_sessions(self.db)], [""])

    def test_the_index_says_which_node_holds_a_session(self) -> None:
        store.thd_put_session(self.db, ("alice", "chat", "m", None, 0, 0, "", 0.0, 5.0, "a", "http://a:1"), claim=True)
        store.thd_put_session(self.db, ("alice", "chat", "n", None, 0, 0, "", 0.0, 9.0, "b", "http://b:2"), claim=True)
        store.thd_put_session(self.db, ("bob", "chat", "m", None, 0, 0, "", 0.0, 7.0, "b", "http://b:2"), claim=True)
        self.assertEqual(
            store.thd_session_holders(self.db, "alice", "chat"),
            [("n", "b", "http://b:2", 9.0), ("m", "a", "http://a:1", 5.0)],
        )
        self.assertEqual(store.thd_session_holders(self.db, "alice", "other"), [])
        self.assertEqual(
            store.thd_session_index(self.db, "alice"),
            [("alice", "chat", "n", "b", 9.0), ("alice", "chat", "m", "a", 5.0)],
        )
        self.assertEqual([r[3] for r in store.thd_session_index(self.db, None)], ["b", "b", "a"])

    def test_a_claim_takes_the_session_over(self) -> None:
        store.thd_put_session(self.db, ("k", "s", "m", "f.bin", 3, 9, "x", 1.0, 1.0, "a", "http://a:1"))
        store.thd_put_session(self.db, ("k", "s", "m", None, 0, 0, "", 0.0, 2.0, "b", "http://b:2"), claim=True)
        self.assertEqual(store.thd_session_holders(self.db, "k", "s"), [("m", "b", "http://b:2", 2.0)])

    def test_cache_entries_keep_the_newest_and_expire(self) -> None:
        ids = [store.thd_put_cache(self.db, ("s", 100.0 + n, b"\x00\x01" * n, b"{}"), 0.0, 3)[0] for n in range(4)]
        self.assertEqual(ids, sorted(ids))
        _, dropped = store.thd_put_cache(self.db, ("s", 200.0, b"v", b"a"), 102.5, 3)
        self.assertEqual(sorted(dropped), [ids[1], ids[2]])  # ids[0] went at the fourth put (all but 3)
        entries = store.thd_cache_entries(self.db, 0.0, 10)
        self.assertEqual([(e[2], e[3], e[4]) for e in entries], [(103.0, b"\x00\x01" * 3, b"{}"), (200.0, b"v", b"a")])
        self.assertEqual(store.thd_purge_cache(self.db, 150.0), 1)
        self.assertEqual(len(store.thd_cache_entries(self.db, 0.0, 10)), 1)

    def test_cache_entries_after_an_id(self) -> None:
        ids = [store.thd_put_cache(self.db, ("s", 100.0 + n, b"v", b"a"), 0.0, 10)[0] for n in range(4)]
        after = store.thd_cache_entries_after(self.db, ids[1], 102.5)
        self.assertEqual([e[0] for e in after], [ids[3]])  # above ids[1], and live
        self.assertEqual([e[0] for e in store.thd_cache_entries_after(self.db, 0, 0.0)], ids)
        self.assertEqual(len(store.thd_cache_entries(self.db, 0.0, 10)), 4)  # nothing deleted


class SQLiteSharedStoreTests(SQLiteStore, SharedStoreContract, SynchronousTestCase):
    pass


class PostgresSharedStoreTests(PostgresStore, SharedStoreContract, SynchronousTestCase):
    def test_a_node_never_overwrites_nor_deletes_a_session_another_took_over(self) -> None:
        """
        Node A's later bank save, or its expiry of its stale copy, leaves
        node B's claim alone; each node reads back only its own rows.
        """
        store.thd_put_session(self.db, ("k", "s", "m", None, 0, 0, "", 0.0, 1.0, "a", "http://a:1"), claim=True)
        store.thd_put_session(self.db, ("k", "s", "m", None, 0, 0, "", 0.0, 2.0, "b", "http://b:2"), claim=True)
        store.thd_put_session(self.db, ("k", "s", "m", "f.bin", 3, 9, "x", 3.0, 3.0, "a", "http://a:1"))
        store.thd_delete_session(self.db, "k", "s", "m", "a")
        self.assertEqual(store.thd_session_holders(self.db, "k", "s"), [("m", "b", "http://b:2", 2.0)])
        self.assertEqual(store.thd_sessions(self.db, "a"), [])
        self.assertEqual([r[1] for r in store.thd_sessions(self.db, "b")], ["s"])
        store.thd_put_session(self.db, ("k", "t", "m", "f.bin", 3, 9, "x", 3.0, 3.0, "a", "http://a:1"))
        self.assertEqual([r[1] for r in store.thd_sessions(self.db, "a")], ["t"])
        store.thd_delete_session(self.db, "k", "s", "m", "b")
        self.assertEqual(store.thd_session_holders(self.db, "k", "s"), [])


def run_threads(count: int, body: object) -> list[BaseException]:
    """
    C{body(n)} on C{count} threads at once; what they raised.
    """
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(n: int) -> None:
        try:
            start.wait()
            body(n)  # type: ignore[operator]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


class PostgresNodesTests(SynchronousTestCase):
    """
    Two connections to one database, as two nodes hold.
    """

    def setUp(self) -> None:
        self.url = postgres.shared().new_database()
        self.nodes = [store.thd_open_postgres(self.url) for _ in range(2)]
        for db in self.nodes:
            self.addCleanup(db.close)

    def test_a_nodes_cache_finds_the_entries_another_stored(self) -> None:
        """
        Two nodes' semantic caches on one database: an entry one stores is
        in the other's index after its next sync (and only once).
        """
        from twisted.internet.defer import Deferred, maybeDeferred

        from blazar.config import CacheConfig
        from blazar.gateway.cachestore import CacheStore
        from tests.gateway.test_cache import unit

        config = CacheConfig()
        caches = []
        for db in self.nodes:

            def run_db(f: Any, *args: Any, db: Any = db) -> Deferred[Any]:
                return maybeDeferred(f, db, *args)

            cache = CacheStore(lambda: config, lambda: 1000.0, run_db)
            self.successResultOf(Deferred.fromCoroutine(cache.load()))
            caches.append(cache)
        a, b = caches
        vector = unit(1.0, 2.0)
        self.successResultOf(a.store("scope", vector, b'{"answer": 1}'))
        self.assertIsNone(b.lookup("scope", vector)[1])
        self.assertEqual(self.successResultOf(Deferred.fromCoroutine(b.sync())), 1)
        found = b.lookup("scope", vector)[1]
        assert found is not None
        self.assertEqual(found.answer, b'{"answer": 1}')
        self.assertEqual(self.successResultOf(Deferred.fromCoroutine(b.sync())), 0)
        self.assertEqual(self.successResultOf(Deferred.fromCoroutine(a.sync())), 0)  # its own: held already

    def test_two_nodes_adding_to_one_counter_from_many_threads_lose_nothing(self) -> None:
        rounds = 40

        def add(n: int) -> None:
            db = self.nodes[n % 2]
            for r in range(rounds):
                store.thd_add_usage(db, [("2026-01-01", "shared", n + 1), ("2026-01-01", f"own{n}", 1)])

        self.assertEqual(run_threads(8, add), [])
        usage = store.thd_day_usage(self.nodes[0], "2026-01-01")
        self.assertEqual(usage["shared"], rounds * sum(n + 1 for n in range(8)))
        self.assertEqual({k: v for k, v in usage.items() if k != "shared"}, {f"own{n}": rounds for n in range(8)})

    def test_two_nodes_never_claim_the_same_line(self) -> None:
        store.thd_create_batch(self.nodes[0], "batch_x", "", 1, "{}", [(f"c{n}", "{}") for n in range(200)])
        claimed: list[list[int]] = [[] for _ in range(8)]

        def claim(n: int) -> None:
            db = self.nodes[n % 2]
            while rows := store.thd_claim_lines(db, "batch_x", 3):
                claimed[n] += [r[0] for r in rows]

        self.assertEqual(run_threads(8, claim), [])
        every = sorted(line for lines in claimed for line in lines)
        self.assertEqual(every, list(range(200)))  # each once
        self.assertEqual(store.thd_line_counts(self.nodes[1], "batch_x"), {"running": 200})

    def test_nodes_starting_together_migrate_once(self) -> None:
        url = postgres.shared().new_database()
        opened: list[store.PgDatabase] = []
        self.assertEqual(run_threads(4, lambda n: opened.append(store.thd_open_postgres(url))), [])
        for db in opened:
            self.addCleanup(db.close)
        versions = opened[0].execute("SELECT version FROM schema_version").fetchall()
        self.assertEqual(versions, [(len(store.POSTGRES_MIGRATIONS),)])

    def test_a_database_at_an_older_version_is_migrated_forward(self) -> None:
        url = postgres.shared().new_database()
        old = store.PgDatabase(url)
        self.addCleanup(old.close)
        old.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        old.execute("INSERT INTO schema_version VALUES (7)")
        for step in store.POSTGRES_MIGRATIONS[:7]:
            for statement in step.split(";"):
                if statement.strip():
                    old.execute(statement)
        db = store.thd_open_postgres(url)
        self.addCleanup(db.close)
        self.assertEqual(db.execute("SELECT version FROM schema_version").fetchone()[0], len(store.POSTGRES_MIGRATIONS))
        self.assertEqual(store.thd_put_bench(db, ("m:latest", 1.0, "e", "{}", "{}", "{}", "[]"), 10), 1)

    def test_reopening_applies_no_migration_twice(self) -> None:
        store.thd_add_usage(self.nodes[0], [("2026-12-01", "a", 5)])
        again = store.thd_open_postgres(self.url)
        self.addCleanup(again.close)
        self.assertEqual(store.thd_day_usage(again, "2026-12-01"), {"a": 5})
        self.assertEqual(
            again.execute("SELECT version FROM schema_version").fetchall(), [(len(store.POSTGRES_MIGRATIONS),)]
        )

    def test_a_database_newer_than_this_blazar_is_refused(self) -> None:
        self.nodes[0].execute("UPDATE schema_version SET version = 99")
        with self.assertRaises(RuntimeError) as cm:
            store.thd_open_postgres(self.url)
        self.assertIn("schema version 99", str(cm.exception))

    def test_the_two_dialects_have_the_same_versions(self) -> None:
        self.assertEqual(len(store.POSTGRES_MIGRATIONS), len(store.MIGRATIONS))


class PostgresOutageTests(SynchronousTestCase):
    """
    A PostgreSQL stopped and started again: every operation meanwhile
    fails naming the server, none succeeds silently, and the same
    connection object works again once the server is back.
    """

    def setUp(self) -> None:
        self.server = postgres.server()
        self.addCleanup(self.server.remove)
        self.db = store.thd_open_postgres(self.server.new_database())
        self.addCleanup(self.db.close)

    def assertUnavailable(self, f: object, *args: object) -> None:
        with self.assertRaises(store.StoreUnavailable) as cm:
            f(self.db, *args)  # type: ignore[operator]
        self.assertIn(f"PostgreSQL at 127.0.0.1:{self.server.port} is unreachable", str(cm.exception))

    def test_a_stopped_server_fails_every_operation_naming_it_and_a_restart_heals(self) -> None:
        store.thd_add_usage(self.db, [("2026-01-01", "alice", 5)])
        self.server.stop()
        self.assertUnavailable(store.thd_add_usage, [("2026-01-01", "alice", 1)])  # the broken connection
        self.assertUnavailable(store.thd_add_usage, [("2026-01-01", "alice", 1)])  # a new one, refused
        self.assertUnavailable(store.thd_day_usage, "2026-01-01")
        self.assertUnavailable(store.thd_claim_lines, "batch_x", 1)
        self.assertUnavailable(store.thd_put_file, ("file-a", "alice", "a", "batch", 1, b"x"))
        self.assertFalse(self.db.in_transaction)
        self.server.start()
        self.assertEqual(store.thd_day_usage(self.db, "2026-01-01"), {"alice": 5})  # nothing written while down
        store.thd_add_usage(self.db, [("2026-01-01", "alice", 2)])
        self.assertEqual(store.thd_day_usage(self.db, "2026-01-01"), {"alice": 7})
        store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"x"))
        self.assertEqual(store.thd_file_content(self.db, "file-a", None), b"x")

    def test_a_transaction_cut_by_the_outage_is_not_finished_on_a_new_connection(self) -> None:
        with self.assertRaises(store.StoreUnavailable):
            with store.transaction(self.db):
                store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"first"))
                self.server.stop()
                self.server.start()
                store.thd_put_file(self.db, ("file-b", "alice", "b", "batch", 1, b"second"))
        self.assertFalse(self.db.in_transaction)
        self.assertEqual(store.thd_files(self.db, None), [])  # neither half of it
