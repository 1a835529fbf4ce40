"""
The Ollama-protocol registry client against an in-memory distribution
server (a twisted.web resource driven through treq's in-memory agent): the
part planner, the resume bookkeeping, Ollama's progress lines, redirects,
stalled parts, a wrong digest refused, the disk checked first, pushes.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from treq.client import HTTPClient
from treq.testing import RequestTraversalAgent
from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IBodyProducer
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from blazar.models import ollama_store as store
from blazar.models.hub import PullError
from blazar.models.ollama_registry import (
    Part,
    RegistryClient,
    plan_parts,
    thd_discard_download,
    thd_finish_download,
    thd_open_download,
    thd_partial_bytes,
    thd_write_part,
)
from blazar.models.ollama_store import DigestMismatch, blob_path, layer, make_manifest, parse_name, partial_path
from blazar.testing import fake_process_reactor
from tests.typed import not_none


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@implementer(IBodyProducer)
class BytesBody:
    """
    A request body written at once (treq's default producer would wait
    for the global reactor's cooperator).
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.length = len(data)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(self.data)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def body_producer(data: Any) -> IBodyProducer:
    return data if IBodyProducer.providedBy(data) else BytesBody(data)


class PlanTests(SynchronousTestCase):
    def test_parts(self) -> None:
        def shape(total: int, parts: int = 4, least: int = 100) -> list[tuple[int, int]]:
            return [(p.offset, p.size) for p in plan_parts(total, parts, least)]

        self.assertEqual(shape(0), [])
        self.assertEqual(shape(99), [(0, 99)])
        self.assertEqual(shape(250), [(0, 125), (125, 125)])
        self.assertEqual(shape(1000), [(0, 250), (250, 250), (500, 250), (750, 250)])
        self.assertEqual(shape(1003), [(0, 250), (250, 250), (500, 250), (750, 253)])
        self.assertEqual(shape(10**6, parts=4), [(i * 250000, 250000) for i in range(4)])
        self.assertEqual(len(plan_parts(256 << 20)), 4)
        self.assertEqual(len(plan_parts(100 << 20)), 1)
        self.assertEqual([p.n for p in plan_parts(1000, 4, 100)], [0, 1, 2, 3])


class BookkeepingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp())
        self.data = bytes(range(256)) * 4
        self.digest = sha(self.data)

    def open(self) -> list[Part]:
        return thd_open_download(self.root, self.digest, len(self.data), lambda n: plan_parts(n, 4, 100))

    def test_started_reserved_and_recorded_as_ollama_does(self) -> None:
        parts = self.open()
        self.assertEqual(partial_path(self.root, self.digest).stat().st_size, 1024)
        record = json.loads(Path(f"{partial_path(self.root, self.digest)}-2").read_bytes())
        self.assertEqual(record, {"N": 2, "Offset": 512, "Size": 256, "Completed": 0})
        self.assertEqual([p.completed for p in parts], [0, 0, 0, 0])

    def test_resumed_where_each_part_got_to(self) -> None:
        parts = self.open()
        thd_write_part(self.root, self.digest, parts[1], 256, self.data[256:300], 44)
        thd_write_part(self.root, self.digest, parts[3], 768, self.data[768:], 256)
        again = self.open()
        self.assertEqual([p.completed for p in again], [0, 44, 0, 256])
        self.assertEqual(thd_partial_bytes(self.root, self.digest, 1024), 300)

    def test_inconsistent_bookkeeping_starts_over(self) -> None:
        parts = self.open()
        thd_write_part(self.root, self.digest, parts[0], 0, self.data[:10], 10)
        Path(f"{partial_path(self.root, self.digest)}-2").write_text("{broken")
        self.assertEqual([p.completed for p in self.open()], [0, 0, 0, 0])
        thd_write_part(self.root, self.digest, parts[0], 0, self.data[:10], 10)
        partial_path(self.root, self.digest).write_bytes(b"short")
        self.assertEqual([p.completed for p in self.open()], [0, 0, 0, 0])
        # a different plan's parts (another size) are not this download's
        self.assertEqual(thd_partial_bytes(self.root, self.digest, 2048), 0)

    def test_finished_only_when_the_digest_matches(self) -> None:
        parts = self.open()
        for p in parts:
            thd_write_part(self.root, self.digest, p, p.offset, self.data[p.offset : p.offset + p.size], p.size)
        path = thd_finish_download(self.root, self.digest)
        self.assertEqual(path.read_bytes(), self.data)
        self.assertEqual(sorted(f.name for f in (self.root / "blobs").iterdir()), [path.name])

    def test_a_wrong_digest_is_discarded(self) -> None:
        parts = self.open()
        for p in parts:
            thd_write_part(self.root, self.digest, p, p.offset, b"x" * p.size, p.size)
        with self.assertRaises(DigestMismatch):
            thd_finish_download(self.root, self.digest)
        self.assertEqual(list((self.root / "blobs").iterdir()), [])

    def test_a_part_record_cut_off_before_its_rename_keeps_the_resume(self) -> None:
        parts = self.open()
        thd_write_part(self.root, self.digest, parts[1], 256, self.data[256:300], 44)
        record = Path(f"{partial_path(self.root, self.digest)}-1")
        # killed between writing a record's temporary file and renaming it
        # (the name an older version gave it, and the one it has now)
        record.with_name(record.name + ".tmp").write_bytes(b'{"N": 1, "Off')
        record.with_name(f".{record.name}.tmp").write_bytes(b'{"N": 1, "Off')
        self.assertEqual([p.completed for p in self.open()], [0, 44, 0, 0])
        self.assertEqual(thd_partial_bytes(self.root, self.digest, 1024), 44)
        thd_discard_download(self.root, self.digest)  # and a discard takes them all
        self.assertEqual(list((self.root / "blobs").iterdir()), [])


