"""
A Responses request with C{store: true} whose response cannot be stored
(the shared store is down: L{blazar.store.StoreUnavailable}) is not a
success: the client would get an id it cannot continue from (issue 42's
"nothing accepted is lost"). Non-streamed: 503 C{store_unavailable}
naming the store; streamed: the stream ends with C{response.failed}
instead of C{response.completed}. With C{store: false} nothing changes.
Through the real surfaces in memory (StubTreq, a fake engine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.trial.unittest import SynchronousTestCase

from blazar import store
from blazar.config import parse_config
from blazar.engines.client import EngineClient
from blazar.engines.supervisor import Supervisor
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.service import build_gateway
from blazar.testing import FakeSupervisor, StubEngineClient, fake_engine_app, fake_process_reactor
from tests.typed import StubTreq

DOWN = "PostgreSQL at 10.0.0.5:5432 is unreachable: connection refused"


class StoreDownTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp()).absolute()
        make_test_model(root / "m.gguf")
        reactor = fake_process_reactor()
        config = parse_config(f'models_dir = "{root}"')
        self.engine = StubTreq(fake_engine_app("m:latest").resource())
        self.writes: list[Any] = []
        self.down = True

        def run_db(f: Any, *args: Any) -> Deferred[Any]:
            if f is store.thd_put_response:
                self.writes.append(args[0])
                if self.down:
                    return fail(store.StoreUnavailable(DOWN))
                return succeed(None)
            return succeed(None)

        gateway = build_gateway(
            ModelRegistry(config, reactor),
            cast(Supervisor, FakeSupervisor(["m:latest"])),
            cast(EngineClient, StubEngineClient(self.engine)),
            reactor,
            lambda: config,
            run_db=run_db,
            wall=lambda: 1000.0,
        )
        self.client = StubTreq(gateway.router())

    def post(self, body: dict[str, Any]) -> tuple[int, bytes]:
        d = self.client.request("POST", "http://localhost/v1/responses", data=json.dumps(body).encode())
        for _ in range(20):
            self.client.flush()
            self.engine.flush()
        response = self.successResultOf(d)
        return response.code, self.successResultOf(response.content())

    def events(self, data: bytes) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for block in data.decode().split("\n\n"):
            if block.strip() and not block.startswith(":"):
                fields = dict(line.split(": ", 1) for line in block.split("\n"))
                out.append((fields["event"], json.loads(fields["data"])))
        return out

    def test_unstored_answer_is_503_naming_the_store(self) -> None:
        code, body = self.post({"model": "m", "input": "hi", "store": True})
        self.assertEqual(code, 503)
        error = json.loads(body)["error"]
        self.assertEqual(error["code"], "store_unavailable")
        self.assertIn("PostgreSQL at 10.0.0.5:5432 is unreachable", error["message"])
        self.assertEqual(len(self.writes), 1)

    def test_unstored_stream_ends_failed_not_completed(self) -> None:
        code, body = self.post({"model": "m", "input": "hi", "store": True, "stream": True})
        self.assertEqual(code, 200)
        events = self.events(body)
        kinds = [kind for kind, _ in events]
        self.assertNotIn("response.completed", kinds)
        self.assertEqual(kinds[-1], "response.failed")
        failed = events[-1][1]["response"]
        self.assertEqual(failed["error"]["code"], "store_unavailable")
        self.assertIn("not stored", failed["error"]["message"])
        self.assertIn("response.output_text.done", kinds)  # the answer itself came whole

    def test_stored_stream_still_completes(self) -> None:
        self.down = False
        code, body = self.post({"model": "m", "input": "hi", "store": True, "stream": True})
        self.assertEqual(code, 200)
        kinds = [kind for kind, _ in self.events(body)]
        self.assertEqual(kinds[-1], "response.completed")
        self.assertEqual(kinds.count("response.completed"), 1)

    def test_store_false_never_writes(self) -> None:
        code, body = self.post({"model": "m", "input": "hi", "store": False})
        self.assertEqual(code, 200)
        self.assertEqual(self.writes, [])
        code, body = self.post({"model": "m", "input": "hi", "store": False, "stream": True})
        self.assertEqual(self.events(body)[-1][0], "response.completed")
