import json
from pathlib import Path
from typing import Any, Callable, cast

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web._newclient import ResponseNeverReceived

from blazar.config import parse_config
from blazar.engines.supervisor import (
    BreakerOpen,
    EngineCrashed,
    EngineStartFailed,
    Instance,
    InstanceState,
    NoCapacity,
    Supervisor,
)
from blazar.models.registry import ModelRegistry
from blazar.models.testmodel import make_test_model
from blazar.testing import fake_process_reactor
from tests.typed import not_none


class SupervisorTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        self.config = parse_config(
            f'models_dir = "{root / "models"}"\nready_timeout = 5\nstop_grace = 3\n'
            '[engines.llamacpp]\nbinary = "/bin/true"\n'
        )
        self.reactor = fake_process_reactor()
        self.health = 503
        self.probes: list[str] = []

        async def probe(url: str) -> int:
            self.probes.append(url)
            return self.health

        self.supervisor = Supervisor(
            self.config,
            ModelRegistry(self.config, self.reactor),
            self.reactor,
            probe,
            {"PATH": "/usr/bin", "LLAMA_ARG_THREADS": "99"},
            port_finder=lambda: 5555,
        )

    def instance_for(self, name: str = "m") -> Deferred:
        return ensureDeferred(self.supervisor.instance_for(name))

    def test_concurrent_first_requests_share_one_spawn(self) -> None:
        waits = [self.instance_for() for _ in range(10)]
        self.assertEqual(len(self.reactor.spawned), 1)
        transport, executable, argv, env = self.reactor.spawned[0]
        self.assertIn("--port", argv)
        self.assertEqual(argv[argv.index("--port") + 1], "5555")
        self.assertIn("LLAMA_API_KEY", env)
        self.assertNotIn("LLAMA_ARG_THREADS", env)
        self.assertTrue(transport.stdin_closed)
        for d in waits:
            self.assertNoResult(d)
        self.reactor.advance(0.05)
        self.assertNoResult(waits[0])
        self.health = 200
        self.reactor.advance(0.05)
        instances = [self.successResultOf(d) for d in waits]
        self.assertTrue(all(i is instances[0] for i in instances))
        self.assertEqual(instances[0].state, InstanceState.READY)
        self.assertEqual(self.probes[-1], "http://127.0.0.1:5555/health")
        # a ready model is reused
        self.assertIs(self.successResultOf(self.instance_for("m:latest")), instances[0])
        self.assertEqual(len(self.reactor.spawned), 1)

    def test_exit_while_starting_fails_waiters_with_status_and_tail(self) -> None:
        d = self.instance_for()
        transport = self.reactor.spawned[0][0]
        transport.protocol.childDataReceived(2, b"loading...\nerror: failed to load model\n")
        transport.exit(1)
        f = self.failureResultOf(d, EngineStartFailed)
        self.assertIn("exit code 1", str(f.value))
        self.assertIn("failed to load model", str(f.value))
        # the next request tries again with a fresh child
        self.instance_for()
        self.assertEqual(len(self.reactor.spawned), 2)

    def test_crashed_child_is_respawned(self) -> None:
        self.health = 200
        d = self.instance_for()
        self.reactor.advance(0)
        first = self.successResultOf(d)
        first.transport.exit(None, signal=9)
        self.assertEqual(first.state, InstanceState.DEAD)
        d = self.instance_for()
        self.reactor.advance(0)
        second = self.successResultOf(d)
        self.assertIsNot(second, first)
        self.assertEqual(len(self.reactor.spawned), 2)

    def test_explain_failure_names_exit_status(self) -> None:
        self.health = 200
        d = self.instance_for()
        self.reactor.advance(0)
        instance = self.successResultOf(d)
        instance.protocol.childDataReceived(2, b"GGML_ASSERT failed\n")
        explained = ensureDeferred(self.supervisor.explain_failure(instance, ConnectionError("reset")))
        self.assertNoResult(explained)
        instance.transport.exit(None, signal=6)
        error = self.successResultOf(explained)
        self.assertIsInstance(error, EngineCrashed)
        self.assertIn("killed by signal 6", str(error))
        self.assertIn("GGML_ASSERT", str(error))

    def test_explain_failure_gives_up_waiting(self) -> None:
        self.health = 200
        d = self.instance_for()
        self.reactor.advance(0)
        instance = self.successResultOf(d)
        explained = ensureDeferred(self.supervisor.explain_failure(instance, ConnectionError("reset")))
        self.reactor.advance(2)
        self.assertIn("reset", str(self.successResultOf(explained)))

    def test_ready_timeout(self) -> None:
        d = self.instance_for()
        self.reactor.advance(5.1)
        # poll steps are 0.05 s; advance enough steps to pass the bound
        for _ in range(120):
            self.reactor.advance(0.05)
        f = self.failureResultOf(d, EngineStartFailed)
        self.assertIn("ready_timeout", str(f.value))
        self.assertEqual(self.reactor.spawned[0][0].signals[0], "TERM")

    def test_stop_terms_then_kills_and_waits_for_exit(self) -> None:
        self.health = 200
        d = self.instance_for()
        self.reactor.advance(0)
        instance = self.successResultOf(d)
        self.supervisor.startService()
        stopped = self.supervisor.stopService()
        self.assertEqual(instance.transport.signals, ["TERM"])
        self.assertNoResult(stopped)
        self.reactor.advance(1)
        # a second SIGTERM makes llama-server exit without finishing its work
        self.assertEqual(instance.transport.signals, ["TERM", "TERM"])
        self.reactor.advance(2)
        self.assertEqual(instance.transport.signals, ["TERM", "TERM", "KILL"])
        self.assertNoResult(stopped)
        instance.transport.exit(None, signal=9)
        self.successResultOf(stopped)
        self.assertEqual(self.supervisor.instances(), [])

    def test_stop_cancels_kill_timer_on_prompt_exit(self) -> None:
        self.health = 200
        d = self.instance_for()
        self.reactor.advance(0)
        instance = self.successResultOf(d)
        stopped = self.supervisor.stopService()
        instance.transport.exit(0)
        self.successResultOf(stopped)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_request_waiting_for_a_child_unloaded_while_loading_gets_the_next(self) -> None:
        """
        A request that waited for a loading child someone unloaded got a
        502 ("unloaded while it was loading"): it now waits for a fresh one.
        """
        waiting = ensureDeferred(self.supervisor.instance_for("m"))
        first = self.supervisor.instances()[0]
        self.supervisor.stop_instance(first, "keep_alive 0")
        first.transport.exit(0)
        self.assertNoResult(waiting)
        self.assertEqual(len(self.reactor.spawned), 2)
        self.health = 200
        self.reactor.advance(0.05)
        fresh = self.successResultOf(waiting)
        self.assertIsNot(fresh, first)
        self.assertEqual(fresh.state, InstanceState.READY)

    def test_an_unload_of_a_child_loading_for_requests_waits_for_them(self) -> None:
        from blazar.engines.lease import InstanceLease

        waiting = ensureDeferred(self.supervisor.instance_for("m"))
        child = self.supervisor.instances()[0]
        self.assertIsNone(self.supervisor.unload_when_idle(child, "keep_alive 0"))
        self.assertEqual(child.transport.signals, [])
        self.health = 200
        self.reactor.advance(0.05)
        self.assertIs(self.successResultOf(waiting), child)
        lease = InstanceLease(self.supervisor, child)
        self.assertEqual(child.transport.signals, [])
        lease.finish(None)  # the request that waited is served, then the unload is done
        self.assertEqual(child.transport.signals, ["TERM"])

    def test_unloads_while_loading_are_waited_out_a_few_times_only(self) -> None:
        from blazar.engines.supervisor import MAX_UNLOADS_WAITED, UnloadedWhileLoading

        waiting = ensureDeferred(self.supervisor.instance_for("m"))
        for _ in range(MAX_UNLOADS_WAITED + 1):
            child = self.supervisor.instances()[-1]
            self.supervisor.stop_instance(child, "keep_alive 0")
            child.transport.exit(0)
        failure = self.failureResultOf(waiting, UnloadedWhileLoading)
        self.assertIn("send the request again", str(failure.value))

    def test_a_placement_asked_for_reloads_the_model_with_it(self) -> None:
        """
        Ollama's num_gpu (and main_gpu, num_thread, use_mmap) on a loaded
        model: it is reloaded with that placement, as Ollama does, once its
        running requests end; a request that asks for none keeps it.
        """
        self.health = 200
        first = self.successResultOf(self.instance_for())
        self.assertNotIn("-ngl", self.reactor.spawned[0][2])
        self.successResultOf(ensureDeferred(self.supervisor.want_profile("m", {"gpu_layers": 3, "threads": 2})))
        d = self.instance_for()
        self.assertEqual(first.transport.signals, ["TERM"])  # idle: stopped for the reload at once
        first.transport.exit(0)
        self.reactor.advance(0.05)
        second = self.successResultOf(d)
        argv = self.reactor.spawned[1][2]
        self.assertEqual(argv[argv.index("-ngl") + 1], "3")
        self.assertEqual(argv[argv.index("--threads") + 1], "2")
        self.assertEqual(second.profile, (("gpu_layers", 3), ("threads", 2)))
        self.assertIs(self.successResultOf(self.instance_for()), second)  # the same placement: kept
        self.successResultOf(ensureDeferred(self.supervisor.want_profile("m", {})))  # none asked: kept
        self.assertIs(self.successResultOf(self.instance_for()), second)
        self.assertEqual(len(self.reactor.spawned), 2)


