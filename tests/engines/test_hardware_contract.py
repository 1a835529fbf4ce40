"""
One contract for L{IHardwareProbe}, run on the real L{NVMLProbe} (on this
machine as it is: with no NVIDIA GPU it must report none, and the CPU and
RAM psutil sees), on L{NVMLProbe} replaying a real H200's NVML answers
(L{RecordedNVML}), and on L{FakeNVML} (that H200, two 24 GiB GPUs, no GPU),
so a planner test that passes on the fake says something about the
product.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import psutil
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from blazar.engines.hardware import GPU, Census, IHardwareProbe, NVMLProbe
from blazar.testing import GIB, FakeNVML, RecordedNVML
from tests.typed import TestCaseMixin

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nvml"
H200 = json.loads((FIXTURES / "h200.json").read_text())
H200_TOTAL = 150754820096
H200_FREE = 150109880320
H200_RESERVED = 644939776  # memory v2's "reserved": 616 MiB, as nvidia-smi -q says


def has_nvidia_device() -> bool:
    """
    Whether this machine has an NVIDIA driver with a device node.
    """
    return Path("/dev/nvidiactl").exists()


class HardwareProbeContract(TestCaseMixin):
    """
    The assertions; mixed into one L{SynchronousTestCase} per
    implementation, whose L{make_probe} builds it.
    """

    # whether nothing else changes the machine between two readings (not
    # so on a real GPU machine, where other processes come and go)
    still = True

    def make_probe(self) -> Any:
        raise NotImplementedError

    def setUp(self) -> None:
        self.probe = self.make_probe()
        self.census: Census = self.probe.thd_census()

    def test_provides_the_interface(self) -> None:
        self.assertTrue(verifyObject(IHardwareProbe, self.probe))

    def test_host(self) -> None:
        c = self.census
        self.assertIsInstance(c, Census)
        self.assertGreaterEqual(c.cpu_physical_cores, 1)
        self.assertGreaterEqual(c.cpu_logical_cores, c.cpu_physical_cores)
        self.assertGreater(c.ram_available, 0)
        self.assertLessEqual(c.ram_available, c.ram_total)

    def test_gpus(self) -> None:
        gpus = self.census.gpus
        self.assertIsInstance(gpus, tuple)
        self.assertEqual([g.index for g in gpus], sorted({g.index for g in gpus}))
        for g in gpus:
            self.assertIsInstance(g, GPU)
            self.assertTrue(g.name)
            self.assertTrue(g.uuid.startswith("GPU-"), g.uuid)
            self.assertGreater(g.memory_total, 0)
            self.assertTrue(0 <= g.memory_free <= g.memory_total)
            # Blazar's "used" is total - free, the driver's reserve included
            self.assertEqual(g.memory_used, g.memory_total - g.memory_free)
            self.assertTrue(0 <= g.memory_reserved <= g.memory_used)
            self.assertLessEqual(sum(b for _, b in g.processes), g.memory_used)
            self.assertEqual([p for p, _ in g.processes], sorted({p for p, _ in g.processes}))
            self.assertTrue(all(b > 0 for _, b in g.processes))
        self.assertEqual(self.census.gpu_memory_free, sum(g.memory_free for g in gpus))

    def test_no_gpu_says_why(self) -> None:
        if not self.census.gpus:
            self.assertTrue(self.census.gpu_note)

    def test_process_memory_matches_the_census(self) -> None:
        pids = {p for g in self.census.gpus for p, _ in g.processes} if self.still else set()
        pids.add(os.getpid())
        for pid in pids:
            self.assertEqual(
                self.probe.thd_process_gpu_memory(pid),
                self.census.process_gpu_memory(pid),
            )
        # no process holds memory under a pid that cannot exist
        self.assertEqual(self.probe.thd_process_gpu_memory(2**31 - 1), {})

    def test_readings_go_forward(self) -> None:
        again = self.probe.thd_census()
        self.assertGreaterEqual(again.taken_at, self.census.taken_at)
        self.assertEqual([g.uuid for g in again.gpus], [g.uuid for g in self.census.gpus])

    def test_reads_in_another_thread(self) -> None:
        found: list[Census] = []
        worker = threading.Thread(target=lambda: found.append(self.probe.thd_census()))
        worker.start()
        worker.join(30)
        self.assertEqual(len(found), 1)
        self.assertEqual(len(found[0].gpus), len(self.census.gpus))


class H200Expectations(TestCaseMixin):
    """
    What the recorded H200 must read as, through either implementation.
    """

    census: Census

    def test_the_h200(self) -> None:
        (gpu,) = self.census.gpus
        self.assertEqual(gpu.name, "NVIDIA H200")
        self.assertEqual(gpu.uuid, "GPU-28deb8df-d7c0-ff30-e8a6-48043f3f8792")
        self.assertEqual(
            (gpu.memory_total, gpu.memory_free, gpu.memory_used, gpu.memory_reserved),
            (H200_TOTAL, H200_FREE, H200_TOTAL - H200_FREE, H200_RESERVED),
        )
        self.assertEqual(gpu.compute_capability, (9, 0))
        self.assertEqual(gpu.driver_version, "580.159.04")
        self.assertEqual(gpu.cuda_driver_version, (13, 0))
        self.assertEqual((gpu.temperature_c, gpu.utilization_percent), (38, 0))
        self.assertEqual(gpu.processes, ())
        self.assertEqual(self.census.gpu_note, "")


class RealProbeTests(HardwareProbeContract, SynchronousTestCase):
    """
    This machine, through NVML and psutil.
    """

    still = False

    def make_probe(self) -> NVMLProbe:
        probe = NVMLProbe()
        self.addCleanup(probe.thd_close)
        return probe

    def test_this_machine(self) -> None:
        self.assertEqual(self.census.cpu_logical_cores, psutil.cpu_count())
        self.assertEqual(self.census.cpu_physical_cores, psutil.cpu_count(logical=False) or psutil.cpu_count())
        self.assertEqual(self.census.ram_total, psutil.virtual_memory().total)
        if not has_nvidia_device():
            self.assertEqual(self.census.gpus, ())
            self.assertEqual(self.probe.thd_process_gpu_memory(os.getpid()), {})
        else:
            self.assertGreaterEqual(len(self.census.gpus), 1)


class RecordedH200Tests(HardwareProbeContract, H200Expectations, SynchronousTestCase):
    """
    L{NVMLProbe}'s own reading code, on what a real H200 answered.
    """

    def make_probe(self) -> NVMLProbe:
        return NVMLProbe(RecordedNVML(H200))


class FakeH200Tests(HardwareProbeContract, H200Expectations, SynchronousTestCase):
    def make_probe(self) -> FakeNVML:
        return FakeNVML.from_snapshot(H200)

    def test_same_gpus_as_the_real_probe_reads(self) -> None:
        self.assertEqual(self.census.gpus, NVMLProbe(RecordedNVML(H200)).thd_census().gpus)


class FakeTwoGPUTests(HardwareProbeContract, SynchronousTestCase):
    def make_probe(self) -> FakeNVML:
        return FakeNVML.with_gpus(24 * GIB, 24 * GIB)

    def test_two_empty_gpus(self) -> None:
        self.assertEqual(
            [(g.index, g.memory_total, g.memory_free) for g in self.census.gpus],
            [(0, 24 * GIB, 24 * GIB), (1, 24 * GIB, 24 * GIB)],
        )
        self.assertEqual(len({g.uuid for g in self.census.gpus}), 2)


class FakeChildOnAGPUTests(HardwareProbeContract, SynchronousTestCase):
    """
    The contract holds while a process holds memory (the pid-based
    assertions have something to compare).
    """

    def make_probe(self) -> FakeNVML:
        fake = FakeNVML.with_gpus(24 * GIB, 24 * GIB)
        fake.set_process_memory(4242, 1, 5 * GIB)
        return fake

    def test_the_child(self) -> None:
        self.assertEqual(self.census.process_gpu_memory(4242), {1: 5 * GIB})


class FakeNoGPUTests(HardwareProbeContract, SynchronousTestCase):
    def make_probe(self) -> FakeNVML:
        return FakeNVML()

    def test_none(self) -> None:
        self.assertEqual(self.census.gpus, ())
