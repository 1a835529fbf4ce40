"""
SIGHUP reloads the config (L{blazar.service.ReloadOnHangup}), with a fake
signal table and a reactor whose C{callFromThread} queues: no real signal,
reactor or time.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.logger import LogEvent, LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import ConfigError, ReloadReport, load_config
from blazar.protocols.keyadmin import KeyAdmin
from blazar.service import ReloadOnHangup
from blazar.testing import fake_process_reactor
from blazar.web.auth import KeyHolder

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
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

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
            formatEvent(e) for e in self.events
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