class SpeculativeAutoTests(SynchronousTestCase):
    """
    C{speculative = "auto"}: the child's argv follows the tuner
    (L{blazar.engines.spectune}), changed at the next idle reload only.
    """

    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        # (its own data_dir: the tuner's decisions are saved in <data_dir>/speccache)
        self.config_text = (
            f'models_dir = "{root / "models"}"\ndata_dir = "{root / "data"}"\nready_timeout = 5\nstop_grace = 3\n'
            '[engines.llamacpp]\nbinary = "/bin/true"\n[models."m"]\nspeculative = "auto"\n'
        )
        self.root = root
        self.config = parse_config(self.config_text)
        self.reactor = fake_process_reactor()

        async def probe(url: str) -> int:
            return 200

        self.probe = probe
        self.supervisor = self.make(self.config)

    def make(self, config: Any) -> Supervisor:
        """
        A supervisor of C{config} (a L{Config} or a L{LiveConfig}) on
        C{self.reactor}.
        """
        return Supervisor(
            config, ModelRegistry(self.config, self.reactor), self.reactor, self.probe, {}, port_finder=lambda: 5555
        )

    def instance_for(self) -> Any:
        return self.successResultOf(ensureDeferred(self.supervisor.instance_for("m")))

    def test_off_at_the_next_idle_reload_not_before(self) -> None:
        first = self.instance_for()
        argv = self.reactor.spawned[0][2]
        self.assertEqual(argv[argv.index("--spec-type") + 1], "ngram-mod,ngram-cache")
        self.assertEqual(dict(first.profile)["speculative"], "ngram")
        tuner = self.supervisor.spec_tuner
        for _ in range(4):
            tuner.observe("m:latest", "interactive", True, 50.0, 100, window=4)
        self.assertFalse(tuner.lookup("m:latest"))
        first.in_flight += 1  # a request runs: nothing is cut, nothing reloads
        self.supervisor.reap()
        self.assertEqual(first.transport.signals, [])
        self.assertIs(self.instance_for(), first)  # a request that comes meanwhile: the same child
        first.in_flight -= 1
        self.supervisor.reap()  # idle now: the reload
        self.assertEqual(first.transport.signals, ["TERM"])
        first.transport.exit(0)
        self.reactor.advance(0.05)
        second = self.instance_for()
        self.assertIsNot(second, first)
        self.assertNotIn("--spec-type", self.reactor.spawned[1][2])
        self.assertEqual(dict(second.profile)["speculative"], "off")
        self.supervisor.reap()  # what the tuner wants: kept
        self.assertEqual(second.transport.signals, [])
        for _ in range(4):
            tuner.observe("m:latest", "interactive", False, 50.0, 100, window=4)
        self.assertEqual(tuner.state("m:latest")["decided"], "off")
        self.supervisor.reap()
        self.assertEqual(second.transport.signals, [])

    def test_a_reload_off_auto_stops_the_tuning(self) -> None:
        from blazar.config import LiveConfig

        live = LiveConfig(self.config)
        self.supervisor = self.make(live)
        first = self.instance_for()
        for _ in range(4):
            self.supervisor.spec_tuner.observe("m:latest", "interactive", True, 50.0, 100, window=4)
        live.swap(parse_config(str(self.config_text).replace('"auto"', '"ngram"')))
        self.supervisor.reap()
        self.assertEqual(first.transport.signals, [])
        self.assertIsNone(self.supervisor.speculative_auto("m:latest"))

    def test_pays_stays_on(self) -> None:
        second = self.decide(80.0, "on")
        self.supervisor.reap()
        self.assertEqual(second.transport.signals, ["TERM"])
        second.transport.exit(0)
        self.reactor.advance(0.05)
        third = self.instance_for()
        self.assertIn("--spec-type", self.reactor.spawned[2][2])
        self.assertEqual(dict(third.profile)["speculative"], "ngram")

    def decide(self, with_lookup: float, decided: str) -> Any:
        """
        A trial: 4 answers at C{with_lookup} tok/s on the first child, an
        idle reload, 4 at 50 tok/s without; the second child.
        """
        first = self.instance_for()
        tuner = self.supervisor.spec_tuner
        for _ in range(4):
            tuner.observe("m:latest", "interactive", True, with_lookup, 100, window=4)
        self.supervisor.reap()
        first.transport.exit(0)
        self.reactor.advance(0.05)
        second = self.instance_for()
        for _ in range(4):
            tuner.observe("m:latest", "interactive", False, 50.0, 100, window=4)
        self.assertEqual(tuner.state("m:latest")["decided"], decided)
        return second

    def decide_off(self) -> Any:
        return self.decide(50.0, "off")

    def test_decision_survives_a_restart(self) -> None:
        """
        The decision is saved in the model's speccache directory; a
        restarted daemon's first child of the model runs as decided, with
        no trial.
        """
        second = self.decide_off()
        saved = self.root / "data" / "speccache" / "m_latest" / "tuner.json"
        self.assertEqual(json.loads(saved.read_text())["decided"], "off")
        stopped = self.supervisor.stopService()
        second.transport.exit(0)
        self.successResultOf(stopped)
        self.reactor = fake_process_reactor()
        self.supervisor = self.make(self.config)
        first = self.instance_for()
        self.assertNotIn("--spec-type", self.reactor.spawned[0][2])
        self.assertEqual(dict(first.profile)["speculative"], "off")
        self.assertEqual(not_none(self.supervisor.speculative_auto("m:latest"))["decided"], "off")

    def sample(self, name: str, **labels: str) -> float | None:
        return self.supervisor.metrics.registry.get_sample_value(name, {"model": "m:latest", **labels})

    def decided(self) -> dict[str, float | None]:
        return {st: self.sample("blazar_engine_speculative_decided", state=st) for st in ("measuring", "on", "off")}

    def test_prometheus(self) -> None:
        """
        C{blazar_engine_speculative_decided{model,state}} (1 for the
        tuner's state) and C{blazar_engine_speculative_lookup{model}}
        (whether the loaded child runs with lookup).
        """
        self.assertNotIn(b"blazar_engine_speculative_decided{", self.supervisor.metrics.render())
        first = self.instance_for()
        self.assertEqual(self.decided(), {"measuring": 1.0, "on": 0.0, "off": 0.0})
        self.assertEqual(self.sample("blazar_engine_speculative_lookup"), 1.0)
        stopped = self.supervisor.stop_instance(first)
        first.transport.exit(0)
        self.successResultOf(stopped)
        self.assertIsNone(self.sample("blazar_engine_speculative_lookup"))  # none loaded
        self.assertEqual(self.decided()["measuring"], 1.0)
        second = self.decide_off()
        self.assertEqual(self.decided(), {"measuring": 0.0, "on": 0.0, "off": 1.0})
        self.assertEqual(self.sample("blazar_engine_speculative_lookup"), 0.0)
        self.assertIs(self.instance_for(), second)

    def test_prometheus_only_auto(self) -> None:
        self.config = parse_config(self.config_text.replace('"auto"', '"ngram"'))
        self.supervisor = self.make(self.config)
        self.instance_for()
        rendered = self.supervisor.metrics.render()
        self.assertNotIn(b"blazar_engine_speculative_decided{", rendered)
        self.assertNotIn(b"blazar_engine_speculative_lookup{", rendered)
        self.assertIn(b"# TYPE blazar_engine_speculative_lookup gauge", rendered)


class LifecycleTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        self.config = parse_config(
            f'models_dir = "{root / "models"}"\nready_timeout = 5\nstop_grace = 3\n'
            "idle_timeout_secs = 100\nbreaker_crashes = 2\nbreaker_window_secs = 60\n"
            "breaker_backoff_secs = 10\nbreaker_max_backoff_secs = 25\n"
            '[engines.llamacpp]\nbinary = "/bin/true"\n'
        )
        self.reactor = fake_process_reactor()
        self.health = 503

        async def probe(url: str) -> int:
            return self.health

        self.supervisor = Supervisor(
            self.config,
            ModelRegistry(self.config, self.reactor),
            self.reactor,
            probe,
            {},
            port_finder=lambda: 5555,
        )
        self.supervisor.startService()

    def tearDown(self) -> None:
        for i in self.supervisor.instances():
            if not i.transport.ended:
                i.transport.exit(0)
        self.successResultOf(self.supervisor.stopService())

    def ready(self) -> Instance:
        self.health = 200
        d = ensureDeferred(self.supervisor.instance_for("m"))
        self.reactor.advance(0)
        self.health = 503
        return self.successResultOf(d)

    def test_the_stop_waits_for_before_stop_even_once_it_has_fired_and_waits_on_another(self) -> None:
        # the shutdown's hook: the batch lines drained (fired at once), then the
        # sessions' slots saved (still going): SIGTERM only after both
        saving: Deferred[None] = Deferred()
        chained: Deferred[None] = Deferred()
        chained.callback(None)
        chained.addCallback(lambda _: saving)
        self.assertTrue(chained.called)  # fired, and paused on saving
        self.supervisor.before_stop = lambda instance: chained
        instance = self.ready()
        self.supervisor.stop_instance(instance, "shutdown")
        self.assertEqual(instance.transport.signals, [])
        saving.callback(None)
        self.assertEqual(instance.transport.signals, ["TERM"])

    def test_a_failing_before_stop_still_stops(self) -> None:
        self.supervisor.before_stop = lambda instance: Deferred.fromCoroutine(_fails())
        instance = self.ready()
        self.supervisor.stop_instance(instance, "evicted")
        self.assertEqual(instance.transport.signals, ["TERM"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_idle_timeout_without_keep_alive(self) -> None:
        instance = self.ready()
        self.reactor.advance(99)
        self.assertEqual(instance.transport.signals, [])
        self.reactor.advance(2)
        self.assertEqual(instance.transport.signals, ["TERM"])
        self.assertEqual(instance.stop_reason, "idle")

    def test_keep_alive_sets_the_countdown_from_last_use(self) -> None:
        instance = self.ready()
        self.reactor.advance(50)
        self.supervisor.touch(instance, 3.0)
        self.assertEqual(instance.expires_at(), self.reactor.seconds() + 3.0)
        self.reactor.advance(2)
        self.assertEqual(instance.transport.signals, [])
        self.reactor.advance(2)
        self.assertEqual(instance.transport.signals, ["TERM"])

    def test_negative_keep_alive_is_forever(self) -> None:
        instance = self.ready()
        self.supervisor.touch(instance, -1)
        self.assertIsNone(instance.expires_at())
        self.reactor.advance(10_000)
        self.assertEqual(instance.transport.signals, [])

    def test_busy_instances_are_not_reaped(self) -> None:
        instance = self.ready()
        instance.in_flight = 1
        self.reactor.advance(500)
        self.assertEqual(instance.transport.signals, [])

    def test_reaper_survives_a_failing_round(self) -> None:
        instance = self.ready()
        instance.last_used = cast(float, None)  # so the round fails
        for _ in range(5):
            self.reactor.advance(1)
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 5)
        instance.last_used = self.reactor.seconds()
        self.reactor.advance(200)
        self.assertEqual(instance.transport.signals, ["TERM"])

    def crash(self) -> None:
        d = ensureDeferred(self.supervisor.instance_for("m"))
        transport = self.reactor.spawned[-1][0]
        transport.protocol.childDataReceived(2, b"error: bad model\n")
        transport.exit(1)
        self.failureResultOf(d, EngineStartFailed)

    def test_breaker_opens_fails_fast_then_allows_one_trial(self) -> None:
        self.crash()
        self.crash()
        spawned = len(self.reactor.spawned)
        f = self.failureResultOf(ensureDeferred(self.supervisor.instance_for("m")), BreakerOpen)
        self.assertIn("exit code 1", str(f.value))
        self.assertIn("bad model", str(f.value))
        self.assertEqual(f.value.retry_after, 10)
        self.assertEqual(len(self.reactor.spawned), spawned)  # failed fast: no spawn
        self.assertEqual(self.supervisor.breaker("m:latest").state, "open")
        self.reactor.advance(10)
        self.crash()  # the one trial start, which fails: re-open, doubled
        self.assertEqual(len(self.reactor.spawned), spawned + 1)
        f = self.failureResultOf(ensureDeferred(self.supervisor.instance_for("m")), BreakerOpen)
        self.assertEqual(f.value.retry_after, 20)
        self.reactor.advance(20)
        instance = self.ready()  # a trial that works closes it
        self.assertEqual(self.supervisor.breaker("m:latest").state, "closed")
        self.assertEqual(instance.state, InstanceState.READY)

    def test_backoff_is_capped_and_reset_works(self) -> None:
        self.crash()
        self.crash()
        for wait in (10, 20, 25, 25):
            self.reactor.advance(wait)
            self.crash()
        f = self.failureResultOf(ensureDeferred(self.supervisor.instance_for("m")), BreakerOpen)
        self.assertEqual(f.value.retry_after, 25)
        self.assertEqual(self.supervisor.reset_breakers(), ["m:latest"])
        self.ready()

    def test_clean_stop_clears_crash_history(self) -> None:
        self.crash()
        instance = self.ready()
        self.supervisor.stop_instance(instance)
        instance.transport.exit(0)
        self.assertEqual(self.supervisor.breaker("m:latest").crashes, [])

    def test_evict_key_grammar(self) -> None:
        instance = self.ready()
        self.assertEqual(self.supervisor.evict("other"), [])
        self.assertEqual(self.supervisor.evict("m#1"), [])
        self.assertEqual(self.supervisor.evict("m@vision"), [])
        self.assertEqual(self.supervisor.evict("M:latest#0@text"), [instance])
        self.assertEqual(instance.transport.signals, ["TERM"])
        self.assertEqual(instance.stop_reason, "evicted")


class CapacityTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "a.gguf")
        make_test_model(root / "models" / "b.gguf")
        self.config = parse_config(
            f'models_dir = "{root / "models"}"\nmax_loaded_models = 1\ndrain_timeout_secs = 2\n'
            '[engines.llamacpp]\nbinary = "/bin/true"\n'
        )
        self.reactor = fake_process_reactor()
        self.free = 10 * 2**30

        async def probe(url: str) -> int:
            return 200

        self.supervisor = Supervisor(
            self.config,
            ModelRegistry(self.config, self.reactor),
            self.reactor,
            probe,
            {},
            port_finder=lambda: 5555,
            free_memory=lambda: self.free,
        )

    def load(self, name: str) -> Deferred:
        d = ensureDeferred(self.supervisor.instance_for(name))
        self.reactor.advance(0)
        return d

    def test_lru_idle_instance_is_evicted_first(self) -> None:
        a = self.successResultOf(self.load("a"))
        d = self.load("b")
        self.assertNoResult(d)  # waits for a to exit
        self.assertEqual(a.transport.signals, ["TERM"])
        self.assertEqual(a.stop_reason, "making room for b:latest")
        a.transport.exit(0)
        self.reactor.advance(0)
        b = self.successResultOf(d)
        self.assertEqual([i.entry.name for i in self.supervisor.instances()], ["b:latest"])
        self.assertEqual(b.state, InstanceState.READY)

    def test_busy_instances_drain_then_503(self) -> None:
        a = self.successResultOf(self.load("a"))
        a.in_flight = 1
        d = self.load("b")
        self.reactor.advance(1)
        self.assertNoResult(d)
        self.assertEqual(a.transport.signals, [])  # never evicted while busy
        for _ in range(20):
            self.reactor.advance(0.1)
        f = self.failureResultOf(d, NoCapacity)
        self.assertIn("max_loaded_models", str(f.value))

    def test_busy_instance_that_drains_in_time_is_evicted(self) -> None:
        a = self.successResultOf(self.load("a"))
        a.in_flight = 1
        d = self.load("b")
        self.reactor.advance(0.5)
        a.in_flight = 0
        self.reactor.advance(0.1)
        self.assertEqual(a.transport.signals, ["TERM"])
        a.transport.exit(0)
        self.reactor.advance(0)
        self.successResultOf(d)

    def test_too_big_for_memory(self) -> None:
        self.free = 1000
        f = self.failureResultOf(self.load("a"), NoCapacity)
        self.assertIn("ctx_size", str(f.value))
        self.assertEqual(self.reactor.spawned, [])

    def test_estimate_counts_weights_and_kv_cache(self) -> None:
        from blazar.models.gguf_meta import GGUFMetadata
        from blazar.models.registry import ModelEntry

        meta = GGUFMetadata("llama", 8192, 32, 4096, 32, 8, 15, True, None, 4_000_000_000)
        entry = ModelEntry("m:latest", Path("/m.gguf"))
        # 4 slots x 4096 ctx, 32 layers, 8 kv heads x 128 dims, f16 K and V
        self.assertEqual(self.supervisor.estimate(entry, meta), 4_000_000_000 + 2 * 32 * 16384 * 8 * 128 * 2)


