"""
The Batch API surface (L{blazar.web.batches}) through C{StubTreq} behind
the real auth gate, with the runner on a real SQLite file and a fake line
sender: the SDK's object shapes on the wire, multipart uploads, query
parameters, OpenAI's error envelope, and per-key ownership.
"""

from __future__ import annotations

import json
from typing import Any

from openai.types import Batch, FileDeleted, FileObject
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from blazar.config import Config, KeyConfig
from blazar.gateway.batch import BatchRunner
from blazar.httpbody import multipart_body
from blazar.postgres import StoreUnavailable
from blazar.web import batches as surface_mod
from blazar.web.auth import AuthGate, KeyHolder
from blazar.web.batches import BatchSurface
from blazar.web.root import SurfaceRouter
from tests.postgres import PostgresStore, SQLiteStore
from tests.typed import StubTreq

ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789abc"
LINE = (
    json.dumps(
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        }
    ).encode()
    + b"\n"
)


class Elsewhere(Resource):
    isLeaf = True

    def render(self, request: Any) -> bytes:
        return b"another surface"


class SurfaceTests(SQLiteStore, SynchronousTestCase):
    def setUp(self) -> None:
        self.db = self.open_store()
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.sent: list[Deferred[Any]] = []

        def send(key: str, endpoint: str, body: bytes, trace: str) -> Deferred[Any]:
            d: Deferred[Any] = Deferred()
            self.sent.append(d)
            return d

        in_thread = lambda f, *args: maybeDeferred(f, *args)  # noqa: E731
        self.runner = BatchRunner(
            self.clock, lambda f, *args: maybeDeferred(f, self.db, *args), in_thread, send, lambda: 4
        )
        other = Elsewhere()
        router = SurfaceRouter(other, other, other, batches=BatchSurface(self.runner, in_thread).app.resource())
        gate = AuthGate(router, KeyHolder(Config(keys=(KeyConfig("alice", ALICE), KeyConfig("bob", BOB)))))
        self.client = StubTreq(gate)

    def call(self, method: str, path: str, secret: str = ALICE, **kwargs: Any) -> tuple[int, Any]:
        headers = {"authorization": f"Bearer {secret}", **kwargs.pop("headers", {})}
        response = self.successResultOf(self.client.request(method, "http://x" + path, headers=headers, **kwargs))
        body = self.successResultOf(response.content())
        try:
            return response.code, json.loads(body)
        except ValueError:
            return response.code, body

    def upload(self, content: bytes = LINE, purpose: str = "batch", secret: str = ALICE) -> tuple[int, Any]:
        raw, content_type = multipart_body({"purpose": purpose}, [("file", "in.jsonl", "application/jsonl", content)])
        return self.call("POST", "/v1/files", secret, data=raw, headers={"content-type": content_type})

    def test_files_round_trip_in_openais_shapes(self) -> None:
        status, made = self.upload()
        self.assertEqual(status, 200, made)
        FileObject.model_validate(made)
        self.assertEqual((made["filename"], made["bytes"], made["purpose"]), ("in.jsonl", len(LINE), "batch"))
        status, listed = self.call("GET", "/v1/files?purpose=batch&limit=5")
        self.assertEqual((status, [f["id"] for f in listed["data"]], listed["object"]), (200, [made["id"]], "list"))
        self.assertEqual(self.call("GET", f"/v1/files/{made['id']}"), (200, made))
        status, content = self.call("GET", f"/v1/files/{made['id']}/content")
        self.assertEqual((status, content), (200, json.loads(LINE)))
        status, deleted = self.call("DELETE", f"/v1/files/{made['id']}")
        FileDeleted.model_validate(deleted)
        status, error = self.call("GET", f"/v1/files/{made['id']}")
        self.assertEqual(
            (status, error["error"]["code"], error["error"]["type"]), (404, "not_found", "invalid_request_error")
        )

    def test_an_unreachable_store_is_a_503_naming_it(self) -> None:
        def down(f: Any, *args: Any) -> Deferred[Any]:
            return fail(StoreUnavailable("PostgreSQL at db.lan:5432 is unreachable: connection refused"))

        self.runner.run_db = down
        for method, path in (("GET", "/v1/files"), ("GET", "/v1/batches"), ("GET", "/v1/files/file-x/content")):
            status, error = self.call(method, path)
            self.assertEqual(
                (status, error["error"]["code"], error["error"]["message"]),
                (503, "store_unavailable", "PostgreSQL at db.lan:5432 is unreachable: connection refused"),
                path,
            )
        self.assertEqual(self.upload()[0], 503)

    def test_upload_errors(self) -> None:
        status, error = self.upload(purpose="assistants")
        self.assertEqual((status, error["error"]["param"]), (400, "purpose"))
        status, error = self.call("POST", "/v1/files", data=b"{}", headers={"content-type": "application/json"})
        self.assertEqual(status, 400)
        self.assertIn("multipart/form-data", error["error"]["message"])
        self.patch(surface_mod, "FILE_MAX_BYTES", 10)
        status, error = self.upload(b"x" * 11)
        self.assertEqual((status, error["error"]["code"], error["error"]["param"]), (413, "file_too_large", "file"))
        self.assertIn("200 MB", error["error"]["message"])

    def test_batches_in_openais_shapes_and_ownership(self) -> None:
        _, made = self.upload()
        status, batch = self.call(
            "POST",
            "/v1/batches",
            json={"input_file_id": made["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        self.assertEqual(status, 200, batch)
        Batch.model_validate(batch)
        self.assertEqual((batch["status"], batch["object"]), ("in_progress", "batch"))
        self.assertEqual(len(self.sent), 1)
        status, got = self.call("GET", f"/v1/batches/{batch['id']}")
        self.assertEqual((status, got["id"]), (200, batch["id"]))
        status, page = self.call("GET", "/v1/batches?limit=1")
        self.assertEqual(([b["id"] for b in page["data"]], page["has_more"]), ([batch["id"]], False))
        # bob sees none of alice's
        for method, path in [
            ("GET", f"/v1/batches/{batch['id']}"),
            ("POST", f"/v1/batches/{batch['id']}/cancel"),
            ("GET", f"/v1/files/{made['id']}/content"),
        ]:
            status, error = self.call(method, path, BOB)
            self.assertEqual((status, error["error"]["code"]), (404, "not_found"), path)
        self.assertEqual(self.call("GET", "/v1/batches", BOB)[1]["data"], [])
        status, cancelling = self.call("POST", f"/v1/batches/{batch['id']}/cancel")
        self.assertEqual((status, cancelling["status"]), (200, "cancelling"))
        self.sent[0].callback((200, {}, b"{}"))
        self.assertEqual(self.call("GET", f"/v1/batches/{batch['id']}")[1]["status"], "cancelled")

    def test_create_errors_in_openais_envelope(self) -> None:
        _, made = self.upload()
        for body, status, param in [
            ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, 400, "input_file_id"),
            ({"input_file_id": made["id"], "endpoint": "/v1/audio", "completion_window": "24h"}, 400, "endpoint"),
            (
                {"input_file_id": made["id"], "endpoint": "/v1/chat/completions", "completion_window": "1h"},
                400,
                "completion_window",
            ),
            (
                {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
                404,
                "input_file_id",
            ),
        ]:
            got, error = self.call("POST", "/v1/batches", json=body)
            self.assertEqual((got, error["error"]["param"]), (status, param), body)
            self.assertEqual(set(error["error"]), {"message", "type", "param", "code"})
        self.assertEqual(self.call("GET", "/v1/batches?limit=0")[0], 400)
        self.assertEqual(self.call("GET", "/v1/files?order=sideways")[0], 400)

    def test_a_finished_batch_cannot_be_cancelled(self) -> None:
        _, made = self.upload()
        _, batch = self.call(
            "POST",
            "/v1/batches",
            json={"input_file_id": made["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        self.sent[0].callback((200, {}, b'{"object": "chat.completion"}'))
        status, error = self.call("POST", f"/v1/batches/{batch['id']}/cancel")
        self.assertEqual(status, 409, error)

    def test_other_paths_go_elsewhere(self) -> None:
        self.assertEqual(self.call("GET", "/v1/models"), (200, b"another surface"))
        self.assertEqual(self.call("GET", "/v1/filesystem"), (200, b"another surface"))


class PostgresSurfaceTests(PostgresStore, SurfaceTests):
    pass
