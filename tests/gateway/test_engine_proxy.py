import json
from typing import Any, cast

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import Config
from blazar.engines.client import EngineClient
from blazar.engines.lease import InstanceLease
from blazar.engines.supervisor import EngineError, Instance
from blazar.engines.supervisor import Supervisor as RealSupervisor
from blazar.gateway.engine_proxy import ChildWedged, EngineProxy
from blazar.testing import FakeEngineClient, FakeInstance, FakeSupervisor


class HealthSupervisor(FakeSupervisor):
    def __init__(self) -> None:
        super().__init__([])
        self.healthy = True
        self.probes = 0

    async def probe_health(self, instance: Any) -> bool:
        self.probes += 1
        return self.healthy


class HeaderTimeoutTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.supervisor = HealthSupervisor()
        self.proxy = EngineProxy(
            cast(RealSupervisor, self.supervisor),
            cast(EngineClient, None),
            self.clock,
            config=lambda: Config(child_header_timeout=10),
        )

    def test_busy_but_healthy_child_is_waited_for(self) -> None:
        request: Deferred[str] = Deferred()
        d = ensureDeferred(self.proxy._headers(cast(Instance, FakeInstance("m")), request))
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
        d = ensureDeferred(self.proxy._headers(cast(Instance, FakeInstance("m")), request))
        self.supervisor.healthy = False
        self.clock.advance(10)
        self.failureResultOf(d, ChildWedged)
        self.assertEqual(cancelled, [True])

    def test_an_sd_server_gets_its_own_long_header_timeout(self) -> None:
        # an sd-server writes its headers only when the whole image is done:
        # sdcpp_child_header_timeout_secs, not child_header_timeout_secs,
        # before its health is asked, and a silent one is wedged then
        self.proxy = EngineProxy(
            cast(RealSupervisor, self.supervisor),
            cast(EngineClient, None),
            self.clock,
            config=lambda: Config(child_header_timeout=10, sdcpp_child_header_timeout=900),
        )
        cancelled = []
        request: Deferred[str] = Deferred(lambda d: cancelled.append(True))
        d = ensureDeferred(self.proxy._headers(cast(Instance, FakeInstance("img", lane="sdcpp")), request))
        self.supervisor.healthy = False
        self.clock.advance(899)
        self.assertEqual(self.supervisor.probes, 0)
        self.assertNoResult(d)
        self.clock.advance(1)
        self.failureResultOf(d, ChildWedged)
        self.assertEqual((self.supervisor.probes, cancelled), (1, [True]))
        chat: Deferred[str] = Deferred(lambda d: None)
        d = ensureDeferred(self.proxy._headers(cast(Instance, FakeInstance("m")), chat))
        self.clock.advance(10)  # a llama-server child: the short one
        self.failureResultOf(d, ChildWedged)

    def test_client_leaving_mid_connect_is_a_cancellation(self) -> None:
        from twisted.internet.defer import CancelledError
        from twisted.internet.error import DNSLookupError

        # cancelling a connect in progress fails the engine request with
        # the endpoint's own error, synchronously, inside the cancel
        request: Deferred[str] = Deferred(lambda d: d.errback(DNSLookupError("127.0.0.1")))
        d = ensureDeferred(self.proxy._headers(cast(Instance, FakeInstance("m")), request))
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_client_leaving_during_a_health_probe_spares_the_child(self) -> None:
        from twisted.internet.defer import CancelledError

        probing: Deferred[bool] = Deferred()

        async def probe(instance: Any) -> bool:
            return await probing

        self.patch(self.supervisor, "probe_health", probe)
        cancelled = []
        request: Deferred[str] = Deferred(lambda d: cancelled.append(True))
        d = ensureDeferred(self.proxy._headers(cast(Instance, FakeInstance("m")), request))
        self.clock.advance(10)
        d.cancel()
        self.failureResultOf(d, CancelledError)  # not ChildWedged: nobody kills the child
        self.assertEqual(cancelled, [True])

    def test_errors_pass_through(self) -> None:
        request: Deferred[str] = Deferred()
        d = ensureDeferred(self.proxy._headers(cast(Instance, FakeInstance("m")), request))
        request.errback(ConnectionRefusedError("x"))
        self.failureResultOf(d, ConnectionRefusedError)
        self.assertEqual(self.clock.getDelayedCalls(), [])


