"""
The semantic cache's live state (issue 26, part 2): the in-memory
L{blazar.gateway.cache.SemanticIndex} and the C{cache_entries} rows it
mirrors in SQLite (L{blazar.store}, migration 6), kept in step. The
pipeline's cache step (L{blazar.gateway.pipeline.Pipeline._cached}) looks
answers up here and stores them; L{blazar.storeservice.CacheService} runs it
(the load at start, the purge job) on the one store thread.

Every database call goes through the injected C{run_db} (the store's own
thread); the index is touched only on the reactor thread. Times are wall
clock UNIX seconds (the rows outlive the daemon).
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from blazar import store
from blazar.config import CacheConfig
from blazar.gateway.cache import Entry, SemanticIndex, Vector, from_blob, to_blob

log = Logger()

#: ids below the highest one read that a sync reads again: on PostgreSQL an id is taken when a
#: row is inserted, so a row of a transaction that commits later than a higher id's is still seen
SYNC_LOOKBACK = 1000


class CacheStore:
    """
    The cache's entries, in memory and in SQLite.

    @ivar index: The entries searched (L{SemanticIndex}).
    @ivar ready: Whether the rows were read back (before that, every
        lookup misses and nothing is stored).
    @ivar pending: Stores not written yet (a stop waits for them).
    """

    def __init__(
        self,
        config: Callable[[], CacheConfig],
        wall: Callable[[], float],
        run_db: Callable[..., Deferred[Any]],
    ) -> None:
        """
        @param config: The live C{[cache]} table (read at each use).
        @param wall: UNIX seconds now.
        @param run_db: C{run_db(f, *args)} runs C{f(db, *args)}, a C{thd_*}
            function of L{blazar.store}, on the database's thread.
        """
        self._config = config
        self._wall = wall
        self._run_db = run_db
        self.index = SemanticIndex()
        self.ready = False
        self.pending: set[Deferred[Any]] = set()
        self._highest = 0  # the highest id read from the store

    async def load(self) -> int:
        """
        Rebuild the index from the live rows (the expired and those beyond
        C{max_entries} are deleted on the way).

        @return: How many entries were loaded.
        """
        config = self._config()
        rows = await self._run_db(store.thd_cache_entries, self._wall() - config.ttl, config.max_entries)
        for id_, scope, created, blob, answer in rows:
            self.index.add(Entry(id_, scope, created, from_blob(blob), answer), config.max_entries)
            self._highest = max(self._highest, id_)
        self.ready = True
        return len(rows)

    async def sync(self) -> int:
        """
        Add to the index the live entries other nodes stored since the last
        read (several nodes sharing one database, C{[cluster] database}):
        the rows above the highest id read (less L{SYNC_LOOKBACK}) that the
        index does not hold.

        @return: How many entries were added.
        """
        if not self.ready:
            return 0
        config = self._config()
        rows = await self._run_db(
            store.thd_cache_entries_after, max(0, self._highest - SYNC_LOOKBACK), self._wall() - config.ttl
        )
        added = 0
        for id_, scope, created, blob, answer in rows:
            self._highest = max(self._highest, id_)
            if id_ not in self.index:
                self.index.add(Entry(id_, scope, created, from_blob(blob), answer), config.max_entries)
                added += 1
        return added

    def lookup(self, scope: str, vector: Vector) -> tuple[float, Entry | None]:
        """
        The live answer for a call of C{scope} whose prompt embeds to
        C{vector}, if one is similar enough (L{SemanticIndex.lookup} with
        the live C{threshold} and C{ttl_secs}).

        @return: The best similarity found and the entry, or L{None}.
        """
        config = self._config()
        if not self.ready:
            return -1.0, None
        return self.index.lookup(scope, vector, self._wall(), config.ttl, config.threshold)

    def store(self, scope: str, vector: Vector, answer: bytes) -> Deferred[Any]:
        """
        Keep C{answer} for calls of C{scope} whose prompts embed close to
        C{vector}: written to SQLite first, then indexed; the expired rows
        and those beyond C{max_entries} go at the same time.

        @return: Fires when stored (never fails: a failure is logged).
        """
        d = Deferred.fromCoroutine(self._store(scope, vector, answer))
        self.pending.add(d)

        def done(result: Any) -> None:
            self.pending.discard(d)
            if isinstance(result, Failure):
                log.failure("storing a semantic cache entry failed", result)

        d.addBoth(done)
        return d

    async def _store(self, scope: str, vector: Vector, answer: bytes) -> None:
        if not self.ready:
            return
        config = self._config()
        created = self._wall()
        id_, dropped = await self._run_db(
            store.thd_put_cache,
            (scope, created, to_blob(vector), answer),
            created - config.ttl,
            config.max_entries,
        )
        for gone in dropped:
            self.index.drop(gone)
        self.index.add(Entry(id_, scope, created, vector, answer), config.max_entries)
        self._highest = max(self._highest, id_)

    async def purge(self) -> int:
        """
        Drop the expired entries, from the index and from SQLite.

        @return: How many rows were deleted.
        """
        if not self.ready:
            return 0
        before = self._wall() - self._config().ttl
        self.index.purge(before)
        return int(await self._run_db(store.thd_purge_cache, before))
