"""
SIGHUP reloads the config (L{blazar.service.ReloadOnHangup}), with a fake
signal table and a reactor whose C{callFromThread} queues: no real signal,
reactor or time.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Callable, cast

from twisted.internet.defer import Deferred
from twisted.logger import ILogObserver, LogEvent, LogLevel, LogPublisher, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest

from blazar.config import ConfigError, ReloadReport, load_config
from blazar.engines.supervisor import Instance
from blazar.protocols.keyadmin import KeyAdmin
from blazar.service import ReloadOnHangup
from blazar.testing import fake_process_reactor
from blazar.web.auth import KeyHolder
from blazar.web.client import context_of
from tests.typed import not_none

GOOD = '[[keys]]\nname = "first"\nsecret = "first-secret-0123456789"\n'


class SignalTable:
    """
    C{signal.signal}'s contract: set a handler, return the previous one
    (L{None} when it was not set from Python).
    """

    def __init__(self, previous: Any = None) -> None:
        self.handlers: dict[int, Any] = {signal.SIGHUP: previous}

    def __call__(self, signum: int, handler: Any) -> Any:
        previous = self.handlers.get(signum)
        self.handlers[signum] = handler
        return previous

    def deliver(self, signum: int) -> None:
        self.handlers[signum](signum, None)


class Reconfigurable:
    def __init__(self) -> None:
        self.configs: list[Any] = []

    def reconfigure(self, config: Any) -> None:
        self.configs.append(config)


class ReloadOnHangupTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = fake_process_reactor()
        self.queued: list[Callable[[], Any]] = []
        self.reactor.callFromThread = lambda f, *a, **kw: self.queued.append(lambda: f(*a, **kw))
        self.signals = SignalTable(previous="twistd's")
        self.events: list[LogEvent] = []
        globalLogPublisher.addObserver(cast(ILogObserver, self.events.append))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, self.events.append))

    def service(self, reload: Callable[[], Any], source: Path | None = None) -> ReloadOnHangup:
        service = ReloadOnHangup(reload, self.reactor, source or Path("/etc/blazar.toml"), self.signals)
        service.startService()
        return service

    def run_queued(self) -> None:
        # the thread pool's results come back through callFromThread too
        while self.queued:
            self.queued.pop(0)()

    def messages(self, level: LogLevel | None = None) -> list[str]:
        return [
            formatEvent(e)
            for e in self.events
            if e.get("log_namespace") == "blazar.service" and (level is None or e["log_level"] == level)
        ]

    def test_the_handler_only_schedules_the_reload(self) -> None:
        calls = []

        async def reload() -> ReloadReport:
            calls.append(1)
            return ReloadReport()

        self.service(reload)
        self.signals.deliver(signal.SIGHUP)
        self.assertEqual((calls, len(self.queued)), ([], 1))  # nothing done inside the handler
        self.run_queued()
        self.assertEqual(calls, [1])
        self.assertIn("SIGHUP: config reloaded from /etc/blazar.toml", self.messages(LogLevel.info))

    def test_settings_that_need_a_restart_are_named(self) -> None:
        async def reload() -> ReloadReport:
            return ReloadReport(restart=("listen", "data_dir"))

        self.service(reload)
        self.signals.deliver(signal.SIGHUP)
        self.run_queued()
        self.assertEqual(
            self.messages(LogLevel.warn),
            ["SIGHUP: config reloaded from /etc/blazar.toml; restart the daemon to apply: listen, data_dir"],
        )

    def test_a_bad_config_is_logged_and_the_running_one_kept(self) -> None:
        root = Path(self.mktemp())
        root.mkdir()
        path = root / "config.toml"
        path.write_text(GOOD)
        holder = KeyHolder(load_config(path))
        admin = KeyAdmin(path, holder.live, self.reactor)
        supervisor, registry = Reconfigurable(), Reconfigurable()
        holder.live.subscribe(supervisor.reconfigure)
        holder.live.subscribe(registry.reconfigure)
        service = self.service(admin.reload, path)

        path.write_text(GOOD + 'listen = "tcp:1"\nlisten = "tcp:2"\n')  # TOML error: a key twice
        self.signals.deliver(signal.SIGHUP)
        self.run_queued()
        self.assertEqual([k.name for k in holder.config.keys], ["first"])
        self.assertEqual((supervisor.configs, registry.configs), ([], []))
        (error,) = self.messages(LogLevel.error)
        self.assertIn("SIGHUP: config not reloaded, the running config stays:", error)
        self.assertIn(str(path), error)
        self.assertTrue(service.running)

        path.unlink()  # a missing file: the same
        self.signals.deliver(signal.SIGHUP)
        self.run_queued()
        self.assertEqual(len(self.messages(LogLevel.error)), 2)

        path.write_text(GOOD + '[[keys]]\nname = "second"\nsecret = "second-secret-0123456789"\n')
        self.signals.deliver(signal.SIGHUP)
        self.run_queued()
        self.assertEqual([k.name for k in holder.config.keys], ["first", "second"])
        self.assertEqual(supervisor.configs, [holder.config])
        self.assertEqual(registry.configs, [holder.config])

    def test_no_config_file_is_a_logged_error(self) -> None:
        async def reload() -> ReloadReport:
            raise ConfigError("this daemon runs without a config file: nothing to reload")

        self.service(reload)
        self.signals.deliver(signal.SIGHUP)
        self.run_queued()
        self.assertEqual(len(self.messages(LogLevel.error)), 1)

    def test_a_bug_in_the_reload_is_logged_not_raised(self) -> None:
        async def reload() -> ReloadReport:
            raise RuntimeError("boom")

        service = self.service(reload)
        self.assertIsNone(self.successResultOf(service.reload()))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertTrue(service.running)

    def test_stop_ignores_hangups_and_restores_the_handler_after_shutdown(self) -> None:
        calls = []

        async def reload() -> ReloadReport:
            calls.append(1)
            return ReloadReport()

        service = self.service(reload)
        self.assertNotEqual(self.signals.handlers[signal.SIGHUP], "twistd's")
        self.successResultOf(service.stopService())
        # engines may still be draining: a hangup now must not kill the daemon
        self.signals.deliver(signal.SIGHUP)
        self.run_queued()
        self.assertEqual(calls, [])
        self.assertIn("SIGHUP while stopping: ignored", self.messages())
        for f, args, kw in self.reactor.triggers["after"]["shutdown"]:
            f(*args, **kw)
        self.assertEqual(self.signals.handlers[signal.SIGHUP], "twistd's")

    def test_a_handler_not_set_from_python_comes_back_as_the_default(self) -> None:
        self.signals = SignalTable(previous=None)

        async def reload() -> ReloadReport:
            return ReloadReport()

        service = self.service(reload)
        service.stopService()
        for f, args, kw in self.reactor.triggers["after"]["shutdown"]:
            f(*args, **kw)
        self.assertIs(self.signals.handlers[signal.SIGHUP], signal.SIG_DFL)

    def test_restarted_service_remembers_the_first_previous_handler(self) -> None:
        async def reload() -> ReloadReport:
            return ReloadReport()

        service = self.service(reload)
        service.stopService()
        service.startService()  # before the reactor shut down
        for f, args, kw in self.reactor.triggers["after"]["shutdown"]:
            f(*args, **kw)  # running again: the restore waits
        self.assertNotEqual(self.signals.handlers[signal.SIGHUP], "twistd's")
        service.stopService()
        for f, args, kw in self.reactor.triggers["after"]["shutdown"]:
            f(*args, **kw)
        self.assertEqual(self.signals.handlers[signal.SIGHUP], "twistd's")

    def test_stop_waits_for_a_reload_in_progress(self) -> None:
        gate: Deferred[None] = Deferred()

        async def reload() -> ReloadReport:
            await gate
            return ReloadReport()

        service = self.service(reload)
        self.signals.deliver(signal.SIGHUP)
        self.run_queued()
        stopped = service.stopService()
        self.assertNoResult(stopped)
        gate.callback(None)
        self.successResultOf(stopped)
        self.assertEqual(service.reloads, set())


class ReloadEveryKeyTests(SynchronousTestCase):
    """
    Every key that L{blazar.config.RELOAD_TABLE} marks as applied at run
    time, changed in the config file and reloaded through the assembled
    daemon (L{blazar.service.assemble}, no sockets: a fake process reactor),
    then observed where the service that uses it reads it: the next spawn's
    argv, its ready and stop timers, the site's connection cap, the proxy's
    header timer, a stream's stall bound, the door's answer, and so on.
    The HTTP-visible keys are observed through a real daemon too
    (tests/integration/test_reload_e2e.py).
    """

    SECRET = "reloaded-secret-0123456789"

    def setUp(self) -> None:
        from blazar.models.testmodel import make_test_model
        from blazar.service import assemble

        self.root = Path(self.mktemp()).absolute()
        make_test_model(self.root / "models" / "m.gguf")
        (self.root / "other").mkdir()
        self.path = self.root / "config.toml"
        self.write()
        self.reactor = fake_process_reactor()
        self.tree = assemble(load_config(self.path), self.reactor, {}, LogPublisher())

    def write(self, top: str = "", tables: str = "") -> None:
        self.path.write_text(
            f'data_dir = "{self.root / "data"}"\n'
            + ("" if "models_dir" in top else f'models_dir = "{self.root / "models"}"\n')
            + top
            + '[engines.llamacpp]\nbinary = "/bin/true"\n'
            + tables
            + '[[keys]]\nname = "root"\nsecret = "root-secret-0123456789"\n'
        )

    def reload(self, top: str = "", tables: str = "") -> Any:
        self.write(top, tables)
        return self.successResultOf(Deferred.fromCoroutine(self.tree.key_admin.reload()))

    def spawn(self) -> tuple[Any, list[str], Deferred[Any]]:
        """
        Start model m (its child never answers /health here): the instance,
        its argv and the Deferred of C{instance_for}.
        """
        from twisted.internet.defer import ensureDeferred

        d = ensureDeferred(self.tree.engines.supervisor.instance_for("m"))
        transport, _, argv, _ = self.reactor.spawned[-1]
        (instance,) = [i for i in self.tree.engines.supervisor._all if i.transport is transport]
        return instance, argv, d

    def end(self, instance: Any, d: Deferred[Any]) -> None:
        if not instance.transport.ended:
            instance.transport.exit(signal=15)
        d.addErrback(lambda f: None)
        self.tree.engines.supervisor.reset_breakers()

    def applied(self, report: Any, key: str) -> None:
        self.assertEqual((report.applied, report.restart), ((key,), ()))

    def check(self, key: str, top: str, tables: str, observe: Callable[[], Any], expected: Any) -> None:
        self.assertNotEqual(observe(), expected, key)
        self.applied(self.reload(top, tables), key)
        self.assertEqual(observe(), expected, key)
        self.applied(self.reload(), key)  # back to the base file
        self.assertNotEqual(observe(), expected, key)

    def test_every_runtime_key_is_checked_here(self) -> None:
        from blazar.config import RELOAD_TABLE, RUNTIME

        runtime = {key for key, kind in RELOAD_TABLE.values() if kind == RUNTIME} - {"source"}
        self.assertEqual(runtime, set(self.CHECKED))

    CHECKED = (
        "models_dir",
        "ready_timeout",
        "stop_grace",
        "max_body_bytes",
        "header_timeout_secs",
        "body_min_bytes_per_sec",
        "max_connections_per_ip",
        "cors_origins",
        "allowed_hosts",
        "keep_alive",
        "idle_timeout_secs",
        "breaker_crashes",
        "breaker_window_secs",
        "breaker_backoff_secs",
        "breaker_max_backoff_secs",
        "max_loaded_models",
        "memory_budget_bytes",
        "gpu_reserve_bytes",
        "drain_timeout_secs",
        "child_header_timeout_secs",
        "stream_stall_close_secs",
        "ctx_policy",
        "hf_endpoint",
        "metrics_require_key",
        "responses_ttl_secs",
        "responses_max_stored",
        "engines.llamacpp",
        "queue",
        "models",
        "keys",
        "session_keep_secs",
        "session_save_timeout_secs",
        "session_bank_entry_max_mib",
        "session_bank_max_mib",
        "sentinel_enforce",
        "sentinel_stall_secs",
        "engines.NAME (command lanes)",
        "whisper_idle_secs",
        "sdcpp_child_header_timeout_secs",
        "engines.whisper",
        "engines.sdcpp",
        "remotes",
        "batch_max_in_flight",
        "cache",
        "max_messages",
        "max_tools",
        "max_schema_nodes",
        "max_file_bytes_per_key",
        "engines.gate_max_slowdown",
        "max_blob_bytes",
        "image_fetch_max_bytes",
        "image_fetch_timeout_secs",
        "image_fetch_private_hosts",
        "ollama_models",
        "registry",
    )

    def test_gate_max_slowdown(self) -> None:
        # read by `blazar engine use` from the file each time; the daemon's live config follows it too
        self.check(
            "engines.gate_max_slowdown",
            "",
            "[engines]\ngate_max_slowdown = 0.2\n",
            lambda: self.tree.live.current.gate_max_slowdown,
            0.2,
        )

    def test_remote_keys(self) -> None:
        from twisted.internet.defer import ensureDeferred

        # the registry resolves NAME:model and the supervisor hands out its instance from the live config
        def remote_url() -> Any:
            d = ensureDeferred(self.tree.engines.supervisor.instance_for("peer:tiny"))
            d.addErrback(lambda f: None)
            instance = self.successResultOf(d)
            return None if instance is None else (instance.base_url, instance.lane, instance.entry.remote_model)

        self.check(
            "remotes",
            "",
            '[[remotes]]\nname = "peer"\nbase_url = "http://10.0.0.2:8080/v1"\nmodels = ["tiny"]\n',
            remote_url,
            ("http://10.0.0.2:8080", "remote", "tiny"),
        )

    def test_batch_max_in_flight(self) -> None:
        # the batch runner reads it from the live config at each line it starts
        runner = self.tree.batches.runner
        assert runner is not None
        self.check("batch_max_in_flight", "batch_max_in_flight = 9\n", "", runner.max_in_flight, 9)

    def test_max_file_bytes_per_key(self) -> None:
        # the Files API reads it from the live config at each upload
        runner = self.tree.batches.runner
        assert runner is not None
        self.check("max_file_bytes_per_key", "max_file_bytes_per_key = 9\n", "", runner.max_file_bytes, 9)

    def test_cache_keys(self) -> None:
        # the cache's store reads [cache] from the live config at each lookup, store and purge
        cache = self.tree.stores.cache.cache
        assert cache is not None and self.tree.gateway.pipeline is not None
        self.assertIs(self.tree.gateway.pipeline.cache, cache)  # the one the pipeline looks answers up in
        self.check("cache.threshold", "", "[cache]\nthreshold = 0.5\n", lambda: cache._config().threshold, 0.5)
        self.check("cache.ttl_secs", "", "[cache]\nttl_secs = 5\n", lambda: cache._config().ttl, 5)
        self.check("cache.max_entries", "", "[cache]\nmax_entries = 7\n", lambda: cache._config().max_entries, 7)
        # and the pipeline its switch, per call
        pipeline = self.tree.gateway.pipeline
        assert pipeline is not None
        report = self.reload("", '[cache]\nenabled = true\nembedding_model = "e"\n[models."e"]\nembedding = true\n')
        self.assertEqual(
            (report.applied, report.restart), (("cache.enabled", "cache.embedding_model", 'models."e:latest"'), ())
        )
        self.assertEqual(pipeline._config().cache.embedding_model, "e:latest")
        self.assertTrue(pipeline._config().cache.enabled)

    def test_builtin_lane_keys(self) -> None:
        from blazar.gateway.engine_proxy import header_timeout_of
        from blazar.testing import FakeInstance

        # the supervisor reads them from its live config at each whisper or sd child's start
        supervisor = self.tree.engines.supervisor
        self.check("whisper_idle_secs", "whisper_idle_secs = 5\n", "", lambda: supervisor._config.whisper_idle, 5)
        self.check(
            "engines.whisper.binary",
            "",
            '[engines.whisper]\nbinary = "/bin/sh"\n',
            lambda: str(supervisor._config.whisper.binary),
            "/bin/sh",
        )
        self.check(
            "engines.sdcpp.args",
            "",
            '[engines.sdcpp]\nargs = ["--steps", "1"]\n',
            lambda: supervisor._config.sdcpp.args,
            ("--steps", "1"),
        )
        # and the proxy its header timer for an sd child (a chat child's is child_header_timeout_secs)
        sd = FakeInstance("img", lane="sdcpp")
        self.check(
            "sdcpp_child_header_timeout_secs",
            "sdcpp_child_header_timeout_secs = 33\n",
            "",
            lambda: header_timeout_of(self.tree.gateway.proxy._config(), sd),
            ("sdcpp_child_header_timeout_secs", 33),
        )

    def test_image_fetch_keys(self) -> None:
        # the pipeline's image fetcher reads them from the live config at each fetch
        images = self.tree.gateway.pipeline.images
        assert images is not None
        self.check(
            "image_fetch_max_bytes",
            "image_fetch_max_bytes = 9\n",
            "",
            lambda: images._config().image_fetch_max_bytes,
            9,
        )
        self.check(
            "image_fetch_timeout_secs",
            "image_fetch_timeout_secs = 2\n",
            "",
            lambda: images._config().image_fetch_timeout,
            2,
        )
        self.check(
            "image_fetch_private_hosts",
            'image_fetch_private_hosts = ["Img.LAN."]\n',
            "",
            lambda: images._config().image_fetch_private_hosts,
            ("img.lan",),
        )

    def test_request_limits(self) -> None:
        # the pipeline reads them from the live config with each chat
        for key in ("max_messages", "max_tools", "max_schema_nodes"):
            self.check(key, f"{key} = 3\n", "", lambda: getattr(self.tree.live.current, key), 3)

    def test_sentinel_enforce(self) -> None:
        # the pipeline reads it from the live config with each answer
        self.check(
            "sentinel_enforce", "sentinel_enforce = true\n", "", lambda: self.tree.live.current.sentinel_enforce, True
        )
        self.check(
            "sentinel_stall_secs", "sentinel_stall_secs = 3\n", "", lambda: self.tree.live.current.sentinel_stall, 3
        )

    def test_session_keys(self) -> None:
        settings = self.tree.stores.sessions.sessions._settings
        self.check("session_keep_secs", "session_keep_secs = 0\n", "", lambda: settings()[0], 0)
        self.check("session_save_timeout_secs", "session_save_timeout_secs = 7\n", "", lambda: settings()[1], 7)
        self.check("session_bank_entry_max_mib", "session_bank_entry_max_mib = 3\n", "", lambda: settings()[2], 3 << 20)
        self.check("session_bank_max_mib", "session_bank_max_mib = 5\n", "", lambda: settings()[3], 5 << 20)

    def test_site_keys(self) -> None:
        site = self.tree.site
        self.check("max_body_bytes", "max_body_bytes = 1234\n", "", lambda: site.max_body_bytes, 1234)
        # (the door reads it from the live config at each blob upload's headers)
        self.check("max_blob_bytes", "max_blob_bytes = 4321\n", "", lambda: site.config().max_blob_bytes, 4321)
        self.check("header_timeout_secs", "header_timeout_secs = 3\n", "", lambda: site.header_timeout, 3)
        self.check("body_min_bytes_per_sec", "body_min_bytes_per_sec = 7\n", "", lambda: site.body_min_rate, 7)
        self.check(
            "cors_origins",
            'cors_origins = ["https://app.example"]\n',
            "",
            lambda: site.cors_origins,
            ("https://app.example",),
        )
        # (the door reads it from the live config at every keyless request)
        self.check(
            "allowed_hosts", 'allowed_hosts = ["GPU.lan."]\n', "", lambda: self.tree.live().allowed_hosts, ("gpu.lan",)
        )

    def test_max_connections_per_ip_caps_the_next_connection(self) -> None:
        from twisted.internet.address import IPv4Address
        from twisted.internet.testing import StringTransport

        def second_is_over_cap() -> bool:
            channels = []
            for _ in range(2):
                channel = self.tree.site.buildProtocol(None)
                channel.makeConnection(StringTransport(peerAddress=IPv4Address("TCP", "10.1.2.3", 40000)))
                channels.append(channel)
            over = bool(channels[1].over_cap)
            for channel in channels:
                channel.connectionLost(None)
            return over

        self.check("max_connections_per_ip", "max_connections_per_ip = 1\n", "", second_is_over_cap, True)

    def test_door_keys(self) -> None:
        from twisted.internet.address import IPv4Address
        from twisted.web.test.requesthelper import DummyRequest

        from blazar.gateway.errors import describe
        from blazar.web.auth import Refusal

        def door(path: bytes, secret: str | None = None) -> Any:
            request = DummyRequest([path[1:]])
            request.method = b"GET"
            cast(Any, request).path = path  # the gate reads it; DummyRequest does not declare it
            request.client = IPv4Address("TCP", "127.0.0.1", 5000)
            if secret is not None:
                request.requestHeaders.setRawHeaders(b"authorization", [f"Bearer {secret}".encode()])
            found = not_none(self.tree.site.gate).authenticate(cast(IRequest, request))
            return describe(found).status if isinstance(found, Refusal) else found.name if found else None

        self.check(
            "keys",
            "",
            f'[[keys]]\nname = "late"\nsecret = "{self.SECRET}"\n',
            lambda: door(b"/v1/models", self.SECRET),
            "late",
        )
        # unset: /metrics needs an (admin) key, from loopback too; false: it is open
        self.check("metrics_require_key", "metrics_require_key = false\n", "", lambda: door(b"/metrics"), None)

    def test_proxy_keys(self) -> None:
        from blazar.testing import FakeInstance
        from tests.gateway.test_backpressure import EngineBody, connect

        def header_timer() -> float:
            request: Deferred[Any] = Deferred()
            d = Deferred.fromCoroutine(self.tree.gateway.proxy._headers(cast(Instance, FakeInstance("m")), request))
            now = self.reactor.seconds()
            (timer,) = [c for c in self.reactor.getDelayedCalls() if c.getTime() > now]
            d.cancel()
            self.failureResultOf(d)
            return timer.getTime() - now

        self.check("child_header_timeout_secs", "child_header_timeout_secs = 9\n", "", header_timer, 9)

        def stall_bound() -> float:
            request, _, _ = connect(self.reactor)
            engine = EngineBody()
            relay = Deferred.fromCoroutine(
                self.tree.gateway.proxy.relay(
                    cast(Instance, FakeInstance("m")), engine, request.write, context_of(request)
                )
            )
            bound = not_none(request.producer)._stall_close_secs
            engine.end()
            self.successResultOf(relay)
            return bound

        self.check("stream_stall_close_secs", "stream_stall_close_secs = 4\n", "", stall_bound, 4)
        self.check("ctx_policy", 'ctx_policy = "fit"\n', "", lambda: self.tree.engines.supervisor.ctx_policy, "fit")

    def test_the_next_spawn_keys(self) -> None:
        def argv() -> list[str]:
            instance, argv, d = self.spawn()
            self.end(instance, d)
            return argv[argv.index("/bin/true") :]

        self.check("engines.llamacpp.args", "", 'args = ["--reloaded"]\n', lambda: argv()[-1], "--reloaded")
        self.check(
            'models."m:latest"',
            "",
            '[models."m"]\nctx_size = 1024\nparallel = 1\n',
            lambda: argv()[argv().index("-c") :][:4],
            ["-c", "1024", "-np", "1"],
        )

        def projector() -> str | None:
            started = argv()
            return started[started.index("--mmproj") + 1] if "--mmproj" in started else None

        self.check(
            'models."m:latest"',
            "",
            '[models."m"]\nmmproj = "mmproj-m.gguf"\n',
            projector,
            str(self.root / "models" / "mmproj-m.gguf"),
        )

        def lane_binary() -> str:
            instance, argv, d = self.spawn()
            self.end(instance, d)
            return argv[3]  # after the launcher: the lane's command

        # a lane serves a model that names it: both keys change together
        both = ("engines.NAME (command lanes)", 'models."m:latest"')
        self.assertNotEqual(lane_binary(), "/bin/alt")
        report = self.reload(
            "", '[engines.alt]\ncommand = ["/bin/alt", "--port", "{port}"]\n[models."m"]\nengine = "alt"\n'
        )
        self.assertEqual((report.applied, report.restart), (both, ()))
        self.assertEqual(lane_binary(), "/bin/alt")
        self.assertEqual(self.reload().applied, both)
        self.assertNotEqual(lane_binary(), "/bin/alt")
        self.check(
            "models_dir",
            f'models_dir = "{self.root / "other"}"\n',
            "",
            lambda: self.tree.engines.registry.models_dir,
            self.root / "other",
        )

        def ready_failure() -> str:
            instance, _, d = self.spawn()
            self.reactor.advance(0)
            for _ in range(400):
                if d.called:
                    break
                self.reactor.advance(0.5)
            message = str(self.failureResultOf(d).value)
            self.end(instance, d)
            return message.split(" s;")[0].rsplit("= ", 1)[1]

        self.check("ready_timeout", "ready_timeout = 7\n", "", ready_failure, "7")

        def kill_after() -> float:
            instance, _, d = self.spawn()
            self.tree.engines.supervisor.stop_instance(instance, "test")
            grace = instance.kill_timer.getTime() - self.reactor.seconds()
            self.end(instance, d)
            return grace

        self.check("stop_grace", "stop_grace = 2.5\n", "", kill_after, 2.5)

    def test_a_running_childs_idle_time_and_keep_alive(self) -> None:
        instance, _, d = self.spawn()
        self.check("idle_timeout_secs", "idle_timeout_secs = 77\n", "", lambda: instance.idle_timeout, 77)

        def default_keep_alive() -> float:
            from blazar.engines.lease import InstanceLease
            from blazar.gateway.call import CallKind

            # an Ollama request without keep_alive gets the default, and ends
            call = self.tree.gateway.ollama._call(CallKind.CHAT, "m", "", {}, {}, False)
            InstanceLease(self.tree.engines.supervisor, instance).finish(call.keep_alive)
            return instance.keep_alive

        self.check("keep_alive", 'keep_alive = "9m"\n', "", default_keep_alive, 540)
        self.end(instance, d)

    def test_breakers_admission_responses_hub(self) -> None:
        breaker = self.tree.engines.supervisor.breaker("m:latest")  # made before the reload: retuned
        for key, attr, value in [
            ("breaker_crashes", "threshold", 9),
            ("breaker_window_secs", "window", 99),
            ("breaker_backoff_secs", "base_backoff", 4),
            ("breaker_max_backoff_secs", "max_backoff", 44),
        ]:
            self.check(key, f"{key} = {value}\n", "", lambda: getattr(breaker, attr), value)
        supervisor = self.tree.engines.supervisor
        self.check("max_loaded_models", "max_loaded_models = 2\n", "", lambda: supervisor._config.max_loaded_models, 2)
        self.check(
            "memory_budget_bytes",
            "memory_budget_bytes = 1073741824\n",
            "",
            lambda: supervisor._config.memory_budget,
            1 << 30,
        )
        self.check(
            "gpu_reserve_bytes", "gpu_reserve_bytes = 2147483648\n", "", lambda: supervisor._config.gpu_reserve, 2 << 30
        )
        self.check("drain_timeout_secs", "drain_timeout_secs = 3\n", "", lambda: supervisor._config.drain_timeout, 3)
        queue = not_none(self.tree.gateway.admission).queue("m:latest")
        self.check(
            "queue.max_waiting",
            "",
            "[queue]\nmax_waiting = 3\n",
            lambda: not_none(self.tree.gateway.admission).queue("m:latest").settings.max_waiting,
            3,
        )
        self.assertIs(not_none(self.tree.gateway.admission).queue("m:latest"), queue)
        self.check(
            "responses_ttl_secs",
            "responses_ttl_secs = 60\n",
            "",
            lambda: self.tree.gateway.responses._config().responses_ttl,
            60,
        )
        self.check(
            "responses_max_stored",
            "responses_max_stored = 5\n",
            "",
            lambda: self.tree.gateway.responses._config().responses_max_stored,
            5,
        )
        self.check(
            "hf_endpoint",
            'hf_endpoint = "http://127.0.0.1:9/hub/"\n',
            "",
            lambda: self.tree.clients.hub._endpoint,
            "http://127.0.0.1:9/hub",
        )
        self.check(
            "ollama_models",
            f'ollama_models = "{self.root / "store"}"\n',
            "",
            lambda: self.tree.engines.registry.ollama_models,
            self.root / "store",
        )
        from blazar.models.ollama_store import parse_name

        library: Any = self.tree.gateway.ollama._operations._library
        self.check(
            "registry",
            'registry = "http://127.0.0.1:9/"\n',
            "",
            lambda: library.base_url(parse_name("tiny")),
            "http://127.0.0.1:9",
        )

    def test_restart_keys_are_named_and_keep_their_running_values(self) -> None:
        report = self.reload('listen = "tcp:1"\naudit_log = "/tmp/x.jsonl"\notlp_endpoint = "http://127.0.0.1:4318"\n')
        self.assertEqual((report.applied, report.restart), ((), ("listen", "audit_log", "otlp_endpoint")))
        self.assertEqual(self.tree.live.current.listen, ("tcp:11434:interface=127.0.0.1",))
        # named again at the next reload: still not applied
        self.assertEqual(self.reload('listen = "tcp:1"\n').restart, ("listen",))
        self.path.write_text(f'data_dir = "{self.root / "elsewhere"}"\n')
        report = self.successResultOf(Deferred.fromCoroutine(self.tree.key_admin.reload()))
        self.assertIn("data_dir", report.restart)
        self.assertEqual(self.tree.engines.registry.models_dir, self.root / "data" / "models")  # not moved


class StartupWarningTests(SynchronousTestCase):
    def test_a_config_with_secrets_others_may_read_is_named(self) -> None:
        """
        Issue 36: the daemon says at startup that its config file's secrets
        are readable by others, and how to fix it; it leaves the mode be.
        """
        from blazar.service import assemble

        root = Path(self.mktemp()).absolute()
        root.mkdir()
        path = root / "config.toml"
        path.write_text(
            f'data_dir = "{root / "data"}"\nmodels_dir = "{root}"\n'
            '[[keys]]\nname = "root"\nsecret = "root-secret-0123456789"\n'
        )
        path.chmod(0o644)
        events: list[LogEvent] = []
        globalLogPublisher.addObserver(cast(ILogObserver, events.append))
        try:
            assemble(load_config(path), fake_process_reactor(), {}, LogPublisher())
        finally:
            globalLogPublisher.removeObserver(cast(ILogObserver, events.append))
        warnings = [formatEvent(e) for e in events if e.get("log_level") == LogLevel.warn]
        self.assertIn(
            f"config file {path} holds secrets ([[keys]] secret) and everyone may read it (mode 644): "
            f"run `chmod 600 {path}`",
            warnings,
        )
        self.assertEqual(path.stat().st_mode & 0o777, 0o644)


class TLSListenerTests(SynchronousTestCase):
    def test_tls12_suites_are_forward_secret_aead_only(self) -> None:
        """
        An C{ssl:} listener offers TLS 1.2 clients ECDHE with AES-GCM or
        ChaCha20 only: no CBC-SHA and no static-RSA key exchange (issue 36;
        Twisted's defaults keep both). The real handshake is in
        tests/integration/test_hardening_lows_e2e.py.
        """
        from OpenSSL import SSL
        from twisted.internet.protocol import Factory
        from twisted.internet.testing import MemoryReactor

        from blazar.service import listener_service
        from tests.integration.test_tls_e2e import self_signed

        root = Path(self.mktemp())
        root.mkdir()
        cert, key = self_signed(root)
        service = listener_service(
            f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}", Factory(), MemoryReactor()
        )
        context = service.endpoint._sslContextFactory.getContext()
        suites = SSL.Connection(context, None).get_cipher_list()
        tls12 = [s for s in suites if not s.startswith("TLS_")]
        self.assertTrue(tls12)
        for suite in tls12:
            self.assertTrue(suite.startswith("ECDHE-") and ("GCM" in suite or "CHACHA20" in suite), suite)
        self.assertIn("TLS_AES_256_GCM_SHA384", suites)  # TLS 1.3 unchanged
        plain = listener_service("tcp:0:interface=127.0.0.1", Factory(), MemoryReactor())
        self.assertTrue(plain._raiseSynchronously)


class StoreSweepTests(SynchronousTestCase):
    def test_the_store_is_swept_of_what_a_crash_left_at_start(self) -> None:
        import os

        from blazar.service import sweep_store

        root = Path(self.mktemp())
        (root / "blobs").mkdir(parents=True)
        stale, fresh = root / "blobs" / ".tmp-upload-old", root / "blobs" / ".tmp-upload-new"
        for path, mtime in ((stale, 1000.0), (fresh, 3000.0)):
            path.write_bytes(b"x")
            os.utime(path, (mtime, mtime))
        reactor = fake_process_reactor()
        reactor.advance(2000.0)  # the daemon starts
        self.successResultOf(sweep_store(reactor, lambda: root))
        self.assertEqual([p.name for p in (root / "blobs").iterdir()], [fresh.name])


def assembled(root: Path) -> Any:
    """
    The daemon assembled (L{blazar.service.assemble}, no sockets: a fake
    process reactor) from a config with its data and models under
    C{root}, which is made.
    """
    from blazar.service import assemble

    root.mkdir()
    path = root / "config.toml"
    path.write_text(f'data_dir = "{root / "data"}"\nmodels_dir = "{root}"\n')
    return assemble(load_config(path), fake_process_reactor(), {}, LogPublisher())


class AssembledStoreTests(SynchronousTestCase):
    def test_one_store_started_before_its_parts(self) -> None:
        """
        One L{StoreService} in the tree, started before every part that
        keeps its state in it (and so stopped after them all).
        """
        from blazar.storeservice import StoreService

        root = Path(self.mktemp()).absolute()
        tree = assembled(root)
        services = list(tree.top)
        database = tree.stores.database
        self.assertEqual([s for s in services if isinstance(s, StoreService)], [database])
        self.assertEqual(database.path, root / "data" / "blazar.db")
        for part in (tree.stores.sessions, tree.stores.usage, tree.stores.cache, tree.batches.service):
            self.assertLess(services.index(database), services.index(part))
            self.assertIs(part._database, database)
        self.assertLess(services.index(tree.stores.sessions), services.index(tree.engines.supervisor))

    def test_a_live_namesake_stops_the_start_before_the_batch_runner_takes_back_lines(self) -> None:
        """
        Another node of this C{[cluster] node} name up at another URL stops
        the start at the store's open, before any part starts: the batch
        runner never takes back (fails) the live node's lines in flight.
        """
        import time

        from blazar import store
        from blazar.service import assemble
        from blazar.storeservice import NodeNameTaken

        root = Path(self.mktemp()).absolute()
        (root / "data").mkdir(parents=True)
        path = root / "config.toml"
        path.write_text(
            f'data_dir = "{root / "data"}"\nmodels_dir = "{root}"\n[cluster]\nnode = "gpu-1"\nurl = "http://me:11434"\n'
        )
        db = store.thd_open(root / "data" / "blazar.db")
        store.thd_put_node(db, ("gpu-1", "http://other:11434", "1", 1.0, time.time(), False, "[]"))
        db.close()
        tree = assemble(load_config(path), fake_process_reactor(), {}, LogPublisher())
        services = list(tree.top)
        with self.assertRaises(NodeNameTaken) as cm:
            tree.top.startService()
        self.assertIn("[cluster] node", str(cm.exception))
        for started in services[: services.index(tree.stores.database)]:
            self.addCleanup(started.stopService)
        self.assertFalse(tree.stores.database.is_open)
        self.assertLess(services.index(tree.stores.database), services.index(tree.batches.service))
        self.assertFalse(tree.batches.service.running)

    def test_shared_keys_only_with_a_cluster_database_and_read_before_the_listeners(self) -> None:
        """
        C{[cluster] database} adds the shared keys' poll to the tree after
        the store and before the listeners, and the door and the key admin
        use it; without it there is none.
        """
        root = Path(self.mktemp()).absolute()
        plain = assembled(root)
        self.assertIsNone(plain.stores.shared_keys)
        self.assertIsNone(plain.keys._shared)
        clustered = Path(self.mktemp()).absolute()
        clustered.mkdir()
        path = clustered / "config.toml"
        path.write_text(
            f'data_dir = "{clustered / "data"}"\nmodels_dir = "{clustered}"\n'
            '[cluster]\ndatabase = "postgresql://blazar@db.invalid:5432/blazar"\n'
        )
        from blazar.service import assemble

        tree = assemble(load_config(path), fake_process_reactor(), {}, LogPublisher())
        shared = tree.stores.shared_keys
        assert shared is not None
        services = list(tree.top)
        self.assertLess(services.index(tree.stores.database), services.index(shared))
        self.assertLess(services.index(shared), services.index(tree.batches.service))
        from blazar.service import Listeners

        (listeners,) = [s for s in services if isinstance(s, Listeners)]
        self.assertLess(services.index(shared), services.index(listeners))
        self.assertIs(tree.key_admin._shared, shared)
        shared.keys = ()
        self.assertFalse(tree.keys.active)
