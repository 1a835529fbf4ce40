"""
The cluster's nodes (issue 42): what each node runs, written to the
shared store's C{nodes} table (migration 10) by its heartbeat every
L{HEARTBEAT_SECS} (L{blazar.storeservice.NodeHeartbeat}), and read back
for C{blazar cluster} (the AMP C{Cluster} command) and the dashboard's
Nodes page (C{GET /ui/api/nodes}) by L{ClusterNodes}.

A node's row: its name (C{blazar.config.node_name}), the URL other nodes
reach it at (C{blazar.config.node_url}), its Blazar version, when it
started, its last heartbeat, whether it stopped cleanly, and per model it
runs L{model_rows}: the child's state and slots (as C{/api/ps} shows
them) and the model's admission queue (waiting, running: the figures of
C{vllm:num_requests_waiting} and C{vllm:num_requests_running},
L{blazar.gateway.gie.queue_counts}).

A node is C{up} while its heartbeat is at most L{UNREACHABLE_SECS} old,
C{stopped} once it marked its clean stop, and C{unreachable} otherwise
(killed, cut off, or its store unreachable from it). On SQLite (no
C{[cluster] database}) the listing is this node's row only.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs
from twisted.internet.defer import Deferred

from blazar import store, strictjson
from blazar.engines.instance import InstanceState, InstanceView
from blazar.gateway.admission import Admission
from blazar.gateway.gie import queue_counts

HEARTBEAT_SECS = 5.0
"""How often each node writes its row."""

UNREACHABLE_SECS = 15.0
"""A row whose heartbeat is older than this is shown C{unreachable} (three heartbeats missed)."""

UP = "up"
STOPPED = "stopped"
UNREACHABLE = "unreachable"

JOIN_HINT = (
    'this node only: no [cluster] database is set. To list several nodes, set [cluster] database = "postgresql://..." '
    "(one database for every node), [cluster] node (each node's name) and [cluster] url (the address the "
    "other nodes reach it at) in each node's config"
)
"""What C{blazar cluster} and the Nodes page say on a node without C{[cluster] database}."""

# the state a model with several children shows: the most useful one's
_STATE_RANK = {InstanceState.READY: 0, InstanceState.STARTING: 1, InstanceState.STOPPING: 2, InstanceState.DEAD: 3}


def model_rows(views: Iterable[InstanceView], admission: Admission | None) -> list[dict[str, Any]]:
    """
    What this node runs, by model (canonical name, sorted): C{{"model",
    "state", "slots", "busy", "waiting", "running"}}. Each model with a
    live child (starting or ready, as C{/api/ps} lists them: C{state} its
    child's, the readiest of several; C{slots} and C{busy} over its
    children), and each with requests waiting or running but no live child
    (C{state} L{None}, C{slots} and C{busy} 0).

    @param views: The supervisor's snapshot (L{blazar.engines.supervisor.Supervisor.snapshot}).
    @param admission: The admission queues (L{None}: none counted).
    """
    models: dict[str, dict[str, Any]] = {}
    for view in views:
        if not view.live:
            continue
        row = models.setdefault(view.name, {"model": view.name, "state": None, "slots": 0, "busy": 0})
        if row["state"] is None or _STATE_RANK[view.state] < _STATE_RANK[InstanceState(row["state"])]:
            row["state"] = str(view.state)
        row["slots"] += view.slots
        row["busy"] += view.in_flight
    queued = sorted(admission.queues) if admission is not None else []
    for name in sorted(set(models) | set(queued)):
        waiting, running = queue_counts(admission, name) if admission is not None else (0, 0)
        if name not in models and not (waiting or running):
            continue  # (admission keeps a queue for every model it ever saw)
        row = models.setdefault(name, {"model": name, "state": None, "slots": 0, "busy": 0})
        row["waiting"], row["running"] = waiting, running
    return [models[name] for name in sorted(models)]


def node_state(heartbeat: float, stopped: bool, now: float) -> str:
    """
    L{UP}, L{STOPPED} or L{UNREACHABLE}: a node's state from its row, at
    C{now} (UNIX seconds, as C{heartbeat}).
    """
    if stopped:
        return STOPPED
    return UNREACHABLE if now - heartbeat > UNREACHABLE_SECS else UP


def live_namesake(row: store.NodeRow, url: str, now: float) -> str | None:
    """
    Why a node whose URL is C{url} must not start under the name of
    C{row} (the C{nodes} row of its name, read at its start, C{now} UNIX
    seconds): another node of that name is L{UP} (not stopped, a heartbeat
    at most L{UNREACHABLE_SECS} old) at another URL, so the two would
    overwrite one row and each fail the other's batch lines as its own
    earlier life's. L{None}: no such node (the row is this node's own,
    stopped, or old enough to be a dead node's).
    """
    name, other_url, version, _, heartbeat, stopped, _ = row
    if node_state(heartbeat, stopped, now) != UP or other_url == url:
        return None
    wait = max(0.0, UNREACHABLE_SECS - (now - heartbeat))
    return (
        f"another node named {name!r} is up at {other_url or '(no url)'} (Blazar {version}, its heartbeat "
        f"{max(0.0, now - heartbeat):.0f} s ago), and this node's url is {url or '(none)'}: two nodes of one "
        "name would overwrite one row of the nodes table and fail each other's batch lines. Give each node "
        'its own name: [cluster] node = "..." in its config file (unset, it is made from the host name and '
        "the data_dir). If that node was this one under its earlier url, stopped uncleanly, start it again "
        f"in {wait:.0f} s, once its heartbeat is {UNREACHABLE_SECS:.0f} s old"
    )


def node_view(row: store.NodeRow, now: float, this: str) -> dict[str, Any]:
    """
    One node as C{blazar cluster --json} and C{GET /ui/api/nodes} show it::

        {"name", "url", "version", "state": "up" | "stopped" | "unreachable",
         "started", "last_seen" (UNIX seconds), "seen_ago" (seconds),
         "this" (whether it is the node answering),
         "models": [{"model", "state", "slots", "busy", "waiting", "running"}, ...]}

    A row whose C{models} is not a JSON list (written by a newer or broken
    node) shows none.
    """
    name, url, version, started, heartbeat, stopped, models = row
    try:
        parsed = strictjson.loads(models)
    except ValueError:
        parsed = []
    return {
        "name": name,
        "url": url,
        "version": version,
        "state": node_state(heartbeat, stopped, now),
        "started": started,
        "last_seen": heartbeat,
        "seen_ago": round(max(0.0, now - heartbeat), 1),
        "this": name == this,
        "models": [m for m in parsed if isinstance(m, dict)] if isinstance(parsed, list) else [],
    }


@attrs.define
class ClusterNodes:
    """
    The nodes as this node sees them in the store.

    @ivar run_db: Runs a C{thd_*} function of L{blazar.store} on the
        store's thread (L{blazar.storeservice.StoreService.run_db}).
    @ivar wall: UNIX seconds now.
    @ivar name: This node's name.
    @ivar clustered: Whether the store is shared (C{[cluster] database}).
    """

    run_db: Callable[..., Deferred[Any]]
    wall: Callable[[], float]
    name: str
    clustered: bool

    async def listing(self) -> dict[str, Any]:
        """
        C{{"clustered": bool, "node": this node's name, "nodes": [L{node_view}, ...],
        "hint": str}}: every node's row (this one's only without C{[cluster]
        database}, and then C{hint} says how to join others; else C{""}).

        @raise blazar.store.StoreUnavailable: The shared store cannot be reached.
        """
        rows = await self.run_db(store.thd_nodes, None if self.clustered else self.name)
        now = self.wall()
        return {
            "clustered": self.clustered,
            "node": self.name,
            "nodes": [node_view(row, now, self.name) for row in rows],
            "hint": "" if self.clustered else JOIN_HINT,
        }
