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

    def test_client_leaving_mid_connect_is_a_cancellation(self) -> None:
        from twisted.internet.defer import CancelledError
        from twisted.internet.error import DNSLookupError

        # cancelling a connect in progress fails the engine request with
        # the endpoint's own error, synchronously, inside the cancel
        request: Deferred[str] = Deferred(lambda d: d.errback(DNSLookupError("127.0.0.1")))
        d = ensureDeferred(self.proxy._headers(FakeInstance("m"), request))
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_client_leaving_during_a_health_probe_spares_the_child(self) -> None:
        from twisted.internet.defer import CancelledError

        probing: Deferred[bool] = Deferred()

        async def probe(instance: Any) -> bool:
            return await probing

        self.supervisor.probe_health = probe  # type: ignore[method-assign]
        cancelled = []
        request: Deferred[str] = Deferred(lambda d: cancelled.append(True))
        d = ensureDeferred(self.proxy._headers(FakeInstance("m"), request))
        self.clock.advance(10)
        d.cancel()
        self.failureResultOf(d, CancelledError)  # not ChildWedged: nobody kills the child
        self.assertEqual(cancelled, [True])

    def test_errors_pass_through(self) -> None:
        request: Deferred[str] = Deferred()
        d = ensureDeferred(self.proxy._headers(FakeInstance("m"), request))
        request.errback(ConnectionRefusedError("x"))
        self.failureResultOf(d, ConnectionRefusedError)
        self.assertEqual(self.clock.getDelayedCalls(), [])


class PreflightTests(SynchronousTestCase):
    def setUp(self) -> None:
        from pathlib import Path

        from blazar.config import parse_config
        from blazar.models.registry import ModelRegistry
        from blazar.testing import fake_process_reactor, make_test_model

        root = Path(self.mktemp())
        make_test_model(root / "m.gguf")  # 2048 tokens per slot
        reactor = fake_process_reactor()
        registry = ModelRegistry(parse_config(f'models_dir = "{root}"'), reactor)
        self.loaded: dict[str, Any] = {}
        self.plan: Any = None

        async def context_for(_: Any, name: str, ctx_size: int) -> Any:
            return self.plan

        supervisor = type("Sup", (), {
            "loaded": lambda _, name: self.loaded.get(name), "context_for": context_for,
        })()
        self.proxy = EngineProxy(supervisor, None, reactor, registry)  # type: ignore[arg-type]
        self.registry = registry
        self.counted = 0

    def check(self, max_tokens: Any, size: int, tokens: int, ctx: Any = None) -> Any:
        async def count() -> int:
            self.counted += 1
            return tokens

        return ensureDeferred(self.proxy.preflight("m", max_tokens, size, count, ctx))

    def test_small_bodies_are_not_counted(self) -> None:
        self.successResultOf(self.check(100, 500, 10_000))
        self.assertEqual(self.counted, 0)
        self.successResultOf(self.check(None, 10**6, 10_000))
        self.assertEqual(self.counted, 0)

    def test_max_tokens_alone_too_big(self) -> None:
        from blazar.web.proxy import PromptTooLong

        f = self.failureResultOf(self.check(2048, 10, 1), PromptTooLong)
        self.assertIn("2048", str(f.value))
        self.assertIn("ctx_size", str(f.value))
        self.assertEqual(self.counted, 0)

    def test_counted_prompt_over_and_under(self) -> None:
        from blazar.web.proxy import PromptTooLong

        f = self.failureResultOf(self.check(100, 3000, 1990), PromptTooLong)
        self.assertIn("the prompt is 1990 tokens and max_tokens is 100", str(f.value))
        self.successResultOf(self.check(100, 3000, 1900))
        self.assertEqual(self.counted, 2)

    def test_a_loaded_childs_context_is_used_without_reading_the_gguf(self) -> None:
        from blazar.web.proxy import PromptTooLong

        self.loaded["m:latest"] = type("Inst", (), {"ctx": 512})()
        def no_read(*args: Any) -> Any:
            raise AssertionError("the GGUF was read")

        self.registry._read = no_read  # type: ignore[misc]
        f = self.failureResultOf(self.check(600, 10, 1), PromptTooLong)
        self.assertIn("512", str(f.value))

    def test_the_count_is_returned_for_reuse(self) -> None:
        self.assertEqual(self.successResultOf(self.check(100, 3000, 1900)), 1900)
        self.assertIsNone(self.successResultOf(self.check(100, 10, 1900)))

    def test_a_requested_context_is_checked_against_the_planned_one(self) -> None:
        from blazar.engines.supervisor import ContextPlan
        from blazar.web.proxy import PromptTooLong

        self.plan = ContextPlan(8192, 8192, "grow", "m:latest", 32768)
        self.successResultOf(self.check(3000, 3000, 100, ctx=8192))
        # held below what was asked: the 400 says why
        self.plan = ContextPlan(2048, 8192, "grow", "m:latest", 2048)
        f = self.failureResultOf(self.check(3000, 3000, 100, ctx=8192), PromptTooLong)
        self.assertIn("2048-token context", str(f.value))
        self.assertIn("above the 2048-token context 'm:latest' was trained for", str(f.value))
        self.plan = ContextPlan(4096, 65536, "grow", "m:latest", 131072, memory_limit=4096,
                                parallel=4, free=2**30)
        f = self.failureResultOf(self.check(100, 10**6, 5000, ctx=65536), PromptTooLong)
        self.assertIn("does not fit in memory (1.0 GiB free)", str(f.value))
        self.assertIn("lower parallel", str(f.value))
        self.plan = ContextPlan(2048, 8192, "fit", "m:latest", 32768)
        f = self.failureResultOf(self.check(3000, 3000, 100, ctx=8192), PromptTooLong)
        self.assertIn('ctx_policy = "grow"', str(f.value))
