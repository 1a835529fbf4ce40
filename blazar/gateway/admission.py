"""
Admission control: who gets an engine slot next, and who waits.

Each model has as many slots as its child has (llama-server's
C{--parallel}, C{parallel} under C{[models."name"]}). A request holds a
slot from admission until its response is finished or its client is gone;
beyond the slots, requests wait in the model's L{ModelQueue}, ordered by:

 1. priority: C{x-blazar-priority: high | low | batch} (case-insensitive;
    anything else is normal; C{batch}, below C{low}, is for offline work). A request body over L{LONG_PREFILL_BYTES} (a long
    prefill, ~16k tokens) is demoted one priority.
 2. work class: L{WorkClass.TOOL} (chat carrying tools) before
    L{WorkClass.INTERACTIVE} (chat, embeddings) before
    L{WorkClass.RAW_LONG} (raw completions, Ollama raw generate). While
    interactive work waits, raw work may hold at most
    C{max(1, N - ceil(N/4))} of the N slots (all N otherwise).
 3. weighted fair queuing between API keys (and, within a key, between
    the fairness ids it names: GIE's C{x-gateway-inference-fairness-id},
    L{Ticket.flow}): each admission adds
    C{1 / weight} to its key's credit and the key with the lowest credit
    goes first (credits reset every L{CREDIT_RESET} admissions and when
    the model goes idle; a key that becomes active starts at the lowest
    credit of the keys already waiting or running, so no key banks a
    burst). Without keys every request is one
    anonymous key.
 4. deadline, earliest first, within a key: C{x-blazar-deadline-ms} (ms
    from arrival; at most C{deadline_low_secs}), else the priority's
    default from C{[queue]} (2 s, 30 s, 120 s), at most
    C{deadline_tool_secs} (10 s) for tool calls. C{batch} is the Batch
    API runner's own (a client's is C{low}); one key may hold at most half
    of C{max_waiting}; a full queue sheds its least urgent waiter for a
    more urgent arrival.

A request still waiting at its deadline fails with L{AllSlotsBusy} (each
surface answers 503 C{all_slots_busy} with C{Retry-After}); a client that
disconnects while waiting leaves the queue at once (cancelling the
L{Deferred} L{ModelQueue.admit} returned).

The scheduler is pure logic on an injected clock (C{seconds()} and
C{callLater()}); L{admit_request} is the glue to a client's request
(its L{blazar.gateway.context.IClient}).
"""

from __future__ import annotations

import heapq
import math
from enum import IntEnum
from typing import Any, Callable

import attrs
from twisted.internet.defer import Deferred, succeed

from blazar.config import Config, QueueConfig
from blazar.gateway.context import RequestContext, key_of, trace_id_of
from blazar.gateway.errors import AllSlotsBusy
from blazar.gateway.priority import Priority
from blazar.metrics import Metrics, gauge

QUEUE_MS_HEADER = b"x-blazar-queue-ms"
LONG_PREFILL_BYTES = 64 * 1024
CREDIT_RESET = 256
# weight of the newest hold time in the service-time average
SERVICE_EWMA = 0.3
# requests listed per model by snapshot() (counts cover all of them)
SNAPSHOT_REQUESTS = 200
# seconds a batch line may wait for a slot (OpenAI's completion_window, 24h)
BATCH_DEADLINE = 24 * 3600.0


class WorkClass(IntEnum):
    """
    What a request asks the engine to do, in admission order.
    """

    TOOL = 0
    INTERACTIVE = 1
    RAW_LONG = 2


CLASS_NAMES = {WorkClass.TOOL: "tool", WorkClass.INTERACTIVE: "interactive", WorkClass.RAW_LONG: "raw_long"}


def human_wait(seconds: float) -> str:
    """
    A wait for people: C{"850ms"} below a second, C{"30s"}, C{"2m05s"}.
    """
    if seconds < 1.0:
        return f"{int(seconds * 1000)}ms"
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole}s"
    return f"{whole // 60}m{whole % 60:02d}s"


