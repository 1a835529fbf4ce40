"""
Regressions a review of the one-path refactor found (issue 18): each test
states what a client (or the lease contract of blazar/engines/lease.py) expects.
"""

from __future__ import annotations

import json
from typing import Any

from klein import Klein
from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.lease import InstanceLease
from blazar.testing import FakeSupervisor, fake_engine_app
from tests.typed import not_none
from tests.web.gateway import MemoryGateway


def failing_engine(status: int) -> Any:
    """
    An engine whose chat endpoint answers C{status} with llama-server's
    error envelope.
    """
    app = Klein()

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat(request: Any) -> bytes:
        request.setResponseCode(status)
        return json.dumps({"error": {"code": status, "message": "engine says no", "type": "x"}}).encode()

    return app


class ReviewFindingsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.build(fake_engine_app("m:latest"))

    def build(self, engine_app: Any) -> None:
        self.supervisor = FakeSupervisor(["m:latest"])
        self.gateway = MemoryGateway(self, self.supervisor, engine_app)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, bytes]:
        return self.gateway.post(path, body)

    def test_ollama_keep_alive_0_unload_waits_for_a_running_request(self) -> None:
        """
        The lease module: "while it is held the child counts the request in
        in_flight, so idle eviction, a keep_alive of 0 from another request
        and a context grow wait for it". Ollama's unload (empty prompt,
        keep_alive 0) stops the child under a request that holds a lease.
        """
        instance = self.successResultOf(ensureDeferred(self.supervisor.instance_for("m:latest")))
        lease = InstanceLease(self.supervisor, instance)  # another client's stream, still running
        code, _, body = self.post("/api/generate", {"model": "m", "keep_alive": 0})
        self.assertEqual(code, 200, body)
        self.assertEqual(self.supervisor.stopped, [], "the child was stopped under a running request")
        lease.finish(0)

    def test_ollama_empty_prompt_load_names_ignored_fields(self) -> None:
        """
        Before the refactor every Ollama request, the load with an empty
        prompt included, named its ignored fields in x-blazar-ignored
        (OllamaSurface._lenient called note_ignored first).
        """
        code, headers, body = self.post("/api/generate", {"model": "m", "options": {"num_batch": 99}})
        self.assertEqual(code, 200, body)
        self.assertEqual(headers.getRawHeaders(b"x-blazar-ignored"), [b"options.num_batch"])

    def test_ollama_empty_prompt_unload_names_ignored_fields(self) -> None:
        code, headers, body = self.post("/api/chat", {"model": "m", "keep_alive": 0, "options": {"num_batch": 99}})
        self.assertEqual(code, 200, body)
        self.assertEqual(headers.getRawHeaders(b"x-blazar-ignored"), [b"options.num_batch"])

    def test_ollama_empty_embeddings_prompt_names_ignored_fields(self) -> None:
        code, headers, body = self.post("/api/embeddings", {"model": "m", "prompt": "", "options": {"num_batch": 99}})
        self.assertEqual(code, 200, body)
        self.assertEqual(headers.getRawHeaders(b"x-blazar-ignored"), [b"options.num_batch"])

    def test_an_empty_embeddings_prompt_still_needs_a_model_that_exists(self) -> None:
        code, _, body = self.post("/api/embeddings", {"model": "nope", "prompt": ""})
        self.assertEqual((code, json.loads(body)), (404, {"error": 'model "nope" not found, try pulling it first'}))
        code, _, body = self.post("/api/embeddings", {"model": "m", "prompt": ""})
        self.assertEqual((code, json.loads(body)), (200, {"embedding": []}))

    def test_anthropic_engine_4xx_is_a_400(self) -> None:
        """
        Before the refactor the Anthropic surface answered any engine 4xx
        as 400 invalid_request_error; now the engine's own status (here
        404) leaks through as a not_found_error.
        """
        self.build(failing_engine(404))
        code, _, body = self.post(
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        self.assertEqual((code, json.loads(body)["error"]["type"]), (400, "invalid_request_error"), body)

    def test_openai_refusal_before_the_pipeline_names_ignored_fields(self) -> None:
        """
        The old surface noted x-blazar-ignored right after the leniency
        screen; now only the pipeline's first step does, so a request the
        surface refuses itself (here a bad keep_alive) loses the header.
        """
        code, headers, body = self.post(
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "service_tier": "auto",
                "keep_alive": "soon",
            },
        )
        self.assertEqual(code, 400, body)
        self.assertEqual(headers.getRawHeaders(b"x-blazar-ignored"), [b"service_tier"])


