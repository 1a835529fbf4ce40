"""
C{speculative = "auto"}: keep n-gram lookup on a model's child only while
it makes decoding faster, measured on the model's own traffic.

The tuner is fed each answer's decode rate: llama-server's own
C{timings.predicted_per_second} (the tokens it generated over the time it
spent generating them, prompt processing excluded), from a non-streamed
answer or a stream's last chunk, with the answer's work class and whether
the child that gave it ran with lookup. Per answer rather than from the
C{/metrics} counters: the counters are scraped once a minute and mix the
work classes; a timing belongs to one answer, one class and one child.
Answers shorter than L{MIN_TOKENS} are left out (their rate is mostly
noise), and so is the first answer of each child (given its pid): a
child just started may decode its first answer slower (cold caches, pages
not yet faulted in), and each side of a trial is measured on a fresh
child, so neither side is measured on a cold start.

A trial, per model: its child starts with lookup (C{decided}:
C{"measuring"}); once one work class has C{window} answers with lookup,
the tuner wants the child without it, which the supervisor applies at the
next idle reload (a moment the child runs no request: never cutting one);
once every class that had C{window} answers with lookup has them without
too (or one class has L{STALL} windows without: the others' traffic
left), it compares the classes' mean rates: the model's gain is the mean of the classes' with/without
ratios, weighted by their answers. Lookup stays (C{"on"}) when the gain is
at least L{MARGIN} (5%), else it goes (C{"off"}), again at the next idle
reload. The decision is logged with both rates, the counts and the margin.
After L{RETRY_SECS} or L{RETRY_ANSWERS} answers the trial starts again
(traffic changes).

A decision outlives the daemon: given C{path_for}, each model's decided
state is written to C{<data_dir>/speccache/<model>/}L{STATE_FILE} when it
is decided and again at stop (with its C{since}), and read, in the thread
pool, before the model's first child is spawned (L{SpecTuner.load}), so a
restarted daemon does not measure again (lookup on for a window or more,
which costs free prose some 15% of its decode speed). The file (strict
JSON, written whole to a temporary name renamed over the old one)::

    {"version": 1, "decided": "off", "decided_at": 1754390400.5,
     "since": 12, "last": {"decided": "off", "ratio": 0.884, ...}}

C{decided_at} is wall-clock time (Unix seconds), since the tuner's clock
(the reactor, a L{twisted.internet.task.Clock} in tests) need not run
from any epoch. Read back, the decision's age (wall clock now minus
C{decided_at}, never below 0: a clock set back makes a decision new, not
older) is subtracted from the tuner's clock, so the re-trial comes when
it would have come without the restart. A decision of L{RETRY_SECS} or
more ago (or after L{RETRY_ANSWERS} answers) is expired: the trial starts
over, keeping its figures as C{last}. A trial still measuring is not
written (the file of the decision it re-tries is removed when the
re-trial starts); a file that cannot be read or is not such a state is
logged and ignored.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import attrs
from twisted.internet.defer import Deferred, DeferredList, DeferredLock
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from blazar import strictjson
from blazar.files import private_dir, write_whole

log = Logger()

# answers per work class, with lookup and without, before deciding (the
# model's speculative_window overrides it)
WINDOW = 20
# lookup stays only when decoding with it is at least this much faster
MARGIN = 0.05
# a decision is tried again after this many seconds or answers
RETRY_SECS = 3600.0
RETRY_ANSWERS = 1000
# a class measured with lookup is waited for until another has this many windows without
STALL = 3
# answers with fewer generated tokens are not counted
MIN_TOKENS = 16
# a model's decided state, in its speccache directory
STATE_FILE = "tuner.json"
STATE_VERSION = 1


@attrs.define
class Rates:
    """
    Decode rates of one work class with one setting: count and sum.
    """

    n: int = 0
    total: float = 0.0

    def add(self, rate: float) -> None:
        self.n += 1
        self.total += rate

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


@attrs.define
class Trial:
    """
    One model's tuning state.

    @ivar decided: C{"measuring"}, C{"on"} or C{"off"}.
    @ivar lookup: Whether the model's next child should run with lookup.
    @ivar on: Rates with lookup, per work class.
    @ivar off: Rates without, per work class.
    @ivar decided_at: When it was decided, in seconds on the tuner's clock.
    @ivar since: Answers counted since it was decided.
    @ivar last: The figures of the last decision (for C{/api/ps}).
    """

    decided: str = "measuring"
    lookup: bool = True
    on: dict[str, Rates] = attrs.field(factory=dict)
    off: dict[str, Rates] = attrs.field(factory=dict)
    decided_at: float | None = None
    since: int = 0
    last: dict[str, Any] | None = None

    def state(self) -> dict[str, Any]:
        """
        What C{/api/ps} shows: the decision, the lookup the next child gets,
        the rates being measured per work class, and the last decision's
        figures.
        """
        classes = sorted(set(self.on) | set(self.off))
        return {
            "decided": self.decided,
            "lookup": "on" if self.lookup else "off",
            "rates": {
                c: {
                    "on": _round(self.on[c].mean if c in self.on else None),
                    "on_n": self.on[c].n if c in self.on else 0,
                    "off": _round(self.off[c].mean if c in self.off else None),
                    "off_n": self.off[c].n if c in self.off else 0,
                }
                for c in classes
            },
            "last": self.last,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def saved_state(trial: Trial, decided_at: float) -> dict[str, Any]:
    """
    What L{STATE_FILE} holds for a decided C{trial}: C{version},
    C{decided} (C{"on"} or C{"off"}), C{decided_at} (the wall-clock time
    of the decision, Unix seconds), C{since} (answers since) and C{last}
    (the decision's figures, as L{Trial.state} shows them).
    """
    return {
        "version": STATE_VERSION,
        "decided": trial.decided,
        "decided_at": decided_at,
        "since": trial.since,
        "last": trial.last,
    }


def restored_trial(saved: Any, now: float, wall: float, retry_secs: float, retry_answers: int) -> tuple[Trial, float]:
    """
    The trial a saved state (L{saved_state}, decoded) gives back, and the
    decision's age in seconds (the wall clock C{wall} minus its
    C{decided_at}, at least 0). Its C{decided_at} is on the tuner's clock
    (C{now} minus the age). An expired decision (L{RETRY_SECS} or
    L{RETRY_ANSWERS} reached) gives a new trial (measuring, with lookup)
    that keeps the figures as C{last}.

    @raise ValueError: C{saved} is not such a state.
    """
    if not isinstance(saved, dict) or saved.get("version") != STATE_VERSION:
        raise ValueError(f"not a state of version {STATE_VERSION}")
    decided, decided_at, since, last = (saved.get(k) for k in ("decided", "decided_at", "since", "last"))
    if decided not in ("on", "off"):
        raise ValueError(f'decided is {decided!r}, not "on" or "off"')
    if isinstance(decided_at, bool) or not isinstance(decided_at, (int, float)) or not math.isfinite(decided_at):
        raise ValueError(f"decided_at is {decided_at!r}, not a time")
    if isinstance(since, bool) or not isinstance(since, int) or since < 0:
        raise ValueError(f"since is {since!r}, not a count of answers")
    if last is not None and not isinstance(last, dict):
        raise ValueError(f"last is {last!r}, not an object")
    age = max(0.0, wall - decided_at)
    if age >= retry_secs or since >= retry_answers:
        return Trial(last=last), age
    return Trial(decided=decided, lookup=decided == "on", decided_at=now - age, since=since, last=last), age


def thd_read_state(path: Path) -> Any:
    """
    The decoded strict JSON of a state file, L{None} if there is none.

    @raise OSError: It cannot be read.
    @raise ValueError: It is not strict JSON in UTF-8 (or -16, -32).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return strictjson.loads(data)


