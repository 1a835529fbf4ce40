"""
Keys' limits in a Redis that several Blazar nodes share (C{[cluster]
redis}, issue 42): the same checks as L{blazar.gateway.quota.Quotas}, exact
across the nodes, because each check-and-count is one Lua script that
Redis runs atomically (C{EVALSHA}); nothing is read into Python and
written back. Times are Redis's own (C{TIME}), so the nodes' clocks do not
matter.

Per key owner (L{blazar.config.KeyConfig.owner}), under
C{blazar:q:{OWNER}:} (the braces keep a key's counters on one Redis Cluster
slot):

  - C{lease}: a sorted set of running requests, each member scored by its
    expiry (ms). The script prunes expired members, refuses at
    C{max_concurrent}, adds the new one; the holder refreshes its members
    every third of L{LEASE_SECS} while the request runs and removes them
    when it ends, so a dead node's leases free themselves within
    L{LEASE_SECS}.
  - C{rpm}: a sorted set of the requests of the last 60 s (sliding window:
    a request is refused while C{rpm} requests were admitted in the 60 s
    before it; the same rule as in memory).
  - C{tpm:s}: the tokens of the last 60 s, a hash of one count per
    second (Redis's C{TIME}), summed by the script: a sliding window to the
    second, whose check costs the same however many answers it holds
    (at most 60 fields; older ones are dropped as it reads).
  - C{day:N}: tokens used on UTC day N (days since the epoch), a counter
    that expires two days later. A Redis that lost it (restarted without
    its data) has it seeded, by the first node that finds it missing, from
    the durable store's day totals (every node's usage rows, written once a
    second) and that node's rows not yet written: the day's limit holds
    across a Redis restart, short of the last second of the other nodes'
    tokens.

Tokens a node could not count while Redis was unreachable are kept and
counted into the day when it answers again (L{RedisQuotas.refresh}); the
minute windows (C{rpm}, C{tpm}) are Redis's alone, so a Redis that loses
its data forgets the last minute's requests.

The client is redis-py, synchronous, run on a small thread pool of its
own (C{thd_*} functions touch no Twisted object). An unreachable Redis
fails the check with L{StoreUnavailable} naming it (503
C{store_unavailable}); the next check connects again.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer

from blazar.config import KeyConfig
from blazar.gateway.quota import IQuotas, QuotaExceeded, Quotas
from blazar.postgres import StoreUnavailable

log = Logger()

LEASE_SECS = 30.0  # a dead node's leases free themselves within this

# KEYS: lease set. ARGV: max (-1: none), member, lease ms. -> {0} or {1}
LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local max, ms = tonumber(ARGV[1]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if max >= 0 and redis.call('ZCARD', KEYS[1]) >= max then
  return {1}
end
redis.call('ZADD', KEYS[1], now + ms, ARGV[2])
redis.call('PEXPIRE', KEYS[1], ms)
return {0}
"""

# KEYS: lease set. ARGV: lease ms, members... -> number refreshed
REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + ms, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ms)
return n
"""

# KEYS: rpm set, tpm hash, day prefix. ARGV: rpm, tpm, daily (-1: none), member, count (1: count the request),
# seed (1: a missing day counter is to be seeded first)
# -> {0} admitted; {1, retry ms} over rpm; {2, used, retry ms} over tpm; {3, used, retry s} over daily;
# {4, day} today's counter is missing (Redis lost it): seed it (SEED), then check again
RATES = """
local t = redis.call('TIME')
local secs = tonumber(t[1])
local now = secs * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, daily = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if rpm >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    local oldest = first[2] and tonumber(first[2]) or now
    return {1, 60000 - (now - oldest)}
  end
