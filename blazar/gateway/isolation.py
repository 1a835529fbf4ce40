"""
Per-key slot isolation (C{[models."x"] isolate_keys = true}): no request of
one key reuses the KV cache another key's request left in a slot.

Keys share a model's child, and llama-server gives a request the slot whose
cache shares the most of its prompt and skips computing that prefix: how
much was skipped shows in the answer's counts (hidden from scoped keys) and
in its time to first token, so a key that guesses at another key's prompt
learns how far its guess matched. For an isolated model Blazar picks the
slot itself (llama-server's C{id_slot}): a free slot this key used last (its
own cache reused), else another free one, sent with C{cache_prompt: false}
so that nothing of what the slot holds is reused. The slot's cache then is
this key's. Keys keep their caches while there are slots for them; with
more keys than slots a key's first request on a slot pays its whole prompt.

A session (L{blazar.gateway.sessions}) keeps the slot its session owns; a
slot another key used last is sent C{cache_prompt: false} there too.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import attrs

from blazar import strictjson


@attrs.define
class Isolated:
    """
    A request's slot on an isolated model, until L{KeyIsolation.release}.

    @ivar slot: The slot it is sent to, or L{None} (no slot free: it goes
        where llama-server puts it, reusing nothing).
    @ivar fresh: Whether it must not reuse the slot's cache (another key's,
        or one Blazar does not know the owner of).
    """

    instance: Any
    owner: str
    slot: int | None
    fresh: bool

    def fields(self) -> dict[str, Any]:
        """
        What the request body gets: C{id_slot}, and C{cache_prompt: false}
        when it must not reuse the slot's cache.
        """
        fields: dict[str, Any] = {}
        if self.slot is not None:
            fields["id_slot"] = self.slot
        if self.fresh:
            fields["cache_prompt"] = False
        return fields


@attrs.define
class _Slots:
    last: list[str | None]  # the key whose request used each slot last (None: not known)
    busy: list[int]  # Blazar's requests running in each slot
    used: list[float]  # when each was last released, clock seconds


class KeyIsolation:
    """
    The slots of each isolated child: who used each last, which are busy.
    """

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._children: WeakKeyDictionary[Any, _Slots] = WeakKeyDictionary()

    def _slots(self, instance: Any, count: int) -> _Slots:
        table = self._children.get(instance)
        if table is None or len(table.last) != count:
            table = self._children[instance] = _Slots([None] * count, [0] * count, [0.0] * count)
        return table

    def take(self, instance: Any, count: int, owner: str) -> Isolated:
        """
        A slot of C{instance} (which has C{count}) for a request of
        C{owner}: a free one it used last (the most recently used of
        them), else a free one never used, else the free one left idle
        longest.
        """
        table = self._slots(instance, count)
        free = [i for i in range(count) if table.busy[i] == 0]
        if not free:
            return Isolated(instance, owner, None, True)
        mine = [i for i in free if table.last[i] == owner]
        if mine:
            slot, fresh = max(mine, key=lambda i: table.used[i]), False
        else:
            unused = [i for i in free if table.last[i] is None]
            slot, fresh = (unused[0] if unused else min(free, key=lambda i: table.used[i])), True
        table.busy[slot] += 1
        return Isolated(instance, owner, slot, fresh)

    def hold(self, instance: Any, count: int, owner: str, slot: int) -> Isolated:
        """
        A session's slot (chosen by L{blazar.gateway.sessions}) for a
        request of C{owner}: fresh unless C{owner} used it last.
        """
        table = self._slots(instance, count)
        if not 0 <= slot < count:
            return Isolated(instance, owner, slot, True)
        table.busy[slot] += 1
        return Isolated(instance, owner, slot, table.last[slot] != owner)

    def release(self, held: Isolated) -> None:
        """
        The request ended: its slot's cache is its key's now.
        """
        table = self._children.get(held.instance)
        if table is None or held.slot is None or not 0 <= held.slot < len(table.last):
            return
        table.busy[held.slot] = max(0, table.busy[held.slot] - 1)
        table.last[held.slot] = held.owner
        table.used[held.slot] = self._clock.seconds()


def with_fields(raw: bytes, fields: dict[str, Any]) -> bytes | None:
    """
    The encoded JSON object C{raw} with C{fields} added at its end (a later
    key wins in llama-server's parser), or L{None} if C{raw} is not an
    object's encoding; C{raw} itself when there are none.
    """
    if not fields:
        return raw
    body = raw.rstrip()
    if not body.endswith(b"}"):
        return None
    inner = body[:-1].rstrip()
    added = strictjson.encode(fields, separators=(",", ":")).encode("utf-8")[1:-1]
    sep = b"" if inner.endswith(b"{") else b","
    return inner + sep + added + b"}"
