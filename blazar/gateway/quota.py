"""
Per-key admission limits checked at the door, in this order:
C{max_concurrent} (a lease held until the response is fully sent or the
client drops), C{rpm} (requests in the last 60 s), C{tpm} (tokens in the
last 60 s) and C{daily_tokens} (tokens this UTC day). A route that names
no model and spends no tokens (the Files and Batch APIs) is held to
C{max_concurrent} and C{rpm} only (L{Quotas.requests}). Tokens are the
child's own usage counts (prompt + completion), recorded after each answer.
Pure logic on injected clocks; the day totals are persisted by
L{blazar.service} through L{blazar.store}.

L{IQuotas} is the seam the door (L{blazar.web.auth}) and the scope check
use: L{Quotas} here, in memory, its Deferreds fired before they are
returned; or, with C{[cluster] redis}, L{blazar.gateway.redisquota}'s,
exact across every node that shares the Redis.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from typing import Any, Callable

from twisted.internet.defer import Deferred, fail, succeed
from zope.interface import Interface, implementer

from blazar.config import KeyConfig


def retry_after_value(seconds: float) -> bytes:
    """
    A C{Retry-After} value: whole seconds, rounded up, at least 1
    (RFC 9110, section 10.2.3).
    """
    return str(max(1, math.ceil(seconds))).encode("ascii")


class QuotaExceeded(Exception):
    """
    A key is over a limit (answered 429 with C{Retry-After}).

    @ivar retry_after: Seconds until a retry can succeed.
    """

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class IQuotas(Interface):
    """
    Where keys' limits are checked and counted. Each method returns a
    Deferred; a refusal is its L{QuotaExceeded} failure, and a counter
    that cannot be reached is a L{blazar.postgres.StoreUnavailable} one
    (a check never passes for want of its counter).
    """

    def take_lease(key: KeyConfig) -> Deferred[object]:
        """
        A lease for one request of C{key} (C{max_concurrent}), to hand
        back to L{give_lease} once its response is sent or its client left.

        @raise QuotaExceeded: (Failure) over max_concurrent.
        """

    def give_lease(key: KeyConfig, lease: object) -> Deferred[None]:
        """
        Hand back a lease L{take_lease} gave.
        """

    def check_rates(key: KeyConfig) -> Deferred[None]:
        """
        Check and count one request against rpm, then tpm, then
        daily_tokens.

        @raise QuotaExceeded: (Failure) over one of them.
        """

    def check_requests(key: KeyConfig) -> Deferred[None]:
        """
        Check and count a request that spends no tokens against rpm alone.

        @raise QuotaExceeded: (Failure) over rpm.
        """

    def count_tokens(key: KeyConfig, tokens: int) -> Deferred[None]:
        """
        Count C{tokens} (prompt + completion) used by a request of C{key}
        against its tpm and daily_tokens.
        """


@implementer(IQuotas)
class Quotas:
    """
    Live counters per key, by its L{blazar.config.KeyConfig.owner}: a key
    added under a removed key's name starts afresh.
    """

    def __init__(self, clock: Any, wall: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall = wall
        self._active: dict[str, int] = defaultdict(int)
        self._recent: dict[str, deque[float]] = defaultdict(deque)
        self._tokens: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._day = self.today()
        self._daily: dict[str, int] = defaultdict(int)
        self._pending: list[tuple[str, str, int]] = []

    def today(self) -> str:
        """
        The current UTC day, YYYY-MM-DD.
        """
        return time.strftime("%Y-%m-%d", time.gmtime(self._wall()))

    def _roll(self) -> None:
        day = self.today()
        if day != self._day:
            self._day = day
            self._daily = defaultdict(int)

    def load_day(self, day: str, usage: dict[str, int]) -> None:
        """
        Seed today's totals (read back from the store at start).
        """
        self._roll()
        if day == self._day:
            for name, tokens in usage.items():
                self._daily[name] += tokens

    def record(self, key: KeyConfig, tokens: int) -> None:
        """
        Count C{tokens} (prompt + completion) used by a request of C{key}.
        """
        if tokens <= 0:
            return
        self._roll()
        self._tokens[key.owner].append((self._clock.seconds(), tokens))
        self._daily[key.owner] += tokens
        self._pending.append((self._day, key.owner, tokens))

    def take_pending(self) -> list[tuple[str, str, int]]:
        """
        Usage recorded since the last call, for the store.
        """
        rows, self._pending = self._pending, []
        return rows

    def put_back(self, rows: list[tuple[str, str, int]]) -> None:
        """
        Return C{rows} taken by L{take_pending} that the store could not
        write: the next call takes them again, first.
        """
        self._pending[:0] = rows

    def unwritten(self, day: str, owner: str) -> int:
        """
        Tokens key C{owner} used on C{day} that are not yet taken for the
        store.
        """
        return sum(tokens for d, name, tokens in self._pending if d == day and name == owner)

    def daily(self, name: str) -> int:
        """
        Tokens key C{name} used today.
        """
        self._roll()
        return self._daily[name]

    def admit(self, key: KeyConfig) -> None:
        """
        L{lease} then L{rates}, for callers with nothing in between.
        """
        self.lease(key)
        try:
            self.rates(key)
        except QuotaExceeded:
            self.release(key)
            raise

    def lease(self, key: KeyConfig) -> None:
        """
        Take a lease for one request of C{key}; pair with L{release}.

        @raise QuotaExceeded: Over max_concurrent.
        """
        if key.max_concurrent is not None and self._active[key.owner] >= key.max_concurrent:
            raise QuotaExceeded(
                f"key {key.name!r} already has {key.max_concurrent} request(s) running "
                "(max_concurrent); retry when one finishes",
                1.0,
            )
        self._active[key.owner] += 1

    def _check_rpm(self, key: KeyConfig, now: float) -> None:
        if key.rpm is not None:
            recent = self._recent[key.owner]
            while recent and now - recent[0] >= 60.0:
                recent.popleft()
            if len(recent) >= key.rpm:
                raise QuotaExceeded(
                    f"key {key.name!r} is over its {key.rpm} requests per minute (rpm)",
                    max(1.0, 60.0 - (now - recent[0])),
                )

    def requests(self, key: KeyConfig) -> None:
        """
        Check and count a request that spends no tokens (the Files and
        Batch APIs: listing, uploading, downloading, deleting; making,
        reading, cancelling a batch) against rpm alone: a key that used
        its tokens may still fetch its batch's output.

        @raise QuotaExceeded: Over rpm.
        """
        now = self._clock.seconds()
        self._check_rpm(key, now)
        if key.rpm is not None:
            self._recent[key.owner].append(now)

    def rates(self, key: KeyConfig) -> None:
        """
        Check and count the request against rpm, then tpm, then
        daily_tokens (after the scope check, as the spec orders them).

        @raise QuotaExceeded: Over one of them.
        """
        now = self._clock.seconds()
        self._check_rpm(key, now)
        if key.tpm is not None:
            window = self._tokens[key.owner]
            while window and now - window[0][0] >= 60.0:
                window.popleft()
            used = sum(t for _, t in window)
            if used >= key.tpm:
                raise QuotaExceeded(
                    f"key {key.name!r} used {used} tokens in the last minute, over its tpm of {key.tpm}",
                    max(1.0, 60.0 - (now - window[0][0])),
                )
        if key.daily_tokens is not None:
            self._roll()
            if self._daily[key.owner] >= key.daily_tokens:
                wall = self._wall()
                to_midnight = 86400 - (wall % 86400)
                raise QuotaExceeded(
                    f"key {key.name!r} used its {key.daily_tokens} daily_tokens for today (UTC)",
                    max(1.0, to_midnight),
                )
        if key.rpm is not None:
            self._recent[key.owner].append(now)

    def release(self, key: KeyConfig) -> None:
        """
        Give back a lease (the response was sent, or the client left).
        """
        if self._active[key.owner] > 0:
            self._active[key.owner] -= 1

    # -- IQuotas: the methods above, as Deferreds that have fired ------------

    def take_lease(self, key: KeyConfig) -> Deferred[object]:
        try:
            self.lease(key)
        except QuotaExceeded:
            return fail()
        return succeed(None)

    def give_lease(self, key: KeyConfig, lease: object) -> Deferred[None]:
        self.release(key)
        return succeed(None)

    def check_rates(self, key: KeyConfig) -> Deferred[None]:
        try:
            self.rates(key)
        except QuotaExceeded:
            return fail()
        return succeed(None)

    def check_requests(self, key: KeyConfig) -> Deferred[None]:
        try:
            self.requests(key)
        except QuotaExceeded:
            return fail()
        return succeed(None)

    def count_tokens(self, key: KeyConfig, tokens: int) -> Deferred[None]:
        self.record(key, tokens)
        return succeed(None)

    def active(self, name: str) -> int:
        """
        Requests of key C{name} running now.
        """
        return self._active[name]
