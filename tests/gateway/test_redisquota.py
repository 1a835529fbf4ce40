"""
L{RedisQuotas} beyond the contract (tests/gateway/test_quota_contract.py),
against a real C{redis-server}: two nodes sharing it, hammered from
threads, never let a key past its limits and count exactly; a dead node's
lease frees itself; a stopped Redis fails the checks naming it, and a
restarted one serves again.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, cast

import redis
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import KeyConfig
from blazar.gateway.quota import QuotaExceeded, Quotas
from blazar.gateway.redisquota import RedisQuotas, describe
from blazar.postgres import StoreUnavailable
from tests import redisserver
from tests.gateway.test_quota_contract import inline, redis_quotas


def outcome(d: Deferred[Any]) -> Any:
    """
    What a Deferred that has fired holds (a L{Failure} consumed).
    """
    assert d.called
    result = d.result
    if isinstance(result, Failure):
        d.addErrback(lambda _: None)
    return result


def hammer(threads: int, each: int, attempt: Callable[[int], bool]) -> int:
    """
    Run C{attempt(i)} C{each} times on each of C{threads} threads, all at
    once; how many returned true.
    """
    start = threading.Barrier(threads)
    wins = [0] * threads

    def run(n: int) -> None:
        start.wait()
        for i in range(each):
            if attempt(n * each + i):
                wins[n] += 1

    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(wins)


class TwoNodeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.url = redisserver.shared().new_db()
        self.a, self.b = self.node(), self.node()
        self.client = redis.Redis.from_url(self.url)
        self.addCleanup(self.client.close)

    def node(self, lease_secs: float = 30.0, ledger: Quotas | None = None) -> RedisQuotas:
        q = redis_quotas(self.url, lease_secs, ledger)
        self.addCleanup(q.stop)
        return q

    def either(self, i: int) -> RedisQuotas:
        return self.a if i % 2 else self.b

    def test_rpm_exact_under_threads(self) -> None:
        """
        8 threads, 200 requests over two nodes against rpm = 37: exactly
        37 pass, and exactly 37 are counted.
        """
        key = KeyConfig("k", "s" * 16, rpm=37)
        passed = hammer(8, 25, lambda i: outcome(self.either(i).check_rates(key)) is None)
        self.assertEqual(passed, 37)
        self.assertEqual(self.client.zcard("blazar:q:{k}:rpm"), 37)

    def test_max_concurrent_exact_under_threads(self) -> None:
        """
        Leases taken from 8 threads on two nodes against max_concurrent =
        5: exactly 5 held; each handed back lets exactly one more in.
        """
        key = KeyConfig("k", "s" * 16, max_concurrent=5)
        leases: list[tuple[RedisQuotas, object]] = []
        lock = threading.Lock()

        def take(i: int) -> bool:
            node = self.either(i)
            got = outcome(node.take_lease(key))
            if isinstance(got, Failure):
                got.trap(QuotaExceeded)
                return False
            with lock:
                leases.append((node, got))
            return True

        self.assertEqual(hammer(8, 10, take), 5)
        self.assertEqual(self.client.zcard("blazar:q:{k}:lease"), 5)
        for node, lease in leases[:2]:
            self.assertIsNone(outcome(node.give_lease(key, lease)))
        self.assertEqual(hammer(8, 10, take), 2)

    def test_tokens_exact_under_threads(self) -> None:
        """
        Tokens counted from 8 threads on two nodes add up exactly (tpm's
        window and the day's counter); the check then refuses at the
        limit, on both nodes.
        """
        key = KeyConfig("k", "s" * 16, tpm=400, daily_tokens=400)
        counted = hammer(8, 25, lambda i: outcome(self.either(i).count_tokens(key, 2)) is None)
        self.assertEqual(counted, 200)
        day = int(time.time() // 86400)
        self.assertEqual(int(self.client.get(f"blazar:q:{{k}}:day:{day}") or 0), 400)
        seconds: dict[bytes, bytes] = self.client.hgetall("blazar:q:{k}:tpm:s")  # type: ignore[assignment]
        self.assertEqual(sum(int(v) for v in seconds.values()), 400)
        for node in (self.a, self.b):
            e = outcome(node.check_rates(key))
            self.assertIsInstance(e, Failure)
            self.assertIn("tpm of 400", e.getErrorMessage())

    def test_rates_and_tokens_never_past_the_limit(self) -> None:
        """
        Requests that check and then count 10 tokens each, from 8 threads
        on two nodes, against daily_tokens = 300: no request is admitted
        once 300 were counted, so at most the requests checked before the
        300th token was counted got in; every admitted one's tokens are
        counted exactly.
        """
        key = KeyConfig("k", "s" * 16, daily_tokens=300)

        def request(i: int) -> bool:
            node = self.either(i)
            if isinstance(outcome(node.check_rates(key)), Failure):
                return False
            outcome(node.count_tokens(key, 10))
            return True

        admitted = hammer(8, 10, request)
        day = int(time.time() // 86400)
        used = int(self.client.get(f"blazar:q:{{k}}:day:{day}") or 0)
        self.assertEqual(used, admitted * 10)
        # (each thread may have checked once before another counted: tokens are known after the answer)
        self.assertGreaterEqual(admitted, 30)
        self.assertLessEqual(admitted, 30 + 7)
        self.assertIsInstance(outcome(self.a.check_rates(key)), Failure)

    def test_dead_nodes_lease_frees_itself(self) -> None:
        """
        A lease whose node died (never handed back, never refreshed) stops
        counting once it expires; one that its holder refreshes does not.
        """
        key = KeyConfig("k", "s" * 16, max_concurrent=1)
        dead = self.node(lease_secs=0.4)
        self.assertIsNotNone(outcome(dead.take_lease(key)))
        self.assertIsInstance(outcome(self.b.take_lease(key)), Failure)
        time.sleep(0.5)
        alive = self.node(lease_secs=0.4)
        self.assertIsNotNone(outcome(alive.take_lease(key)))
        for _ in range(3):
            time.sleep(0.2)
            outcome(alive.refresh())
        self.assertIsInstance(outcome(self.b.take_lease(key)), Failure)  # 0.6 s on, still held

    def test_refresher_runs_on_the_clock(self) -> None:
        """
        L{RedisQuotas.start} refreshes the leases every third of their
        time on the injected clock.
        """
        clock = Clock()
        holder = RedisQuotas(self.url, clock, lease_secs=0.6, in_thread=inline)
        holder.start()
        self.addCleanup(holder.stop)
        key = KeyConfig("k", "s" * 16, max_concurrent=1)
        self.assertIsNotNone(outcome(holder.take_lease(key)))
        for _ in range(4):
            time.sleep(0.2)
            clock.advance(0.2)
        self.assertIsInstance(outcome(self.b.take_lease(key)), Failure)

    def test_ledger_gets_the_tokens(self) -> None:
        """
        Counted tokens go to the node's in-memory ledger too, which the
        store's usage rows are written from.
        """
        ledger = Quotas(Clock())
        node = self.node(ledger=ledger)
        key = KeyConfig("k", "s" * 16, daily_tokens=1000)
        outcome(node.count_tokens(key, 12))
        self.assertEqual(ledger.daily("k"), 12)
        self.assertEqual([row[1:] for row in ledger.take_pending()], [("k", 12)])


class LostDataTests(SynchronousTestCase):
    """
    A Redis that lost its data (restarted without persistence, or
    flushed): the day's counter is seeded from what the store says, so
    C{daily_tokens} is not opened by the loss.
    """

    def setUp(self) -> None:
        self.url = redisserver.shared().new_db()
        self.client = redis.Redis.from_url(self.url)
        self.addCleanup(self.client.close)
        self.asked: list[str] = []
        self.store = {"k": 900}

        def day_used(owner: str) -> Deferred[int]:
            self.asked.append(owner)
            return succeed(self.store.get(owner, 0))

        self.q = RedisQuotas(self.url, Clock(), in_thread=inline, day_used=day_used)
        self.addCleanup(self.q.stop)
        self.key = KeyConfig("k", "s" * 16, daily_tokens=1000)

    def test_check_seeds_a_missing_day_once(self) -> None:
        """
        The first check that finds no counter seeds it from the store; the
        next checks read Redis only; the seeded use counts toward the limit.
        """
        self.assertIsNone(outcome(self.q.check_rates(self.key)))
        self.assertIsNone(outcome(self.q.check_rates(self.key)))
        self.assertEqual(self.asked, ["k"])
        outcome(self.q.count_tokens(self.key, 100))
        failure = outcome(self.q.check_rates(self.key))
        self.assertIsInstance(failure, Failure)
        failure.trap(QuotaExceeded)
        self.assertIn("daily_tokens", failure.getErrorMessage())

    def test_flush_then_check_refuses(self) -> None:
        """
        The counter is lost after being counted into (FLUSHDB, as a Redis
        restarted without its data): the next check seeds it again from the
        store and refuses a key the store says is spent.
        """
        outcome(self.q.count_tokens(self.key, 10))
        self.client.flushdb()
        self.store["k"] = 1000
        failure = outcome(self.q.check_rates(self.key))
        self.assertIsInstance(failure, Failure)
        failure.trap(QuotaExceeded)

    def test_count_into_a_missing_day_seeds_not_adds(self) -> None:
        """
        Counting tokens when the counter is gone seeds it from the store
        (whose figure already holds these tokens, from the ledger) instead
        of starting a counter at just these tokens.
        """
        self.assertEqual(outcome(self.q.count_tokens(self.key, 50)), None)
        (day,) = [k for k in self.client.keys("blazar:q:{k}:day:*")]
        self.assertEqual(int(cast(bytes, self.client.get(day))), 900)

    def test_another_nodes_seed_is_kept(self) -> None:
        """
        Two nodes seeding at once: the first one's value stays (SET NX).
        """
        self.assertIsNone(outcome(self.q.check_rates(self.key)))
        self.store["k"] = 5
        self.client.delete(*self.client.keys("blazar:q:{k}:day:*"))
        self.client.set("blazar:q:{k}:day:" + str(int(self.client.time()[0]) // 86400), 700)
        outcome(self.q.check_rates(self.key))
        (day,) = self.client.keys("blazar:q:{k}:day:*")
        self.assertEqual(int(cast(bytes, self.client.get(day))), 700)


class OutageTests(SynchronousTestCase):
    def test_stopped_then_restarted(self) -> None:
        """
        With Redis down, every check fails with L{StoreUnavailable} naming
        it (never a pass); once it is back, the next check reconnects.
        """
        server = redisserver.server()
        self.addCleanup(server.remove)
        q = redis_quotas(server.url())
        self.addCleanup(q.stop)
        key = KeyConfig("k", "s" * 16, rpm=100, max_concurrent=5, tpm=1000)
        self.assertIsNone(outcome(q.check_rates(key)))
        server.stop()
        for d in (q.check_rates(key), q.take_lease(key), q.check_requests(key), q.count_tokens(key, 5)):
            failure = outcome(d)
            self.assertIsInstance(failure, Failure)
            failure.trap(StoreUnavailable)
            self.assertIn(f"Redis at 127.0.0.1:{server.port} is unreachable", failure.getErrorMessage())
        server.start()
        self.assertIsNone(outcome(q.check_rates(key)))
        self.assertIsNotNone(outcome(q.take_lease(key)))

    def test_tokens_counted_while_down_are_sent_later(self) -> None:
        """
        Tokens Redis could not take while it was down are counted into the
        day by the next refresh once it is back (not into the minute
        window: they are older than that).
        """
        server = redisserver.server()
        self.addCleanup(server.remove)
        q = redis_quotas(server.url())
        self.addCleanup(q.stop)
        key = KeyConfig("k", "s" * 16, daily_tokens=100, tpm=1000)
        outcome(q.count_tokens(key, 30))
        server.stop()
        outcome(q.count_tokens(key, 50)).trap(StoreUnavailable)
        self.assertIsNone(outcome(q.refresh()))  # still down: kept
        server.start()  # (without its data: this server does not persist)
        client = redis.Redis.from_url(server.url())
        self.addCleanup(client.close)
        self.assertEqual(client.keys("blazar:q:*"), [])
        self.assertIsNone(outcome(q.refresh()))
        (day,) = client.keys("blazar:q:{k}:day:*")
        self.assertEqual(int(cast(bytes, client.get(day))), 50)
        self.assertEqual(client.keys("blazar:q:{k}:tpm*"), [])  # not in the minute window
        self.assertIsNone(outcome(q.refresh()))  # sent once
        self.assertEqual(int(cast(bytes, client.get(day))), 50)

    def test_describe_hides_the_password(self) -> None:
        self.assertEqual(describe("redis://:hunter2@10.1.2.3:6380/2"), "10.1.2.3:6380")
        self.assertEqual(describe("redis://redis.internal"), "redis.internal:6379")
