"""
C{speculative = "auto"}'s feed: the pipeline hands each answer's
C{timings} to the supervisor's tuner with the call's work class and
whether the answering child runs with n-gram lookup (its launch profile),
through the real surfaces (OpenAI chat, with tools or not, Ollama,
Anthropic), streamed or not.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from klein import Klein
from twisted.trial.unittest import SynchronousTestCase

from blazar.testing import FakeInstance, FakeSupervisor
from tests.web.gateway import MemoryGateway

TIMINGS = {"predicted_n": 40, "predicted_per_second": 62.5}


def timed_engine() -> Klein:
    app = Klein()

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat(request: Any) -> bytes:
        body = json.loads(request.content.read())
        if body.get("stream"):
            request.setHeader(b"content-type", b"text/event-stream")
            delta = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hello"}}], "model": "m"}
            last = {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}], "model": "m", "timings": TIMINGS}
            request.write(b"data: " + json.dumps(delta).encode() + b"\n\n")
            request.write(b"data: " + json.dumps(last, separators=(",", ":")).encode() + b"\n\n")
            return b"data: [DONE]\n\n"
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "choices": [{"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "Hi"}}],
                "model": "m",
                "object": "chat.completion",
                "usage": {"completion_tokens": 40, "prompt_tokens": 2, "total_tokens": 42},
                "timings": TIMINGS,
            },
            separators=(",", ":"),
        ).encode()

    return app


@attrs.define(eq=False)
class Profiled(FakeInstance):
    profile: tuple[tuple[str, Any], ...] = (("speculative", "off"),)


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def observe(self, *args: Any) -> None:
        self.seen.append(args)


class SpecTimingsTests(SynchronousTestCase):
    def setUp(self) -> None:
        tuner = self.tuner = Recorder()

        class Tuned(FakeSupervisor):
            spec_tuner = tuner

            async def instance_for(self, name: str, ctx_size: int | None = None) -> Any:
                if "m:latest" not in self.table:
                    self.table["m:latest"] = Profiled("m:latest", pid=1001, port=5001, ctx=self.ctx)
                return self.table["m:latest"]

        self.gateway = MemoryGateway(self, Tuned(["m:latest"]), timed_engine())

    def test_answers_reach_the_tuner(self) -> None:
        hello = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        for body in (
            {"model": "m", "messages": hello},
            {"model": "m", "messages": hello, "stream": True},
            {"model": "m", "messages": hello, "tools": [tool]},
        ):
            status, _, data = self.gateway.post("/v1/chat/completions", body)
            self.assertEqual(status, 200, data)
        for stream in (False, True):
            status, _, data = self.gateway.post("/api/chat", {"model": "m", "messages": hello, "stream": stream})
            self.assertEqual(status, 200, data)
        status, _, data = self.gateway.post("/v1/messages", {"model": "m", "messages": hello, "max_tokens": 8})
        self.assertEqual(status, 200, data)
        self.assertEqual(
            self.tuner.seen,
            [
                ("m:latest", "interactive", False, 62.5, 40, None, 1001),
                ("m:latest", "interactive", False, 62.5, 40, None, 1001),
                ("m:latest", "tool", False, 62.5, 40, None, 1001),
                ("m:latest", "interactive", False, 62.5, 40, None, 1001),  # Ollama's
                ("m:latest", "interactive", False, 62.5, 40, None, 1001),
                ("m:latest", "interactive", False, 62.5, 40, None, 1001),  # Anthropic's
            ],
        )