class ContextPolicyTests(SynchronousTestCase):
    """
    Ollama's num_ctx (C{instance_for(name, ctx_size)}) under ctx_policy
    "grow" (the default) and "fit". The model is trained for 32768 tokens,
    so it starts at the 4096-token default; its KV cache takes 2 KiB per
    token of context per slot (K and V, 2 layers, 4 KV heads of 16 dims, f16,
    4 slots).
    """

    def make(self, policy: str = "grow", extra: str = "", free: int | None = None) -> tuple[Supervisor, Any]:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf", context_length=32768)
        self.size = (root / "models" / "m.gguf").stat().st_size
        config = parse_config(
            f'models_dir = "{root / "models"}"\nctx_policy = "{policy}"\ndrain_timeout_secs = 5\n'
            '[engines.llamacpp]\nbinary = "/bin/true"\n' + extra
        )
        reactor = fake_process_reactor()
        self.free = free

        async def probe(url: str) -> int:
            return 200

        return Supervisor(
            config,
            ModelRegistry(config, reactor),
            reactor,
            probe,
            {},
            port_finder=lambda: 5555,
            free_memory=(lambda: cast(int, self.free)) if free is not None else None,
        ), reactor

    def get(self, supervisor: Supervisor, ctx: int | None = None) -> Deferred:
        return ensureDeferred(supervisor.instance_for("m", ctx))

    def engine_ctx(self, reactor: Any) -> int:
        argv = reactor.spawned[-1][2][3:]  # after [python, -c, launcher]
        return int(argv[argv.index("-c") + 1]) // int(argv[argv.index("-np") + 1])

    def test_fit_ignores_a_larger_num_ctx(self) -> None:
        supervisor, reactor = self.make("fit")
        first = self.successResultOf(self.get(supervisor))
        again = self.successResultOf(self.get(supervisor, 8192))
        self.assertIs(again, first)
        self.assertEqual(len(reactor.spawned), 1)
        plan = self.successResultOf(ensureDeferred(supervisor.context_for("m", 8192)))
        self.assertEqual(plan.ctx, 4096)
        self.assertIn('ctx_policy = "fit"', plan.shortfall())

    def test_reload_is_another_name_for_grow(self) -> None:
        supervisor, _ = self.make("reload")
        self.assertEqual(supervisor.ctx_policy, "grow")

    def test_grow_restarts_once_and_the_context_stays(self) -> None:
        supervisor, reactor = self.make()
        first = self.successResultOf(self.get(supervisor))
        self.assertEqual(first.ctx, 4096)
        d = self.get(supervisor, 8192)
        self.assertNoResult(d)
        self.assertEqual(first.transport.signals, ["TERM"])
        self.assertIn("4096 -> 8192", first.stop_reason)
        first.transport.exit(0)
        second = self.successResultOf(d)
        self.assertEqual((second.ctx, self.engine_ctx(reactor)), (8192, 8192))
        # smaller (or no) num_ctx later: served by the grown child, no restart
        for ctx in (1024, None, 8192):
            self.assertIs(self.successResultOf(self.get(supervisor, ctx)), second)
        self.assertEqual(len(reactor.spawned), 2)
        self.assertEqual(second.transport.signals, [])

    def test_above_the_trained_context_is_clamped(self) -> None:
        supervisor, reactor = self.make()
        first = self.successResultOf(self.get(supervisor))
        plan = self.successResultOf(ensureDeferred(supervisor.context_for("m", 100_000)))
        self.assertEqual((plan.ctx, plan.trained), (32768, 32768))
        self.assertIn("32768-token context 'm:latest' was trained for", plan.shortfall())
        d = self.get(supervisor, 100_000)
        first.transport.exit(0)
        self.assertEqual(self.successResultOf(d).ctx, 32768)
        self.assertEqual(self.engine_ctx(reactor), 32768)

    def test_configured_ctx_size_is_the_starting_point(self) -> None:
        supervisor, reactor = self.make(extra='[models."m"]\nctx_size = 1024\n')
        first = self.successResultOf(self.get(supervisor, 512))
        self.assertEqual(first.ctx, 1024)
        self.assertIs(self.successResultOf(self.get(supervisor, 1024)), first)
        self.assertEqual(len(reactor.spawned), 1)

    def test_first_load_starts_at_the_asked_context(self) -> None:
        supervisor, reactor = self.make()
        first = self.successResultOf(self.get(supervisor, 16384))
        self.assertEqual((first.ctx, self.engine_ctx(reactor), len(reactor.spawned)), (16384, 16384, 1))

    def test_grow_waits_for_running_requests_and_new_ones_queue_behind_it(self) -> None:
        supervisor, reactor = self.make()
        first = self.successResultOf(self.get(supervisor))
        first.in_flight = 1  # a request running on the small child
        grow = self.get(supervisor, 8192)
        plain = self.get(supervisor)  # arrives meanwhile: must not get the small child
        reactor.advance(1)
        self.assertEqual(first.transport.signals, [])  # never stopped while busy
        self.assertNoResult(grow)
        self.assertNoResult(plain)
        first.in_flight = 0
        reactor.advance(0.1)
        self.assertEqual(first.transport.signals, ["TERM"])
        first.transport.exit(0)
        second = self.successResultOf(grow)
        self.assertIs(self.successResultOf(plain), second)
        self.assertEqual(second.ctx, 8192)

    def test_concurrent_growing_requests_share_one_restart(self) -> None:
        supervisor, reactor = self.make()
        first = self.successResultOf(self.get(supervisor))
        first.in_flight = 1
        waits = [self.get(supervisor, ctx) for ctx in (8192, 16384, 6000)]
        first.in_flight = 0
        reactor.advance(0.1)
        first.transport.exit(0)
        grown = [self.successResultOf(d) for d in waits]
        self.assertTrue(all(g is grown[0] for g in grown))
        self.assertEqual((grown[0].ctx, len(reactor.spawned)), (16384, 2))

    def test_grow_gives_up_when_the_child_stays_busy(self) -> None:
        supervisor, reactor = self.make()
        first = self.successResultOf(self.get(supervisor))
        first.in_flight = 1
        grow = self.get(supervisor, 8192)
        plain = self.get(supervisor)
        reactor.advance(5.1)
        f = self.failureResultOf(grow, NoCapacity)
        self.assertIn("drain_timeout_secs", str(f.value))
        self.assertIn("ctx_size = 8192", str(f.value))
        # the running request was never disturbed, and the one queued behind
        # the grow gets the child that is still there
        self.assertEqual(first.transport.signals, [])
        self.assertIs(self.successResultOf(plain), first)
        self.flushLoggedErrors()

    def test_grow_waits_for_a_loading_child_and_the_request_already_waiting(self) -> None:
        supervisor, reactor = self.make()
        health = [503]

        async def probe(url: str) -> int:
            return health[0]

        supervisor._probe = probe
        loading = self.get(supervisor)

        def send(instance: Instance) -> Instance:
            instance.in_flight += 1  # as EngineProxy.send does, at once
            return instance

        loading.addCallback(send)
        grow = self.get(supervisor, 8192)
        reactor.advance(0.05)
        (first,) = supervisor.instances()
        self.assertNoResult(loading)  # the premise: the child is still loading (its /health is 503)
        health[0] = 200
        reactor.advance(0.05)
        # the request that was waiting for the load before the grow came is
        # served by it, and the grow waits for that request
        self.assertIs(self.successResultOf(loading), first)
        reactor.advance(1)
        self.assertEqual(first.transport.signals, [])
        first.in_flight = 0
        reactor.advance(0.1)
        self.assertEqual(first.transport.signals, ["TERM"])
        first.transport.exit(0)
        reactor.advance(0.05)
        self.assertEqual(self.successResultOf(grow).ctx, 8192)

    def test_memory_limits_the_grow_to_the_largest_that_fits(self) -> None:
        per_token = 2048
        supervisor, reactor = self.make(free=10**9)
        first = self.successResultOf(self.get(supervisor))
        # 10000 tokens per slot fit once the 4096-token KV cache is freed
        self.free = self.size + (10_000 - 4096) * per_token
        plan = self.successResultOf(ensureDeferred(supervisor.context_for("m", 32768)))
        self.assertEqual((plan.ctx, plan.memory_limit), (9216, 9216))  # rounded down to 1024s
        self.assertIn("does not fit in memory", plan.shortfall())
        self.assertIn("parallel", plan.shortfall())
        d = self.get(supervisor, 32768)
        self.free = self.size + 10_000 * per_token  # the old child's cache is free again
        first.transport.exit(0)
        self.assertEqual(self.successResultOf(d).ctx, 9216)
        self.assertEqual(self.engine_ctx(reactor), 9216)

    def test_memory_below_the_loaded_context_keeps_the_child(self) -> None:
        supervisor, reactor = self.make(free=10**9)
        first = self.successResultOf(self.get(supervisor))
        self.free = 0
        plan = self.successResultOf(ensureDeferred(supervisor.context_for("m", 32768)))
        self.assertEqual(plan.ctx, 4096)
        self.assertIs(self.successResultOf(self.get(supervisor, 32768)), first)
        self.assertEqual((first.transport.signals, len(reactor.spawned)), ([], 1))

    def test_no_restart_during_shutdown(self) -> None:
        supervisor, reactor = self.make()
        first = self.successResultOf(self.get(supervisor))
        first.in_flight = 1
        grow = self.get(supervisor, 8192)
        supervisor.stopService()
        first.transport.exit(0)
        reactor.advance(0.1)
        self.failureResultOf(grow, EngineStartFailed)
        self.assertEqual(len(reactor.spawned), 1)
        self.flushLoggedErrors()


