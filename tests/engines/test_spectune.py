"""
C{speculative = "auto"}'s tuner (L{blazar.engines.spectune}): fed answers'
decode rates on a L{Clock}, it decides per model, from the work classes'
rates with n-gram lookup and without.
"""

from __future__ import annotations

from typing import cast

from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.spectune import MARGIN, MIN_TOKENS, SpecTuner


class SpecTunerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.tuner = SpecTuner(self.clock, retry_secs=600.0, retry_answers=50)
        self.logged: list[str] = []

        def observer(event: dict) -> None:
            if event.get("log_namespace") == "blazar.engines.spectune" and event.get("log_level") == LogLevel.info:
                self.logged.append(formatEvent(event))

        globalLogPublisher.addObserver(cast(ILogObserver, observer))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, observer))

    def feed(self, n: int, lookup: bool, rate: float, work: str = "interactive", model: str = "m") -> None:
        for _ in range(n):
            self.tuner.observe(model, work, lookup, rate, 100, window=4)

    def test_starts_measuring_with_lookup(self) -> None:
        self.assertTrue(self.tuner.lookup("m"))
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")

    def test_pays_stays_on(self) -> None:
        """
        After a window with lookup it wants the child without; after a
        window without, lookup that is at least MARGIN faster stays, and
        the decision is logged with both rates, the counts and the margin.
        """
        self.feed(3, True, 120.0)
        self.assertTrue(self.tuner.lookup("m"))
        self.feed(1, True, 120.0)
        self.assertFalse(self.tuner.lookup("m"))  # trying without, for the next child
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        self.feed(4, False, 100.0)
        state = self.tuner.state("m")
        self.assertEqual(state["decided"], "on")
        self.assertTrue(self.tuner.lookup("m"))
        self.assertEqual(state["last"]["ratio"], 1.2)
        self.assertEqual(state["last"]["classes"]["interactive"], {"on": 120.0, "on_n": 4, "off": 100.0, "off_n": 4})
        decided = [line for line in self.logged if "decided on" in line]
        self.assertEqual(len(decided), 1)
        self.assertIn("120.0 tok/s with lookup (4 answers) vs 100.0 without (4)", decided[0])
        self.assertIn(">= 1.05", decided[0])

    def test_does_not_pay_off(self) -> None:
        """
        Lookup less than MARGIN faster (here 3%) goes.
        """
        self.feed(4, True, 103.0)
        self.feed(4, False, 100.0)
        self.assertEqual(self.tuner.state("m")["decided"], "off")
        self.assertFalse(self.tuner.lookup("m"))
        self.assertLess(1.03, 1 + MARGIN)

    def test_answers_from_the_old_child_count_as_theirs(self) -> None:
        """
        Answers still coming from a child with lookup after the tuner
        wanted it off are counted with lookup, not as the other side.
        """
        self.feed(4, True, 100.0)
        self.feed(10, True, 100.0)  # the child is not reloaded yet
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        self.assertEqual(self.tuner.state("m")["rates"]["interactive"]["on_n"], 14)

    def test_a_childs_first_answer_ignored(self) -> None:
        """
        Given the child's pid, its first answer (warming up) is not counted.
        """
        for child in (7, 7, 7, 8, 8):
            self.tuner.observe("m", "interactive", True, 50.0, 100, window=10, child=child)
        self.assertEqual(self.tuner.state("m")["rates"]["interactive"]["on_n"], 3)

    def test_short_answers_ignored(self) -> None:
        for _ in range(10):
            self.tuner.observe("m", "interactive", True, 500.0, MIN_TOKENS - 1, window=4)
        self.assertEqual(self.tuner.state("m")["rates"], {})

    def test_per_work_class(self) -> None:
        """
        A class decides only with a window each way; the model's gain is
        the classes' ratios weighted by their answers.
        """
        self.feed(4, True, 200.0, work="tool")  # tool code: lookup pays
        self.feed(2, True, 100.0, work="interactive")
        self.feed(4, False, 100.0, work="interactive")
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")  # no class full both ways
        self.feed(2, True, 100.0, work="interactive")  # (from the old child)
        self.feed(1, False, 100.0, work="tool")
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        self.feed(1, False, 100.0, work="interactive")  # interactive full both ways, tool not yet
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        self.feed(3, False, 100.0, work="tool")  # tool full: 2.0 x 8 + 1.0 x 9 over 17
        state = self.tuner.state("m")
        self.assertEqual(state["decided"], "on")
        self.assertEqual(set(state["last"]["classes"]), {"interactive", "tool"})

    def test_class_gone_does_not_stall(self) -> None:
        """
        A class measured with lookup whose traffic stops is not waited for
        once another has STALL windows without.
        """
        self.feed(4, True, 200.0, work="tool")
        self.feed(4, True, 100.0, work="interactive")
        self.feed(11, False, 100.0, work="interactive")
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        self.feed(1, False, 100.0, work="interactive")
        state = self.tuner.state("m")
        self.assertEqual(state["decided"], "off")
        self.assertEqual(set(state["last"]["classes"]), {"interactive"})

    def test_classes_weighted(self) -> None:
        self.feed(4, True, 200.0, work="tool")
        self.feed(4, True, 100.0, work="interactive")
        for _ in range(4):
            self.tuner.observe("m", "tool", False, 100.0, 100, window=4)
            self.tuner.observe("m", "interactive", False, 100.0, 100, window=4)
        last = self.tuner.state("m")["last"]
        self.assertEqual(last["ratio"], 1.5)  # (2.0 x 8 + 1.0 x 8) / 16
        self.assertEqual(last["decided"], "on")

    def test_models_apart(self) -> None:
        self.feed(4, True, 100.0, model="a")
        self.assertFalse(self.tuner.lookup("a"))
        self.assertTrue(self.tuner.lookup("b"))

    def test_retrial_after_time(self) -> None:
        """
        After retry_secs a new trial starts, with lookup, keeping the last
        decision's figures.
        """
        self.feed(4, True, 100.0)
        self.feed(4, False, 100.0)
        self.assertEqual(self.tuner.state("m")["decided"], "off")
        self.clock.advance(599)
        self.feed(1, False, 100.0)
        self.assertFalse(self.tuner.lookup("m"))
        self.clock.advance(1)
        self.feed(1, False, 100.0)
        state = self.tuner.state("m")
        self.assertEqual(state["decided"], "measuring")
        self.assertTrue(self.tuner.lookup("m"))
        self.assertEqual(state["last"]["decided"], "off")
        self.assertTrue(any("tries n-gram lookup again" in line for line in self.logged))

    def test_retrial_after_answers(self) -> None:
        self.feed(4, True, 100.0)
        self.feed(4, False, 100.0)
        self.feed(49, False, 100.0)
        self.assertEqual(self.tuner.state("m")["decided"], "off")
        self.feed(1, False, 100.0)
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        # the new trial measures again: with lookup first, then without
        self.feed(4, True, 130.0)
        self.feed(4, False, 100.0)
        self.assertEqual(self.tuner.state("m")["decided"], "on")


class SpecColumnTests(SynchronousTestCase):
    def test_blazar_ps_column(self) -> None:
        from blazar.gateway.operations import spec_column

        self.assertEqual(spec_column({"decided": "off", "running": "off"}), "auto=off")
        self.assertEqual(spec_column({"decided": "on", "running": None}), "auto=on")
        self.assertEqual(spec_column({"decided": "measuring", "running": "on"}), "auto?on")
        self.assertEqual(spec_column({"decided": "measuring", "running": None}), "auto?")
