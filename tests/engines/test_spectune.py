"""
C{speculative = "auto"}'s tuner (L{blazar.engines.spectune}): fed answers'
decode rates on a L{Clock}, it decides per model, from the work classes'
rates with n-gram lookup and without.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from blazar.engines.spectune import MARGIN, MIN_TOKENS, STATE_FILE, SpecTuner
from blazar.testing import fake_process_reactor


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


class SavedStateTests(SynchronousTestCase):
    """
    A decision outlives the daemon: written to the model's L{STATE_FILE}
    when made (and at stop, with its answers since), read back before the
    model's first child by a new tuner over the same files, the decision's
    wall-clock time turned into the new tuner's clock.
    """

    def setUp(self) -> None:
        self.root = Path(self.mktemp())
        self.wall = 1_754_000_000.0
        self.logged: list[tuple[LogLevel, str]] = []

        def observer(event: dict) -> None:
            if event.get("log_namespace") == "blazar.engines.spectune":
                self.logged.append((event["log_level"], formatEvent(event)))

        globalLogPublisher.addObserver(cast(ILogObserver, observer))
        self.addCleanup(globalLogPublisher.removeObserver, cast(ILogObserver, observer))
        self.tuner = self.restart()

    def path(self, model: str = "m") -> Path:
        return self.root / "speccache" / model / STATE_FILE

    def restart(self) -> SpecTuner:
        """
        A new tuner (a restarted daemon): a fresh reactor whose clock
        starts at 0, over the same files and wall clock.
        """
        self.reactor = fake_process_reactor()  # (its thread pool runs work at once)
        return SpecTuner(self.reactor, retry_secs=600.0, retry_answers=50, path_for=self.path, wall=lambda: self.wall)

    def load(self, tuner: SpecTuner, model: str = "m") -> None:
        self.successResultOf(ensureDeferred(tuner.load(model)))

    def feed(self, tuner: SpecTuner, n: int, lookup: bool, rate: float) -> None:
        for _ in range(n):
            tuner.observe("m", "interactive", lookup, rate, 100, window=4)

    def decide_off(self) -> None:
        self.load(self.tuner)
        self.feed(self.tuner, 4, True, 100.0)
        self.assertFalse(self.path().exists())  # measuring: not written
        self.feed(self.tuner, 4, False, 100.0)
        self.assertEqual(self.tuner.state("m")["decided"], "off")

    def warnings(self) -> list[str]:
        return [text for level, text in self.logged if level == LogLevel.warn]

    def test_written_when_decided(self) -> None:
        self.reactor.advance(42)  # the tuner's clock is not the wall clock
        self.decide_off()
        saved = json.loads(self.path().read_text())
        self.assertEqual(
            saved,
            {
                "version": 1,
                "decided": "off",
                "decided_at": self.wall,
                "since": 0,
                "last": self.tuner.state("m")["last"],
            },
        )
        self.assertEqual(saved["last"]["ratio"], 1.0)
        self.assertEqual(list(self.path().parent.iterdir()), [self.path()])  # (no temporary left)

    def test_restart_keeps_the_decision_and_its_retrial_time(self) -> None:
        self.decide_off()
        self.wall += 300
        tuner = self.restart()
        self.assertTrue(tuner.lookup("m"))  # not read yet
        self.load(tuner)
        self.assertFalse(tuner.lookup("m"))  # the first child runs without, as before the restart
        state = tuner.state("m")
        self.assertEqual(state["decided"], "off")
        self.assertEqual(state["last"], self.tuner.state("m")["last"])
        self.assertTrue(any("keeps its saved decision: off (300s and 0 answers ago)" in t for _, t in self.logged))
        # the re-trial comes 600 s after the decision, 300 s after the restart
        self.reactor.advance(299)
        self.feed(tuner, 1, False, 100.0)
        self.assertEqual(tuner.state("m")["decided"], "off")
        self.reactor.advance(1)
        self.feed(tuner, 1, False, 100.0)
        self.assertEqual(tuner.state("m")["decided"], "measuring")
        self.assertTrue(tuner.lookup("m"))
        self.assertFalse(self.path().exists())  # a re-trial's decision no longer holds

    def test_expired_at_restart_measures_again(self) -> None:
        self.decide_off()
        self.wall += 600
        tuner = self.restart()
        self.load(tuner)
        state = tuner.state("m")
        self.assertEqual(state["decided"], "measuring")
        self.assertTrue(tuner.lookup("m"))
        self.assertEqual(state["last"]["decided"], "off")  # its figures still shown
        self.assertTrue(any("has expired" in t for _, t in self.logged))

    def test_answers_since_saved_at_stop(self) -> None:
        """
        C{since} is written at stop: the re-trial after C{retry_answers}
        counts the answers before the restart too.
        """
        self.decide_off()
        self.feed(self.tuner, 30, False, 100.0)
        self.successResultOf(ensureDeferred(self.tuner.stop()))
        self.assertEqual(json.loads(self.path().read_text())["since"], 30)
        self.assertEqual(json.loads(self.path().read_text())["decided_at"], self.wall)
        tuner = self.restart()
        self.load(tuner)
        self.feed(tuner, 19, False, 100.0)
        self.assertEqual(tuner.state("m")["decided"], "off")
        self.feed(tuner, 1, False, 100.0)
        self.assertEqual(tuner.state("m")["decided"], "measuring")

    def test_measuring_not_written_at_stop(self) -> None:
        self.load(self.tuner)
        self.feed(self.tuner, 5, True, 100.0)
        self.successResultOf(ensureDeferred(self.tuner.stop()))
        self.assertFalse(self.path().exists())

    def test_answers_counted_before_the_read_win(self) -> None:
        self.decide_off()
        tuner = self.restart()
        self.feed(tuner, 2, True, 100.0)
        self.load(tuner)
        self.assertEqual(tuner.state("m")["decided"], "measuring")
        self.assertEqual(tuner.state("m")["rates"]["interactive"]["on_n"], 2)

    def test_read_once_per_model(self) -> None:
        self.decide_off()
        tuner = self.restart()
        self.load(tuner)
        self.path().unlink()
        self.load(tuner)
        self.assertEqual(tuner.state("m")["decided"], "off")

    def test_wall_clock_set_back(self) -> None:
        """
        A decision from the wall clock's future is as new, not older.
        """
        self.decide_off()
        self.wall -= 3600
        tuner = self.restart()
        self.load(tuner)
        self.assertEqual(tuner.state("m")["decided"], "off")
        self.reactor.advance(599)
        self.feed(tuner, 1, False, 100.0)
        self.assertEqual(tuner.state("m")["decided"], "off")

    def test_no_file(self) -> None:
        self.load(self.tuner)
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        self.assertEqual(self.warnings(), [])

    def check_ignored(self, content: bytes, why: str) -> None:
        self.path().parent.mkdir(parents=True, exist_ok=True)
        self.path().write_bytes(content)
        self.load(self.tuner)
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        self.assertTrue(self.tuner.lookup("m"))
        (warning,) = self.warnings()
        self.assertIn(str(self.path()), warning)
        self.assertIn(why, warning)

    def saved(self, **changes: Any) -> bytes:
        state = {"version": 1, "decided": "off", "decided_at": self.wall, "since": 0, "last": None}
        return json.dumps({**state, **changes}).encode()

    def test_corrupt_file_ignored(self) -> None:
        self.check_ignored(b'{"version": 1, "decided": "of', "Unterminated string")

    def test_not_strict_json_ignored(self) -> None:
        self.check_ignored(b'{"version": 1, "decided": "off", "decided_at": NaN, "since": 0}', "NaN")

    def test_not_utf8_ignored(self) -> None:
        self.check_ignored(b'{"decided": "\xff"}', "codec")

    def test_not_a_state_ignored(self) -> None:
        self.check_ignored(b"[1, 2]", "not a state of version 1")

    def test_other_version_ignored(self) -> None:
        self.check_ignored(self.saved(version=2), "not a state of version 1")

    def test_bad_decision_ignored(self) -> None:
        self.check_ignored(self.saved(decided="measuring"), "decided is 'measuring'")

    def test_bad_time_ignored(self) -> None:
        self.check_ignored(self.saved(decided_at="yesterday"), "decided_at is 'yesterday'")

    def test_bad_since_ignored(self) -> None:
        self.check_ignored(self.saved(since=-1), "since is -1")

    def test_bad_last_ignored(self) -> None:
        self.check_ignored(self.saved(last=[1]), "last is [1]")

    def test_unreadable_file_ignored(self) -> None:
        self.path().mkdir(parents=True)  # reading a directory: IsADirectoryError
        self.load(self.tuner)
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        (warning,) = self.warnings()
        self.assertIn("Is a directory", warning)

    def test_write_failure_logged_not_raised(self) -> None:
        """
        A write that fails (here: the model's directory is a file) is
        logged as an error; the decision holds in memory.
        """
        self.path().parent.parent.mkdir(parents=True)
        self.path().parent.write_bytes(b"")
        self.decide_off()
        self.assertFalse(self.tuner.lookup("m"))
        errors = [text for level, text in self.logged if level == LogLevel.error]
        self.assertEqual(len(errors), 1)
        self.assertIn("cannot write the speculative tuner's state", errors[0])
        self.successResultOf(ensureDeferred(self.tuner.stop()))

    def test_writes_in_the_thread_pool_in_order(self) -> None:
        """
        The files are written in the reactor's thread pool, one operation
        at a time per model: a re-trial's removal waits for the
        decision's write; stop waits for both.
        """
        pool = HeldThreadPool()
        self.reactor.getThreadPool = lambda: pool
        self.feed(self.tuner, 4, True, 100.0)
        self.feed(self.tuner, 4, False, 100.0)  # decided: the write is handed to the pool
        self.assertEqual(pool.names(), ["thd_write_state"])
        self.assertFalse(self.path().exists())
        self.reactor.advance(600)
        self.feed(self.tuner, 1, False, 100.0)  # a re-trial: its removal waits for the write
        self.assertEqual(self.tuner.state("m")["decided"], "measuring")
        self.assertEqual(pool.names(), ["thd_write_state"])
        stopped = ensureDeferred(self.tuner.stop())
        self.assertNoResult(stopped)
        pool.run_one()
        self.assertTrue(self.path().exists())
        self.assertEqual(pool.names(), ["thd_remove_state"])
        self.assertNoResult(stopped)
        pool.run_one()
        self.assertFalse(self.path().exists())
        self.successResultOf(stopped)


class HeldThreadPool:
    """
    A thread pool that holds its work until the test runs it.
    """

    def __init__(self) -> None:
        self.work: list[tuple[Any, Any, tuple[Any, ...]]] = []

    def callInThreadWithCallback(self, on_result: Any, f: Any, *args: Any) -> None:
        self.work.append((on_result, f, args))

    def names(self) -> list[str]:
        return [f.__name__ for _, f, _ in self.work]

    def run_one(self) -> None:
        on_result, f, args = self.work.pop(0)
        on_result(True, f(*args))


class SpecColumnTests(SynchronousTestCase):
    def test_blazar_ps_column(self) -> None:
        from blazar.gateway.operations import spec_column

        self.assertEqual(spec_column({"decided": "off", "running": "off"}), "auto=off")
        self.assertEqual(spec_column({"decided": "on", "running": None}), "auto=on")
        self.assertEqual(spec_column({"decided": "measuring", "running": "on"}), "auto?on")
        self.assertEqual(spec_column({"decided": "measuring", "running": None}), "auto?")
