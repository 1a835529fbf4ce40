"""
The Batch API's tables (L{blazar.store}, migration 5): ownership, cursor
pagination, and at-most-once lines.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar import store


class BatchStoreTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.db: sqlite3.Connection = store.thd_open(Path(self.mktemp()) / "blazar.db")
        self.addCleanup(self.db.close)

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
            self.db, "batch_x", json.dumps({"error": {"code": "interrupted", "message": "m"}}))
        self.assertEqual(failed, 1)
        # a late answer for it changes nothing
        store.thd_finish_line(self.db, "batch_x", 1, True, json.dumps({"custom_id": "late"}))
        self.assertEqual(store.thd_line_counts(self.db, "batch_x"), {"done": 1, "failed": 1, "pending": 3})
        self.assertEqual([c[1] for c in store.thd_claim_lines(self.db, "batch_x", 10)], ["c2", "c3", "c4"])
        self.assertEqual(store.thd_claim_lines(self.db, "batch_x", 10), [])
        self.assertEqual(store.thd_results(self.db, "batch_x", True), b'{"custom_id": "c0"}\n')
        self.assertEqual(json.loads(store.thd_results(self.db, "batch_x", False))["custom_id"], "c1")