end
if tpm >= 0 then
  -- one field per second (at most 60 live ones): the check's cost does not grow with the traffic
  local used, oldest, stale = 0, nil, {}
  local rows = redis.call('HGETALL', KEYS[2])
  for i = 1, #rows, 2 do
    local second = tonumber(rows[i])
    if second <= secs - 60 then
      stale[#stale + 1] = rows[i]
    else
      used = used + tonumber(rows[i + 1])
      if oldest == nil or second < oldest then oldest = second end
    end
  end
  if #stale > 0 then
    redis.call('HDEL', KEYS[2], unpack(stale))
  end
  if used >= tpm then
    return {2, used, ((oldest or secs) + 60) * 1000 - now}
  end
end
if daily >= 0 then
  local day = redis.call('GET', KEYS[3] .. math.floor(secs / 86400))
  if day == false and ARGV[6] == '1' then
    return {4, math.floor(secs / 86400)}
  end
  local used = tonumber(day or '0')
  if used >= daily then
    return {3, used, 86400 - (secs % 86400)}
  end
end
if rpm >= 0 and ARGV[5] == '1' then
  redis.call('ZADD', KEYS[1], now, ARGV[4])
  redis.call('PEXPIRE', KEYS[1], 61000)
end
return {0}
"""

# KEYS: tpm hash, day prefix. ARGV: tokens, member, tpm? (1/0), daily? (1/0), seed (1: a missing day counter is
# seeded, not counted into) -> {0}; {1, day} today's counter is missing: SEED it (the seed holds these tokens)
TOKENS = """
local t = redis.call('TIME')
local secs = tonumber(t[1])
local now = secs * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[3] == '1' then
  redis.call('HINCRBY', KEYS[1], secs, tonumber(ARGV[1]))
  redis.call('EXPIRE', KEYS[1], 61)
end
if ARGV[4] == '1' then
  local day = KEYS[2] .. math.floor(secs / 86400)
  if ARGV[5] == '1' and redis.call('EXISTS', day) == 0 then
    return {1, math.floor(secs / 86400)}
  end
  redis.call('INCRBY', day, tonumber(ARGV[1]))
  redis.call('EXPIRE', day, 2 * 86400)
end
return {0}
"""

# KEYS: day prefix. ARGV: day, tokens -> 1 if set, 0 if another node seeded it first
SEED = """
local day = KEYS[1] .. ARGV[1]
if redis.call('SET', day, ARGV[2], 'NX', 'EX', 2 * 86400) then
  return 1
end
return 0
"""


def describe(url: str) -> str:
    """
    C{host:port} of a Redis URL, as messages name the server: never its
    password.
    """
    try:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            return parts.path or "the configured socket"
        return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
    except ValueError:
        return "the configured address"


class RedisConnection:
    """
    The redis-py client and the scripts, used from the thread pool only
    (its methods are all thread side).
    redis-py keeps a connection pool and connects again after a broken
    connection; each command is retried once on a connection error (every
    script here is safe to run twice: its members are named by the caller,
    and a daily count run twice only counts more, never less).
    """

    def __init__(self, url: str) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.where = describe(url)
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 1),
        )
        self.lease = self.client.register_script(LEASE)
        self.refresh = self.client.register_script(REFRESH)
        self.rates = self.client.register_script(RATES)
        self.tokens = self.client.register_script(TOKENS)
        self.seed = self.client.register_script(SEED)

    def thd_call(self, script: Any, keys: list[str], args: list[object]) -> Any:
        """
        Run C{script}.

        @raise StoreUnavailable: Redis cannot be reached or answered with
            an error; the message names it.
        """
        import redis

        try:
            return script(keys=keys, args=args)
        except redis.RedisError as e:
            raise StoreUnavailable(f"Redis at {self.where} is unreachable: {e}") from None

    def thd_release(self, where: str, member: str) -> None:
        """
        Remove lease C{member} from set C{where}.

        @raise StoreUnavailable: As L{thd_call}.
        """
        import redis

        try:
            self.client.zrem(where, member)
        except redis.RedisError as e:
            raise StoreUnavailable(f"Redis at {self.where} is unreachable: {e}") from None

    def thd_close(self) -> None:
        self.client.close()


def _limit(value: int | None) -> int:
    return -1 if value is None else value


@implementer(IQuotas)
class RedisQuotas:
    """
    L{IQuotas} in a shared Redis. Counted tokens also go to C{ledger} (the
    node's in-memory L{Quotas}), whose day totals L{blazar.storeservice}
    writes to the store as before, for the usage the store reports.

    @param url: The C{[cluster] redis} URL.
    @param reactor: Schedules the lease refreshes and runs the thread pool.
    @param ledger: Where counted tokens are kept for the store.
    @param lease_secs: How long a lease outlives its holder's last refresh.
    @param threads: The most threads of its pool talking to Redis at once.
    @param in_thread: Runs a blocking function off the reactor and gives
        its result as a Deferred (tests); L{None}: the pool.
    @param day_used: A key owner's tokens today as the durable store and
        this node's unwritten rows have them: what a lost day counter is
        seeded with (L{None}: a lost counter starts again from 0).
    """

    def __init__(
        self,
        url: str,
        reactor: Any,
        ledger: Quotas | None = None,
        lease_secs: float = LEASE_SECS,
        threads: int = 4,
        in_thread: Callable[..., Deferred[Any]] | None = None,
        day_used: Callable[[str], Deferred[int]] | None = None,
    ) -> None:
        self._reactor = reactor
        self._connection = RedisConnection(url)
        self.where = self._connection.where
        self._ledger = ledger
        self._lease_ms = int(lease_secs * 1000)
        self._pool = ThreadPool(minthreads=1, maxthreads=threads, name="blazar-redis")
        self._in_thread = in_thread or (lambda f, *a: deferToThreadPool(reactor, self._pool, f, *a))
        self._node = uuid.uuid4().hex[:12]
        # the leases this node holds: set key -> members (reactor thread only)
        self._held: dict[str, set[str]] = {}
        self._refresher = LoopingCall(self.refresh)
        self._refresher.clock = reactor
        self._lease_secs = lease_secs
        self._in_pool = in_thread is None
        self._day_used = day_used
        # tokens not counted into the day while Redis was unreachable: (key, tokens), counted by refresh()
        self._unsent: list[tuple[KeyConfig, int]] = []

    def start(self) -> None:
        """
        Start the thread pool and the lease refreshes.
        """
        if self._in_pool:
            self._pool.start()
        self._refresher.start(self._lease_secs / 3, now=False).addErrback(
            lambda f: log.failure("the Redis lease refresher stopped", f)
        )

    def stop(self) -> None:
        """
        Stop refreshing, close the connections and the thread pool (leases
        still held expire by themselves).
        """
        if self._refresher.running:
            self._refresher.stop()
        if self._in_pool:
            self._pool.callInThread(self._connection.thd_close)
            self._pool.stop()
        else:
            self._connection.thd_close()

    def _run(self, script: Any, keys: list[str], args: list[object]) -> Deferred[Any]:
        return self._in_thread(self._connection.thd_call, script, keys, args)

    def _member(self) -> str:
        return f"{self._node}-{uuid.uuid4().hex[:16]}"

    @staticmethod
    def _key(key: KeyConfig, what: str) -> str:
        return f"blazar:q:{{{key.owner}}}:{what}"

    # -- IQuotas -------------------------------------------------------------

    def take_lease(self, key: KeyConfig) -> Deferred[object]:
        if key.max_concurrent is None:
            return succeed(None)
        where, member = self._key(key, "lease"), self._member()

        def taken(result: list[int]) -> object:
            if result[0] != 0:
                raise QuotaExceeded(
                    f"key {key.name!r} already has {key.max_concurrent} request(s) running "
                    "(max_concurrent); retry when one finishes",
                    1.0,
                )
            self._held.setdefault(where, set()).add(member)
            return (where, member)

        return self._run(self._connection.lease, [where], [key.max_concurrent, member, self._lease_ms]).addCallback(
            taken
        )

    def give_lease(self, key: KeyConfig, lease: object) -> Deferred[None]:
        if not isinstance(lease, tuple):
            return succeed(None)
        where, member = lease
        members = self._held.get(where)
        if members is not None:
            members.discard(member)
            if not members:
                del self._held[where]
        return self._in_thread(self._connection.thd_release, where, member)

    def check_rates(self, key: KeyConfig) -> Deferred[None]:
        return self._rates(key, key.tpm, key.daily_tokens)

    def check_requests(self, key: KeyConfig) -> Deferred[None]:
        return self._rates(key, None, None)

    def _rates(self, key: KeyConfig, tpm: int | None, daily: int | None) -> Deferred[None]:
        if key.rpm is None and tpm is None and daily is None:
            return succeed(None)
        keys = [self._key(key, "rpm"), self._key(key, "tpm:s"), self._key(key, "day:")]
        seed = int(daily is not None and self._day_used is not None)
        args: list[object] = [_limit(key.rpm), _limit(tpm), _limit(daily), self._member(), 1, seed]

        def checked(result: list[int]) -> Deferred[None] | None:
            if result[0] == 4:
                # the day's counter is gone: seed it, then check once more (not seeding again)
                again = [*args[:-1], 0]
                return self._seed(key, result[1]).addCallback(
                    lambda _: self._run(self._connection.rates, keys, again).addCallback(checked)
                )
            if result[0] == 1:
                raise QuotaExceeded(
                    f"key {key.name!r} is over its {key.rpm} requests per minute (rpm)",
                    max(1.0, result[1] / 1000),
                )
            if result[0] == 2:
                raise QuotaExceeded(
                    f"key {key.name!r} used {result[1]} tokens in the last minute, over its tpm of {key.tpm}",
                    max(1.0, result[2] / 1000),
                )
            if result[0] == 3:
                raise QuotaExceeded(
                    f"key {key.name!r} used its {key.daily_tokens} daily_tokens for today (UTC)",
                    max(1.0, float(result[2])),
                )
            return None

        return self._run(self._connection.rates, keys, args).addCallback(checked)

    def _seed(self, key: KeyConfig, day: int) -> Deferred[None]:
        """
        Set C{key}'s counter of day C{day} (days since the epoch, Redis's)
        to what the store says it used today, unless another node did first.
        """
        assert self._day_used is not None
        where = self._key(key, "day:")

        def seed(used: int) -> Deferred[None]:
            log.info(
                "Redis had no token count for key {key} today: seeded it with {used} from the store",
                key=key.name,
                used=used,
            )
            return self._run(self._connection.seed, [where], [day, used]).addCallback(lambda _: None)

        return self._day_used(key.owner).addCallback(seed)

    def count_tokens(self, key: KeyConfig, tokens: int) -> Deferred[None]:
        if tokens <= 0 or (key.tpm is None and key.daily_tokens is None):
            return succeed(None)
        if self._ledger is not None:
            self._ledger.record(key, tokens)
        return self._count(key, tokens, key.tpm is not None)

    def _count(self, key: KeyConfig, tokens: int, minute: bool) -> Deferred[None]:
        """
        Count C{tokens} into C{key}'s minute window (if C{minute}) and day;
        a missing day counter is seeded (the seed holds these tokens, which
        the ledger had before the store was read); tokens Redis could not
        take are kept for L{refresh}, and the failure passed on.
        """
        keys = [self._key(key, "tpm:s"), self._key(key, "day:")]
        daily = key.daily_tokens is not None
        args: list[object] = [
            tokens,
            self._member(),
            int(minute),
            int(daily),
            int(daily and self._day_used is not None),
        ]

        def counted(result: list[int]) -> Deferred[None] | None:
            if result[0] == 1:
                return self._seed(key, result[1])
            return None

        def unsent(f: Failure) -> Failure:
            if f.check(StoreUnavailable) and daily:
                self._unsent.append((key, tokens))
            return f

        return self._run(self._connection.tokens, keys, args).addCallbacks(counted, unsent)

    # -- the holder's refreshes ----------------------------------------------

    def refresh(self) -> Deferred[None]:
        """
        Push out the expiry of every lease this node holds (one script per
        key); a failure is logged and the next round tries again.
        """
        held = [(where, sorted(members)) for where, members in self._held.items() if members]
        d = self._in_thread(self._thd_refresh, held) if held else succeed(None)

        def failed(f: Failure) -> None:
            log.error("refreshing the Redis leases failed: {why}", why=f.getErrorMessage())

        d.addErrback(failed)
        return d.addCallback(lambda _: self._resend())

    def _resend(self) -> Deferred[None]:
        """
        Count into the day the tokens Redis could not take while it was
        unreachable (not into the minute window: they are older than now);
        those it still cannot take are kept for the next round.
        """
        unsent, self._unsent = self._unsent, []
        if not unsent:
            return succeed(None)

        async def resend() -> None:
            for key, tokens in unsent:
                try:
                    await self._count(key, tokens, minute=False)
                except StoreUnavailable:
                    pass  # kept again by _count
                except Exception:
                    log.failure("counting tokens kept while Redis was unreachable failed")

        return Deferred.fromCoroutine(resend())

    def _thd_refresh(self, held: list[tuple[str, list[str]]]) -> None:
        for where, members in held:
            self._connection.thd_call(self._connection.refresh, [where], [self._lease_ms, *members])
