"""
One contract for L{IQuotas}, run on the in-memory L{Quotas} and on
L{RedisQuotas} against a real C{redis-server} (L{tests.redisserver}; in
CI a missing server fails, elsewhere the Redis half is skipped, naming
C{apt-get install redis-server}). The Redis one runs its blocking calls
inline here, so every Deferred has fired when it is returned, as the
in-memory one's have.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from blazar.config import KeyConfig
from blazar.gateway.quota import IQuotas, QuotaExceeded, Quotas
from blazar.gateway.redisquota import RedisQuotas
from tests import redisserver


def inline(f: Any, *args: Any) -> Deferred[Any]:
    """
    Run a thread-side function here and now (the tests' stand-in for the
    thread pool).
    """
    return maybeDeferred(f, *args)


def redis_quotas(url: str, lease_secs: float = 30.0, ledger: Quotas | None = None) -> RedisQuotas:
    return RedisQuotas(url, Clock(), ledger=ledger, lease_secs=lease_secs, in_thread=inline)


class QuotaContract:
    """
    What every L{IQuotas} does (mixed into a L{SynchronousTestCase}).
    """

    def make(self) -> IQuotas:
        raise NotImplementedError

    # (the mixin's view of SynchronousTestCase)
    successResultOf: Any
    failureResultOf: Any
    assertEqual: Any
    assertIn: Any
    assertTrue: Any
    assertLessEqual: Any
    assertGreaterEqual: Any

    def refused(self, d: Deferred[Any]) -> QuotaExceeded:
        e = self.failureResultOf(d, QuotaExceeded).value
        assert isinstance(e, QuotaExceeded)
        return e

    def test_provides(self) -> None:
        self.assertTrue(verifyObject(IQuotas, self.make()))

    def test_unlimited_key(self) -> None:
        q = self.make()
        key = KeyConfig("free", "s" * 16)
        for _ in range(20):
            self.successResultOf(q.take_lease(key))
            self.successResultOf(q.check_rates(key))
            self.successResultOf(q.check_requests(key))
            self.successResultOf(q.count_tokens(key, 1000))

    def test_max_concurrent(self) -> None:
        q = self.make()
        key = KeyConfig("k", "s" * 16, max_concurrent=2)
        first = self.successResultOf(q.take_lease(key))
        self.successResultOf(q.take_lease(key))
        e = self.refused(q.take_lease(key))
        self.assertIn("max_concurrent", str(e))
        self.assertEqual(e.retry_after, 1.0)
        self.successResultOf(q.give_lease(key, first))
        self.successResultOf(q.take_lease(key))
        self.refused(q.take_lease(key))

    def test_rpm(self) -> None:
        q = self.make()
        key = KeyConfig("k", "s" * 16, rpm=3)
        for _ in range(2):
            self.successResultOf(q.check_rates(key))
        self.successResultOf(q.check_requests(key))  # the Files and Batch APIs count too
        e = self.refused(q.check_rates(key))
        self.assertIn("rpm", str(e))
        self.assertGreaterEqual(e.retry_after, 1.0)
        self.assertLessEqual(e.retry_after, 60.0)
        self.refused(q.check_requests(key))

    def test_tpm(self) -> None:
        q = self.make()
        key = KeyConfig("k", "s" * 16, tpm=100)
        self.successResultOf(q.count_tokens(key, 99))
        self.successResultOf(q.check_rates(key))
        self.successResultOf(q.count_tokens(key, 1))
        e = self.refused(q.check_rates(key))
        self.assertIn("used 100 tokens in the last minute, over its tpm of 100", str(e))
        self.successResultOf(q.check_requests(key))  # (tokens do not hold back the Files and Batch APIs)

    def test_daily_tokens(self) -> None:
        q = self.make()
        key = KeyConfig("k", "s" * 16, daily_tokens=50)
        self.successResultOf(q.count_tokens(key, 30))
        self.successResultOf(q.check_rates(key))
        self.successResultOf(q.count_tokens(key, 20))
        e = self.refused(q.check_rates(key))
        self.assertIn("daily_tokens", str(e))
        self.assertLessEqual(e.retry_after, 86400.0)

    def test_keys_apart(self) -> None:
        """
        Each key owner has counters of its own: a new key under a removed
        key's name (another id) starts afresh.
        """
        q = self.make()
        alice = KeyConfig("alice", "a" * 16, rpm=1, id="1")
        again = KeyConfig("alice", "b" * 16, rpm=1, id="2")
        bob = KeyConfig("bob", "c" * 16, rpm=1)
        self.successResultOf(q.check_rates(alice))
        self.refused(q.check_rates(alice))
        self.successResultOf(q.check_rates(again))
        self.successResultOf(q.check_rates(bob))


class MemoryQuotaContractTests(QuotaContract, SynchronousTestCase):
    def make(self) -> IQuotas:
        return Quotas(Clock())


class RedisQuotaContractTests(QuotaContract, SynchronousTestCase):
    def make(self) -> IQuotas:
        q = redis_quotas(redisserver.shared().new_db())
        self.addCleanup(q.stop)
        return q
