"""
Batches shared by several nodes (issue 42): two L{BatchRunner}s, each with
its own connection to one store (SQLite here, the real PostgreSQL in the
C{Postgres*} twins), on one Clock. Any node runs any batch's lines; a
line's lease is renewed while its node lives, taken back (failed, never
sent again) only once it ended; a node that lost its lease never writes a
second answer; a batch is finalized exactly once.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.gateway import batch as batch_mod
from blazar.gateway.batch import BatchRunner, error_template, thd_finalize
from tests.gateway.test_batch import CHAT, NOW, FakeSend, jsonl, line
from tests.postgres import PostgresStore, SQLiteStore


class Node:
    """
    One node: its store connection, its runner, its fake line sender.
    """

    def __init__(self, db: store.Database, clock: Clock, name: str, in_flight: int = 2) -> None:
        self.db = db
        self.send = FakeSend()
        self.runner = BatchRunner(
            clock,
            lambda f, *args: maybeDeferred(f, db, *args),
            lambda f, *args: maybeDeferred(f, *args),
            self.send,
            lambda: in_flight,
            node=name,
        )


class NodesCase(SQLiteStore, SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(NOW)
        db_a, db_b = self.open_stores(2)
        self.db = db_a
        self.a = Node(db_a, self.clock, "node-a")
        self.b = Node(db_b, self.clock, "node-b")

    def ok(self, coroutine: Any) -> Any:
        return self.successResultOf(Deferred.fromCoroutine(coroutine))

    def make_batch(self, node: Node, n: int) -> dict[str, Any]:
        content = jsonl(*[line(f"req-{i}") for i in range(n)])
        file = self.ok(node.runner.upload("alice", "in.jsonl", "batch", content))
        return self.ok(
            node.runner.create("alice", {"input_file_id": file["id"], "endpoint": CHAT, "completion_window": "24h"})
        )

    def get(self, batch_id: str) -> dict[str, Any]:
        return self.ok(self.b.runner.batch("alice", batch_id))

    def lines_of(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        return [json.loads(x) for x in self.ok(self.b.runner.content("alice", file_id)).splitlines()]

    def stop(self, *nodes: Node) -> None:
        for node in nodes:
            self.ok(node.runner.stop())

    def outputs(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM batch_files WHERE purpose = 'batch_output'").fetchone()[0])


class SharedBatchTests(NodesCase):
    def test_a_batch_made_on_one_node_is_run_by_both_each_line_once(self) -> None:
        self.ok(self.a.runner.start())
        self.ok(self.b.runner.start())
        made = self.make_batch(self.a, 9)
        self.assertEqual(len(self.a.send.calls), 2)
        self.clock.advance(batch_mod.TEND_EVERY)  # B picks it up
        self.assertEqual(len(self.b.send.calls), 2)
        for _ in range(20):
            self.a.send.answer_all()
            self.b.send.answer_all()
            self.clock.advance(batch_mod.TEND_EVERY)
        sent = self.a.send.custom_ids() + self.b.send.custom_ids()
        self.assertEqual(sorted(sent), sorted(f"req-{i}" for i in range(9)))  # each once, over both
        self.assertTrue(self.b.send.calls)
        done = self.get(made["id"])
        self.assertEqual(
            (done["status"], done["request_counts"]), ("completed", {"total": 9, "completed": 9, "failed": 0})
        )
        self.assertEqual(sorted(o["custom_id"] for o in self.lines_of(done["output_file_id"])), sorted(sent))
        self.assertEqual(self.outputs(), 1)  # finalized once
        self.stop(self.a, self.b)

    def test_each_node_shows_the_counts_of_both_while_it_runs(self) -> None:
        self.ok(self.a.runner.start())
        self.ok(self.b.runner.start())
        made = self.make_batch(self.a, 8)
        self.clock.advance(batch_mod.TEND_EVERY)
        self.b.send.answer(0)
        self.b.send.answer(1, status=400, body={"error": {"message": "no"}})
        self.a.send.answer(0)
        for node in (self.a, self.b):
            got = self.ok(node.runner.batch("alice", made["id"]))
            self.assertEqual(
                (got["status"], got["request_counts"]), ("in_progress", {"total": 8, "completed": 2, "failed": 1})
            )
            listed = self.ok(node.runner.batches("alice"))["data"]
            self.assertEqual(listed[0]["request_counts"], got["request_counts"])

    def test_a_live_nodes_lines_are_never_taken_back(self) -> None:
        self.ok(self.a.runner.start())
        self.ok(self.b.runner.start())
        made = self.make_batch(self.a, 2)
        for _ in range(30):  # 300 s: five leases, renewed by A all along
            self.clock.advance(batch_mod.TEND_EVERY)
        self.assertEqual(store.thd_line_counts(self.db, made["id"]), {"running": 2})
        self.a.send.answer_all()
        self.clock.advance(batch_mod.TEND_EVERY)
        done = self.get(made["id"])
        self.assertEqual(
            (done["status"], done["request_counts"]), ("completed", {"total": 2, "completed": 2, "failed": 0})
        )
        self.assertEqual(self.b.send.calls, [])
        self.stop(self.a, self.b)

    def test_a_dead_nodes_lines_are_taken_back_once_its_lease_ends_and_its_late_answers_dropped(self) -> None:
        # A claims two lines and dies (its runner never tends: no renewal); B runs the rest
        made = self.make_batch(self.a, 4)
        self.assertEqual(len(self.a.send.calls), 2)
        self.ok(self.b.runner.start())
        self.assertEqual(len(self.b.send.calls), 2)
        self.b.send.answer_all()
        self.clock.advance(batch_mod.TEND_EVERY)
        self.assertEqual(store.thd_line_counts(self.db, made["id"]), {"running": 2, "done": 2})  # A's, within its lease
        self.assertEqual(self.get(made["id"])["status"], "in_progress")
        self.clock.advance(batch_mod.LEASE)
        done = self.get(made["id"])
        self.assertEqual(
            (done["status"], done["request_counts"]), ("completed", {"total": 4, "completed": 2, "failed": 2})
        )
        errors = self.lines_of(done["error_file_id"])
        self.assertEqual(
            [(e["custom_id"], e["error"]["code"]) for e in errors],
            [("req-0", "batch_interrupted"), ("req-1", "batch_interrupted")],
        )
        # A's answers come late: never written (each line answered once)
        self.a.send.answer_all()
        self.assertEqual(
            [json.loads(r)["custom_id"] for r in store.thd_results(self.db, made["id"], True).decode().splitlines()],
            ["req-2", "req-3"],
        )
        self.assertEqual(store.thd_line_counts(self.db, made["id"]), {"failed": 2, "done": 2})
        self.assertEqual(self.get(made["id"]), done)
        self.assertEqual(self.outputs(), 2)
        self.stop(self.b)

    def test_a_cancel_on_one_node_is_kept_by_the_other(self) -> None:
        self.ok(self.a.runner.start())
        self.ok(self.b.runner.start())
        made = self.make_batch(self.a, 8)
        self.clock.advance(batch_mod.TEND_EVERY)
        self.assertEqual(len(self.b.send.calls), 2)
        self.assertEqual(self.ok(self.b.runner.cancel("alice", made["id"]))["status"], "cancelling")
        self.a.send.answer_all()  # A has not seen the cancel yet: its record must not undo it
        self.assertEqual(self.get(made["id"])["status"], "cancelling")
        self.b.send.answer_all()
        self.clock.advance(batch_mod.TEND_EVERY)
        self.clock.advance(batch_mod.TEND_EVERY)
        done = self.get(made["id"])
        self.assertEqual(done["status"], "cancelled")
        self.assertEqual(done["request_counts"]["completed"], len(self.a.send.calls) + len(self.b.send.calls))
        self.assertEqual(self.outputs(), 1)
        self.stop(self.a, self.b)

    def test_a_node_cancels_a_batch_it_has_not_yet_picked_up(self) -> None:
        self.ok(self.a.runner.start())
        self.ok(self.b.runner.start())
        made = self.make_batch(self.a, 5)
        self.assertEqual(self.ok(self.b.runner.cancel("alice", made["id"]))["status"], "cancelling")
        self.a.send.answer_all()
        self.clock.advance(batch_mod.TEND_EVERY)
        done = self.get(made["id"])
        self.assertEqual(
            (done["status"], done["request_counts"]), ("cancelled", {"total": 5, "completed": 2, "failed": 0})
        )
        self.assertEqual(self.b.send.calls, [])
        self.stop(self.a, self.b)


class ClaimStoreTests(NodesCase):
    def setUp(self) -> None:
        super().setUp()
        self.db_b = self.b.db
        store.thd_create_batch(
            self.db,
            "batch_x",
            "alice",
            1,
            json.dumps({"id": "batch_x", "status": "in_progress"}),
            [(f"c{i}", "{}") for i in range(3)],
        )

    def test_the_answer_needs_the_claim_still_held(self) -> None:
        self.assertEqual(len(store.thd_claim_lines(self.db, "batch_x", 2, "a", "a:1", NOW + 60)), 2)
        self.assertEqual(store.thd_renew_leases(self.db, "a", NOW + 120), 2)
        template = error_template(batch_mod.INTERRUPTED)
        self.assertEqual(store.thd_take_back_lines(self.db_b, NOW + 100, template), {})  # lease renewed: alive
        self.assertEqual(store.thd_take_back_lines(self.db_b, NOW + 121, template), {"batch_x": 2})
        self.assertFalse(store.thd_finish_line(self.db, "batch_x", 0, True, '{"custom_id": "c0"}', "a:1"))
        self.assertFalse(store.thd_release_line(self.db, "batch_x", 1, "a:1"))
        self.assertEqual(store.thd_line_counts(self.db, "batch_x"), {"failed": 2, "pending": 1})
        # a claim's token names only its own lines
        [(n, _, _)] = store.thd_claim_lines(self.db_b, "batch_x", 5, "b", "b:1", NOW + 200)
        self.assertFalse(store.thd_finish_line(self.db, "batch_x", n, True, "{}", "a:1"))
        self.assertTrue(store.thd_finish_line(self.db_b, "batch_x", n, True, "{}", "b:1"))

    def test_a_starting_node_takes_back_its_own_lines_at_once_never_another_live_ones(self) -> None:
        store.thd_claim_lines(self.db, "batch_x", 1, "a", "a:1", NOW + 60)
        store.thd_claim_lines(self.db_b, "batch_x", 1, "b", "b:1", NOW + 60)
        template = error_template(batch_mod.INTERRUPTED)
        self.assertEqual(store.thd_take_back_lines(self.db, NOW, template, "a"), {"batch_x": 1})
        self.assertEqual(store.thd_line_counts(self.db, "batch_x"), {"failed": 1, "running": 1, "pending": 1})
        self.assertTrue(store.thd_finish_line(self.db_b, "batch_x", 1, True, "{}", "b:1"))

    def test_no_line_of_a_batch_cancelled_elsewhere_is_claimed(self) -> None:
        cancelling = json.dumps({"id": "batch_x", "status": "cancelling"})
        self.assertTrue(store.thd_put_batch(self.db_b, "batch_x", cancelling))
        self.assertEqual(store.thd_claim_lines(self.db, "batch_x", 3, "a", "a:1", NOW + 60), [])
        self.assertEqual(store.thd_line_counts(self.db, "batch_x"), {"pending": 3})

    def test_finalized_exactly_once_and_not_while_a_line_runs(self) -> None:
        store.thd_claim_lines(self.db, "batch_x", 3, "a", "a:1", NOW + 60)
        store.thd_finish_line(self.db, "batch_x", 0, True, '{"custom_id": "c0"}', "a:1")
        store.thd_finish_line(self.db, "batch_x", 1, False, '{"custom_id": "c1"}', "a:1")
        final = {"id": "batch_x", "status": "completed"}
        self.assertIsNone(thd_finalize(self.db_b, final, "alice", 9))  # c2 still runs on a
        store.thd_finish_line(self.db, "batch_x", 2, True, '{"custom_id": "c2"}', "a:1")
        first = thd_finalize(self.db, final, "alice", 9)
        second = thd_finalize(self.db_b, final, "alice", 10)
        assert first is not None and second is not None
        self.assertEqual(second, first)  # the stored one: no second set of files
        self.assertEqual(first["request_counts"], {"total": 3, "completed": 2, "failed": 1})
        self.assertEqual(self.outputs(), 2)
        # a node that has not seen the end never writes over it
        self.assertFalse(
            store.thd_put_batch(self.db_b, "batch_x", json.dumps({"id": "batch_x", "status": "in_progress"}))
        )


class PostgresSharedBatchTests(PostgresStore, SharedBatchTests):
    pass


class PostgresClaimStoreTests(PostgresStore, ClaimStoreTests):
    pass
