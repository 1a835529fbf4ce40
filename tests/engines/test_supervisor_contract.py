"""
One behavioural contract for L{ISupervisor}, run against the fake
(L{blazar.testing.FakeSupervisor}) and the real L{Supervisor} (on a
C{MemoryReactorClock} with faked processes and a faked C{/health}), so a
surface test that passes on the fake says something about the product.

Each implementation supplies a few hooks that play the child's part:
L{SupervisorContract.settle}, L{advance}, L{silence}, L{die},
L{exit_reported} and L{finish_stop}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web._newclient import ResponseNeverReceived
from zope.interface.verify import verifyObject

from blazar.config import parse_config
from blazar.engines.llamacpp import DEFAULT_PARALLEL
from blazar.engines.supervisor import (
    EngineCrashed,
    IInstance,
    InstanceState,
    InstanceView,
    ISupervisor,
    Supervisor,
)
from blazar.models.registry import ModelNotFound, ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.testing import FakeInstance, FakeSupervisor, fake_process_reactor
from tests.typed import TestCaseMixin


class SupervisorContract(TestCaseMixin):
    """
    The assertions; mixed into one L{SynchronousTestCase} per
    implementation, which sets C{self.supervisor} and the hooks.
    """

    supervisor: Any

    # -- hooks --------------------------------------------------------------

    def settle(self) -> None:
        """
        Let pending work run (spawns, readiness).
        """
        raise NotImplementedError

    def advance(self, seconds: float) -> None:
        raise NotImplementedError

    def silence(self, instance: Any) -> None:
        """
        The child stops answering C{/health} (it keeps running).
        """
        raise NotImplementedError

    def die(self, instance: Any) -> None:
        """
        The child exits; its exit is not reported yet.
        """
        raise NotImplementedError

    def exit_reported(self, instance: Any) -> None:
        """
        The exit of a child that died is reported.
        """
        raise NotImplementedError

    def finish_stop(self, instance: Any) -> None:
        """
        A child that was told to stop exits.
        """
        raise NotImplementedError

    # -- helpers ------------------------------------------------------------

    def ready(self, name: str = "m") -> Any:
        d = ensureDeferred(self.supervisor.instance_for(name))
        self.settle()
        return self.successResultOf(d)

    def probe(self, instance: Any) -> Deferred[bool]:
        return Deferred.fromCoroutine(self.supervisor.probe_health(instance))

    # -- the contract -------------------------------------------------------

    def test_provides_the_interfaces(self) -> None:
        self.assertTrue(verifyObject(ISupervisor, self.supervisor))
        self.assertTrue(verifyObject(IInstance, self.ready()))

    def test_instance_for_gives_a_ready_instance(self) -> None:
        instance = self.ready("m")
        self.assertEqual(instance.entry.name, "m:latest")
        self.assertEqual(instance.state, InstanceState.READY)
        self.assertIsNotNone(instance.pid)
        self.assertIsNotNone(instance.ready_at)
        self.assertIs(self.successResultOf(instance.wait_ready()), instance)
        self.assertIs(self.supervisor.loaded("m:latest"), instance)
        self.assertEqual(list(self.supervisor.instances()), [instance])

    def test_one_instance_per_model(self) -> None:
        first = self.ready("m")
        self.assertIs(self.ready("m:latest"), first)

    def test_unknown_model(self) -> None:
        d = ensureDeferred(self.supervisor.instance_for("nope"))
        self.settle()
        self.failureResultOf(d, ModelNotFound)

    def test_touch_and_keep_alive(self) -> None:
        instance = self.ready()
        served = instance.served
        self.advance(5.0)
        self.supervisor.touch(instance, 30.0)
        self.assertEqual(instance.served, served + 1)
        self.assertEqual(instance.keep_alive, 30.0)
        self.assertEqual(instance.expires_at(), instance.last_used + 30.0)
        self.supervisor.touch(instance)  # keeps the request's keep_alive
        self.assertEqual(instance.keep_alive, 30.0)
        self.supervisor.touch(instance, -1.0)  # forever
        self.assertIsNone(instance.expires_at())

    def test_stop_instance(self) -> None:
        instance = self.ready()
        stopped = self.supervisor.stop_instance(instance, "keep_alive 0")
        self.assertIsNone(self.supervisor.loaded("m:latest"))
        self.finish_stop(instance)
        self.successResultOf(stopped)
        self.assertEqual(instance.state, InstanceState.DEAD)
        self.assertNotIn(instance, self.supervisor.instances())
        self.assertIsNot(self.ready(), instance)

    def test_kill_instance(self) -> None:
        instance = self.ready()
        killed = self.supervisor.kill_instance(instance, "wedged: no response headers")
        self.assertIsNone(self.supervisor.loaded("m:latest"))
        self.finish_stop(instance)
        self.successResultOf(killed)
        self.assertEqual(instance.state, InstanceState.DEAD)

    def test_evict(self) -> None:
        instance = self.ready()
        self.assertEqual(list(self.supervisor.evict("m#1")), [])
        self.assertEqual(list(self.supervisor.evict("other")), [])
        self.assertEqual(list(self.supervisor.evict("m@text")), [instance])
        self.assertIsNone(self.supervisor.loaded("m:latest"))

    def test_probe_health_of_an_answering_child(self) -> None:
        self.assertIs(self.successResultOf(self.probe(self.ready())), True)

    def test_probe_health_false_on_a_dead_child(self) -> None:
        instance = self.ready()
        self.die(instance)
        self.assertIs(self.successResultOf(self.probe(instance)), False)

    def test_probe_health_false_after_3s_of_silence(self) -> None:
        instance = self.ready()
        self.silence(instance)
        d = self.probe(instance)
        self.advance(2.9)
        self.assertNoResult(d)
        self.advance(0.1)
        self.assertIs(self.successResultOf(d), False)

    def test_probe_health_propagates_the_callers_cancellation(self) -> None:
        """
        A client that leaves while its request waits on a probe: a
        cancellation, never "unhealthy", and the child is left alone.
        """
        instance = self.ready()
        self.silence(instance)
        d = self.probe(instance)
        self.advance(1.0)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.advance(5.0)  # the probe's own timer is gone: nothing fires later
        self.assertIs(self.supervisor.loaded("m:latest"), instance)
        self.assertEqual(instance.state, InstanceState.READY)
        self.assertFalse(self.supervisor.exited(instance))

    def test_exited_false_while_the_child_runs(self) -> None:
        instance = self.ready()
        self.assertFalse(self.supervisor.exited(instance))
        self.assertEqual(instance.state, InstanceState.READY)

    def test_exited_finds_an_unreported_exit(self) -> None:
        instance = self.ready()
        self.die(instance)
        self.assertTrue(self.supervisor.exited(instance))
        self.assertEqual(instance.state, InstanceState.DEAD)
        self.assertIsNone(self.supervisor.loaded("m:latest"))
        self.assertIsNot(self.ready(), instance)

    def test_explain_failure_of_a_crashed_child(self) -> None:
        instance = self.ready()
        self.die(instance)
        explained = ensureDeferred(self.supervisor.explain_failure(instance, ConnectionError("reset")))
        self.exit_reported(instance)
        error = self.successResultOf(explained)
        self.assertIsInstance(error, EngineCrashed)
        self.assertEqual(error.model, "m:latest")
        self.assertEqual(instance.state, InstanceState.DEAD)
        self.assertIsNone(self.supervisor.loaded("m:latest"))

    def test_snapshot(self) -> None:
        instance = self.ready()
        self.supervisor.touch(instance, 30.0)
        instance.in_flight += 1
        (view,) = self.supervisor.snapshot()
        self.assertIsInstance(view, InstanceView)
        self.assertEqual(
            (view.name, view.entry, view.state, view.pid, view.port, view.ctx),
            ("m:latest", instance.entry, InstanceState.READY, instance.pid, instance.port, instance.ctx),
        )
        slots = instance.entry.settings.parallel or DEFAULT_PARALLEL
        self.assertEqual((view.in_flight, view.busy, view.slots), (1, 1, slots))
        self.assertEqual(view.expires_at, instance.expires_at())
        self.assertEqual((view.ready_at, view.served), (instance.ready_at, instance.served))
        self.assertEqual(view.breaker, "closed")
        self.assertTrue(view.live)
        self.assertIsNone(view.rss)
        with self.assertRaises(attrs.exceptions.FrozenInstanceError):
            view.in_flight = 0
        # a view is a copy: later changes are not in it
        instance.in_flight -= 1
        self.assertEqual(view.in_flight, 1)
        self.supervisor.stop_instance(instance, "requested")
        self.finish_stop(instance)
        self.assertEqual(self.supervisor.snapshot(), [])

    def test_breakers(self) -> None:
        self.ready()
        self.assertEqual(self.supervisor.breaker("m:latest").state, "closed")
        self.assertEqual(self.supervisor.reset_breakers("m:latest"), ["m:latest"])
        self.assertEqual(self.supervisor.reset_breakers("never-loaded"), [])

    def test_ctx_policy_and_context_for(self) -> None:
        self.assertEqual(self.supervisor.ctx_policy, "grow")
        d = ensureDeferred(self.supervisor.context_for("m:latest", 512))
        self.settle()
        plan = self.successResultOf(d)
        self.assertEqual((plan.model, plan.asked, plan.policy), ("m:latest", 512, "grow"))
        self.assertGreaterEqual(plan.ctx, 512)


class FakeSupervisorContractTests(SupervisorContract, SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.supervisor = FakeSupervisor(["m:latest"], clock=self.clock)

    def settle(self) -> None:
        pass

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def silence(self, instance: FakeInstance) -> None:
        instance.answers_health = False

    def die(self, instance: FakeInstance) -> None:
        instance.alive = False

    def exit_reported(self, instance: FakeInstance) -> None:
        pass

    def finish_stop(self, instance: FakeInstance) -> None:
        pass


class RealSupervisorContractTests(SupervisorContract, SynchronousTestCase):
    """
    The real L{Supervisor}: processes from L{fake_process_reactor}, and a
    C{/health} probe that answers as the child at that port would (200;
    refused once it has died; nothing while silenced, failing as Twisted's
    HTTP client does when cancelled).
    """

    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        config = parse_config(
            f'models_dir = "{root / "models"}"\nstop_grace = 3\n[engines.llamacpp]\nbinary = "/bin/true"\n'
        )
        self.reactor = fake_process_reactor()
        self.silent: set[int] = set()
        ports = iter(range(5000, 6000))

        async def probe(url: str) -> int:
            port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
            instance = next(i for i in self.supervisor._all | set(self.gone) if i.port == port)
            if not self.reactor.process_alive(instance.pid):
                raise ConnectionRefusedError("127.0.0.1", port)
            if port in self.silent:

                def cancel(d: Deferred[int]) -> None:
                    d.errback(ResponseNeverReceived([Failure(CancelledError())]))

                return await Deferred(cancel)
            return 200

        self.gone: list[Any] = []
        self.supervisor = Supervisor(
            config,
            ModelRegistry(config, self.reactor),
            self.reactor,
            probe,
            {"PATH": "/usr/bin"},
            port_finder=lambda: next(ports),
            process_alive=self.reactor.process_alive,
        )

    def settle(self) -> None:
        for _ in range(3):
            self.reactor.advance(0)

    def advance(self, seconds: float) -> None:
        self.reactor.advance(seconds)

    def silence(self, instance: Any) -> None:
        self.silent.add(instance.port)

    def die(self, instance: Any) -> None:
        self.gone.append(instance)
        instance.transport.die()

    def exit_reported(self, instance: Any) -> None:
        instance.transport.exit(None, signal=9)

    def finish_stop(self, instance: Any) -> None:
        self.assertIn("TERM", instance.transport.signals)
        instance.transport.exit(
            0 if "KILL" not in instance.transport.signals else None,
            signal=9 if "KILL" in instance.transport.signals else None,
        )

    def test_kill_instance_sends_sigkill_at_once(self) -> None:
        instance = self.ready()
        self.supervisor.kill_instance(instance, "wedged: no response headers")
        self.assertEqual(instance.transport.signals, ["TERM", "KILL"])
        instance.transport.exit(None, signal=9)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_measured_snapshot_reads_memory_in_the_pool(self) -> None:
        import blazar.engines.supervisor as module

        instance = self.ready()
        read: list[int] = []

        def thd_rss(pid: int) -> int:
            read.append(pid)
            return 4096

        self.patch(module, "thd_rss", thd_rss)
        (view,) = self.successResultOf(Deferred.fromCoroutine(self.supervisor.measured_snapshot()))
        self.assertEqual((view.rss, read), (4096, [instance.pid]))