class PreflightTests(SynchronousTestCase):
    def setUp(self) -> None:
        from pathlib import Path

        from blazar.config import parse_config
        from blazar.models.registry import ModelRegistry
        from blazar.models.testmodel import make_test_model
        from blazar.testing import fake_process_reactor

        root = Path(self.mktemp())
        make_test_model(root / "m.gguf")  # 2048 tokens per slot
        reactor = fake_process_reactor()
        registry = ModelRegistry(parse_config(f'models_dir = "{root}"'), reactor)
        self.loaded: dict[str, Any] = {}
        self.plan: Any = None

        async def context_for(_: Any, name: str, ctx_size: int) -> Any:
            return self.plan

        supervisor = type(
            "Sup",
            (),
            {
                "loaded": lambda _, name: self.loaded.get(name),
                "context_for": context_for,
            },
        )()
        self.proxy = EngineProxy(supervisor, cast(EngineClient, None), reactor, registry)
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
        from blazar.gateway.engine_proxy import PromptTooLong

        f = self.failureResultOf(self.check(2048, 10, 1), PromptTooLong)
        self.assertIn("2048", str(f.value))
        self.assertIn("ctx_size", str(f.value))
        self.assertEqual(self.counted, 0)

    def test_counted_prompt_over_and_under(self) -> None:
        from blazar.gateway.engine_proxy import PromptTooLong

        f = self.failureResultOf(self.check(100, 3000, 1990), PromptTooLong)
        self.assertIn("the prompt is 1990 tokens and max_tokens is 100", str(f.value))
        self.successResultOf(self.check(100, 3000, 1900))
        self.assertEqual(self.counted, 2)

    def test_a_loaded_childs_context_is_used_without_reading_the_gguf(self) -> None:
        from blazar.gateway.engine_proxy import PromptTooLong

        self.loaded["m:latest"] = type("Inst", (), {"ctx": 512})()

        def no_read(*args: Any) -> Any:
            raise AssertionError("the GGUF was read")

        self.registry._read = no_read
        f = self.failureResultOf(self.check(600, 10, 1), PromptTooLong)
        self.assertIn("512", str(f.value))

    def test_the_count_is_returned_for_reuse(self) -> None:
        self.assertEqual(self.successResultOf(self.check(100, 3000, 1900)), 1900)
        self.assertIsNone(self.successResultOf(self.check(100, 10, 1900)))

    def test_a_requested_context_is_checked_against_the_planned_one(self) -> None:
        from blazar.engines.supervisor import ContextPlan
        from blazar.gateway.engine_proxy import PromptTooLong

        self.plan = ContextPlan(8192, 8192, "grow", "m:latest", 32768)
        self.successResultOf(self.check(3000, 3000, 100, ctx=8192))
        # held below what was asked: the 400 says why
        self.plan = ContextPlan(2048, 8192, "grow", "m:latest", 2048)
        f = self.failureResultOf(self.check(3000, 3000, 100, ctx=8192), PromptTooLong)
        self.assertIn("2048-token context", str(f.value))
        self.assertIn("above the 2048-token context 'm:latest' was trained for", str(f.value))
        self.plan = ContextPlan(4096, 65536, "grow", "m:latest", 131072, memory_limit=4096, parallel=4, free=2**30)
        f = self.failureResultOf(self.check(100, 10**6, 5000, ctx=65536), PromptTooLong)
        self.assertIn("does not fit in memory (1.0 GiB free)", str(f.value))
        self.assertIn("lower parallel", str(f.value))
        self.plan = ContextPlan(2048, 8192, "fit", "m:latest", 32768)
        f = self.failureResultOf(self.check(3000, 3000, 100, ctx=8192), PromptTooLong)
        self.assertIn('ctx_policy = "grow"', str(f.value))

    def test_a_prompt_too_large_by_its_size_alone_is_not_counted(self) -> None:
        from blazar.gateway.engine_proxy import PromptTooLong

        async def count() -> int:
            self.counted += 1
            return 1

        f = self.failureResultOf(
            ensureDeferred(self.proxy.preflight("m", 100, 10**6, count, floor=1990)), PromptTooLong
        )
        self.assertIn("at least 1990 tokens (by its size)", str(f.value))
        self.assertEqual(self.counted, 0)
        self.successResultOf(ensureDeferred(self.proxy.preflight("m", 100, 10**6, count, floor=1000)))
        self.assertEqual(self.counted, 1)

    def test_counts_are_bounded_per_model_and_have_a_deadline(self) -> None:
        from blazar.gateway.engine_proxy import COUNT_DEADLINE_SECS, COUNTS_PER_MODEL, EngineRejected

        started: list[Deferred[int]] = []

        async def count() -> int:
            d: Deferred[int] = Deferred()
            started.append(d)
            return await d

        checks = [ensureDeferred(self.proxy.preflight("m", 100, 10**6, count)) for _ in range(COUNTS_PER_MODEL + 1)]
        self.assertEqual(len(started), COUNTS_PER_MODEL)  # the last waits its turn
        started[0].callback(10)
        self.assertEqual(self.successResultOf(checks[0]), 10)
        self.assertEqual(len(started), COUNTS_PER_MODEL + 1)
        self.proxy._clock.advance(COUNT_DEADLINE_SECS)
        for late in checks[1:]:
            f = self.failureResultOf(late, EngineRejected)
            self.assertEqual(f.value.status, 503)
            self.assertIn("send it again shortly", str(f.value))
        self.assertTrue(all(d.called for d in started))  # the counts were cancelled (their requests closed)
        self.assertEqual(self.proxy._counts, {})