def thd_write_state(path: Path, data: bytes) -> None:
    """
    Write a state file whole (a temporary name renamed over the old
    file), making its directory (0700, as the lookup cache's) if missing.
    """
    if not path.parent.is_dir():
        private_dir(path.parent.parent)
        private_dir(path.parent)
    write_whole(path.with_name(path.name + ".tmp"), path, lambda out: out.write(data))


def thd_remove_state(path: Path) -> None:
    path.unlink(missing_ok=True)


class SpecTuner:
    """
    The trials of every C{speculative = "auto"} model, in memory, and
    their decisions in files when given C{path_for}.

    @param clock: C{IReactorTime} (the decisions' times, the re-trial).
    @param path_for: A model's canonical name -> its L{STATE_FILE}
        (L{None}: nothing is read or written).
    @param reactor: C{IReactorThreads}, which reads and writes the files
        in its thread pool (L{None}: C{clock}).
    @param wall: The wall-clock time in Unix seconds (C{time.time}): what
        the files hold.
    """

    def __init__(
        self,
        clock: Any,
        margin: float = MARGIN,
        retry_secs: float = RETRY_SECS,
        retry_answers: int = RETRY_ANSWERS,
        path_for: Callable[[str], Path] | None = None,
        reactor: Any = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self.margin = margin
        self.retry_secs = retry_secs
        self.retry_answers = retry_answers
        self.trials: dict[str, Trial] = {}
        self._children: dict[str, int] = {}  # model -> the child whose first answer was seen
        self._path_for = path_for
        self._reactor = clock if reactor is None else reactor
        self._wall = wall
        self._loading: dict[str, Deferred[None]] = {}
        # one file operation at a time per model, in order (a decision's write, a re-trial's removal)
        self._locks: dict[str, DeferredLock] = {}
        self._pending: set[Deferred[Any]] = set()

    async def load(self, model: str) -> None:
        """
        Read C{model}'s saved decision (L{STATE_FILE}) in the thread pool,
        once: the supervisor awaits it before spawning the model's child,
        so a decision that outlived a restart gives its lookup to the first
        child. A decision still in force becomes the model's trial, unless
        answers were counted meanwhile (then memory wins); an expired one
        starts a new trial that shows its figures as C{last}. Never fails:
        a file that cannot be read or is not a state is logged and ignored.
        """
        if self._path_for is None:
            return
        loading = self._loading.get(model)
        if loading is None:
            loading = self._loading[model] = Deferred.fromCoroutine(self._load(model, self._path_for(model)))
            loading.addErrback(lambda f: log.failure("{model}: reading the speculative tuner's state", f, model=model))
        await loading

    async def _load(self, model: str, path: Path) -> None:
        try:
            saved = await self._thread(thd_read_state, path)
            if saved is None or model in self.trials:
                return
            trial, age = restored_trial(saved, self._clock.seconds(), self._wall(), self.retry_secs, self.retry_answers)
        except (OSError, ValueError) as e:
            log.warn(
                "{model}: ignoring the speculative tuner's state {path} ({error}): it measures afresh",
                model=model,
                path=str(path),
                error=str(e) or repr(e),
            )
            return
        self.trials[model] = trial
        if trial.decided == "measuring":
            log.info(
                "{model}: speculative auto's saved decision ({decided}, {age:.0f}s and {answers} answers ago) "
                "has expired: it tries n-gram lookup again",
                model=model,
                decided=(trial.last or {}).get("decided"),
                age=age,
                answers=saved["since"],
            )
        else:
            log.info(
                "{model}: speculative auto keeps its saved decision: {decided} ({age:.0f}s and {answers} answers ago)",
                model=model,
                decided=trial.decided,
                age=age,
                answers=trial.since,
            )

    async def stop(self) -> None:
        """
        Write every decided trial again (its C{since} changed), then wait
        for every file operation under way. Never fails.
        """
        for model, trial in sorted(self.trials.items()):
            if trial.decided != "measuring":
                self._save(model, trial)
        await DeferredList(list(self._pending), consumeErrors=True)

    def _thread(self, f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        return deferToThreadPool(self._reactor, self._reactor.getThreadPool(), f, *args)

    def _save(self, model: str, trial: Trial) -> None:
        assert trial.decided_at is not None
        # the decision's wall-clock time: now on the wall clock, less its age on the tuner's
        decided_at = self._wall() - (self._clock.seconds() - trial.decided_at)
        data = strictjson.encode(saved_state(trial, decided_at), sort_keys=True).encode("utf-8")
        self._file(model, "write", thd_write_state, data)

    def _file(self, model: str, verb: str, f: Callable[..., None], *args: Any) -> None:
        # f(path, *args) in the thread pool, after the model's earlier ones; a failure is logged
        if self._path_for is None:
            return
        path = self._path_for(model)
        d = self._locks.setdefault(model, DeferredLock()).run(self._thread, f, path, *args)
        self._pending.add(d)

        def failed(failure: Any) -> None:
            if failure.check(OSError):
                log.error(
                    "{model}: cannot {verb} the speculative tuner's state {path}: {error}",
                    model=model,
                    verb=verb,
                    path=str(path),
                    error=failure.getErrorMessage(),
                )
            else:
                log.failure("{model}: {verb} the speculative tuner's state", failure, model=model, verb=verb)

        d.addErrback(failed)
        d.addBoth(lambda _: self._pending.discard(d))

    def lookup(self, model: str) -> bool:
        """
        Whether the next child of C{model} should run with n-gram lookup
        (C{True} for a model not tried yet: a trial starts with it on).
        """
        trial = self.trials.get(model)
        return trial.lookup if trial is not None else True

    def state(self, model: str) -> dict[str, Any]:
        return self.trials.get(model, Trial()).state()

    def observe(
        self,
        model: str,
        work: str,
        lookup: bool,
        rate: float,
        tokens: int,
        window: int | None = None,
        child: int | None = None,
    ) -> None:
        """
        One answer of C{model}, of work class C{work}, from a child that
        ran with lookup (C{lookup}) or without, decoding C{tokens} tokens
        at C{rate} tokens/s.

        @param child: The child's pid: its first answer is not counted
            (L{None}: every answer counts).
        """
        if child is not None and self._children.get(model) != child:
            self._children[model] = child
            return  # a fresh child's first answer: warming up
        if tokens < MIN_TOKENS or not rate > 0:
            return
        window = window or WINDOW
        trial = self.trials.setdefault(model, Trial())
        if trial.decided != "measuring":
            trial.since += 1
            assert trial.decided_at is not None
            if trial.since >= self.retry_answers or self._clock.seconds() - trial.decided_at >= self.retry_secs:
                log.info(
                    "{model}: speculative auto tries n-gram lookup again ({answers} answers, {secs:.0f}s since "
                    "it decided {decided})",
                    model=model,
                    answers=trial.since,
                    secs=self._clock.seconds() - trial.decided_at,
                    decided=trial.decided,
                )
                trial = self.trials[model] = Trial(last=trial.last)
                self._file(model, "remove", thd_remove_state)  # (the decision no longer holds)
            else:
                return
        (trial.on if lookup else trial.off).setdefault(work, Rates()).add(rate)
        if trial.lookup:
            if any(r.n >= window for r in trial.on.values()):
                trial.lookup = False
                log.info(
                    "{model}: speculative auto measured {window} answers with n-gram lookup; the next idle "
                    "reload starts it without, to compare",
                    model=model,
                    window=window,
                )
            return
        tried = [c for c in trial.on if trial.on[c].n >= window]
        full = [c for c in tried if c in trial.off and trial.off[c].n >= window]
        # every class measured with lookup is waited for, unless one has STALL windows without (its traffic left)
        waited = any(r.n >= STALL * window for r in trial.off.values())
        if full and (len(full) == len(tried) or waited):
            self._decide(model, trial, full)

    def _decide(self, model: str, trial: Trial, classes: list[str]) -> None:
        weights = {c: trial.on[c].n + trial.off[c].n for c in classes}
        ratios = {c: (trial.on[c].mean or 0.0) / (trial.off[c].mean or 1.0) for c in classes}
        gain = sum(ratios[c] * weights[c] for c in classes) / sum(weights.values())
        keep = gain >= 1 + self.margin
        trial.decided = "on" if keep else "off"
        trial.lookup = keep
        trial.decided_at = self._clock.seconds()
        trial.since = 0
        figures = ", ".join(
            f"{c}: {trial.on[c].mean:.1f} tok/s with lookup ({trial.on[c].n} answers) vs "
            f"{trial.off[c].mean:.1f} without ({trial.off[c].n})"
            for c in classes
        )
        trial.last = {
            "decided": trial.decided,
            "ratio": round(gain, 3),
            "margin": self.margin,
            "classes": {
                c: {
                    "on": _round(trial.on[c].mean),
                    "on_n": trial.on[c].n,
                    "off": _round(trial.off[c].mean),
                    "off_n": trial.off[c].n,
                }
                for c in classes
            },
        }
        log.info(
            "{model}: speculative auto decided {decided}: {figures}; with/without = {ratio:.3f}, "
            "lookup {verb} (it must be >= {need:.2f}); applied at the next idle reload",
            model=model,
            decided=trial.decided,
            figures=figures,
            ratio=gain,
            verb="stays" if keep else "goes",
            need=1 + self.margin,
        )
        self._save(model, trial)
