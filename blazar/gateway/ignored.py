"""
Making the leniency policy visible: the fields a request carried that Blazar
accepted but did not honour go into one response header,
C{x-blazar-ignored}, and into the log once per client and field
(L{blazar.web.translate.leniency} decides which fields those are).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from twisted.logger import Logger

from blazar.gateway.context import RequestContext, key_of, trace_id_of

log = Logger()

IGNORED_HEADER = b"x-blazar-ignored"
_SEEN_MAX = 4096
# per request: names kept (for the header and the log), and their length
_PER_REQUEST = 64
_NAME_MAX = 100


class IgnoredFields:
    """
    Remembers which (client, surface, field) triples were logged, so that
    each is logged once (bounded: the oldest are forgotten first).
    """

    def __init__(self, limit: int = _SEEN_MAX) -> None:
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._limit = limit

    def client_of(self, context: RequestContext) -> str:
        """
        Who sent a request, for the log: its key's name (or C{-}) and the
        first product of its C{User-Agent}.
        """
        key = key_of(context)
        agent = context.client.agent() if context.client is not None else ""
        return f"{key.name if key is not None else '-'} {agent or '-'}"

    def note(self, context: RequestContext, surface: str, names: Iterable[str]) -> None:
        """
        Add C{names} to the ones C{x-blazar-ignored} lists for the request
        (L{RequestContext.ignored}: data the web layer writes, with names
        noted earlier for it kept) and log each name not yet logged for
        this client. Bounded: names are cut to 100 characters and at most
        64 a request are listed, logged and remembered (the rest are
        counted).
        """
        kept: dict[str, None] = {}
        more = 0
        for name in names:
            short = name[:_NAME_MAX]
            if short in kept:
                continue
            if len(kept) >= _PER_REQUEST:
                more += 1
                continue
            kept[short] = None
        if not kept:
            return
        shown = list(kept) + ([f"(+{more} more)"] if more else [])
        # a later step's names join an earlier step's (the surface's, then the pipeline's)
        before = [n for n in context.ignored if n and n != "..."]
        context.ignored = tuple(header_value(before + shown).decode("ascii").split(","))
        client = self.client_of(context)[:_NAME_MAX]
        if more:
            log.info(
                "ignored {count} more request fields on the {surface} surface (client {client}) than are listed",
                count=more,
                surface=surface,
                client=client,
                trace_id=trace_id_of(context),
            )
        for name in kept:
            triple = (client, surface, name)
            if triple in self._seen:
                self._seen.move_to_end(triple)
                continue
            self._seen[triple] = None
            if len(self._seen) > self._limit:
                self._seen.popitem(last=False)
            log.info(
                "ignored request field {field!r} on the {surface} surface (client {client}); "
                "see the leniency table in docs/surfaces.md",
                field=name,
                surface=surface,
                client=client,
                trace_id=trace_id_of(context),
            )


#: One per daemon process: the surfaces share it.
IGNORED = IgnoredFields()


def note_ignored(context: RequestContext, surface: str, names: Iterable[str]) -> None:
    """
    L{IgnoredFields.note} on the process's L{IGNORED}.
    """
    IGNORED.note(context, surface, names)


def header_value(names: list[str], limit: int = 1024) -> bytes:
    """
    The C{x-blazar-ignored} header's value: the names, comma-separated,
    cut (with a trailing C{,...}) at about C{limit} bytes.
    """
    out: list[str] = []
    size = 0
    for name in dict.fromkeys(names):
        safe = "".join(c for c in name if 0x20 < ord(c) < 0x7F and c != ",")[:100]
        if not safe:
            continue
        if size + len(safe) + 1 > limit:
            out.append("...")
            break
        out.append(safe)
        size += len(safe) + 1
    return ",".join(out).encode("ascii")
