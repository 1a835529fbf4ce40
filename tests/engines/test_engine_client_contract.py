"""
The engine-client fake keeps the IEngineClient contract
(tests/engines/engine_client_contract.py) that the real client keeps
against a real llama-server (tests/integration/test_engine_client_e2e.py).
"""

from __future__ import annotations

from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import SynchronousTestCase

from blazar.testing import FakeEngineClient, StubEngineClient, fake_engine_app
from tests.engines.engine_client_contract import check_engine_client


class FakeEngineClientContractTests(SynchronousTestCase):
    def check(self, make: Any) -> None:
        http = StubTreq(fake_engine_app("m:latest").resource())

        async def read(response: Any) -> bytes:
            return bytes(await response.content())

        d = ensureDeferred(check_engine_client(make(http), "http://127.0.0.1:8080", {}, read))
        for _ in range(40):
            http.flush()
        self.successResultOf(d)

    def test_stub_engine_client(self) -> None:
        self.check(StubEngineClient)

    def test_fake_engine_client(self) -> None:
        self.check(FakeEngineClient)
