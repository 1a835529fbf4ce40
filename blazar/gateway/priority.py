"""
Admission's priority tiers (L{blazar.gateway.admission}), on their own so
that the request's context (L{blazar.gateway.context.IClient}) can name
the tier its surface decoded without importing admission.
"""

from __future__ import annotations

from enum import IntEnum


class Priority(IntEnum):
    """
    Priority tiers, most urgent first.
    """

    HIGH = 0
    NORMAL = 1
    LOW = 2
    # offline work (Batch API lines): a slot only when nobody else waits
    BATCH = 3
