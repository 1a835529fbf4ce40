"""
Tools offered to a model whose chat template renders none are refused on
every surface (issue 35 item 5), through the real surfaces and pipeline
(StubTreq, a fake engine): unless forced, C{tool_choice} none, or the
operator gives llama-server a template of their own.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.models.testmodel import make_test_model
from blazar.testing import FakeSupervisor, fake_engine_app
from tests.web.gateway import MemoryGateway

NO_TOOLS = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "hi"}]


def asks(model: str, **extra: Any) -> dict[str, dict[str, Any]]:
    return {
        "/v1/chat/completions": {"model": model, "messages": HI, "tools": [TOOL], **extra},
        "/api/chat": {"model": model, "messages": HI, "tools": [TOOL], "stream": False, **extra},
        "/v1/messages": {
            "model": model,
            "max_tokens": 8,
            "messages": HI,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        },
        "/v1/responses": {
            "model": model,
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        },
    }


class ToolsSeenTests(SynchronousTestCase):
    def build(self, config: str = "") -> None:
        self.app = fake_engine_app("plain:latest")
        self.gateway = MemoryGateway(
            self, FakeSupervisor(["plain:latest", "m:latest"]), self.app, models=("plain", "m"), config=config
        )
        make_test_model(self.gateway.root / "plain.gguf", seed=3, chat_template=NO_TOOLS)

    def test_refused_on_every_surface_before_the_engine(self) -> None:
        self.build()
        for path, body in asks("plain").items():
            status, _, data = self.gateway.post(path, body)
            self.assertEqual(status, 400, (path, data))
            self.assertIn(b"does not support tools", data, path)
        self.assertEqual(self.app.requests, [])

    def test_a_template_with_tools_none_and_the_operators_template_are_served(self) -> None:
        self.build()
        for path, body in asks("m").items():
            self.assertEqual(self.gateway.post(path, body)[0], 200, path)
        status, _, data = self.gateway.post(
            "/v1/chat/completions", {"model": "plain", "messages": HI, "tools": [TOOL], "tool_choice": "none"}
        )
        self.assertEqual(status, 200, data)
        self.build('[models."plain"]\nargs = ["--chat-template-file", "/etc/tools.jinja"]\n')
        status, _, data = self.gateway.post("/v1/chat/completions", {"model": "plain", "messages": HI, "tools": [TOOL]})
        self.assertEqual(status, 200, data)

    def test_the_message_names_the_fixes(self) -> None:
        self.build()
        _, _, data = self.gateway.post("/v1/chat/completions", {"model": "plain", "messages": HI, "tools": [TOOL]})
        error = json.loads(data)["error"]
        self.assertEqual((error["code"], error["param"]), ("model_not_supported", "model"))
        for fix in ("tool_choice", "--chat-template-file", '[models."plain:latest"]'):
            self.assertIn(fix, error["message"])
