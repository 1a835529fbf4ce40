"""
What NVML says on a real GPU machine, as JSON: the numbers a hardware
probe reads (issue 38 plans GPU placement against them; a fake NVML must
answer as this does). Run where a GPU is, with nvidia-ml-py installed:

    python3 scripts/nvml_snapshot.py > nvml.json

For each device: name, UUID, PCI bus id, memory (v1 and v2: total, free,
used, reserved), compute capability, temperature, utilisation, power,
clocks, MIG mode, the compute processes and their memory. With
C{--allocate GIB} (needs PyTorch), the same memory readings again while
this process holds that many GiB on device 0, and after it lets go: what
NVML counts for a CUDA context and an allocation, seen from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable


def _try(f: Callable[[], Any]) -> Any:
    """
    C{f()}, or the NVML error's name: some queries are not supported on
    some devices and drivers, and which ones is itself a fact to record.
    """
    try:
        value = f()
    except Exception as e:  # pynvml.NVMLError_*: the name says which
        return {"error": type(e).__name__, "message": str(e)}
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _memory(pynvml: Any, handle: Any) -> dict[str, Any]:
    v1 = _try(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    v2 = _try(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2))
    out: dict[str, Any] = {}
    for label, info in (("v1", v1), ("v2", v2)):
        if isinstance(info, dict):
            out[label] = info
        else:
            out[label] = {k: getattr(info, k) for k in ("total", "free", "used", "reserved") if hasattr(info, k)}
    return out


def _processes(pynvml: Any, handle: Any) -> Any:
    found = _try(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    if isinstance(found, dict):
        return found
    return [{"pid": p.pid, "usedGpuMemory": p.usedGpuMemory} for p in found]


def snapshot(pynvml: Any) -> dict[str, Any]:
    """
    Every device's readings, and the driver's.
    """
    count = pynvml.nvmlDeviceGetCount()
    devices = []
    for i in range(count):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        util = _try(lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
        devices.append(
            {
                "index": i,
                "name": _try(lambda: pynvml.nvmlDeviceGetName(h)),
                "uuid": _try(lambda: pynvml.nvmlDeviceGetUUID(h)),
                "pci_bus_id": _try(lambda: pynvml.nvmlDeviceGetPciInfo(h).busId),
                "memory": _memory(pynvml, h),
                "bar1_memory": _try(
                    lambda: {
                        k: getattr(pynvml.nvmlDeviceGetBAR1MemoryInfo(h), k)
                        for k in ("bar1Total", "bar1Free", "bar1Used")
                    }
                ),
                "compute_capability": _try(lambda: list(pynvml.nvmlDeviceGetCudaComputeCapability(h))),
                "temperature_c": _try(lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                "utilization": util if isinstance(util, dict) else {"gpu": util.gpu, "memory": util.memory},
                "power_mw": _try(lambda: pynvml.nvmlDeviceGetPowerUsage(h)),
                "power_limit_mw": _try(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h)),
                "clocks_mhz": {
                    name: _try(lambda c=clock: pynvml.nvmlDeviceGetClockInfo(h, c))
                    for name, clock in (("sm", pynvml.NVML_CLOCK_SM), ("mem", pynvml.NVML_CLOCK_MEM))
                },
                "max_clocks_mhz": {
                    name: _try(lambda c=clock: pynvml.nvmlDeviceGetMaxClockInfo(h, c))
                    for name, clock in (("sm", pynvml.NVML_CLOCK_SM), ("mem", pynvml.NVML_CLOCK_MEM))
                },
                "mig_mode": _try(lambda: list(pynvml.nvmlDeviceGetMigMode(h))),
                "persistence_mode": _try(lambda: pynvml.nvmlDeviceGetPersistenceMode(h)),
                "compute_mode": _try(lambda: pynvml.nvmlDeviceGetComputeMode(h)),
                "processes": _processes(pynvml, h),
            }
        )
    return {
        "driver_version": _try(pynvml.nvmlSystemGetDriverVersion),
        "nvml_version": _try(pynvml.nvmlSystemGetNVMLVersion),
        "cuda_driver_version": _try(pynvml.nvmlSystemGetCudaDriverVersion),
        "device_count": count,
        "devices": devices,
    }


def allocation(pynvml: Any, gib: float) -> dict[str, Any]:
    """
    Device 0's memory as NVML counts it: before, with a CUDA context only,
    while C{gib} GiB are held, and after they are freed.
    """
    import torch

    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    steps: dict[str, Any] = {"before": _memory(pynvml, h)}
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context
    torch.cuda.synchronize()
    steps["context_only"] = {"memory": _memory(pynvml, h), "processes": _processes(pynvml, h)}
    held = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    steps["holding"] = {
        "gib": gib,
        "memory": _memory(pynvml, h),
        "processes": _processes(pynvml, h),
        "torch_reserved": torch.cuda.memory_reserved(),
    }
    del held
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    time.sleep(0.5)
    steps["freed"] = {"memory": _memory(pynvml, h), "processes": _processes(pynvml, h)}
    steps["pid"] = os.getpid()
    return steps


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocate", type=float, default=0.0, help="GiB to hold on device 0 (needs PyTorch)")
    args = parser.parse_args(argv)
    import pynvml

    pynvml.nvmlInit()
    try:
        out: dict[str, Any] = {
            "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "nvidia_ml_py": getattr(pynvml, "__version__", None),
            "snapshot": snapshot(pynvml),
        }
        if args.allocate > 0:
            out["allocation"] = allocation(pynvml, args.allocate)
    finally:
        pynvml.nvmlShutdown()
    json.dump(out, sys.stdout, indent=1, allow_nan=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
