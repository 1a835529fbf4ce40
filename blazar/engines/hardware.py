"""
The hardware probe: what this machine has for engines to run on — NVIDIA
GPUs as NVML reports them, CPU cores and RAM — as one frozen L{Census}.

Two parts:

  - L{IHardwareProbe}, whose C{thd_*} methods block (NVML and C{psutil}
    calls) and so run in a thread pool; L{NVMLProbe} is the real one,
    L{blazar.testing.FakeNVML} the fake (both pass
    C{tests/engines/test_hardware_contract.py}).
  - L{HardwareCensus}, a service that keeps the latest census: refreshed
    every L{INTERVAL} seconds by a L{LoopingCall} on an injected clock, and
    at once after L{HardwareCensus.invalidate} (for the supervisor to call
    on every spawn and evict, so that the planner's next reading,
    L{HardwareCensus.fresh}, sees the VRAM a child took or gave back). It
    also serves the
    C{blazar_gpu_memory_bytes} gauges.

No GPU is a normal answer: a machine without the NVIDIA driver, without
C{libnvidia-ml.so}, or where NVML fails to start has zero GPUs in its
census, and L{Census.gpu_note} says why. The probe never raises for that.

Memory figures follow NVML's C{nvmlDeviceGetMemoryInfo} (NVML API
reference, "Device Queries"): the v2 structure (driver R510+) where the
driver has it, else v1. The two agree on C{total} and C{free}; they differ
on C{used}: v1's C{used} counts the memory the driver reserves for itself
(firmware, ECC, page tables: 616 MiB on an idle H200), while v2 reports
that as C{reserved} and keeps C{used} for what contexts allocated (0 on an
idle GPU; C{nvidia-smi -q} shows both lines, "Reserved" and "Used"). Blazar's
L{GPU.memory_used} is C{total - free}, i.e. v1's C{used} (= v2's C{used +
reserved}), so that C{used + free == total} on every driver and in every
gauge; L{GPU.memory_reserved} keeps the v2 figure (0 where only v1 is
known). The planner should plan against L{GPU.memory_free}, which
both versions report the same way.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

import attrs
from prometheus_client.core import Metric
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Attribute, Interface, implementer

from blazar.metrics import Metrics, gauge

log = Logger()

# seconds between two readings when nothing invalidates the census
INTERVAL = 10.0


@attrs.frozen
class GPU:
    """
    One NVIDIA GPU, as NVML saw it at L{Census.taken_at}.

    @ivar index: NVML's device index (0-based, in PCI bus order, the order
        C{CUDA_VISIBLE_DEVICES} uses unless C{CUDA_DEVICE_ORDER} changes it).
    @ivar uuid: C{GPU-xxxxxxxx-...}: stable across reboots and re-orders.
    @ivar name: The marketing name, e.g. C{NVIDIA H200}.
    @ivar memory_total: Bytes of device memory.
    @ivar memory_free: Bytes free now (what a new child can take).
    @ivar memory_used: Bytes not free: C{total - free}, the driver's own
        reserve included (see the module docstring).
    @ivar memory_reserved: Bytes the driver reserves for itself (NVML's
        memory v2 C{reserved}; 0 where the driver has only v1).
    @ivar compute_capability: C{(major, minor)}, e.g. C{(9, 0)} for Hopper;
        L{None} when NVML cannot say.
    @ivar driver_version: The kernel driver's version, e.g. C{"580.159.04"}.
    @ivar cuda_driver_version: The newest CUDA runtime the driver supports,
        C{(major, minor)}, e.g. C{(13, 0)}; L{None} when unknown.
    @ivar temperature_c: Core temperature in degrees Celsius, or L{None}.
    @ivar utilization_percent: Percent of the last sample period in which
        a kernel ran, or L{None}.
    @ivar processes: The compute processes on this GPU: C{(pid, bytes)}
        pairs, by pid. PIDs are as the driver sees them (the host's PID
        namespace: inside a container they need not match the
        container's). A process whose usage NVML cannot read (some
        containers, missing permission) is left out.
    """

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_free: int
    memory_used: int
    memory_reserved: int = 0
    compute_capability: tuple[int, int] | None = None
    driver_version: str | None = None
    cuda_driver_version: tuple[int, int] | None = None
    temperature_c: int | None = None
    utilization_percent: int | None = None
    processes: tuple[tuple[int, int], ...] = ()

    def process_memory(self, pid: int) -> int:
        """
        Bytes C{pid} holds on this GPU (0 if it holds none).
        """
        return sum(used for p, used in self.processes if p == pid)


@attrs.frozen
class Census:
    """
    What the machine has, read at one moment.

    @ivar gpus: Every GPU NVML sees, by index; empty without one.
    @ivar cpu_physical_cores: Physical cores (the default thread count for
        an engine); the logical count where the OS cannot tell.
    @ivar cpu_logical_cores: Hardware threads.
    @ivar ram_total: Bytes of RAM.
    @ivar ram_available: Bytes of RAM a new process could take without
        swapping (C{psutil.virtual_memory().available}).
    @ivar taken_at: When, in seconds since the epoch.
    @ivar gpu_note: Why there are no GPUs, or which could not be read
        (NVML's error, e.g. C{"NVML Shared Library Not Found"}); C{""} when
        NVML answered in full.
    """

    gpus: tuple[GPU, ...]
    cpu_physical_cores: int
    cpu_logical_cores: int
    ram_total: int
    ram_available: int
    taken_at: float
    gpu_note: str = ""

    @property
    def gpu_memory_free(self) -> int:
        """
        Free bytes over every GPU.
        """
        return sum(g.memory_free for g in self.gpus)

    def process_gpu_memory(self, pid: int) -> dict[int, int]:
        """
        GPU index to bytes that C{pid} holds there; C{{}} for a process
        that holds no GPU memory.
        """
        return {g.index: used for g in self.gpus if (used := g.process_memory(pid))}


class IHardwareProbe(Interface):
    """
    Reads the machine. Every method blocks: call it in a thread pool, never
    on the reactor thread. No method raises because a GPU, the driver or
    NVML is missing: that machine has zero GPUs.
    """

    def thd_census() -> Census:
        """
        Read everything now.
        """

    def thd_process_gpu_memory(pid: int) -> dict[int, int]:
        """
        GPU index to bytes the process C{pid} holds there now (what a
        child really uses, for the planner to compare with its estimate);
        C{{}} when it holds none or there is no GPU.
        """


def cuda_version(encoded: int) -> tuple[int, int]:
    """
    NVML's encoded CUDA version (C{1000 * major + 10 * minor}: C{13000}) as
    C{(13, 0)}.
    """
    return encoded // 1000, (encoded % 1000) // 10


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def thd_host() -> dict[str, int]:
    """
    CPU cores and RAM, from C{psutil}: the keys of L{Census} other than the
    GPUs.
    """
    import psutil

    logical = psutil.cpu_count(logical=True) or 1
    memory = psutil.virtual_memory()
    return {
        "cpu_physical_cores": psutil.cpu_count(logical=False) or logical,
        "cpu_logical_cores": logical,
        "ram_total": int(memory.total),
        "ram_available": int(memory.available),
    }


@implementer(IHardwareProbe)
class NVMLProbe:
    """
    The real probe: NVML through C{pynvml} (the C{nvidia-ml-py} package),
    CPU and RAM through C{psutil}.

    NVML is started once, on first use, and kept (starting it can take
    seconds per GPU on a driver without persistence mode); a failed start
    is tried again at the next reading, so a driver loaded later is found.
    L{thd_close} shuts it down. Safe to call from several threads at once.

    @param nvml: The C{pynvml} module, or a stand-in with the same
        functions (tests replay recorded answers through it); L{None}
        imports C{pynvml}.
    @param now: Wall-clock seconds, for L{Census.taken_at}.
    @param host: Reads CPU and RAM (L{thd_host}).
    """

    def __init__(
        self,
        nvml: Any = None,
        now: Callable[[], float] = time.time,
        host: Callable[[], dict[str, int]] = thd_host,
    ) -> None:
        self._nvml = nvml
        self._now = now
        self._host = host
        self._lock = threading.Lock()
        self._started = False

    def _start(self) -> tuple[Any, str]:
        """
        The NVML module once NVML is started, or L{None} and why not.
        """
        with self._lock:
            if self._started:
                return self._nvml, ""
            try:
                if self._nvml is None:
                    import pynvml

                    self._nvml = pynvml
                self._nvml.nvmlInit()
            except Exception as e:  # ImportError, pynvml.NVMLError_*: no GPU to speak of
                return None, f"NVML unavailable: {_text(e) or type(e).__name__}"
            self._started = True
            return self._nvml, ""

    def thd_close(self) -> None:
        """
        Shut NVML down if this probe started it.
        """
        with self._lock:
            if self._started:
                self._started = False
                try:
                    self._nvml.nvmlShutdown()
                except Exception:
                    pass

    def thd_census(self) -> Census:
        gpus, note = self._gpus()
        return Census(gpus=gpus, taken_at=self._now(), gpu_note=note, **self._host())

    def thd_process_gpu_memory(self, pid: int) -> dict[int, int]:
        nvml, _ = self._start()
        if nvml is None:
            return {}
        found: dict[int, int] = {}
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception:
            return {}
        for index in range(count):
            try:
                used = dict(_processes(nvml, nvml.nvmlDeviceGetHandleByIndex(index))).get(pid)
            except Exception:
                continue
            if used:
                found[index] = used
        return found

    def _gpus(self) -> tuple[tuple[GPU, ...], str]:
        nvml, note = self._start()
        if nvml is None:
            return (), note
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as e:
            return (), f"NVML cannot count GPUs: {_text(e) or type(e).__name__}"
        if count == 0:
            return (), "NVML sees no GPU"
        driver = _optional(lambda: _text(nvml.nvmlSystemGetDriverVersion()))
        cuda = _optional(lambda: cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion())))
        gpus, problems = [], []
        for index in range(count):
            try:
                gpus.append(_gpu(nvml, index, driver, cuda))
            except Exception as e:  # a lost or inaccessible GPU: the others still count
                problems.append(f"GPU {index} unreadable: {_text(e) or type(e).__name__}")
        return tuple(gpus), "; ".join(problems)


def _optional(read: Callable[[], Any]) -> Any:
    """
    C{read()}, or L{None} where NVML does not support it on this device or
    driver (C{NVMLError_NotSupported} and kin).
    """
    try:
        return read()
    except Exception:
        return None


def _memory(nvml: Any, handle: Any) -> tuple[int, int, int]:
    """
    C{(total, free, reserved)} bytes: memory v2 where the driver has it,
    else v1 (reserved 0).
    """
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
            return int(info.total), int(info.free), int(info.reserved)
        except Exception:
            pass  # an older driver: NVMLError_FunctionNotFound / ArgumentVersionMismatch
    info = nvml.nvmlDeviceGetMemoryInfo(handle)
    return int(info.total), int(info.free), 0


def _processes(nvml: Any, handle: Any) -> tuple[tuple[int, int], ...]:
    """
    C{(pid, bytes)} of each compute process on a GPU, by pid; a process
    whose C{usedGpuMemory} NVML cannot give (L{None}) is left out.
    """
    found: dict[int, int] = {}
    for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.usedGpuMemory is not None:
            found[int(p.pid)] = found.get(int(p.pid), 0) + int(p.usedGpuMemory)
    return tuple(sorted(found.items()))


def _gpu(nvml: Any, index: int, driver: str | None, cuda: tuple[int, int] | None) -> GPU:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    total, free, reserved = _memory(nvml, handle)
    capability = _optional(lambda: tuple(int(n) for n in nvml.nvmlDeviceGetCudaComputeCapability(handle)))
    return GPU(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        memory_total=total,
        memory_free=free,
        memory_used=total - free,
        memory_reserved=reserved,
        compute_capability=capability,
        driver_version=driver,
        cuda_driver_version=cuda,
        temperature_c=_optional(lambda: int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))),
        utilization_percent=_optional(lambda: int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)),
        processes=_optional(lambda: _processes(nvml, handle)) or (),
    )


class IHardwareCensus(Interface):
    """
    The latest census of the GPUs, CPU and RAM, kept fresh.
    """

    latest = Attribute("The newest L{Census}, or L{None} before the first reading.")

    def fresh() -> Deferred[Census]:
        """
        The census, read after the last invalidation.
        """


@implementer(IHardwareCensus)
class HardwareCensus(Service):
    """
    The latest L{Census}, kept fresh: read by C{probe} in the reactor's
    thread pool every C{interval} seconds (a L{LoopingCall} on C{reactor},
    which may be a L{twisted.internet.task.Clock} with a thread pool), and
    again at once after L{invalidate}. One reading at a time: a call that
    comes while one runs is served by the next.

    @ivar latest: The newest census, or L{None} before the first reading.
    @param reactor: Gives the clock (C{callLater}) and C{getThreadPool()}.
    @param metrics: Where to serve C{blazar_gpu_memory_bytes}; L{None}
        for none.
    """

    def __init__(
        self,
        probe: IHardwareProbe,
        reactor: Any,
        metrics: Metrics | None = None,
        interval: float = INTERVAL,
    ) -> None:
        self._probe = probe
        self._reactor = reactor
        self._interval = interval
        self.latest: Census | None = None
        self._job: LoopingCall | None = None
        # invalidations so far, and how many the latest census postdates
        self._generation = 0
        self._fresh_generation = -1
        self._reading: Deferred[None] | None = None
        self._again = False
        self._waiters: list[Deferred[Census]] = []
        if metrics is not None:
            metrics.gauges(self.collect_metrics)

    def startService(self) -> None:
        Service.startService(self)
        self._job = LoopingCall(self._tick)
        self._job.clock = self._reactor
        self._job.start(self._interval, now=True).addErrback(lambda f: log.failure("hardware census job stopped", f))

    def stopService(self) -> None:
        Service.stopService(self)
        if self._job is not None and self._job.running:
            self._job.stop()
        # (a reading in its thread ends by itself; its waiters still get it)

    def _tick(self) -> None:
        try:
            self.refresh()
        except Exception:
            log.failure("hardware census: could not start a reading")

    @property
    def stale(self) -> bool:
        """
        Whether L{invalidate} was called after the latest reading began
        (or there is none yet).
        """
        return self._fresh_generation != self._generation

    def invalidate(self) -> None:
        """
        The census no longer describes the machine (a child was spawned or
        stopped): read it again now. L{fresh} waits for that reading.
        """
        self._generation += 1
        self.refresh()

    def refresh(self) -> None:
        """
        Start a reading, unless one runs (then another follows it).
        """
        if self._reading is not None:
            self._again = True
            return
        generation = self._generation
        d: Deferred[Census] = deferToThreadPool(self._reactor, self._reactor.getThreadPool(), self._probe.thd_census)
        self._reading = d.addCallbacks(self._read, self._failed, callbackArgs=(generation,))
        self._reading.addBoth(self._done)

    def _read(self, census: Census, generation: int) -> None:
        self.latest = census
        self._fresh_generation = generation

    def _failed(self, failure: Failure) -> None:
        log.failure("hardware census: the probe failed; keeping the last census", failure)

    def _done(self, _: object) -> None:
        self._reading = None
        if self._again:  # asked for (or invalidated) while this reading ran
            self._again = False
            self.refresh()
            return  # that reading's end serves the waiters
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if self.latest is not None:
                waiter.callback(self.latest)
            else:
                waiter.errback(RuntimeError("the hardware probe has not answered yet"))

    def fresh(self) -> Deferred[Census]:
        """
        The census, read after the last L{invalidate}: at once if the
        latest one is, else when the reading under way ends. If that
        reading fails, the last census there is (stale), or a
        C{RuntimeError} if there was never one.
        """
        if self.latest is not None and not self.stale:
            return succeed(self.latest)
        d: Deferred[Census] = Deferred()
        self._waiters.append(d)
        if self._reading is None:
            self.refresh()
        return d

    def collect_metrics(self) -> Iterable[Metric]:
        """
        Scrape-time gauge C{blazar_gpu_memory_bytes{gpu,kind}}: C{gpu} is
        the NVML index (as C{CUDA_VISIBLE_DEVICES} and llama-server's
        C{--device CUDAn} count), C{kind} is C{total}, C{used} (C{total -
        free}, the driver's reserve included) or C{free}. No rows without
        a GPU or before the first reading.
        """
        gpus = self.latest.gpus if self.latest is not None else ()
        yield gauge(
            "blazar_gpu_memory_bytes",
            "GPU memory in bytes by NVML device index: total, used (total - free, "
            "the driver's reserve included) and free, as last read",
            ["gpu", "kind"],
            [
                ([str(g.index), kind], float(value))
                for g in gpus
                for kind, value in (("total", g.memory_total), ("used", g.memory_used), ("free", g.memory_free))
            ],
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def describe(census: Census) -> list[str]:
    """
    The census as lines for people (C{blazar doctor}): CPU and RAM, then
    one line per GPU (name, memory total and free, driver and CUDA
    version, compute capability), or why there is none.
    """
    lines = [
        f"CPU: {census.cpu_physical_cores} physical cores, {census.cpu_logical_cores} logical; "
        f"RAM: {_gib(census.ram_total)} total, {_gib(census.ram_available)} available"
    ]
    if not census.gpus:
        lines.append(f"GPUs: none, CPU only ({census.gpu_note or 'NVML sees no GPU'})")
    for g in census.gpus:
        versions = ", ".join(
            part
            for part in (
                f"driver {g.driver_version}" if g.driver_version else "",
                "CUDA {}.{}".format(*g.cuda_driver_version) if g.cuda_driver_version else "",
                "compute {}.{}".format(*g.compute_capability) if g.compute_capability else "",
            )
            if part
        )
        lines.append(
            f"GPU {g.index}: {g.name}, {_gib(g.memory_total)} total, {_gib(g.memory_free)} free"
            + (f" ({versions})" if versions else "")
        )
    if census.gpus and census.gpu_note:
        lines.append(f"GPUs: {census.gpu_note}")
    return lines
