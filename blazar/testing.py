"""
Public test helpers: fakes (a fake process reactor, a fake engine, a fake
supervisor and instance, a fake engine client) that tests and users can
import; each passes the same interface tests as the real thing.

The tiny GGUF model generator is a product feature
(C{blazar models make-test}): L{blazar.models.testmodel}.
"""

from __future__ import annotations

from typing import Any

import attrs

from blazar.engines.supervisor import InstanceState



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

    def callInThreadWithCallback(self, onResult, func, *args, **kw):  # type: ignore[no-untyped-def]
        try:
            result = func(*args, **kw)
        except BaseException:
            from twisted.python.failure import Failure

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
        from twisted.internet.error import ProcessExitedAlready

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
        from twisted.internet.error import ProcessDone, ProcessTerminated
        from twisted.python.failure import Failure

        self.ended = True
        reason = (
            Failure(ProcessDone(0))
            if code == 0 and signal is None
            else Failure(ProcessTerminated(code, signal))
        )
        self.protocol.processExited(reason)  # type: ignore[attr-defined]
        self.protocol.processEnded(reason)  # type: ignore[attr-defined]

    def die(self) -> None:
        """
        The process exits, and the reactor has not reaped it yet: C{/proc}
        shows a zombie (L{FakeProcessReactor.process_alive} is false), no
        exit is reported until L{exit}, and signals still succeed.
        """
        self.zombie = True


def fake_process_reactor():  # type: ignore[no-untyped-def]
    """
    A C{MemoryReactorClock} that also fakes C{spawnProcess} (recording each
    call in C{.spawned} as C{(transport, executable, args, env)}) and runs
    thread-pool work synchronously. Its C{process_alive(pid)} stands in for
    L{blazar.engines.process.process_alive} (the supervisor's
    C{process_alive} argument): false once a child's transport has died or
    exited.
    """
    from twisted.internet.testing import MemoryReactorClock

    class FakeProcessReactor(MemoryReactorClock):
        def __init__(self) -> None:
            super().__init__()
            self.spawned: list[tuple[FakeProcessTransport, str, list[str], dict[str, str]]] = []
            self._pool = SynchronousThreadPool()

        def getThreadPool(self) -> SynchronousThreadPool:
            return self._pool

        def process_alive(self, pid: int | None) -> bool:
            return any(t.pid == pid and not (t.ended or t.zombie) for t, *_ in self.spawned)

        def callFromThread(self, f, *args, **kw):  # type: ignore[no-untyped-def]
            f(*args, **kw)

        def spawnProcess(self, protocol, executable, args=(), env=None, path=None,  # type: ignore[no-untyped-def]
                         uid=None, gid=None, usePTY=False, childFDs=None):
            transport = FakeProcessTransport(protocol, pid=1000 + len(self.spawned))
            protocol.makeConnection(transport)
            self.spawned.append((transport, executable, list(args), dict(env or {})))
            return transport

    return FakeProcessReactor()


# -- a fake engine and supervisor for surface unit tests --------------------


def fake_engine_app(model_name: str = "m:latest"):  # type: ignore[no-untyped-def]
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
            "created": 1, "id": "chatcmpl-x", "model": model_name,
            "object": "chat.completion.chunk",
        }
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat(request):  # type: ignore[no-untyped-def]
        body = json.loads(request.content.read())
        app.requests.append(("/v1/chat/completions", body))  # type: ignore[attr-defined]
        fail = (body.get("chat_template_kwargs") or {}).get("fail")
        if fail:
            request.setResponseCode(fail)
            return json.dumps(
                {"error": {"code": fail, "message": "engine says no", "type": "server_error"}}
            ).encode()
        if body.get("stream"):
            request.setHeader(b"content-type", b"text/event-stream")
            for i, text in enumerate(["Hel", "lo"]):
                request.write(chunk(i, text))
            return b"data: [DONE]\n\n"
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "choices": [{"finish_reason": "stop", "index": 0,
                             "message": {"role": "assistant", "content": "Hello"}}],
                "created": 1, "model": model_name, "object": "chat.completion",
                "usage": {"completion_tokens": 1, "prompt_tokens": 2, "total_tokens": 3},
            },
            separators=(",", ":"),
        ).encode()

    return app