class ScriptedEngines(FakeEngineClient):
    """
    An engine client whose requests end, in turn, as C{outcomes} say: an
    exception is raised, a callable is called first (a test's way to change
    the world as a request goes out), anything else is a 200 response.
    C{routed} records C{(url, stream)}.
    """

    def __init__(self, *outcomes: Any) -> None:
        super().__init__(None)
        self.outcomes = list(outcomes)
        self.routed: list[tuple[str, bool]] = []

    async def request(self, method: str, url: str, body: Any, headers: Any, stream: bool = True) -> Any:
        self.routed.append((url, stream))
        outcome = self.outcomes.pop(0)
        if callable(outcome):
            outcome = outcome()
        if isinstance(outcome, BaseException):
            raise outcome
        return type("Response", (), {"code": 200})()


class ChildExitedTests(SynchronousTestCase):
    """
    A request that reaches a child which had already exited (its exit
    reported or not) goes to a fresh child; one the child may have read
    fails (running it twice could duplicate a generation).
    """

    def setUp(self) -> None:
        import attrs

        @attrs.define
        class ExplainingSupervisor(FakeSupervisor):
            explained: list[BaseException] = attrs.field(factory=list)

            async def explain_failure(self, instance: Any, error: BaseException) -> EngineError:
                # the real one waits up to 2 s for the exit to be reported
                self.explained.append(error)
                return await super().explain_failure(instance, error)

        self.clock = Clock()
        self.supervisor = ExplainingSupervisor(["m:latest"])
        self.first = self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))

    def send(self, engines: ScriptedEngines, stream: bool = False) -> Deferred[Any]:
        proxy = EngineProxy(cast(RealSupervisor, self.supervisor), cast(EngineClient, engines), self.clock)
        return ensureDeferred(proxy.send("m", "/v1/chat/completions", b"{}", stream=stream))

    def reset(self) -> Any:
        from twisted.internet.error import ConnectionLost
        from twisted.python.failure import Failure
        from twisted.web._newclient import ResponseNeverReceived

        from blazar.engines.client import NotDelivered

        return NotDelivered(ResponseNeverReceived([Failure(ConnectionLost())]))

    def clean_close(self) -> Any:
        from twisted.internet.error import ConnectionDone
        from twisted.python.failure import Failure
        from twisted.web._newclient import ResponseNeverReceived

        return ResponseNeverReceived([Failure(ConnectionDone())])

    def test_a_child_that_had_exited_unreported_hands_the_request_to_a_fresh_one(self) -> None:
        from twisted.internet.error import ConnectionRefusedError

        from blazar.engines.client import NotDelivered

        for stream, error in [(False, self.reset()), (True, NotDelivered(ConnectionRefusedError()))]:
            self.first.alive = False  # a zombie: exited, not yet reaped
            engines = ScriptedEngines(error, 200)
            lease, response = self.successResultOf(self.send(engines, stream))
            instance = lease.instance
            self.assertIsNot(instance, self.first)
            self.assertEqual(self.first.state, "dead")
            self.assertEqual((self.first.in_flight, instance.in_flight), (0, 1))
            self.assertEqual(len(engines.routed), 2)
            self.assertEqual(self.supervisor.explained, [])  # no wait for the exit report
            lease.release()  # the caller's, once the answer is read
            self.first = instance
        self.assertEqual(self.supervisor.started, 3)

    def test_a_live_child_gets_it_again_on_a_fresh_connection(self) -> None:
        engines = ScriptedEngines(self.reset(), 200)
        lease, _ = self.successResultOf(self.send(engines))
        self.assertIs(lease.instance, self.first)
        self.assertEqual([stream for _, stream in engines.routed], [False, True])
        self.assertEqual(self.supervisor.started, 1)

    def test_exiting_when_asked_exited_by_the_second_try(self) -> None:
        from twisted.internet.error import ConnectionRefusedError

        from blazar.engines.client import NotDelivered

        def refused_now_gone() -> Exception:
            self.first.alive = False
            return NotDelivered(ConnectionRefusedError())

        engines = ScriptedEngines(self.reset(), refused_now_gone, 200)
        lease, _ = self.successResultOf(self.send(engines))
        self.assertIsNot(lease.instance, self.first)
        self.assertEqual(len(engines.routed), 3)

    def test_a_clean_close_from_a_child_now_dead_is_a_crash(self) -> None:
        from blazar.engines.client import StaleConnection
        from blazar.engines.supervisor import EngineCrashed

        # at once on a kept connection, or on a streamed request's own
        for stream, error in [(False, StaleConnection(self.clean_close())), (True, self.clean_close())]:
            self.first.alive = False
            engines = ScriptedEngines(error, 200)
            self.failureResultOf(self.send(engines, stream), EngineCrashed)
            self.assertEqual(len(engines.routed), 1)  # not run again
            self.assertEqual(self.first.in_flight, 0)
            self.first = self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))

    def test_an_answer_that_had_begun_is_a_crash(self) -> None:
        from twisted.internet.error import ConnectionLost
        from twisted.python.failure import Failure
        from twisted.web._newclient import ResponseFailed

        from blazar.engines.supervisor import EngineCrashed

        self.first.alive = False
        engines = ScriptedEngines(ResponseFailed([Failure(ConnectionLost())]), 200)
        self.failureResultOf(self.send(engines), EngineCrashed)
        self.assertEqual(len(engines.routed), 1)

    def test_a_fresh_child_dead_on_arrival_too_is_a_502_not_a_loop(self) -> None:
        from blazar.engines.supervisor import EngineCrashed

        def dies() -> Exception:
            for instance in self.supervisor.table.values():
                instance.alive = False
            return self.reset()

        engines = ScriptedEngines(dies, dies, 200)
        self.failureResultOf(self.send(engines), EngineCrashed)
        self.assertEqual(len(engines.routed), 2)
        self.assertEqual(self.supervisor.started, 2)


