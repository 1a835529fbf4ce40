"""
The Deferreds that wait for one event (a child's exit, its readiness, a
spawn, a context grow), each cancellable on its own: a client that goes
away stops its wait, never the event others wait for.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

T = TypeVar("T")


class Waiters(Generic[T]):
    """
    The Deferreds waiting for one event, in the order they began to wait.
    """

    def __init__(self) -> None:
        self._waiting: list[Deferred[T]] = []

    def wait(self) -> Deferred[T]:
        """
        A Deferred that fires when the event does (L{fire}, L{fail}, or
        L{fire_first}); cancelling it stops only this wait.
        """

        def cancel(d: Deferred[T]) -> None:
            if d in self._waiting:
                self._waiting.remove(d)

        d: Deferred[T] = Deferred(cancel)
        self._waiting.append(d)
        return d

    def pending(self) -> bool:
        """
        Whether any wait is still open (not fired, not cancelled).
        """
        return any(not d.called for d in self._waiting)

    def fire(self, result: T) -> None:
        """
        Every open wait fires with C{result}.
        """
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            if not d.called:  # a callback of an earlier one may have cancelled it
                d.callback(result)

    def fail(self, error: BaseException | Failure) -> None:
        """
        Every open wait fails with C{error}.
        """
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            if not d.called:
                d.errback(error)

    def fire_first(self, result: T) -> bool:
        """
        The oldest open wait fires with C{result}, the others keep waiting.

        @return: Whether one was open.
        """
        while self._waiting:
            d = self._waiting.pop(0)
            if not d.called:
                d.callback(result)
                return True
        return False
