"""
L{blazar.gateway.isolation}: which slot each key's request gets on a model
with C{isolate_keys}, and when it may reuse the slot's cache.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.gateway.isolation import KeyIsolation


class KeyIsolationTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.isolation = KeyIsolation(self.clock)
        self.child = type("Child", (), {})()

    def test_a_key_reuses_only_its_own_slot(self) -> None:
        a = self.isolation.take(self.child, 2, "a")
        self.assertEqual((a.slot, a.fresh), (0, True))  # never used: nothing known of it, nothing reused
        self.assertEqual(a.fields(), {"id_slot": 0, "cache_prompt": False})
        self.isolation.release(a)
        again = self.isolation.take(self.child, 2, "a")
        self.assertEqual((again.slot, again.fresh), (0, False))
        self.assertEqual(again.fields(), {"id_slot": 0})
        b = self.isolation.take(self.child, 2, "b")  # slot 0 is busy: the other one, fresh
        self.assertEqual((b.slot, b.fresh), (1, True))
        self.isolation.release(again)
        self.isolation.release(b)
        self.clock.advance(1)
        c = self.isolation.take(self.child, 2, "c")  # every slot is another key's: fresh, in the idlest
        self.assertTrue(c.fresh)
        self.isolation.release(c)
        mine = self.isolation.take(self.child, 2, "c")
        self.assertEqual((mine.slot, mine.fresh), (c.slot, False))

    def test_no_slot_free_reuses_nothing(self) -> None:
        held = [self.isolation.take(self.child, 2, "a") for _ in range(2)]
        extra = self.isolation.take(self.child, 2, "a")
        self.assertEqual(extra.fields(), {"cache_prompt": False})
        self.isolation.release(extra)  # (no slot: nothing to note)
        for h in held:
            self.isolation.release(h)

    def test_a_sessions_slot_is_fresh_unless_the_key_used_it_last(self) -> None:
        a = self.isolation.take(self.child, 2, "a")
        self.isolation.release(a)
        self.assertEqual(a.slot, 0)
        self.assertTrue(self.isolation.hold(self.child, 2, "b", 0).fresh)  # a's cache
        self.assertTrue(self.isolation.hold(self.child, 2, "a", 1).fresh)  # not known whose
        self.assertFalse(self.isolation.hold(self.child, 2, "a", 0).fresh)  # its own
