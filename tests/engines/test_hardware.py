"""
The hardware probe's reading code (L{NVMLProbe} on recorded NVML
answers), the fake's knobs (L{FakeNVML}), the census service
(L{HardwareCensus}: its job, L{HardwareCensus.invalidate},
L{HardwareCensus.fresh}), its gauges and what doctor prints. The
behaviour every probe shares is in test_hardware_contract.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

from prometheus_client.parser import text_string_to_metric_families
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from blazar.engines.hardware import (
    Census,
    HardwareCensus,
    IHardwareProbe,
    NVMLProbe,
    cuda_version,
    describe,
)
from blazar.metrics import Metrics
from blazar.testing import GIB, FakeNVML, RecordedNVML, fake_process_reactor

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nvml"
H200 = json.loads((FIXTURES / "h200.json").read_text())


def h200_holding() -> dict[str, Any]:
    """
    The H200 recording as it was while pid 428 held 8 GiB (the recording's
    C{allocation.holding} step).
    """
    recorded = copy.deepcopy(H200)
    holding = recorded["allocation"]["holding"]
    device = recorded["snapshot"]["devices"][0]
    device["memory"], device["processes"] = holding["memory"], holding["processes"]
    return recorded


class NVMLProbeTests(SynchronousTestCase):
    def test_memory_v2_reserved_is_kept_apart(self) -> None:
        (gpu,) = NVMLProbe(RecordedNVML(H200)).thd_census().gpus
        self.assertEqual(gpu.memory_reserved, 644939776)
        # used is v1's: total - free, the reserve included (v2 says 0)
        self.assertEqual(gpu.memory_used, 644939776)

    def test_memory_v1_on_an_older_driver(self) -> None:
        (gpu,) = NVMLProbe(RecordedNVML(H200, v2=False)).thd_census().gpus
        self.assertEqual((gpu.memory_total, gpu.memory_free), (150754820096, 150109880320))
        self.assertEqual((gpu.memory_used, gpu.memory_reserved), (644939776, 0))

    def test_a_child_holding_memory(self) -> None:
        probe = NVMLProbe(RecordedNVML(h200_holding()))
        (gpu,) = probe.thd_census().gpus
        self.assertEqual(gpu.processes, ((428, 9231663104),))
        self.assertEqual(gpu.memory_used, 9885843456)  # v1 "used" in the recording
        self.assertEqual(gpu.memory_free, 140868976640)
        self.assertEqual(probe.thd_process_gpu_memory(428), {0: 9231663104})
        self.assertEqual(probe.thd_process_gpu_memory(429), {})

    def test_no_driver_is_zero_gpus(self) -> None:
        nvml = RecordedNVML(H200, init_error=OSError("NVML Shared Library Not Found"))
        probe = NVMLProbe(nvml)
        census = probe.thd_census()
        self.assertEqual(census.gpus, ())
        self.assertEqual(census.gpu_note, "NVML unavailable: NVML Shared Library Not Found")
        self.assertEqual(probe.thd_process_gpu_memory(428), {})
        self.assertGreaterEqual(census.cpu_physical_cores, 1)

    def test_a_driver_loaded_later_is_found(self) -> None:
        nvml = RecordedNVML(H200, init_error=OSError("Driver Not Loaded"))
        probe = NVMLProbe(nvml)
        self.assertEqual(probe.thd_census().gpus, ())
        nvml._init_error = None
        self.assertEqual(len(probe.thd_census().gpus), 1)

    def test_nvml_started_once_and_closed(self) -> None:
        nvml = RecordedNVML(H200)
        probe = NVMLProbe(nvml)
        for _ in range(3):
            probe.thd_census()
        probe.thd_process_gpu_memory(1)
        self.assertEqual(nvml.initialised, 1)
        probe.thd_close()
        self.assertEqual(nvml.initialised, 0)
        probe.thd_close()
        self.assertEqual(nvml.initialised, 0)

    def test_unsupported_readings_are_none(self) -> None:
        recorded = copy.deepcopy(H200)
        device = recorded["snapshot"]["devices"][0]
        for key in ("temperature_c", "compute_capability", "utilization", "processes"):
            device[key] = {"error": "NVMLError_NotSupported", "message": "Not Supported"}
        recorded["snapshot"]["cuda_driver_version"] = {"error": "NVMLError_NotSupported", "message": "x"}
        (gpu,) = NVMLProbe(RecordedNVML(recorded)).thd_census().gpus
        self.assertEqual(
            (
                gpu.temperature_c,
                gpu.compute_capability,
                gpu.utilization_percent,
                gpu.processes,
                gpu.cuda_driver_version,
            ),
            (None, None, None, (), None),
        )
        self.assertEqual(gpu.memory_free, 150109880320)
        # the fake reads the same recording the same way
        self.assertEqual(FakeNVML.from_snapshot(recorded).thd_census().gpus, (gpu,))

    def test_an_unreadable_gpu_does_not_hide_the_others(self) -> None:
        recorded = copy.deepcopy(H200)
        lost = copy.deepcopy(recorded["snapshot"]["devices"][0])
        lost["index"], lost["uuid"] = 1, "GPU-lost"
        lost["memory"] = {
            "v1": {"error": "NVMLError_GpuIsLost", "message": "GPU is lost"},
            "v2": {"error": "NVMLError_GpuIsLost", "message": "GPU is lost"},
        }
        recorded["snapshot"]["devices"].append(lost)
        census = NVMLProbe(RecordedNVML(recorded)).thd_census()
        self.assertEqual([g.index for g in census.gpus], [0])
        self.assertEqual(census.gpu_note, "GPU 1 unreadable: GPU is lost")

    def test_unknown_process_memory_is_left_out(self) -> None:
        recorded = h200_holding()
        recorded["snapshot"]["devices"][0]["processes"].append({"pid": 77, "usedGpuMemory": None})
        (gpu,) = NVMLProbe(RecordedNVML(recorded)).thd_census().gpus
        self.assertEqual([pid for pid, _ in gpu.processes], [428])

    def test_zero_gpus_with_a_driver(self) -> None:
        recorded = copy.deepcopy(H200)
        recorded["snapshot"]["devices"] = []
        census = NVMLProbe(RecordedNVML(recorded)).thd_census()
        self.assertEqual((census.gpus, census.gpu_note), ((), "NVML sees no GPU"))

    def test_cuda_version(self) -> None:
        self.assertEqual(cuda_version(13000), (13, 0))
        self.assertEqual(cuda_version(12040), (12, 4))

    def test_taken_at_from_the_clock(self) -> None:
        self.assertEqual(NVMLProbe(RecordedNVML(H200), now=lambda: 1234.5).thd_census().taken_at, 1234.5)


class FakeNVMLTests(SynchronousTestCase):
    def test_a_child_takes_and_gives_back_vram(self) -> None:
        fake = FakeNVML.with_gpus(24 * GIB, 24 * GIB)
        fake.set_process_memory(1000, 0, 6 * GIB)
        census = fake.thd_census()
        self.assertEqual([g.memory_free for g in census.gpus], [18 * GIB, 24 * GIB])
        self.assertEqual(fake.thd_process_gpu_memory(1000), {0: 6 * GIB})
        fake.set_process_memory(1000, 0, 0)
        self.assertEqual(fake.thd_census().gpus[0].memory_free, 24 * GIB)
        self.assertEqual(fake.thd_process_gpu_memory(1000), {})

    def test_set_free_then_a_child(self) -> None:
        fake = FakeNVML.with_gpus(24 * GIB)
        fake.set_free(0, 10 * GIB)
        self.assertEqual(fake.thd_census().gpus[0].memory_free, 10 * GIB)
        fake.set_process_memory(5, 0, 4 * GIB)
        gpu = fake.thd_census().gpus[0]
        self.assertEqual((gpu.memory_free, gpu.memory_used), (6 * GIB, 18 * GIB))

    def test_the_recorded_child(self) -> None:
        self.assertEqual(
            FakeNVML.from_snapshot(h200_holding()).thd_census().gpus,
            NVMLProbe(RecordedNVML(h200_holding())).thd_census().gpus,
        )

    def test_counts_readings(self) -> None:
        fake = FakeNVML()
        fake.thd_census()
        fake.thd_census()
        self.assertEqual(fake.readings, 2)


class HeldThreadPool:
    """
    A thread pool whose work runs only when the test says (L{finish}), so a
    reading can be under way.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[Callable[[bool, Any], None], Callable[[], Any]]] = []

    def callInThreadWithCallback(self, on_result, func, *args, **kw):
        self.pending.append((on_result, lambda: func(*args, **kw)))

    def finish(self) -> None:
        on_result, work = self.pending.pop(0)
        try:
            result = work()
        except Exception:
            on_result(False, Failure())
        else:
            on_result(True, result)


