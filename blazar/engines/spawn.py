"""
What a spawn of an engine child needs besides the supervisor's table: a
free port, the child's environment, its slot directory, and the identity
of the files it loads (L{child_shape}).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import attrs
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure

from blazar.config import CommandLane, Config
from blazar.engines import runfiles
from blazar.engines.errors import EngineStartFailed, UnknownArchitecture
from blazar.engines.instance import Instance
from blazar.engines.lanes import (
    BUILTIN,
    WHISPER,
    LaneError,
    ServerNotFound,
    architecture_error_text,
    builtin_argv,
    lane_argv,
    lane_for_architecture,
    route,
    thd_find_server,
)
from blazar.engines.llamacpp import (
    DEFAULT_PARALLEL,
    EngineCommand,
    build_command,
    context_per_slot,
    lookup_cache,
    slot_save_dir,
)
from blazar.engines.process import DEATHSIG_LAUNCHER, EngineProcessProtocol
from blazar.files import private_dir
from blazar.metrics import Metrics
from blazar.models.gguf_meta import GGUFMetadata
from blazar.models.registry import ModelEntry

log = Logger()


def thd_identity(*paths: Path) -> str:
    """
    What the files a child is started from are right now (path, size,
    mtime of each): part of L{Instance.shape}.
    """
    parts = []
    for path in paths:
        try:
            st = os.stat(path)
            parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{path}:missing")
    return "\0".join(parts)


def child_shape(identity: str, argv: Sequence[str]) -> str:
    """
    L{Instance.shape}: the files' identity and the command line (without
    the port, which changes with every start), hashed.
    """
    args = list(argv)
    if "--port" in args:
        at = args.index("--port")
        del args[at : at + 2]
    return hashlib.sha256((identity + "\0" + "\0".join(args)).encode("utf-8")).hexdigest()[:32]


def thd_slot_dir(path: Path) -> None:
    """
    Make a model's slot save directory (0700, its parents too) if missing.
    """
    if not path.is_dir():
        private_dir(path.parent)
        private_dir(path)


def thd_lookup_cache(path: Path) -> None:
    """
    Make a model's n-gram lookup cache file (empty) and its directory
    (0700) if missing: llama-server aborts at load on a C{-lcd} file that
    does not exist, and this engine version reads the file but never
    writes it (docs/speculative.md).
    """
    if not path.parent.is_dir():
        private_dir(path.parent.parent)
        private_dir(path.parent)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)


def free_port() -> int:
    """
    A TCP port on 127.0.0.1 that is free right now.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """
    The base environment for engine children: the daemon's, without any
    C{LLAMA_ARG_*} or C{LLAMA_API_KEY*} variable (those would silently
    change engine flags or keys).
    """
    return {k: v for k, v in environ.items() if not k.startswith("LLAMA_ARG_") and not k.startswith("LLAMA_API_KEY")}


async def probe_health(probe: Callable[[str], Awaitable[int]], clock: Any, url: str) -> bool:
    """
    Whether C{url} (a child's C{/health}) answers 200 within 3 seconds.

    @param probe: Returns the HTTP status of a GET to a URL.
    @raise CancelledError: The caller was cancelled (its client left):
        that says nothing about the child, so it is not a L{False}
        (which would get a busy, healthy child killed as wedged),
        whatever the probe fails with once cancelled (Twisted's HTTP
        client reports it as C{ResponseNeverReceived([CancelledError])},
        not as a bare C{CancelledError}).
    """
    caller_left = False
    asked: Deferred[int] = ensureDeferred(probe(url))  # type: ignore[arg-type]

    def leave(_: Deferred[int]) -> None:
        nonlocal caller_left
        caller_left = True
        asked.cancel()

    answer: Deferred[int] = Deferred(leave)

    def relay(result: Any) -> None:
        if not answer.called:
            if isinstance(result, Failure):
                answer.errback(result)
            else:
                answer.callback(result)

    asked.addBoth(relay)
    timer = clock.callLater(3.0, asked.cancel)
    try:
        return await answer == 200
    except Exception:
        if caller_left:
            raise CancelledError() from None
        return False  # refused, reset, its own timeout or ours: not healthy
    finally:
        if timer.active():
            timer.cancel()


