"""
The process protocol for one engine child: line-by-line logging of its
output, a tail kept for error messages, and its exit as a value.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Callable

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from blazar.engines import lanes
from blazar.engines.waiters import Waiters
from blazar.names import strip_dirs

# Python program that makes the child die with the daemon, then becomes the
# engine (same PID, so signals and accounting go to the engine itself).
# PR_SET_PDEATHSIG survives exec; 1 is PR_SET_PDEATHSIG, 9 is SIGKILL.
# The child leaves the daemon's process group: a terminal's Ctrl-C signals
# the whole foreground group, and the daemon must be the one that stops its
# engines (after saving their sessions' slots), not the terminal.
DEATHSIG_LAUNCHER = (
    "import ctypes,os,sys\n"
    "try:\n"
    " ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)\n"
    "except Exception:\n"
    " pass\n"
    "os.setpgid(0,0)\n"
    # what the engine writes (the KV bank's slot files: conversations) is
    # its owner's alone
    "os.umask(0o077)\n"
    "os.execv(sys.argv[1],sys.argv[1:])\n"
)

MAX_LINE = 8192
TAIL_LINES = 40

# llama-server's words for a task it stopped because its client left
# (ENGINE.md): "srv stop: cancel task, id_task = 5", then, if the task had a
# slot, "slot release: id  1 | task 5 | stop processing: n_tokens = 178, ..."
# (the slot's tokens: the prompt and what was generated before the stop)
CANCEL_LINE = re.compile(r"cancel task, id_task = (\d+)")
RELEASE_LINE = re.compile(r"\| task (\d+) \| stop processing: n_tokens = (\d+)")
MAX_CANCELLING = 256


@attrs.frozen
class ExitStatus:
    """
    How a child ended: C{code} for a normal exit, C{signal} if killed.
    """

    code: int | None
    signal: int | None

    def describe(self) -> str:
        """
        Human words, e.g. C{"exit code 1"} or C{"killed by signal 9"}.
        """
        if self.signal is not None:
            return f"killed by signal {self.signal}"
        return f"exit code {self.code}"


def exit_status(reason: Failure) -> ExitStatus:
    """
    The L{ExitStatus} in a C{processEnded} reason.
    """
    value = reason.value
    if isinstance(value, ProcessTerminated):
        return ExitStatus(value.exitCode, value.signal)
    if isinstance(value, ProcessDone):
        return ExitStatus(0, None)
    return ExitStatus(None, None)


def process_alive(pid: int | None) -> bool:
    """
    Whether process C{pid} is running (not gone, not a zombie), from
    C{/proc/<pid>/stat}; one small read, for the rare failure path.
    """
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


def thd_rss(pid: int) -> int | None:
    """
    Resident memory of process C{pid} in bytes, or L{None} (gone, or not
    readable). Blocking: call in a thread pool.
    """
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return None


def sanitize_line(line: str) -> str:
    """
    A line of engine output as a client may see it: printable, at most 300
    characters, file paths reduced to their last component.
    """
    text = "".join(c if c.isprintable() else " " for c in line)
    return strip_dirs(text).strip()[:300]


ROUTINE_WARNINGS = (
    # a prompt whose every token is already in the slot's KV cache (the same
    # request again): llama-server re-evaluates the last one, and says so at
    # warning level twice per request
    "need to evaluate at least 1 token",
    "n_past was set to",
)


_ROUTINE = re.compile("|".join(re.escape(routine) for routine in ROUTINE_WARNINGS))


def engine_level(line: str) -> str | None:
    """
    The level llama.cpp's log format gives a line (C{0.00.002.435 W srv  ...}:
    C{"W"} for a warning, C{"E"} for an error), or L{None} for its info and
    debug lines, for lines in no known format and for the warnings it
    prints in routine work (L{ROUTINE_WARNINGS}).
    """
    head = line[:24]
    if " E " in head:
        return "E"
    if " W " in head and _ROUTINE.search(line) is None:
        return "W"
    return None


class EngineProcessProtocol(ProcessProtocol):
    """
    Reads a child's stdout and stderr, keeps the last L{TAIL_LINES} lines,
    hands every line to C{output} (the daemon's per-model ring, which
    C{blazar logs MODEL} shows), and fires L{ended} on exit.

    Only the lines the engine marks as warnings or errors become events of
    the daemon's log: formatting every line as a log event (a llama-server
    writes nine per request) was a third of the daemon's CPU. Without an
    C{output} (a protocol made alone, in a test), every line is logged.

    Lines longer than L{MAX_LINE} bytes are cut, never treated as an error:
    closing an engine's pipes would kill it with SIGPIPE.
    """

    log = Logger()

    def __init__(
        self,
        model: str,
        engine: str = "llamacpp",
        output: Callable[[str, str], None] | None = None,
    ) -> None:
        """
        @param output: Takes C{(model, line)} for every line of output.
        """
        self.model = model
        self.engine = engine
        self._output = output
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.status: ExitStatus | None = None
        self._partial = {1: b"", 2: b""}
        self._ended: Waiters[ExitStatus] = Waiters()
        self._cancelling: deque[int] = deque(maxlen=MAX_CANCELLING)  # task ids the engine said it cancelled
        self._cancel_waiters: Waiters[int] = Waiters()

    def connectionMade(self) -> None:
        # llama-server does not read stdin.
        assert self.transport is not None
        self.transport.closeStdin()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        buffered = self._partial.get(childFD, b"") + data
        end = buffered.rfind(b"\n")
        if end < 0:
            rest = buffered
        elif end <= MAX_LINE:
            # no line in the block can be over MAX_LINE: decoded at once
            # (a newline is never part of a multi-byte character, so this
            # is each line decoded alone) and checked at once for what
            # only some lines hold
            self._lines(buffered[:end].decode("utf-8", "replace"))
            rest = buffered[end + 1 :]
        else:
            *lines, rest = buffered.split(b"\n")
            for line in lines:
                self._line(line)
        if len(rest) > MAX_LINE:
            self._line(rest)
            rest = b""
        self._partial[childFD] = rest

    def _lines(self, block: str) -> None:
        """
        The complete lines C{block} holds (without its last newline), each
        as L{_text} takes it; what only some lines hold (a cancel report,
        a warning or error level) looked for once in the block, and per
        line only when the block has it.
        """
        output = self._output
        if output is None:
            for text in block.split("\n"):
                self._text(text.rstrip("\r"))
            return
        cancels = "cancel task" in block or "stop processing" in block
        levels = " E " in block or " W " in block
        tail, model = self.tail, self.model
        for text in block.split("\n"):
            if text.endswith("\r"):
                text = text.rstrip("\r")
            if not text:
                continue
            tail.append(text)
            if cancels and ("cancel task" in text or (self._cancelling and "stop processing" in text)):
                self._cancel_report(text)
            output(model, f"{model} | {text}")
            if levels:
                self._log_level(text)

    def _line(self, raw: bytes) -> None:
        self._text(raw[:MAX_LINE].rstrip(b"\r").decode("utf-8", "replace"))

    def _text(self, text: str) -> None:
        if not text:
            return
        self.tail.append(text)
        if "cancel task" in text or (self._cancelling and "stop processing" in text):
            self._cancel_report(text)
        if self._output is None:
            self.log.info("{model} | {line}", model=self.model, engine=self.engine, line=text)
            return
        self._output(self.model, f"{self.model} | {text}")
        self._log_level(text)

    def _log_level(self, text: str) -> None:
        level = engine_level(text)
        if level == "E":
            self.log.error("{model} | {line}", model=self.model, engine=self.engine, line=text, ring=False)
        elif level == "W":
            self.log.warn("{model} | {line}", model=self.model, engine=self.engine, line=text, ring=False)

    def _cancel_report(self, text: str) -> None:
        cancel = CANCEL_LINE.search(text)
        if cancel is not None:
            self._cancelling.append(int(cancel.group(1)))
            return
        release = RELEASE_LINE.search(text)
        if release is None or int(release.group(1)) not in self._cancelling:
            return
        self._cancelling.remove(int(release.group(1)))
        self._cancel_waiters.fire_first(int(release.group(2)))

    def next_cancelled(self) -> Deferred[int]:
        """
        The tokens of the next task the child reports it stopped early (its
        client left): the prompt and what it generated before the stop, in
        its slot. Waiters are served in order; a stop no one waits for is
        dropped. Cancelling the Deferred (a time limit) stops only this
        wait.
        """
        return self._cancel_waiters.wait()

    def unknown_architecture(self) -> str | None:
        """
        The architecture llama.cpp said it does not know, if its output says
        so (L{blazar.engines.lanes.unknown_architecture}; the unfinished
        last line of each stream counts too).
        """
        partial = [raw[:MAX_LINE].decode("utf-8", "replace") for raw in self._partial.values() if raw]
        return lanes.unknown_architecture("\n".join(list(self.tail)[-32:] + partial))

    def tail_text(self, lines: int = 8) -> str:
        """
        The last C{lines} lines of output, joined with newlines.
        """
        return "\n".join(list(self.tail)[-lines:])

    def error_line(self) -> str:
        """
        The one line of output fit for a client to see: of the last 16, the
        first error line (llama.cpp's C{E} level, or one that says "error":
        the cause; later ones tend to say "exiting due to ... error"), else
        the last line; with directories cut from file paths and at most 300
        characters. The whole tail stays in the daemon's log.
        """
        lines = list(self.tail)[-16:]
        chosen = next(
            (line for line in lines if " E " in line[:24] or "error" in line.lower()), lines[-1] if lines else ""
        )
        return sanitize_line(chosen)

    def processEnded(self, reason: Failure) -> None:
        for fd, rest in self._partial.items():
            if rest:
                self._line(rest)
            self._partial[fd] = b""
        self.status = exit_status(reason)
        self._ended.fire(self.status)

    def when_ended(self) -> Deferred[ExitStatus]:
        """
        A Deferred that fires with the L{ExitStatus} once the child has
        exited and its pipes are closed (at once if that already happened).
        Cancelling it stops only this wait.
        """
        if self.status is not None:
            from twisted.internet.defer import succeed

            return succeed(self.status)
        return self._ended.wait()