@attrs.define(eq=False)
class Ticket:
    """
    One request, waiting for or holding a slot.

    @ivar key: The API key's name (C{""} without keys): one key may hold
        at most half of C{max_waiting}.
    @ivar fairness: The fairness id the request named within its key
        (GIE's C{x-gateway-inference-fairness-id}), or L{None}.
    @ivar arrived: Clock seconds at arrival.
    @ivar deadline: Clock seconds after which it stops waiting.
    """

    key: str
    weight: float
    priority: Priority
    work: WorkClass
    arrived: float
    deadline: float
    trace_id: str = ""
    seq: int = 0
    admitted_at: float | None = None
    waiter: Deferred[Lease] | None = None
    timer: Any = None
    fairness: str | None = None

    @property
    def flow(self) -> str:
        """
        What weighted fair queuing shares slots between: the key, or the
        key and the fairness id it named (one flow per tenant behind one
        key, e.g. an inference gateway's).
        """
        return self.key if self.fairness is None else f"{self.key}\0{self.fairness}"

    @property
    def rank(self) -> tuple[int, int]:
        return (int(self.priority), int(self.work))


class Lease:
    """
    A held slot; L{release} (idempotent) gives it back.
    """

    def __init__(self, queue: ModelQueue, ticket: Ticket) -> None:
        self._queue = queue
        self.ticket = ticket
        self.released = False

    @property
    def waited(self) -> float:
        """
        Seconds the request waited for its slot.
        """
        assert self.ticket.admitted_at is not None
        return self.ticket.admitted_at - self.ticket.arrived

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._queue._release(self.ticket)


