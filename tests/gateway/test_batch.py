"""
The Batch API's logic (L{blazar.gateway.batch}): input validation, the
object shapes (checked against the openai SDK's own types), and the runner
with a fake line sender on a Clock and a real SQLite file: bounded lines
in flight, counts, output and error files, cancel, expiry, retry after a
refusal, and each line at most once across a restart.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any, TypeVar, cast

from openai.types import Batch, FileObject
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.gateway import batch as batch_mod
from blazar.gateway.batch import (
    FILE_MAX_BYTES,
    BatchConflict,
    BatchNotFound,
    BatchRunner,
    FileNotFound,
    FileTooLarge,
    parse_input,
)
from blazar.gateway.errors import BadRequest, Unavailable
from tests.postgres import PostgresStore, SQLiteStore

CHAT = "/v1/chat/completions"
NOW = 1_700_000_000.0
E = TypeVar("E", bound=BaseException)


def line(custom_id: str, url: str = CHAT, **body: Any) -> bytes:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": url,
            "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}], **body},
        }
    ).encode()


def jsonl(*lines: bytes) -> bytes:
    return b"\n".join(lines) + b"\n"


class ParseInputTests(SynchronousTestCase):
    def test_valid_lines_in_order(self) -> None:
        lines, errors, model = parse_input(jsonl(line("a"), b"", line("b")), CHAT)
        self.assertEqual(errors, [])
        self.assertEqual([c for c, _ in lines], ["a", "b"])
        self.assertEqual(json.loads(lines[1][1])["messages"][0]["content"], "b")
        self.assertEqual(model, "m")

    def test_each_bad_line_is_named_with_its_number(self) -> None:
        content = jsonl(
            line("a"),
            b"{not json",
            b"[1]",
            json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode(),
            line("a"),
            json.dumps({"custom_id": "g", "method": "GET", "url": CHAT, "body": {}}).encode(),
            line("u", url="/v1/embeddings"),
            json.dumps({"custom_id": "n", "method": "POST", "url": CHAT}).encode(),
            line("s", stream=True),
        )
        _, errors, _ = parse_input(content, CHAT)
        self.assertEqual(
            [(e["code"], e["line"], e["param"]) for e in errors],
            [
                ("invalid_json_line", 2, None),
                ("invalid_json_line", 3, None),
                ("missing_required_parameter", 4, "custom_id"),
                ("duplicate_custom_id", 5, "custom_id"),
                ("invalid_method", 6, "method"),
                ("invalid_url", 7, "url"),
                ("missing_required_parameter", 8, "body"),
                ("invalid_value", 9, "body.stream"),
            ],
        )
        for error in errors:  # OpenAI's BatchError shape
            Batch.model_validate({**_batch_fields(), "errors": {"object": "list", "data": [error]}})

    def test_an_empty_file_and_too_many_lines(self) -> None:
        self.assertEqual(parse_input(b"\n\n", CHAT)[1][0]["code"], "empty_file")
        self.patch(batch_mod, "MAX_LINES", 2)
        self.assertEqual(parse_input(jsonl(line("a"), line("b"), line("c")), CHAT)[1][0]["code"], "too_many_requests")

    def test_several_models_name_none(self) -> None:
        self.assertIsNone(parse_input(jsonl(line("a"), line("b", model="other")), CHAT)[2])


def _batch_fields() -> dict[str, Any]:
    return batch_mod.new_batch("batch_x", CHAT, "file-x", "24h", 1, None)


class FakeSend:
    """
    Records each line sent; the test answers them.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any], str, Deferred[Any]]] = []

    def __call__(self, key: str, endpoint: str, body: bytes, trace: str) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.calls.append((key, endpoint, json.loads(body), trace, d))
        return d

    def open(self) -> list[int]:
        return [i for i, c in enumerate(self.calls) if not c[4].called]

    def answer(self, i: int, status: int = 200, body: Any = None, headers: dict[str, str] | None = None) -> None:
        _, endpoint, request, trace, d = self.calls[i]
        payload = body if body is not None else {"object": "chat.completion", "echo": request["messages"][0]["content"]}
        d.callback((status, {"x-blazar-trace-id": trace, **(headers or {})}, json.dumps(payload).encode()))

    def answer_all(self) -> None:
        while self.open():
            for i in self.open():
                self.answer(i)

    def custom_ids(self) -> list[str]:
        return [c[2]["messages"][0]["content"] for c in self.calls]


