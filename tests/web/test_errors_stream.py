"""
An OpenAI stream that fails after its headers went out (a model's load
fails after the C{: loading} comments) ends with a C{data:} error event
that carries the C{type} and C{code} the same error gets as a whole
answer: the one table's category, not a blanket C{engine_error}.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from blazar.testing import fake_engine_app
from tests.web.gateway import MemoryGateway
from tests.web.test_error_table import CASES, HELLO, Bug, Failing


class OpenAIStreamErrorTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.supervisor = Failing(["m:latest"])
        self.gateway = MemoryGateway(self, self.supervisor, fake_engine_app("m:latest"))

    def test_an_error_event_has_its_categorys_type_and_code(self) -> None:
        for error, _, _, kind, openai_type, code in CASES:
            self.supervisor.failure = error
            where = f"{type(error).__name__}({error})"
            status, _, data = self.gateway.post(
                "/v1/chat/completions", {"model": "m", "messages": HELLO, "stream": True}
            )
            self.assertEqual(status, 200, where)  # the loading comments went out first
            self.assertTrue(data.startswith(b": loading\n\n"), where)
            last = data.strip().split(b"\n\n")[-1]
            self.assertTrue(last.startswith(b"data: "), where)
            event = json.loads(last[len(b"data: ") :])["error"]
            self.assertEqual((event["type"], event["code"]), (openai_type, code), where)
            self.assertEqual(set(event), {"message", "type", "param", "code"}, where)
            self.assertNotIn(b"[DONE]", data, where)
        self.assertEqual(len(self.flushLoggedErrors(Bug)), 1)
