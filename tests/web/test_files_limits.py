"""
The Files and Batch APIs under the per-key limits (issue 36, item 8):
C{rpm} and C{max_concurrent} on every one of their routes, the per-key
storage quota (C{file_bytes}, C{max_file_bytes_per_key}) on uploads, and a
download streamed in pieces. Through C{StubTreq} behind the real auth gate
and quotas, with the runner on a real store (SQLite, and PostgreSQL for the storage tests).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from blazar import store
from blazar.config import Config, KeyConfig
from blazar.gateway.batch import BatchRunner
from blazar.gateway.quota import Quotas
from blazar.httpbody import multipart_body
from blazar.web import download
from blazar.web.auth import AuthGate, KeyHolder
from blazar.web.batches import BatchSurface
from blazar.web.root import SurfaceRouter
from tests.postgres import PostgresStore, SQLiteStore, StoreMixin
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


class Gateway:
    """
    The Batch API surface behind the auth gate and the quotas, on a real
    store: the case's (a L{tests.postgres.StoreMixin}: SQLite or PostgreSQL).
    """

    def __init__(
        self, case: SynchronousTestCase, keys: tuple[KeyConfig, ...], max_file_bytes: int = 1 << 30, host: str = "x"
    ) -> None:
        self.case = case
        self.host = host
        assert isinstance(case, StoreMixin)
        self.db = case.open_store()
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.in_thread_calls = 0

        def in_thread(f: Any, *args: Any) -> Deferred[Any]:
            self.in_thread_calls += 1
            return maybeDeferred(f, *args)

        def send(key: str, endpoint: str, body: bytes, trace: str) -> Deferred[Any]:
            return Deferred()

        self.runner = BatchRunner(
            self.clock,
            lambda f, *args: maybeDeferred(f, self.db, *args),
            in_thread,
            send,
            lambda: 4,
            lambda: max_file_bytes,
        )
        other = Elsewhere()
        surface = BatchSurface(self.runner, in_thread)
        router = SurfaceRouter(other, other, other, batches=surface.app.resource())
        self.quotas = Quotas(self.clock, wall=self.clock.seconds)
        self.client = StubTreq(AuthGate(router, KeyHolder(Config(keys=keys)), self.quotas))

    def response(self, method: str, path: str, secret: str | None = ALICE, **kwargs: Any) -> Any:
        headers = {**({"authorization": f"Bearer {secret}"} if secret else {}), **kwargs.pop("headers", {})}
        return self.case.successResultOf(
            self.client.request(method, f"http://{self.host}" + path, headers=headers, **kwargs)
        )

    def call(self, method: str, path: str, secret: str | None = ALICE, **kwargs: Any) -> tuple[int, Any]:
        response = self.response(method, path, secret, **kwargs)
        body = self.case.successResultOf(response.content())
        try:
            return response.code, json.loads(body)
        except ValueError:
            return response.code, body

    def upload(self, content: bytes = LINE, secret: str | None = ALICE) -> tuple[int, Any]:
        raw, content_type = multipart_body({"purpose": "batch"}, [("file", "in.jsonl", "application/jsonl", content)])
        return self.call("POST", "/v1/files", secret, data=raw, headers={"content-type": content_type})


class RateLimitTests(SQLiteStore, SynchronousTestCase):
    def routes(self, gateway: Gateway) -> list[tuple[str, str, dict[str, Any]]]:
        _, made = gateway.upload()
        gateway.clock.advance(60)
        raw, content_type = multipart_body({"purpose": "batch"}, [("file", "in.jsonl", "application/jsonl", LINE)])
        return [
            ("POST", "/v1/files", {"data": raw, "headers": {"content-type": content_type}}),
            ("GET", "/v1/files", {}),
            ("GET", f"/v1/files/{made['id']}", {}),
            ("GET", f"/v1/files/{made['id']}/content", {}),
            ("DELETE", "/v1/files/file-nope", {}),
            (
                "POST",
                "/v1/batches",
                {"json": {"input_file_id": made["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}},
            ),
            ("GET", "/v1/batches", {}),
            ("GET", "/v1/batches/batch_nope", {}),
            ("POST", "/v1/batches/batch_nope/cancel", {}),
        ]

    def test_rpm_holds_on_every_files_and_batches_route(self) -> None:
        gateway = Gateway(self, (KeyConfig("alice", ALICE, rpm=1), KeyConfig("bob", BOB)))
        for method, path, kwargs in self.routes(gateway):
            self.assertNotEqual(gateway.call("GET", "/v1/files")[0], 429)  # the minute's one request
            response = gateway.response(method, path, **kwargs)
            error = json.loads(self.successResultOf(response.content()))
            self.assertEqual(
                (response.code, error["error"]["code"], error["error"]["type"]),
                (429, "rate_limit_exceeded", "rate_limit_error"),
                path,
            )
            self.assertIn("rpm", error["error"]["message"])
            self.assertEqual(response.headers.getRawHeaders("retry-after"), ["60"], path)
            self.assertEqual(gateway.call("GET", "/v1/files", BOB)[0], 200)  # bob has his own window
            gateway.clock.advance(60)
            status, _ = gateway.call(method, path, **kwargs)
            self.assertNotEqual(status, 429, path)  # a new minute
            gateway.clock.advance(60)

    def test_the_fourth_request_in_a_minute_of_a_key_with_rpm_3(self) -> None:
        gateway = Gateway(self, (KeyConfig("alice", ALICE, rpm=3),))
        self.assertEqual(gateway.upload()[0], 200)
        self.assertEqual(gateway.call("GET", "/v1/files")[0], 200)
        gateway.clock.advance(30)
        self.assertEqual(gateway.call("GET", "/v1/batches")[0], 200)
        status, error = gateway.call("GET", "/v1/files")
        self.assertEqual((status, error["error"]["code"]), (429, "rate_limit_exceeded"))

    def test_token_limits_do_not_keep_a_key_from_its_files(self) -> None:
        key = KeyConfig("alice", ALICE, tpm=10, daily_tokens=10)
        gateway = Gateway(self, (key,))
        gateway.quotas.record(key, 1000)  # its tokens are spent: chats get 429; its batch output is still its own
        self.assertEqual(gateway.upload()[0], 200)
        self.assertEqual(gateway.call("GET", "/v1/files")[0], 200)

    def test_max_concurrent_holds_on_the_files_routes(self) -> None:
        key = KeyConfig("alice", ALICE, max_concurrent=1)
        gateway = Gateway(self, (key,))
        gateway.quotas.lease(key)  # one request of alice's is running
        response = gateway.response("GET", "/v1/files")
        error = json.loads(self.successResultOf(response.content()))
        self.assertEqual((response.code, error["error"]["code"]), (429, "rate_limit_exceeded"))
        self.assertIn("max_concurrent", error["error"]["message"])
        self.assertEqual(response.headers.getRawHeaders("retry-after"), ["1"])
        gateway.quotas.release(key)
        self.assertEqual(gateway.call("GET", "/v1/files")[0], 200)
        self.assertEqual(gateway.quotas.active("alice"), 0)


class StorageQuotaTests(SQLiteStore, SynchronousTestCase):
    def test_an_upload_past_the_keys_quota_is_refused_until_a_delete(self) -> None:
        gateway = Gateway(
            self,
            (KeyConfig("alice", ALICE, file_bytes=2 * len(LINE), id="k1"), KeyConfig("bob", BOB)),
            max_file_bytes=len(LINE),
        )
        _, first = gateway.upload()
        self.assertEqual(gateway.upload()[0], 200)
        status, error = gateway.upload()
        self.assertEqual(
            (status, error["error"]["code"], error["error"]["param"], error["error"]["type"]),
            (413, "storage_quota_exceeded", "file", "invalid_request_error"),
        )
        message = error["error"]["message"]
        for words in (
            "key 'alice'",
            f"{2 * len(LINE)} bytes",
            "max_file_bytes_per_key",
            "file_bytes",
            "DELETE /v1/files/",
        ):
            self.assertIn(words, message)
        self.assertEqual(len(gateway.call("GET", "/v1/files")[1]["data"]), 2)  # nothing was stored
        # bob's quota is the config's, and his own
        self.assertEqual(gateway.upload(secret=BOB)[0], 200)
        self.assertEqual(gateway.upload(secret=BOB)[0], 413)
        self.assertEqual(gateway.call("DELETE", f"/v1/files/{first['id']}")[0], 200)
        self.assertEqual(gateway.upload()[0], 200)

    def test_without_keys_the_one_owner_has_the_quota(self) -> None:
        gateway = Gateway(self, (), max_file_bytes=len(LINE), host="127.0.0.1")
        self.assertEqual(gateway.upload(secret=None)[0], 200)
        status, error = gateway.upload(secret=None)
        self.assertEqual((status, error["error"]["code"]), (413, "storage_quota_exceeded"))
        self.assertIn("max_file_bytes_per_key", error["error"]["message"])
        self.assertNotIn("[[keys]]", error["error"]["message"])


class DownloadTests(SQLiteStore, SynchronousTestCase):
    def test_a_download_is_sent_in_pieces_read_in_threads(self) -> None:
        gateway = Gateway(self, (KeyConfig("alice", ALICE),))
        content = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and a bit
        self.patch(download, "PIECE", 4096)
        _, made = gateway.upload(content)
        before = gateway.in_thread_calls
        response = gateway.response("GET", f"/v1/files/{made['id']}/content")
        self.assertEqual(response.code, 200)
        self.assertEqual(response.length, len(content))  # (its Content-Length)
        self.assertEqual(self.successResultOf(response.content()), content)
        # one thread call per 64 KiB piece (and the close), not one whole read
        self.assertGreaterEqual(gateway.in_thread_calls - before, len(content) // download.PIECE)

    def test_a_file_deleted_while_it_downloads_is_still_sent_whole(self) -> None:
        gateway = Gateway(self, (KeyConfig("alice", ALICE),))
        _, made = gateway.upload(b"x" * 100_000)
        size, handle = self.successResultOf(gateway.runner.open_content("alice", made["id"]))
        self.assertEqual(gateway.call("DELETE", f"/v1/files/{made['id']}")[0], 200)
        self.assertIsNone(store.thd_file(gateway.db, made["id"], None))
        if not store.is_postgres(gateway.db):
            self.assertFalse((store.files_dir(gateway.db) / made["id"]).exists())
        with handle:
            self.assertEqual((size, handle.read()), (100_000, b"x" * 100_000))


class PostgresStorageQuotaTests(PostgresStore, StorageQuotaTests):
    pass


class PostgresDownloadTests(PostgresStore, DownloadTests):
    pass
