"""
The one request path: every surface's request goes through the same steps
of L{blazar.gateway.pipeline.Pipeline}, in the same order, and so fails the
same way when two steps would refuse it. Through the real surfaces, the
real pipeline and the real registry in memory (StubTreq, a fake engine);
the steps are observed by wrapping them (each wrapper calls the real step
and only notes its name).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import KeyConfig
from blazar.testing import FakeSupervisor, fake_engine_app
from tests.web.gateway import MemoryGateway

HELLO = [{"role": "user", "content": "hi"}]


def requests(model: str, max_tokens: int = 8) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "openai": ("/v1/chat/completions", {"model": model, "messages": HELLO, "max_tokens": max_tokens}),
        "responses": ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": max_tokens}),
        "anthropic": ("/v1/messages", {"model": model, "max_tokens": max_tokens, "messages": HELLO}),
        "ollama": (
            "/api/chat",
            {"model": model, "messages": HELLO, "stream": False, "options": {"num_predict": max_tokens}},
        ),
    }


class OnePathTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.steps: list[str] = []
        steps = self.steps

        class Observed(FakeSupervisor):
            async def instance_for(self, name: str, ctx_size: int | None = None) -> Any:
                steps.append("lease")
                return await super().instance_for(name, ctx_size)

        self.gateway = MemoryGateway(
            self,
            Observed(["m:latest", "e:latest"]),
            fake_engine_app("m:latest"),
            models=("m", "e"),
            config='[models."e"]\nembedding = true\n',
            admission=True,
        )
        self.gate = self.gateway.capture
        self.pipeline, self.proxy = self.gateway.pipeline, self.gateway.proxy
        self.observe(self.pipeline, "_scope", "scope")
        self.observe(self.pipeline, "_purpose", "purpose")
        self.observe(self.proxy, "place_system_messages", "placement")
        self.observe(self.proxy, "preflight", "preflight")
        self.observe(self.pipeline, "_admit", "admission")
        self.observe(self.proxy, "send", "send")

    def observe(self, owner: Any, name: str, step: str) -> None:
        real = getattr(owner, name)

        def noted(*args: Any, **kwargs: Any) -> Any:
            self.steps.append(step)
            return real(*args, **kwargs)

        self.patch(owner, name, noted)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        status, _, data = self.gateway.post(path, body)
        return status, json.loads(data)

    def test_every_surface_runs_the_same_steps_in_the_same_order(self) -> None:
        seen = {}
        for surface, (path, body) in requests("m").items():
            del self.steps[:]
            status, answer = self.post(path, body)
            self.assertEqual(status, 200, (surface, answer))
            # the scope step resolves the model, so later steps do not ask for it again
            seen[surface] = list(dict.fromkeys(self.steps))
        expected = ["scope", "purpose", "placement", "preflight", "admission", "lease", "send"]
        self.assertEqual(seen, {surface: expected for surface in seen})

    def test_scope_before_purpose_before_preflight_on_every_surface(self) -> None:
        def statuses(model: str, max_tokens: int = 8) -> dict[str, int]:
            return {surface: self.post(path, body)[0] for surface, (path, body) in requests(model, max_tokens).items()}

        # a chat request for an embedding model: refused by purpose (400) ...
        self.assertEqual(statuses("e"), dict.fromkeys(requests("e"), 400))
        # ... before the preflight would look at its context
        for surface, (path, body) in requests("e", 10**7).items():
            status, answer = self.post(path, body)
            self.assertEqual(status, 400, surface)
            self.assertIn("embedding", json.dumps(answer), surface)
        # a scoped key that may not use it: the model does not exist (404), on every surface
        self.gate.key = KeyConfig("scoped", "x" * 16, models=("m:latest",))
        self.assertEqual(statuses("e"), dict.fromkeys(requests("e"), 404))
        self.assertEqual(statuses("m"), dict.fromkeys(requests("m"), 200))
        # the preflight before admission and the engine: nothing was sent for these
        del self.steps[:]
        for surface, (path, body) in requests("m", 10**7).items():
            self.assertEqual(self.post(path, body)[0], 400, surface)
        self.assertNotIn("admission", self.steps)
        self.assertNotIn("send", self.steps)

    def test_the_preflight_names_each_apis_own_field(self) -> None:
        fields = {
            "openai": "max_tokens",
            "responses": "max_output_tokens",
            "anthropic": "max_tokens",
            "ollama": "num_predict",
        }
        for surface, (path, body) in requests("m", 10**7).items():
            status, answer = self.post(path, body)
            self.assertEqual(status, 400, surface)
            message = json.dumps(answer)
            self.assertIn(f"{fields[surface]} = 10000000 does not fit", message, surface)
            if surface in ("openai", "responses"):
                self.assertEqual(answer["error"]["param"], fields[surface], surface)


class PromptTextBytesTests(SynchronousTestCase):
    """
    What the prompt floor measures: text every template renders, nothing
    a template may leave out.
    """

    def test_messages_and_prompts(self) -> None:
        from blazar.gateway.pipeline import prompt_text_bytes

        self.assertEqual(
            prompt_text_bytes(
                {
                    "messages": [
                        {"role": "system", "content": "héllo"},  # 6 bytes
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": "abc"}, {"type": "image_url", "image_url": {}}],
                        },
                        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "x" * 99}}]},
                        {"role": "tool", "name": "n" * 50, "content": "1234"},
                        "junk",
                    ],
                    "tools": [{"x": "y" * 1000}],
                }
            ),
            13,
        )
        self.assertEqual(prompt_text_bytes({"prompt": ["ab", "abcd", 3]}), 4)
        self.assertEqual(prompt_text_bytes({"prompt": "\ud800x"}), 4)  # a lone surrogate: not an error
        self.assertEqual(prompt_text_bytes({"input": "x"}), 0)
