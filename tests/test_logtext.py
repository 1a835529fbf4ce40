"""
The daemon's text log (L{blazar.logtext}) says what twistd's own observer
says, line for line.
"""

from __future__ import annotations

import io
import time
from typing import Callable, cast

from twisted.internet.task import Clock
from twisted.logger import ILogObserver, Logger, LogPublisher, formatEventAsClassicLogText, formatTime
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from blazar.logtext import FLUSH_SECS, RENDERED, TextObserver, event_text


def events_of(emit: Callable[[Logger], None]) -> list[dict[str, object]]:
    publisher = LogPublisher()
    events: list[dict[str, object]] = []
    publisher.addObserver(cast(ILogObserver, events.append))
    emit(Logger(namespace="blazar.web.site", observer=publisher))
    return events


class TextObserverTests(SynchronousTestCase):
    def twistd_line(self, event: dict[str, object]) -> str:
        return formatEventAsClassicLogText(event, lambda t: formatTime(t, "%Y-%m-%dT%H:%M:%S%z")) or ""

    def ours(self, event: dict[str, object]) -> str:
        out = io.StringIO()
        TextObserver(out)(event)
        return out.getvalue()

    def test_the_same_lines_as_twistds_observer(self) -> None:
        def emit(log: Logger) -> None:
            log.info("{method} {path} {status}", method="POST", path="/v1/{odd}", status=200)
            log.warn("two\nlines")
            log.info(
                RENDERED, rendered="POST /v1/chat/completions 200 573 11.8ms model=tiny key= trace=t", method="POST"
            )
            log.error("{x!r}", x={"a": 1})
            try:
                1 / 0
            except ZeroDivisionError:
                log.failure("it broke", Failure())

        events = events_of(emit)
        events.append({"log_format": "system set", "log_system": "-", "log_time": time.time()})
        events.append({"log_format": "no time", "log_namespace": "n"})

        class Unprintable:
            def __str__(self) -> str:
                raise ValueError("nope")

        events.append({"log_format": "x", "log_system": Unprintable(), "log_time": 1700000000.0})
        for event in events:
            self.assertEqual(self.ours(event), self.twistd_line(event))

    def test_a_rendered_event_is_taken_as_it_is(self) -> None:
        [event] = events_of(lambda log: log.info(RENDERED, rendered="GET /{not a field} 200", status=200))
        self.assertEqual(event_text(event), "GET /{not a field} 200")

    def test_the_time_prefix_follows_the_clock(self) -> None:
        out = io.StringIO()
        observer = TextObserver(out)
        for when in (0.2, 0.9, 1.1, 3600.5):
            observer({"log_format": "x", "log_time": when, "log_namespace": "n", "log_level": None})
        stamps = [line.split(" ")[0] for line in out.getvalue().splitlines()]
        self.assertEqual(stamps, [formatTime(t, "%Y-%m-%dT%H:%M:%S%z") for t in (0.2, 0.9, 1.1, 3600.5)])

    def test_an_event_without_a_format_writes_nothing(self) -> None:
        self.assertEqual(self.ours({"log_time": 1.0, "x": 1}), "")

    def test_terminal_controls_are_escaped(self) -> None:
        """
        What a client sends (issue 36: a C{User-Agent} or model name with
        ESC, CR, C1's CSI) reaches the log as text, not as a terminal
        escape sequence; tabs and newlines stay.
        """
        evil = "curl\x1b[2J\x1b]0;pwned\x07\r\x9b31m\x00\x7f"
        [rendered] = events_of(lambda log: log.info(RENDERED, rendered=f"POST / 200 model={evil}"))
        [formatted] = events_of(lambda log: log.info("client {client} at\ttwo\nlines", client=evil))
        for event in (rendered, formatted):
            line = self.ours({**event, "log_time": 1.0})
            self.assertIn("curl\\x1b[2J\\x1b]0;pwned\\x07\\r\\x9b31m\\x00\\x7f", line)
            self.assertNotRegex(line.replace("\n", "").replace("\t", ""), "[\x00-\x1f\x7f-\x9f]")
        self.assertIn("at\ttwo\n\tlines", self.ours({**formatted, "log_time": 1.0}))


