"""
What a node writes of what it runs (L{blazar.gateway.nodes.model_rows}):
per model its live children's state and slots and the model's admission
queue (the same counts as the vLLM-named gauges), and a node's state from
its row (L{blazar.gateway.nodes.node_state}).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, cast

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from blazar.config import Config
from blazar.engines.instance import InstanceState, InstanceView
from blazar.gateway.admission import Admission
from blazar.gateway.gie import queue_counts
from blazar.gateway.nodes import STOPPED, UNREACHABLE, UNREACHABLE_SECS, UP, model_rows, node_state


def view(name: str, state: InstanceState, slots: int = 2, busy: int = 0) -> Any:
    return SimpleNamespace(
        name=name,
        state=state,
        slots=slots,
        in_flight=busy,
        live=state in (InstanceState.STARTING, InstanceState.READY),
    )


def views(*made: Any) -> Iterable[InstanceView]:
    return cast(Iterable[InstanceView], made)


class ModelRowsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.admission = Admission(Clock(), lambda: Config())

    def queue_up(self, model: str, count: int, slots: int = 1) -> None:
        queue = self.admission.queue(model)
        for _ in range(count):
            queue.admit(queue.ticket(), slots)

    def test_each_live_child_with_its_queue(self) -> None:
        self.queue_up("a:latest", 3)  # one running, two waiting
        rows = model_rows(
            views(view("b:latest", InstanceState.STARTING), view("a:latest", InstanceState.READY, 1, 1)),
            self.admission,
        )
        self.assertEqual(
            rows,
            [
                {"model": "a:latest", "state": "ready", "slots": 1, "busy": 1, "waiting": 2, "running": 1},
                {"model": "b:latest", "state": "starting", "slots": 2, "busy": 0, "waiting": 0, "running": 0},
            ],
        )
        self.assertEqual(queue_counts(self.admission, "a:latest"), (2, 1))  # as the gauges count them

    def test_children_on_their_way_out_are_not_listed(self) -> None:
        self.assertEqual(
            model_rows(views(view("a", InstanceState.STOPPING), view("b", InstanceState.DEAD)), self.admission), []
        )

    def test_several_children_of_one_model_add_up_and_show_the_readiest(self) -> None:
        rows = model_rows(
            views(view("a", InstanceState.STARTING, 2, 0), view("a", InstanceState.READY, 4, 3)), self.admission
        )
        self.assertEqual(rows, [{"model": "a", "state": "ready", "slots": 6, "busy": 3, "waiting": 0, "running": 0}])

    def test_a_queue_without_a_child_is_listed_only_while_it_holds_requests(self) -> None:
        self.admission.queue("idle")  # admission keeps every queue it made
        self.queue_up("loading", 2)
        self.assertEqual(
            model_rows(views(), self.admission),
            [{"model": "loading", "state": None, "slots": 0, "busy": 0, "waiting": 1, "running": 1}],
        )

    def test_without_admission_no_queues(self) -> None:
        self.assertEqual(
            model_rows(views(view("a", InstanceState.READY)), None),
            [{"model": "a", "state": "ready", "slots": 2, "busy": 0, "waiting": 0, "running": 0}],
        )


class NodeStateTests(SynchronousTestCase):
    def test_states(self) -> None:
        self.assertEqual(node_state(100.0, False, 100.0 + UNREACHABLE_SECS), UP)
        self.assertEqual(node_state(100.0, False, 100.1 + UNREACHABLE_SECS), UNREACHABLE)
        self.assertEqual(node_state(100.0, True, 100.0), STOPPED)
        self.assertEqual(node_state(100.0, True, 1e9), STOPPED)  # a clean stop is never unreachable
