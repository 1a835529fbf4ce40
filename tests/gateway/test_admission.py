"""
The admission scheduler, deterministic on a Clock: priority, work class,
deadline order, long-prefill demotion, the raw ceiling, weighted fair
queuing between keys, expiry, disconnects, introspection.
"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.test.requesthelper import DummyRequest

from blazar.config import Config, KeyConfig, QueueConfig, parse_config
from blazar.gateway.admission import (
    LONG_PREFILL_BYTES,
    Admission,
    AllSlotsBusy,
    Lease,
    ModelQueue,
    Priority,
    WorkClass,
    admit_request,
    human_wait,
    queue_ms,
)
from blazar.gateway.context import RequestContext
from blazar.web.client import asked_of, context_of, parse_deadline_ms, parse_priority


class QueueTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.queue = ModelQueue("m:latest", self.clock, QueueConfig())
        self.admitted: list[str] = []
        self.leases: dict[str, Lease] = {}

    def enqueue(self, label: str, slots: int = 1, **kwargs: Any) -> Deferred[Lease]:
        d = self.queue.admit(self.queue.ticket(trace_id=label, **kwargs), slots)

        def got(lease: Lease) -> Lease:
            self.admitted.append(label)
            self.leases[label] = lease
            return lease

        return d.addCallback(got)

    def release(self, label: str) -> None:
        self.leases.pop(label).release()

    def drain(self) -> None:
        """
        Release admitted requests one by one until nothing is left.
        """
        while self.leases:
            self.release(next(iter(self.leases)))


class OrderTests(QueueTestCase):
    def test_free_slot_admits_at_once(self) -> None:
        d = self.enqueue("a")
        self.assertIsInstance(self.successResultOf(d), Lease)
        self.assertEqual(self.queue.snapshot()["slots"], {"busy": 1, "total": 1})

    def test_priority_order(self) -> None:
        self.enqueue("hold")
        self.enqueue("low", priority=Priority.LOW)
        self.enqueue("normal")
        self.enqueue("high", priority=Priority.HIGH)
        self.drain()
        self.assertEqual(self.admitted, ["hold", "high", "normal", "low"])

    def test_batch_after_everything(self) -> None:
        """
        Batch lines wait behind every other tier, even ones that arrive
        after them, and take a day's deadline by default.
        """
        self.enqueue("hold")
        for i in range(3):
            self.enqueue(f"batch{i}", priority=Priority.BATCH, work=WorkClass.TOOL)
        self.clock.advance(60.0)
        self.enqueue("low", priority=Priority.LOW, work=WorkClass.RAW_LONG)
        self.enqueue("chat")
        self.assertEqual(self.queue.snapshot()["waiting"]["by_priority"]["batch"], 3)
        self.drain()
        self.assertEqual(self.admitted, ["hold", "chat", "low", "batch0", "batch1", "batch2"])

    def test_batch_deadline_is_a_day(self) -> None:
        ticket = self.queue.ticket(priority=Priority.BATCH)
        self.assertEqual(ticket.deadline - ticket.arrived, 24 * 3600.0)

    def test_class_order_within_a_priority(self) -> None:
        self.enqueue("hold")
        self.enqueue("raw", work=WorkClass.RAW_LONG)
        self.enqueue("chat", work=WorkClass.INTERACTIVE)
        self.enqueue("tool", work=WorkClass.TOOL)
        self.drain()
        self.assertEqual(self.admitted, ["hold", "tool", "chat", "raw"])

    def test_priority_before_class(self) -> None:
        self.enqueue("hold")
        self.enqueue("normal-tool", work=WorkClass.TOOL)
        self.enqueue("high-raw", work=WorkClass.RAW_LONG, priority=Priority.HIGH)
        self.drain()
        self.assertEqual(self.admitted, ["hold", "high-raw", "normal-tool"])

    def test_earliest_deadline_first_within_a_class(self) -> None:
        self.enqueue("hold")
        self.enqueue("5s", deadline=5.0)
        self.clock.advance(0.1)
        self.enqueue("1s", deadline=1.0)
        self.enqueue("3s", deadline=3.0)
        self.drain()
        self.assertEqual(self.admitted, ["hold", "1s", "3s", "5s"])

    def test_default_deadlines_by_tier(self) -> None:
        config = QueueConfig(deadline_high=2, deadline_normal=30, deadline_low=120, deadline_tool=10)
        queue = ModelQueue("m", self.clock, config)
        self.assertEqual(queue.ticket(priority=Priority.HIGH).deadline, 2)
        self.assertEqual(queue.ticket().deadline, 30)
        self.assertEqual(queue.ticket(priority=Priority.LOW).deadline, 120)
        # tool calls: tightened to 10 s, never loosened
        self.assertEqual(queue.ticket(work=WorkClass.TOOL).deadline, 10)
        self.assertEqual(queue.ticket(work=WorkClass.TOOL, priority=Priority.HIGH).deadline, 2)
        # an explicit deadline wins, up to the longest the operator set (issue 36)
        self.assertEqual(queue.ticket(work=WorkClass.TOOL, deadline=45.0).deadline, 45)
        self.assertEqual(queue.ticket(deadline=86_400.0).deadline, 120)
        self.assertEqual(queue.ticket(priority=Priority.BATCH, deadline=86_400.0).deadline, 86_400)

    def test_one_key_cannot_fill_the_queue_and_a_full_queue_sheds_for_urgency(self) -> None:
        config = QueueConfig(max_waiting=4)
        queue = ModelQueue("m", self.clock, config)
        self.successResultOf(queue.admit(queue.ticket(key="a"), slots=1))  # holds the slot
        parked = [queue.admit(queue.ticket(key="a", priority=Priority.LOW)) for _ in range(2)]
        with self.assertRaises(AllSlotsBusy) as caught:
            queue.admit(queue.ticket(key="a", priority=Priority.LOW))
        self.assertIn("half of queue.max_waiting", str(caught.exception))
        others = [queue.admit(queue.ticket(key="b", priority=Priority.LOW)) for _ in range(2)]
        self.assertEqual(len(queue.waiting), 4)
        urgent = queue.admit(queue.ticket(key="c", priority=Priority.HIGH))
        self.assertNoResult(urgent)
        shed = [d for d in parked + others if d.called]
        self.assertEqual(len(shed), 1)
        self.assertIn("more urgent request took", str(self.failureResultOf(shed[0], AllSlotsBusy).value))
        with self.assertRaises(AllSlotsBusy):  # as urgent as the least urgent: no room made
            queue.admit(queue.ticket(key="d", priority=Priority.LOW))

    def test_long_prefill_demoted_one_priority(self) -> None:
        big = LONG_PREFILL_BYTES + 1
        self.assertEqual(self.queue.ticket(priority=Priority.HIGH, body_size=big).priority, Priority.NORMAL)
        self.assertEqual(self.queue.ticket(body_size=big).priority, Priority.LOW)
        self.assertEqual(self.queue.ticket(priority=Priority.LOW, body_size=big).priority, Priority.LOW)
        self.assertEqual(
            self.queue.ticket(priority=Priority.HIGH, body_size=LONG_PREFILL_BYTES).priority, Priority.HIGH
        )
        # in line: a big high request goes after a small normal one that came first
        self.enqueue("hold")
        self.enqueue("normal")
        self.enqueue("big-high", priority=Priority.HIGH, body_size=big)
        self.enqueue("small-high", priority=Priority.HIGH)
        self.drain()
        self.assertEqual(self.admitted, ["hold", "small-high", "normal", "big-high"])


class RawCeilingTests(QueueTestCase):
    def test_raw_takes_every_slot_while_no_interactive_work_waits(self) -> None:
        for i in range(4):
            self.enqueue(f"raw{i}", slots=4, work=WorkClass.RAW_LONG)
        self.assertEqual(self.admitted, ["raw0", "raw1", "raw2", "raw3"])
        self.assertEqual(self.queue.raw_ceiling, 4)

    def test_ceiling_lowered_while_interactive_work_waits(self) -> None:
        for i in range(3):
            self.enqueue(f"raw{i}", slots=4, work=WorkClass.RAW_LONG)
        self.enqueue("chat0", slots=4)
        # all 4 busy; a high-priority raw request and a normal chat wait
        self.enqueue("raw-high", slots=4, work=WorkClass.RAW_LONG, priority=Priority.HIGH)
        self.enqueue("chat1", slots=4)
        self.assertEqual(self.queue.raw_ceiling, 3)
        self.release("chat0")
        # raw already holds 3 = max(1, 4 - ceil(4/4)) slots: the chat goes first
        self.assertEqual(self.admitted[-1], "chat1")
        self.assertEqual(self.queue.raw_ceiling, 4)
        self.release("chat1")
        # nothing interactive waits: the raw request may take the 4th slot
        self.assertEqual(self.admitted[-1], "raw-high")
        self.assertEqual(self.queue.snapshot()["raw"], {"busy": 4, "ceiling": 4})

    def test_ceiling_formula(self) -> None:
        for slots, ceiling in [(1, 1), (2, 1), (3, 2), (4, 3), (8, 6), (9, 6)]:
            queue = ModelQueue("m", self.clock, QueueConfig())
            queue.slots = slots
            queue.waiting.append(queue.ticket())
            self.assertEqual(queue.raw_ceiling, ceiling, slots)

    def test_one_slot_model_still_serves_raw(self) -> None:
        self.enqueue("chat0")
        self.enqueue("raw", work=WorkClass.RAW_LONG)
        self.release("chat0")
        self.assertEqual(self.admitted, ["chat0", "raw"])


class FairQueuingTests(QueueTestCase):
    def saturate(self, weights: dict[str, float], admissions: int, backlog: int = 5) -> dict[str, int]:
        """
        Keep C{backlog} requests per key waiting on a 1-slot model and count
        who is admitted over C{admissions} admissions.
        """
        counts = {k: 0 for k in weights}
        holder: list[tuple[str, Lease]] = self.__dict__.setdefault("holder", [])

        def add(key: str) -> None:
            d = self.queue.admit(self.queue.ticket(key=key, weight=weights[key]), 1)
            d.addCallback(lambda lease: holder.append((key, lease)))

        fresh = not holder
        for key in weights:
            for _ in range(backlog if fresh else 0):
                add(key)
        for _ in range(admissions):
            key, lease = holder.pop(0)
            counts[key] += 1
            add(key)  # the key sends another, so it never runs dry
            self.clock.advance(0.01)
            lease.release()
        return counts

    def test_weights_1_and_3_over_1000_admissions(self) -> None:
        counts = self.saturate({"light": 1.0, "heavy": 3.0}, 1000)
        ratio = counts["heavy"] / counts["light"]
        self.assertTrue(2.85 <= ratio <= 3.15, counts)

    def test_equal_weights_alternate(self) -> None:
        counts = self.saturate({"a": 1.0, "b": 1.0}, 1000)
        self.assertTrue(abs(counts["a"] - counts["b"]) <= 2, counts)

    def test_without_keys_one_anonymous_key_is_deadline_order(self) -> None:
        self.enqueue("hold")
        self.enqueue("late", deadline=9.0)
        self.enqueue("early", deadline=2.0)
        self.drain()
        self.assertEqual(self.admitted, ["hold", "early", "late"])

    def test_idle_key_cannot_bank_a_burst(self) -> None:
        self.enqueue("hold", key="a")
        for i in range(100):
            self.enqueue(f"a{i}", key="a")
        for _ in range(60):
            self.release(self.admitted[-1])
        # "b" starts waiting after "a" had 60 admissions: it is not given 60 in a row
        for i in range(10):
            self.enqueue(f"b{i}", key="b")
        for _ in range(10):
            self.release(self.admitted[-1])
        last = self.admitted[-10:]
        self.assertEqual(sum(1 for label in last if label.startswith("b")), 5, last)

    def test_newcomer_against_a_running_incumbent_alternates(self) -> None:
        # "a" ran 50 alone and holds the slot (nothing waits); then "b" and
        # "a" arrive interleaved, "b" first
        for i in range(50):
            self.enqueue(f"solo{i}", key="a")
            self.release(f"solo{i}")
        self.enqueue("hold", key="a")
        for i in range(20):
            self.enqueue(f"b{i}", key="b")
            self.enqueue(f"a{i}", key="a")
        self.drain()
        order = "".join(label[0] for label in self.admitted[51:])
        self.assertEqual(order, "ba" * 20)

    def test_idle_model_forgets_credits(self) -> None:
        self.enqueue("x", key="a")
        self.release("x")
        self.assertEqual(self.queue.credits, {})

    def test_credits_reset_after_256_admissions(self) -> None:
        # the first admission happens while the backlog is built
        self.saturate({"a": 1.0, "b": 2.0}, 254)
        self.assertEqual(self.queue.credits, {"a": 86.0, "b": 85.5})  # 86 and 171 admissions
        self.saturate({"a": 1.0, "b": 2.0}, 1)
        self.assertEqual(self.queue.credits, {})


class ExpiryTests(QueueTestCase):
    def test_deadline_gives_all_slots_busy_with_wait(self) -> None:
        self.enqueue("hold")
        d = self.enqueue("normal")
        self.clock.advance(29.9)
        self.assertNoResult(d)
        self.clock.advance(0.1)
        error = self.failureResultOf(d, AllSlotsBusy).value
        self.assertIn("all_slots_busy", str(error))
        self.assertIn("waited 30s", str(error))
        self.assertIn("x-blazar-deadline-ms", str(error))
        self.assertEqual(error.waited, 30.0)
        self.assertGreaterEqual(int(error.retry_after_header), 1)
        self.assertEqual(self.queue.waiting, [])
        self.assertEqual(self.queue.snapshot()["expired"], 1)

    def test_sub_second_wait_in_ms(self) -> None:
        self.enqueue("hold")
        d = self.enqueue("quick", deadline=0.85)
        self.clock.advance(0.85)
        self.assertIn("waited 850ms", str(self.failureResultOf(d, AllSlotsBusy).value))

    def test_retry_after_from_service_times(self) -> None:
        self.enqueue("first")
        self.clock.advance(4.0)
        self.release("first")  # a slot is held ~4 s
        self.enqueue("hold")
        self.enqueue("waiter-1")
        d = self.enqueue("waiter-2", deadline=1.0)
        self.clock.advance(1.0)
        error = self.failureResultOf(d, AllSlotsBusy).value
        # hold ends in ~3 s, waiter-1 runs ~4 s: a new request starts in ~7 s
        self.assertEqual(error.retry_after_header, b"7")

    def test_admitted_request_has_no_pending_timer(self) -> None:
        self.enqueue("hold")
        self.enqueue("next")
        self.release("hold")
        self.assertEqual(self.admitted, ["hold", "next"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_full_queue_refused_at_once(self) -> None:
        queue = ModelQueue("m", self.clock, QueueConfig(max_waiting=2))
        queue.admit(queue.ticket(), 1)
        queue.admit(queue.ticket(), 1)
        queue.admit(queue.ticket(), 1)
        with self.assertRaises(AllSlotsBusy) as caught:
            queue.admit(queue.ticket(), 1)
        self.assertIn("queue.max_waiting = 2", str(caught.exception))

    def test_human_wait(self) -> None:
        self.assertEqual(human_wait(0.85), "850ms")
        self.assertEqual(human_wait(0.0), "0ms")
        self.assertEqual(human_wait(30.2), "30s")
        self.assertEqual(human_wait(125), "2m05s")


class DisconnectTests(QueueTestCase):
    def test_cancel_while_queued_frees_the_place(self) -> None:
        self.enqueue("hold")
        gone = self.enqueue("gone")
        self.enqueue("next")
        gone.cancel()
        self.failureResultOf(gone, CancelledError)
        self.assertEqual([t.trace_id for t in self.queue.waiting], ["next"])
        self.release("hold")
        self.assertEqual(self.admitted, ["hold", "next"])
        # the cancelled request's deadline timer went with it
        self.clock.advance(300)
        self.assertEqual(self.admitted, ["hold", "next"])

    def test_release_is_idempotent(self) -> None:
        lease = self.successResultOf(self.enqueue("a"))
        lease.release()
        lease.release()
        self.assertEqual(self.queue.snapshot()["slots"]["busy"], 0)


class SnapshotTests(QueueTestCase):
    def test_positions_counts_and_estimates(self) -> None:
        self.enqueue("warm")
        self.clock.advance(2.0)
        self.release("warm")  # service time 2 s
        self.enqueue("hold")
        self.enqueue("low", priority=Priority.LOW)
        self.enqueue("tool", work=WorkClass.TOOL)
        self.clock.advance(0.5)
        self.enqueue("high", priority=Priority.HIGH)
        snap = self.queue.snapshot()
        self.assertEqual(snap["slots"], {"busy": 1, "total": 1})
        self.assertEqual(snap["waiting"]["total"], 3)
        self.assertEqual(snap["waiting"]["by_priority"], {"high": 1, "normal": 1, "low": 1, "batch": 0})
        self.assertEqual(snap["waiting"]["by_class"], {"tool": 1, "interactive": 2, "raw_long": 0})
        self.assertEqual(snap["oldest_wait_ms"], 500)
        self.assertEqual(snap["service_ms"], 2000.0)
        rows = [(r["trace_id"], r["position"], r["estimated_start_ms"]) for r in snap["requests"]]
        # hold has run 0.5 of ~2 s; then each takes ~2 s
        self.assertEqual(rows, [("high", 1, 1500), ("tool", 2, 3500), ("low", 3, 5500)])

    def test_show_filters_rows_not_positions(self) -> None:
        self.enqueue("hold")
        self.enqueue("theirs", key="other")
        self.enqueue("mine", key="me")
        snap = self.queue.snapshot(lambda t: t.key == "me")
        self.assertEqual([(r["trace_id"], r["position"]) for r in snap["requests"]], [("mine", 2)])
        self.assertEqual(snap["waiting"]["total"], 2)

    def test_order_matches_admissions(self) -> None:
        self.enqueue("hold")
        weights = {"a": 1.0, "b": 3.0}
        for i in range(40):
            key = "ab"[i % 2]
            self.enqueue(
                f"{key}{i}",
                key=key,
                weight=weights[key],
                priority=Priority(i % 3),
                work=WorkClass(i % 2),
                deadline=float(i % 7 + 1),
            )
        predicted = [t.trace_id for t in self.queue.order()]
        self.drain()
        self.assertEqual(self.admitted[1:], predicted)


class ParsingTests(SynchronousTestCase):
    def test_priority_header(self) -> None:
        self.assertEqual(parse_priority(b"HIGH"), Priority.HIGH)
        self.assertEqual(parse_priority(b" low "), Priority.LOW)
        self.assertEqual(parse_priority(b"urgent"), Priority.NORMAL)
        self.assertEqual(parse_priority(b"Batch"), Priority.BATCH)
        self.assertEqual(parse_priority(None), Priority.NORMAL)

    def test_deadline_header(self) -> None:
        self.assertEqual(parse_deadline_ms(b"1500"), 1.5)
        self.assertIsNone(parse_deadline_ms(b"-5"))
        self.assertIsNone(parse_deadline_ms(b"soon"))
        self.assertIsNone(parse_deadline_ms(b"nan"))
        self.assertIsNone(parse_deadline_ms(None))

    def test_queue_config(self) -> None:
        config = parse_config("[queue]\ndeadline_high_secs = 1\nmax_waiting = 5\n")
        self.assertEqual(config.queue, QueueConfig(deadline_high=1.0, max_waiting=5))


class AdmitRequestTests(SynchronousTestCase):
    """
    The glue to a web request: headers in, the slot held until the
    response finishes or the client leaves.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.admission = Admission(self.clock, lambda: Config())

    def request(self, key: KeyConfig | None = None, **headers: str) -> DummyRequest:
        request = DummyRequest([b"v1"])
        for name, value in headers.items():
            request.requestHeaders.setRawHeaders(name.replace("_", "-"), [value])
        context_of(request).key = key
        context_of(request).trace_id = "t-" + str(len(self.admission.queue("m").waiting))
        return request

    def admit(self, request: DummyRequest, work: WorkClass = WorkClass.INTERACTIVE) -> Deferred[Lease]:
        asked = asked_of(cast(IRequest, request))  # what the surface decodes from the headers
        return Deferred.fromCoroutine(
            admit_request(
                self.admission,
                context_of(request),
                "m",
                1,
                work,
                10,
                priority=asked.priority,
                deadline=asked.deadline,
            )
        )

    def test_slot_held_until_the_response_finishes(self) -> None:
        first = self.request()
        lease = self.successResultOf(self.admit(first))
        self.assertEqual(queue_ms(lease), b"0")
        second = self.request()
        waiting = self.admit(second)
        self.assertNoResult(waiting)
        self.clock.advance(0.25)
        first.finish()
        self.assertTrue(lease.released)
        self.assertEqual(queue_ms(self.successResultOf(waiting)), b"250")

    def test_client_gone_while_waiting_leaves_the_queue(self) -> None:
        holder = self.request()
        self.admit(holder)
        gone = self.request()
        waiting = self.admit(gone)
        gone.processingFailed(Failure(ConnectionError("client left")))
        self.failureResultOf(waiting, CancelledError)
        self.assertEqual(self.admission.queue("m").waiting, [])

    def test_client_gone_after_admission_releases(self) -> None:
        request = self.request()
        lease = self.successResultOf(self.admit(request))
        request.processingFailed(Failure(ConnectionError("client left")))
        self.assertTrue(lease.released)

    def test_no_client_is_refused_before_it_queues(self) -> None:
        """
        A context without a client could never release its slot: it is a
        programming error, refused before it takes a place in the queue.
        """
        admitting = Deferred.fromCoroutine(
            admit_request(self.admission, RequestContext(), "m", 1, WorkClass.INTERACTIVE, 10)
        )
        self.assertIn("RequestContext.client", str(self.failureResultOf(admitting, ValueError).value))
        self.assertEqual(self.admission.queue("m").waiting, [])

    def test_headers_and_key_weight(self) -> None:
        self.admit(self.request())
        key = KeyConfig("heavy", "x" * 16, weight=3.0)
        self.admit(self.request(key, x_blazar_priority="High", x_blazar_deadline_ms="1234"))
        (ticket,) = self.admission.queue("m").waiting
        self.assertEqual((ticket.key, ticket.weight, ticket.priority), ("heavy", 3.0, Priority.HIGH))
        self.assertAlmostEqual(ticket.deadline - ticket.arrived, 1.234)

    def test_snapshot_filters_models(self) -> None:
        self.admit(self.request())
        self.admission.queue("other")
        snap = self.admission.snapshot(lambda model, ticket: model == "m")
        self.assertEqual([m["model"] for m in snap["models"]], ["m"])
