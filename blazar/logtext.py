"""
The daemon's log as text lines, at a cost the request path can pay.

twistd's own text observer formats each event's time with a time-zone
lookup and renders its format string field by field: about 67 µs per
event on a 2-core VM, a tenth of Blazar's CPU per request for the access
line alone. L{TextObserver} writes the same line
(C{2026-12-02T01:51:14+0000 [namespace#level] text}) with the time prefix
made once per second, and takes an event whose format is C{"{rendered}"}
(L{RENDERED}: the access line, built once by the site) as it is.

C{blazar serve} runs twistd with C{--logger=blazar.logtext.observer};
C{twistd -n blazar} without it logs through twistd's own observer (the
same lines, formatted more slowly).
"""

from __future__ import annotations

import atexit
import re
import sys
import threading
import time
from typing import IO, Any, Callable

from twisted.logger import ILogObserver, eventAsText
from twisted.python import threadable
from zope.interface import implementer

RENDERED = "{rendered}"
"""
The format of an event whose text is already made: C{rendered=TEXT}.
"""


# C0 controls but tab and newline, DEL, and C1 controls: what a terminal
# acts on (ESC starts its escape sequences; C1's CSI is one on its own)
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """
    C{text} with the control characters a terminal acts on written as
    Python escapes (ESC as C{\\x1b}, CR as C{\\r}): what clients send (a
    C{User-Agent}, a model name, a field name) reaches the log file,
    C{blazar logs} and C{tail -f} as text, never as a terminal escape
    sequence. Tabs and newlines stay (a multi-line event is one indented
    entry).
    """
    if text.isprintable() or _CONTROLS.search(text) is None:  # (every character it escapes is unprintable)
        return text
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], text)


def event_text(event: dict[str, Any]) -> str | None:
    """
    The text of C{event} as L{twisted.logger.formatEvent} gives it (with
    a failure's traceback), taking a L{RENDERED} event's text as it is;
    control characters escaped (L{printable}).
    """
    if event.get("log_format") == RENDERED and "log_failure" not in event:
        rendered = event.get("rendered")
        if isinstance(rendered, str):
            return printable(rendered)
    text = eventAsText(event, includeTraceback=True, includeTimestamp=False, includeSystem=False)
    return printable(text) if text else None


FLUSH_SECS = 0.0
"""
How long a line logged on the reactor's thread may be held: until the
reactor's next turn. A stream's chunks and a finished answer are sent in
the turn that wrote them (L{blazar.web.site}), so a response's last log
lines may reach the file just after the client has the response.
"""


@implementer(ILogObserver)
class TextObserver:
    """
    Writes each event as one line of C{out}, in twistd's classic format,
    and flushes: at once, or, when C{later} takes the flush, after
    L{FLUSH_SECS}: the lines of that time are held and written together
    (one write system call for them all, not one per line, even when
    C{out} writes through, as with C{PYTHONUNBUFFERED}).
    """

    def __init__(self, out: IO[str], later: Callable[[float, Callable[[], None]], bool] | None = None) -> None:
        """
        @param later: C{later(delay, f)} calls C{f} after C{delay} seconds
            and returns C{True}, or returns C{False} when it cannot (no
            reactor running, or not on its thread): the line is flushed
            at once.
        """
        self._out = out
        self._later = later
        self._flush_due: float | None = None  # the log time of the first line waiting for the flush
        self._held: list[str] = []  # lines waiting for it (C{out} may write through: PYTHONUNBUFFERED)
        # threads log too; and a signal handler (twistd's SIGTERM: "Received
        # SIGTERM, shutting down.") logs on the reactor's thread in the middle
        # of whatever it interrupted, this observer's own write included: the
        # lock is re-entrant, and a flush entered again leaves the lines to
        # the one under way (a lock that is not would wait on itself forever)
        self._lock = threading.RLock()
        self._writing = False
        self._second = -1
        self._stamp = ""

    def flush(self) -> None:
        """
        Write the lines held for the next flush, and flush C{out}.
        """
        with self._lock:
            if self._writing:
                return  # entered again (a signal handler's line): the flush under way writes it next
            self._writing = True
            try:
                self._flush_due = None
                while self._held:
                    lines, self._held = self._held, []
                    self._out.write("".join(lines))
                self._out.flush()
            finally:
                self._writing = False

    def _time(self, when: float) -> str:
        second = int(when)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(second))
        return self._stamp

    def __call__(self, event: dict[str, Any]) -> None:
        text = event_text(event)
        if text is None:
            return
        when = event.get("log_time")
        stamp = self._time(when) if isinstance(when, (int, float)) else "-"  # as twistd's
        system = event.get("log_system")
        if system is None:
            level = event.get("log_level")
            system = f"{event.get('log_namespace', '-')}#{getattr(level, 'name', '-')}"
        elif not isinstance(system, str):
            try:
                system = str(system)
            except Exception:
                system = "UNFORMATTABLE"
        if "\n" in text:
            text = text.replace("\n", "\n\t")
        line = f"{stamp} [{system}] {text}\n"
        with self._lock:
            self._held.append(line)
            if self._later is not None and isinstance(when, (int, float)):
                if self._flush_due is not None and when < self._flush_due + 1.0:
                    return  # (a flush that has not come in a second never will: the reactor stopped)
                if self._later(FLUSH_SECS, self.flush):
                    self._flush_due = when
                    return
        self.flush()


def _reactor_later(delay: float, f: Callable[[], None]) -> bool:
    """
    C{f} called by the running reactor after C{delay} seconds, when called
    on the reactor's thread (L{TextObserver}'s C{later}).
    """
    reactor = sys.modules.get("twisted.internet.reactor")  # never installs one (twistd chooses it)
    if reactor is None or not getattr(reactor, "running", False) or not threadable.isInIOThread():
        return False
    reactor.callLater(delay, f)
    return True


def observer() -> TextObserver:
    """
    twistd's C{--logger} factory: L{TextObserver} on standard output,
    flushed by the running reactor on its next turn (L{FLUSH_SECS}).
    """
    text = TextObserver(sys.stdout, _reactor_later)
    atexit.register(text.flush)  # what the reactor had no time to flush
    return text
