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

import re
import sys
import time
from typing import IO, Any

from twisted.logger import ILogObserver, eventAsText
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
    if _CONTROLS.search(text) is None:
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


@implementer(ILogObserver)
class TextObserver:
    """
    Writes each event as one line of C{out}, in twistd's classic format,
    and flushes.

    """

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._second = -1
        self._stamp = ""

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
        self._out.write(f"{stamp} [{system}] {text}\n")
        self._out.flush()


def observer() -> TextObserver:
    """
    twistd's C{--logger} factory: L{TextObserver} on standard output.
    """
    return TextObserver(sys.stdout)
