"""
The one place a twisted.web request meets the gateway: L{asked_of}
decodes what the client asked in its headers for the surface's call;
L{context_of} gives a request's L{RequestContext} with its
L{RequestClient}, the L{IClient} through which the gateway follows the
response; L{opened}, L{judged} and L{note_ignored} write the response
headers the gateway decided, which it hands back as data. Nothing below
C{blazar.web} holds the request itself.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping, TypeVar

from twisted.internet.defer import Deferred
from twisted.web.iweb import IRequest
from zope.interface import implementer

from blazar.gateway.call import Asked, Call
from blazar.gateway.context import IClient, RequestContext
from blazar.gateway.ignored import IGNORED_HEADER
from blazar.gateway.ignored import note_ignored as gateway_note_ignored
from blazar.gateway.pipeline import Pipeline
from blazar.gateway.priority import Priority
from blazar.gateway.quota import retry_after_value
from blazar.gateway.reply import Reply
from blazar.gateway.sessions import session_name

PRIORITY_HEADER = b"x-blazar-priority"
DEADLINE_HEADER = b"x-blazar-deadline-ms"
# Kubernetes' Gateway API Inference Extension (GIE) and llm-d's endpoint picker
# (docs/gie.md): Blazar's own header, where both are sent, wins
OBJECTIVE_HEADER = b"x-gateway-inference-objective"
FAIRNESS_HEADER = b"x-gateway-inference-fairness-id"
TTFT_HEADER = b"x-slo-ttft-ms"
TPOT_HEADER = b"x-slo-tpot-ms"
# an InferenceObjective's name -> the admission tier: GIE's criticalities
# (Critical, Standard, Sheddable) and Blazar's own tier names, any case
OBJECTIVES = {
    b"critical": Priority.HIGH,
    b"high": Priority.HIGH,
    b"standard": Priority.NORMAL,
    b"normal": Priority.NORMAL,
    b"default": Priority.NORMAL,
    b"sheddable": Priority.LOW,
    b"low": Priority.LOW,
    b"batch": Priority.LOW,
}
MAX_FAIRNESS = 100

T = TypeVar("T")


def parse_priority(value: bytes | None) -> Priority:
    """
    C{x-blazar-priority}: C{high}, C{low} or C{batch} (any case; C{batch}
    is below C{low}: a slot only when nothing else waits); anything else,
    or no header, is normal.
    """
    if value is None:
        return Priority.NORMAL
    word = value.strip().lower()
    if word == b"high":
        return Priority.HIGH
    if word == b"low":
        return Priority.LOW
    if word == b"batch":
        return Priority.BATCH
    return Priority.NORMAL


def parse_deadline_ms(value: bytes | None) -> float | None:
    """
    C{x-blazar-deadline-ms}: how long (ms, from arrival) the request may
    wait for a slot; L{None} when absent, not a number, or not positive.

    @return: Seconds.
    """
    if value is None:
        return None
    try:
        ms = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(ms) or ms <= 0:
        return None
    return min(ms, 24 * 3600 * 1000.0) / 1000.0


def parse_objective(value: bytes) -> Priority | None:
    """
    C{x-gateway-inference-objective}: the name of a GIE InferenceObjective,
    as a tier (L{OBJECTIVES}, any case); L{None} for a name not there.
    """
    return OBJECTIVES.get(value.strip().lower())


def parse_fairness(value: bytes | None) -> str | None:
    """
    C{x-gateway-inference-fairness-id}: the tenant within the API key that
    weighted fair queuing shares slots between (at most L{MAX_FAIRNESS}
    characters, longer ids cut); L{None} when absent or blank.
    """
    if value is None:
        return None
    fairness = value.decode("utf-8", "replace").strip()
    return fairness[:MAX_FAIRNESS] or None


def asked_of(request: IRequest, session_hint: str | None = None) -> Asked:
    """
    What the client asked beside its body, decoded once (for the surface's
    L{blazar.gateway.call.Call}): its priority, its deadline, its fairness
    id and the session it names (a header, else C{session_hint}, the
    surface's own from the body: Responses C{prompt_cache_key}, Anthropic
    C{metadata.user_id}).

    GIE's headers (docs/gie.md) count where Blazar's own is absent:
    C{x-gateway-inference-objective} for C{x-blazar-priority} (an objective
    not in L{OBJECTIVES} is normal and named in C{x-blazar-ignored}, as is
    one overruled by C{x-blazar-priority}), C{x-slo-ttft-ms} for
    C{x-blazar-deadline-ms} (a request that cannot start within its
    time-to-first-token target has missed it), C{x-session-id} after
    C{x-blazar-session}. C{x-slo-tpot-ms} has no counterpart (a token's
    pace is the engine's) and is named in C{x-blazar-ignored}. Values
    that do not parse are treated as Blazar's own are: absent.
    """

    def header(name: str) -> str | None:
        # bytes decoded leniently: a header that is not UTF-8 still names a session
        raw = request.requestHeaders.getRawHeaders(name.encode("ascii"))
        return raw[0].decode("utf-8", "replace") if raw else None

    ignored: list[str] = []
    own = request.getHeader(PRIORITY_HEADER)
    objective = request.getHeader(OBJECTIVE_HEADER)
    priority = parse_priority(own)
    if objective is not None:
        tier = parse_objective(objective)
        if own is None and tier is not None:
            priority = tier
        else:
            ignored.append(OBJECTIVE_HEADER.decode("ascii"))
    deadline_header = request.getHeader(DEADLINE_HEADER)
    deadline = parse_deadline_ms(deadline_header if deadline_header is not None else request.getHeader(TTFT_HEADER))
    if request.getHeader(TPOT_HEADER) is not None:
        ignored.append(TPOT_HEADER.decode("ascii"))
    return Asked(
        priority=priority,
        deadline=deadline,
        session=session_name(header, session_hint),
        fairness=parse_fairness(request.getHeader(FAIRNESS_HEADER)),
        ignored=tuple(ignored),
    )


@implementer(IClient)
class RequestClient:
    """
    L{IClient} over one twisted.web request.
    """

    def __init__(self, request: IRequest) -> None:
        self._request = request

    def agent(self) -> str:
        return (self._request.getHeader(b"user-agent") or b"").decode("ascii", "replace").split(" ", 1)[0][:60]

    def body_size(self) -> int:
        content = self._request.content
        if content is None:
            return 0
        here = content.tell()
        content.seek(0, 2)
        size = int(content.tell())
        content.seek(here)
        return size

    def finished(self) -> Deferred[None]:
        return self._request.notifyFinish()  # type: ignore[attr-defined]

    def writing(self) -> bool:
        return bool(getattr(self._request, "startedWriting", True))

    def consumer(self) -> Any:
        return self._request


def context_of(request: Any) -> RequestContext:
    """
    The request's L{RequestContext} (made on first use, e.g. for a
    C{StubTreq} or C{DummyRequest} request no L{blazar.web.site} made),
    with its L{RequestClient}.
    """
    context = getattr(request, "blazar", None)
    if context is None:
        context = request.blazar = RequestContext()
    if context.client is None:
        context.client = RequestClient(request)
    return context


@asynccontextmanager
async def opened(pipeline: Pipeline, request: IRequest, call: Call) -> AsyncIterator[Reply]:
    """
    C{pipeline.open} for a surface: the call run up to its answer, with the
    response headers the pipeline decided (as data: L{Reply.headers},
    L{blazar.gateway.pipeline.Opened.headers}) written on the request at
    the moments they always went out: before a stream's headers
    (C{Call.on_send}), with the reply, or with the error of a call that
    failed after deciding them (a cache miss, then a full queue).
    """
    inner = call.on_send

    def on_send(cold: bool) -> Callable[[], None] | None:
        write_headers(request, run.headers)
        write_ignored(request)
        return inner(cold) if inner is not None else None

    run = pipeline.open(context_of(request), call, on_send)
    entered = False
    try:
        async with run as reply:
            entered = True
            write_headers(request, reply.headers)
            write_ignored(request)
            yield reply
    except BaseException:
        if not entered:
            write_headers(request, run.headers)
        raise
    finally:
        write_ignored(request)  # the call's end may name the client's keep_alive


async def judged(request: IRequest, reply: Reply, reading: Awaitable[T]) -> T:
    """
    C{reading} (the reply's L{Reply.read}, L{Reply.relay} or
    L{Reply.chunks}) awaited, then the sentinel's verdict on the answer
    (L{Reply.verdict}: empty unless the answer was not yet written) set on
    the response, before the surface writes its body or the error of an
    enforced refusal.
    """
    try:
        return await reading
    finally:
        write_headers(request, reply.verdict)


def note_ignored(request: IRequest, surface: str, names: Iterable[str]) -> None:
    """
    L{blazar.gateway.ignored.note_ignored} for the surface's own decoding,
    and C{x-blazar-ignored} set on the response (call before anything is
    written).
    """
    gateway_note_ignored(context_of(request), surface, names)
    write_ignored(request)


def write_ignored(request: IRequest) -> None:
    """
    Set C{x-blazar-ignored} on the response as the gateway decided it so
    far (L{RequestContext.ignored}; nothing when nothing was ignored).
    """
    names = context_of(request).ignored
    if names:
        request.setHeader(IGNORED_HEADER, ",".join(names).encode("ascii"))


def write_headers(request: IRequest, headers: Mapping[bytes, bytes]) -> None:
    """
    Set C{headers} on the response (before it is written).
    """
    for name, value in headers.items():
        request.setHeader(name, value)


def retry_after(request: IRequest, seconds: float) -> None:
    """
    Set C{Retry-After} on a refusal (quota, all slots busy, breaker open).
    """
    request.setHeader(b"retry-after", retry_after_value(seconds))
