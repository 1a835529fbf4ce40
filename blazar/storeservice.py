"""
Blazar's durable state at run time: the one connection to
C{<data_dir>/blazar.db}, or to the PostgreSQL database of C{[cluster]
database} (L{blazar.store}), and the one thread it lives on
(L{StoreService}), and the parts that keep their state in it, each with
its own small API and its own place in the service tree: key usage
(L{UsageStore}), sessions (L{SessionService}), the semantic cache
(L{CacheService}) and the Batch API (L{BatchService}). Stored Responses
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

from blazar import store
from blazar.config import LiveConfig, node_name, node_url
from blazar.engines.client import EngineClient
from blazar.gateway.batch import BatchRunner, LineSender
from blazar.gateway.cachestore import CacheStore
from blazar.gateway.quota import Quotas
from blazar.gateway.sessions import EngineSlots, Sessions, sessions_from_rows
from blazar.metrics import Metrics, gauge

log = Logger()

T = TypeVar("T")

CACHE_PURGE_SECS = 60.0  # how often expired semantic cache entries are dropped (a lookup skips them anyway)


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

    def startService(self) -> None:
        Service.startService(self)
        self._pool.start()
        # at start, before serving: a short blocking open (and migration); an
        # unreachable PostgreSQL stops the start, naming the server
        if self.url is not None:
            self._db = self._call_now(store.thd_open_postgres, self.url)
        else:
            self._db = self._call_now(store.thd_open, self.path)

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
            self._quotas._pending[:0] = rows

        return d.addErrback(failed)

    def stopService(self) -> Deferred[Any]:
        Service.stopService(self)
        self._flusher.stop()
        return self._database.hold(self.flush())


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
    of the expired entries every L{CACHE_PURGE_SECS}. On stop it waits for
    the stores in flight.

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

    def startService(self) -> None:
        Service.startService(self)
        self.started = Deferred.fromCoroutine(self._load())
        self.started.addErrback(lambda f: log.failure("the semantic cache did not start; every lookup misses", f))
        self._purger.start()

    async def _load(self) -> None:
        loaded = await self.cache.load()
        if loaded:
            log.info("semantic cache: {count} entries read back", count=loaded)

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        self._purger.stop()
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
