"""
Context growth: the context per slot a request asking for C{num_ctx}
tokens runs with (L{ContextPlan}, planned against free memory), and the
restart of a model's child with a larger context that every growing
request shares (L{ContextGrowth}).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import attrs
from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from blazar.config import Config
from blazar.engines.errors import EngineStartFailed, NoCapacity
from blazar.engines.instance import Instance, InstanceState
from blazar.engines.llamacpp import DEFAULT_PARALLEL, context_per_slot
from blazar.engines.waiters import Waiters
from blazar.models.gguf_meta import GGUFMetadata
from blazar.models.registry import ModelEntry

log = Logger()


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
            return (
                f'num_ctx {self.asked} was not applied: ctx_policy = "{self.policy}" keeps the '
                f'loaded {self.ctx}-token context (set ctx_policy = "grow", or raise ctx_size '
                f"under {where})"
            )
        if self.memory_limit is not None:
            free = f" ({self.free / 2**30:.1f} GiB free)" if self.free is not None else ""
            return (
                f"num_ctx {self.asked} does not fit in memory{free}: at most about "
                f"{self.memory_limit} tokens per slot for {self.parallel} slots (lower parallel "
                f"under {where}, unload other models, or use a smaller quantization)"
            )
        return (
            f"num_ctx {self.asked} is above the {self.trained}-token context {self.model!r} "
            f"was trained for, so it gets {self.ctx}"
        )


@attrs.define(eq=False)
class Grow:
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
    _waiters: Waiters[BaseException | None] = attrs.field(factory=Waiters)
    _done: bool = False
    _error: BaseException | None = None

    def wait(self) -> Deferred[BaseException | None]:
        """
        Fires when the grow is over, with its error (or L{None}); never
        fails. Cancelling it stops only this wait.
        """
        if self._done:
            return succeed(self._error)
        return self._waiters.wait()

    def settle(self, error: BaseException | None) -> None:
        self._done, self._error = True, error
        self._waiters.fire(error)


@attrs.define(eq=False)
class ContextGrowth:
    """
    Every model's context growth: what a request asking for more context
    gets (L{plan}) and the one restart per model under way (L{begin},
    L{under_way}). What it needs of the supervisor it is given.

    @ivar _loaded: The live child of a canonical model name, if any.
    @ivar _memory_free: Bytes of memory free now, L{None} if not measured.
    @ivar _stop: Stops a child for a reason; fires once it has exited.
    @ivar _spawn: Waits for (or starts) the spawn of an entry.
    @ivar _shutting_down: Whether Blazar is shutting down.
    """

    _config: Callable[[], Config]
    _reactor: Any
    _metadata: Callable[[ModelEntry], Awaitable[GGUFMetadata]]
    _loaded: Callable[[str], Instance | None]
    _memory_free: Callable[[], Awaitable[int | None]]
    _stop: Callable[[Instance, str], Deferred[Any]]
    _spawn: Callable[[ModelEntry], Deferred[Instance]]
    _shutting_down: Callable[[], bool]
    _grows: dict[str, Grow] = attrs.field(factory=dict)

    def under_way(self, name: str) -> Grow | None:
        """
        The restart of canonical model C{name}'s child under way, if any.
        """
        return self._grows.get(name)

    async def plan(self, entry: ModelEntry, asked: int) -> ContextPlan:
        """
        The context per slot a request for C{entry} asking for C{asked}
        tokens per slot runs with now (L{blazar.engines.supervisor.Supervisor.context_for}).
        """
        meta = await self._metadata(entry)
        parallel = entry.settings.parallel or DEFAULT_PARALLEL
        loaded = self._loaded(entry.name)
        current = loaded.ctx if loaded is not None and loaded.ctx else context_per_slot(entry, meta)
        policy = self._config().ctx_policy
        trained = meta.context_length
        plan = ContextPlan(current, asked, policy, entry.name, trained, parallel=parallel)
        wanted = min(asked, trained) if trained else asked
        if policy != "grow" or wanted <= current:
            return plan
        free = await self._memory_free()
        per_token = kv_bytes_per_token(meta) * parallel
        if free is not None and per_token:
            freed = per_token * loaded.ctx if loaded is not None else 0
            fits = (free + freed - meta.size) // per_token
            fits = fits // 1024 * 1024 if fits >= 1024 else max(fits, 0) // 256 * 256
            if fits < wanted:
                return attrs.evolve(plan, ctx=max(current, fits), memory_limit=fits, free=free)
        return attrs.evolve(plan, ctx=wanted, free=free)

    def begin(self, entry: ModelEntry, old: Instance, target: int, why: str = "grow") -> Grow:
        """
        Start replacing C{old} by a child with C{target} tokens per slot
        (C{why}: C{"grow"}, or C{"reload"} for another placement).
        """
        grow = self._grows[entry.name] = Grow(target, why=why)

        def done(result: Any) -> None:
            if self._grows.get(entry.name) is grow:
                del self._grows[entry.name]
            error = result.value if isinstance(result, Failure) else None
            if error is not None:
                log.error("growing the context of {model} failed: {error}", model=entry.name, error=str(error))
            grow.settle(error)

        ensureDeferred(self._grow(entry, old, grow)).addBoth(done)
        return grow

    async def _grow(self, entry: ModelEntry, old: Instance, grow: Grow) -> None:
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
        deadline = self._reactor.seconds() + self._config().drain_timeout
        while old.in_flight and old.state == InstanceState.READY:
            if self._reactor.seconds() >= deadline and grow.why == "reload":
                raise NoCapacity(
                    entry.name,
                    (
                        f"cannot reload {entry.name!r} with the placement asked for (num_gpu, main_gpu, num_thread, "
                        f"use_mmap): {old.in_flight} requests still running on it after drain_timeout_secs = "
                        f"{self._config().drain_timeout:g}; send the request again later, or set the model's profile "
                        f'under [models."{entry.name}"] (gpu_layers, main_gpu, threads, use_mmap) and leave the '
                        "options out"
                    ),
                )
            if self._reactor.seconds() >= deadline:
                raise NoCapacity(
                    entry.name,
                    (
                        f"cannot grow the context of {entry.name!r} from {old.ctx} to {grow.target} "
                        f"tokens per slot: {old.in_flight} requests still running on it after "
                        f"drain_timeout_secs = {self._config().drain_timeout:g}; send the request again "
                        f'later, or set ctx_size = {grow.target} under [models."{entry.name}"] so it '
                        f"starts that large"
                    ),
                )
            await deferLater(self._reactor, 0.1, lambda: None)
        grow.spawning = True
        if old.state == InstanceState.STOPPING:
            await old.protocol.when_ended()  # someone else stopped it: no second SIGTERM
        elif old.state != InstanceState.DEAD:
            why = (
                "reload with another launch profile (placement asked for, or speculative auto)"
                if grow.why == "reload" and grow.target == old.ctx
                else f"context {old.ctx} -> {grow.target} tokens per slot (num_ctx)"
            )
            await self._stop(old, why)
        if self._shutting_down():
            raise EngineStartFailed(entry.name, f"Blazar is shutting down; {entry.name!r} was not restarted")
        grown = attrs.evolve(entry, settings=attrs.evolve(entry.settings, ctx_size=grow.target))
        await self._spawn(grown)


def estimate_bytes(entry: ModelEntry, meta: GGUFMetadata) -> int:
    """
    Bytes a child for C{entry} needs: the weights (file size) plus the
    f16 KV cache for every slot,
    2 x n_layer x n_ctx x n_head_kv x head_dim x 2 bytes.
    """
    parallel = entry.settings.parallel or DEFAULT_PARALLEL
    n_ctx = context_per_slot(entry, meta) * parallel
    return meta.size + kv_bytes_per_token(meta) * n_ctx


def kv_bytes_per_token(meta: GGUFMetadata) -> int:
    """
    Bytes of f16 KV cache one token of context takes:
    2 (K and V) x n_layer x n_head_kv x head_dim x 2 bytes.
    """
    n_layer = meta.block_count or 0
    head_count = meta.head_count or 1
    head_dim = (meta.embedding_length or 0) // head_count
    n_head_kv = meta.head_count_kv or head_count
    return 2 * n_layer * n_head_kv * head_dim * 2
