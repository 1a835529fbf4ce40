from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.testing import FakeInstance
from blazar.web.proxy import ChildWedged, EngineProxy


class HealthSupervisor:
    def __init__(self) -> None:
        self.healthy = True
        self.probes = 0

    async def probe_health(self, instance: Any) -> bool:
        self.probes += 1
        return self.healthy


class HeaderTimeoutTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.supervisor = HealthSupervisor()
        self.proxy = EngineProxy(self.supervisor, None, self.clock, header_timeout=10)  # type: ignore[arg-type]

    def test_busy_but_healthy_child_is_waited_for(self) -> None:
        request: Deferred[str] = Deferred()
        d = ensureDeferred(self.proxy._headers(FakeInstance("m"), request))
        for _ in range(25):
            self.clock.advance(1)
        self.assertEqual(self.supervisor.probes, 2)
        self.assertNoResult(d)
        request.callback("response")
        self.assertEqual(self.successResultOf(d), "response")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_silent_child_is_wedged_and_request_cancelled(self) -> None:
        cancelled = []
        request: Deferred[str] = Deferred(lambda d: cancelled.append(True))
        d = ensureDeferred(self.proxy._headers(FakeInstance("m"), request))
        self.supervisor.healthy = False
        self.clock.advance(10)
        self.failureResultOf(d, ChildWedged)
        self.assertEqual(cancelled, [True])

    def test_errors_pass_through(self) -> None:
        request: Deferred[str] = Deferred()
        d = ensureDeferred(self.proxy._headers(FakeInstance("m"), request))
        request.errback(ConnectionRefusedError("x"))
        self.failureResultOf(d, ConnectionRefusedError)
        self.assertEqual(self.clock.getDelayedCalls(), [])
