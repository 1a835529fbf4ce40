"""
A request's hold on one ready child (L{InstanceLease}): while it is held
the child counts the request in C{in_flight}, so idle eviction, a
C{keep_alive} of 0 from another request and a context grow wait for it;
when it ends, the use is recorded with the request's C{keep_alive}, and a
C{keep_alive} of 0 unloads the child if nothing else runs on it or waits
for it.

The lease is the only code that changes C{in_flight}; nothing outside
L{blazar.engines} touches it.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.logger import Logger

log = Logger()


class InstanceLease:
    """
    One request's use of C{instance}: counted from construction until
    L{release} or L{finish} (whichever comes first; the other is then a
    no-op).

    @ivar instance: The child (a L{blazar.engines.supervisor.Instance}).
    """

    __slots__ = ("_supervisor", "instance", "_held")

    def __init__(self, supervisor: Any, instance: Any) -> None:
        self._supervisor = supervisor
        self.instance = instance
        self._held = True
        instance.in_flight += 1

    @property
    def held(self) -> bool:
        """
        Whether the lease still counts in the child's C{in_flight}.
        """
        return self._held

    def release(self) -> None:
        """
        Stop counting, without recording a use: for a request that was
        never answered by this child (it goes to a fresh one), or the
        gateway's own small calls (token counts, template probes).
        """
        if self._held:
            self._held = False
            self.instance.in_flight -= 1

    def finish(self, keep_alive: float | None, others_waiting: Callable[[], bool] = lambda: False) -> None:
        """
        The request is over: stop counting, record the use with its
        C{keep_alive} (seconds; L{None}: the model's default), and for a
        C{keep_alive} of 0 unload the child if no other request runs on it
        and C{others_waiting()} is false (a request waiting for a slot of
        this model wants the child: the last one unloads it). A child marked
        to unload when idle (L{Supervisor.unload_when_idle}) is stopped by
        the last lease to end.
        """
        if not self._held:
            return
        self.release()
        instance = self.instance
        self._supervisor.touch(instance, keep_alive)
        if instance.in_flight != 0:
            return
        pending = instance.unload_when_idle
        if pending is not None or (keep_alive == 0 and not others_waiting()):
            d = self._supervisor.stop_instance(instance, pending or "keep_alive 0")
            d.addErrback(lambda f: log.failure("unloading {model} failed", f, model=instance.entry.name))