class RunnerCase(SQLiteStore, SynchronousTestCase):
    """
    The runner over a real store: SQLite here, PostgreSQL in the
    C{Postgres*} twins at the end.
    """

    def setUp(self) -> None:
        self.db = self.open_store()
        self.clock = Clock()
        self.clock.advance(NOW)
        self.send = FakeSend()
        self.in_flight = 2
        self.runner = self.make_runner()

    def make_runner(self) -> BatchRunner:
        return BatchRunner(
            self.clock,
            lambda f, *args: maybeDeferred(f, self.db, *args),
            lambda f, *args: maybeDeferred(f, *args),
            self.send,
            lambda: self.in_flight,
        )

    def ok(self, coroutine: Any) -> Any:
        return self.successResultOf(Deferred.fromCoroutine(coroutine))

    def fails(self, coroutine: Any, error: type[E]) -> E:
        return cast(E, self.failureResultOf(Deferred.fromCoroutine(coroutine), error).value)

    def make_batch(self, n: int = 5, key: str = "alice", endpoint: str = CHAT, **extra: Any) -> dict[str, Any]:
        content = jsonl(*[line(f"req-{i}", url=endpoint) for i in range(n)])
        file = self.ok(self.runner.upload(key, "in.jsonl", "batch", content))
        return self.ok(
            self.runner.create(
                key, {"input_file_id": file["id"], "endpoint": endpoint, "completion_window": "24h", **extra}
            )
        )

    def get(self, batch_id: str, key: str = "alice") -> dict[str, Any]:
        return self.ok(self.runner.batch(key, batch_id))

    def lines_of(self, file_id: str | None, key: str = "alice") -> list[dict[str, Any]]:
        assert file_id is not None
        return [json.loads(x) for x in self.ok(self.runner.content(key, file_id)).splitlines()]


class FilesTests(RunnerCase):
    def test_upload_list_retrieve_content_delete(self) -> None:
        made = self.ok(self.runner.upload("alice", "in.jsonl", "batch", b"abc\n"))
        FileObject.model_validate(made)
        self.assertEqual(
            (made["object"], made["bytes"], made["purpose"], made["filename"], made["created_at"]),
            ("file", 4, "batch", "in.jsonl", int(NOW)),
        )
        self.assertTrue(made["id"].startswith("file-"))
        self.assertEqual(self.ok(self.runner.file("alice", made["id"])), made)
        self.assertEqual(self.ok(self.runner.content("alice", made["id"])), b"abc\n")
        listed = self.ok(self.runner.files("alice"))
        self.assertEqual(
            (listed["object"], [f["id"] for f in listed["data"]], listed["has_more"]), ("list", [made["id"]], False)
        )
        self.assertEqual(
            self.ok(self.runner.delete_file("alice", made["id"])), {"id": made["id"], "object": "file", "deleted": True}
        )
        self.fails(self.runner.file("alice", made["id"]), FileNotFound)

    def test_another_keys_files_do_not_exist(self) -> None:
        made = self.ok(self.runner.upload("alice", "in.jsonl", "batch", b"abc\n"))
        for op in (self.runner.file, self.runner.content, self.runner.delete_file):
            self.fails(op("bob", made["id"]), FileNotFound)
        self.assertEqual(self.ok(self.runner.files("bob"))["data"], [])
        self.ok(self.runner.file("alice", made["id"]))  # still there

    def test_pagination_and_purpose(self) -> None:
        ids = []
        for n in range(3):
            ids.append(self.ok(self.runner.upload("alice", f"{n}.jsonl", "batch", b"x"))["id"])
            self.clock.advance(1)
        page = self.ok(self.runner.files("alice", limit=2))
        self.assertEqual([f["id"] for f in page["data"]], ids[::-1][:2])
        self.assertTrue(page["has_more"])
        rest = self.ok(self.runner.files("alice", after=page["last_id"]))
        self.assertEqual([f["id"] for f in rest["data"]], [ids[0]])
        self.assertEqual([f["id"] for f in self.ok(self.runner.files("alice", order="asc"))["data"]], ids)
        self.assertEqual(self.ok(self.runner.files("alice", purpose="batch_output"))["data"], [])

    def test_only_batch_files_and_at_most_200_mb(self) -> None:
        self.assertEqual(self.fails(self.runner.upload("alice", "f", "fine-tune", b"x"), BadRequest).param, "purpose")

    def test_a_full_disk_is_a_503_naming_it(self) -> None:
        def full(f: Any, *args: Any) -> Any:
            raise sqlite3.OperationalError("database or disk is full")

        runner = BatchRunner(
            self.clock, full, lambda f, *args: maybeDeferred(f, *args), self.send, lambda: self.in_flight
        )
        error = self.fails(runner.upload("alice", "in.jsonl", "batch", b"x\n"), Unavailable)
        self.assertIn("data_dir is full", str(error))
        self.patch(batch_mod, "FILE_MAX_BYTES", 3)
        too_big = self.fails(self.runner.upload("alice", "f", "batch", b"abcd"), FileTooLarge)
        self.assertEqual(too_big.status, 413)
        self.assertIn("200 MB", str(too_big))
        self.assertEqual(FILE_MAX_BYTES, 200 * 1024 * 1024)


