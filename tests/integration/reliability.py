"""
Shared bookkeeping for the reliability suite: what it tried, what it
injected, and what the gateway did wrong. tests/integration/conftest.py
prints one summary line from it at the end of the run.
"""

from __future__ import annotations

import attrs


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
