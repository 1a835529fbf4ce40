"""
What every L{blazar.gateway.sessions.ISlotBank} does, checked on the fake
(tests/gateway/test_sessions.py) and on a real llama-server child
(tests/integration/test_sessions_e2e.py).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from blazar.gateway.sessions import ISlotBank, SlotActionFailed


async def check_slot_bank(
    bank: Any,
    instance: Any,
    fill: Callable[[int], Awaitable[int]],
    corrupt: Callable[[str], None],
) -> None:
    """
    @param fill: Run a request in slot N; the tokens it leaves there.
    @param corrupt: Damage a saved file (by name).
    """
    assert ISlotBank.providedBy(bank)
    tokens = await fill(0)
    assert tokens > 0
    assert (0, True, False) in await bank.slots(instance, 5.0)
    saved, size = await bank.save(instance, 0, "contract.bin", 5.0)
    assert saved == tokens and size > 0
    await bank.erase(instance, 1, 5.0)
    assert await bank.restore(instance, 1, "contract.bin", 5.0) == tokens
    for missing in ("nothing-here.bin",):
        try:
            await bank.restore(instance, 1, missing, 5.0)
        except SlotActionFailed:
            pass
        else:
            raise AssertionError("restoring a missing file did not fail")
    corrupt("contract.bin")
    try:
        await bank.restore(instance, 1, "contract.bin", 5.0)
    except SlotActionFailed:
        pass
    else:
        raise AssertionError("restoring a damaged file did not fail")
