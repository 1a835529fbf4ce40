from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import KeyConfig
from blazar.gateway.quota import QuotaExceeded, Quotas


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


class TokenQuotaTests(SynchronousTestCase):
    def test_tpm_window(self) -> None:
        clock = Clock()
        q = Quotas(clock, wall=lambda: 1_000_000.0)
        key = KeyConfig("k", "s" * 16, tpm=100)
        q.admit(key)
        q.record(key, 60)
        q.admit(key)
        q.record(key, 50)
        clock.advance(20)
        with self.assertRaises(QuotaExceeded) as cm:
            q.admit(key)
        self.assertEqual(cm.exception.retry_after, 40)
        clock.advance(40)
        q.admit(key)

    def test_daily_tokens_roll_over_at_utc_midnight_and_persist(self) -> None:
        now = [86400.0 * 20000 + 100]  # 100 s into a UTC day
        q = Quotas(Clock(), wall=lambda: now[0])
        key = KeyConfig("k", "s" * 16, daily_tokens=50)
        q.load_day(q.today(), {"k": 45})  # read back from the store
        q.admit(key)
        q.record(key, 10)
        self.assertEqual(q.take_pending(), [(q.today(), "k", 10)])
        with self.assertRaises(QuotaExceeded) as cm:
            q.admit(key)
        self.assertEqual(cm.exception.retry_after, 86400 - 100)
        now[0] += 86400
        q.admit(key)  # a new day
        self.assertEqual(q.daily("k"), 0)

    def test_a_key_added_under_a_removed_keys_name_starts_afresh(self) -> None:
        q = Quotas(Clock())
        removed = KeyConfig("alice", "s" * 16, daily_tokens=50, id="a1")
        q.load_day(q.today(), {"alice#a1": 60})
        with self.assertRaises(QuotaExceeded):
            q.admit(removed)
        again = KeyConfig("alice", "t" * 16, daily_tokens=50, id="b2")
        q.admit(again)
        q.record(again, 5)
        self.assertEqual(q.take_pending(), [(q.today(), "alice#b2", 5)])


class StoreTests(SynchronousTestCase):
    def test_usage_round_trip_and_migrations(self) -> None:
        from pathlib import Path

        from blazar import store

        path = Path(self.mktemp()) / "blazar.db"
        db = store.thd_open(path)
        store.thd_add_usage(db, [("2026-12-01", "a", 5), ("2026-12-01", "a", 7), ("2026-12-02", "a", 1)])
        db.close()
        db = store.thd_open(path)  # reopening applies no migration twice
        self.assertEqual(store.thd_day_usage(db, "2026-12-01"), {"a": 12})
        self.assertEqual(db.execute("SELECT version FROM schema_version").fetchone()[0], len(store.MIGRATIONS))
        self.assertEqual(db.execute("PRAGMA journal_mode").fetchone()[0], "wal")
        db.close()


class RequestsTests(SynchronousTestCase):
    """
    L{Quotas.requests}: the routes that spend no tokens (the Files and
    Batch APIs) count against rpm alone.
    """

    def test_rpm_is_shared_with_the_model_routes(self) -> None:
        clock = Clock()
        q = Quotas(clock)
        key = KeyConfig("k", "s" * 16, rpm=2)
        q.requests(key)
        q.rates(key)  # a chat: the minute's second request
        with self.assertRaises(QuotaExceeded) as cm:
            q.requests(key)
        self.assertIn("rpm", str(cm.exception))
        self.assertEqual(cm.exception.retry_after, 60)
        clock.advance(60)
        q.requests(key)

    def test_token_limits_do_not_apply(self) -> None:
        q = Quotas(Clock())
        key = KeyConfig("k", "s" * 16, tpm=1, daily_tokens=1)
        q.record(key, 100)
        with self.assertRaises(QuotaExceeded):
            q.rates(key)
        for _ in range(10):
            q.requests(key)
