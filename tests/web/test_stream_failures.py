"""
Every failure after a stream's 200 went out ends the stream in the
surface's own terms (a C{response.failed} event, an Anthropic C{error}
event, a final Ollama C{{"error": ...}} line), never with an error body of
its own after the events: a GGUF file that turns out unreadable when its
model is loaded, a model gone, an engine that cannot be found, and a bug.
Through the real surfaces in memory (StubTreq, a fake engine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, cast

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import parse_config
from blazar.engines.client import EngineClient
from blazar.engines.llamacpp import EngineNotFound
from blazar.engines.supervisor import Supervisor
from blazar.models.gguf_meta import GGUFError
from blazar.models.registry import ModelNotFound, ModelRegistry, ModelUnreadable
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeInstance, FakeSupervisor, StubEngineClient, fake_engine_app, fake_process_reactor
from tests.typed import StubTreq

HELLO = [{"role": "user", "content": "hi"}]
STREAMS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": HELLO, "stream": True}),
]


class Bug(Exception):
    """
    Stands for a bug: not a domain error of any surface.
    """


class FailingSupervisor(FakeSupervisor):
    """
    A supervisor whose next load fails with C{failure} (when set).
    """

    failure: Exception | None = None

    async def instance_for(self, name: str, ctx_size: int | None = None) -> FakeInstance:
        if self.failure is not None:
            raise self.failure
        return await super().instance_for(name, ctx_size)


class FakeHub:
    """
    A hub that reports some progress, then breaks.
    """

    async def pull(self, name: Any, models_dir: Path, progress: Callable[[dict[str, Any]], None]) -> list[Path]:
        progress({"status": "pulling manifest"})
        raise Bug("hub broke")


class StreamFailureTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp()).absolute()
        make_test_model(root / "m.gguf")
        self.gguf = root / "m.gguf"
        self.reactor = fake_process_reactor()
        config = parse_config(f'models_dir = "{root}"')
        engine = fake_engine_app("m:latest")

        @engine.route("/v1/chat/completions/input_tokens", methods=["POST"])
        def input_tokens(request: Any) -> bytes:
            return b'{"input_tokens": 2}'

        self.engine = StubTreq(engine.resource())
        self.supervisor = FailingSupervisor(["m:latest"])
        registry = ModelRegistry(config, self.reactor)
        gateway = build_gateway(
            registry,
            cast(Supervisor, self.supervisor),
            cast(EngineClient, StubEngineClient(self.engine)),
            self.reactor,
            lambda: config,
            hub=FakeHub(),
            wall=lambda: 0.0,
        )
        self.engines, self.proxy = gateway.proxy, gateway.pipeline
        self.client = StubTreq(gateway.router())

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes, bytes]:
        d = self.client.request("POST", "http://localhost" + path, data=json.dumps(body).encode())
        for _ in range(20):
            self.client.flush()
            self.engine.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(response.content())
        return response.code, (response.headers.getRawHeaders(b"content-type") or [b""])[0], content

    def events(self, data: bytes) -> list[tuple[str, dict[str, Any]]]:
        """
        The stream's events, each C{event:} and C{data:} framed; fails the
        test on anything else (a bare JSON body after the events). SSE
        comments (C{: loading} while a model loads) are skipped.
        """
        out = []
        for block in data.decode().split("\n\n"):
            if not block.strip() or block.startswith(":"):
                continue
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            self.assertEqual(set(fields), {"event", "data"}, block)
            out.append((fields["event"], json.loads(fields["data"])))
        return out

    def assertFailedInItsTerms(self, path: str, data: bytes, message: str) -> None:
        events = self.events(data)
        kind, payload = events[-1]
        if path == "/v1/responses":
            self.assertEqual([k for k, _ in events[:2]], ["response.created", "response.in_progress"])
            self.assertEqual(kind, "response.failed", events)
            self.assertEqual(payload["response"]["status"], "failed")
            self.assertIn(message, payload["response"]["error"]["message"])
        else:
            self.assertEqual(events[0][0], "message_start")
            self.assertEqual(kind, "error", events)
            self.assertEqual(payload["type"], "error")
            self.assertIn(message, payload["error"]["message"])

    def test_domain_errors_at_the_load_end_the_stream(self) -> None:
        for failure, message in [
            (
                ModelUnreadable(
                    "m:latest",
                    GGUFError(self.gguf, "is not a readable GGUF file (truncated GGUF file, wanted 8 bytes at 99328)"),
                ),
                "truncated GGUF",
            ),
            (ModelNotFound("m", []), "m"),
            (EngineNotFound("no llama-server found; set BLAZAR_ENGINE"), "BLAZAR_ENGINE"),
        ]:
            self.supervisor.failure = failure
            for path, body in STREAMS:
                status, kind, data = self.post(path, body)
                self.assertEqual((status, kind), (200, b"text/event-stream"), (path, failure))
                self.assertFailedInItsTerms(path, data, message)

    def test_a_bug_at_the_load_ends_the_stream(self) -> None:
        self.supervisor.failure = Bug("boom")
        for path, body in STREAMS:
            status, _, data = self.post(path, body)
            self.assertEqual(status, 200)
            self.assertFailedInItsTerms(path, data, "internal error; see the daemon log")
            self.assertNotIn(b"boom", data)
        self.assertEqual(len(self.flushLoggedErrors(Bug)), len(STREAMS))

    def broken_relay(self) -> None:
        relay = self.engines.relay_chunks

        async def broken(*args: Any, **kwargs: Any) -> None:
            await relay(*args, **kwargs)  # every chunk is out, then it breaks
            raise Bug("boom")

        self.patch(self.engines, "relay_chunks", broken)

    def test_a_bug_mid_stream_ends_it(self) -> None:
        self.broken_relay()
        # Anthropic twice: the first request loads the model, the second finds it ready
        for path, body in [*STREAMS, STREAMS[1]]:
            status, _, data = self.post(path, body)
            self.assertEqual(status, 200, data)
            self.assertFailedInItsTerms(path, data, "internal error; see the daemon log")
            self.assertIn(b"Hel", data)
        self.assertEqual(len(self.flushLoggedErrors(Bug)), 3)
        self.assertEqual(self.supervisor.table["m:latest"].in_flight, 0)

    def test_ollama_streams_end_with_an_error_line(self) -> None:
        self.broken_relay()
        asks: list[tuple[str, dict[str, Any]]] = [
            ("/api/chat", {"model": "m", "messages": HELLO}),
            ("/api/generate", {"model": "m", "prompt": "hi"}),
            ("/api/pull", {"model": "hf.co/someone/some-GGUF"}),
        ]
        for path, body in asks:
            status, kind, data = self.post(path, body)
            self.assertEqual((status, kind), (200, b"application/x-ndjson"), (path, data))
            lines = [json.loads(line) for line in data.splitlines()]
            self.assertEqual(lines[-1], {"error": "internal error; see the daemon log"}, path)
            self.assertGreater(len(lines), 1, path)
        self.assertEqual(len(self.flushLoggedErrors(Bug)), 3)
        # a load that fails comes before the 200: an error status, as before
        self.supervisor.failure = ModelUnreadable("m:latest", GGUFError(self.gguf, "is truncated"))
        status, _, data = self.post("/api/chat", {"model": "m", "messages": HELLO})
        self.assertEqual(status, 502)
        self.assertIn("truncated", json.loads(data)["error"])
        self.assertNotIn(str(self.gguf), json.loads(data)["error"])
