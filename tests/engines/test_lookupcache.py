"""
L{blazar.engines.lookupcache}: each n-gram lookup model's cache, counted
from its answers as llama.cpp counts a context and written in the
engine's own file format (the e2e has the real llama-server load and
draft from it: tests/integration/test_speculative_e2e.py).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.lookupcache import TOKEN_NULL, LookupCaches, NgramCounts
from blazar.testing import fake_process_reactor

N = TOKEN_NULL


class NgramCountsTests(SynchronousTestCase):
    def test_update_counts_every_ngram_of_one_to_four_tokens(self) -> None:
        counts = NgramCounts()
        counts.update([1, 2, 3, 1, 2, 3])
        # common_ngram_cache_update: for size n, every i >= n counts tokens[i-n:i] -> tokens[i]
        self.assertEqual(counts.ngrams[(1, N, N, N)], {2: 2})
        self.assertEqual(counts.ngrams[(3, N, N, N)], {1: 1})
        self.assertEqual(counts.ngrams[(1, 2, N, N)], {3: 2})
        self.assertEqual(counts.ngrams[(1, 2, 3, N)], {1: 1})
        self.assertEqual(counts.ngrams[(2, 3, 1, 2)], {3: 1})
        self.assertNotIn((2, 3, 1, 2, 3), counts.ngrams)
        self.assertEqual(len(counts), 3 + 3 + 3 + 2)

    def test_the_engines_file_format(self) -> None:
        counts = NgramCounts()
        counts.update([7, 8])
        # common_ngram_cache_save: int32 tokens[4], int32 ntokens, then (int32 token, int32 count) each
        self.assertEqual(counts.to_bytes(), struct.pack("<4ii2i", 7, N, N, N, 1, 8, 1))

    def test_round_trip_and_merge(self) -> None:
        counts = NgramCounts()
        counts.update([5, 6, 7, 5, 6, 8] * 3)
        again = NgramCounts.from_bytes(counts.to_bytes())
        self.assertEqual(again.ngrams, counts.ngrams)
        again.merge(counts)
        self.assertEqual(again.ngrams[(5, 6, N, N)], {7: 6, 8: 6})

    def test_a_cut_or_bad_file_is_refused(self) -> None:
        counts = NgramCounts()
        counts.update([1, 2, 3])
        data = counts.to_bytes()
        for bad in (
            data[:-1],
            data[:10],
            struct.pack("<4ii", 1, N, N, N, 0),
            struct.pack("<4ii2i", 1, N, N, N, 1, 2, 0),
        ):
            with self.subTest(size=len(bad)):
                self.assertRaises(ValueError, NgramCounts.from_bytes, bad)

    def test_the_rarest_go_first_past_the_cap(self) -> None:
        counts = NgramCounts(max_ngrams=10)
        counts.update([1, 2] * 20)  # 1 -> 2 and 2 -> 1, seen often
        counts.update(list(range(100, 110)))  # each n-gram once
        self.assertLessEqual(len(counts), 10)
        self.assertEqual(counts.ngrams[(1, N, N, N)], {2: 20})


class LookupCachesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = fake_process_reactor()
        self.dir = Path(self.mktemp())
        self.caches = LookupCaches(self.reactor, lambda model: self.dir / model / "lookup-dynamic.bin", every=5.0)
        self.asked: list[str] = []

    def tokenize(self, text: str) -> Deferred[list[int]]:
        self.asked.append(text)
        return succeed([ord(c) for c in text])

    def read(self, model: str = "m") -> NgramCounts:
        return NgramCounts.from_bytes((self.dir / model / "lookup-dynamic.bin").read_bytes())

    def test_answers_are_written_every_few_seconds_and_at_stop(self) -> None:
        self.caches.start()
        self.caches.add("m", "abab", self.tokenize)
        self.assertEqual(self.asked, ["abab"])
        path = self.dir / "m" / "lookup-dynamic.bin"
        self.assertFalse(path.exists())  # not yet
        self.reactor.advance(5)
        self.assertEqual(self.read().ngrams[(ord("a"), N, N, N)], {ord("b"): 2})
        written = path.stat().st_mtime_ns
        self.reactor.advance(5)  # nothing new: not written again
        self.assertEqual(path.stat().st_mtime_ns, written)
        self.caches.add("m", "ab", self.tokenize)
        self.successResultOf(ensureDeferred(self.caches.stop()))
        self.assertEqual(self.read().ngrams[(ord("a"), N, N, N)], {ord("b"): 3})
        self.assertFalse((self.dir / "m" / "lookup-dynamic.bin.tmp").exists())
        self.assertEqual((path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777), (0o600, 0o700))

    def test_a_restart_adds_to_the_file(self) -> None:
        self.caches.add("m", "xyxy", self.tokenize)
        self.successResultOf(ensureDeferred(self.caches.stop()))
        later = LookupCaches(self.reactor, lambda model: self.dir / model / "lookup-dynamic.bin")
        later.add("m", "xy", self.tokenize)
        self.successResultOf(ensureDeferred(later.stop()))
        self.assertEqual(self.read().ngrams[(ord("x"), N, N, N)], {ord("y"): 3})

    def test_a_file_that_is_no_cache_is_started_afresh(self) -> None:
        path = self.dir / "m" / "lookup-dynamic.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"not a cache")
        self.caches.add("m", "pq", self.tokenize)
        self.successResultOf(ensureDeferred(self.caches.stop()))
        self.assertEqual(self.read().ngrams, {(ord("p"), N, N, N): {ord("q"): 1}})

    def test_blank_answers_and_gone_children_count_nothing(self) -> None:
        def gone(text: str) -> Deferred[Any]:
            raise ConnectionRefusedError("the child stopped")

        self.caches.add("m", "  ", self.tokenize)
        self.caches.add("m", "hello", gone)
        self.caches.add("m", "hello", lambda text: succeed([]))
        self.successResultOf(ensureDeferred(self.caches.stop()))
        self.assertEqual(self.asked, [])
        self.assertFalse((self.dir / "m").exists())

    def test_a_write_that_fails_is_logged_and_tried_again(self) -> None:
        self.caches.add("m", "abc", self.tokenize)
        self.dir.mkdir(exist_ok=True)
        (self.dir / "m").write_text("a file where the directory goes")
        self.successResultOf(self.caches.save())
        self.assertEqual(len(self.flushLoggedErrors()), 1)
        (self.dir / "m").unlink()
        self.successResultOf(self.caches.save())  # (the next write has it)
        self.assertIn((ord("b"), N, N, N), self.read().ngrams)