@implementer(IHardwareProbe)
class BrokenOnce:
    """
    A probe whose next reading raises (a bug, since probes answer "no GPU"
    rather than raise): the census job must survive it.
    """

    def __init__(self, probe: FakeNVML) -> None:
        self.probe = probe
        self.break_next = False

    def thd_census(self) -> Census:
        if self.break_next:
            self.break_next = False
            raise ZeroDivisionError("a bug")
        return self.probe.thd_census()

    def thd_process_gpu_memory(self, pid: int) -> dict[int, int]:
        return self.probe.thd_process_gpu_memory(pid)


class HardwareCensusTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = fake_process_reactor()
        self.fake = FakeNVML.with_gpus(24 * GIB, 24 * GIB, now=self.reactor.seconds)
        self.metrics = Metrics()
        self.census = HardwareCensus(self.fake, self.reactor, self.metrics, interval=10.0)

    def start(self) -> None:
        self.census.startService()
        self.addCleanup(self.census.stopService)

    def test_read_at_start_and_every_interval(self) -> None:
        self.assertIsNone(self.census.latest)
        self.start()
        self.assertEqual(self.fake.readings, 1)
        assert self.census.latest is not None
        self.assertEqual(len(self.census.latest.gpus), 2)
        self.reactor.advance(9.9)
        self.assertEqual(self.fake.readings, 1)
        self.reactor.advance(0.1)
        self.assertEqual(self.fake.readings, 2)
        self.assertEqual(self.census.latest.taken_at, 10.0)

    def test_stop_stops_the_job(self) -> None:
        self.census.startService()
        self.census.stopService()
        self.reactor.advance(60)
        self.assertEqual(self.fake.readings, 1)

    def test_invalidate_reads_at_once(self) -> None:
        self.start()
        self.fake.set_process_memory(1000, 1, 20 * GIB)
        assert self.census.latest is not None
        self.assertEqual(self.census.latest.gpus[1].memory_free, 24 * GIB)  # the cache, until told
        self.census.invalidate()
        self.assertEqual(self.fake.readings, 2)
        self.assertFalse(self.census.stale)
        census = self.successResultOf(self.census.fresh())
        self.assertEqual(census.gpus[1].memory_free, 4 * GIB)
        self.assertEqual(census.process_gpu_memory(1000), {1: 20 * GIB})
        self.assertEqual(self.fake.readings, 2)  # fresh() used the reading invalidate() made

    def test_fresh_waits_for_a_reading_begun_after_invalidate(self) -> None:
        pool = HeldThreadPool()
        self.reactor.getThreadPool = lambda: pool
        self.start()  # the first reading is under way
        self.census.invalidate()  # a spawn, while it runs
        d = self.census.fresh()
        self.assertNoResult(d)
        self.fake.set_process_memory(1000, 0, 8 * GIB)
        pool.finish()  # the reading from before the spawn: not good enough
        self.assertNoResult(d)
        self.assertTrue(self.census.stale)
        self.assertEqual(len(pool.pending), 1)  # the one after it was started
        pool.finish()
        self.assertEqual(self.successResultOf(d).gpus[0].memory_free, 16 * GIB)
        self.assertFalse(self.census.stale)
        self.assertEqual(pool.pending, [])

    def test_one_reading_at_a_time(self) -> None:
        pool = HeldThreadPool()
        self.reactor.getThreadPool = lambda: pool
        self.start()
        self.reactor.advance(30)  # three ticks while the first reading hangs
        self.census.invalidate()
        self.assertEqual(len(pool.pending), 1)
        pool.finish()
        self.assertEqual(len(pool.pending), 1)  # one more for all that asked
        pool.finish()
        self.assertEqual(pool.pending, [])

    def test_the_job_survives_a_failing_probe(self) -> None:
        broken = BrokenOnce(self.fake)
        census = HardwareCensus(broken, self.reactor, interval=10.0)
        census.startService()
        self.addCleanup(census.stopService)
        first = census.latest
        broken.break_next = True
        self.reactor.advance(10)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertIs(census.latest, first)  # the last census stays
        self.reactor.advance(10)
        self.assertIsNot(census.latest, first)
        self.assertEqual(self.fake.readings, 2)

    def test_fresh_after_a_failure_gives_the_last_census(self) -> None:
        pool = HeldThreadPool()
        self.reactor.getThreadPool = lambda: pool
        broken = BrokenOnce(self.fake)
        census = HardwareCensus(broken, self.reactor)
        census.startService()
        self.addCleanup(census.stopService)
        pool.finish()
        first = census.latest
        census.invalidate()
        d = census.fresh()
        broken.break_next = True
        pool.finish()
        self.assertIs(self.successResultOf(d), first)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertTrue(census.stale)
        # the next fresh() reads again
        d = census.fresh()
        pool.finish()
        self.assertIsNot(self.successResultOf(d), first)

    def test_fresh_with_no_census_ever(self) -> None:
        broken = BrokenOnce(self.fake)
        broken.break_next = True
        census = HardwareCensus(broken, self.reactor)
        self.failureResultOf(census.fresh(), RuntimeError)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertIsNotNone(self.successResultOf(census.fresh()))


