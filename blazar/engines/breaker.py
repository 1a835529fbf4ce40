"""
The crash breaker: per model, starts fail fast for a while after the
child crashed too often (L{Breaker}); L{Breakers} holds one per model.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from blazar.config import Config
from blazar.engines.errors import BreakerOpen
from blazar.metrics import Metric, gauge


@attrs.define
class Breaker:
    """
    Crash history and circuit state for one model.

    Closed: starts are allowed. C{threshold} crashes within C{window}
    seconds open it for C{backoff} seconds (doubling on each re-open, up to
    C{max_backoff}); then one trial start is allowed (half-open). A trial
    that becomes ready closes it; a clean stop clears the history.
    """

    threshold: int
    window: float
    base_backoff: float
    max_backoff: float
    crashes: list[float] = attrs.field(factory=list)
    open_until: float | None = None
    backoff: float = 0.0
    trial: bool = False
    last_error: str = ""

    @property
    def state(self) -> str:
        if self.open_until is None:
            return "closed"
        return "half-open" if self.trial else "open"

    def allow(self, now: float) -> float | None:
        """
        L{None} if a start may proceed now, else seconds to wait.
        """
        if self.open_until is None:
            return None
        if now >= self.open_until and not self.trial:
            self.trial = True
            return None
        if self.trial:
            return max(self.open_until - now, 0.0) or 1.0
        return self.open_until - now

    def crashed(self, now: float, error: str) -> None:
        self.last_error = error
        self.crashes = [t for t in self.crashes if now - t < self.window] + [now]
        if self.trial or len(self.crashes) >= self.threshold:
            self.backoff = min(self.backoff * 2 if self.backoff else self.base_backoff, self.max_backoff)
            self.open_until = now + self.backoff
            self.trial = False

    def ready(self) -> None:
        if self.trial:
            self.open_until = None
            self.trial = False
            self.crashes = []

    def reset(self) -> None:
        self.crashes = []
        self.open_until = None
        self.backoff = 0.0
        self.trial = False


@attrs.define(eq=False)
class Breakers:
    """
    One L{Breaker} per model (and per shared remote), made on first use
    with the live config's settings.

    @ivar _config: The config as it is now.
    @ivar _clock: The supervisor's clock (C{seconds()}).
    """

    _config: Callable[[], Config]
    _clock: Any
    _breakers: dict[str, Breaker] = attrs.field(factory=dict)

    def of(self, name: str) -> Breaker:
        """
        The breaker of C{name}.
        """
        found = self._breakers.get(name)
        if found is None:
            c = self._config()
            found = self._breakers[name] = Breaker(
                c.breaker_crashes, c.breaker_window, c.breaker_backoff, c.breaker_max_backoff
            )
        return found

    def reset(self, name: str | None = None) -> list[str]:
        """
        Close the breakers of C{name}, or of every model.

        @return: The names whose breaker was reset.
        """
        names = [name] if name is not None else list(self._breakers)
        for n in names:
            if n in self._breakers:
                self._breakers[n].reset()
        return [n for n in names if n in self._breakers]

    def retune(self, config: Config) -> None:
        """
        Give every breaker C{config}'s thresholds; their history stays.
        """
        for breaker in self._breakers.values():
            breaker.threshold = config.breaker_crashes
            breaker.window = config.breaker_window
            breaker.base_backoff = config.breaker_backoff
            breaker.max_backoff = config.breaker_max_backoff

    def check(self, name: str, what: Callable[[int, str], str] | None = None) -> None:
        """
        @param what: What failed, given the failures and the seconds to
            wait (default: the engine's crashes).
        @raise BreakerOpen: The breaker of C{name} is open.
        """
        breaker = self.of(name)
        wait = breaker.allow(self._clock.seconds())
        if wait is not None:
            if what is None:

                def what(crashes: int, seconds: str) -> str:
                    return (
                        f"model {name!r} is failing to run: its engine crashed {crashes} times lately; "
                        f"next try in {seconds} s"
                    )

            raise BreakerOpen(
                name,
                what(len(breaker.crashes), f"{wait:.0f}")
                + f" (`blazar ps --reset` to try now). Last failure: {breaker.last_error}",
                wait,
            )

    def gauge(self) -> Metric:
        """
        The metric C{blazar_breaker_state{model}}: 0 closed, 1 half-open, 2 open.
        """
        value = {"closed": 0, "half-open": 1, "open": 2}
        return gauge(
            "blazar_breaker_state",
            "Crash breaker per model: 0 closed, 1 half-open, 2 open",
            ["model"],
            [([n], value[b.state]) for n, b in sorted(self._breakers.items())],
        )