class ExitFoundByARequestTests(SynchronousTestCase):
    """
    L{Supervisor.exited}: a request that could not reach its child finds the
    child exited (a zombie the reactor has not reaped yet, or gone) before
    the exit is reported.
    """

    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        self.reactor = fake_process_reactor()
        self.supervisor = self.make(root, "breaker_crashes = 3\n")

    def make(self, root: Path, extra: str) -> Supervisor:
        config = parse_config(
            f'models_dir = "{root / "models"}"\nready_timeout = 5\nstop_grace = 3\n{extra}'
            '[engines.llamacpp]\nbinary = "/bin/true"\n'
        )

        async def probe(url: str) -> int:
            return 200

        return Supervisor(
            config,
            ModelRegistry(config, self.reactor),
            self.reactor,
            probe,
            {},
            port_finder=lambda: 5555,
            process_alive=self.reactor.process_alive,
        )

    def ready(self) -> Instance:
        d = ensureDeferred(self.supervisor.instance_for("m"))
        self.reactor.advance(0)
        return self.successResultOf(d)

    def crashes(self) -> float | None:
        return self.supervisor.metrics.registry.get_sample_value("blazar_engine_crashes_total", {"model": "m:latest"})

    def test_a_live_child_has_not_exited(self) -> None:
        instance = self.ready()
        self.assertFalse(self.supervisor.exited(instance))
        self.assertEqual(instance.state, InstanceState.READY)
        self.assertIs(self.supervisor.loaded("m:latest"), instance)

    def test_a_zombie_is_dead_at_once_and_one_fresh_child_serves_everyone(self) -> None:
        first = self.ready()
        first.transport.die()
        self.assertTrue(self.supervisor.exited(first))
        self.assertTrue(self.supervisor.exited(first))  # asked again: counted once
        self.assertEqual(first.state, InstanceState.DEAD)
        self.assertIsNone(self.supervisor.loaded("m:latest"))
        waits = [ensureDeferred(self.supervisor.instance_for("m")) for _ in range(5)]
        self.reactor.advance(0)
        fresh = {self.successResultOf(d) for d in waits}
        self.assertEqual(len(fresh), 1)
        self.assertIsNot(fresh.pop(), first)
        self.assertEqual(len(self.reactor.spawned), 2)  # one spawn, not one per request
        self.assertEqual(self.crashes(), 1)
        self.assertEqual(len(self.supervisor.breaker("m:latest").crashes), 1)
        # the exit report comes: bookkeeping, no second crash
        first.transport.exit(None, signal=9)
        self.assertEqual(self.crashes(), 1)
        self.assertEqual(len(self.supervisor.breaker("m:latest").crashes), 1)
        self.assertIn("killed by signal 9", self.supervisor.breaker("m:latest").last_error)
        self.assertNotIn(first, self.supervisor.instances())
        self.assertEqual(len(self.supervisor.instances()), 1)

    def test_a_reported_exit_is_an_exit(self) -> None:
        instance = self.ready()
        instance.transport.exit(None, signal=9)
        self.assertTrue(self.supervisor.exited(instance))
        self.assertEqual(self.crashes(), 1)

    def test_the_breaker_counts_the_crash_before_the_exit_is_reported(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        self.supervisor = self.make(root, "breaker_crashes = 1\n")
        instance = self.ready()
        instance.transport.die()
        self.assertTrue(self.supervisor.exited(instance))
        f = self.failureResultOf(ensureDeferred(self.supervisor.instance_for("m")), BreakerOpen)
        self.assertIn("found by a request", str(f.value))
        self.assertEqual(len(self.reactor.spawned), 1)
        instance.transport.exit(None, signal=9)
        self.assertEqual(self.crashes(), 1)

    def test_stopping_a_child_found_dead_signals_nothing(self) -> None:
        instance = self.ready()
        instance.transport.die()
        self.supervisor.exited(instance)
        stopped = self.supervisor.stop_instance(instance, "keep_alive 0")
        self.assertEqual(instance.transport.signals, [])
        self.assertEqual(self.supervisor.evict("m"), [])
        self.assertNoResult(stopped)
        instance.transport.exit(None, signal=9)
        self.successResultOf(stopped)
        self.assertEqual(self.crashes(), 1)  # a crash, not an eviction
        evictions = [
            s
            for m in self.supervisor.metrics.registry.collect()
            for s in m.samples
            if s.name == "blazar_evictions_total"
        ]
        self.assertEqual(evictions, [])
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_child_being_stopped_that_exits_is_not_a_crash(self) -> None:
        instance = self.ready()
        self.supervisor.stop_instance(instance, "idle")
        instance.transport.die()
        self.assertTrue(self.supervisor.exited(instance))
        self.assertEqual(instance.state, InstanceState.STOPPING)
        instance.transport.exit(0)
        self.assertIsNone(self.crashes())

    def test_a_second_stop_is_the_same_stop(self) -> None:
        """
        An unload loop sent a stopping child a second SIGTERM (llama-server
        then exits at once, dropping the work it was finishing): a second
        stop now waits for the first.
        """
        instance = self.ready()
        first = self.supervisor.stop_instance(instance, "keep_alive 0")
        again = self.supervisor.stop_instance(instance, "keep_alive 0")
        self.assertEqual(instance.transport.signals, ["TERM"])
        self.assertEqual(self.supervisor.evict("m"), [])
        self.assertEqual(instance.transport.signals, ["TERM"])
        instance.transport.exit(0)
        self.successResultOf(first)
        self.successResultOf(again)
        self.assertEqual(instance.stop_reason, "keep_alive 0")


class HealthProbeTests(SynchronousTestCase):
    """
    The real L{Supervisor.probe_health} on a child that stops answering
    C{/health}: a timeout is "unhealthy", a caller that is cancelled (its
    client left) is a cancellation, never "unhealthy" — that would get a
    busy, healthy child killed as wedged.
    """

    def setUp(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        config = parse_config(f'models_dir = "{root / "models"}"\n[engines.llamacpp]\nbinary = "/bin/true"\n')
        self.reactor = fake_process_reactor()
        self.pending: list[Deferred[int]] = []

        def probe(url: str) -> Deferred[int]:
            def cancel(d: Deferred[int]) -> None:
                # as Twisted's HTTP client reports a cancelled request
                d.errback(ResponseNeverReceived([Failure(CancelledError())]))

            d: Deferred[int] = Deferred(cancel)
            self.pending.append(d)
            return d

        self.supervisor = Supervisor(
            config,
            ModelRegistry(config, self.reactor),
            self.reactor,
            probe,
            {"PATH": "/usr/bin"},
            port_finder=lambda: 5555,
        )

    def probe(self) -> Deferred[bool]:
        instance: Any = type("I", (), {"base_url": "http://127.0.0.1:5555", "health_path": "/health"})()
        return Deferred.fromCoroutine(self.supervisor.probe_health(instance))

    def test_a_silent_child_is_unhealthy_after_the_timeout(self) -> None:
        d = self.probe()
        self.assertNoResult(d)
        self.reactor.advance(3.0)
        self.assertIs(self.successResultOf(d), False)

    def test_a_client_that_leaves_is_a_cancellation_not_unhealthy(self) -> None:
        d = self.probe()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.reactor.getDelayedCalls(), [])  # the timeout timer is gone too

    def test_a_probe_that_gives_up_on_its_own_is_unhealthy(self) -> None:
        d = self.probe()
        # the engine client's own timeout cancels its request
        self.pending[0].errback(ResponseNeverReceived([Failure(CancelledError())]))
        self.assertIs(self.successResultOf(d), False)

    def test_an_answer_in_time(self) -> None:
        d = self.probe()
        self.pending[0].callback(200)
        self.assertIs(self.successResultOf(d), True)


class InstanceStateTests(SynchronousTestCase):
    def test_a_string_in_comparisons_json_and_text(self) -> None:
        import json

        self.assertEqual(InstanceState.READY, "ready")
        self.assertIn(InstanceState.STOPPING, ("starting", "stopping"))
        self.assertEqual(json.dumps({"state": InstanceState.DEAD}), '{"state": "dead"}')
        self.assertEqual(f"{InstanceState.STARTING}", "starting")
        self.assertEqual(InstanceState("ready"), InstanceState.READY)


async def _fails() -> None:
    raise RuntimeError("the hook failed")


class HardwareChangeTests(SynchronousTestCase):
    """
    The hardware census is told when a child becomes ready (its VRAM is
    allocated then) and when it exits.
    """

    def test_ready_and_exit_are_told(self) -> None:
        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        config = parse_config(f'models_dir = "{root / "models"}"\n[engines.llamacpp]\nbinary = "/bin/true"\n')
        reactor = fake_process_reactor()
        told: list[float] = []
        health = [503]

        async def probe(url: str) -> int:
            return health[0]

        supervisor = Supervisor(config, ModelRegistry(config, reactor), reactor, probe, {}, port_finder=lambda: 5555)
        supervisor.on_hardware_change = lambda: told.append(reactor.seconds())
        d = ensureDeferred(supervisor.instance_for("m"))
        self.assertEqual(told, [])  # spawned, not loaded yet
        health[0] = 200
        reactor.advance(0.05)
        instance = self.successResultOf(d)
        self.assertEqual(len(told), 1)
        instance.transport.exit(0)
        self.assertEqual(len(told), 2)


class GPUPlacementTests(SynchronousTestCase):
    """
    With a hardware census that sees GPUs, a llama.cpp child is placed by
    the planner: it sees only its plan's GPUs (in NVML's order), with the
    plan's layers and llama-server's own fitting off; a model that cannot
    be placed is a 503 naming the levers; after it is ready, what NVML
    measures corrects the model's next plan. (A real GPU run is pending:
    these run against blazar.testing.FakeNVML.)
    """

    def make(self, nvml: Any, model_config: str = "", top: str = "") -> Supervisor:
        from twisted.internet.defer import succeed

        root = Path(self.mktemp())
        make_test_model(root / "models" / "m.gguf")
        make_test_model(root / "models" / "d.gguf")
        config = parse_config(
            f'{top}models_dir = "{root / "models"}"\n[models."m"]\nparallel = 2\n{model_config}'
            '[engines.llamacpp]\nbinary = "/bin/true"\n'
        )
        self.reactor = fake_process_reactor()

        self.health = 200

        async def probe(url: str) -> int:
            return self.health

        supervisor = Supervisor(
            config, ModelRegistry(config, self.reactor), self.reactor, probe, {}, port_finder=lambda: 5555
        )
        supervisor.hardware = lambda: succeed(nvml.thd_census())
        self.asked: list[Path] = []

        def devices(binary: Path, known: Any) -> tuple[tuple[str, float], list[str] | None]:
            key = (str(binary), 1.0)
            if key in known:
                return key, known[key]
            self.asked.append(binary)
            return key, None if self.engine_devices is None else list(self.engine_devices)

        self.engine_devices: list[str] | None = ["CUDA0: NVIDIA GeForce RTX 4090 (24564 MiB, 24000 MiB free)"]
        supervisor.engine_devices = devices
        return supervisor

    def test_a_child_sees_its_plans_gpu_with_its_layers(self) -> None:
        from blazar.testing import GIB, FakeNVML

        nvml = FakeNVML.with_gpus(24 * GIB, 24 * GIB)
        nvml.set_free(0, 2 * GIB)  # GPU 1 has the most room
        supervisor = self.make(nvml)
        self.health = 503
        d = ensureDeferred(supervisor.instance_for("m"))
        instance = supervisor.instances()[0]
        _, _, argv, env = self.reactor.spawned[0]
        self.assertEqual(env["CUDA_VISIBLE_DEVICES"], "1")
        self.assertEqual(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID")
        self.assertEqual(argv[argv.index("-ngl") + 1], str(instance.plan.n_units))  # all of it
        self.assertEqual(argv[argv.index("--fit") + 1], "off")
        self.assertNotIn("--tensor-split", argv)
        # ready: NVML's figure for the child corrects the next plan
        nvml.set_process_memory(not_none(instance.pid), 1, sum(instance.plan.gpu_bytes.values()) + 50 * 2**20)
        self.health = 200
        self.reactor.advance(0.05)
        self.assertIs(self.successResultOf(d), instance)
        self.assertEqual(supervisor._room.corrections["m:latest"], 50 * 2**20)
        self.assertEqual([v.vram for v in supervisor.snapshot()], [sum(instance.plan.gpu_bytes.values())])

    def test_a_draft_model_is_counted_in_the_plan_and_rides_on_its_gpu(self) -> None:
        from blazar.engines.llamacpp import context_per_slot
        from blazar.engines.planner import draft_bytes, estimate_need
        from blazar.models.gguf_meta import thd_read_metadata
        from blazar.testing import GIB, FakeNVML

        plain = self.make(FakeNVML.with_gpus(24 * GIB))
        ensureDeferred(plain.instance_for("m"))
        without = sum(plain.instances()[0].plan.gpu_bytes.values())
        supervisor = self.make(FakeNVML.with_gpus(24 * GIB), 'speculative = "draft"\ndraft_model = "d"\n')
        ensureDeferred(supervisor.instance_for("m"))
        instance = supervisor.instances()[0]
        _, _, argv, _ = self.reactor.spawned[0]
        self.assertEqual(argv[argv.index("--spec-draft-ngl") + 1], "all")
        # the draft's weights, KV cache and compute buffer at the target's slots, on the target's GPU
        assert instance.entry.draft is not None
        per_slot = context_per_slot(instance.entry, thd_read_metadata(instance.entry.path))
        draft = draft_bytes(estimate_need("d", thd_read_metadata(instance.entry.draft), per_slot, 2))
        self.assertGreater(draft, 0)
        self.assertEqual(sum(instance.plan.gpu_bytes.values()) - without, draft)

    def test_a_model_that_cannot_be_placed_is_refused_with_its_levers(self) -> None:
        from blazar.engines.supervisor import NoCapacity
        from blazar.testing import GIB, FakeNVML

        nvml = FakeNVML.with_gpus(24 * GIB)
        nvml.set_free(0, 1 << 20)
        supervisor = self.make(nvml, "gpu_layers = 99\n")  # all of it on the GPU, as asked
        failure = self.failureResultOf(ensureDeferred(supervisor.instance_for("m")), NoCapacity)
        self.assertIn("gpu_layers", str(failure.value))
        self.assertEqual(self.reactor.spawned, [])

    def test_gpu_reserve_bytes_is_left_free_on_each_gpu(self) -> None:
        from blazar.engines.supervisor import NoCapacity
        from blazar.testing import GIB, FakeNVML

        nvml = FakeNVML.with_gpus(24 * GIB)
        nvml.set_free(0, 2 * GIB)
        self.successResultOf(ensureDeferred(self.make(nvml, "gpu_layers = 99\n").instance_for("m")))  # fits
        supervisor = self.make(nvml, "gpu_layers = 99\n", top=f"gpu_reserve_bytes = {2 * GIB - (1 << 20)}\n")
        failure = self.failureResultOf(ensureDeferred(supervisor.instance_for("m")), NoCapacity)
        self.assertIn("kept free by gpu_reserve_bytes", str(failure.value))

    def test_a_cpu_build_on_a_gpu_machine_runs_its_children_on_the_cpu(self) -> None:
        """
        An engine that lists no CUDA device (a CPU build) gets no GPU plan:
        its children are CPU children, and the binary is asked once.
        """
        from blazar.testing import GIB, FakeNVML

        supervisor = self.make(FakeNVML.with_gpus(24 * GIB))
        self.engine_devices = []
        instance = self.successResultOf(ensureDeferred(supervisor.instance_for("m")))
        _, _, argv, env = self.reactor.spawned[0]
        self.assertNotIn("-ngl", argv)
        self.assertNotIn("CUDA_VISIBLE_DEVICES", env)
        self.assertIsNone(instance.plan)
        self.assertFalse(self.successResultOf(ensureDeferred(supervisor._room.engine_uses_gpus(Path("/bin/true"), 1))))
        self.assertEqual(self.asked, [Path("/bin/true")])  # once per binary file

    def test_an_engine_that_cannot_say_is_asked_again(self) -> None:
        """
        A C{--list-devices} that failed (a slow driver, a timeout) puts this
        child on the CPU, and the next start asks again.
        """
        from blazar.testing import GIB, FakeNVML

        supervisor = self.make(FakeNVML.with_gpus(24 * GIB))
        self.engine_devices = None
        self.assertFalse(self.successResultOf(ensureDeferred(supervisor._room.engine_uses_gpus(Path("/bin/true"), 1))))
        self.engine_devices = ["CUDA0: NVIDIA GeForce RTX 4090 (24564 MiB, 24000 MiB free)"]
        self.assertTrue(self.successResultOf(ensureDeferred(supervisor._room.engine_uses_gpus(Path("/bin/true"), 1))))
        self.assertTrue(self.successResultOf(ensureDeferred(supervisor._room.engine_uses_gpus(Path("/bin/true"), 1))))
        self.assertEqual(self.asked, [Path("/bin/true")] * 2)

    def test_a_machine_without_gpus_is_as_before(self) -> None:
        from blazar.testing import FakeNVML

        supervisor = self.make(FakeNVML())
        self.successResultOf(ensureDeferred(supervisor.instance_for("m")))
        _, _, argv, env = self.reactor.spawned[0]
        self.assertNotIn("-ngl", argv)
        self.assertNotIn("CUDA_VISIBLE_DEVICES", env)


class GPUMemoryTests(SynchronousTestCase):
    """
    What each child holds on each GPU, as C{blazar ps}, the dashboard and
    C{blazar_model_vram_bytes{model,gpu}} show it: the plan's figure until
    NVML has measured the ready child, NVML's after; the series goes with
    the child. (Against blazar.testing.FakeNVML.)
    """

    make: Callable[..., Supervisor] = GPUPlacementTests.make
    reactor: Any  # set by the borrowed make

    def vram(self, supervisor: Supervisor, gpu: int) -> float | None:
        return supervisor.metrics.registry.get_sample_value(
            "blazar_model_vram_bytes", {"model": "m:latest", "gpu": str(gpu)}
        )

    def test_one_gpu_planned_then_measured_then_gone(self) -> None:
        from blazar.testing import GIB, FakeNVML

        nvml = FakeNVML.with_gpus(24 * GIB)
        supervisor = self.make(nvml)
        self.health = 503
        d = ensureDeferred(supervisor.instance_for("m"))
        instance = supervisor.instances()[0]
        planned = instance.plan.gpu_bytes[0]
        self.assertGreater(planned, 0)
        # loading: the plan's figure
        self.assertEqual(self.vram(supervisor, 0), planned)
        (view,) = supervisor.snapshot()
        self.assertEqual(view.gpu_memory(), [(0, planned, None)])
        self.assertEqual(view.gpu_held(), {0: planned})
        # ready: NVML's
        nvml.set_process_memory(not_none(instance.pid), 0, planned + 64 * 2**20)
        self.health = 200
        self.reactor.advance(0.05)
        self.successResultOf(d)
        self.assertEqual(instance.vram_measured, {0: planned + 64 * 2**20})
        self.assertEqual(self.vram(supervisor, 0), planned + 64 * 2**20)
        (view,) = supervisor.snapshot()
        self.assertEqual(view.gpu_memory(), [(0, planned, planned + 64 * 2**20)])
        # stopping: it still holds it; exited: the series is gone
        supervisor.stop_instance(instance, "requested")
        self.assertEqual(self.vram(supervisor, 0), planned + 64 * 2**20)
        instance.transport.exit(0)
        self.assertIsNone(self.vram(supervisor, 0))
        self.assertNotIn(b"blazar_model_vram_bytes{", supervisor.metrics.render())

    def test_two_gpus_a_split_model_has_a_series_per_gpu(self) -> None:
        from blazar.testing import GIB, FakeNVML

        nvml = FakeNVML.with_gpus(24 * GIB, 24 * GIB)
        supervisor = self.make(nvml, "tensor_split = [1, 1]\n")
        self.health = 503
        d = ensureDeferred(supervisor.instance_for("m"))
        instance = supervisor.instances()[0]
        self.assertEqual(sorted(instance.plan.gpu_bytes), [0, 1])
        self.assertEqual(
            [self.vram(supervisor, g) for g in (0, 1)], [instance.plan.gpu_bytes[0], instance.plan.gpu_bytes[1]]
        )
        # NVML sees it on GPU 0 only: GPU 1 is measured at 0, not left at its plan
        nvml.set_process_memory(not_none(instance.pid), 0, 300 * 2**20)
        self.health = 200
        self.reactor.advance(0.05)
        self.successResultOf(d)
        self.assertEqual([self.vram(supervisor, g) for g in (0, 1)], [300 * 2**20, None])
        (view,) = supervisor.snapshot()
        self.assertEqual(
            view.gpu_memory(), [(0, instance.plan.gpu_bytes[0], 300 * 2**20), (1, instance.plan.gpu_bytes[1], 0)]
        )
        instance.transport.exit(0)
        self.assertEqual([self.vram(supervisor, g) for g in (0, 1)], [None, None])

    def test_no_gpu_no_series_and_nothing_measured(self) -> None:
        from blazar.testing import FakeNVML

        supervisor = self.make(FakeNVML())
        instance = self.successResultOf(ensureDeferred(supervisor.instance_for("m")))
        self.reactor.advance(0.05)
        self.assertIsNone(instance.vram_measured)
        (view,) = supervisor.snapshot()
        self.assertEqual(
            (view.vram_planned, view.vram_measured, view.gpu_memory(), view.gpu_held()), (None, None, [], {})
        )
        self.assertNotIn(b"blazar_model_vram_bytes{", supervisor.metrics.render())
        self.assertIn(b"# TYPE blazar_model_vram_bytes gauge", supervisor.metrics.render())

    def test_a_child_the_planner_did_not_place_is_measured_too(self) -> None:
        from blazar.testing import GIB, FakeNVML

        nvml = FakeNVML.with_gpus(24 * GIB)
        supervisor = self.make(nvml)
        self.health = 503
        d = ensureDeferred(supervisor.instance_for("m"))
        instance = supervisor.instances()[0]
        instance.plan = instance.need = None  # as a child of another lane, or spawned without a census
        nvml.set_process_memory(not_none(instance.pid), 0, 200 * 2**20)
        self.health = 200
        self.reactor.advance(0.05)
        self.successResultOf(d)
        self.assertEqual(self.vram(supervisor, 0), 200 * 2**20)
        (view,) = supervisor.snapshot()
        self.assertEqual(view.gpu_memory(), [(0, None, 200 * 2**20)])
        self.assertEqual(supervisor._room.corrections, {})  # no plan: nothing to correct
