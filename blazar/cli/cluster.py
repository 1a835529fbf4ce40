"""
C{blazar cluster}: the nodes of a cluster (issue 42), over the control
socket (the AMP C{Cluster} command): each node's name, URL, state (up,
stopped, unreachable; when it was last seen), the models it has loaded
and each one's queue. Without C{[cluster] database} it lists this node
and says how to join others.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from blazar import strictjson
from blazar.cli.daemon import OK, Verbs, control, daemon_verb

if TYPE_CHECKING:
    from twisted.protocols.amp import AMP


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def render(listing: dict[str, Any], truncated: bool = False) -> list[str]:
    """
    The lines C{blazar cluster} prints for a C{Cluster} listing
    (L{blazar.gateway.nodes.ClusterNodes.listing}): a line per node (name,
    this node marked C{*}, state with when it was last seen, URL, version),
    under it a line per model it runs (state, busy/total slots, requests
    waiting and running), then the hint on joining others when the store
    is not shared.
    """
    nodes = listing["nodes"]
    lines: list[str] = []
    if not nodes:
        lines.append("no nodes have written their row yet")
    else:
        width = max(len("NODE"), *(len(n["name"]) + 2 for n in nodes))
        lines.append(f"{'NODE':<{width}} {'STATE':<28} {'URL':<32} VERSION")
        for n in nodes:
            name = n["name"] + (" *" if n["this"] else "")
            state = f"{n['state']} (seen {_ago(n['seen_ago'])})"
            lines.append(f"{name:<{width}} {state:<28} {n['url'] or '-':<32} {n['version']}")
            models = n["models"]
            if not models:
                lines.append(f"  {'no models loaded' if n['state'] == 'up' else '-'}")
                continue
            model_width = max(len("MODEL"), *(len(str(m["model"])) for m in models))
            lines.append(f"  {'MODEL':<{model_width}} {'STATE':<9} {'SLOTS':>7} {'WAITING':>7} {'RUNNING':>7}")
            for m in models:
                slots = f"{m.get('busy', 0)}/{m.get('slots', 0)}"
                lines.append(
                    f"  {m['model']:<{model_width}} {m.get('state') or '-':<9} {slots:>7} "
                    f"{m.get('waiting', 0):>7} {m.get('running', 0):>7}"
                )
    if truncated:
        lines.append("... some models or nodes not listed (the control channel's limit)")
    if not listing["clustered"]:
        lines.append("")
        lines.append(listing["hint"])
    return lines


def _cluster(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Cluster

    async def action(p: AMP) -> int:
        answer = await p.callRemote(Cluster)
        listing = json.loads(answer["cluster"])
        if args.json:
            listing["truncated"] = answer["truncated"]
            print(strictjson.encode(listing))
            return OK
        for line in render(listing, answer["truncated"]):
            print(line)
        return OK

    return control(args, action)


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{cluster} to the parser.
    """
    daemon_verb(
        verbs, "cluster", "the cluster's nodes: state, url, loaded models and their queues (up/stopped/unreachable)",
        _cluster,
    )  # fmt: skip