class GaugeTests(SynchronousTestCase):
    def gauges(self, metrics: Metrics) -> dict[tuple[str, str], float]:
        families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
        family = families["blazar_gpu_memory_bytes"]
        self.assertEqual(family.type, "gauge")
        return {(s.labels["gpu"], s.labels["kind"]): s.value for s in family.samples}

    def test_gpu_memory_by_index_and_kind(self) -> None:
        reactor = fake_process_reactor()
        fake = FakeNVML.with_gpus(24 * GIB, 16 * GIB)
        metrics = Metrics()
        census = HardwareCensus(fake, reactor, metrics)
        self.assertEqual(self.gauges(metrics), {})  # before the first reading
        census.startService()
        self.addCleanup(census.stopService)
        fake.set_process_memory(1000, 1, 4 * GIB)
        census.invalidate()
        self.assertEqual(
            self.gauges(metrics),
            {
                ("0", "total"): 24 * GIB,
                ("0", "used"): 0,
                ("0", "free"): 24 * GIB,
                ("1", "total"): 16 * GIB,
                ("1", "used"): 4 * GIB,
                ("1", "free"): 12 * GIB,
            },
        )

    def test_h200_used_counts_the_reserve(self) -> None:
        metrics = Metrics()
        census = HardwareCensus(FakeNVML.from_snapshot(H200), fake_process_reactor(), metrics)
        census.startService()
        self.addCleanup(census.stopService)
        values = self.gauges(metrics)
        self.assertEqual(values[("0", "used")], 644939776)
        self.assertEqual(values[("0", "used")] + values[("0", "free")], values[("0", "total")])

    def test_no_gpu_no_rows(self) -> None:
        metrics = Metrics()
        census = HardwareCensus(FakeNVML(), fake_process_reactor(), metrics)
        census.startService()
        self.addCleanup(census.stopService)
        self.assertEqual(self.gauges(metrics), {})


