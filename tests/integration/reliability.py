"""
Shared bookkeeping for the reliability suite: what it tried, what it
injected, and what the gateway did wrong. tests/integration/conftest.py
prints one summary line from it at the end of the run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import attrs

if TYPE_CHECKING:
    from tests.integration.harness import Daemon


@attrs.define
class Tally:
    inputs: int = 0
    faults: int = 0
    gateway_5xx: int = 0
    leaked_slots: int = 0
    leaked_fds: int = 0
    ran: bool = False

    def line(self) -> str:
        return (
            f"reliability: {self.inputs} bad inputs tried, {self.faults} faults injected, "
            f"gateway 5xx = {self.gateway_5xx}, leaked slots = {self.leaked_slots}, "
            f"leaked fds = {self.leaked_fds}"
        )


TALLY = Tally()


@contextmanager
def tallied(daemon: "Daemon") -> Iterator["Daemon"]:
    """
    A reliability module's daemon: started, counted as a run of the suite
    (so the summary line is printed), closed at the end.
    """
    daemon.start()
    TALLY.ran = True
    try:
        yield daemon
    finally:
        daemon.close()