class AnthropicAdmissionOrderTests(SynchronousTestCase):
    """
    The Anthropic stream's prompt count (Counting.IF_READY) is decided and
    made before admission (Pipeline._start), the old surface did both after
    it.
    """

    def setUp(self) -> None:
        engine = fake_engine_app("m:latest")
        self.counted: list[bytes] = []

        @engine.route("/v1/chat/completions/input_tokens", methods=["POST"])
        def input_tokens(request: Any) -> bytes:
            self.counted.append(request.content.read())
            return b'{"input_tokens": 7}'

        self.supervisor = FakeSupervisor(["m:latest"])
        gateway = MemoryGateway(self, self.supervisor, engine, config='[models."m"]\nparallel = 1\n', admission=True)
        self.admission, self.client, self.engine = gateway.admission, gateway.client, gateway.engine

    def pump(self) -> None:
        for _ in range(20):
            self.client.flush()
            self.engine.flush()

    def hold(self) -> Any:
        queue = not_none(self.admission).queue("m:latest")
        return self.successResultOf(queue.admit(queue.ticket(trace_id="holder"), 1))

    def start(self) -> Any:
        return self.client.request(
            "POST",
            "http://localhost/v1/messages",
            data=json.dumps(
                {
                    "model": "m",
                    "max_tokens": 8,
                    "stream": True,
                    "messages": [{"role": "user", "content": "hi"}],
                }
            ).encode(),
        )

    def test_message_start_counts_a_prompt_whose_model_loaded_while_it_queued(self) -> None:
        held = self.hold()
        d = self.start()
        self.pump()
        self.assertNoResult(d)  # queued behind the held slot; the model is not loaded
        # another request loads the model meanwhile
        self.successResultOf(ensureDeferred(self.supervisor.instance_for("m:latest")))
        held.release()
        self.pump()
        body = self.successResultOf(self.successResultOf(d).content()).decode()
        start = json.loads(body.split("\n\n")[0].split("data: ", 1)[1])
        self.assertEqual(start["type"], "message_start")
        # the old surface decided warm/cold after admission and counted then
        self.assertEqual(start["message"]["usage"]["input_tokens"], 7, body)

    def test_no_engine_call_before_admission(self) -> None:
        self.successResultOf(ensureDeferred(self.supervisor.instance_for("m:latest")))
        held = self.hold()
        d = self.start()
        self.pump()
        self.assertNoResult(d)  # still queued
        self.assertEqual(self.counted, [], "the engine was asked to count a prompt not yet admitted")
        held.release()
        self.pump()
        self.successResultOf(d)