class ModelQueue:
    """
    The slots of one model and the requests waiting for them.

    @ivar slots: The model's slot count (set by each L{admit}).
    @ivar service: Average seconds a slot is held (an EWMA), or L{None}
        before the first release.
    """

    def __init__(self, model: str, clock: Any, settings: QueueConfig, metrics: Metrics | None = None) -> None:
        self._metrics = metrics
        self.model = model
        self._clock = clock
        self.settings = settings
        self.slots = 1
        self.waiting: list[Ticket] = []
        self.running: list[Ticket] = []
        self.credits: dict[str, float] = {}
        self.admissions = 0
        self.admitted_total = 0
        self.expired_total = 0
        self.service: float | None = None
        self._seq = 0
        self._waits: dict[tuple[Priority, WorkClass], Any] = {}  # queue_wait's children, bound once each

    # -- the request side -------------------------------------------------

    def ticket(
        self,
        *,
        key: str = "",
        weight: float = 1.0,
        priority: Priority = Priority.NORMAL,
        work: WorkClass = WorkClass.INTERACTIVE,
        deadline: float | None = None,
        body_size: int = 0,
        trace_id: str = "",
        fairness: str | None = None,
    ) -> Ticket:
        """
        A ticket for a request arriving now.

        @param deadline: Seconds the request may wait (from the
            C{x-blazar-deadline-ms} header), or L{None} for the default.
        @param body_size: Bytes of the request body; over
            L{LONG_PREFILL_BYTES} demotes it one priority.
        @param fairness: The fairness id within the key (L{Ticket.flow}).
        """
        if body_size > LONG_PREFILL_BYTES and priority < Priority.LOW:
            priority = Priority(priority + 1)
        settings = self.settings
        if priority is Priority.NORMAL:
            default = settings.deadline_normal
        elif priority is Priority.HIGH:
            default = settings.deadline_high
        elif priority is Priority.LOW:
            default = settings.deadline_low
        else:
            default = BATCH_DEADLINE
        if work == WorkClass.TOOL and priority != Priority.BATCH:  # a batch line waits its day
            default = min(default, self.settings.deadline_tool)
        # a client's deadline may lengthen the wait up to the longest the
        # operator set (deadline_low_secs), no further (issue 36: a day's
        # deadline let one key park 1,024 waiters)
        deadline = default if deadline is None else min(deadline, max(default, self.settings.deadline_low))
        now = self._clock.seconds()
        self._seq += 1
        return Ticket(
            key=key,
            weight=weight if weight > 0 else 1.0,
            priority=priority,
            work=work,
            arrived=now,
            deadline=now + deadline,
            trace_id=trace_id,
            seq=self._seq,
            fairness=fairness,
        )

    def admit(self, ticket: Ticket, slots: int | None = None) -> Deferred[Lease]:
        """
        Wait for a slot.

        @param slots: The model's slot count now (it may change on reload).
        @return: Fires with a L{Lease} once admitted (at once if a slot is
            free and nobody is ahead); fails with L{AllSlotsBusy} at the
            deadline or when L{QueueConfig.max_waiting} requests wait
            already. Cancelling it leaves the queue.
        """
        if slots is not None:
            self.slots = max(1, slots)
        share = max(1, self.settings.max_waiting // 2)
        if ticket.key and sum(1 for t in self.waiting if t.key == ticket.key) >= share:
            self.expired_total += 1
            raise AllSlotsBusy(
                f"all_slots_busy: key {ticket.key!r} already has {share} requests waiting for model "
                f"{self.model!r}, half of queue.max_waiting = {self.settings.max_waiting}: one key may not fill "
                "the queue; retry later",
                0.0,
                self._retry_after(),
            )
        if len(self.waiting) >= self.settings.max_waiting:
            # a full queue makes room for a more urgent arrival: its least
            # urgent waiter (lowest priority and class, then latest deadline) goes
            worst = max(self.waiting, key=lambda t: (t.rank, t.deadline, t.seq))
            if ticket.rank < worst.rank:
                self._expire(worst, shed=True)
        if len(self.waiting) >= self.settings.max_waiting:
            self.expired_total += 1
            raise AllSlotsBusy(
                f"all_slots_busy: {len(self.waiting)} requests already wait for the "
                f"{self.slots} slot(s) of model {self.model!r} (queue.max_waiting = "
                f"{self.settings.max_waiting}); retry later, or raise parallel under "
                f'[models."{self.model}"]',
                0.0,
                self._retry_after(),
            )
        active = {t.flow for t in self.waiting} | {t.flow for t in self.running}
        if ticket.flow not in active and active:
            # a key that becomes active starts level with the keys already
            # waiting or running: nobody banks credit while idle and spends
            # it as a burst (a newcomer at 0 against a busy incumbent would)
            others = min(self.credits.get(k, 0.0) for k in active)
            self.credits[ticket.flow] = max(self.credits.get(ticket.flow, 0.0), others)

        if (
            not self.waiting
            and len(self.running) < self.slots
            and (
                ticket.work != WorkClass.RAW_LONG
                or sum(1 for t in self.running if t.work == WorkClass.RAW_LONG) < self.slots
            )
        ):
            # the usual case: a free slot and nobody ahead
            return succeed(self._start(ticket))

        def cancel(d: Deferred[Lease]) -> None:
            self._leave(ticket)

        waiter: Deferred[Lease] = Deferred(cancel)
        ticket.waiter = waiter
        self.waiting.append(ticket)
        self._dispatch()
        if ticket.admitted_at is None:
            ticket.timer = self._clock.callLater(
                max(0.0, ticket.deadline - self._clock.seconds()), self._expire, ticket
            )
        return waiter

    # -- scheduling -------------------------------------------------------

    @property
    def raw_ceiling(self) -> int:
        """
        Slots raw work may hold: all of them, or C{max(1, N - ceil(N/4))}
        while interactive work waits.
        """
        if any(t.work != WorkClass.RAW_LONG for t in self.waiting):
            return max(1, self.slots - math.ceil(self.slots / 4))
        return self.slots

    def _pick(self, waiting: list[Ticket], credits: dict[str, float], raw_ok: bool) -> Ticket | None:
        candidates = waiting if raw_ok else [t for t in waiting if t.work != WorkClass.RAW_LONG]
        if not candidates:
            return None
        best = min(t.rank for t in candidates)
        return min(
            (t for t in candidates if t.rank == best),
            key=lambda t: (credits.get(t.flow, 0.0), t.deadline, t.seq),
        )

    def _dispatch(self) -> None:
        while len(self.running) < self.slots and self.waiting:
            raw_busy = sum(1 for t in self.running if t.work == WorkClass.RAW_LONG)
            ticket = self._pick(self.waiting, self.credits, raw_busy < self.raw_ceiling)
            if ticket is None:
                return
            self.waiting.remove(ticket)
            self._start(ticket)

    def _start(self, ticket: Ticket) -> Lease:
        if ticket.timer is not None and ticket.timer.active():
            ticket.timer.cancel()
        ticket.admitted_at = self._clock.seconds()
        if self._metrics is not None:
            labels = (ticket.priority, ticket.work)
            wait = self._waits.get(labels)
            if wait is None:
                wait = self._waits[labels] = self._metrics.queue_wait.labels(
                    self.model, ticket.priority.name.lower(), CLASS_NAMES[ticket.work]
                )
            wait.observe(ticket.admitted_at - ticket.arrived)
        self.running.append(ticket)
        self.credits[ticket.flow] = self.credits.get(ticket.flow, 0.0) + 1.0 / ticket.weight
        self.admitted_total += 1
        self.admissions += 1
        if self.admissions >= CREDIT_RESET:
            self.admissions = 0
            self.credits.clear()
        lease = Lease(self, ticket)
        waiter, ticket.waiter = ticket.waiter, None
        if waiter is not None:
            waiter.callback(lease)
        return lease

    def _release(self, ticket: Ticket) -> None:
        self.running.remove(ticket)
        if not self.running and not self.waiting:
            # idle: nobody has a share to catch up on
            self.credits.clear()
            self.admissions = 0
        assert ticket.admitted_at is not None
        held = self._clock.seconds() - ticket.admitted_at
        self.service = held if self.service is None else ((1 - SERVICE_EWMA) * self.service + SERVICE_EWMA * held)
        self._dispatch()

    def _leave(self, ticket: Ticket) -> None:
        if ticket in self.waiting:
            self.waiting.remove(ticket)
            if ticket.timer is not None and ticket.timer.active():
                ticket.timer.cancel()
            ticket.waiter = None
            self._dispatch()  # the raw ceiling may have risen

    def _expire(self, ticket: Ticket, shed: bool = False) -> None:
        """
        End C{ticket}'s wait with L{AllSlotsBusy}: its deadline came, or
        (C{shed}) a full queue made room for a more urgent request.
        """
        waiter = ticket.waiter
        if ticket not in self.waiting or waiter is None:
            return
        position = 1 + sum(1 for t in self.waiting if (t.rank, t.deadline) < (ticket.rank, ticket.deadline))
        ticket.waiter = None
        ticket.timer = None
        self.waiting.remove(ticket)
        self.expired_total += 1
        waited = self._clock.seconds() - ticket.arrived
        retry = self._retry_after()
        self._dispatch()
        if shed:
            waiter.errback(
                AllSlotsBusy(
                    f"all_slots_busy: the queue of model {self.model!r} is full (queue.max_waiting = "
                    f"{self.settings.max_waiting}) and a more urgent request took this one's place after "
                    f"{human_wait(waited)}; retry in {max(1, math.ceil(retry))}s",
                    waited,
                    retry,
                )
            )
            return
        waiter.errback(
            AllSlotsBusy(
                f"all_slots_busy: all {self.slots} slot(s) of model {self.model!r} stayed busy; "
                f"waited {human_wait(waited)} (position {position} of {len(self.waiting) + 1}). "
                f"Retry in {max(1, math.ceil(retry))}s, allow a longer wait with the "
                f'x-blazar-deadline-ms header, or raise parallel under [models."{self.model}"]',
                waited,
                retry,
            )
        )

    # -- introspection ----------------------------------------------------

    def order(self) -> list[Ticket]:
        """
        The waiting requests in the order they would be admitted if no
        more arrived and every slot were free to take them (the raw ceiling
        is not simulated). O(n log n).
        """
        buckets: dict[tuple[int, int], dict[str, list[Ticket]]] = {}
        for t in self.waiting:
            buckets.setdefault(t.rank, {}).setdefault(t.flow, []).append(t)
        credits = dict(self.credits)
        admissions = self.admissions
        ordered: list[Ticket] = []
        for rank in sorted(buckets):
            lines = {k: sorted(ts, key=lambda t: (t.deadline, t.seq)) for k, ts in buckets[rank].items()}
            heads = {k: 0 for k in lines}

            def entry(k: str) -> tuple[float, float, int, str]:
                head = lines[k][heads[k]]
                return (credits.get(k, 0.0), head.deadline, head.seq, k)

            heap = [entry(k) for k in lines]
            heapq.heapify(heap)
            while heap:
                _, _, _, k = heapq.heappop(heap)
                ticket = lines[k][heads[k]]
                heads[k] += 1
                ordered.append(ticket)
                credits[k] = credits.get(k, 0.0) + 1.0 / ticket.weight
                admissions += 1
                if admissions >= CREDIT_RESET:
                    admissions = 0
                    credits.clear()
                    heap = [entry(e[3]) for e in heap]
                    heapq.heapify(heap)
                if heads[k] < len(lines[k]):
                    heapq.heappush(heap, entry(k))
        return ordered

    def _start_times(self, count: int) -> list[float] | None:
        """
        Estimated seconds from now until each of the next C{count} queued
        requests starts, from the average service time; L{None} without
        one.
        """
        if self.service is None:
            return None
        now = self._clock.seconds()
        free = [max(0.0, self.service - (now - (t.admitted_at or now))) for t in self.running] + [0.0] * max(
            0, self.slots - len(self.running)
        )
        heapq.heapify(free)
        starts = []
        for _ in range(count):
            start = heapq.heappop(free) if free else 0.0
            starts.append(start)
            heapq.heappush(free, start + self.service)
        return starts

    def _retry_after(self) -> float:
        starts = self._start_times(len(self.waiting) + 1)
        return starts[-1] if starts else 1.0

    def snapshot(self, show: Callable[[Ticket], bool] = lambda t: True) -> dict[str, Any]:
        """
        The queue for C{GET /api/queue} and C{blazar queue}::

            {"model", "slots": {"busy", "total"}, "raw": {"busy", "ceiling"},
             "waiting": {"total", "by_priority": {"high", "normal", "low", "batch"},
                         "by_class": {"tool", "interactive", "raw_long"}},
             "oldest_wait_ms", "service_ms", "admitted", "expired",
             "requests": [{"trace_id", "key", "position", "priority",
                           "class", "waited_ms", "deadline_in_ms",
                           "estimated_start_ms"}],
             "running": [{"trace_id", "key", "priority", "class", "elapsed_ms"}]}

        Times are milliseconds; C{estimated_start_ms} (from now) and
        C{service_ms} are L{None} before any request has finished.
        C{requests} lists at most L{SNAPSHOT_REQUESTS} waiting requests for
        which C{show} is true, first in line first (positions count every
        waiting request).
        """
        now = self._clock.seconds()
        ordered = self.order()
        starts = self._start_times(min(len(ordered), SNAPSHOT_REQUESTS * 4))
        requests: list[dict[str, Any]] = []
        for position, t in enumerate(ordered):
            if len(requests) >= SNAPSHOT_REQUESTS:
                break
            if not show(t):
                continue
            requests.append(
                {
                    "trace_id": t.trace_id,
                    "key": t.key,
                    "position": position + 1,
                    "priority": t.priority.name.lower(),
                    "class": CLASS_NAMES[t.work],
                    "waited_ms": round((now - t.arrived) * 1000),
                    "deadline_in_ms": round((t.deadline - now) * 1000),
                    "estimated_start_ms": (
                        round(starts[position] * 1000) if starts is not None and position < len(starts) else None
                    ),
                }
            )
        return {
            "model": self.model,
            "slots": {"busy": len(self.running), "total": self.slots},
            "raw": {
                "busy": sum(1 for t in self.running if t.work == WorkClass.RAW_LONG),
                "ceiling": self.raw_ceiling,
            },
            "waiting": {
                "total": len(self.waiting),
                "by_priority": {p.name.lower(): sum(1 for t in self.waiting if t.priority == p) for p in Priority},
                "by_class": {CLASS_NAMES[w]: sum(1 for t in self.waiting if t.work == w) for w in WorkClass},
            },
            "oldest_wait_ms": round(max((now - t.arrived for t in self.waiting), default=0.0) * 1000),
            "service_ms": round(self.service * 1000, 1) if self.service is not None else None,
            "admitted": self.admitted_total,
            "expired": self.expired_total,
            "requests": requests,
            "running": [
                {
                    "trace_id": t.trace_id,
                    "key": t.key,
                    "priority": t.priority.name.lower(),
                    "class": CLASS_NAMES[t.work],
                    "elapsed_ms": round((now - (t.admitted_at if t.admitted_at is not None else t.arrived)) * 1000),
                }
                for t in self.running[:SNAPSHOT_REQUESTS]
                if show(t)
            ],
        }


class Admission:
    """
    Every model's L{ModelQueue}, created on first use.

    @param config: The live config (swapped on C{blazar reload}); its
        C{[queue]} settings apply to requests arriving after a change.
    """

    def __init__(self, clock: Any, config: Callable[[], Config], metrics: Metrics | None = None) -> None:
        self._clock = clock
        self._config = config
        self._metrics = metrics
        self.queues: dict[str, ModelQueue] = {}
        if metrics is not None:
            metrics.gauges(self.collect_metrics)

    def collect_metrics(self) -> Any:
        """
        Scrape-time gauges: C{blazar_queue_depth{model,priority,class}},
        C{blazar_slots_busy{model}}, C{blazar_slots_total{model}}.
        """
        depth = []
        for name, q in sorted(self.queues.items()):
            counts: dict[tuple[str, str], int] = {}
            for t in q.waiting:
                cell = (t.priority.name.lower(), CLASS_NAMES[t.work])
                counts[cell] = counts.get(cell, 0) + 1
            depth += [
                ([name, p.name.lower(), CLASS_NAMES[w]], counts.get((p.name.lower(), CLASS_NAMES[w]), 0))
                for p in Priority
                for w in WorkClass
            ]
        yield gauge("blazar_queue_depth", "Requests waiting for a slot", ["model", "priority", "class"], depth)
        yield gauge(
            "blazar_slots_busy",
            "Slots held by admitted requests",
            ["model"],
            [([n], len(q.running)) for n, q in sorted(self.queues.items())],
        )
        yield gauge(
            "blazar_slots_total",
            "Slots of the model (its parallel)",
            ["model"],
            [([n], q.slots) for n, q in sorted(self.queues.items())],
        )

    def queue(self, model: str) -> ModelQueue:
        """
        The queue of canonical model name C{model}.
        """
        queue = self.queues.get(model)
        settings = self._config().queue
        if queue is None:
            queue = self.queues[model] = ModelQueue(model, self._clock, settings, self._metrics)
        queue.settings = settings
        return queue

    def snapshot(self, show: Callable[[str, Ticket | None], bool] = lambda m, t: True) -> dict[str, Any]:
        """
        C{{"models": [ModelQueue.snapshot(), ...]}} for the models C{show}
        allows (called with a ticket of L{None} for the model itself).
        """

        def rows(model: str) -> Callable[[Ticket], bool]:
            return lambda t: show(model, t)

        return {"models": [q.snapshot(rows(name)) for name, q in sorted(self.queues.items()) if show(name, None)]}


async def admit_request(
    admission: Admission,
    context: RequestContext | None,
    model: str,
    slots: int,
    work: WorkClass,
    size: int | None = None,
    priority: Priority = Priority.NORMAL,
    deadline: float | None = None,
    fairness: str | None = None,
) -> Lease:
    """
    Wait for a slot of C{model} on behalf of a client's request: at the
    priority and deadline it asked for (L{blazar.gateway.call.Asked}), for
    the API key it was admitted with (its C{weight}), with its trace id.
    The slot is released when the response is finished or the client
    leaves; the lease says how long it waited (L{queue_ms}: the caller's
    C{x-blazar-queue-ms}).

    @param slots: The model's slot count.
    @param priority: The tier the client asked for.
    @param deadline: Seconds it may wait, as it asked, or L{None}.
    @param fairness: The fairness id it named within its key
        (L{Ticket.flow}), or L{None}.
    @param size: Bytes of the request body as sent (default:
        the client's).
    @raise AllSlotsBusy: At the deadline, or the queue is full.
    @raise CancelledError: The client left while waiting.
    @raise ValueError: The context has no client (its finish releases the
        slot).
    """
    key = key_of(context)
    client = context.client if context is not None else None
    if client is None:
        # its finish is what releases the slot: without it the slot would leak
        raise ValueError("admit_request needs the call's client (RequestContext.client) to release its slot")
    queue = admission.queue(model)
    if priority is Priority.BATCH and not (context is not None and context.batch_line):
        # batch (below everything, a day's wait) is the Batch API runner's own:
        # from a client it is low (issue 36: it let one key park 1,024 waiters)
        priority = Priority.LOW
    ticket = queue.ticket(
        key=key.name if key is not None else "",
        weight=key.weight if key is not None else 1.0,
        priority=priority,
        deadline=deadline,
        work=work,
        body_size=client.body_size() if size is None else size,
        trace_id=trace_id_of(context),
        fairness=fairness,
    )
    waiting = queue.admit(ticket, slots)
    gone = client.finished()
    if not waiting.called:
        # the client left while waiting: leave the queue at once, even if
        # the handler's Deferred is not cancelled (e.g. a resource that
        # does not propagate the disconnect)
        gone.addErrback(lambda _: waiting.cancel() if not waiting.called else None)
    lease = await waiting
    gone.addBoth(lambda _: lease.release())
    if context is not None and context.started is not None:  # observed: for its trace
        context.spans["queue"] = (ticket.arrived, ticket.admitted_at)
    return lease


def queue_ms(lease: Lease) -> bytes:
    """
    The C{x-blazar-queue-ms} value of an admitted request: how long it
    waited for its slot, in whole milliseconds.
    """
    return str(round(lease.waited * 1000)).encode("ascii")
