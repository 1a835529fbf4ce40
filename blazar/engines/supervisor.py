"""
The supervisor: one llama-server child per loaded model, started on first
use, watched, and stopped with the daemon.

States of an L{Instance} (L{InstanceState}): C{starting} (spawned, waiting
for C{/health} 200), C{ready}, C{stopping} (SIGTERM sent), C{dead} (exited:
reported by the reactor, or found by a request, L{Supervisor.exited}). A
dead instance leaves the table at once, so the next request spawns a fresh
child.

The seams: L{ISupervisor} and L{IInstance} (L{blazar.engines.interfaces})
are what the rest of Blazar may use (L{blazar.testing.FakeSupervisor}
provides them too, checked by one shared contract test); readers that only
look (C{/api/ps}, the metrics) take L{Supervisor.snapshot}'s frozen
L{InstanceView}s.

The L{Supervisor} is the facade over the table of children; each concept
it composes has its module:
  - L{blazar.engines.errors}: the failures it raises;
  - L{blazar.engines.instance}: a child (L{Instance}) and its views;
  - L{blazar.engines.breaker}: the crash breakers (L{Breakers});
  - L{blazar.engines.growth}: context plans and grows (L{ContextGrowth});
  - L{blazar.engines.room}: GPU placement and eviction (L{Room});
  - L{blazar.engines.remote}: remote models' instances (L{Remotes});
  - L{blazar.engines.spawn}: lanes, command lines, the spawn (L{Launcher});
  - L{blazar.engines.watch}: health wait and exits (L{ChildWatch}).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import attrs
from twisted.application.service import Service
from twisted.internet.defer import (
    Deferred,
    DeferredList,
    DeferredLock,
    ensureDeferred,
    succeed,
)
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from blazar.config import CommandLane, Config, LiveConfig, live_config
from blazar.engines import runfiles
from blazar.engines.breaker import Breaker, Breakers
from blazar.engines.errors import (
    BreakerOpen,
    EngineCrashed,
    EngineError,
    EngineStartFailed,
    EngineTimeout,
    NoCapacity,
    UnknownArchitecture,
    UnloadedWhileLoading,
)
from blazar.engines.growth import ContextGrowth, ContextPlan, estimate_bytes
from blazar.engines.instance import IInstance, Instance, InstanceState, InstanceView, evicted_name, view_of
from blazar.engines.interfaces import ISupervisor
from blazar.engines.llamacpp import find_binary, lookup_cache, speccache_dir
from blazar.engines.lookupcache import LookupCaches
from blazar.engines.process import ExitStatus, process_alive, thd_rss
from blazar.engines.remote import RemoteInstance, Remotes
from blazar.engines.room import Room
from blazar.engines.spawn import Launcher, child_shape, free_port, probe_health, thd_identity
from blazar.engines.spectune import STATE_FILE, SpecTuner
from blazar.engines.waiters import Waiters
from blazar.engines.watch import ChildWatch
from blazar.metrics import Metrics, gauge
from blazar.models.gguf_meta import GGUFMetadata
from blazar.models.registry import ModelEntry, ModelRegistry
from blazar.names import name_key

# the names other modules import from here (moved to the modules of their concepts)
__all__ = [
    "MAX_UNLOADS_WAITED",
    "BreakerOpen",
    "Breaker",
    "ContextPlan",
    "EngineCrashed",
    "EngineError",
    "EngineStartFailed",
    "EngineTimeout",
    "IInstance",
    "ISupervisor",
    "Instance",
    "InstanceState",
    "InstanceView",
    "NoCapacity",
    "Supervisor",
    "UnknownArchitecture",
    "UnloadedWhileLoading",
    "child_shape",
    "estimate_bytes",
    "evicted_name",
    "thd_identity",
    "view_of",
]

log = Logger()

# how many unloads of the child it waited for one request sits out before its
# answer is the unload's error
MAX_UNLOADS_WAITED = 3


@implementer(ISupervisor)
@attrs.define(eq=False)
class Supervisor(Service):
    """
    Starts, tracks and stops engine children.

    @ivar _probe: Returns the HTTP status of a GET to a URL (the engine
        client's C{get_status}); used for C{/health}.
    @ivar _environ: The daemon's environment; children get a filtered copy.
    @ivar _process_alive: Whether a pid runs (not gone, not a zombie):
        L{blazar.engines.process.process_alive}.
    """

    _live: LiveConfig = attrs.field(converter=live_config)
    _registry: ModelRegistry
    _reactor: Any
    _probe: Callable[[str], Awaitable[int]]
    _environ: Mapping[str, str] = attrs.field(factory=lambda: dict(os.environ))
    _find_binary: Callable[[Config, Mapping[str, str]], Path] = find_binary
    _port_finder: Callable[[], int] = free_port
    _health_interval: float = 0.01
    _instances: dict[str, Instance] = attrs.field(factory=dict)
    _all: set[Instance] = attrs.field(factory=set)
    _spawning: dict[str, Waiters[Instance]] = attrs.field(factory=dict)
    # the placement clients last asked for, per model (want_profile): sorted (profile key, value) items
    _profiles: dict[str, tuple[tuple[str, Any], ...]] = attrs.field(factory=dict)
    _shutting_down: bool = False
    _reaper: Any = None
    _run_dir: Path | None = None
    _free_memory: Callable[[], int] | None = None
    _process_alive: Callable[[int | None], bool] = process_alive
    _admission: Any = attrs.field(factory=DeferredLock)
    metrics: Metrics = attrs.field(factory=Metrics)
    _engine_output: Callable[[str, str], None] | None = None
    # called when a child becomes ready or exits (blazar.engines.hardware.HardwareCensus.invalidate)
    on_hardware_change: Callable[[], None] | None = None
    # called with a ready child about to be stopped (the KV bank saves its
    # sessions' slots: blazar.gateway.sessions); SIGTERM waits for it
    before_stop: Callable[[Instance], Deferred[None]] | None = None
    # the concepts it composes: crash breakers, room-making (placement,
    # eviction), context growth, remote instances
    _breakers: Breakers = attrs.field(init=False)
    _room: Room = attrs.field(init=False)
    _growth: ContextGrowth = attrs.field(init=False)
    _remotes: Remotes = attrs.field(init=False)
    _launcher: Launcher = attrs.field(init=False)
    _watch: ChildWatch = attrs.field(init=False)
    # speculative = "auto": the tuner, and each tuned model's entry as the registry gave it (the idle reload's)
    spec_tuner: SpecTuner = attrs.field(init=False)
    # n-gram lookup: each model's lookup cache, counted from its answers (the pipeline feeds it)
    lookup_caches: LookupCaches = attrs.field(init=False)
    _auto: dict[str, ModelEntry] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        Service.__init__(self)
        config = lambda: self._live.current  # noqa: E731
        self._breakers = Breakers(config, self._reactor)
        self._room = Room(config, self._reactor, self._all, self.stop_instance, self._free_memory)
        self._growth = ContextGrowth(
            config,
            self._reactor,
            self._registry.metadata,
            self.loaded,
            self._room.memory_free,
            self.stop_instance,
            self._join_spawn,
            lambda: self._shutting_down,
        )
        self._remotes = Remotes(config, self._reactor, self._breakers, self._environ, self.metrics)
        self._launcher = Launcher(
            config,
            self._reactor,
            self._environ,
            self._find_binary,
            self._port_finder,
            self._run_dir,
            self._engine_output,
            self.metrics,
        )
        self._watch = ChildWatch(
            config,
            self._reactor,
            lambda url: self._probe(url),  # read when called: one probe for the watch and probe_health
            self._health_interval,
            self._instances,
            self._all,
            self._breakers,
            self._room,
            self._remotes,
            self.metrics,
            self._hardware_changed,
            self._process_alive,
            self._run_dir,
        )
        self.spec_tuner = SpecTuner(
            self._reactor, path_for=lambda name: speccache_dir(self._live.current.data_dir, name) / STATE_FILE
        )
        self.lookup_caches = LookupCaches(self._reactor, lambda name: lookup_cache(self._live.current.data_dir, name))
        self.metrics.gauges(self.collect_metrics)
        self._live.subscribe(self.reconfigure)

    @property
    def hardware(self) -> Callable[[], Deferred[Any]] | None:
        """
        The hardware census as of now (C{HardwareCensus.fresh}): with GPUs,
        llama.cpp children are placed by L{blazar.engines.planner}; L{None}
        (or no GPU): RAM-only capacity.
        """
        return self._room.hardware

    @hardware.setter
    def hardware(self, census: Callable[[], Deferred[Any]] | None) -> None:
        self._room.hardware = census

    @property
    def engine_devices(
        self,
    ) -> Callable[[Path, Mapping[tuple[str, float], list[str]]], tuple[tuple[str, float], list[str] | None]]:
        """
        The GPUs an engine binary can use (thread side: L{thd_engine_devices}).
        """
        return self._room.engine_devices

    @engine_devices.setter
    def engine_devices(
        self,
        devices: Callable[[Path, Mapping[tuple[str, float], list[str]]], tuple[tuple[str, float], list[str] | None]],
    ) -> None:
        self._room.engine_devices = devices

    @property
    def _config(self) -> Config:
        # the live config, read at each use: a reload applies from the next read
        return self._live.current

    def collect_metrics(self) -> Any:
        """
        Scrape-time gauges: C{blazar_instances_loaded{state}},
        C{blazar_breaker_state{model}} (0 closed, 1 half-open, 2 open) and
        C{blazar_model_vram_bytes{model,gpu}} (the bytes a model's children
        hold on GPU C{gpu}, an NVML index: measured by NVML once a child is
        ready, else planned; a series goes when the child exits); for each
        C{speculative = "auto"} model that has had a child
        (L{speculative_auto}), C{blazar_engine_speculative_decided{model,state}}
        (1 for the tuner's state, C{measuring}, C{on} or C{off}; 0 for the
        other two) and C{blazar_engine_speculative_lookup{model}} (1 when
        the loaded child runs with n-gram lookup, 0 without; no series with
        none loaded).
        """
        states = (InstanceState.STARTING, InstanceState.READY, InstanceState.STOPPING)
        views = self.snapshot()
        yield gauge(
            "blazar_instances_loaded",
            "Engine children, by state",
            ["state"],
            [([st], sum(1 for v in views if v.state == st)) for st in states],
        )
        lanes = sorted({v.lane for v in views if v.live} | {"llamacpp"})
        yield gauge(
            "blazar_instances_by_lane",
            "Live engine children, by lane (llamacpp, whisper, sdcpp, ...)",
            ["lane"],
            [([lane], sum(1 for v in views if v.live and v.lane == lane)) for lane in lanes],
        )
        yield self._breakers.gauge()
        held: dict[tuple[str, int], int] = {}
        for v in views:  # (a model being reloaded has two children for a moment: one series, summed)
            for gpu, used in v.gpu_held().items():
                held[v.name, gpu] = held.get((v.name, gpu), 0) + used
        yield gauge(
            "blazar_model_vram_bytes",
            "GPU memory in bytes a model's engine children hold, by NVML "
            "device index: as NVML measured once ready, else as planned",
            ["model", "gpu"],
            [([name, str(gpu)], float(used)) for (name, gpu), used in sorted(held.items())],
        )
        tuned = [(name, state) for name in sorted(self._auto) if (state := self.speculative_auto(name)) is not None]
        yield gauge(
            "blazar_engine_speculative_decided",
            'The speculative = "auto" tuner\'s state of a model: 1 for its state '
            "(measuring, on: n-gram lookup kept, off: dropped), 0 for the others",
            ["model", "state"],
            [([name, st], float(state["decided"] == st)) for name, state in tuned for st in ("measuring", "on", "off")],
        )
        yield gauge(
            "blazar_engine_speculative_lookup",
            'Whether the loaded child of a speculative = "auto" model runs with n-gram lookup (1) or without (0)',
            ["model"],
            [([name], float(state["running"] == "on")) for name, state in tuned if state["running"] is not None],
        )

    def startService(self) -> None:
        Service.startService(self)
        if self._run_dir is not None:
            # Before serving: children of a daemon that died unstopped.
            # Blocking is fine here, the reactor serves nothing yet.
            for pid in runfiles.thd_stop_orphans(self._run_dir):
                log.warn("stopped orphaned engine pid {pid} left by an earlier daemon", pid=pid)
        self._reaper = LoopingCall(self.reap)
        self._reaper.clock = self._reactor
        self._reaper.start(1.0, now=False).addErrback(lambda f: log.failure("idle reaper stopped", f))
        self.lookup_caches.start()

    def reap(self) -> None:
        """
        Stop every ready child whose idle time ran out (run each second).
        Never raises: a periodic job that raises stops for good.
        """
        try:
            now = self._reactor.seconds()
            for instance in list(self._all):
                expires = instance.expires_at()
                if (
                    instance.state == InstanceState.READY
                    and instance.in_flight == 0
                    and expires is not None
                    and expires <= now
                ):
                    self.stop_instance(instance, "idle")
                elif instance.state == InstanceState.READY and instance.in_flight == 0:
                    self._retune(instance)
        except Exception:
            log.failure("idle reaper failed")

    def _profile(self, entry: ModelEntry) -> tuple[tuple[str, Any], ...]:
        """
        What a llama.cpp child of C{entry} is launched with over its
        settings: the client's placement (L{want_profile}) and, for
        C{speculative = "auto"}, the tuner's choice (C{"ngram"} or
        C{"off"}), which L{blazar.engines.llamacpp.build_command} compiles.
        """
        profile = self._profiles.get(entry.name, ())
        if entry.settings.speculative != "auto":
            self._auto.pop(entry.name, None)
            return profile
        self._auto[entry.name] = entry
        mode = "ngram" if self.spec_tuner.lookup(entry.name) else "off"
        return tuple(sorted((*profile, ("speculative", mode))))

    def speculative_auto(self, name: str) -> dict[str, Any] | None:
        """
        For a C{speculative = "auto"} model (canonical C{name}) that has had
        a child: the tuner's state (L{blazar.engines.spectune.Trial.state}:
        C{decided}, the C{lookup} the next child gets, the C{rates} being
        measured, the C{last} decision's figures) and C{running}, whether
        the loaded child runs with lookup (C{"on"}, C{"off"}, or L{None}
        with none loaded). L{None} for any other model.
        """
        if name not in self._auto:
            return None
        state = self.spec_tuner.state(name)
        instance = self._instances.get(name)
        running = dict(instance.profile).get("speculative") if instance is not None else None
        state["running"] = None if running is None else "on" if running == "ngram" else "off"
        return state

    def _retune(self, instance: Instance) -> None:
        """
        The idle reload of C{speculative = "auto"}: a ready child running no
        request whose lookup is not what the tuner now wants is replaced by
        one that has it (requests that come meanwhile wait for the new one).
        """
        running = dict(instance.profile).get("speculative")
        name = instance.entry.name
        entry = self._auto.get(name)
        if running is None or entry is None or self._instances.get(name) is not instance:
            return
        settings = self._config.models.get(name)
        if settings is None or settings.speculative != "auto":
            # (a config reload took the model off "auto": its next child gets the new setting)
            del self._auto[name]
            return
        wanted = "ngram" if self.spec_tuner.lookup(name) else "off"
        if running == wanted or self._growth.under_way(name) is not None:
            return
        log.info(
            "{model}: idle reload for speculative auto: n-gram lookup {was} -> {now} ({decided})",
            model=name,
            was=running,
            now=wanted,
            decided=self.spec_tuner.state(name)["decided"],
        )
        self._growth.begin(entry, instance, instance.ctx, "reload")

    def breaker(self, name: str) -> Breaker:
        """
        The crash breaker for canonical model C{name}.
        """
        return self._breakers.of(name)

    def reset_breakers(self, name: str | None = None) -> list[str]:
        """
        Close the breakers of C{name} (canonical), or of every model.

        @return: The models whose breaker was reset.
        """
        return self._breakers.reset(name)

    def reconfigure(self, config: Config) -> None:
        """
        After a swap of the live config (timeouts, limits and model settings
        are read from it at each use): retune the breakers and the running
        children's C{idle_timeout_secs}; the children keep running.
        """
        for instance in self._all:
            instance.idle_timeout = config.idle_timeout
        self._breakers.retune(config)

    @property
    def ctx_policy(self) -> str:
        """
        C{"grow"} or C{"fit"}: what a request asking for more context than
        the loaded child has does (see L{instance_for}).
        """
        return self._config.ctx_policy

    def instances(self) -> list[Instance]:
        """
        Every live child (starting, ready or stopping), oldest first.
        """
        return sorted(self._all, key=lambda i: i.started_at)

    def snapshot(self) -> list[InstanceView]:
        """
        A read-only L{InstanceView} of each live child, oldest first; no
        I/O (C{rss} is L{None}: L{measured_snapshot} reads it).
        """
        return [view_of(i, self.breaker(i.entry.name).state) for i in self.instances()]

    async def measured_snapshot(self) -> list[InstanceView]:
        """
        L{snapshot}, with each child's resident memory (C{rss}, bytes) read
        from C{/proc} in the thread pool.
        """
        views = self.snapshot()
        pool = self._reactor.getThreadPool()
        measured = []
        for view in views:
            rss = None
            if view.pid:
                rss = await deferToThreadPool(self._reactor, pool, thd_rss, view.pid)
            measured.append(attrs.evolve(view, rss=rss))
        return measured

    async def instance_for(self, name: str, ctx_size: int | None = None) -> Instance:
        """
        A ready child for the model a client named, spawning one if needed.
        Concurrent calls for one model share a single spawn.

        @param ctx_size: Tokens per slot the request asks for (Ollama's
            C{num_ctx}). Under C{ctx_policy = "grow"} (the default) a
            loaded child with less context is replaced by one with the
            context L{context_for} plans (clamped to the trained context
            and to free memory): once the requests running on the old
            child finish, with every request that arrives meanwhile
            waiting for the new one, and one restart for all growing
            requests that join before it starts. A smaller C{ctx_size} is
            served by the loaded child, so a grown context stays. Under
            C{"fit"} it is ignored and the context preflight decides.
        @raise blazar.models.registry.ModelNotFound: No such model.
        @raise EngineStartFailed: The child could not start.
        @raise NoCapacity: The old child was still busy after
            C{drain_timeout_secs}, so it could not grow.
        @raise blazar.engines.llamacpp.EngineNotFound: No binary.
        """
        entry = await self._registry.resolve(name)
        if entry.remote is not None:
            return self._remotes.instance(entry)  # type: ignore[return-value]
        target = 0
        if ctx_size and self._config.ctx_policy == "grow":
            target = (await self._growth.plan(entry, ctx_size)).ctx
        unloads = 0
        while True:
            grow = self._growth.under_way(entry.name)
            instance = self._instances.get(entry.name)
            wanted = self._profiles.get(entry.name, ())
            # (the tuner's speculative choice waits for the idle reload: _retune)
            reprofile = (
                instance is not None
                and instance.lane == "llamacpp"
                and tuple(kv for kv in instance.profile if kv[0] != "speculative") != wanted
            )
            if grow is None and instance is not None and (target > instance.ctx or reprofile):
                grow = self._growth.begin(
                    entry, instance, max(target, instance.ctx), "reload" if target <= instance.ctx else "grow"
                )
            if grow is not None:
                if target > grow.target and not grow.spawning:
                    grow.target = target  # one restart for every growing request
                part = (target > 0 and grow.target >= target) or reprofile
                error = await grow.wait()
                if error is not None and part:
                    raise error
                continue
            if instance is None:
                spawned = entry
                if target:
                    spawned = attrs.evolve(entry, settings=attrs.evolve(entry.settings, ctx_size=target))
                instance = await self._join_spawn(spawned)
                if target > instance.ctx:
                    continue  # it joined a smaller spawn already under way: grow it
            try:
                ready = await instance.wait_ready()
            except UnknownArchitecture as e:
                entry = self._launcher.reroute(entry, e)  # once, to a lane that declares it; else the teaching error
                self.breaker(entry.name).reset()
                continue
            except UnloadedWhileLoading:
                # (an unload or eviction of the child this request waited
                # for: a fresh one serves it, as after a stop of a ready one)
                if self._shutting_down or unloads >= MAX_UNLOADS_WAITED:
                    raise
                unloads += 1
                continue
            if self._instances.get(entry.name) is ready:
                return ready
            # stopped while we waited for it to load (a grow, an eviction): again

    def remote_failed(self, instance: RemoteInstance, error: str) -> str:
        """
        A remote could not be reached, timed out or answered 5xx: counted
        against its model's breaker, as a crash is.

        @return: C{error} without the remote's key.
        """
        return self._remotes.failed(instance, error)

    def remote_ok(self, instance: RemoteInstance) -> None:
        """
        A remote answered: a half-open breaker closes.
        """
        self._remotes.ok(instance)

    async def want_profile(self, name: str, wishes: Mapping[str, Any]) -> None:
        """
        A client's placement for the model it named (Ollama's C{num_gpu},
        C{main_gpu}, C{num_thread}, C{use_mmap}, as the profile keys
        C{gpu_layers}, C{main_gpu}, C{threads}, C{use_mmap}: over the
        config's). As on Ollama, a loaded child with another placement is
        reloaded for it: once its running requests end (never cut), by the
        next L{instance_for}. A request that asks for none keeps what is
        loaded.

        @raise blazar.models.registry.ModelNotFound: No such model.
        """
        if not wishes:
            return
        entry = await self._registry.resolve(name)
        if entry.remote is None:
            self._profiles[entry.name] = tuple(sorted(wishes.items()))

    async def context_for(self, name: str, ctx_size: int) -> ContextPlan:
        """
        The context per slot a request for model C{name} asking for
        C{ctx_size} tokens per slot would run with now; L{instance_for}
        grows the child to it under C{ctx_policy = "grow"}.

        It is C{ctx_size}, clamped to the model's trained context and to
        what fits in free memory (the KV cache of the child it replaces
        counts as free; a context limited by memory is rounded down to a
        multiple of 1024 tokens, so drifting free memory does not restart
        the child again and again), and never below the loaded child's
        context or the configured C{ctx_size}.

        @raise blazar.models.registry.ModelNotFound: No such model.
        """
        return await self._growth.plan(await self._registry.resolve(name), ctx_size)

    def _join_spawn(self, entry: ModelEntry) -> Deferred[Instance]:
        """
        Wait for the spawn of C{entry}, starting it if none is under way.
        The spawn runs on its own: a client that goes away (cancelling
        this wait) does not abort a load that others, or its own retry,
        will want.
        """

        waiters = self._spawning.get(entry.name)
        if waiters is not None:
            return waiters.wait()
        waiters = self._spawning[entry.name] = Waiters()
        d = waiters.wait()

        def done(result: Any) -> None:
            pending = self._spawning.pop(entry.name, waiters)
            if isinstance(result, Failure):
                if not pending.pending():
                    log.error("loading {model} failed: {error}", model=entry.name, error=result.getErrorMessage())
                pending.fail(result)
            else:
                pending.fire(result)

        ensureDeferred(self._spawn(entry)).addBoth(done)
        return d

    async def _spawn(self, entry: ModelEntry) -> Instance:
        # Everything before the table insert must not yield to the reactor
        # while another caller could also decide to spawn: resolve the
        # awaitable parts first, then check the table again.
        self._breakers.check(entry.name)
        pinned = self._launcher.pinned(entry)
        meta = await self._registry.metadata(entry)
        # LaneError: none serves it
        lane, binary, identity = await self._launcher.prepare(entry, meta, pinned)
        if lane is None and entry.settings.speculative == "auto":
            await self.spec_tuner.load(entry.name)  # (a decision saved before a restart: once per model)
        existing = self._instances.get(entry.name)
        if existing is not None:
            return existing
        await self._admission.acquire()
        try:
            existing = self._instances.get(entry.name)
            if existing is not None:
                return existing
            placed = await self._room.gpu_plan(entry, meta, binary) if lane is None else None
            await self._room.make_room(entry, meta)
            instance = self._start(entry, meta, binary, identity, lane, placed)
            self._room.hold(instance, entry, meta)
            return instance
        finally:
            self._admission.release()

    def estimate(self, entry: ModelEntry, meta: GGUFMetadata) -> int:
        """
        Bytes a child for C{entry} needs: L{estimate_bytes}.
        """
        return estimate_bytes(entry, meta)

    def _start(
        self,
        entry: ModelEntry,
        meta: GGUFMetadata,
        binary: Path,
        identity: str = "",
        lane: CommandLane | None = None,
        placed: Any = None,
    ) -> Instance:
        profile = self._profile(entry) if lane is None else ()
        instance = self._launcher.launch(entry, meta, binary, identity, lane, placed, profile)
        self._instances[entry.name] = instance
        self._all.add(instance)
        ended = instance.protocol.when_ended()
        ended.addCallback(self._watch.ended, instance)
        ended.addErrback(lambda f: log.failure("engine exit bookkeeping failed", f))
        d = ensureDeferred(self._watch.await_ready(instance))
        d.addErrback(lambda f: log.failure("engine start failed unexpectedly", f))
        return instance

    def _hardware_changed(self) -> None:
        """
        A child became ready or exited: what the GPUs and RAM hold changed
        (the hardware census reads them again: L{on_hardware_change}).
        """
        if self.on_hardware_change is not None:
            try:
                self.on_hardware_change()
            except Exception:
                log.failure("telling the hardware census a child came or went")

    def exited(self, instance: Instance) -> bool:
        """
        Whether C{instance}'s child has exited: its exit was reported, or
        C{/proc} shows its pid gone or a zombie (the reactor reaps it and
        reports the exit a moment later). Called on the request path when a
        request could not reach the child.

        A ready child found exited here is dead from then on, without
        waiting for the report: it leaves the table, so the next
        L{instance_for} starts a fresh child (one spawn for every request
        that wants one), and its crash counts now, once, for the breaker;
        the report does the rest of the bookkeeping when it comes.
        """
        return self._watch.exited(instance)

    async def explain_failure(self, instance: Instance, error: BaseException) -> EngineError:
        """
        Turn a broken connection to C{instance} into an L{EngineCrashed}
        that names the exit status and the tail of the child's output,
        waiting up to two seconds for the exit to be reported. A remote's
        is its failure (L{remote_failed}): it counts for its breaker.
        """
        return await self._watch.explain(instance, error)

    def touch(self, instance: Instance, keep_alive: float | None = None) -> None:
        """
        Record a use of C{instance}; C{keep_alive} (seconds, negative for
        forever) replaces its idle time when given, as Ollama's per-request
        C{keep_alive} does.
        """
        instance.last_used = self._reactor.seconds()
        instance.served += 1
        if keep_alive is not None:
            instance.keep_alive = keep_alive

    def loaded(self, name: str) -> Instance | None:
        """
        The live child for canonical model C{name}, if any.
        """
        return self._instances.get(name)

    def unload_when_idle(self, instance: Instance, reason: str) -> Deferred[ExitStatus] | None:
        """
        Stop C{instance} now if no request runs on it; else mark it, and the
        lease of the last request to end stops it (L{blazar.engines.lease}).
        A running answer is never cut (Ollama's unload waits as well), and
        a child still loading for requests that wait for it serves them
        first.
        """
        if instance.in_flight == 0 and not (instance.state == InstanceState.STARTING and instance.awaited()):
            return self.stop_instance(instance, reason)
        instance.unload_when_idle = reason
        log.info(
            "{model}: unloading once its {n} running request(s) end ({reason})",
            model=instance.entry.name,
            n=instance.in_flight,
            reason=reason,
        )
        return None

    def stop_instance(self, instance: Instance, reason: str = "requested") -> Deferred[ExitStatus]:
        """
        SIGTERM the child, SIGKILL after C{stop_grace}; fires on exit.

        @param reason: Why, for the log (C{idle}, C{keep_alive 0}, C{evicted},
            C{shutdown}, ...).
        """
        if isinstance(instance, RemoteInstance):
            return succeed(None)  # nothing runs here (keep_alive 0, an unload)
        if self._instances.get(instance.entry.name) is instance:
            del self._instances[instance.entry.name]
        if instance.stop_reason:
            # a stop is under way: this is the same one (a second SIGTERM
            # would make llama-server drop the work it is finishing)
            return instance.protocol.when_ended()
        if not instance.stop_reason and instance.state != InstanceState.DEAD:
            instance.stop_reason = reason
            log.info("stopping {model}: {reason}", model=instance.entry.name, reason=reason)
            if self.before_stop is not None and instance.state == InstanceState.READY:
                saving = self.before_stop(instance)
                saving.addErrback(lambda f: log.failure("before stopping {model}", f, model=instance.entry.name))
                # (not saving.called: a Deferred that fired and then waits on
                # one its callback returned is "called" and still running)
                finished: list[bool] = []
                saving.addCallback(lambda _: finished.append(True))
                if not finished:
                    ended = instance.protocol.when_ended()
                    saving.addCallback(lambda _: instance.terminate(self._reactor, self._config.stop_grace))
                    saving.addErrback(lambda f: log.failure("stopping {model} failed", f, model=instance.entry.name))
                    return ended
        return instance.terminate(self._reactor, self._config.stop_grace)

    async def probe_health(self, instance: Instance) -> bool:
        """
        Whether C{instance}'s C{/health} answers 200 within a few seconds
        (L{blazar.engines.spawn.probe_health}).

        @raise CancelledError: The caller was cancelled (its client left):
            never L{False}.
        """
        return await probe_health(self._probe, self._reactor, instance.base_url + instance.health_path)

    def kill_instance(self, instance: Instance, reason: str) -> Deferred[ExitStatus]:
        """
        Stop a child that no longer responds: SIGKILL at once.
        """
        ended = self.stop_instance(instance, reason)
        if isinstance(instance, RemoteInstance):
            return ended
        if instance.transport is not None and instance.protocol.status is None:
            try:
                instance.transport.signalProcess("KILL")
            except ProcessExitedAlready:
                pass
        return ended

    def evict(self, key: str) -> list[Instance]:
        """
        Stop the instances a key names (L{evicted_name}): C{name} (every
        instance of that model), or C{name#replica} / C{name@lane} for one
        instance.

        @return: The instances being stopped.
        """
        wanted = evicted_name(key)
        if wanted is None:
            return []
        chosen = [
            i
            for i in self._all
            if name_key(i.entry.name) == wanted and i.state not in (InstanceState.STOPPING, InstanceState.DEAD)
        ]
        for instance in chosen:
            self.stop_instance(instance, "evicted")
        return chosen

    def stopService(self) -> Deferred[object]:
        """
        Stop every child; fires once all have exited.
        """
        Service.stopService(self)
        self._shutting_down = True
        if self._reaper is not None and self._reaper.running:
            self._reaper.stop()
        waits: list[Deferred[Any]] = [self.stop_instance(i, "shutdown") for i in list(self._all)]
        waits.append(ensureDeferred(self.lookup_caches.stop()))  # (answers still being counted, then written)
        waits.append(ensureDeferred(self.spec_tuner.stop()))  # (the decisions, with their answers since)
        return DeferredList(waits, consumeErrors=True)  # type: ignore[return-value]
