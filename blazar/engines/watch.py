"""
The watch over each engine child's life after its spawn: ready once its
C{/health} answers 200 within C{ready_timeout_secs}; dead once its exit is
reported (L{ChildWatch.ended}) or found by a request (L{ChildWatch.exited});
and what a broken connection to it means (L{ChildWatch.explain}).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs
from twisted.internet.defer import CancelledError, ensureDeferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from blazar.config import Config
from blazar.engines import runfiles
from blazar.engines.breaker import Breakers
from blazar.engines.errors import (
    EngineCrashed,
    EngineError,
    EngineStartFailed,
    UnknownArchitecture,
    UnloadedWhileLoading,
)
from blazar.engines.instance import Instance, InstanceState
from blazar.engines.process import ExitStatus
from blazar.engines.remote import RemoteInstance, Remotes, failure_text
from blazar.engines.room import Room
from blazar.metrics import Metrics, label_reason

log = Logger()


@attrs.define(eq=False)
class ChildWatch:
    """
    Watches the supervisor's children from spawn to exit.

    @ivar _probe: Returns the HTTP status of a GET to a URL (C{/health}).
    @ivar _instances: The supervisor's live child per model (its own dict).
    @ivar _children: The supervisor's live children (its own set).
    @ivar _changed: Called when a child becomes ready or exits.
    @ivar _process_alive: Whether a pid runs (not gone, not a zombie).
    """

    _config: Callable[[], Config]
    _reactor: Any
    _probe: Callable[[str], Awaitable[int]]
    _health_interval: float
    _instances: dict[str, Instance]
    _children: set[Instance]
    _breakers: Breakers
    _room: Room
    _remotes: Remotes
    _metrics: Metrics
    _changed: Callable[[], None]
    _process_alive: Callable[[int | None], bool]
    _run_dir: Path | None

    async def await_ready(self, instance: Instance) -> None:
        """
        Poll a starting child's health until it answers 200 (ready), it
        exits (L{ended} settles its waiters) or C{ready_timeout_secs} runs
        out (it is stopped).
        """
        deadline = self._reactor.seconds() + self._config().ready_timeout
        url = instance.base_url + instance.health_path
        while instance.protocol.status is None:
            try:
                status = await self._probe(url)
            except CancelledError:
                raise
            except Exception:
                status = 0
            if instance.protocol.status is not None:
                break
            if status == 200:
                instance.state = InstanceState.READY
                self._changed()  # (llama-server allocates its VRAM while it loads)
                if self._room.hardware is not None:
                    ensureDeferred(self._room.measure(instance)).addErrback(
                        lambda f: log.failure("measuring {model}'s GPU memory", f, model=instance.entry.name)
                    )
                log.info(
                    "{model} ready on port {port} (pid {pid}) after {secs:.2f}s",
                    model=instance.entry.name,
                    engine="llamacpp",
                    port=instance.port,
                    pid=instance.pid,
                    secs=self._reactor.seconds() - instance.started_at,
                )
                self._breakers.of(instance.entry.name).ready()
                self._metrics.load_duration.labels(instance.entry.name).observe(
                    self._reactor.seconds() - instance.started_at
                )
                instance.ready_once = True
                instance.ready_at = self._reactor.seconds()
                instance._settle(None)
                return
            if self._reactor.seconds() >= deadline:
                instance._settle(
                    EngineStartFailed(
                        instance.entry.name,
                        f"{instance.server} for model {instance.entry.name!r} did not answer "
                        f"{instance.health_path} 200 within ready_timeout = {self._config().ready_timeout:g} s; "
                        f"raise ready_timeout in the config if the model is large. It said: "
                        + instance.protocol.error_line(),
                    )
                )
                instance.terminate(self._reactor, self._config().stop_grace)
                return
            await deferLater(self._reactor, self._health_interval, lambda: None)
        # Exited while starting: _ended settles the waiters.

    def ended(self, status: ExitStatus, instance: Instance) -> None:
        """
        A child's exit was reported: it leaves the table, its crash (if it
        was not stopped) counts for its breaker, and requests waiting for
        it to start get their answer.
        """
        if self._run_dir is not None and instance.run_files is not None:
            run_dir, pid = self._run_dir, instance.pid or 0
            instance.run_files.addCallback(
                lambda _: deferToThreadPool(
                    self._reactor,
                    self._reactor.getThreadPool(),
                    runfiles.thd_remove,
                    run_dir,
                    instance.entry.name,
                    pid,
                )
            ).addErrback(lambda f: log.failure("removing run files failed", f))
        was = instance.state
        instance.state = InstanceState.DEAD
        self._room.release(instance)
        self._changed()
        self._children.discard(instance)
        if self._instances.get(instance.entry.name) is instance:
            del self._instances[instance.entry.name]
        message = instance.describe_exit(status)
        if was == InstanceState.STOPPING:
            self._metrics.evictions.labels(instance.entry.name, label_reason(instance.stop_reason)).inc()
            log.info(
                "{model} stopped ({reason}; {status})",
                model=instance.entry.name,
                engine="llamacpp",
                status=status.describe(),
                reason=instance.stop_reason,
            )
            if status.signal is None and status.code == 0:
                self._breakers.of(instance.entry.name).reset()
        else:
            log.error(
                "{message}",
                message=instance.describe_exit(status, full=True),
                model=instance.entry.name,
                engine="llamacpp",
            )
            detail = f"{status.describe()}; {instance.protocol.error_line()}"
            if was == InstanceState.DEAD:
                # a request found it exited first and counted the crash
                self._breakers.of(instance.entry.name).last_error = detail
            else:
                self._metrics.crashes.labels(instance.entry.name).inc()
                self._breakers.of(instance.entry.name).crashed(self._reactor.seconds(), detail)
        if instance._failure is None and not instance.ready_once:
            # it never became ready (crashed, or stopped while loading):
            # every request waiting for it gets an answer
            if was == InstanceState.STOPPING:
                message = (
                    f"model {instance.entry.name!r} was unloaded while it was loading "
                    f"({instance.stop_reason}); send the request again"
                )
            architecture = instance.protocol.unknown_architecture() if was != InstanceState.STOPPING else None
            if architecture is not None:
                instance._settle(UnknownArchitecture(instance.entry.name, message, architecture, instance.lane))
            elif was == InstanceState.STOPPING:
                instance._settle(UnloadedWhileLoading(instance.entry.name, message))
            else:
                instance._settle(EngineStartFailed(instance.entry.name, message))
        for timer in (instance.kill_timer, instance.term_timer):
            if timer is not None and timer.active():
                timer.cancel()

    def exited(self, instance: Instance) -> bool:
        """
        Whether C{instance}'s child has exited, reported or not
        (L{blazar.engines.supervisor.Supervisor.exited}); a ready one found
        exited leaves the table now and its crash counts once.
        """
        if isinstance(instance, RemoteInstance):
            return False  # never spawned: a refused connection is the remote's failure (explain_failure)
        if instance.state == InstanceState.DEAD or instance.protocol.status is not None:
            return True
        if self._process_alive(instance.pid):
            return False
        if instance.state == InstanceState.READY:
            name = instance.entry.name
            instance.state = InstanceState.DEAD
            if self._instances.get(name) is instance:
                del self._instances[name]
            self._metrics.crashes.labels(name).inc()
            self._breakers.of(name).crashed(
                self._reactor.seconds(),
                f"pid {instance.pid} exited (found by a request before its exit was reported)",
            )
            log.info(
                "{model}: its engine (pid {pid}) has exited; the next request starts a fresh one",
                model=name,
                engine="llamacpp",
                pid=instance.pid,
            )
        return True

    async def explain(self, instance: Instance, error: BaseException) -> EngineError:
        """
        What a broken connection to C{instance} means
        (L{blazar.engines.supervisor.Supervisor.explain_failure}).
        """
        if isinstance(instance, RemoteInstance):
            error_text = self._remotes.failed(instance, failure_text(error))
            return EngineCrashed(
                instance.entry.name,
                f"{instance.server} for model {instance.entry.name!r} could not be reached: {error_text}",
            )
        ended = instance.protocol.when_ended()
        timer = self._reactor.callLater(2.0, ended.cancel)
        try:
            status = await ended
        except CancelledError:
            return EngineCrashed(
                instance.entry.name,
                f"connection to {instance.server} for model {instance.entry.name!r} failed: {error}",
            )
        if timer.active():
            timer.cancel()
        return EngineCrashed(instance.entry.name, instance.describe_exit(status))