class CreateTests(RunnerCase):
    def test_a_valid_batch_is_in_progress_in_openais_shape(self) -> None:
        made = self.make_batch(3, metadata={"job": "nightly"})
        Batch.model_validate(made)
        self.assertEqual(made["status"], "in_progress")
        self.assertEqual(made["request_counts"], {"total": 3, "completed": 0, "failed": 0})
        self.assertEqual(
            (made["created_at"], made["in_progress_at"], made["expires_at"]), (int(NOW), int(NOW), int(NOW) + 86400)
        )
        self.assertEqual((made["metadata"], made["model"], made["completion_window"]), ({"job": "nightly"}, "m", "24h"))
        self.assertTrue(made["id"].startswith("batch_"))
        self.assertEqual(self.get(made["id"])["id"], made["id"])

    def test_bad_parameters_are_400(self) -> None:
        file = self.ok(self.runner.upload("alice", "in.jsonl", "batch", jsonl(line("a"))))
        good = {"input_file_id": file["id"], "endpoint": CHAT, "completion_window": "24h"}
        changes: list[tuple[dict[str, Any], str]] = [
            ({"input_file_id": None}, "input_file_id"),
            ({"endpoint": "/v1/moderations"}, "endpoint"),
            ({"completion_window": "48h"}, "completion_window"),
            ({"metadata": {"k": 1}}, "metadata"),
        ]
        for change, param in changes:
            error = self.fails(self.runner.create("alice", {**good, **change}), BadRequest)
            self.assertEqual(error.param, param)
        self.assertEqual(self.send.calls, [])

    def test_no_batch_is_made_where_lines_cannot_run(self) -> None:
        from blazar.gateway.errors import Unavailable

        file = self.ok(self.runner.upload("alice", "in.jsonl", "batch", jsonl(line("a"))))
        self.runner.unavailable = "the Batch API cannot run on this daemon: set a shorter data_dir"
        error = self.fails(
            self.runner.create("alice", {"input_file_id": file["id"], "endpoint": CHAT, "completion_window": "24h"}),
            Unavailable,
        )
        self.assertIn("data_dir", str(error))
        self.assertEqual(self.send.calls, [])

    def test_another_keys_file_is_404(self) -> None:
        file = self.ok(self.runner.upload("alice", "in.jsonl", "batch", jsonl(line("a"))))
        self.fails(
            self.runner.create("bob", {"input_file_id": file["id"], "endpoint": CHAT, "completion_window": "24h"}),
            FileNotFound,
        )

    def test_bad_lines_fail_the_batch_at_validation(self) -> None:
        file = self.ok(self.runner.upload("alice", "in.jsonl", "batch", jsonl(line("a"), line("a"))))
        made = self.ok(
            self.runner.create("alice", {"input_file_id": file["id"], "endpoint": CHAT, "completion_window": "24h"})
        )
        Batch.model_validate(made)
        self.assertEqual((made["status"], made["failed_at"], made["in_progress_at"]), ("failed", int(NOW), None))
        self.assertEqual(made["errors"]["object"], "list")
        self.assertEqual([(e["code"], e["line"]) for e in made["errors"]["data"]], [("duplicate_custom_id", 2)])
        self.assertEqual(self.send.calls, [])
        self.assertEqual(self.get(made["id"])["status"], "failed")

    def test_another_keys_batch_does_not_exist(self) -> None:
        made = self.make_batch(1)
        self.fails(self.runner.batch("bob", made["id"]), BatchNotFound)
        self.fails(self.runner.cancel("bob", made["id"]), BatchNotFound)
        self.assertEqual(self.ok(self.runner.batches("bob"))["data"], [])

    def test_list_newest_first_with_after(self) -> None:
        ids = []
        for _ in range(3):
            ids.append(self.make_batch(1)["id"])
            self.clock.advance(1)
        page = self.ok(self.runner.batches("alice", limit=2))
        self.assertEqual(
            ([b["id"] for b in page["data"]], page["has_more"], page["first_id"], page["last_id"]),
            (ids[::-1][:2], True, ids[2], ids[1]),
        )
        rest = self.ok(self.runner.batches("alice", after=page["last_id"], limit=2))
        self.assertEqual(([b["id"] for b in rest["data"]], rest["has_more"]), ([ids[0]], False))


