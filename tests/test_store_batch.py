"""
The Batch API's tables (L{blazar.store}, migration 5): ownership, cursor
pagination, and at-most-once lines, on SQLite and on PostgreSQL; its file
contents on disk (migration 7) with SQLite, in the database with PostgreSQL.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
from pathlib import Path

import psycopg
from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.gateway.batch import thd_finalize, thd_unfinished
from tests.postgres import PostgresStore, SQLiteStore, StoreMixin


class BatchStoreContract(StoreMixin):
    def setUp(self) -> None:
        self.db = self.open_store()

    def test_migrated(self) -> None:
        version = self.db.execute("SELECT version FROM schema_version").fetchone()[0]
        self.assertEqual(version, len(store.MIGRATIONS))

    def test_files_belong_to_their_key(self) -> None:
        store.thd_put_file(self.db, ("file-a", "alice", "in.jsonl", "batch", 10, b"{}\n"))
        self.assertEqual(store.thd_file_content(self.db, "file-a", "alice"), b"{}\n")
        self.assertIsNone(store.thd_file_content(self.db, "file-a", "bob"))
        self.assertEqual(store.thd_file_content(self.db, "file-a", None), b"{}\n")
        self.assertEqual(store.thd_files(self.db, "bob"), [])
        self.assertEqual(store.thd_files(self.db, "alice"), [("file-a", "alice", "in.jsonl", "batch", 10, 3)])
        self.assertFalse(store.thd_delete_file(self.db, "file-a", "bob"))
        self.assertTrue(store.thd_delete_file(self.db, "file-a", "alice"))
        self.assertIsNone(store.thd_file_content(self.db, "file-a", None))

    def test_a_content_that_fails_midway_leaves_nothing(self) -> None:
        class Broken(io.BytesIO):
            def read(self, size: int | None = -1, /) -> bytes:
                if self.tell():
                    raise OSError("the upload broke")
                return super().read(4)

        with self.assertRaises(OSError):
            store.thd_put_file(self.db, ("file-b", "alice", "in.jsonl", "batch", 10, Broken(b"12345678")))
        if not store.is_postgres(self.db):
            folder = store.files_dir(self.db)
            self.assertEqual(sorted(p.name for p in folder.iterdir()), [])
        self.assertEqual(store.thd_files(self.db, None), [])
        self.assertIsNone(store.thd_file_content(self.db, "file-b", None))
        store.thd_put_file(self.db, ("file-c", "alice", "in.jsonl", "batch", 10, io.BytesIO(b"12345678")))
        self.assertEqual(store.thd_file_content(self.db, "file-c", "alice"), b"12345678")
        if not store.is_postgres(self.db):
            self.assertEqual(
                ((folder / "file-c").read_bytes(), (folder / "file-c").stat().st_mode & 0o777), (b"12345678", 0o600)
            )

    def test_batches_paginate_newest_first(self) -> None:
        for n in range(5):
            store.thd_create_batch(self.db, f"batch_{n}", "alice", 100 + n, json.dumps({"id": f"batch_{n}"}), [])
        store.thd_create_batch(self.db, "batch_bob", "bob", 200, "{}", [])
        first = [json.loads(b)["id"] for _, b in store.thd_batches(self.db, "alice", None, 2)]
        self.assertEqual(first, ["batch_4", "batch_3"])
        rest = [json.loads(b)["id"] for _, b in store.thd_batches(self.db, "alice", first[-1], 10)]
        self.assertEqual(rest, ["batch_2", "batch_1", "batch_0"])
        self.assertEqual(len(store.thd_batches(self.db, None, None, 10)), 6)

    def test_lines_run_at_most_once(self) -> None:
        lines = [(f"c{n}", json.dumps({"n": n})) for n in range(5)]
        store.thd_create_batch(self.db, "batch_x", "", 1, "{}", lines)
        claimed = store.thd_claim_lines(self.db, "batch_x", 2)
        self.assertEqual([c[1] for c in claimed], ["c0", "c1"])
        store.thd_finish_line(self.db, "batch_x", 0, True, json.dumps({"custom_id": "c0"}))
        # the daemon dies with c1 in flight; on start the line is failed, not pending
        failed = store.thd_interrupted_lines(
            self.db, "batch_x", json.dumps({"error": {"code": "interrupted", "message": "m"}})
        )
        self.assertEqual(failed, 1)
        # a late answer for it changes nothing
        store.thd_finish_line(self.db, "batch_x", 1, True, json.dumps({"custom_id": "late"}))
        self.assertEqual(store.thd_line_counts(self.db, "batch_x"), {"done": 1, "failed": 1, "pending": 3})
        self.assertEqual([c[1] for c in store.thd_claim_lines(self.db, "batch_x", 10)], ["c2", "c3", "c4"])
        self.assertEqual(store.thd_claim_lines(self.db, "batch_x", 10), [])
        self.assertEqual(store.thd_results(self.db, "batch_x", True), b'{"custom_id": "c0"}\n')
        self.assertEqual(json.loads(store.thd_results(self.db, "batch_x", False))["custom_id"], "c1")

    def test_a_released_line_is_claimed_again_and_pending_ones_fail(self) -> None:
        store.thd_create_batch(self.db, "batch_r", "", 1, "{}", [("c0", "{}"), ("c1", "{}"), ("c2", "{}")])
        self.assertEqual([c[0] for c in store.thd_claim_lines(self.db, "batch_r", 2)], [0, 1])
        store.thd_release_line(self.db, "batch_r", 1)
        self.assertEqual([c[0] for c in store.thd_claim_lines(self.db, "batch_r", 5)], [1, 2])
        store.thd_release_line(self.db, "batch_r", 2)
        self.assertEqual(store.thd_fail_pending(self.db, "batch_r", json.dumps({"error": {"code": "expired"}})), 1)
        self.assertEqual(store.thd_line_counts(self.db, "batch_r"), {"running": 2, "failed": 1})

    def test_unfinished_batches_and_a_finalized_ones_files(self) -> None:
        store.thd_create_batch(
            self.db, "batch_a", "alice", 1, json.dumps({"id": "batch_a", "status": "in_progress"}), []
        )
        store.thd_create_batch(self.db, "batch_b", "alice", 2, json.dumps({"id": "batch_b", "status": "completed"}), [])
        store.thd_create_batch(self.db, "batch_c", "bob", 3, json.dumps({"id": "batch_c", "status": "validating"}), [])
        self.assertEqual([json.loads(b)["id"] for _, b in thd_unfinished(self.db)], ["batch_a", "batch_c"])
        store.thd_create_batch(
            self.db, "batch_d", "alice", 4, json.dumps({"id": "batch_d"}), [("c0", "{}"), ("c1", "{}")]
        )
        store.thd_claim_lines(self.db, "batch_d", 2)
        store.thd_finish_line(self.db, "batch_d", 0, True, '{"custom_id": "c0"}')
        store.thd_finish_line(self.db, "batch_d", 1, False, '{"custom_id": "c1"}')
        done = thd_finalize(self.db, {"id": "batch_d", "status": "completed"}, "alice", 9)
        assert done is not None
        self.assertEqual(done["request_counts"], {"total": 2, "completed": 1, "failed": 1})
        self.assertEqual(store.thd_file_content(self.db, done["output_file_id"], "alice"), b'{"custom_id": "c0"}\n')
        self.assertEqual(store.thd_file_content(self.db, done["error_file_id"], "alice"), b'{"custom_id": "c1"}\n')
        self.assertEqual(
            json.loads(store.thd_batch(self.db, "batch_d", "alice") or "")["output_file_id"], done["output_file_id"]
        )


class SQLiteBatchStoreTests(SQLiteStore, BatchStoreContract, SynchronousTestCase):
    pass


class PostgresBatchStoreTests(PostgresStore, BatchStoreContract, SynchronousTestCase):
    pass


class SQLiteFileContentTests(SynchronousTestCase):
    """
    File contents out of SQLite (migration 7): one file each under
    C{<data_dir>/files}, read in pieces, removed on delete, held to a quota.
    """

    def setUp(self) -> None:
        self.path = Path(self.mktemp()) / "blazar.db"
        self.db: sqlite3.Connection = store.thd_open(self.path)
        self.addCleanup(self.db.close)
        self.files = self.path.parent / "files"

    def test_a_files_content_is_a_file_of_its_own_and_a_delete_removes_it(self) -> None:
        size = store.thd_put_file(self.db, ("file-a", "alice", "in.jsonl", "batch", 10, io.BytesIO(b"x" * 3_000_000)))
        self.assertEqual(size, 3_000_000)
        self.assertEqual((self.files / "file-a").read_bytes(), b"x" * 3_000_000)
        self.assertEqual(sorted(os.listdir(self.files)), ["file-a"])  # no temporary left
        self.assertEqual(
            store.thd_file(self.db, "file-a", "alice"), ("file-a", "alice", "in.jsonl", "batch", 10, 3_000_000)
        )
        found = store.thd_open_content(self.db, "file-a", "alice")
        assert found is not None
        with found[1] as handle:
            self.assertEqual((found[0], handle.read(5)), (3_000_000, b"xxxxx"))
        self.assertIsNone(store.thd_open_content(self.db, "file-a", "bob"))
        self.assertTrue(store.thd_delete_file(self.db, "file-a", "alice"))
        self.assertEqual(os.listdir(self.files), [])

    def test_the_quota_counts_the_keys_files_only(self) -> None:
        store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"x" * 60), quota=100)
        store.thd_put_file(self.db, ("file-b", "bob", "b", "batch", 1, b"x" * 90), quota=100)
        with self.assertRaises(store.OverQuota) as cm:
            store.thd_put_file(self.db, ("file-c", "alice", "c", "batch", 1, io.BytesIO(b"x" * 41)), quota=100)
        self.assertEqual((cm.exception.used, cm.exception.size, cm.exception.quota), (60, 41, 100))
        self.assertFalse((self.files / "file-c").exists())
        store.thd_put_file(self.db, ("file-c", "alice", "c", "batch", 1, b"x" * 40), quota=100)
        self.assertEqual(store.thd_file_bytes(self.db, "alice"), 100)

    def test_a_row_that_fails_leaves_no_content_and_touches_no_other(self) -> None:
        store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"first"))
        with self.assertRaises(FileExistsError):
            store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"again"))
        self.assertEqual(store.thd_file_content(self.db, "file-a", "alice"), b"first")
        (self.files / "file-a").unlink()  # a row left without content (by hand): the same id again
        with self.assertRaises(sqlite3.IntegrityError):
            store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"again"))
        self.assertEqual(os.listdir(self.files), [])  # the refused row's content went with it

    def test_the_sweep_removes_what_no_row_names(self) -> None:
        store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"kept"))
        (self.files / "file-gone").write_bytes(b"a crash rolled its row back")
        (self.files / ".file-b.part").write_bytes(b"half written")
        self.assertEqual(store.thd_sweep_files(self.db), 2)
        self.assertEqual(os.listdir(self.files), ["file-a"])

    def test_older_blobs_move_out_and_give_their_space_back(self) -> None:
        path = Path(self.mktemp()) / "blazar.db"
        path.parent.mkdir()
        old = sqlite3.connect(path, isolation_level=None)
        old.execute("PRAGMA journal_mode=WAL")
        old.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        old.execute("INSERT INTO schema_version VALUES (6)")
        for sql in store.MIGRATIONS[:6]:
            assert isinstance(sql, str)
            for statement in sql.split(";"):
                if statement.strip():
                    old.execute(statement)
        big = bytes(range(256)) * 40_000  # 10 MB
        old.execute("INSERT INTO batch_files VALUES ('file-big', 'alice', 'in.jsonl', 'batch', 5, ?)", (big,))
        old.execute("INSERT INTO batch_files VALUES ('file-empty', '', 'e.jsonl', 'batch_output', 6, ?)", (b"",))
        old.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        old.close()
        self.assertGreater(path.stat().st_size, len(big))
        db = store.thd_open(path)
        self.addCleanup(db.close)
        self.assertEqual(db.execute("SELECT version FROM schema_version").fetchone()[0], len(store.MIGRATIONS))
        self.assertEqual(store.thd_file_content(db, "file-big", "alice"), big)
        self.assertEqual(store.thd_file_content(db, "file-empty", ""), b"")
        self.assertEqual(
            sorted((r[0], r[5]) for r in store.thd_files(db, None)), [("file-big", len(big)), ("file-empty", 0)]
        )
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.assertLess(path.stat().st_size, 1_000_000)  # the BLOB's pages went back to the file system
        self.assertEqual(oct(os.stat(path.parent / "files" / "file-big").st_mode & 0o777), "0o600")


class PostgresFileContentTests(PostgresStore, SynchronousTestCase):
    """
    File contents in PostgreSQL (C{[cluster] database}): 1 MiB pieces that
    every node reads, written with their row and deleted with it, held to a
    quota.
    """

    def setUp(self) -> None:
        self.db = self.open_store()

    def pieces(self, id_: str) -> list[int]:
        return [
            len(d) for (d,) in self.db.execute("SELECT data FROM batch_file_chunks WHERE id = ? ORDER BY n", (id_,))
        ]

    def test_a_content_is_stored_in_pieces_read_back_whole_and_deleted_with_its_row(self) -> None:
        content = bytes(range(256)) * 12_000  # 3 MB
        size = store.thd_put_file(self.db, ("file-a", "alice", "in.jsonl", "batch", 10, io.BytesIO(content)))
        self.assertEqual(size, len(content))
        self.assertEqual(self.pieces("file-a"), [store.CHUNK, store.CHUNK, len(content) - 2 * store.CHUNK])
        self.assertEqual(store.thd_file(self.db, "file-a", "alice"), ("file-a", "alice", "in.jsonl", "batch", 10, size))
        found = store.thd_open_content(self.db, "file-a", "alice")
        assert found is not None
        self.assertTrue(store.thd_delete_file(self.db, "file-a", "alice"))
        with found[1] as handle:  # a delete while it is read does not cut it short
            self.assertEqual((found[0], handle.read()), (len(content), content))
        self.assertEqual(self.pieces("file-a"), [])
        self.assertIsNone(store.thd_open_content(self.db, "file-a", "alice"))
        self.assertEqual(store.thd_sweep_files(self.db), 0)

    def test_an_empty_content_and_bytes(self) -> None:
        self.assertEqual(store.thd_put_file(self.db, ("file-e", "", "e.jsonl", "batch_output", 1, b"")), 0)
        self.assertEqual(store.thd_file_content(self.db, "file-e", ""), b"")
        self.assertEqual(
            store.thd_put_file(self.db, ("file-b", "", "b.jsonl", "batch", 1, b"x" * (store.CHUNK + 1))),
            store.CHUNK + 1,
        )
        self.assertEqual(self.pieces("file-b"), [store.CHUNK, 1])

    def test_the_quota_counts_the_keys_files_only(self) -> None:
        store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"x" * 60), quota=100)
        store.thd_put_file(self.db, ("file-b", "bob", "b", "batch", 1, b"x" * 90), quota=100)
        with self.assertRaises(store.OverQuota) as cm:
            store.thd_put_file(self.db, ("file-c", "alice", "c", "batch", 1, io.BytesIO(b"x" * 41)), quota=100)
        self.assertEqual((cm.exception.used, cm.exception.size, cm.exception.quota), (60, 41, 100))
        self.assertIsNone(store.thd_file(self.db, "file-c", None))
        store.thd_put_file(self.db, ("file-c", "alice", "c", "batch", 1, b"x" * 40), quota=100)
        self.assertEqual(store.thd_file_bytes(self.db, "alice"), 100)

    def test_a_row_that_fails_leaves_no_content_and_touches_no_other(self) -> None:
        store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"first"))
        with self.assertRaises(psycopg.IntegrityError):
            store.thd_put_file(self.db, ("file-a", "alice", "a", "batch", 1, b"again"))
        self.assertEqual(store.thd_file_content(self.db, "file-a", "alice"), b"first")
        self.assertEqual(self.pieces("file-a"), [5])

    def test_a_file_written_in_a_transaction_that_rolls_back_leaves_nothing(self) -> None:
        with self.assertRaises(RuntimeError):
            with store.transaction(self.db):
                store.thd_put_file(self.db, ("file-t", "alice", "t", "batch", 1, b"x" * 10))
                raise RuntimeError("the batch's final write failed")
        self.assertIsNone(store.thd_file(self.db, "file-t", None))
        self.assertEqual(self.pieces("file-t"), [])
