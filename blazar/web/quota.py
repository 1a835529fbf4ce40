"""
Per-key admission limits checked at the door: C{max_concurrent} (a lease
held until the response is fully sent or the client drops) and C{rpm}
(requests in the last 60 s). Pure logic on an injected clock.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

from blazar.config import KeyConfig


class QuotaExceeded(Exception):
    """
    A key is over a limit (answered 429 with C{Retry-After}).

    @ivar retry_after: Seconds until a retry can succeed.
    """

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Quotas:
    """
    Live counters per key name.
    """

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._active: dict[str, int] = defaultdict(int)
        self._recent: dict[str, deque[float]] = defaultdict(deque)

    def admit(self, key: KeyConfig) -> None:
        """
        Take a lease for one request of C{key}; pair with L{release}.

        @raise QuotaExceeded: Over max_concurrent, or over rpm.
        """
        now = self._clock.seconds()
        if key.max_concurrent is not None and self._active[key.name] >= key.max_concurrent:
            raise QuotaExceeded(
                f"key {key.name!r} already has {key.max_concurrent} request(s) running "
                "(max_concurrent); retry when one finishes", 1.0,
            )
        if key.rpm is not None:
            recent = self._recent[key.name]
            while recent and now - recent[0] >= 60.0:
                recent.popleft()
            if len(recent) >= key.rpm:
                raise QuotaExceeded(
                    f"key {key.name!r} is over its {key.rpm} requests per minute (rpm)",
                    max(1.0, 60.0 - (now - recent[0])),
                )
            recent.append(now)
        self._active[key.name] += 1

    def release(self, key: KeyConfig) -> None:
        """
        Give back a lease (the response was sent, or the client left).
        """
        if self._active[key.name] > 0:
            self._active[key.name] -= 1

    def active(self, name: str) -> int:
        """
        Requests of key C{name} running now.
        """
        return self._active[name]
