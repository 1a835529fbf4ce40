from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import KeyConfig
from blazar.web.quota import QuotaExceeded, Quotas


class QuotaTests(SynchronousTestCase):
    def test_max_concurrent_lease(self) -> None:
        q = Quotas(Clock())
        key = KeyConfig("k", "s" * 16, max_concurrent=1)
        q.admit(key)
        with self.assertRaises(QuotaExceeded) as cm:
            q.admit(key)
        self.assertIn("max_concurrent", str(cm.exception))
        q.release(key)
        q.admit(key)
        self.assertEqual(q.active("k"), 1)

    def test_rpm_window_and_retry_after(self) -> None:
        clock = Clock()
        q = Quotas(clock)
        key = KeyConfig("k", "s" * 16, rpm=2)
        q.admit(key)
        q.release(key)
        clock.advance(10)
        q.admit(key)
        q.release(key)
        with self.assertRaises(QuotaExceeded) as cm:
            q.admit(key)
        self.assertEqual(cm.exception.retry_after, 50)
        clock.advance(50)
        q.admit(key)  # the first one left the window

    def test_unlimited_key(self) -> None:
        q = Quotas(Clock())
        key = KeyConfig("k", "s" * 16)
        for _ in range(100):
            q.admit(key)
        self.assertEqual(q.active("k"), 100)