class RunTests(RunnerCase):
    def test_lines_run_bounded_and_the_batch_completes(self) -> None:
        made = self.make_batch(5)
        self.assertEqual(len(self.send.calls), 2)  # batch_max_in_flight
        key, endpoint, _, trace, _ = self.send.calls[0]
        self.assertEqual((key, endpoint, trace), ("alice", CHAT, made["id"] + ".0"))
        self.send.answer(0)
        self.assertEqual(len(self.send.open()), 2)  # the next one started
        self.assertEqual(self.get(made["id"])["request_counts"], {"total": 5, "completed": 1, "failed": 0})
        self.send.answer_all()
        self.assertEqual(self.send.custom_ids(), [f"req-{i}" for i in range(5)])
        done = self.get(made["id"])
        Batch.model_validate(done)
        self.assertEqual(
            (done["status"], done["completed_at"], done["finalizing_at"], done["error_file_id"]),
            ("completed", int(NOW), int(NOW), None),
        )
        self.assertEqual(done["request_counts"], {"total": 5, "completed": 5, "failed": 0})
        output = self.lines_of(done["output_file_id"])
        self.assertEqual([o["custom_id"] for o in output], [f"req-{i}" for i in range(5)])
        first = output[0]
        self.assertEqual(set(first), {"id", "custom_id", "response", "error"})
        self.assertTrue(first["id"].startswith("batch_req_"))
        self.assertEqual(len({o["id"] for o in output}), 5)
        self.assertEqual(first["error"], None)
        self.assertEqual(
            first["response"],
            {
                "status_code": 200,
                "request_id": made["id"] + ".0",
                "body": {"object": "chat.completion", "echo": "req-0"},
            },
        )
        out_file = self.ok(self.runner.file("alice", done["output_file_id"]))
        self.assertEqual((out_file["purpose"], out_file["filename"]), ("batch_output", f"{made['id']}_output.jsonl"))
        self.fails(self.runner.content("bob", done["output_file_id"]), FileNotFound)

    def test_an_error_answer_goes_to_the_error_file(self) -> None:
        made = self.make_batch(2)
        self.send.answer(0, 400, {"error": {"message": "bad", "type": "invalid_request_error"}})
        self.send.answer(1)
        done = self.get(made["id"])
        self.assertEqual(done["request_counts"], {"total": 2, "completed": 1, "failed": 1})
        [error] = self.lines_of(done["error_file_id"])
        self.assertEqual((error["custom_id"], error["response"]["status_code"], error["error"]), ("req-0", 400, None))
        self.assertEqual([o["custom_id"] for o in self.lines_of(done["output_file_id"])], ["req-1"])

    def test_a_line_that_cannot_be_sent_fails_alone(self) -> None:
        made = self.make_batch(2)
        self.send.calls[0][4].errback(ConnectionRefusedError("no listener"))
        self.send.answer(1)
        done = self.get(made["id"])
        [error] = self.lines_of(done["error_file_id"])
        self.assertEqual((error["response"], error["error"]["code"]), (None, "request_failed"))
        self.assertEqual(done["status"], "completed")

    def test_a_refusal_with_retry_after_sends_the_line_again_later(self) -> None:
        made = self.make_batch(1)
        self.send.answer(0, 429, {"error": {"message": "rpm"}}, {"retry-after": "5"})
        self.assertEqual(len(self.send.calls), 1)  # the batch waits
        self.assertEqual(self.get(made["id"])["request_counts"]["failed"], 0)
        self.clock.advance(5)
        self.assertEqual(len(self.send.calls), 2)
        self.send.answer(1)
        self.assertEqual(self.get(made["id"])["request_counts"], {"total": 1, "completed": 1, "failed": 0})

    def test_batches_run_oldest_first(self) -> None:
        first = self.make_batch(3)
        second = self.make_batch(2, key="bob")
        self.assertEqual([c[3] for c in self.send.calls], [first["id"] + ".0", first["id"] + ".1"])
        self.send.answer_all()
        self.assertEqual([c[0] for c in self.send.calls], ["alice"] * 3 + ["bob"] * 2)
        self.assertEqual(self.get(second["id"], "bob")["status"], "completed")

    def test_embeddings_lines(self) -> None:
        file = self.ok(
            self.runner.upload(
                "alice",
                "e.jsonl",
                "batch",
                jsonl(
                    json.dumps(
                        {
                            "custom_id": "e",
                            "method": "POST",
                            "url": "/v1/embeddings",
                            "body": {"model": "m", "input": "hi"},
                        }
                    ).encode()
                ),
            )
        )
        made = self.ok(
            self.runner.create(
                "alice", {"input_file_id": file["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
            )
        )
        self.assertEqual(self.send.calls[0][1:3], ("/v1/embeddings", {"model": "m", "input": "hi"}))
        self.send.answer(0, body={"object": "list", "data": []})
        self.assertEqual(self.lines_of(self.get(made["id"])["output_file_id"])[0]["response"]["body"]["object"], "list")


class CancelTests(RunnerCase):
    def test_running_lines_finish_pending_ones_never_start(self) -> None:
        made = self.make_batch(5)
        cancelling = self.ok(self.runner.cancel("alice", made["id"]))
        Batch.model_validate(cancelling)
        self.assertEqual((cancelling["status"], cancelling["cancelling_at"]), ("cancelling", int(NOW)))
        self.send.answer_all()
        self.assertEqual(len(self.send.calls), 2)
        done = self.get(made["id"])
        self.assertEqual((done["status"], done["cancelled_at"]), ("cancelled", int(NOW)))
        self.assertEqual(done["request_counts"], {"total": 5, "completed": 2, "failed": 0})
        self.assertEqual(len(self.lines_of(done["output_file_id"])), 2)
        self.assertEqual(self.ok(self.runner.cancel("alice", made["id"]))["status"], "cancelled")

    def test_lines_claimed_as_it_is_cancelled_never_start(self) -> None:
        held: list[tuple[Deferred[Any], Any, tuple[Any, ...]]] = []

        def run_db(f: Any, *args: Any) -> Deferred[Any]:
            if f is store.thd_claim_lines:
                d: Deferred[Any] = Deferred()
                held.append((d, f, args))
                return d
            return maybeDeferred(f, self.db, *args)

        self.runner.run_db = run_db
        made = self.make_batch(3)
        self.assertEqual(len(held), 1)  # the claim is on the database thread
        self.assertEqual(self.ok(self.runner.cancel("alice", made["id"]))["status"], "cancelling")
        d, f, args = held.pop()
        d.callback(f(self.db, *args))
        self.assertEqual(self.send.calls, [])
        done = self.get(made["id"])
        self.assertEqual(
            (done["status"], done["request_counts"]), ("cancelled", {"total": 3, "completed": 0, "failed": 0})
        )
        self.assertEqual(store.thd_line_counts(self.db, made["id"]), {"pending": 3})

    def test_a_finished_batch_cannot_be_cancelled(self) -> None:
        made = self.make_batch(1)
        self.send.answer_all()
        self.assertEqual(self.fails(self.runner.cancel("alice", made["id"]), BatchConflict).status, 409)


class ExpiryTests(RunnerCase):
    def test_pending_lines_expire_as_failed_with_openais_error(self) -> None:
        self.ok(self.runner.start())  # the expiry job
        made = self.make_batch(5)
        self.clock.advance(86400)
        self.assertEqual(self.get(made["id"])["status"], "in_progress")  # two lines still in flight
        self.send.answer_all()
        self.assertEqual(len(self.send.calls), 2)
        done = self.get(made["id"])
        Batch.model_validate(done)
        self.assertEqual((done["status"], done["expired_at"]), ("expired", int(NOW) + 86400))
        self.assertEqual(done["request_counts"], {"total": 5, "completed": 2, "failed": 3})
        errors = self.lines_of(done["error_file_id"])
        self.assertEqual([e["custom_id"] for e in errors], ["req-2", "req-3", "req-4"])
        self.assertEqual(errors[0]["error"], batch_mod.EXPIRED)
        self.assertEqual(errors[0]["response"], None)
        self.assertEqual(len({e["id"] for e in errors}), 3)

    def test_the_job_survives_an_error(self) -> None:
        self.ok(self.runner.start())
        self.runner._active["boom"] = None  # type: ignore[assignment]  # a broken entry: its round fails
        self.clock.advance(60)
        self.assertEqual(len(self.flushLoggedErrors(AttributeError)), 2)  # the expiry job's and the tending round's
        del self.runner._active["boom"]
        made = self.make_batch(1)
        self.clock.advance(86400 + 60)
        self.send.answer_all()
        self.assertEqual(self.get(made["id"])["status"], "expired")  # the job looked again


class RestartTests(RunnerCase):
    def test_each_line_runs_at_most_once_across_an_unclean_stop(self) -> None:
        made = self.make_batch(5)
        self.send.answer(0)
        # the daemon dies with req-1 and req-2 in flight: a new runner on the same database
        sent_before = self.send.custom_ids()
        self.send = FakeSend()
        self.runner = self.make_runner()
        self.ok(self.runner.start())
        self.send.answer_all()
        sent = sent_before + self.send.custom_ids()
        self.assertEqual(sorted(sent), [f"req-{i}" for i in range(5)])  # each once
        done = self.get(made["id"])
        self.assertEqual(done["status"], "completed")
        self.assertEqual(done["request_counts"], {"total": 5, "completed": 3, "failed": 2})
        errors = self.lines_of(done["error_file_id"])
        self.assertEqual(
            [(e["custom_id"], e["error"]["code"]) for e in errors],
            [("req-1", "batch_interrupted"), ("req-2", "batch_interrupted")],
        )
        self.assertEqual([o["custom_id"] for o in self.lines_of(done["output_file_id"])], ["req-0", "req-3", "req-4"])

    def test_a_clean_stop_waits_for_the_lines_in_flight(self) -> None:
        made = self.make_batch(5)
        stopped = Deferred.fromCoroutine(self.runner.stop())
        self.assertNoResult(stopped)
        self.assertNoResult(self.runner.drained())
        self.send.answer_all()
        self.successResultOf(stopped)
        self.assertEqual(len(self.send.calls), 2)  # none started after the stop
        self.send = FakeSend()
        self.runner = self.make_runner()
        self.ok(self.runner.start())
        self.send.answer_all()
        done = self.get(made["id"])
        self.assertEqual(done["request_counts"], {"total": 5, "completed": 5, "failed": 0})

    def test_a_stop_cuts_lines_short_after_its_bound(self) -> None:
        made = self.make_batch(2)
        stopped = Deferred.fromCoroutine(self.runner.stop())
        self.clock.advance(batch_mod.STOP_WAIT)
        self.successResultOf(stopped)
        self.assertEqual(len(self.send.calls), 2)
        self.runner = self.make_runner()
        self.ok(self.runner.start())
        done = self.get(made["id"])
        self.assertEqual(
            (done["status"], done["request_counts"]), ("completed", {"total": 2, "completed": 0, "failed": 2})
        )

    def test_a_cancelling_batch_is_cancelled_at_start(self) -> None:
        made = self.make_batch(3)
        self.ok(self.runner.cancel("alice", made["id"]))
        self.runner = self.make_runner()  # stopped before its lines answered
        self.ok(self.runner.start())
        done = self.get(made["id"])
        self.assertEqual(
            (done["status"], done["request_counts"]), ("cancelled", {"total": 3, "completed": 0, "failed": 2})
        )


class PostgresFilesTests(PostgresStore, FilesTests):
    pass


class PostgresCreateTests(PostgresStore, CreateTests):
    pass


class PostgresRunTests(PostgresStore, RunTests):
    pass


class PostgresCancelTests(PostgresStore, CancelTests):
    pass


class PostgresExpiryTests(PostgresStore, ExpiryTests):
    pass


class PostgresRestartTests(PostgresStore, RestartTests):
    pass
