"""
The audit lane: a real writer thread, a stalled one, rotation, and a
daemon writing one line per request.
"""

import json
import time
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.models.testmodel import GeneratedModel
from blazar.web.audit import AuditLog
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon


class AuditTests(SynchronousTestCase):
    def wait_for(self, predicate: Any) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)

    def test_stalled_writer_drops_and_counts(self) -> None:
        path = Path(self.mktemp()) / "audit.jsonl"
        audit = AuditLog(path, queue_size=100)
        audit.gate.clear()  # the writer is stalled
        audit.start()
        self.addCleanup(audit.stop)
        t0 = time.monotonic()
        for i in range(10_000):
            audit.submit({"trace": f"t{i}", "key": "k", "method": "GET", "path": "/x", "status": 200, "ms": 1})
        self.assertLess(time.monotonic() - t0, 2.0)  # never blocked
        self.assertGreaterEqual(audit.dropped, 10_000 - 101)
        audit.gate.set()
        self.wait_for(lambda: audit.written + audit.dropped == 10_000)
        lines = path.read_text().splitlines()
        first = json.loads(lines[0])
        self.assertEqual(
            set(first),
            {
                "ts",
                "node",
                "trace",
                "key",
                "method",
                "path",
                "model",
                "status",
                "ms",
                "priority",
                "queue_depth",
                "sentinel",
            },
        )

    def test_a_full_disk_drops_and_counts_then_the_writer_comes_back(self) -> None:
        """
        Issue 36: the first ENOSPC ended the writer thread for good. The
        kernel's own ENOSPC (/dev/full) for a while, then the file again.
        """
        path = Path(self.mktemp()) / "audit.jsonl"
        audit = AuditLog(path, retry_secs=0.05)
        real_open = audit._open
        self.patch(audit, "_open", lambda: open("/dev/full", "a", encoding="utf-8"))
        audit.start()
        self.addCleanup(audit.stop)
        audit.submit({"trace": "t0", "status": 200})
        self.wait_for(lambda: audit.dropped == 1)
        self.assertIn("No space left on device", audit.down or "")
        self.patch(audit, "_open", real_open)
        time.sleep(0.2)  # past the back-off
        audit.submit({"trace": "t1", "status": 200})
        self.wait_for(lambda: audit.written == 1)
        self.assertIsNone(audit.down)
        self.assertEqual([json.loads(line)["trace"] for line in path.read_text().splitlines()], ["t1"])

    def test_rotation(self) -> None:
        path = Path(self.mktemp()) / "audit.jsonl"
        audit = AuditLog(path, max_bytes=2000)
        audit.start()
        for i in range(100):
            audit.submit({"trace": f"t{i}", "status": 200})
        audit.stop()
        self.assertTrue(path.with_name("audit.jsonl.1").exists())
        self.assertLessEqual(path.stat().st_size, 2000)

    def test_files_are_0600_whatever_the_umask(self) -> None:
        import os

        old = os.umask(0)
        self.addCleanup(os.umask, old)
        path = Path(self.mktemp()) / "logs" / "audit.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("")  # left by an older version, readable by all
        os.chmod(path, 0o644)
        path.with_name("audit.jsonl.1").write_text("")
        os.chmod(path.with_name("audit.jsonl.1"), 0o644)
        audit = AuditLog(path, max_bytes=2000)
        audit.start()
        for i in range(100):
            audit.submit({"trace": f"t{i}", "status": 200})
        audit.stop()
        for p in (path, path.with_name("audit.jsonl.1")):
            self.assertEqual(p.stat().st_mode & 0o777, 0o600, p)
        fresh = Path(self.mktemp()) / "new" / "audit.jsonl"
        writer = AuditLog(fresh)
        writer.start()
        self.addCleanup(writer.stop)
        self.wait_for(fresh.exists)
        self.assertEqual((fresh.stat().st_mode & 0o777, fresh.parent.stat().st_mode & 0o777), (0o600, 0o700))


def test_daemon_writes_one_line_per_request(engine: str, models: dict[str, GeneratedModel], tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    d = Daemon(
        tmp_path / "d",
        f'audit_log = "{path}"\n'
        + daemon_config(engine, models)
        + '\n[cluster]\nnode = "gpu-7"\n'
        + ('[[keys]]\nname = "auditor"\nsecret = "audit-secret-0123456789"\n'),
    )
    d.start()
    try:
        import http.client

        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                {"content-type": "application/json", "x-api-key": "audit-secret-0123456789"},
            )
            assert conn.getresponse().status == 200
            conn.close()
    finally:
        d.stop()
        d.kill_everything()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    chats = [line for line in lines if line["path"] == "/v1/chat/completions"]
    assert len(chats) == 3
    assert chats[0]["key"] == "auditor" and chats[0]["model"] == "tiny:latest" and chats[0]["status"] == 200
    assert {line["node"] for line in lines} == {"gpu-7"}  # each node's own log names it (issue 42)
    assert "audit-secret" not in path.read_text()