class FlushCounter(io.StringIO):
    flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


class DeferredFlushTests(SynchronousTestCase):
    """
    With a C{later}, the lines written on the reactor's thread share one
    flush, made within L{FLUSH_SECS}; without one (no running reactor, or
    another thread) each line is flushed at once.
    """

    def event(self, when: float) -> dict[str, object]:
        return {"log_format": "x", "log_time": when, "log_namespace": "n", "log_level": None}

    def test_one_flush_for_the_lines_of_a_moment(self) -> None:
        clock = Clock()
        out = FlushCounter()

        def later(delay: float, f: Callable[[], None]) -> bool:
            clock.callLater(delay, f)
            return True

        observer = TextObserver(out, later)
        for when in (10.0, 10.01, 10.02):
            observer(self.event(when))
        self.assertEqual((out.flushes, out.getvalue()), (0, ""))  # held: one write for them all
        clock.advance(FLUSH_SECS)
        self.assertEqual((out.flushes, len(out.getvalue().splitlines())), (1, 3))
        observer(self.event(10.1))
        clock.advance(FLUSH_SECS)
        self.assertEqual(out.flushes, 2)

    def test_flushed_at_once_when_it_cannot_wait(self) -> None:
        out = FlushCounter()
        observer = TextObserver(out, lambda delay, f: False)
        observer(self.event(1.0))
        observer(self.event(1.0))
        self.assertEqual(out.flushes, 2)

    def test_a_flush_that_never_came_does_not_hold_later_lines(self) -> None:
        """
        A flush scheduled as the reactor stopped never runs: a line a
        second later is flushed at once.
        """
        out = FlushCounter()
        can_wait = [True]
        observer = TextObserver(out, lambda delay, f: can_wait[0])
        observer(self.event(5.0))
        can_wait[0] = False
        observer(self.event(5.5))
        self.assertEqual(out.flushes, 0)
        observer(self.event(6.5))
        self.assertEqual((out.flushes, len(out.getvalue().splitlines())), (1, 3))

    def test_flush_writes_what_is_held(self) -> None:
        out = FlushCounter()
        observer = TextObserver(out, lambda delay, f: True)
        observer(self.event(1.0))
        observer.flush()
        self.assertEqual(len(out.getvalue().splitlines()), 1)


class SignalDuringWrite(io.StringIO):
    """
    An output whose first write is interrupted by a signal handler that
    logs through the same observer (as twistd's SIGTERM handler does).
    """

    observer: TextObserver
    line: dict[str, object]
    interrupted = False

    def write(self, text: str) -> int:
        if not self.interrupted:
            self.interrupted = True
            self.observer(self.line)
        return super().write(text)


class ReentryTests(SynchronousTestCase):
    def event(self, when: float, text: str) -> dict[str, object]:
        return {"log_format": text, "log_time": when, "log_namespace": "n", "log_level": None}

    def test_a_signal_handler_logging_mid_write_neither_hangs_nor_loses_lines(self) -> None:
        """
        A line logged while the observer writes (a signal handler on the
        same thread) is written after the lines being written, once; the
        observer never waits on its own lock.
        """
        import threading

        for later in (lambda delay, f: True, lambda delay, f: False):
            out = SignalDuringWrite()
            observer = TextObserver(out, later)
            out.observer, out.line = observer, self.event(2.0, "Received SIGTERM, shutting down.")
            done = threading.Event()

            def log() -> None:
                observer(self.event(1.0, "before"))
                observer.flush()
                done.set()

            thread = threading.Thread(target=log, daemon=True)
            thread.start()
            thread.join(5)
            self.assertTrue(done.is_set(), "the observer waited on its own lock")
            observer.flush()
            self.assertEqual(
                [line.split("] ", 1)[1] for line in out.getvalue().splitlines()],
                ["before", "Received SIGTERM, shutting down."],
            )