class DescribeTests(SynchronousTestCase):
    def test_h200(self) -> None:
        lines = describe(FakeNVML.from_snapshot(H200, cpu_physical_cores=16, cpu_logical_cores=32).thd_census())
        self.assertEqual(
            lines,
            [
                "CPU: 16 physical cores, 32 logical; RAM: 64.0 GiB total, 48.0 GiB available",
                "GPU 0: NVIDIA H200, 140.4 GiB total, 139.8 GiB free (driver 580.159.04, CUDA 13.0, compute 9.0)",
            ],
        )

    def test_no_gpu(self) -> None:
        census = NVMLProbe(RecordedNVML(H200, init_error=OSError("NVML Shared Library Not Found"))).thd_census()
        self.assertEqual(
            describe(census)[1:], ["GPUs: none, CPU only (NVML unavailable: NVML Shared Library Not Found)"]
        )

    def test_two_gpus(self) -> None:
        fake = FakeNVML.with_gpus(24 * GIB, 24 * GIB, cuda_driver_version=None)
        fake.set_free(1, 3 * GIB)
        self.assertEqual(
            describe(fake.thd_census())[1:],
            [
                "GPU 0: NVIDIA GeForce RTX 4090, 24.0 GiB total, 24.0 GiB free (driver 580.159.04, compute 8.9)",
                "GPU 1: NVIDIA GeForce RTX 4090, 24.0 GiB total, 3.0 GiB free (driver 580.159.04, compute 8.9)",
            ],
        )


class FreeMemoryTests(SynchronousTestCase):
    def test_ram_and_every_gpu(self) -> None:
        from blazar.service import thd_free_memory

        fake = FakeNVML.with_gpus(24 * GIB, 24 * GIB, ram_available=10 * GIB)
        fake.set_free(0, 2 * GIB)
        self.assertEqual(thd_free_memory(fake), 36 * GIB)

    def test_own_probe(self) -> None:
        from blazar.service import thd_free_memory

        self.assertGreater(thd_free_memory(), 0)

    def test_assembled(self) -> None:
        from tests.test_service import assembled

        tree = assembled(Path(self.mktemp()).absolute())
        services = list(tree.top)
        self.assertIsInstance(tree.engines.hardware, HardwareCensus)
        # started before the supervisor: its first census is there for the first spawn
        self.assertLess(services.index(tree.engines.hardware), services.index(tree.engines.supervisor))
