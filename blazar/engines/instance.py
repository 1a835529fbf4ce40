"""
One engine child as the supervisor tracks it (L{Instance}, in an
L{InstanceState}), and the read-only L{InstanceView} of it that readers
(C{/api/ps}, the control socket, the metrics) take.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ProcessExitedAlready
from zope.interface import Attribute, Interface, implementer

from blazar.engines.lanes import BUILTIN, SDCPP, SERVER_NAME
from blazar.engines.llamacpp import DEFAULT_PARALLEL
from blazar.engines.process import EngineProcessProtocol, ExitStatus
from blazar.engines.waiters import Waiters
from blazar.models.registry import ModelEntry
from blazar.names import name_key


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
            (
                gpu,
                planned.get(gpu, 0) if self.vram_planned is not None else None,
                measured.get(gpu, 0) if self.vram_measured is not None else None,
            )
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
        entry=entry,
        name=entry.name,
        state=InstanceState(instance.state),
        pid=instance.pid,
        port=instance.port,
        in_flight=instance.in_flight,
        # whisper-server and sd-server take one request at a time (admission gives them one slot)
        slots=1 if getattr(instance, "lane", "") in BUILTIN else entry.settings.parallel or DEFAULT_PARALLEL,
        ctx=instance.ctx,
        started_at=instance.started_at,
        ready_at=instance.ready_at,
        last_used=instance.last_used,
        expires_at=instance.expires_at(),
        served=instance.served,
        breaker=breaker,
        lane=getattr(instance, "lane", "llamacpp"),
        vram=sum(plan.gpu_bytes.values()) if (plan := getattr(instance, "plan", None)) is not None else 0,
        vram_planned=tuple(sorted(plan.gpu_bytes.items())) if plan is not None else None,
        vram_measured=tuple(sorted(measured.items()))
        if (measured := getattr(instance, "vram_measured", None)) is not None
        else None,
    )


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
    _waiters: Waiters[Instance] = attrs.field(factory=Waiters)
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
            return fail(self._failure)
        return self._waiters.wait()

    def awaited(self) -> bool:
        """
        Whether requests wait for this child to become ready.
        """
        return self._waiters.pending()

    def _settle(self, failure: BaseException | None) -> None:
        self._failure = failure
        if failure is None:
            self._waiters.fire(self)
        else:
            self._waiters.fail(failure)

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

    def terminate(self, clock: Any, grace: float) -> Deferred[ExitStatus]:
        """
        SIGTERM the child (again after a second), SIGKILL after C{grace}
        seconds; fires with its L{ExitStatus} once it has exited. The
        timers are cancelled when it exits (L{blazar.engines.supervisor}).
        """
        instance = self
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
        instance.kill_timer = clock.callLater(grace, signal, "KILL")
        if grace > 1.0:
            instance.term_timer = clock.callLater(1.0, signal, "TERM")
        return ended

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


def evicted_name(key: str) -> str | None:
    """
    The model (as L{blazar.names.name_key}) an eviction key names:
    C{name}, or C{name#replica} / C{name@lane} for one instance (Blazar
    runs one instance per model today: replica C{0}, lane C{text});
    L{None} if it names none.
    """
    base, lane = (key.split("@", 1) + [""])[:2] if "@" in key else (key, "")
    base, replica = (base.split("#", 1) + [""])[:2] if "#" in base else (base, "")
    try:
        wanted = name_key(base)
    except ValueError:
        return None
    if replica not in ("", "0") or lane not in ("", "text"):
        return None
    return wanted
