"""
Sessions and the KV bank (L{blazar.gateway.sessions}), on a fake slot bank
and a clock.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.gateway.sessions import (
    Pin,
    Sessions,
    anthropic_hint,
    session_name,
    sessions_from_rows,
)
from blazar.testing import FakeInstance, FakeSlotBank
from tests.gateway.slot_bank_contract import check_slot_bank
from tests.typed import not_none

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clients"


def run_now(f: Any, *args: Any) -> Deferred[Any]:
    return succeed(f(*args))


class NamingTests(SynchronousTestCase):
    def test_the_header_first_then_the_agents_then_the_hint(self) -> None:
        headers = {"x-blazar-session": "mine", "x-claude-code-session-id": "cc", "session-id": "codex"}
        self.assertEqual(session_name(headers.get, "hint"), "mine")
        del headers["x-blazar-session"]
        self.assertEqual(session_name(headers.get, "hint"), "cc")
        del headers["x-claude-code-session-id"]
        self.assertEqual(session_name(headers.get, "hint"), "codex")
        self.assertEqual(session_name(dict[str, str]().get, " hint "), "hint")
        self.assertIsNone(session_name({"x-blazar-session": "  "}.get, None))

    def test_the_recorded_agents_name_their_sessions(self) -> None:
        claude = json.loads((FIXTURES / "claude-code-first.json").read_text())
        lower = {k.lower(): v for k, v in claude["headers"].items()}
        self.assertEqual(anthropic_hint(claude["body"]), lower["x-claude-code-session-id"])
        self.assertEqual(session_name(lower.get, None), lower["x-claude-code-session-id"])
        codex = json.loads((FIXTURES / "codex-first.json").read_text())
        lower = {k.lower(): v for k, v in codex["headers"].items()}
        self.assertEqual(session_name(lower.get, codex["body"]["prompt_cache_key"]), lower["session-id"])
        self.assertIsNone(anthropic_hint({"metadata": {"user_id": "plain-user"}}))

    def test_id_slot_is_added_at_the_end(self) -> None:
        from blazar.gateway.isolation import with_fields

        self.assertEqual(json.loads(with_fields(b'{"a": 1}\n', {"id_slot": 3}) or b""), {"a": 1, "id_slot": 3})
        self.assertEqual(
            json.loads(with_fields(b"{}", {"id_slot": 0, "cache_prompt": False}) or b""),
            {"id_slot": 0, "cache_prompt": False},
        )
        self.assertIsNone(with_fields(b"[1]", {"id_slot": 0}))
        self.assertEqual(with_fields(b"[1]", {}), b"[1]")


class SessionTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.bank = FakeSlotBank()
        self.data = Path(tempfile.mkdtemp(prefix="blazar-sessions-"))
        self.keep = 900.0
        self.counted: list[tuple[str, str]] = []
        self.rows: dict[tuple[str, str, str], Any] = {}
        self.sessions = Sessions(
            self.clock,
            self.bank,
            lambda: self.data,
            lambda: (self.keep, 2.0, 512 << 20, 4096 << 20),
            run_now,
            persist=self.persist,
            forget=self.forget,
            count=lambda op, result: self.counted.append((op, result)),
        )
        self.child = FakeInstance("m:latest", parallel=2, ctx=2048)

    def persist(self, session: Any) -> Deferred[None]:
        self.rows[(session.key, session.name, session.model)] = session.bank
        return succeed(None)

    def forget(self, session: Any) -> Deferred[None]:
        self.rows.pop((session.key, session.name, session.model), None)
        return succeed(None)

    def pin(self, name: str, child: Any = None, key: str = "k") -> Pin | None:
        return self.successResultOf(Deferred.fromCoroutine(self.sessions.pin(key, name, child or self.child)))

    def turn(self, name: str, tokens: int, child: Any = None, key: str = "k") -> Pin:
        """
        One request of session C{name}: pinned, run (its slot then holds
        C{tokens}), released.
        """
        pin = self.pin(name, child, key)
        assert pin is not None
        self.bank.fill(child or self.child, pin.slot, tokens)
        self.sessions.release(pin, tokens)
        self.clock.advance(1)
        return pin

    def test_a_session_keeps_its_slot(self) -> None:
        a, b = self.turn("a", 10), self.turn("b", 20)
        self.assertNotEqual(a.slot, b.slot)
        self.assertEqual(self.turn("a", 15).slot, a.slot)
        self.assertEqual(self.bank.calls, [])  # nothing paged: each has its slot

    def test_more_sessions_than_slots_page_the_least_recent_out_and_back(self) -> None:
        a, b = self.turn("a", 100), self.turn("b", 200)
        c = self.turn("c", 300)  # a is the least recently used: saved, its slot given to c
        self.assertEqual(c.slot, a.slot)
        a_file = a.session.file
        self.assertEqual(self.bank.calls, [("save", a.slot, a_file)])
        self.assertEqual(not_none(a.session.bank).tokens, 100)
        self.assertIn(("k", "a", "m:latest"), self.rows)
        again = self.turn("a", 120)  # b is now the least recent: saved; a restored where b was
        self.assertEqual(again.slot, b.slot)
        self.assertEqual(self.bank.calls[1:], [("save", b.slot, b.session.file), ("restore", b.slot, a_file)])
        self.assertIn(("restore", "ok"), self.counted)

    def test_a_stop_saves_every_session_and_a_new_child_restores_them(self) -> None:
        a, _ = self.turn("a", 100), self.turn("b", 200)
        self.successResultOf(self.sessions.stopping(self.child))
        self.assertEqual(sorted(c[0] for c in self.bank.calls), ["save", "save"])
        self.assertIsNone(a.session.slot)
        fresh = FakeInstance("m:latest", parallel=2, ctx=2048)
        pin = self.pin("b", fresh)
        assert pin is not None
        self.assertEqual(self.bank.held(fresh, pin.slot), 200)  # restored before the request

    def test_a_stop_that_waits_first_is_pending_from_the_start(self) -> None:
        """
        At shutdown the saves wait for the batch lines to drain; the wait is
        pending at once, so the store's stop (which settles L{pending})
        cannot close the database before the saves run.
        """
        self.turn("a", 100)
        drained: Deferred[None] = Deferred()
        stopping = self.sessions.stopping(self.child, after=drained)
        self.assertIn(stopping, self.sessions.pending)
        self.assertEqual(self.bank.calls, [])  # nothing saved while lines still run
        drained.callback(None)
        self.successResultOf(stopping)
        self.assertEqual([c[0] for c in self.bank.calls], ["save"])
        self.assertEqual(self.sessions.pending, set())

    def test_unnamed_conversations_are_saved_and_restored_into_their_slots(self) -> None:
        a = self.turn("a", 100)
        other = 1 - a.slot
        self.bank.fill(self.child, other, 70)  # a request no client named ran there
        self.successResultOf(self.sessions.stopping(self.child))
        saved = {c[2] for c in self.bank.calls if c[0] == "save"}
        self.assertEqual(saved, {a.session.file, [s for s in self.sessions.of_key(None) if s.key != "k"][0].file})
        fresh = FakeInstance("m:latest", parallel=2, ctx=2048)
        self.successResultOf(Deferred.fromCoroutine(self.sessions.warm(fresh)))
        self.assertEqual(self.bank.held(fresh, other), 70)  # back in the same slot, before any request
        restores = len([c for c in self.bank.calls if c[0] == "restore"])
        self.successResultOf(Deferred.fromCoroutine(self.sessions.warm(fresh)))  # once per child
        self.assertEqual(len([c for c in self.bank.calls if c[0] == "restore"]), restores)
        pin = self.pin("a", fresh)
        assert pin is not None
        self.assertEqual((pin.slot, self.bank.held(fresh, pin.slot)), (a.slot, 100))
        self.assertEqual(self.sessions.of_key(""), [])  # the unnamed ones belong to no client's key

    def test_a_key_has_at_most_so_many_sessions(self) -> None:
        from blazar.gateway import sessions

        for n in range(sessions.MAX_SESSIONS_PER_KEY + 5):
            self.sessions.load([sessions.Session("k", f"s{n}", "m:latest", float(n))])
        self.turn("new", 10)
        mine = self.sessions.of_key("k")
        self.assertLessEqual(len(mine), sessions.MAX_SESSIONS_PER_KEY)
        self.assertIn("new", [s.name for s in mine])
        self.assertNotIn("s0", [s.name for s in mine])  # the least recently used went

    def test_a_bank_entry_of_another_shape_is_never_restored(self) -> None:
        a = self.turn("a", 100)
        self.successResultOf(self.sessions.stopping(self.child))
        other = FakeInstance("m:latest", parallel=2, ctx=4096)  # another context per slot
        pin = self.pin("a", other)
        assert pin is not None
        self.assertEqual(self.bank.held(other, pin.slot), 0)
        self.assertNotIn("restore", [c[0] for c in self.bank.calls])
        self.assertIsNone(a.session.bank)
        self.assertIn(("restore", "other_shape"), self.counted)

    def test_a_damaged_bank_entry_falls_back_to_prefill(self) -> None:
        a = self.turn("a", 100)
        self.successResultOf(self.sessions.stopping(self.child))
        self.bank.corrupt.add(a.session.file)
        fresh = FakeInstance("m:latest", parallel=2, ctx=2048)
        pin = self.pin("a", fresh)
        assert pin is not None  # the request still goes, to an erased slot
        self.assertEqual([c[0] for c in self.bank.calls][-2:], ["restore", "erase"])
        self.assertIsNone(a.session.bank)
        self.assertIn(("restore", "failed"), self.counted)
        self.flushLoggedErrors()

    def test_sessions_belong_to_their_key(self) -> None:
        mine, theirs = self.turn("same", 10, key="alice"), self.turn("same", 20, key="bob")
        self.assertIsNot(mine.session, theirs.session)
        self.assertEqual([s.key for s in self.sessions.of_key("alice")], ["alice"])
        self.assertEqual(self.sessions.close("carol", "same"), [])
        slot = theirs.slot
        self.bank.fill(self.child, slot, 20)
        self.assertEqual([s.key for s in self.sessions.close("bob", "same")], ["bob"])
        self.assertEqual(self.bank.held(self.child, slot), 0)  # the conversation is gone from the child too
        self.assertEqual([s.key for s in self.sessions.of_key(None)], ["alice"])

    def test_unused_sessions_expire_with_their_bank_entry(self) -> None:
        a = self.turn("a", 10)
        self.successResultOf(self.sessions.stopping(self.child))
        running = self.pin("b")
        self.clock.advance(901)
        self.assertEqual(self.sessions.expire(), 1)  # a; b has a request running
        self.assertEqual([s.name for s in self.sessions.of_key(None)], ["b"])
        self.assertNotIn(("k", "a", "m:latest"), self.rows)
        assert running is not None
        self.assertIsNone(a.session.bank)

    def test_off_and_full(self) -> None:
        held = [self.pin("a"), self.pin("b")]  # both slots with a request running
        self.assertTrue(all(held))
        self.assertIsNone(self.pin("c"))  # no idle session to page out: unpinned
        self.keep = 0.0
        self.assertIsNone(self.pin("a"))

    def test_rows_read_back(self) -> None:
        [session] = sessions_from_rows([("k", "a", "m:latest", "f.bin", 100, 51200, "shape", 5.0, 6.0)])
        bank = not_none(session.bank)
        self.assertEqual((bank.file, bank.tokens, session.last_used), ("f.bin", 100, 6.0))

    def test_the_fake_bank_keeps_the_contract(self) -> None:
        bank = FakeSlotBank()
        child = FakeInstance("m:latest", parallel=2)

        async def fill(slot: int) -> int:
            bank.fill(child, slot, 42)
            return 42

        self.successResultOf(Deferred.fromCoroutine(check_slot_bank(bank, child, fill, bank.corrupt.add)))


class HardeningTests(SessionTests):
    """
    What the attack on the first version found (issue 20's review).
    """

    def test_a_busy_slot_is_not_chosen(self) -> None:
        self.bank.busy.add(0)  # an unnamed request llama-server put in slot 0
        pin = self.pin("a")
        assert pin is not None
        self.assertEqual(pin.slot, 1)
        self.bank.busy.add(1)
        self.assertIsNone(self.pin("b"))  # nothing idle: unpinned

    def test_a_child_that_does_not_answer_keeps_the_entry(self) -> None:
        a = self.turn("a", 100)
        self.successResultOf(self.sessions.stopping(self.child))
        fresh = FakeInstance("m:latest", parallel=2, ctx=2048)
        self.bank.unreachable = True  # it crashed, not yet reported
        self.assertIsNone(self.pin("a", fresh))  # unpinned
        self.assertIsNotNone(a.session.bank)
        self.assertIn(("restore", "no_answer"), self.counted)
        self.assertNotIn("erase", [c[0] for c in self.bank.calls])
        self.bank.unreachable = False
        pin = self.pin("a", fresh)
        assert pin is not None
        self.assertEqual(self.bank.held(fresh, pin.slot), 100)
        self.flushLoggedErrors()

    def test_a_client_leaving_during_a_restore_keeps_the_entry(self) -> None:
        from twisted.internet.defer import CancelledError

        a = self.turn("a", 100)
        self.successResultOf(self.sessions.stopping(self.child))
        fresh = FakeInstance("m:latest", parallel=2, ctx=2048)
        waiting: Deferred[int] = Deferred()

        async def slow_restore(instance: Any, slot: int, filename: str, timeout: float) -> int:
            return await waiting

        self.patch(self.bank, "restore", slow_restore)
        d = Deferred.fromCoroutine(self.sessions.pin("k", "a", fresh))
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertIsNotNone(a.session.bank)
        self.assertEqual(a.session.in_flight, 0)

    def test_an_embedding_child_saves_nothing(self) -> None:
        from blazar.config import ModelConfig
        from blazar.models.registry import ModelEntry

        class Embedder(FakeInstance):
            @property
            def entry(self) -> ModelEntry:
                return ModelEntry(self.name, Path("/nonexistent/e.gguf"), settings=ModelConfig(embedding=True))

        child = Embedder("e:latest")
        self.bank.fill(child, 0, 10)
        self.successResultOf(self.sessions.stopping(child))
        self.assertEqual(self.bank.calls, [])
        self.assertEqual(self.sessions.of_key(None), [])

    def test_the_childs_own_shape_is_used(self) -> None:
        a = self.turn("a", 100)
        self.successResultOf(self.sessions.stopping(self.child))
        reflagged = FakeInstance("m:latest", parallel=2, ctx=2048, shape="other-flags")
        pin = self.pin("a", reflagged)
        assert pin is not None
        self.assertEqual(self.bank.held(reflagged, pin.slot), 0)
        self.assertIn(("restore", "other_shape"), self.counted)
        self.assertIsNone(a.session.bank)

    def test_long_names_stay_apart(self) -> None:
        from blazar.gateway.sessions import MAX_NAME

        one, two = "x" * 300 + "1", "x" * 300 + "2"
        names = {session_name({"x-blazar-session": n}.get, None) for n in (one, two)}
        self.assertEqual(len(names), 2)
        self.assertTrue(all(len(n or "") <= MAX_NAME for n in names))


class IndexTests(SessionTests):
    """
    The KV bank's index (issue 42): a node's row names it from the
    session's first pin on that node, not only from its first save.
    """

    def setUp(self) -> None:
        super().setUp()
        self.claims: list[tuple[str, str, str]] = []
        self.sessions = Sessions(
            self.clock,
            self.bank,
            lambda: self.data,
            lambda: (self.keep, 2.0, 512 << 20, 4096 << 20),
            run_now,
            persist=self.persist,
            forget=self.forget,
            count=lambda op, result: self.counted.append((op, result)),
            claim=self.claim,
            node="node-a",
        )

    def claim(self, session: Any) -> Deferred[None]:
        self.claims.append((session.key, session.name, session.model))
        return succeed(None)

    def test_the_first_pin_claims_the_session_once(self) -> None:
        self.turn("a", 10)
        self.assertEqual(self.claims, [("k", "a", "m:latest")])
        self.assertEqual(self.rows, {})  # no bank entry yet: the claim is the row
        self.turn("a", 20)
        self.turn("b", 5)
        self.assertEqual(self.claims, [("k", "a", "m:latest"), ("k", "b", "m:latest")])

    def test_rows_read_back_are_already_this_nodes(self) -> None:
        self.sessions.load(sessions_from_rows([("k", "a", "m:latest", None, 0, 0, "", 0.0, 6.0)]))
        self.turn("a", 10)
        self.assertEqual(self.claims, [])

    def test_a_session_taken_over_is_claimed_again(self) -> None:
        self.turn("a", 10)
        self.sessions.disown("k", "a")
        self.sessions.disown("k", "other")  # (none by that name: nothing)
        self.turn("a", 10)
        self.assertEqual(self.claims, [("k", "a", "m:latest")] * 2)

    def test_the_listing_names_the_node(self) -> None:
        self.turn("a", 10)
        [session] = self.sessions.of_key("k")
        self.assertEqual(session.view(self.sessions.node)["node"], "node-a")
