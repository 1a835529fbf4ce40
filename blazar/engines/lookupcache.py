"""
The n-gram lookup cache of each C{speculative = "ngram"} (or C{"auto"})
model, kept by Blazar from the model's own answers.

llama-server's C{ngram-cache} drafter reads a dynamic lookup cache at
start (C{-lcd FILE}: n-grams of one to four tokens, each with the tokens
that followed it and how often) and drafts from it where the context has
nothing, but the pinned engine never writes that file
(C{common_speculative_impl_ngram_cache}: C{save_dynamic} is always
false). So Blazar writes it: each answer's text, tokenized by the child
that wrote it (its C{/tokenize}), is counted into the model's cache as
llama.cpp's C{common_ngram_cache_update} counts a context, and the cache
is written in the engine's own format (C{common_ngram_cache_save}) to
C{<data_dir>/speccache/<model>/lookup-dynamic.bin}: a few seconds after
new answers, and at stop. The next child of the model (after an idle
reload, an eviction or a daemon restart) loads it: an answer seen before
is drafted from it, where a fresh cache drafts nothing.

The engine drafts from this cache only with enough evidence (an n-gram
seen at least twice, the drafted token at least two thirds of the time:
C{draft_min_sample_size_strict}), so counts add up over many answers;
the cache keeps at most L{MAX_NGRAMS} n-grams, dropping the rarest first.

Every read and write of a model's counts runs in the thread pool, under
the model's lock: counting an answer and writing the file (a few MB at
most) never block the reactor. The file is written whole to a temporary
name and renamed over the old one (mode 0600, in a 0700 directory), so a
child never loads half of one.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from blazar.files import private_dir, write_whole

log = Logger()

# llama.cpp's common/ngram-cache.h
NGRAM_MIN = 1
NGRAM_MAX = 4
TOKEN_NULL = -1
_NGRAM = struct.Struct(f"<{NGRAM_MAX}i")
_INT = struct.Struct("<i")
_PAIR = struct.Struct("<ii")

# n-grams kept per model (about 40 bytes each in the file)
MAX_NGRAMS = 200_000
# seconds between writes of a cache that counted new answers
SAVE_EVERY = 5.0

Ngram = tuple[int, ...]


class NgramCounts:
    """
    One model's n-gram counts: for each n-gram (1 to 4 tokens, padded with
    L{TOKEN_NULL} to 4, as llama.cpp's C{common_ngram}) the tokens that
    followed it and how often.
    """

    def __init__(self, max_ngrams: int = MAX_NGRAMS) -> None:
        self.max_ngrams = max_ngrams
        self.ngrams: dict[Ngram, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.ngrams)

    def update(self, tokens: list[int]) -> None:
        """
        Count C{tokens} as C{common_ngram_cache_update} counts a whole
        context: every n-gram of 1 to 4 tokens and the token after it.
        """
        pad = (TOKEN_NULL,) * NGRAM_MAX
        for size in range(NGRAM_MIN, NGRAM_MAX + 1):
            for i in range(size, len(tokens)):
                key = (*tokens[i - size : i], *pad[size:])
                following = self.ngrams.get(key)
                if following is None:
                    self.ngrams[key] = {tokens[i]: 1}
                else:
                    following[tokens[i]] = following.get(tokens[i], 0) + 1
        if len(self.ngrams) > self.max_ngrams:
            self._prune()

    def _prune(self) -> None:
        """
        Keep the 90% of L{max_ngrams} n-grams seen most often.
        """
        keep = int(self.max_ngrams * 0.9)
        ranked = sorted(self.ngrams.items(), key=lambda item: sum(item[1].values()), reverse=True)
        self.ngrams = dict(ranked[:keep])

    def merge(self, other: NgramCounts) -> None:
        """
        Add C{other}'s counts (C{common_ngram_cache_merge}).
        """
        for key, part in other.ngrams.items():
            mine = self.ngrams.setdefault(key, {})
            for token, count in part.items():
                mine[token] = mine.get(token, 0) + count
        if len(self.ngrams) > self.max_ngrams:
            self._prune()

    def to_bytes(self) -> bytes:
        """
        The counts in C{common_ngram_cache_save}'s format: per n-gram its 4
        tokens, the number of following tokens, then each token and its
        count (int32, little-endian).
        """
        out = bytearray()
        for key, part in self.ngrams.items():
            out += _NGRAM.pack(*key)
            out += _INT.pack(len(part))
            for token, count in part.items():
                out += _PAIR.pack(token, min(count, 2**31 - 1))
        return bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes, max_ngrams: int = MAX_NGRAMS) -> NgramCounts:
        """
        Counts read from C{common_ngram_cache_save}'s format.

        @raise ValueError: C{data} is not a whole cache.
        """
        counts = cls(max_ngrams)
        at, end = 0, len(data)
        while at < end:
            if end - at < _NGRAM.size + _INT.size:
                raise ValueError(f"a cut n-gram at byte {at}")
            key = _NGRAM.unpack_from(data, at)
            (n,) = _INT.unpack_from(data, at + _NGRAM.size)
            at += _NGRAM.size + _INT.size
            if n <= 0 or end - at < n * _PAIR.size:
                raise ValueError(f"a bad token count at byte {at}")
            part = counts.ngrams.setdefault(key, {})
            for token, count in _PAIR.iter_unpack(data[at : at + n * _PAIR.size]):
                if count <= 0:
                    raise ValueError(f"a count of {count} at byte {at}")
                part[token] = part.get(token, 0) + count
            at += n * _PAIR.size
        return counts


class ModelCache:
    """
    One model's counts and its file. Every method runs in the thread
    pool (C{thd_}): the lock keeps counting and writing apart.
    """

    def __init__(self, path: Path, max_ngrams: int = MAX_NGRAMS) -> None:
        self.path = path
        self.counts = NgramCounts(max_ngrams)
        self.lock = threading.Lock()
        self.loaded = False
        self.dirty = False

    def _load(self) -> str | None:
        # the file's counts first, so a write keeps what earlier children's answers taught;
        # what was wrong with it, for the reactor to log (nothing here touches Twisted)
        if self.loaded:
            return None
        self.loaded = True
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            self.counts.merge(NgramCounts.from_bytes(data, self.counts.max_ngrams))
        except ValueError as e:
            return str(e)
        return None

    def thd_add(self, tokens: list[int]) -> str | None:
        """
        Count C{tokens}; the first time, read the file's counts first.

        @return: Why the file could not be read (it is started afresh), or
            L{None}.
        """
        with self.lock:
            why = self._load()
            self.counts.update(tokens)
            self.dirty = True
        return why

    def thd_save(self) -> bool:
        """
        Write the counts if they changed; C{True} if it wrote.
        """
        with self.lock:
            if not self.dirty:
                return False
            data = self.counts.to_bytes()
            self.dirty = False
        try:
            if not self.path.parent.is_dir():
                private_dir(self.path.parent.parent)
                private_dir(self.path.parent)
            write_whole(
                self.path.with_name(self.path.name + ".tmp"), self.path, lambda out: out.write(data), private=True
            )
        except BaseException:
            self.dirty = True  # (tried again at the next write)
            raise
        return True


class LookupCaches:
    """
    The lookup caches of every model with n-gram lookup, fed answers by the
    pipeline (L{add}) and written every L{SAVE_EVERY} seconds and at
    L{stop}.

    @param reactor: C{IReactorThreads} and C{IReactorTime}.
    @param path_for: A model's canonical name -> its cache file
        (L{blazar.engines.llamacpp.lookup_cache} in the data dir).
    """

    def __init__(
        self,
        reactor: Any,
        path_for: Callable[[str], Path],
        every: float = SAVE_EVERY,
        max_ngrams: int = MAX_NGRAMS,
    ) -> None:
        self._reactor = reactor
        self._path_for = path_for
        self._every = every
        self._max_ngrams = max_ngrams
        self.models: dict[str, ModelCache] = {}
        self._loop: LoopingCall | None = None
        self._pending: set[Deferred[None]] = set()

    def _thread(self, f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        return deferToThreadPool(self._reactor, self._reactor.getThreadPool(), f, *args)

    def start(self) -> None:
        loop = self._loop = LoopingCall(self.save)
        loop.clock = self._reactor
        loop.start(self._every, now=False).addErrback(lambda f: log.failure("the lookup cache writer stopped", f))

    def add(self, model: str, text: str, tokenize: Callable[[str], Awaitable[list[int]]]) -> None:
        """
        Count an answer of C{model} into its cache, in the background:
        C{tokenize} gives the text's tokens (the child that wrote it, its
        C{/tokenize}, no BOS; C{[]} when that child is gone), a thread
        counts them. A failure is logged, never raised: the cache is a hint.
        """
        if not text.strip():
            return
        d = ensureDeferred(self._add(model, text, tokenize))
        self._pending.add(d)

        def done(result: Any) -> None:
            self._pending.discard(d)

        d.addErrback(lambda f: log.failure("{model}: counting an answer into its lookup cache failed", f, model=model))
        d.addBoth(done)

    async def _add(self, model: str, text: str, tokenize: Callable[[str], Awaitable[list[int]]]) -> None:
        try:
            tokens = await tokenize(text)
        except Exception as e:  # (the child stopped since it answered: an ordinary race)
            log.info("{model}: an answer left out of its lookup cache: {why}", model=model, why=str(e) or repr(e))
            return
        if len(tokens) < 2:
            return
        cache = self.models.get(model)
        if cache is None:
            cache = self.models[model] = ModelCache(self._path_for(model), self._max_ngrams)
        why = await self._thread(cache.thd_add, [int(t) for t in tokens])
        if why is not None:
            log.warn("{path}: not a lookup cache ({why}); starting it afresh", path=str(cache.path), why=why)

    def save(self, models: Iterable[str] | None = None) -> Deferred[Any]:
        """
        Write every cache (or C{models}') that counted answers since its
        last write.
        """
        names = list(self.models) if models is None else [m for m in models if m in self.models]
        return DeferredList(
            [self._thread(self.models[m].thd_save).addErrback(self._failed, m) for m in names],
            consumeErrors=True,
        )

    def _failed(self, failure: Any, model: str) -> None:
        log.failure("{model}: writing its lookup cache failed", failure, model=model)

    async def stop(self) -> None:
        """
        Stop the writer; count the answers under way and write every cache.
        """
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if self._pending:
            await DeferredList(list(self._pending), consumeErrors=True)
        await self.save()