@attrs.define(eq=False)  # as the real Instance: compared and hashed by identity
class FakeInstance:
    """
    Stands in for L{blazar.engines.supervisor.Instance} in surface tests.
    """

    name: str
    base_url: str = "http://engine.invalid"
    api_key: str = "secret"
    in_flight: int = 0
    state: InstanceState = InstanceState.READY
    parallel: int = 1
    alive: bool = True  # its child runs; False: it exited, unreported
    ctx: int = 0  # tokens per slot, as the real one (0: not known, read from the GGUF)

    @property
    def entry(self):  # type: ignore[no-untyped-def]
        from blazar.config import ModelConfig

        return attrs.make_class("Entry", ["name", "settings"])(self.name, ModelConfig(parallel=self.parallel))

    @property
    def auth_headers(self) -> dict[bytes, list[bytes]]:
        return {b"authorization": [b"Bearer " + self.api_key.encode()]}


@attrs.define
class FakeSupervisor:
    """
    Resolves names against a fixed list; every model is always ready.
    """

    names: list[str]
    instances: dict[str, FakeInstance] = attrs.field(factory=dict)
    started: int = 0
    ctx_policy: str = "grow"
    ctx: int = 2048

    async def instance_for(self, name: str, ctx_size: int | None = None) -> FakeInstance:
        from blazar.models.registry import ModelNotFound
        from blazar.names import name_key

        try:
            key = name_key(name)
        except ValueError:
            raise ModelNotFound(name, self.names) from None
        for canonical in self.names:
            if name_key(canonical) == key:
                if canonical not in self.instances:
                    self.started += 1
                    self.instances[canonical] = FakeInstance(canonical)
                return self.instances[canonical]
        raise ModelNotFound(name, self.names)

    touched: list[tuple[str, float | None]] = attrs.field(factory=list)

    async def context_for(self, name: str, ctx_size: int) -> Any:
        """
        As the real one for a model trained for C{ctx} tokens per slot,
        loaded with all of it: C{ctx} whatever C{ctx_size} asks.
        """
        from blazar.engines.supervisor import ContextPlan

        return ContextPlan(self.ctx, ctx_size, self.ctx_policy, name, self.ctx)

    def loaded(self, name: str) -> FakeInstance | None:
        return self.instances.get(name)

    def touch(self, instance: FakeInstance, keep_alive: float | None = None) -> None:
        self.touched.append((instance.name, keep_alive))

    def stop_instance(self, instance: FakeInstance, reason: str = "requested") -> Any:
        from twisted.internet.defer import succeed

        instance.state = InstanceState.STOPPING
        self.instances.pop(instance.name, None)
        return succeed(None)

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
            if self.instances.get(instance.name) is instance:
                del self.instances[instance.name]
        return True

    async def explain_failure(self, instance: FakeInstance, error: BaseException) -> Exception:
        """
        As the real one when the child has exited: the instance is dead and
        leaves the table.
        """
        from blazar.engines.supervisor import EngineCrashed

        instance.state = InstanceState.DEAD
        self.instances.pop(instance.name, None)
        return EngineCrashed(instance.name, f"engine connection failed: {error}")


def forced_tool_call_request(
    model: str, seed: int = 1, stream: bool = False, tool_choice: str = "required"
) -> dict[str, object]:
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
    from blazar.models.testmodel import vocabulary

    ids = {tok: i for i, tok in enumerate(vocabulary()[0])}
    bias = {
        ids["<tool_call>"]: 100, ids["\n"]: 100,
        ids["<0x09>"]: -100, ids["<0x20>"]: -100, ids["<0x0A>"]: -100, ids["▁"]: -100,
    }
    if tool_choice == "required":
        bias[ids["<|im_end|>"]] = 100
    return {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{
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
        }],
        "tool_choice": tool_choice,
        "logit_bias": {str(k): v for k, v in bias.items()},
        "max_tokens": 200,
        "seed": seed,
        "stream": stream,
    }
