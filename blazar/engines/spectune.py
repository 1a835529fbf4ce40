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
"""

from __future__ import annotations

from typing import Any

import attrs
from twisted.logger import Logger

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


class SpecTuner:
    """
    The trials of every C{speculative = "auto"} model, in memory.

    @param clock: C{IReactorTime} (for the re-trial).
    """

    def __init__(
        self,
        clock: Any,
        margin: float = MARGIN,
        retry_secs: float = RETRY_SECS,
        retry_answers: int = RETRY_ANSWERS,
    ) -> None:
        self._clock = clock
        self.margin = margin
        self.retry_secs = retry_secs
        self.retry_answers = retry_answers
        self.trials: dict[str, Trial] = {}
        self._children: dict[str, int] = {}  # model -> the child whose first answer was seen

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