class InStreamMetricsTests(SynchronousTestCase):
    """
    An engine's 4xx after a stream's headers went out (every Responses
    stream sends its headers before the send; an Anthropic stream whose
    model must load first) ends the stream with a 200 status, and
    in_stream notes no kind for a 4xx problem: blazar_errors_total does
    not count it at all (observe counts a None kind only for status >= 400).
    The old surfaces noted "engine_error".
    """

    def setUp(self) -> None:
        self.supervisor = FakeSupervisor(["m:latest"])
        self.gateway = MemoryGateway(self, self.supervisor, failing_engine(400))

    def stream(self, path: str, body: dict[str, Any]) -> tuple[int, bytes, Any]:
        status, _, data = self.gateway.post(path, body)
        return status, data, self.gateway.context().error

    def test_responses_stream_engine_400_is_counted(self) -> None:
        code, data, kind = self.stream("/v1/responses", {"model": "m", "input": "hi", "stream": True})
        self.assertEqual(code, 200)
        self.assertIn(b"response.failed", data)
        self.assertEqual(kind, "engine_error")

    def test_anthropic_cold_stream_engine_400_is_counted(self) -> None:
        code, data, kind = self.stream(
            "/v1/messages",
            {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        )
        self.assertEqual(code, 200)
        self.assertIn(b"event: error", data)
        self.assertEqual(kind, "engine_error")


class PlacementOptionsTests(SynchronousTestCase):
    """
    Ollama's placement options (num_gpu, main_gpu, num_thread, use_mmap)
    reach the supervisor as the model's profile, on a chat and on a load;
    a scoped key's are named ignored (a tenant does not reload a shared
    model).
    """

    def setUp(self) -> None:
        self.supervisor = FakeSupervisor(["m:latest"])
        self.gateway = MemoryGateway(
            self,
            self.supervisor,
            fake_engine_app("m:latest"),
            config=(
                '[[keys]]\nname = "admin"\nsecret = "admin-secret-0123456789"\n'
                '[[keys]]\nname = "tenant"\nsecret = "tenant-secret-0123456789"\nmodels = ["m"]\n'
            ),
        )

    def test_an_unscoped_keys_placement_is_the_models(self) -> None:
        options = {"num_gpu": 12, "main_gpu": 1, "num_thread": 4, "use_mmap": False, "num_batch": 9}
        code, headers, body = self.gateway.post(
            "/api/chat",
            {"model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}], "options": options},
            headers={"authorization": "Bearer admin-secret-0123456789"},
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(
            self.supervisor.profiles["m"], {"gpu_layers": 12, "main_gpu": 1, "threads": 4, "use_mmap": False}
        )
        self.assertEqual(headers.getRawHeaders(b"x-blazar-ignored"), [b"options.num_batch"])
        code, _, body = self.gateway.post(
            "/api/generate",
            {"model": "m", "options": {"num_gpu": 0}},
            headers={"authorization": "Bearer admin-secret-0123456789"},
        )
        self.assertEqual(code, 200, body)  # a load
        self.assertEqual(self.supervisor.profiles["m"], {"gpu_layers": 0})

    def test_a_scoped_keys_placement_is_ignored(self) -> None:
        code, headers, body = self.gateway.post(
            "/api/chat",
            {
                "model": "m",
                "stream": False,
                "messages": [{"role": "user", "content": "hi"}],
                "options": {"num_gpu": 12, "num_thread": 2},
            },
            headers={"authorization": "Bearer tenant-secret-0123456789"},
        )
        self.assertEqual(code, 200, body)
        self.assertEqual(self.supervisor.profiles, {})
        ignored = b",".join(headers.getRawHeaders(b"x-blazar-ignored") or []).decode()
        self.assertIn("options.num_gpu", ignored)
        self.assertIn("options.num_thread", ignored)

    def test_a_scoped_keys_keep_alive_is_named_at_the_calls_end(self) -> None:
        """
        A scoped key's C{keep_alive} is noted when the call ends (its
        lease's end), after the answer was read: on an answer written
        after the call, it still joins the surface's names in the header;
        on a load, too.
        """
        tenant = {"authorization": "Bearer tenant-secret-0123456789"}
        chat = {"model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}], "keep_alive": "5m"}
        code, headers, body = self.gateway.post("/api/chat", {**chat, "options": {"num_batch": 9}}, headers=tenant)
        self.assertEqual(code, 200, body)
        self.assertEqual(headers.getRawHeaders(b"x-blazar-ignored"), [b"options.num_batch,keep_alive"])
        code, headers, body = self.gateway.post("/api/generate", {"model": "m", "keep_alive": "5m"}, headers=tenant)
        self.assertEqual(code, 200, body)  # a load
        self.assertEqual(headers.getRawHeaders(b"x-blazar-ignored"), [b"keep_alive"])