@attrs.define(eq=False)
class Launcher:
    """
    Starts engine children: finds the binary a model's lane runs, compiles
    the child's command line, and spawns it with the filtered environment
    (L{child_environment}), behind the launcher that kills it when the
    daemon dies. The supervisor keeps the table and the bookkeeping.

    @ivar _find_binary: Finds llama-server (L{blazar.engines.llamacpp.find_binary}).
    @ivar _port_finder: A free TCP port on 127.0.0.1 (L{free_port}).
    @ivar _run_dir: Where run files and the children's working directory
        go; L{None}: none (tests).
    @ivar _engine_output: Called with each line a child writes.
    """

    _config: Callable[[], Config]
    _reactor: Any
    _environ: Mapping[str, str]
    _find_binary: Callable[[Config, Mapping[str, str]], Path]
    _port_finder: Callable[[], int]
    _run_dir: Path | None
    _engine_output: Callable[[str, str], None] | None
    _metrics: Metrics
    # models whose children died with llama.cpp's unknown-architecture error: the lane that serves them
    _rerouted: dict[str, str] = attrs.field(factory=dict)

    def pinned(self, entry: ModelEntry) -> str | None:
        """
        The lane C{entry} is pinned to: by its config, else by a re-route
        (L{reroute}); L{None}: routed by its format and architecture.
        """
        return entry.settings.engine or self._rerouted.get(entry.name)

    def reroute(self, entry: ModelEntry, error: UnknownArchitecture) -> ModelEntry:
        """
        A child of C{entry} died at load with llama.cpp's unknown-architecture
        error: the entry pinned to a lane that declares the architecture
        (once: that lane was not the one tried); its breaker is the
        caller's to reset.

        @raise LaneError: No such lane; the text names the install or config step.
        """
        lane = lane_for_architecture(error.architecture, self._config(), tried=error.lane)
        if lane is None or entry.settings.engine is not None or entry.name in self._rerouted:
            raise LaneError(entry.name, architecture_error_text(entry.name, error.architecture)) from None
        log.warn(
            "{model}: llama.cpp does not know its architecture {arch!r}; re-routed to the {lane} lane, "
            "which declares it",
            model=entry.name,
            arch=error.architecture,
            lane=lane.name,
        )
        self._rerouted[entry.name] = lane.name  # until the daemon restarts (or the config pins a lane)
        return attrs.evolve(entry, settings=attrs.evolve(entry.settings, engine=lane.name))

    async def prepare(
        self, entry: ModelEntry, meta: GGUFMetadata, pinned: str | None
    ) -> tuple[CommandLane | None, Path, str]:
        """
        What a child of C{entry} runs: its lane (L{None}: llama.cpp), its
        binary, and the identity of the files it loads (L{thd_identity};
        empty for another lane), with its slot directory made.

        @raise blazar.engines.lanes.LaneError: No lane serves it.
        @raise EngineStartFailed: Its lane's server is not installed.
        """
        lane = route(entry.name, entry.format, pinned, self._config(), meta.architecture)
        if lane is not None and lane.name == WHISPER and self._run_dir is not None:
            await deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(), thd_slot_dir, self._run_dir / "child-cwd"
            )
        if lane is not None and lane.name in BUILTIN:
            try:
                binary = await deferToThreadPool(
                    self._reactor,
                    self._reactor.getThreadPool(),
                    thd_find_server,
                    lane.name,
                    self._config(),
                    self._environ,
                )
            except ServerNotFound as e:
                raise EngineStartFailed(entry.name, f"model {entry.name!r}: {e}") from None
        elif lane is not None:
            binary = Path(lane.command[0])
        else:
            binary = await deferToThreadPool(
                self._reactor,
                self._reactor.getThreadPool(),
                self._find_binary,
                self._config(),
                self._environ,
            )
        if lane is None and not entry.settings.embedding:
            # llama-server refuses a --slot-save-path that is not a directory
            await deferToThreadPool(
                self._reactor,
                self._reactor.getThreadPool(),
                thd_slot_dir,
                slot_save_dir(self._config().data_dir, entry.name),
            )
        if lane is None and entry.settings.speculative in ("ngram", "auto") and not entry.settings.embedding:
            await deferToThreadPool(
                self._reactor,
                self._reactor.getThreadPool(),
                thd_lookup_cache,
                lookup_cache(self._config().data_dir, entry.name),
            )
        # the files as this child will load them (a file replaced later does
        # not change what it holds)
        identity = (
            ""
            if lane is not None
            else await deferToThreadPool(
                self._reactor,
                self._reactor.getThreadPool(),
                thd_identity,
                Path(entry.path),
                Path(binary),
            )
        )
        return lane, binary, identity

    def launch(
        self,
        entry: ModelEntry,
        meta: GGUFMetadata,
        binary: Path,
        identity: str,
        lane: CommandLane | None,
        placed: Any,
        profile: tuple[tuple[str, Any], ...],
    ) -> Instance:
        """
        Spawn a child of C{entry}, placed as C{placed} (the planner's plan
        and estimate, or L{None}) with the client's C{profile} over its
        settings: the L{Instance}, starting.
        """
        port = self._port_finder()
        api_key = secrets.token_urlsafe(24)
        if profile:
            entry = attrs.evolve(entry, settings=attrs.evolve(entry.settings, **dict(profile)))
        if lane is None:
            command = build_command(
                binary,
                entry,
                meta,
                port=port,
                api_key=api_key,
                config=self._config(),
                plan=placed[0] if placed is not None else None,
            )
        elif lane.name in BUILTIN:
            command = EngineCommand(
                tuple(
                    builtin_argv(
                        lane.name,
                        str(binary),
                        model=str(entry.path),
                        port=port,
                        secret=api_key,
                        args=(*getattr(self._config(), lane.name).args, *entry.settings.args),
                    )
                ),
                {},
            )
        else:
            command = EngineCommand(
                tuple(
                    lane_argv(
                        lane,
                        model=str(entry.path),
                        port=port,
                        api_key=api_key,
                        alias=entry.name,
                        ctx_size=context_per_slot(entry, meta),
                        parallel=entry.settings.parallel or DEFAULT_PARALLEL,
                    )
                ),
                {lane.api_key_env: api_key} if lane.api_key_env else {},
            )
        protocol = EngineProcessProtocol(entry.name, output=self._engine_output)
        now = self._reactor.seconds()
        self._metrics.loads.labels(entry.name).inc()
        idle = self._config().idle_timeout
        if lane is not None and lane.name == WHISPER:  # whisper_idle_secs; 0: kept until the daemon stops
            idle = self._config().whisper_idle or -1.0
        instance = Instance(
            entry,
            port,
            api_key,
            protocol,
            started_at=now,
            last_used=now,
            idle_timeout=idle,
            binary=str(binary),
            ctx=0 if lane is not None and lane.name in BUILTIN else context_per_slot(entry, meta),  # 0: no context
            shape=child_shape(identity, command.argv) if lane is None else "",
            lane=lane.name if lane is not None else "llamacpp",
            kv_bank=lane is None and "--slot-save-path" in command.argv,
            health_path=lane.health if lane is not None else "/health",
            path_prefix="/" + api_key if lane is not None and lane.name == WHISPER else "",
            profile=profile,
            plan=placed[0] if placed is not None else None,
            need=placed[1] if placed is not None else None,
            argv=tuple(command.argv),
        )
        env = child_environment(self._environ)
        env.update(command.env)
        argv = [sys.executable, "-c", DEATHSIG_LAUNCHER, *command.argv]
        log.info(
            "starting {model}: {argv}",
            model=entry.name,
            engine=instance.lane,
            argv=" ".join(command.argv).replace(api_key, "<per-child key>"),
        )
        # whisper-server serves ./examples/server/public from its working directory: give it an empty one
        cwd = str(self._run_dir / "child-cwd") if lane is not None and lane.name == WHISPER and self._run_dir else None
        transport = self._reactor.spawnProcess(
            protocol,
            sys.executable,
            argv,
            env=env,
            childFDs={0: "w", 1: "r", 2: "r"},
            path=cwd,
        )
        instance.pid = transport.pid
        instance.transport = transport
        if self._run_dir is not None:
            instance.run_files = deferToThreadPool(
                self._reactor,
                self._reactor.getThreadPool(),
                runfiles.thd_write,
                self._run_dir,
                entry.name,
                transport.pid,
                port,
                list(command.argv),
                api_key,
            )
            instance.run_files.addErrback(lambda f: log.failure("writing run files failed", f))
        return instance
