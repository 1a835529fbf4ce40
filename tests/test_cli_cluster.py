"""
C{blazar cluster}'s lines, from C{Cluster} listings as the control
channel gives them (L{blazar.cli.cluster.render}): a line per node with
its state and when it was last seen, its models with their queues, and
on a node without a shared store the config keys that join others.
"""

from __future__ import annotations

from typing import Any

from blazar.cli.cluster import render
from blazar.gateway.nodes import JOIN_HINT


def node(name: str, state: str, seen_ago: float, models: list[dict[str, Any]], this: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "url": f"http://{name}:11434",
        "version": "1.2.3",
        "state": state,
        "started": 0.0,
        "last_seen": 0.0,
        "seen_ago": seen_ago,
        "this": this,
        "models": models,
    }


SMOL = {"model": "smollm:latest", "state": "ready", "slots": 4, "busy": 1, "waiting": 5, "running": 1}


def test_every_node_with_its_state_models_and_queues() -> None:
    lines = render(
        {
            "clustered": True,
            "node": "a",
            "hint": "",
            "nodes": [
                node("a", "up", 1.2, [], this=True),
                node("bee", "up", 3.0, [SMOL, {"model": "x", "state": None, "slots": 0, "busy": 0, "waiting": 2}]),
                node("c", "stopped", 130.0, []),
                node("d", "unreachable", 7300.0, []),
            ],
        }
    )
    assert lines[0].split() == ["NODE", "STATE", "URL", "VERSION"]
    assert lines[1].split() == ["a", "*", "up", "(seen", "1s", "ago)", "http://a:11434", "1.2.3"]
    assert lines[2].strip() == "no models loaded"
    assert lines[3].split() == ["bee", "up", "(seen", "3s", "ago)", "http://bee:11434", "1.2.3"]
    assert lines[4].split() == ["MODEL", "STATE", "SLOTS", "WAITING", "RUNNING"]
    assert lines[5].split() == ["smollm:latest", "ready", "1/4", "5", "1"]
    assert lines[6].split() == ["x", "-", "0/0", "2", "0"]
    assert lines[7].split() == ["c", "stopped", "(seen", "2m", "ago)", "http://c:11434", "1.2.3"]
    assert lines[8].strip() == "-"
    assert lines[9].split()[:5] == ["d", "unreachable", "(seen", "2h", "ago)"]
    assert len(lines) == 11


def test_without_a_shared_store_this_node_and_how_to_join() -> None:
    lines = render({"clustered": False, "node": "a", "hint": JOIN_HINT, "nodes": [node("a", "up", 0.0, [SMOL], True)]})
    assert lines[1].startswith("a *")
    assert lines[-2:] == ["", JOIN_HINT]
    for key in ("[cluster] database", "[cluster] node", "[cluster] url"):
        assert key in lines[-1]


def test_a_cut_listing_says_so() -> None:
    lines = render({"clustered": True, "node": "a", "hint": "", "nodes": [node("a", "up", 0.0, [])]}, truncated=True)
    assert "not listed" in lines[-1]


def test_no_rows_yet() -> None:
    assert render({"clustered": True, "node": "a", "hint": "", "nodes": []}) == ["no nodes have written their row yet"]
