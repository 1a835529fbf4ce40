"""
Blazar's durable state at run time: the one connection to
C{<data_dir>/blazar.db}, or to the PostgreSQL database of C{[cluster]
database} (L{blazar.store}), and the one thread it lives on
(L{StoreService}), and the parts that keep their state in it, each with
its own small API and its own place in the service tree: key usage
(L{UsageStore}), sessions (L{SessionService}), the semantic cache
(L{CacheService}), the Batch API (L{BatchService}), this node's row in
the cluster's node registry (L{NodeHeartbeat}) and, on a cluster's shared
store, the API keys every node shares (L{SharedKeys}). Stored Responses
and C{blazar bench} runs call L{StoreService.run_db} directly.

One open, one drain, one close: the store opens (and migrates) the
database at start, before its parts start; each part's stop hands the
store what it still writes (L{StoreService.hold}), and the store closes
the connection only once all of it is written, so nothing is lost or
half written on stop. Added to the tree before every part, the store is
started before them and stopped after them.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any, Callable, Collection, TypeVar

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred, succeed
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer

from blazar import __version__, store, strictjson
from blazar.config import ConfigError, LiveConfig, SharedKey, node_name, node_url, shared_key
from blazar.engines.client import EngineClient
from blazar.gateway.batch import BatchRunner, LineSender
from blazar.gateway.cachestore import CacheStore
from blazar.gateway.nodes import HEARTBEAT_SECS, live_namesake
from blazar.gateway.quota import Quotas
from blazar.gateway.sessions import EngineSlots, Sessions, sessions_from_rows
from blazar.metrics import Metrics, gauge
from blazar.postgres import StoreUnavailable
from blazar.protocols.keyadmin import ISharedKeys

log = Logger()

T = TypeVar("T")

CACHE_PURGE_SECS = 60.0  # how often expired semantic cache entries are dropped (a lookup skips them anyway)
CACHE_SYNC_SECS = 2.0  # how often a node of a shared database reads the cache entries the others stored
SHARED_KEYS_POLL_SECS = 1.0  # how often a node reads the shared keys' version (a change reaches it within this)


async def settle(pending: Collection[Deferred[Any]]) -> None:
    """
    Wait until C{pending} (a live collection its owner adds to and removes
    from) is empty, whatever its Deferreds' results.
    """
    while pending:
        await DeferredList(list(pending), consumeErrors=True)


class PeriodicJob:
    """
    A part's job run every C{interval} seconds on the injected clock, the
    first time one interval after L{start}. It cannot die: a failure of
    the body (raised, or of the Deferred it returns) is logged as
    C{failed} and the job runs again at the next interval.
    """

    def __init__(self, clock: Any, interval: float, body: Callable[[], object], failed: str) -> None:
        self._clock = clock
        self._interval = interval
        self._body = body
        self._failed = failed
        self._loop: LoopingCall | None = None

    def start(self) -> None:
        self._loop = LoopingCall(lambda: Deferred.fromCoroutine(self._run()))
        self._loop.clock = self._clock
        self._loop.start(self._interval, now=False).addErrback(lambda f: log.failure("a store job stopped", f))

    async def _run(self) -> None:
        try:
            await maybeDeferred(self._body)
        except Exception:
            log.failure(self._failed)

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()


class StoreService(Service):
    """
    The daemon's one connection to its SQLite file (or its PostgreSQL
    database) and the one thread (a pool of one: SQLite connections belong
    to one thread) every database call runs on, in the order it was made.

    @ivar path: The database file (SQLite).
    @ivar url: The PostgreSQL database's URL (C{[cluster] database}), if
        the store is there; then C{path} is unused.
    """

    def __init__(self, path: Path, reactor: Any, pool: ThreadPool | None = None, url: str | None = None) -> None:
        """
        @param pool: The thread the connection lives on (tests pass
            L{blazar.testing.SynchronousThreadPool}).
        """
        self.path = path
        self.url = url
        self._reactor = reactor
        self._pool = pool if pool is not None else ThreadPool(1, 1, name="blazar-store")
        self._db: store.Database | None = None
        self._held: set[Deferred[None]] = set()
        self._start_checks: list[Callable[[store.Database], object]] = []

    @property
    def is_open(self) -> bool:
        """
        Whether the connection is open (from start until the close on stop).
        """
        return self._db is not None

    def run(self, f: Callable[..., T], *args: Any) -> Deferred[T]:
        """
        C{f(*args)} on the store's thread, after the calls made before it.
        """
        return deferToThreadPool(self._reactor, self._pool, f, *args)

    def run_db(self, f: Callable[..., T], *args: Any) -> Deferred[T]:
        """
        C{f(db, *args)} on the store's thread: a C{thd_*} function of
        L{blazar.store} given the connection.
        """
        return self.run(f, self._db, *args)

    def run_db_now(self, f: Callable[..., T], *args: Any) -> T:
        """
        C{f(db, *args)} on the store's thread, waited for: for a part's
        short read at start, before the daemon serves, only.

        @raise Exception: What C{f} raised.
        """
        return self._call_now(f, self._db, *args)

    def _call_now(self, f: Callable[..., T], *args: Any) -> T:
        box: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._pool.callInThreadWithCallback(lambda ok, value: box.put((ok, value)), f, *args)
        ok, value = box.get()
        if not ok:
            value.raiseException()
        return value

    def hold(self, d: Deferred[T]) -> Deferred[T]:
        """
        Keep the connection open until C{d} (a part's stop, with the writes
        it still makes) has fired.

        @return: C{d}, its result untouched.
        """
        done: Deferred[None] = Deferred()
        self._held.add(done)
        done.addBoth(lambda _: self._held.discard(done))

        def fired(result: Any) -> Any:
            done.callback(None)
            return result

        return d.addBoth(fired)

    def add_start_check(self, check: Callable[[store.Database], object]) -> None:
        """
        Run C{check(db)} on the store's thread right after the open at
        start, before any part starts (L{NodeHeartbeat.thd_refuse_a_live_namesake}).
        What it raises stops the start as an unreachable server does: the
        connection closed, the thread stopped, the exception raised from
        L{startService} (twistd exits non-zero with its message).
        """
        self._start_checks.append(check)

    def startService(self) -> None:
        Service.startService(self)
        self._pool.start()
        # at start, before serving: a short blocking open (and migration) and
        # the start checks; an unreachable PostgreSQL or a failed check stops
        # the start, naming the server or the problem (the pool stopped first:
        # its thread would keep the failed process alive)
        try:
            db: store.Database
            if self.url is not None:
                db = self._call_now(store.thd_open_postgres, self.url)
            else:
                db = self._call_now(store.thd_open, self.path)
            try:
                for check in self._start_checks:
                    self._call_now(check, db)
            except BaseException:
                self._call_now(db.close)
                raise
            self._db = db
        except BaseException:
            self._pool.stop()
            Service.stopService(self)
            raise

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)

        async def close() -> None:
            await settle(self._held)
            if self._db is not None:
                db, self._db = self._db, None
                await self.run(db.close)

        def stop_pool(result: Any) -> Any:
            self._pool.stop()
            return result

        return Deferred.fromCoroutine(close()).addBoth(stop_pool)


class UsageStore(Service):
    """
    Keeps per-key day token totals in the store: reads today's back into
    the quotas at start, writes new usage in batches (one transaction a
    second), and flushes on stop.
    """

    def __init__(self, database: StoreService, quotas: Quotas, reactor: Any) -> None:
        self._database = database
        self._quotas = quotas
        self._flusher = PeriodicJob(reactor, 1.0, self.flush, "writing key usage failed")

    def startService(self) -> None:
        Service.startService(self)
        day = self._quotas.today()
        self._quotas.load_day(day, self._database.run_db_now(store.thd_day_usage, day))
        self._flusher.start()

    def flush(self) -> Deferred[Any]:
        rows = self._quotas.take_pending()
        if not rows or not self._database.is_open:
            return succeed(None)
        d = self._database.run_db(store.thd_add_usage, rows)

        def failed(f: Any) -> None:
            log.failure("writing key usage failed; will retry", f)
            self._quotas.put_back(rows)

        return d.addErrback(failed)

    def stopService(self) -> Deferred[Any]:
        Service.stopService(self)
        self._flusher.stop()
        return self._database.hold(self.flush())

    def day_used(self, owner: str) -> Deferred[int]:
        """
        Tokens key C{owner} used today: the store's rows (every node's, on
        a shared store) and this node's not yet written.
        """
        day = self._quotas.today()
        return self._database.run_db(store.thd_day_usage, day).addCallback(
            lambda usage: usage.get(owner, 0) + self._quotas.unwritten(day, owner)
        )


class SessionService(Service):
    """
    Runs L{blazar.gateway.sessions.Sessions}: its rows in the store, read
    back at start; the reaper of sessions unused for C{session_keep_secs},
    once a minute. Added before the supervisor, it is stopped after it: it
    waits for the saves the children's stops begin.

    Each row names this node (C{blazar.config.node_name}) and the URL
    other nodes reach it at (C{blazar.config.node_url}): with C{[cluster]
    database}, the KV bank's index the nodes share; a node reads back only
    its own rows, and writes a bank save or deletes a row only while the
    row still names it (another node may have taken the session over).
    """

    def __init__(
        self, database: StoreService, live: LiveConfig, engines: EngineClient, reactor: Any, metrics: Metrics
    ) -> None:
        self._database = database
        self.node, self.url = node_name(live.current), node_url(live.current)
        self._reaper = PeriodicJob(reactor, 60.0, lambda: self.sessions.expire(), "expiring sessions failed")

        def settings() -> tuple[float, float, int, int]:
            c = live.current
            return (
                c.session_keep,
                c.session_save_timeout,
                c.session_bank_entry_max_mib << 20,
                c.session_bank_max_mib << 20,
            )

        self.sessions = Sessions(
            reactor,
            EngineSlots(engines, reactor),
            lambda: live.current.data_dir,
            settings,
            database.run,
            persist=self._persist,
            forget=self._forget,
            count=lambda op, result: metrics.session_bank.labels(op, result).inc(),
            claim=lambda session: self._persist(session, claim=True),
            node=self.node,
        )
        if live.current.cluster.database is not None:
            self.sessions.index = self.index  # (one node's own database lists only its own)
        metrics.gauges(
            lambda: [
                gauge(
                    "blazar_sessions",
                    "Sessions kept (blazar.gateway.sessions), by model and whether saved to the bank",
                    ["model", "saved"],
                    self._counts(),
                )
            ]
        )

    def _counts(self) -> list[tuple[list[str], float]]:
        counts: dict[tuple[str, str], int] = {}
        for session in self.sessions.of_key(None):
            label = (session.model, "true" if session.bank is not None else "false")
            counts[label] = counts.get(label, 0) + 1
        return [([m, saved], n) for (m, saved), n in sorted(counts.items())]

    def _db_call(self, f: Any, *args: Any) -> Deferred[Any]:
        if not self._database.is_open:
            return succeed(None)
        return self._database.run_db(f, *args)

    def _persist(self, session: Any, claim: bool = False) -> Deferred[Any]:
        bank = session.bank
        row = (
            session.key,
            session.name,
            session.model,
            bank.file if bank else None,
            bank.tokens if bank else 0,
            bank.size if bank else 0,
            bank.shape if bank else "",
            bank.saved_at if bank else 0.0,
            session.last_used,
            self.node,
            self.url,
        )
        return self._db_call(store.thd_put_session, row, claim)

    def _forget(self, session: Any) -> Deferred[Any]:
        return self._db_call(store.thd_delete_session, session.key, session.name, session.model, self.node)

    def holders(self, key: str, name: str) -> Deferred[list[tuple[str, str, str, float]]]:
        """
        Which nodes hold C{key}'s sessions named C{name}, by the index
        (L{blazar.store.thd_session_holders}); none while the store is
        closed.
        """
        if not self._database.is_open:
            return succeed([])
        return self._database.run_db(store.thd_session_holders, key, name)

    def index(self, key: str | None) -> Deferred[list[tuple[str, str, str, str, float]]]:
        """
        Every node's sessions of C{key} (L{blazar.store.thd_session_index}).
        """
        if not self._database.is_open:
            return succeed([])
        return self._database.run_db(store.thd_session_index, key)

    def startService(self) -> None:
        Service.startService(self)
        self.sessions.load(sessions_from_rows(self._database.run_db_now(store.thd_sessions, self.node)))
        self._reaper.start()

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        self._reaper.stop()
        return self._database.hold(Deferred.fromCoroutine(settle(self.sessions.pending)))


class CacheService(Service):
    """
    Runs the semantic cache's L{CacheStore}: its rows in the store, read
    back into the index after start (lookups miss until then), and a purge
    of the expired entries every L{CACHE_PURGE_SECS}; on a database that
    several nodes share, the entries the others store are read into the
    index every L{CACHE_SYNC_SECS}. On stop it waits for the stores in
    flight.

    @ivar cache: The entries the pipeline looks answers up in.
    @ivar started: Fires when the rows are read back.
    """

    def __init__(
        self, database: StoreService, live: LiveConfig, reactor: Any, wall: Callable[[], float] = time.time
    ) -> None:
        self._database = database
        self.started: Deferred[None] | None = None
        self.cache = CacheStore(lambda: live.current.cache, wall, database.run_db)
        self._purger = PeriodicJob(
            reactor,
            CACHE_PURGE_SECS,
            lambda: Deferred.fromCoroutine(self.cache.purge()),
            "purging the semantic cache failed; will retry",
        )
        self._syncer = (
            PeriodicJob(
                reactor,
                CACHE_SYNC_SECS,
                lambda: Deferred.fromCoroutine(self.cache.sync()),
                "reading the other nodes' semantic cache entries failed; will retry",
            )
            if live.current.cluster.database is not None
            else None
        )

    def startService(self) -> None:
        Service.startService(self)
        self.started = Deferred.fromCoroutine(self._load())
        self.started.addErrback(lambda f: log.failure("the semantic cache did not start; every lookup misses", f))
        self._purger.start()
        if self._syncer is not None:
            self._syncer.start()

    async def _load(self) -> None:
        loaded = await self.cache.load()
        if loaded:
            log.info("semantic cache: {count} entries read back", count=loaded)

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        self._purger.stop()
        if self._syncer is not None:
            self._syncer.stop()
        return self._database.hold(Deferred.fromCoroutine(settle(self.cache.pending)))


class BatchService(Service):
    """
    Runs the Batch API's runner (L{blazar.gateway.batch.BatchRunner}, its
    rows in the store): resumes unfinished batches at start; on stop waits
    for the lines in flight (recorded before the store closes), then closes
    the line sender's connections.
    """

    def __init__(self, database: StoreService, runner: BatchRunner, sender: LineSender) -> None:
        self._database = database
        self.runner = runner
        self._sender = sender

    def startService(self) -> None:
        Service.startService(self)
        Deferred.fromCoroutine(self.runner.start()).addErrback(lambda f: log.failure("resuming batches failed", f))

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)

        async def stop() -> None:
            await self.runner.stop()
            await self._sender.close()

        return self._database.hold(Deferred.fromCoroutine(stop()))


# a shared keys' poll reads every row, not only the version, once in this many polls
FULL_READ_POLLS = 60


@implementer(ISharedKeys)
class SharedKeys(Service):
    """
    The API keys every node of a cluster shares (C{[cluster] database};
    the table of L{blazar.store.thd_shared_keys}): read at start, before
    the daemon serves (a node never answers as keyless while shared keys
    exist), then every L{SHARED_KEYS_POLL_SECS} on the injected clock,
    one integer (the version) while nothing changed, every row when it
    did (whether the version went up or back: a failover to a replica or a
    restored backup can move it back) and every L{FULL_READ_POLLS} polls
    whatever it says; each read makes a new L{keys} tuple, which the door's
    L{blazar.web.auth.KeyHolder} merges with the config file's keys.

    While the store cannot be reached the node keeps the keys it last read
    (and says so once in its log), and changes fail with
    L{StoreUnavailable}. A row this Blazar cannot read (a field it does not
    know, a value it does not take) is left out, logged once per version.

    @ivar keys: The shared keys last read.
    """

    def __init__(
        self,
        database: StoreService,
        live: LiveConfig,
        reactor: Any,
        interval: float = SHARED_KEYS_POLL_SECS,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """
        @param interval: Seconds between two polls (a change made on
            another node is used here within it).
        @param wall: The clock a rotation's time is stamped with.
        """
        self._database = database
        self._wall = wall
        self._live = live
        self.keys: tuple[SharedKey, ...] = ()
        self._version: int | None = None
        self._rows: list[store.SharedKeyRow] = []
        self._polls = 0
        self._down = False
        self._pending: set[Deferred[Any]] = set()
        self._poller = PeriodicJob(reactor, interval, self.poll, "reading the shared API keys failed; will retry")

    def startService(self) -> None:
        Service.startService(self)
        self._apply(*self._database.run_db_now(store.thd_shared_keys))
        self._poller.start()

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        self._poller.stop()
        return self._database.hold(Deferred.fromCoroutine(settle(self._pending)))

    def _run(self, f: Callable[..., T], *args: Any) -> Deferred[T]:
        d = self._database.run_db(f, *args)
        self._pending.add(d)

        def done(result: Any) -> Any:
            self._pending.discard(d)
            return result

        return d.addBoth(done)

    def poll(self) -> Deferred[None]:
        """
        Read the shared keys if their version moved; a store that cannot
        be reached keeps the last set (logged once, and once when it is
        back).
        """
        return Deferred.fromCoroutine(self._poll())

    async def _poll(self) -> None:
        if not self._database.is_open:
            return
        self._polls += 1
        # every FULL_READ_POLLS polls every row, whatever the version says: a counter that went back
        # (a failover to a replica that lagged, a restored backup) must not hide a change for good
        since = None if self._polls % FULL_READ_POLLS == 0 else self._version
        try:
            read = await self._run(store.thd_shared_keys_since, since)
        except StoreUnavailable as e:
            if not self._down:
                self._down = True
                log.error(
                    "the shared API keys cannot be read ({why}); this node keeps the {count} it last read "
                    "until the store is back",
                    why=str(e),
                    count=len(self.keys),
                )
            return
        if self._down:
            self._down = False
            log.info("the shared API keys are read again: the store is back")
        if read is not None:
            self._apply(*read)

    def _apply(self, version: int, rows: list[store.SharedKeyRow]) -> None:
        # any version read is the store's state now, lower or higher: the store's reads run one
        # at a time, in order, so no read overtakes a later one; a counter that went back (a
        # failover, a restore) is taken as it is
        if version == self._version and rows == self._rows:
            return  # (a full read that found nothing new: the door's tables stay)
        remotes = self._live.current.remotes
        keys = []
        for name, key_id, digest, hint, settings, _ in rows:
            try:
                keys.append(shared_key(name, key_id, digest, hint, strictjson.loads(settings), remotes))
            except (ConfigError, ValueError) as e:
                log.error("the shared key {name!r} is left out: {why}", name=name, why=str(e))
        self.keys, self._version, self._rows = tuple(keys), version, rows

    async def add(self, row: tuple[str, str, str, str, str, float]) -> None:
        await self._run(store.thd_add_shared_key, row)
        await self._poll()

    async def rotate(self, name: str, digest: str, hint: str) -> None:
        await self._run(store.thd_rotate_shared_key, name, digest, hint, self._wall())
        await self._poll()

    async def remove(self, name: str, local_unscoped: bool, local_scoped: bool) -> None:
        await self._run(store.thd_remove_shared_key, name, local_unscoped, local_scoped)
        await self._poll()


class NodeNameTaken(Exception):
    """
    Another node of this node's name (C{[cluster] node}) is up at another
    URL; the message says which and what to change.
    """


class NodeHeartbeat(Service):
    """
    This node's row in the store's C{nodes} table (L{blazar.gateway.nodes}):
    written at start, then every L{HEARTBEAT_SECS} on the injected clock
    (a failed write is logged and tried again at the next beat), and
    marked stopped, with no models, on a clean stop (held until written
    before the store closes). Started once the node serves, stopped first.
    Its name is checked earlier, at the store's open
    (L{thd_refuse_a_live_namesake}), before the batch runner takes back
    the lines of this name's earlier life.

    @ivar started: UNIX seconds this node started (its row's C{started}).
    """

    def __init__(
        self,
        database: StoreService,
        name: str,
        url: str,
        models: Callable[[], list[dict[str, Any]]],
        reactor: Any,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """
        @param name: This node's name (L{blazar.config.node_name}).
        @param url: Where the other nodes reach it (L{blazar.config.node_url}).
        @param models: What it runs now (L{blazar.gateway.nodes.model_rows}),
            read on the reactor thread at each beat.
        @param wall: UNIX seconds now.
        """
        self._database = database
        self._name = name
        self._url = url
        self._models = models
        self._wall = wall
        self.started = 0.0
        self._unwritten = False  # the last beat found the store unreachable (logged once)
        self._beat = PeriodicJob(reactor, HEARTBEAT_SECS, self.beat, "writing this node's heartbeat failed; will retry")

    def thd_refuse_a_live_namesake(self, db: store.Database) -> None:
        """
        On the store's thread, at its open (L{StoreService.add_start_check}):
        read this node's row and refuse to start while another node of
        this name is up at another URL (L{blazar.gateway.nodes.live_namesake}).

        @raise NodeNameTaken: Such a node is up; the message names it and
            the C{[cluster] node} key.
        """
        for row in store.thd_nodes(db, self._name):
            problem = live_namesake(row, self._url, self._wall())
            if problem is not None:
                raise NodeNameTaken(problem)

    def _row(self, stopped: bool) -> store.NodeRow:
        models = [] if stopped else self._models()
        return (self._name, self._url, __version__, self.started, self._wall(), stopped, strictjson.encode(models))

    def beat(self) -> Deferred[None]:
        """
        Write this node's row now (what it runs, the time). An unreachable
        store is logged once until a beat is written again (the other
        nodes show this one unreachable meanwhile); anything else fails
        the returned Deferred.
        """
        if not self._database.is_open:
            return succeed(None)
        return Deferred.fromCoroutine(self._write(self._row(False)))

    async def _write(self, row: store.NodeRow) -> None:
        try:
            await self._database.run_db(store.thd_put_node, row)
        except store.StoreUnavailable as e:
            if not self._unwritten:
                self._unwritten = True
                log.error(
                    "this node's heartbeat cannot be written ({error}): the other nodes show it unreachable "
                    "until it is; will retry every {every} s",
                    error=str(e),
                    every=HEARTBEAT_SECS,
                )
            return
        if self._unwritten:
            self._unwritten = False
            log.info("this node's heartbeat is written again")

    def startService(self) -> None:
        Service.startService(self)
        self.started = self._wall()
        self.beat().addErrback(lambda f: log.failure("writing this node's first heartbeat failed; will retry", f))
        self._beat.start()

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        self._beat.stop()
        if not self._database.is_open:
            return succeed(None)

        def not_marked(f: Any) -> None:
            if f.check(store.StoreUnavailable):
                log.error("this node could not mark itself stopped ({error}): it shows unreachable", error=str(f.value))
            else:
                log.failure("marking this node stopped failed: it shows unreachable instead", f)

        return self._database.hold(self._database.run_db(store.thd_put_node, self._row(True)).addErrback(not_marked))
