"""
Public test helpers: fakes (a fake process reactor, a fake engine, a fake
supervisor and instance, a fake engine client) that tests and users can
import; each passes the same interface tests as the real thing.

The tiny GGUF model generator is a product feature
(C{blazar models make-test}): L{blazar.models.testmodel}.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError, ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from zope.interface import implementer

from blazar import strictjson
from blazar.config import ModelConfig
from blazar.engines.breaker import Breaker
from blazar.engines.client import IEngineClient, NotDelivered
from blazar.engines.errors import EngineCrashed, EngineError, EngineStartFailed
from blazar.engines.growth import ContextPlan, estimate_bytes
from blazar.engines.hardware import GPU, Census, IHardwareProbe, cuda_version
from blazar.engines.instance import IInstance, InstanceState, InstanceView, evicted_name, view_of
from blazar.engines.interfaces import ISupervisor
from blazar.engines.process import EngineProcessProtocol, ExitStatus
from blazar.gateway.sessions import ISlotBank, SlotActionFailed
from blazar.httpbody import BodyTooLarge
from blazar.models import testmodel
from blazar.models.registry import ModelEntry, ModelNotFound
from blazar.names import name_key

# -- fakes for unit tests ---------------------------------------------------


class SynchronousThreadPool:
    """
    A thread pool that runs work at once in the caller's thread, so code
    that uses C{deferToThreadPool} runs without threads in unit tests.
    """

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def callInThreadWithCallback(self, onResult, func, *args, **kw):
        try:
            result = func(*args, **kw)
        except BaseException:
            onResult(False, Failure())
        else:
            onResult(True, result)


@attrs.define(eq=False)
class FakeProcessTransport:
    """
    What L{FakeProcessReactor.spawnProcess} returns: records signals and
    lets a test end the process with L{exit}.
    """

    protocol: object
    pid: int
    signals: list[str] = attrs.field(factory=list)
    stdin_closed: bool = False
    ended: bool = False
    zombie: bool = False

    def signalProcess(self, signal: str) -> None:
        if self.ended:
            raise ProcessExitedAlready()
        self.signals.append(signal)

    def closeStdin(self) -> None:
        self.stdin_closed = True

    def exit(self, code: int | None = 0, signal: int | None = None) -> None:
        """
        End the process as the real reactor reports it: C{processExited}
        first, then C{processEnded}.
        """
        self.ended = True
        reason = Failure(ProcessDone(0)) if code == 0 and signal is None else Failure(ProcessTerminated(code, signal))
        self.protocol.processExited(reason)  # type: ignore[attr-defined]
        self.protocol.processEnded(reason)  # type: ignore[attr-defined]

    def die(self) -> None:
        """
        The process exits, and the reactor has not reaped it yet: C{/proc}
        shows a zombie (L{FakeProcessReactor.process_alive} is false), no
        exit is reported until L{exit}, and signals still succeed.
        """
        self.zombie = True


def fake_process_reactor():
    """
    A C{MemoryReactorClock} that also fakes C{spawnProcess} (recording each
    call in C{.spawned} as C{(transport, executable, args, env)}) and runs
    thread-pool work synchronously. Its C{process_alive(pid)} stands in for
    L{blazar.engines.process.process_alive} (the supervisor's
    C{process_alive} argument): false once a child's transport has died or
    exited.
    """

    class FakeProcessReactor(MemoryReactorClock):
        def __init__(self) -> None:
            super().__init__()
            self.spawned: list[tuple[FakeProcessTransport, str, list[str], dict[str, str]]] = []
            self._pool = SynchronousThreadPool()

        def getThreadPool(self) -> SynchronousThreadPool:
            return self._pool

        def process_alive(self, pid: int | None) -> bool:
            return any(t.pid == pid and not (t.ended or t.zombie) for t, *_ in self.spawned)

        def callFromThread(self, f, *args, **kw):
            f(*args, **kw)

        def spawnProcess(
            self, protocol, executable, args=(), env=None, path=None, uid=None, gid=None, usePTY=False, childFDs=None
        ):
            transport = FakeProcessTransport(protocol, pid=1000 + len(self.spawned))
            protocol.makeConnection(transport)
            self.spawned.append((transport, executable, list(args), dict(env or {})))
            return transport

    return FakeProcessReactor()


# -- a fake engine and supervisor for surface unit tests --------------------


def fake_engine_app(model_name: str = "m:latest"):
    """
    A Klein app that answers like llama-server (compact JSON, C{model} set
    to C{model_name}, SSE streams ending in C{[DONE]}), for
    C{treq.testing.StubTreq}. C{app.requests} records C{(path, body)}.
    Send C{"chat_template_kwargs": {"fail": N}} in a request body (a field
    the gateway passes through) to get status N back.
    """
    import json

    from klein import Klein

    app = Klein()
    app.requests = []  # type: ignore[attr-defined]

    def chunk(i: int, text: str) -> bytes:
        body = {
            "choices": [{"finish_reason": None, "index": 0, "delta": {"content": text}}],
            "created": 1,
            "id": "chatcmpl-x",
            "model": model_name,
            "object": "chat.completion.chunk",
        }
        return b"data: " + strictjson.encode(body, separators=(",", ":")).encode() + b"\n\n"

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat(request):
        body = json.loads(request.content.read())
        app.requests.append(("/v1/chat/completions", body))  # type: ignore[attr-defined]
        fail = (body.get("chat_template_kwargs") or {}).get("fail")
        if fail:
            request.setResponseCode(fail)
            return strictjson.encode(
                {"error": {"code": fail, "message": "engine says no", "type": "server_error"}},
            ).encode()
        if body.get("stream"):
            request.setHeader(b"content-type", b"text/event-stream")
            for i, text in enumerate(["Hel", "lo"]):
                request.write(chunk(i, text))
            return b"data: [DONE]\n\n"
        request.setHeader(b"content-type", b"application/json")
        return strictjson.encode(
            {
                "choices": [
                    {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "Hello"}}
                ],
                "created": 1,
                "model": model_name,
                "object": "chat.completion",
                "usage": {"completion_tokens": 1, "prompt_tokens": 2, "total_tokens": 3},
            },
            separators=(",", ":"),
        ).encode()

    return app


def _engine_protocol(instance: "FakeInstance") -> Any:
    return EngineProcessProtocol(instance.name)


@implementer(IInstance)
@attrs.define(eq=False)  # as the real Instance: compared and hashed by identity
class FakeInstance:
    """
    Stands in for L{blazar.engines.supervisor.Instance} in surface tests:
    an L{IInstance} with no process behind it.

    @ivar alive: Its child runs; L{False}: it exited, unreported
        (L{FakeSupervisor.exited} finds it).
    @ivar answers_health: Its C{/health} answers 200
        (L{FakeSupervisor.probe_health}); L{False}: it is silent.
    @ivar protocol: A real L{blazar.engines.process.EngineProcessProtocol}
        that no process feeds (C{status} L{None}: running).
    """

    name: str
    base_url: str = "http://engine.invalid"
    api_key: str = "secret"
    in_flight: int = 0
    state: InstanceState = InstanceState.READY
    parallel: int = 1
    alive: bool = True
    ctx: int = 0  # tokens per slot, as the real one (0: not known, read from the GGUF)
    port: int = 0
    pid: int | None = None
    started_at: float = 0.0
    ready_at: float | None = 0.0
    last_used: float = 0.0
    keep_alive: float | None = None
    unload_when_idle: str | None = None
    idle_timeout: float = 1800.0
    served: int = 0
    answers_health: bool = True
    path: Path | None = None  # its model file (entry.path), if a test needs a real one
    settings: ModelConfig | None = None  # its entry's settings, if a test needs others than parallel's
    binary: str = ""
    shape: str = ""  # as the real one's (blazar.engines.supervisor.child_shape); "": computed from the files
    lane: str = "llamacpp"  # as the real one's: llamacpp, whisper, sdcpp or a command lane's name
    server: str = "llama-server"
    argv: tuple[str, ...] = ()  # the command line it was started with, as the real one's
    plan: Any = None  # a blazar.engines.planner.Plan where a test places it on GPUs, as the real one's
    vram_measured: dict[int, int] | None = None  # GPU -> bytes NVML measured, as the real one's
    protocol: Any = attrs.field(default=attrs.Factory(_engine_protocol, takes_self=True))

    @property
    def entry(self) -> ModelEntry:
        return ModelEntry(
            self.name,
            self.path or Path(f"/nonexistent/{self.name}.gguf"),
            settings=self.settings or ModelConfig(parallel=self.parallel),
        )

    @property
    def auth_headers(self) -> dict[bytes, list[bytes]]:
        return {b"authorization": [b"Bearer " + self.api_key.encode()]}

    def expires_at(self) -> float | None:
        """
        As the real one: last use plus C{keep_alive}, else plus
        C{idle_timeout}; L{None} if kept forever.
        """
        keep = self.idle_timeout if self.keep_alive is None else self.keep_alive
        if keep < 0:
            return None
        return self.last_used + keep

    def wait_ready(self) -> Deferred[Any]:
        if self.state == InstanceState.READY:
            return succeed(self)
        return fail(EngineStartFailed(self.name, f"model {self.name!r} is {self.state}"))


@implementer(ISupervisor)
@attrs.define
class FakeSupervisor:
    """
    An L{ISupervisor} that resolves names against a fixed list; every
    model is ready at once, and a stopped one exits at once. Its clock
    (a L{Clock} unless given) times uses, expiry and the 3 s health
    probe.

    @ivar table: The live instance per canonical name (the real one's
        C{loaded}).
    @ivar started: Instances made so far.
    @ivar touched: C{(name, keep_alive)} of every L{touch}.
    @ivar stopped: C{(name, reason)} of every stop or kill.
    @ivar profiles: The placement asked for per model name (L{want_profile}).
    """

    names: list[str]
    table: dict[str, FakeInstance] = attrs.field(factory=dict)
    started: int = 0
    ctx_policy: str = "grow"
    ctx: int = 2048
    clock: Any = attrs.field(factory=Clock)
    touched: list[tuple[str, float | None]] = attrs.field(factory=list)
    stopped: list[tuple[str, str]] = attrs.field(factory=list)
    breakers: dict[str, Breaker] = attrs.field(factory=dict)
    profiles: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    _config: Any = None

    async def instance_for(self, name: str, ctx_size: int | None = None) -> FakeInstance:
        try:
            key = name_key(name)
        except ValueError:
            raise ModelNotFound(name, self.names) from None
        for canonical in self.names:
            if name_key(canonical) == key:
                if canonical not in self.table:
                    self.started += 1
                    now = self.clock.seconds()
                    self.table[canonical] = FakeInstance(
                        canonical,
                        pid=1000 + self.started,
                        port=5000 + self.started,
                        started_at=now,
                        ready_at=now,
                        last_used=now,
                        ctx=self.ctx,
                    )
                return self.table[canonical]
        raise ModelNotFound(name, self.names)

    async def context_for(self, name: str, ctx_size: int) -> Any:
        """
        As the real one for a model trained for C{ctx} tokens per slot,
        loaded with all of it: C{ctx} whatever C{ctx_size} asks.
        """
        return ContextPlan(self.ctx, ctx_size, self.ctx_policy, name, self.ctx)

    async def want_profile(self, name: str, wishes: Any) -> None:
        """
        Records the placement asked for (C{profiles}, by the name asked);
        nothing is reloaded.
        """
        if wishes:
            self.profiles[name] = dict(wishes)

    def loaded(self, name: str) -> FakeInstance | None:
        return self.table.get(name)

    def instances(self) -> list[FakeInstance]:
        return sorted(self.table.values(), key=lambda i: i.started_at)

    def snapshot(self) -> list[InstanceView]:
        return [view_of(i, self.breaker(i.name).state) for i in self.instances()]

    async def measured_snapshot(self) -> list[InstanceView]:
        """
        L{snapshot}: a fake child has no memory to measure (C{rss} L{None}).
        """
        return self.snapshot()

    def touch(self, instance: FakeInstance, keep_alive: float | None = None) -> None:
        self.touched.append((instance.name, keep_alive))
        instance.last_used = self.clock.seconds()
        instance.served += 1
        if keep_alive is not None:
            instance.keep_alive = keep_alive

    def stop_instance(self, instance: FakeInstance, reason: str = "requested") -> Deferred[Any]:
        """
        As the real one, with a child that exits at once: it leaves the
        table, and the result fires with a clean L{ExitStatus}.
        """
        if self.table.get(instance.name) is instance:
            del self.table[instance.name]
        if instance.state != InstanceState.DEAD:
            self.stopped.append((instance.name, reason))
        instance.state = InstanceState.DEAD
        instance.alive = False
        return succeed(ExitStatus(0, None))

    def unload_when_idle(self, instance: FakeInstance, reason: str) -> Deferred[Any] | None:
        """
        As the real one: stopped now if idle, else marked for its last
        request's lease to stop.
        """
        if instance.in_flight == 0:
            return self.stop_instance(instance, reason)
        instance.unload_when_idle = reason
        return None

    def kill_instance(self, instance: FakeInstance, reason: str) -> Deferred[Any]:
        return self.stop_instance(instance, reason)

    async def probe_health(self, instance: FakeInstance) -> bool:
        """
        As the real one: L{True} if the child answers, L{False} for an
        exited one, and for a silent one after 3 s on the clock; a caller
        cancelled meanwhile gets L{CancelledError}, never L{False}.
        """
        if instance.state == InstanceState.DEAD or not instance.alive:
            return False
        if instance.answers_health:
            return True
        silence: Deferred[bool] = Deferred()
        timer = self.clock.callLater(3.0, silence.callback, False)
        try:
            return await silence
        finally:
            if timer.active():
                timer.cancel()

    def exited(self, instance: FakeInstance) -> bool:
        """
        As the real one: whether the child has exited (the instance is
        dead, or a test cleared C{alive}); a ready one found exited is dead
        from then on and leaves the table, so the next request gets a fresh
        instance.
        """
        if instance.state == InstanceState.DEAD:
            return True
        if instance.alive:
            return False
        if instance.state == InstanceState.READY:
            instance.state = InstanceState.DEAD
            if self.table.get(instance.name) is instance:
                del self.table[instance.name]
        return True

    async def explain_failure(self, instance: FakeInstance, error: BaseException) -> EngineError:
        """
        As the real one when the child has exited: the instance is dead and
        leaves the table.
        """
        instance.state = InstanceState.DEAD
        instance.alive = False
        if self.table.get(instance.name) is instance:
            del self.table[instance.name]
        return EngineCrashed(instance.name, f"engine connection failed: {error}")

    def remote_failed(self, instance: Any, error: str) -> str:
        """
        As the real one: the failure counts against the model's breaker.
        """
        self.breaker(instance.entry.name).crashed(self.clock.seconds(), error)
        return error

    def remote_ok(self, instance: Any) -> None:
        self.breaker(instance.entry.name).ready()

    def breaker(self, name: str) -> Breaker:
        found = self.breakers.get(name)
        if found is None:
            found = self.breakers[name] = Breaker(3, 60.0, 10.0, 300.0)
        return found

    def reset_breakers(self, name: str | None = None) -> list[str]:
        names = [name] if name is not None else list(self.breakers)
        for n in names:
            if n in self.breakers:
                self.breakers[n].reset()
        return [n for n in names if n in self.breakers]

    def evict(self, key: str) -> list[FakeInstance]:
        wanted = evicted_name(key)
        chosen = [i for i in self.instances() if wanted is not None and name_key(i.name) == wanted]
        for instance in chosen:
            self.stop_instance(instance, "evicted")
        return chosen

    def estimate(self, entry: ModelEntry, meta: Any) -> int:
        return estimate_bytes(entry, meta)

    def reconfigure(self, config: Any) -> None:
        self._config = config
        self.ctx_policy = config.ctx_policy


@implementer(IEngineClient)
class FakeEngineClient:
    """
    An L{IEngineClient} over an in-memory HTTP client such as
    C{treq.testing.StubTreq(fake_engine_app().resource())}, so the proxy
    code runs unchanged against a fake engine.

    @ivar sent: C{(method, url)} of every request.
    """

    def __init__(self, http: Any) -> None:
        self._http = http
        self.sent: list[tuple[str, str]] = []
        self.closed = False

    async def get_status(self, url: str, timeout: float = 2.0) -> int:
        return (await self.get(url, {}, timeout, max_bytes=1 << 16))[0]

    async def get(
        self,
        url: str,
        headers: dict[bytes, list[bytes]],
        timeout: float = 5.0,
        max_bytes: int = 1 << 20,
    ) -> tuple[int, bytes]:
        self.sent.append(("GET", url))
        response = await self._http.request("GET", url, headers=headers)
        body = await response.content()
        if len(body) > max_bytes:  # (as the real client's read_body)
            raise BodyTooLarge(f"body over {max_bytes} bytes")
        return int(response.code), bytes(body)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: dict[bytes, list[bytes]],
        stream: bool = True,
    ) -> Any:
        self.sent.append((method, url))
        return await self._http.request(method, url, data=body, headers=headers, unbuffered=True)

    async def close(self) -> None:
        self.closed = True


@implementer(IEngineClient)
class StubEngineClient(FakeEngineClient):
    """
    A L{FakeEngineClient} over C{stub} whose next C{refuse} requests find
    their children exited, unreported: each kills the live instances of
    C{supervisor} (a L{FakeSupervisor}) and raises L{NotDelivered}, as a
    refused connection to a dead child does.
    """

    def __init__(self, stub: Any, supervisor: FakeSupervisor | None = None) -> None:
        super().__init__(stub)
        self.stub = stub
        self.supervisor = supervisor
        self.refuse = 0

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: dict[bytes, list[bytes]],
        stream: bool = True,
    ) -> Any:
        if self.refuse:
            # the next requests' children have exited (unreported): they refuse
            self.refuse -= 1
            for instance in self.supervisor.table.values() if self.supervisor else ():
                instance.alive = False
            raise NotDelivered(ConnectionRefusedError("127.0.0.1", 1))
        return await super().request(method, url, body, headers, stream)


def forced_tool_call_request(
    model: str, seed: int = 1, stream: bool = False, tool_choice: str = "required"
) -> dict[str, Any]:
    """
    An OpenAI chat request that makes the random test model emit one real,
    parsed tool call on the pinned llama-server (seen with seeds 1-4).

    How: C{tool_choice: "required"} makes the engine's grammar apply once
    C{<tool_call>} and a newline appear, so both are pushed up with
    C{logit_bias}; spaces and tabs are pushed down so the JSON closes within
    C{max_tokens}; the argument is an enum so its string ends; and
    C{<|im_end|>} is pushed up so the turn ends after one call
    (C{finish_reason: "tool_calls"}).

    With C{tool_choice="auto"} (what Ollama's API amounts to: it has no
    tool_choice) the engine's grammar is lazy and a pushed-up C{<|im_end|>}
    would end the turn before the call starts, so it is left alone: the
    model then writes several parsed calls until C{max_tokens}
    (C{finish_reason: "length"}).
    """
    ids = {tok: i for i, tok in enumerate(testmodel.vocabulary()[0])}
    bias = {
        ids["<tool_call>"]: 100,
        ids["\n"]: 100,
        ids["<0x09>"]: -100,
        ids["<0x20>"]: -100,
        ids["<0x0A>"]: -100,
        ids["▁"]: -100,
    }
    if tool_choice == "required":
        bias[ids["<|im_end|>"]] = 100
    return {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather for a city",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                        "required": ["city"],
                    },
                },
            }
        ],
        "tool_choice": tool_choice,
        "logit_bias": {str(k): v for k, v in bias.items()},
        "max_tokens": 200,
        "seed": seed,
        "stream": stream,
    }


@implementer(ISlotBank)
class FakeSlotBank:
    """
    L{blazar.gateway.sessions.ISlotBank} in memory: each slot of each
    instance holds a token count (L{fill} is a request that ran there),
    each saved file the count it was saved with. A file named in
    C{corrupt} fails to restore, as llama-server's answer to a damaged
    file does.

    @ivar calls: C{(action, slot, filename)} in order.
    """

    def __init__(self) -> None:
        self.slots_held: dict[tuple[int, int], int] = {}
        self.files: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.busy: set[int] = set()  # slots a task runs in (of any instance)
        self.unreachable = False  # the child answers nothing (it is gone)
        self.calls: list[tuple[str, int, str | None]] = []

    def fill(self, instance: Any, slot: int, tokens: int) -> None:
        self.slots_held[(id(instance), slot)] = tokens

    def held(self, instance: Any, slot: int) -> int:
        return self.slots_held.get((id(instance), slot), 0)

    async def save(self, instance: Any, slot: int, filename: str, timeout: float) -> tuple[int, int]:
        self.calls.append(("save", slot, filename))
        tokens = self.held(instance, slot)
        self.files[filename] = tokens
        self.corrupt.discard(filename)
        return tokens, tokens * 512

    async def restore(self, instance: Any, slot: int, filename: str, timeout: float) -> int:
        self.calls.append(("restore", slot, filename))
        if self.unreachable:
            raise SlotActionFailed("restore: Connection refused", transient=True)
        if filename not in self.files or filename in self.corrupt:
            raise SlotActionFailed(
                "restore: 400 'Unable to restore slot: No available space in KV cache or invalid slot save file'"
            )
        self.fill(instance, slot, self.files[filename])
        return self.files[filename]

    async def erase(self, instance: Any, slot: int, timeout: float) -> None:
        self.calls.append(("erase", slot, None))
        self.fill(instance, slot, 0)

    async def slots(self, instance: Any, timeout: float) -> list[tuple[int, bool, bool]]:
        if self.unreachable:
            raise SlotActionFailed("slots: Connection refused", transient=True)
        used = {slot for (ident, slot) in self.slots_held if ident == id(instance)}
        return [(slot, slot in used, slot in self.busy) for slot in range(max(used | self.busy | {0}) + 1)]


# -- a fake hardware probe and a recorded NVML -------------------------------

GIB = 1 << 30


def _recorded(value: Any) -> Any:
    """
    A value from an C{nvml_snapshot.py} recording, or L{None} where the
    recording holds the NVML error it got instead (C{{"error": ...}}).
    """
    return None if isinstance(value, dict) and "error" in value else value


def _snapshot_of(recorded: dict[str, Any]) -> dict[str, Any]:
    # the whole file (scripts/nvml_snapshot.py's output) or its "snapshot"
    return recorded["snapshot"] if "snapshot" in recorded else recorded


@attrs.define
class FakeGPU:
    """
    One GPU of a L{FakeNVML}, mutable. Its free memory is C{memory_total -
    memory_reserved - other_used - sum(processes)}, so a test that gives a
    child VRAM (L{FakeNVML.set_process_memory}) sees the free figure fall.

    @ivar other_used: Bytes held by something not listed in C{processes}
        (another user, a graphics context).
    @ivar processes: pid to bytes.
    """

    index: int
    memory_total: int
    name: str = "NVIDIA GeForce RTX 4090"
    uuid: str = ""
    memory_reserved: int = 0
    other_used: int = 0
    processes: dict[int, int] = attrs.field(factory=dict)
    compute_capability: tuple[int, int] | None = (8, 9)
    temperature_c: int | None = 40
    utilization_percent: int | None = 0

    def __attrs_post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-00000000-0000-0000-0000-{self.index:012d}"

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_reserved - self.other_used - sum(self.processes.values()))


@implementer(IHardwareProbe)
@attrs.define
class FakeNVML:
    """
    L{blazar.engines.hardware.IHardwareProbe} from given numbers: a
    recording of a real machine (L{from_snapshot}) or simple specs
    (L{with_gpus}); zero GPUs by default. It answers at once, in any
    thread, and counts its readings in C{readings}.
    """

    gpus: list[FakeGPU] = attrs.field(factory=list)
    cpu_physical_cores: int = 8
    cpu_logical_cores: int = 16
    ram_total: int = 64 * GIB
    ram_available: int = 48 * GIB
    driver_version: str | None = "580.159.04"
    cuda_driver_version: tuple[int, int] | None = (13, 0)
    gpu_note: str = ""
    now: Any = lambda: 0.0
    readings: int = 0

    @classmethod
    def with_gpus(cls, *totals: int, name: str = "NVIDIA GeForce RTX 4090", **host: Any) -> "FakeNVML":
        """
        One GPU per total (bytes), empty, e.g. C{FakeNVML.with_gpus(24 *
        GIB, 24 * GIB)}; C{host} sets the other fields.
        """
        return cls(gpus=[FakeGPU(i, total, name=name) for i, total in enumerate(totals)], **host)

    @classmethod
    def from_snapshot(cls, recorded: dict[str, Any], **host: Any) -> "FakeNVML":
        """
        The machine C{scripts/nvml_snapshot.py} recorded (its JSON output,
        e.g. C{tests/fixtures/nvml/h200.json}), read as L{NVMLProbe}
        reads NVML: memory v2 where recorded, else v1.
        """
        snapshot = _snapshot_of(recorded)
        gpus = []
        for device in snapshot["devices"]:
            memory = device["memory"]
            v2 = _recorded(memory.get("v2"))
            info = v2 if v2 and "reserved" in v2 else memory["v1"]
            reserved = int(info.get("reserved", 0)) if info is v2 else 0
            processes = {
                int(p["pid"]): int(p["usedGpuMemory"])
                for p in _recorded(device["processes"]) or []
                if p["usedGpuMemory"] is not None
            }
            capability = _recorded(device.get("compute_capability"))
            utilization = _recorded(device.get("utilization"))
            gpus.append(
                FakeGPU(
                    index=int(device["index"]),
                    memory_total=int(info["total"]),
                    name=device["name"],
                    uuid=device["uuid"],
                    memory_reserved=reserved,
                    other_used=max(0, int(info["total"]) - int(info["free"]) - reserved - sum(processes.values())),
                    processes=processes,
                    compute_capability=tuple(capability) if capability else None,
                    temperature_c=_recorded(device.get("temperature_c")),
                    utilization_percent=utilization.get("gpu") if utilization else None,
                )
            )
        cuda = _recorded(snapshot.get("cuda_driver_version"))
        return cls(
            gpus=gpus,
            driver_version=_recorded(snapshot.get("driver_version")),
            cuda_driver_version=cuda_version(cuda) if cuda is not None else None,
            **host,
        )

    def gpu(self, index: int) -> FakeGPU:
        return next(g for g in self.gpus if g.index == index)

    def set_free(self, index: int, free: int) -> None:
        """
        GPU C{index} has C{free} bytes free now (something outside the
        listed processes holds the rest); later process changes move it.
        """
        gpu = self.gpu(index)
        gpu.other_used = max(0, gpu.memory_total - gpu.memory_reserved - sum(gpu.processes.values()) - free)

    def set_process_memory(self, pid: int, index: int, used: int) -> None:
        """
        Process C{pid} holds C{used} bytes on GPU C{index} (0: none, it
        leaves the list).
        """
        processes = self.gpu(index).processes
        if used:
            processes[pid] = used
        else:
            processes.pop(pid, None)

    def _gpu(self, g: FakeGPU) -> GPU:
        free = g.memory_free
        return GPU(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            memory_total=g.memory_total,
            memory_free=free,
            memory_used=g.memory_total - free,
            memory_reserved=g.memory_reserved,
            compute_capability=g.compute_capability,
            driver_version=self.driver_version,
            cuda_driver_version=self.cuda_driver_version,
            temperature_c=g.temperature_c,
            utilization_percent=g.utilization_percent,
            processes=tuple(sorted(g.processes.items())),
        )

    def thd_census(self) -> Census:
        self.readings += 1
        return Census(
            gpus=tuple(self._gpu(g) for g in sorted(self.gpus, key=lambda g: g.index)),
            cpu_physical_cores=self.cpu_physical_cores,
            cpu_logical_cores=self.cpu_logical_cores,
            ram_total=self.ram_total,
            ram_available=self.ram_available,
            taken_at=self.now(),
            gpu_note=(self.gpu_note or "NVML sees no GPU") if not self.gpus else self.gpu_note,
        )

    def thd_process_gpu_memory(self, pid: int) -> dict[int, int]:
        return {g.index: g.processes[pid] for g in self.gpus if g.processes.get(pid)}


class RecordedNVMLError(Exception):
    """
    What L{RecordedNVML} raises where the recording holds an NVML error
    (as C{pynvml.NVMLError_*} would).
    """


class RecordedNVML:
    """
    A stand-in for the C{pynvml} module that answers what a real machine
    answered (an C{nvml_snapshot.py} recording), so
    L{blazar.engines.hardware.NVMLProbe}'s reading code runs without a GPU.

    @param v2: Whether the driver answers memory v2 (C{False}: an older
        driver, which refuses the versioned call).
    @param init_error: Make C{nvmlInit} raise this (no driver, no library).
    """

    NVML_TEMPERATURE_GPU = 0
    nvmlMemory_v2 = 0x02000028

    def __init__(self, recorded: dict[str, Any], v2: bool = True, init_error: Exception | None = None) -> None:
        self._snapshot = _snapshot_of(recorded)
        self._v2 = v2
        self._init_error = init_error
        self.initialised = 0

    @staticmethod
    def _answer(value: Any) -> Any:
        if isinstance(value, dict) and "error" in value:
            raise RecordedNVMLError(value.get("message", value["error"]))
        return value

    def _device(self, handle: int) -> dict[str, Any]:
        return self._snapshot["devices"][handle]

    def nvmlInit(self) -> None:
        if self._init_error is not None:
            raise self._init_error
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._answer(self._snapshot["driver_version"])

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._answer(self._snapshot["cuda_driver_version"])

    def nvmlDeviceGetCount(self) -> int:
        return len(self._snapshot["devices"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self._snapshot["devices"]):
            raise RecordedNVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._answer(self._device(handle)["name"])

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._answer(self._device(handle)["uuid"])

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> Any:
        memory = self._device(handle)["memory"]
        if version is not None:
            if not self._v2 or "v2" not in memory:
                raise RecordedNVMLError("Function Not Found")
            return SimpleNamespace(**self._answer(memory["v2"]))
        return SimpleNamespace(**self._answer(memory["v1"]))

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return tuple(self._answer(self._device(handle)["compute_capability"]))

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return self._answer(self._device(handle)["temperature_c"])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(**self._answer(self._device(handle)["utilization"]))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return [SimpleNamespace(**p) for p in self._answer(self._device(handle)["processes"])]
