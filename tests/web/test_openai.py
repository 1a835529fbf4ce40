import json
from pathlib import Path
from typing import Any, cast

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import Supervisor
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeSupervisor, StubEngineClient, fake_engine_app, fake_process_reactor
from tests.typed import StubTreq


class OpenAISurfaceTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "m.gguf")
        self.reactor = fake_process_reactor()
        config = parse_config(f'models_dir = "{root}"')
        self.engine_app = fake_engine_app("m:latest")
        self.engine = StubTreq(self.engine_app.resource())
        self.supervisor = FakeSupervisor(["m:latest"])
        self.engine_client = StubEngineClient(self.engine, self.supervisor)
        registry = ModelRegistry(config, self.reactor)
        surface = build_gateway(
            registry, cast(Supervisor, self.supervisor), cast(EngineClient, self.engine_client), self.reactor
        ).openai
        self.client = StubTreq(surface.app.resource())

    def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any, bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        d = self.client.request(method, "http://localhost" + path, data=data)
        for _ in range(20):
            self.client.flush()
            self.engine.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(response.content())
        return response.code, response.headers, content

    def test_chat_non_streaming_renames_model(self) -> None:
        code, headers, body = self.call(
            "POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
        self.assertEqual(code, 200)
        parsed = json.loads(body)
        self.assertEqual(parsed["model"], "m")
        self.assertEqual(parsed["choices"][0]["message"]["content"], "Hello")
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/json"])
        # the request went to the engine as sent
        self.assertEqual(self.engine_app.requests[0][1]["messages"][0]["content"], "hi")

    def test_a_whole_answer_goes_out_with_its_length(self) -> None:
        """
        A non-streamed answer carries its C{Content-Length} (its model
        renamed first), so it is written whole, not as chunks.
        """
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        d = self.client.request("POST", "http://localhost/v1/chat/completions", data=body)
        for _ in range(20):
            self.client.flush()
            self.engine.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(response.content())
        self.assertEqual(json.loads(content)["model"], "m")
        # (the client's parser keeps Content-Length as the length; a chunked answer has none)
        self.assertEqual(response.length, len(content))

    def test_chat_streaming_relays_events(self) -> None:
        code, headers, body = self.call(
            "POST",
            "/v1/chat/completions",
            {"model": "M:latest", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        )
        self.assertEqual(code, 200)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        # a cold model: the headers and ": loading" comments come first
        self.assertTrue(body.startswith(b": loading\n\n"))
        events = [e for e in body.split(b"\n\n") if e and not e.startswith(b":")]
        self.assertEqual(events[-1], b"data: [DONE]")
        chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
        self.assertEqual([c["model"] for c in chunks], ["M:latest", "M:latest"])
        self.assertEqual("".join(c["choices"][0]["delta"]["content"] for c in chunks), "Hello")

    def assertOpenAIError(self, code: int, body: bytes, status: int, error_code: Any, *needles: str) -> dict:
        self.assertEqual(code, status, body)
        error = json.loads(body)["error"]
        self.assertEqual(set(error), {"message", "type", "param", "code"})
        self.assertEqual(error["code"], error_code)
        for needle in needles:
            self.assertIn(needle, error["message"])
        return error

    def test_unknown_model_404_names_available(self) -> None:
        for stream in (False, True):
            code, _, body = self.call(
                "POST",
                "/v1/chat/completions",
                {"model": "nope", "stream": stream, "messages": [{"role": "user", "content": "x"}]},
            )
            self.assertOpenAIError(code, body, 404, "model_not_found", "nope", "m:latest")

    def test_bad_requests(self) -> None:
        code, _, body = self.call("POST", "/v1/chat/completions", raw=b"{not json")
        self.assertOpenAIError(code, body, 400, None, "not valid JSON")
        code, _, body = self.call("POST", "/v1/chat/completions", [1, 2])
        self.assertOpenAIError(code, body, 400, None, "JSON object")
        code, _, body = self.call("POST", "/v1/chat/completions", {"messages": []})
        error = self.assertOpenAIError(code, body, 400, None, "model")
        self.assertEqual(error["param"], "model")
        code, _, body = self.call("POST", "/v1/chat/completions", {"model": "m"})
        self.assertOpenAIError(code, body, 400, None, "messages")
        code, _, body = self.call("POST", "/v1/completions", {"model": "m"})
        self.assertOpenAIError(code, body, 400, None, "prompt")
        code, _, body = self.call("POST", "/v1/embeddings", {"model": "m", "input": []})
        self.assertOpenAIError(code, body, 400, None, "input")
        code, _, body = self.call(
            "POST", "/v1/chat/completions", {"model": "m", "stream": "yes", "messages": [{"role": "user"}]}
        )
        self.assertOpenAIError(code, body, 400, None, "stream")

    def test_engine_failure_is_502_with_engine_message(self) -> None:
        code, _, body = self.call(
            "POST",
            "/v1/chat/completions",
            {"model": "m", "chat_template_kwargs": {"fail": 500}, "messages": [{"role": "user", "content": "x"}]},
        )
        self.assertOpenAIError(code, body, 502, "engine_error", "engine says no")

    def test_engine_4xx_keeps_status(self) -> None:
        code, _, body = self.call(
            "POST",
            "/v1/chat/completions",
            {"model": "m", "chat_template_kwargs": {"fail": 400}, "messages": [{"role": "user", "content": "x"}]},
        )
        self.assertOpenAIError(code, body, 400, None, "engine says no")

    def test_models_list_and_get(self) -> None:
        code, _, body = self.call("GET", "/v1/models")
        self.assertEqual(code, 200)
        listing = json.loads(body)
        self.assertEqual(listing["object"], "list")
        self.assertEqual([m["id"] for m in listing["data"]], ["m:latest"])
        self.assertEqual(listing["data"][0]["object"], "model")
        code, _, body = self.call("GET", "/v1/models/m")
        self.assertEqual((code, json.loads(body)["id"]), (200, "m"))
        code, _, body = self.call("GET", "/v1/models/zzz")
        self.assertOpenAIError(code, body, 404, "model_not_found")

    def test_health_touches_no_engine(self) -> None:
        for path in ("/health", "/healthz"):
            code, _, body = self.call("GET", path)
            self.assertEqual((code, json.loads(body)), (200, {"status": "ok"}))
        self.assertEqual(self.supervisor.table, {})

    def test_unknown_route_and_method(self) -> None:
        code, _, body = self.call("GET", "/v1/nothing")
        self.assertOpenAIError(code, body, 404, "not_found")
        code, _, body = self.call("GET", "/v1/chat/completions")
        self.assertOpenAIError(code, body, 405, "method_not_allowed")

    def test_dead_child_refusing_connection_is_retried_once_on_a_fresh_one(self) -> None:
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        self.engine_client.refuse = 1
        code, _, body = self.call("POST", "/v1/chat/completions", chat)
        self.assertEqual(code, 200, body)
        self.assertEqual(self.supervisor.started, 2)
        self.engine_client.refuse = 2
        code, _, body = self.call("POST", "/v1/chat/completions", chat)
        self.assertOpenAIError(code, body, 502, "engine_error", "connection failed")