class MemoryRegistry(Resource):
    """
    A Docker Registry v2 in memory: manifests and blobs by repository,
    Range requests, uploads; counts the blob bytes it serves, and can
    redirect blob reads to a "CDN" path, stall a blob after some bytes,
    ask for a token (a new C{token} expires the one given before), or
    refuse a blob's next reads.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.uploads: dict[str, bytes] = {}
        self.served = 0
        self.requests: list[tuple[str, str]] = []
        self.redirect = False
        self.stall_after: int | None = None  # bytes of the next blob response, then silence
        self.stalled: list[Request] = []
        self.token: str | None = None
        self.ignore_range = False
        self.refuse: dict[str, int] = {}  # blob digest: how many more of its reads answer 403
        self.authorizations: list[tuple[str, str | None]] = []  # (Host, Authorization) of each request

    def put_model(self, repository: str, tag: str, layers: dict[str, bytes]) -> bytes:
        descriptors = []
        for media, data in layers.items():
            self.blobs[sha(data)] = data
            descriptors.append(layer(media, sha(data), len(data)))
        config = b'{"model_format":"gguf"}'
        self.blobs[sha(config)] = config
        raw = store.manifest_bytes(make_manifest(layer(store.MEDIA_CONFIG, sha(config), len(config)), descriptors))
        self.manifests[(repository, tag)] = raw
        return raw

    def render(self, request: Request) -> bytes | int:
        method = request.method.decode()
        path = request.path.decode()
        self.requests.append((method, path))
        self.authorizations.append((request.getHeader("host") or "", request.getHeader("authorization")))
        if path == "/token":
            return json.dumps({"token": self.token}).encode()
        if self.token is not None and request.getHeader("authorization") != f"Bearer {self.token}":
            request.setResponseCode(401)
            request.setHeader(
                "www-authenticate", 'Bearer realm="http://registry.test/token",service="test",scope="repository:x:pull"'
            )
            return b'{"errors":[{"code":"UNAUTHORIZED"}]}'
        if m := re.fullmatch(r"/cdn/(sha256:[0-9a-f]{64})", path):
            return self._blob(request, m[1])
        m = re.fullmatch(r"/v2/(?P<repo>[^/]+/[^/]+)/(?P<kind>manifests|blobs)/(?P<ref>[^/]+)", path)
        if m and m["kind"] == "manifests" and method == "GET":
            raw = self.manifests.get((m["repo"], m["ref"]))
            if raw is None:
                request.setResponseCode(404)
                return b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}'
            request.setHeader("content-type", store.MEDIA_MANIFEST)
            return raw
        if m and m["kind"] == "manifests" and method == "PUT":
            self.manifests[(m["repo"], m["ref"])] = not_none(request.content).read()
            request.setResponseCode(201)
            return b""
        if m and m["kind"] == "blobs" and method == "HEAD":
            request.setResponseCode(200 if m["ref"] in self.blobs else 404)
            return b""
        if m and m["kind"] == "blobs" and method == "GET":
            if self.redirect:
                request.setResponseCode(307)
                request.setHeader("location", f"http://cdn.test/cdn/{m['ref']}")
                return b""
            return self._blob(request, m["ref"])
        if re.fullmatch(r"/v2/[^/]+/[^/]+/blobs/uploads/", path) and method == "POST":
            upload = f"u{len(self.uploads)}"
            self.uploads[upload] = b""
            request.setResponseCode(202)
            request.setHeader("location", f"/v2/upload/{upload}?state=x")
            return b""
        if m2 := re.fullmatch(r"/v2/upload/(u\d+)", path):
            data = not_none(request.content).read()
            digest = request.args[b"digest"][0].decode()
            if sha(data) != digest:
                request.setResponseCode(400)
                return b'{"errors":[{"code":"DIGEST_INVALID"}]}'
            self.blobs[digest] = data
            del self.uploads[m2[1]]
            request.setResponseCode(201)
            return b""
        request.setResponseCode(404)
        return b"{}"

    def _blob(self, request: Request, digest: str) -> bytes | int:
        if self.refuse.get(digest):
            self.refuse[digest] -= 1
            request.setResponseCode(403)
            return b'{"errors":[{"code":"DENIED"}]}'
        data = self.blobs.get(digest)
        if data is None:
            request.setResponseCode(404)
            return b'{"errors":[{"code":"BLOB_UNKNOWN"}]}'
        wanted = request.getHeader("range")
        start, end = 0, len(data) - 1
        if wanted and not self.ignore_range:
            a, b = not_none(re.fullmatch(r"bytes=(\d+)-(\d+)", wanted)).groups()
            start, end = int(a), int(b)
            request.setResponseCode(206)
            request.setHeader("content-range", f"bytes {start}-{end}/{len(data)}")
        body = data[start : end + 1]
        if self.stall_after is not None:
            request.setHeader("content-length", str(len(body)))
            sent = body[: self.stall_after]
            self.stall_after = None
            self.served += len(sent)
            request.write(sent)
            self.stalled.append(request)
            return NOT_DONE_YET
        self.served += len(body)
        return body


class RegistryCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = Path(self.mktemp())
        self.reactor = fake_process_reactor()
        self.server = MemoryRegistry()
        self.agent = RequestTraversalAgent(self.server)
        http = HTTPClient(self.agent, data_to_body_producer=body_producer)
        self.client = RegistryClient(self.reactor, "http://registry.test", http=http, min_part=1000, stall=30.0)
        self.weights = bytes(range(256)) * 20  # 5120 bytes: 4 parts of 1280
        self.server.put_model(
            "library/tiny",
            "latest",
            {
                store.MEDIA_MODEL: self.weights,
                store.MEDIA_SYSTEM: b"Be brief.",
            },
        )
        self.lines: list[dict[str, Any]] = []

    def drive(self, d: Deferred[Any]) -> Any:
        for _ in range(2000):
            if d.called:
                break
            self.agent.flush()
            self.reactor.advance(0.5)
        return d

    def pull(self, name: str = "tiny") -> Deferred[Any]:
        return self.drive(ensureDeferred(self.client.pull(parse_name(name), self.root, self.lines.append)))


class PullTests(RegistryCase):
    def test_progress_lines_are_ollamas(self) -> None:
        files = self.successResultOf(self.pull())
        self.assertEqual(len(files), 3)
        statuses = [line["status"] for line in self.lines]
        self.assertEqual(statuses[0], "pulling manifest")
        self.assertEqual(statuses[-3:], ["verifying sha256 digest", "writing manifest", "success"])
        self.assertEqual({k for line in self.lines for k in line}, {"status", "digest", "total", "completed"})
        weights = sha(self.weights)
        mine = [line for line in self.lines if line.get("digest") == weights]
        self.assertEqual(
            mine[0], {"status": f"pulling {weights[7:19]}", "digest": weights, "total": 5120, "completed": 0}
        )
        self.assertEqual(mine[-1]["completed"], 5120)
        self.assertEqual([line["completed"] for line in mine], sorted(line["completed"] for line in mine))
        self.assertEqual(self.server.served, 5120 + len(b"Be brief.") + len(b'{"model_format":"gguf"}'))
        # four ranged requests for the weights
        self.assertEqual(sum(1 for r in self.server.requests if r == ("GET", f"/v2/library/tiny/blobs/{weights}")), 4)

    def test_stored_as_ollama_stores_it(self) -> None:
        self.successResultOf(self.pull())
        raw = self.server.manifests[("library/tiny", "latest")]
        path = self.root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
        self.assertEqual(path.read_bytes(), raw)
        (model,) = store.thd_models(self.root)
        self.assertEqual((model.name.display, model.system, model.digest), ("tiny:latest", "Be brief.", sha(raw)))
        self.assertEqual(model.model.read_bytes(), self.weights)
        self.assertEqual(
            sorted(p.name for p in (self.root / "blobs").iterdir()),
            sorted(blob_path(self.root, d).name for d in self.server.blobs),
        )

    def test_a_second_pull_fetches_nothing(self) -> None:
        self.successResultOf(self.pull())
        served = self.server.served
        self.lines.clear()
        self.successResultOf(self.pull())
        self.assertEqual(self.server.served, served)
        self.assertTrue(all(line.get("completed") == line.get("total") for line in self.lines if "digest" in line))

    def test_redirects_to_a_cdn_are_followed(self) -> None:
        self.server.redirect = True
        self.successResultOf(self.pull())
        self.assertIn(("GET", f"/cdn/{sha(self.weights)}"), self.server.requests)

    def test_a_server_ignoring_range_still_gives_each_part_its_bytes(self) -> None:
        self.server.ignore_range = True
        self.successResultOf(self.pull())
        (model,) = store.thd_models(self.root)
        self.assertEqual(model.model.read_bytes(), self.weights)

    def test_a_stalled_part_is_asked_again_from_where_it_stopped(self) -> None:
        self.server.stall_after = 100  # the first blob request: the weights' first part
        self.successResultOf(self.pull())
        self.assertEqual(store.thd_models(self.root)[0].model.read_bytes(), self.weights)
        served = len(self.weights) + len(b"Be brief.") + len(b'{"model_format":"gguf"}')
        self.assertEqual(self.server.served, served)  # nothing fetched twice
        gets = [r for r in self.server.requests if r == ("GET", f"/v2/library/tiny/blobs/{sha(self.weights)}")]
        self.assertEqual(len(gets), 5)  # four parts, one asked again

    def test_a_pull_resumes_the_parts_a_stopped_one_left(self) -> None:
        digest = sha(self.weights)
        parts = thd_open_download(self.root, digest, len(self.weights), lambda n: plan_parts(n, 4, 1000))
        thd_write_part(self.root, digest, parts[0], 0, self.weights[:1280], 1280)
        thd_write_part(self.root, digest, parts[2], 2560, self.weights[2560:3000], 440)
        self.successResultOf(self.pull())
        self.assertEqual(self.server.served, 5120 - 1280 - 440 + len(b"Be brief.") + len(b'{"model_format":"gguf"}'))
        first = [line for line in self.lines if line.get("digest") == digest][0]
        self.assertEqual(first["completed"], 1720)
        self.assertEqual(store.thd_models(self.root)[0].model.read_bytes(), self.weights)

    def test_a_blob_with_a_wrong_digest_is_refused_and_nothing_named(self) -> None:
        self.server.blobs[sha(self.weights)] = b"z" * 5120
        failure = self.failureResultOf(self.pull(), PullError)
        self.assertEqual(failure.value.status, 502)
        self.assertIn("not its digest", str(failure.value))
        self.assertEqual(store.thd_list(self.root), [])
        self.assertFalse(blob_path(self.root, sha(self.weights)).exists())
        self.assertFalse(any("partial" in p.name for p in (self.root / "blobs").iterdir()))
        self.assertNotIn("success", [line["status"] for line in self.lines])

    def test_a_delete_during_a_pull_leaves_the_blobs_it_skipped(self) -> None:
        self.successResultOf(self.pull())
        self.server.put_model("library/two", "latest", {store.MEDIA_MODEL: self.weights, store.MEDIA_SYSTEM: b"Hi."})
        self.server.stall_after = 1  # its first blob read: its own system prompt (the weights are there)
        d = ensureDeferred(self.client.pull(parse_name("two"), self.root, self.lines.append))
        for _ in range(10):  # until it has found the weights there and waits for its system prompt
            if self.server.stalled:
                break
            self.agent.flush()
        self.assertTrue(self.server.stalled)
        self.assertEqual(store.thd_delete_manifest(self.root, parse_name("tiny")), [sha(b"Be brief.")])
        self.drive(d)
        self.successResultOf(d)
        (model,) = store.thd_models(self.root)
        self.assertEqual((model.name.display, model.model.read_bytes()), ("two:latest", self.weights))

    def test_unknown_model(self) -> None:
        failure = self.failureResultOf(self.pull("nope:1"), PullError)
        self.assertEqual(failure.value.status, 404)
        self.assertIn("file does not exist", str(failure.value))
        self.assertEqual(self.lines, [{"status": "pulling manifest"}])

    def test_the_disk_is_checked_before_any_blob(self) -> None:
        manifest = json.loads(self.server.manifests[("library/tiny", "latest")])
        manifest["layers"][0]["size"] = 1 << 60
        self.server.manifests[("library/tiny", "latest")] = store.manifest_bytes(manifest)
        failure = self.failureResultOf(self.pull(), PullError)
        self.assertEqual(failure.value.status, 507)
        self.assertIn("not enough disk space", str(failure.value))
        self.assertEqual([r for r in self.server.requests if "/blobs/" in r[1]], [])
        self.assertEqual(list((self.root / "blobs").iterdir()), [])

    def test_a_name_with_a_host_goes_to_that_host(self) -> None:
        self.assertEqual(self.client.base_url(parse_name("tiny")), "http://registry.test")
        self.assertEqual(self.client.base_url(parse_name("me/tiny")), "http://registry.test")
        self.assertEqual(self.client.base_url(parse_name("registry.test/me/tiny")), "http://registry.test")
        self.assertEqual(self.client.base_url(parse_name("other.test:5000/me/tiny")), "https://other.test:5000")
        self.assertEqual(self.client.base_url(parse_name("other.test/me/tiny"), insecure=True), "http://other.test")

    def test_anonymous_token(self) -> None:
        self.server.token = "t0k"
        self.successResultOf(self.pull())
        self.assertEqual(
            self.server.requests[:3],
            [
                ("GET", "/v2/library/tiny/manifests/latest"),
                ("GET", "/token"),
                ("GET", "/v2/library/tiny/manifests/latest"),
            ],
        )

    def test_an_expired_token_is_replaced(self) -> None:
        self.server.token = "t0k"
        self.successResultOf(self.pull())
        self.server.token = "t1k"  # the registry's tokens expire: "t0k" is refused from now on
        self.server.put_model("library/other", "latest", {store.MEDIA_MODEL: b"other weights"})
        self.server.requests.clear()
        self.successResultOf(self.pull("other"))
        self.assertEqual(
            self.server.requests[:3],
            [
                ("GET", "/v2/library/other/manifests/latest"),
                ("GET", "/token"),
                ("GET", "/v2/library/other/manifests/latest"),
            ],
        )
        # a pull of the first repository again uses the new token too
        self.server.requests.clear()
        self.successResultOf(self.pull())
        self.assertEqual(self.server.requests.count(("GET", "/token")), 1)

    def test_a_token_goes_only_to_the_registry_that_gave_it(self) -> None:
        self.server.token = "t0k"
        self.successResultOf(self.pull())
        self.server.authorizations.clear()
        self.drive(
            ensureDeferred(
                self.client.pull(parse_name("other.test/library/tiny"), self.root, self.lines.append, insecure=True)
            )
        )
        (first, *_) = self.server.authorizations
        self.assertEqual(first, ("other.test", None))


class QueuedPool:
    """
    A thread pool whose work waits until L{run} (so that pulls interleave
    at each thread hop, as they do with real threads).
    """

    def __init__(self) -> None:
        self.queue: list[tuple[Any, Any, tuple[Any, ...]]] = []

    def callInThreadWithCallback(self, on_result: Any, f: Any, *args: Any) -> None:
        self.queue.append((on_result, f, args))

    def run(self) -> None:
        while self.queue:
            on_result, f, args = self.queue.pop(0)
            try:
                result = f(*args)
            except BaseException:
                on_result(False, Failure())
            else:
                on_result(True, result)


class ConcurrentPullTests(RegistryCase):
    def setUp(self) -> None:
        super().setUp()
        self.pool = QueuedPool()
        self.reactor._pool = self.pool

    def test_pulls_of_one_blob_wait_for_each_other_even_when_one_fails(self) -> None:
        # the system prompt's blob is refused once: the pull that fetches it first fails
        self.server.refuse[sha(b"Be brief.")] = 1
        pulls = [ensureDeferred(self.client.pull(parse_name("tiny"), self.root, self.lines.append)) for _ in range(3)]
        for _ in range(2000):
            if all(d.called for d in pulls):
                break
            self.agent.flush()
            self.pool.run()
            self.reactor.advance(0.5)
        outcomes = []
        for d in pulls:
            self.assertTrue(d.called, "a pull waiting for another's blob never ended")
            outcomes.append("ok" if d.result is not None and not isinstance(d.result, Failure) else "failed")
            d.addErrback(lambda f: f.trap(PullError))
        self.assertEqual(sorted(outcomes), ["failed", "ok", "ok"])
        self.assertEqual(self.client.pulls, {})
        # each blob was fetched once
        self.assertEqual(self.server.served, 5120 + len(b"Be brief.") + len(b'{"model_format":"gguf"}'))
        self.assertEqual(store.thd_models(self.root)[0].model.read_bytes(), self.weights)


class PushTests(RegistryCase):
    def setUp(self) -> None:
        super().setUp()
        self.successResultOf(self.pull())
        self.manifest = self.server.manifests[("library/tiny", "latest")]
        self.blobs = dict(self.server.blobs)
        self.server.blobs.clear()
        self.server.manifests.clear()
        self.lines.clear()

    def push(self, name: str) -> Deferred[Any]:
        return self.drive(ensureDeferred(self.client.push(parse_name(name), self.root, self.lines.append)))

    def test_pushed_with_ollamas_progress(self) -> None:
        store.thd_copy_manifest(self.root, parse_name("tiny"), parse_name("me/tiny:v1"))
        self.successResultOf(self.push("me/tiny:v1"))
        self.assertEqual(self.server.manifests, {("me/tiny", "v1"): self.manifest})
        self.assertEqual(self.server.blobs, self.blobs)
        statuses = [line["status"] for line in self.lines]
        self.assertEqual(statuses[0], "retrieving manifest")
        self.assertEqual(statuses[-2:], ["pushing manifest", "success"])
        weights = sha(self.weights)
        mine = [line for line in self.lines if line.get("digest") == weights]
        self.assertEqual(
            mine[0], {"status": f"pushing {weights[7:19]}", "digest": weights, "total": 5120, "completed": 0}
        )
        self.assertEqual(mine[-1]["completed"], 5120)

    def test_blobs_there_already_are_skipped(self) -> None:
        self.server.blobs.update(self.blobs)
        self.successResultOf(self.push("tiny"))
        self.assertFalse(any(m == "POST" for m, _ in self.server.requests))
        self.assertEqual(self.server.manifests, {("library/tiny", "latest"): self.manifest})

    def test_a_model_not_in_the_store(self) -> None:
        failure = self.failureResultOf(self.push("me/none"), PullError)
        self.assertEqual(failure.value.status, 404)