class TemplateProbeTests(SynchronousTestCase):
    """
    Whether a child's template takes a mid-conversation system message is
    asked once per child, shared by concurrent first requests, and asked
    again of a new child (its file may have changed).
    """

    def setUp(self) -> None:
        self.children: dict[str, FakeInstance] = {}
        self.accepting: dict[int, bool] = {}
        self.sent: list[Deferred[Any]] = []
        proxy = self

        class Supervisor:
            def loaded(self, name: str) -> Any:
                return proxy.children.get(name)

        class Probing(EngineProxy):
            async def send(self, model: str, path: str, body: bytes, *args: Any, **kw: Any) -> Any:
                assert path == "/apply-template"
                d: Deferred[Any] = Deferred()
                proxy.sent.append(d)
                instance = await d
                return InstanceLease(None, instance), None

            async def read(self, instance: Any, response: Any) -> bytes:
                from blazar.gateway import placement

                return json.dumps(
                    {
                        "prompt": "blazar-probe-assistant " + placement.MARK + " blazar-probe-user-2"
                        if proxy.accepting[id(instance)]
                        else "no"
                    }
                ).encode()

        self.proxy = Probing(cast(RealSupervisor, Supervisor()), cast(EngineClient, None), Clock())

    def child(self, accepts: bool) -> FakeInstance:
        instance = FakeInstance("m")
        self.accepting[id(instance)] = accepts
        self.children["m"] = instance
        return instance

    def test_one_probe_per_child_shared_by_concurrent_requests(self) -> None:
        waits = [ensureDeferred(self.proxy.mid_system_ok("m")) for _ in range(5)]
        self.assertEqual(len(self.sent), 1)
        first = self.child(accepts=True)
        self.sent[0].callback(first)
        self.assertEqual([self.successResultOf(d) for d in waits], [True] * 5)
        self.assertEqual(first.in_flight, 0)
        self.assertTrue(self.successResultOf(ensureDeferred(self.proxy.mid_system_ok("m"))))
        self.assertEqual(len(self.sent), 1)  # cached for that child
        # a new child (restarted on a changed file) is asked again
        second = self.child(accepts=False)
        d = ensureDeferred(self.proxy.mid_system_ok("m"))
        self.assertEqual(len(self.sent), 2)
        self.sent[1].callback(second)
        self.assertFalse(self.successResultOf(d))

    def test_a_waiter_that_leaves_does_not_stop_the_probe(self) -> None:
        from twisted.internet.defer import CancelledError

        leaving = ensureDeferred(self.proxy.mid_system_ok("m"))
        staying = ensureDeferred(self.proxy.mid_system_ok("m"))
        leaving.cancel()
        self.failureResultOf(leaving, CancelledError)
        self.sent[0].callback(self.child(accepts=True))
        self.assertTrue(self.successResultOf(staying))
