"""
The bench history's table (L{blazar.store}, migration 8): a database of
the version before gains it, runs come back newest first per model, and
each model keeps its newest runs only; on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from tests.postgres import PostgresStore, SQLiteStore, StoreMixin


def row(model: str, created: float, engine: str = "llamacpp@a") -> store.BenchRow:
    return (model, created, engine, '{"argv": []}', "{}", "{}", "[]")


class BenchStoreContract(StoreMixin):
    def setUp(self) -> None:
        self.db = self.open_store()

    def test_runs_come_back_newest_first_per_model(self) -> None:
        first = store.thd_put_bench(self.db, row("a:latest", 1.0), 10)
        store.thd_put_bench(self.db, row("b:latest", 2.0), 10)
        third = store.thd_put_bench(self.db, row("a:latest", 3.0, "llamacpp@b"), 10)
        self.assertGreater(third, first)
        runs = store.thd_bench_history(self.db, "a:latest", 10)
        self.assertEqual(
            [(r[0], r[1], r[3]) for r in runs], [(third, "a:latest", "llamacpp@b"), (first, "a:latest", "llamacpp@a")]
        )
        self.assertEqual(runs[0][1:], row("a:latest", 3.0, "llamacpp@b"))
        self.assertEqual([r[1] for r in store.thd_bench_history(self.db, None, 2)], ["a:latest", "b:latest"])
        self.assertEqual(store.thd_bench_history(self.db, "c:latest", 10), [])

    def test_each_model_keeps_its_newest_runs(self) -> None:
        for n in range(5):
            store.thd_put_bench(self.db, row("a:latest", float(n)), 3)
        store.thd_put_bench(self.db, row("b:latest", 9.0), 3)
        self.assertEqual([r[2] for r in store.thd_bench_history(self.db, "a:latest", 10)], [4.0, 3.0, 2.0])
        self.assertEqual(len(store.thd_bench_history(self.db, "b:latest", 10)), 1)  # another model's untouched

    def test_an_installed_engine_is_named_by_its_binary(self) -> None:
        self.db.execute(
            "INSERT INTO engines (kind, tag, source, sha256, path, installed_at, active) VALUES "
            "('llamacpp', '11434.0.0-cpu', 'pypi:x', 'h', '/e/bin/llama-server', 1.0, 1)"
        )
        self.assertEqual(store.thd_engine_named(self.db, "/e/bin/llama-server"), "llamacpp@11434.0.0-cpu")
        self.assertIsNone(store.thd_engine_named(self.db, "/other/llama-server"))


class SQLiteBenchStoreTests(SQLiteStore, BenchStoreContract, SynchronousTestCase):
    def test_a_database_of_version_7_gains_the_table(self) -> None:
        path = Path(self.mktemp()) / "blazar.db"
        path.parent.mkdir()
        old = sqlite3.connect(path, isolation_level=None)
        old.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        old.execute("INSERT INTO schema_version VALUES (7)")
        old.execute(
            "CREATE TABLE engines (kind TEXT, tag TEXT, source TEXT, sha256 TEXT, path TEXT, "
            "installed_at REAL, active INTEGER DEFAULT 0, activated_at REAL)"
        )
        # (migration 9 adds the batch lines' owner and lease)
        old.execute(
            "CREATE TABLE batch_lines (batch TEXT, line INTEGER, custom_id TEXT, body TEXT, state TEXT, result TEXT)"
        )
        old.execute(str(store.MIGRATIONS[2]))  # (migration 12 adds the sessions' node and url)
        old.close()
        db = store.thd_open(path)
        self.addCleanup(db.close)
        self.assertEqual(db.execute("SELECT version FROM schema_version").fetchone()[0], len(store.MIGRATIONS))
        self.assertEqual(store.thd_bench_history(db, None, 10), [])
        self.assertEqual(store.thd_put_bench(db, row("m:latest", 1.0), 10), 1)


class PostgresBenchStoreTests(PostgresStore, BenchStoreContract, SynchronousTestCase):
    pass
