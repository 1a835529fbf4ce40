"""
Run files and orphan stopping, with real (tiny) processes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.runfiles import run_dir, thd_remove, thd_stop_orphans, thd_write


class RunFileTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.rundir = run_dir(Path(self.mktemp()))

    def test_layout_and_modes(self) -> None:
        thd_write(self.rundir, "hf.co/u/r:Q4", 123, 4000, ["/bin/llama-server", "-m", "x"], "sekrit")
        self.assertEqual(self.rundir.stat().st_mode & 0o777, 0o700)
        (pid_file,) = self.rundir.glob("*.pid")
        self.assertEqual(json.loads(pid_file.read_text())["pid"], 123)
        key = pid_file.with_suffix(".apikey")
        self.assertEqual(key.read_text(), "sekrit")
        self.assertEqual(key.stat().st_mode & 0o777, 0o600)
        self.assertEqual(pid_file.stat().st_mode & 0o777, 0o600)
        thd_remove(self.rundir, "hf.co/u/r:Q4", 999)  # not that child: kept
        self.assertTrue(pid_file.exists())
        thd_remove(self.rundir, "hf.co/u/r:Q4", 123)
        self.assertEqual(list(self.rundir.iterdir()), [])

    def test_modes_are_set_whatever_the_umask(self) -> None:
        old = os.umask(0)
        self.addCleanup(os.umask, old)
        data = Path(self.mktemp())
        data.mkdir()
        (data / "run").mkdir(mode=0o755)
        run = run_dir(data)
        self.assertEqual(run.stat().st_mode & 0o777, 0o700)
        (run / "m.apikey").write_text("old")  # left behind with a loose mode
        os.chmod(run / "m.apikey", 0o644)
        thd_write(run, "m", 1, 2, ["x"], "new")
        self.assertEqual(
            [(p.name, p.stat().st_mode & 0o777) for p in sorted(run.iterdir())], [("m.apikey", 0o600), ("m.pid", 0o600)]
        )
        self.assertEqual((run / "m.apikey").read_text(), "new")

    def test_orphans_are_stopped_only_when_the_command_line_matches(self) -> None:
        argv = [sys.executable, "-c", "import time; time.sleep(60)", "orphan-marker"]
        orphan = subprocess.Popen(argv)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "not-ours"])
        try:
            thd_write(self.rundir, "a", orphan.pid, 1, argv, "k")
            thd_write(self.rundir, "b", other.pid, 2, [sys.executable, "something-else"], "k")
            thd_write(self.rundir, "c", 999_999_9, 3, ["gone"], "k")  # long dead
            time.sleep(0.2)
            stopped = thd_stop_orphans(self.rundir, grace=5)
            self.assertEqual(stopped, [orphan.pid])
            self.assertIsNotNone(orphan.poll())
            self.assertIsNone(other.poll())  # a reused pid is left alone
            self.assertEqual(list(self.rundir.iterdir()), [])
        finally:
            for p in (orphan, other):
                if p.poll() is None:
                    p.kill()
                p.wait()
