"""
The semantic cache step of the pipeline (L{blazar.gateway.pipeline.Pipeline._cached})
and its live state (L{blazar.gateway.cachestore.CacheStore}), through the
real surfaces, pipeline and registry in memory (StubTreq), with a fake
engine that answers chat and embeddings, and the real SQLite rows.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any, cast

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.task import Clock
from twisted.python.threadpool import ThreadPool
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from blazar import store
from blazar.config import CacheConfig, KeyConfig, LiveConfig, parse_config
from blazar.gateway.cache import Vector, normalized
from blazar.gateway.cachestore import CacheStore
from blazar.metrics import Metrics
from blazar.testing import FakeSupervisor, SynchronousThreadPool
from blazar.web.client import context_of
from blazar.web.observe import RequestObserver
from tests.typed import StubTreq
from tests.web.gateway import MemoryGateway

CONFIG = '[models."e"]\nembedding = true\n[cache]\nenabled = true\nembedding_model = "e"\nttl_secs = 60\n'


def bag_of_words(text: str) -> list[float]:
    """
    A stand-in embedding: each word counted in one of 32 dimensions, so
    prompts with the same words are the same vector and prompts with no
    word in common are nearly orthogonal.
    """
    vector = [0.0] * 32
    for word in text.lower().replace("?", " ").split():
        vector[zlib.crc32(word.encode()) % 32] += 1.0
    return vector


def unit(*values: float) -> Vector:
    vector = normalized(values)
    assert vector is not None
    return vector


def cache_engine() -> Any:
    """
    A llama-server stand-in for chat and embeddings. C{app.requests}
    records C{(path, body)}; C{app.embed_status} answers embeddings with
    that status instead (C{app.chat_status} chats); C{app.finish} is the chat
    answer's finish reason.
    """
    from klein import Klein

    app: Any = Klein()  # and the recorder's fields below
    app.requests = []
    app.embed_status = 200
    app.finish = "stop"
    app.answers = 0
    app.chat_status = 200

    @app.route("/v1/embeddings", methods=["POST"])
    def embeddings(request: Any) -> bytes:
        body = json.loads(request.content.read())
        app.requests.append(("/v1/embeddings", body))
        request.setHeader(b"content-type", b"application/json")
        if app.embed_status != 200:
            request.setResponseCode(app.embed_status)
            return json.dumps(
                {"error": {"code": app.embed_status, "message": "no embeddings here", "type": "server_error"}}
            ).encode()
        return json.dumps(
            {
                "object": "list",
                "model": body["model"],
                "data": [{"object": "embedding", "index": 0, "embedding": bag_of_words(body["input"])}],
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            }
        ).encode()

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat(request: Any) -> bytes:
        body = json.loads(request.content.read())
        app.requests.append(("/v1/chat/completions", body))
        app.answers += 1
        if app.chat_status != 200:
            request.setResponseCode(app.chat_status)
            request.setHeader(b"content-type", b"application/json")
            return json.dumps({"error": {"code": app.chat_status, "message": "no", "type": "server_error"}}).encode()
        if body.get("stream"):
            request.setHeader(b"content-type", b"text/event-stream")
            meta = {
                "created": 1,
                "id": f"chatcmpl-s{app.answers}",
                "model": "m:latest",
                "object": "chat.completion.chunk",
            }
            chunks = [
                {
                    **meta,
                    "choices": [
                        {"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": "streamed "}}
                    ],
                },
                {**meta, "choices": [{"finish_reason": None, "index": 0, "delta": {"content": f"{app.answers}"}}]},
                {**meta, "choices": [{"finish_reason": app.finish, "index": 0, "delta": {}}]},
            ]
            if (body.get("stream_options") or {}).get("include_usage"):
                chunks.append(
                    {**meta, "choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 6, "total_tokens": 8}}
                )
            return (
                b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks)
                + b"data: [DONE]\n\n"
            )
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "choices": [
                    {
                        "finish_reason": app.finish,
                        "index": 0,
                        "message": {"role": "assistant", "content": f"answer {app.answers}"},
                    }
                ],
                "created": 1,
                "id": f"chatcmpl-{app.answers}",
                "model": "m:latest",
                "object": "chat.completion",
                "usage": {"completion_tokens": 5, "prompt_tokens": 7, "total_tokens": 12},
            },
            separators=(",", ":"),
        ).encode()  # compact, as llama-server's

    @app.route("/apply-template", methods=["POST"])
    def apply_template(request: Any) -> bytes:
        body = json.loads(request.content.read())
        app.requests.append(("/apply-template", body))
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"prompt": "".join(str(m.get("content")) for m in body["messages"])}).encode()

    @app.route("/completion", methods=["POST"])
    def completion(request: Any) -> bytes:
        # a JSON answer (blazar.gateway.jsonanswer), not streamed here
        body = json.loads(request.content.read())
        app.requests.append(("/completion", body))
        app.answers += 1
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "content": json.dumps({"answer": app.answers}),
                "stop": True,
                "stop_type": "eos",
                "tokens_predicted": 5,
                "tokens_evaluated": 7,
            }
        ).encode()

    return app


class Door(Resource):
    """
    As the site's auth gate: the request comes in with C{key}, and its
    usage is recorded in C{used} (a key with token limits).
    """

    isLeaf = True

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner
        self.key: KeyConfig | None = None
        self.used: list[int] = []

    def render(self, request: Any) -> Any:
        context_of(request).usage = self.used.append
        self._inner.key = self.key
        return self._inner.render(request)


def memory_db(test: SynchronousTestCase) -> Any:
    db = store.thd_open(Path(test.mktemp()) / "blazar.db")
    test.addCleanup(db.close)
    return db


class CacheStepTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.build()

    def build(self, extra: str = "") -> None:
        """
        The gateway, its registry and pipeline reading C{CONFIG} and
        C{extra}, with the cache on a fresh database.
        """
        self.app = cache_engine()
        self.gateway = MemoryGateway(
            self,
            FakeSupervisor(["m:latest", "e:latest"]),
            self.app,
            models=("m", "e"),
            config=CONFIG + extra,
            admission=True,
        )
        self.config = parse_config(f'models_dir = "{self.gateway.registry.models_dir}"\n{CONFIG}{extra}')
        self.gateway.pipeline._config = lambda: self.config
        self.db = memory_db(self)
        self.cache = CacheStore(
            lambda: self.config.cache, self.gateway.reactor.seconds, lambda f, *args: maybeDeferred(f, self.db, *args)
        )
        self.successResultOf(Deferred.fromCoroutine(self.cache.load()))
        self.gateway.pipeline.cache = self.cache
        self.door = Door(self.gateway.capture)
        self.gateway.client = StubTreq(self.door)
        self.metrics = Metrics()
        self.observer = RequestObserver(self.metrics, self.gateway.reactor)

    def chat(self, text: str, path: str = "/v1/chat/completions", **extra: Any) -> tuple[int, Any, Any]:
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
        if path == "/api/chat":
            body.setdefault("stream", False)
        status, headers, data = self.gateway.post(path, body)
        request = self.gateway.capture.requests[-1]
        self.observer._finished(None, request, "openai")
        found = headers.getRawHeaders(b"x-blazar-cache")
        return status, [v.decode() for v in found] if found is not None else None, data

    def sent(self, path: str = "/v1/chat/completions") -> int:
        return sum(1 for p, _ in self.app.requests if p == path)

    def counted(self, result: str) -> float:
        value = self.metrics.registry.get_sample_value("blazar_cache_total", {"model": "m:latest", "result": result})
        return value or 0.0

    def test_the_same_prompt_twice_is_a_hit_with_no_engine_request(self) -> None:
        status, header, data = self.chat("what is the capital of france")
        self.assertEqual((status, header), (200, ["miss"]))
        first = json.loads(data)
        self.assertEqual((self.sent(), self.sent("/v1/embeddings"), len(self.cache.index)), (1, 1, 1))
        embed = self.app.requests[0][1]
        self.assertEqual(embed, {"model": "e:latest", "input": "what is the capital of france"})
        status, header, data = self.chat("what is the capital of france")
        self.assertEqual((status, header), (200, ["hit"]))
        second = json.loads(data)
        self.assertEqual(self.sent(), 1)  # answered from the cache: no chat request reached the engine
        self.assertEqual(second["choices"], first["choices"])
        self.assertEqual(second["model"], "m")  # in the client's spelling, as any answer
        self.assertNotEqual(second["id"], first["id"])
        self.assertEqual((self.counted("miss"), self.counted("hit")), (1, 1))
        # a paraphrase with the same words (cosine 1 here) is a hit too
        self.assertEqual(self.chat("What is the capital of France?")[1], ["hit"])
        # ... and a different question is not
        self.assertEqual(self.chat("how tall is mount everest")[1], ["miss"])
        self.assertEqual(self.sent(), 2)

    def test_a_hit_takes_no_slot_and_counts_no_tokens(self) -> None:
        self.door.key = KeyConfig("k", "k" * 16, tpm=1000)
        self.chat("hello there")
        self.assertEqual(self.door.used, [12])
        self.assertEqual(self.gateway.context().tokens, (7, 5))
        self.gateway.pipeline.admission = None  # a hit never asks for a slot (this would fail if it did)
        self.patch(self.gateway.pipeline, "_admit", None)
        status, header, _ = self.chat("hello there")
        self.assertEqual((status, header), (200, ["hit"]))
        self.assertEqual(self.door.used, [12])  # not counted against the key's tpm or daily tokens
        self.assertIsNone(self.gateway.context().tokens)

    def test_a_hit_never_crosses_keys(self) -> None:
        self.door.key = KeyConfig("a", "a" * 16)
        self.chat("the same words")
        self.door.key = KeyConfig("b", "b" * 16)
        self.assertEqual(self.chat("the same words")[1], ["miss"])
        self.assertEqual(self.chat("the same words")[1], ["hit"])  # b's own answer now
        self.door.key = KeyConfig("a", "a" * 16)
        self.assertEqual(self.chat("the same words")[1], ["hit"])
        self.assertEqual(self.sent(), 2)

    def test_other_sampling_or_model_is_a_miss(self) -> None:
        self.chat("some words", temperature=0)
        self.assertEqual(self.chat("some words", temperature=1.5)[1], ["miss"])
        self.assertEqual(self.chat("some words", temperature=0, max_tokens=9)[1], ["miss"])
        self.assertEqual(self.chat("some words", temperature=0)[1], ["hit"])

    def test_below_the_threshold_is_a_miss(self) -> None:
        self.chat("alpha beta gamma delta")
        # three words of the four (and the role's): about 0.89 under these word buckets
        a, b = bag_of_words("alpha beta gamma delta"), bag_of_words("alpha beta gamma")
        cosine = sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
        self.assertLess(cosine, 0.90)
        self.app.finish = "length"  # the misses' own answers are not stored (the sentinel flags them)
        self.assertEqual(self.chat("alpha beta gamma")[1], ["miss"])
        self.config = parse_config(self.config_text(threshold=round(cosine - 0.01, 4)))
        status, header, data = self.chat("alpha beta gamma")
        self.assertEqual(header, ["hit"])
        self.assertEqual(json.loads(data)["choices"][0]["message"]["content"], "answer 1")

    def config_text(self, **cache: Any) -> str:
        extra = "".join(f"{k} = {v}\n" for k, v in cache.items())
        return f'models_dir = "{self.gateway.registry.models_dir}"\n{CONFIG}{extra}'

    def test_an_answer_expires_after_ttl_secs(self) -> None:
        self.chat("tell me a joke")
        self.gateway.reactor.advance(59)
        self.assertEqual(self.chat("tell me a joke")[1], ["hit"])
        self.gateway.reactor.advance(2)
        self.assertEqual(self.chat("tell me a joke")[1], ["miss"])
        self.assertEqual(self.sent(), 2)

    def test_streams_tools_and_formats_bypass_both_ways(self) -> None:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        extras: list[dict[str, Any]] = [
            {"stream": True},
            {"tools": tools},
            {"response_format": {"type": "json_object"}},
        ]
        for extra in extras:
            status, header, _ = self.chat("bypassing words", **extra)
            self.assertEqual((status, header), (200, None), extra)
            self.assertEqual(self.gateway.context().cache, "bypass")
        self.assertEqual((self.sent("/v1/embeddings"), len(self.cache.index)), (0, 0))  # no lookup, no store
        self.assertEqual(self.counted("bypass"), 3)
        # a stream is never a hit, even of an answer stored without one
        self.chat("bypassing words")
        self.assertEqual(self.chat("bypassing words")[1], ["hit"])
        self.assertEqual(self.chat("bypassing words", stream=True)[1], None)
        # (the JSON answer is decoded by /completion: blazar.gateway.jsonanswer)
        self.assertEqual((self.sent(), self.sent("/completion")), (4, 1))

    def test_a_failing_embedding_leaves_the_call_uncached(self) -> None:
        self.app.embed_status = 500
        status, header, data = self.chat("embed me")
        self.assertEqual((status, header), (200, None))
        self.assertEqual(json.loads(data)["choices"][0]["message"]["content"], "answer 1")
        self.assertEqual(self.gateway.context().cache, "error")
        self.assertEqual(self.counted("error"), 1)
        self.assertEqual(len(self.cache.index), 0)

    def test_a_call_that_fails_after_the_miss_still_says_so(self) -> None:
        # the headers decided before the failure go out with its error
        self.app.chat_status = 500
        body = {"model": "m", "messages": [{"role": "user", "content": "failing words"}]}
        status, headers, _ = self.gateway.post("/v1/chat/completions", body)
        self.assertEqual(
            (status, headers.getRawHeaders(b"x-blazar-cache"), headers.getRawHeaders(b"x-blazar-queue-ms")),
            (502, [b"miss"], [b"0"]),
        )

    def test_an_answer_the_sentinel_flags_is_not_stored(self) -> None:
        self.app.finish = "length"  # truncated at max_tokens
        self.assertEqual(self.chat("cut short")[1], ["miss"])
        self.assertEqual(len(self.cache.index), 0)
        self.assertEqual(self.chat("cut short")[1], ["miss"])
        self.assertEqual(self.sent(), 2)

    def test_the_key_then_the_model_then_the_global_switch(self) -> None:
        self.build('[models."m"]\ncache = true\n')
        self.config = parse_config(
            self.config_text().replace("enabled = true", "enabled = false") + '[models."m"]\ncache = true\n'
        )
        self.chat("switch words")
        self.assertEqual(self.chat("switch words")[1], ["hit"])  # the model's switch
        self.door.key = KeyConfig("k", "k" * 16, cache=False)
        self.assertEqual(self.chat("switch words")[1], None)  # the key's switch wins
        self.assertIsNone(self.gateway.context().cache)  # not counted: the cache is off for it
        self.build()
        self.config = parse_config(self.config_text().replace("enabled = true", "enabled = false"))
        self.door.key = KeyConfig("k", "k" * 16, cache=True)
        self.assertEqual(self.chat("switch words")[1], ["miss"])
        self.door.key = None
        self.assertEqual(self.chat("switch words")[1], None)  # off globally, and nothing says otherwise

    def test_anthropic_and_responses_whole_answers_use_it_too(self) -> None:
        # they read the engine's stream to make one answer: stored from the stream, replayed as one
        messages = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "anthropic words"}]}
        # their streams bypass it (first: once the model is loaded, a stream asks the fake engine to count)
        status, headers, _ = self.gateway.post("/v1/messages", {**messages, "stream": True})
        self.assertEqual((status, headers.getRawHeaders(b"x-blazar-cache")), (200, None))
        self.assertEqual(self.gateway.context().cache, "bypass")
        self.app.answers = 0
        status, headers, first = self.gateway.post("/v1/messages", messages)
        self.assertEqual((status, headers.getRawHeaders(b"x-blazar-cache")), (200, [b"miss"]))
        status, headers, second = self.gateway.post("/v1/messages", messages)
        self.assertEqual((status, headers.getRawHeaders(b"x-blazar-cache")), (200, [b"hit"]))
        self.assertEqual(self.sent(), 2)
        first_message, second_message = json.loads(first), json.loads(second)
        self.assertEqual(second_message["content"], [{"type": "text", "text": "streamed 1"}])
        self.assertEqual(second_message["content"], first_message["content"])
        self.assertEqual(
            (second_message["stop_reason"], second_message["usage"]["output_tokens"]),
            (first_message["stop_reason"], first_message["usage"]["output_tokens"]),
        )
        self.assertIsNone(self.gateway.context().tokens)  # a hit's tokens count nowhere
        responses = {"model": "m", "max_output_tokens": 8, "input": "responses words"}
        self.assertEqual(self.gateway.post("/v1/responses", responses)[1].getRawHeaders(b"x-blazar-cache"), [b"miss"])
        status, headers, data = self.gateway.post("/v1/responses", responses)
        self.assertEqual((status, headers.getRawHeaders(b"x-blazar-cache")), (200, [b"hit"]))
        self.assertEqual(json.loads(data)["output"][0]["content"][0]["text"], "streamed 2")
        self.assertEqual(self.sent(), 3)

    def test_a_streamed_whole_answer_the_sentinel_flags_is_not_stored(self) -> None:
        self.app.finish = "length"
        messages = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "cut words"}]}
        self.gateway.post("/v1/messages", messages)
        self.assertEqual(self.gateway.post("/v1/messages", messages)[1].getRawHeaders(b"x-blazar-cache"), [b"miss"])
        self.assertEqual(len(self.cache.index), 0)

    def test_the_audit_line_names_the_outcome(self) -> None:
        from blazar.web.audit import AuditLog

        audit = AuditLog(Path(self.mktemp()) / "audit.jsonl", wall=lambda: 1.0)
        audit.submit({"model": "m:latest", "cache": "hit"})
        audit.submit({"model": "m:latest"})
        self.assertEqual([audit._queue.get_nowait().get("cache") for _ in range(2)], ["hit", None])

    def test_ollama_chat_is_answered_from_the_same_answer(self) -> None:
        self.chat("ollama words", path="/api/chat")
        status, header, data = self.chat("ollama words", path="/api/chat")
        self.assertEqual((status, header), (200, ["hit"]))
        line = json.loads(data)
        self.assertEqual((line["message"]["content"], line["done"]), ("answer 1", True))
        self.assertEqual(self.sent(), 1)


class CacheStoreTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.config = CacheConfig(enabled=True, embedding_model="e:latest", ttl=10.0, max_entries=3)
        self.db = memory_db(self)

    def store(self) -> CacheStore:
        cache = CacheStore(lambda: self.config, self.clock.seconds, lambda f, *args: maybeDeferred(f, self.db, *args))
        self.successResultOf(Deferred.fromCoroutine(cache.load()))
        return cache

    def test_nothing_before_load(self) -> None:
        cache = CacheStore(lambda: self.config, self.clock.seconds, lambda f, *args: succeed(None))
        self.successResultOf(cache.store("s", unit(1.0, 0.0), b"{}"))
        self.assertEqual(cache.lookup("s", unit(1.0, 0.0)), (-1.0, None))

    def test_rebuilt_from_sqlite_and_bounded(self) -> None:
        cache = self.store()
        for i in range(5):
            self.successResultOf(cache.store(f"s{i}", unit(1.0, float(i)), b"answer %d" % i))
            self.clock.advance(1)
        self.assertEqual(len(cache.index), 3)
        self.assertEqual(len(self.db.execute("SELECT id FROM cache_entries").fetchall()), 3)
        again = self.store()
        self.assertEqual(len(again.index), 3)
        similarity, entry = again.lookup("s4", unit(1.0, 4.0))
        self.assertAlmostEqual(similarity, 1.0, places=5)
        self.assertEqual(entry.answer if entry else None, b"answer 4")
        self.assertIsNone(again.lookup("s0", unit(1.0, 0.0))[1])

    def test_purge_drops_the_expired(self) -> None:
        cache = self.store()
        self.successResultOf(cache.store("s", unit(1.0, 0.0), b"old"))
        self.clock.advance(8)
        self.successResultOf(cache.store("t", unit(1.0, 0.0), b"new"))
        self.clock.advance(3)
        self.assertEqual(self.successResultOf(Deferred.fromCoroutine(cache.purge())), 1)
        self.assertEqual(len(cache.index), 1)
        self.assertEqual([r[0] for r in self.db.execute("SELECT answer FROM cache_entries")], [b"new"])

    def test_a_failing_store_is_logged(self) -> None:
        cache = self.store()
        self.db.close()
        d = cache.store("s", unit(1.0, 0.0), b"x")
        self.successResultOf(d)
        self.assertEqual(len(self.flushLoggedErrors()), 1)
        self.assertEqual((len(cache.index), cache.pending), (0, set()))
        self.db = memory_db(self)


class CacheServiceTests(SynchronousTestCase):
    def test_loads_at_start_purges_on_a_clock_and_survives_a_failing_purge(self) -> None:
        from blazar.storeservice import CACHE_PURGE_SECS, CacheService, StoreService
        from blazar.testing import fake_process_reactor

        reactor = fake_process_reactor()
        path = Path(self.mktemp()) / "blazar.db"
        db = store.thd_open(path)
        vector = unit(0.0, 1.0)
        assert vector is not None
        from blazar.gateway.cache import to_blob

        db.execute(
            "INSERT INTO cache_entries (scope, created, vector, answer) VALUES ('s', 100, ?, ?)",
            (to_blob(vector), b"a"),
        )
        db.close()
        wall = Clock()
        wall.advance(105)
        live = LiveConfig(parse_config("[cache]\nttl_secs = 10\n"))
        database = StoreService(path, reactor, cast(ThreadPool, SynchronousThreadPool()))
        database.startService()
        service = CacheService(database, live, reactor, wall.seconds)
        service.startService()
        assert service.started is not None
        self.successResultOf(service.started)
        self.assertEqual(len(service.cache.index), 1)
        purges: list[int] = []
        real = service.cache.purge

        async def purge() -> int:
            if not purges:
                purges.append(0)
                raise RuntimeError("the disk is gone")
            purges.append(await real())
            return purges[-1]

        self.patch(service.cache, "purge", purge)
        wall.advance(10)
        reactor.advance(CACHE_PURGE_SECS)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        reactor.advance(CACHE_PURGE_SECS)  # the job kept running
        self.assertEqual(purges, [0, 1])
        self.assertEqual(len(service.cache.index), 0)
        self.successResultOf(service.stopService())
        self.successResultOf(database.stopService())
        self.assertFalse(database.is_open)


class StreamShapeTests(SynchronousTestCase):
    """
    A completion as the stream it was made from, and back.
    """

    def test_round_trip(self) -> None:
        from blazar.gateway.cache import StreamedAnswer, as_chunks

        completion = {
            "id": "chatcmpl-1",
            "created": 5,
            "model": "m",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "hi", "reasoning_content": "hm"},
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
        chunks = as_chunks(json.dumps(completion).encode())
        self.assertEqual(
            [c["choices"][0]["delta"] if c["choices"] else c["usage"] for c in chunks],
            [
                {"role": "assistant", "reasoning_content": "hm"},
                {"role": "assistant", "content": "hi"},
                {},
                completion["usage"],
            ],
        )
        answer = StreamedAnswer()
        for chunk in chunks:
            answer.feed(chunk)
        made = answer.completion()
        assert made is not None
        self.assertEqual(json.loads(made), completion)
        self.assertEqual(as_chunks(b"not json"), [])

    def test_unfinished_or_tool_calls_are_no_answer(self) -> None:
        from blazar.gateway.cache import StreamedAnswer

        unfinished = StreamedAnswer()
        unfinished.feed({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})
        self.assertIsNone(unfinished.completion())
        called = StreamedAnswer()
        called.feed({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}, "finish_reason": "stop"}]})
        self.assertIsNone(called.completion())
