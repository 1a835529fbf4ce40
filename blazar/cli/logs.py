"""
C{blazar logs}: the daemon's recent log lines, or one model's engine
output, over the control socket; C{-f} follows them over the HTTP API's
Server-Sent Events where it can.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
from typing import TYPE_CHECKING

from blazar.cli.daemon import ERROR, OK, Verbs, control, daemon_http, daemon_verb

if TYPE_CHECKING:
    from twisted.protocols.amp import AMP


def _follow_http(args: argparse.Namespace) -> int | None:
    """
    C{blazar logs -f} over the daemon's C{GET /api/logs?follow=1} (the
    dashboard's Server-Sent Events, from the same ring): new lines as they
    come, no polling. L{None} when the HTTP API cannot serve it (no TCP
    listener, no answer, or it wants a key this shell does not have):
    the control socket is asked instead.
    """
    import http.client

    found = daemon_http(argparse.Namespace(config=args.config), "logs")
    if isinstance(found, int):
        return None
    host, port, _ = found
    query = {"follow": "1", **({"model": args.model} if args.model else {})}
    headers = {"accept": "text/event-stream"}
    key = os.environ.get("BLAZAR_API_KEY")
    if key:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.request("GET", "/api/logs?" + urllib.parse.urlencode(query), headers=headers)
        resp = conn.getresponse()
    except OSError:
        return None
    if resp.status == 404 and args.model:
        print(f"blazar: no model named {args.model!r}", file=sys.stderr)
        return ERROR
    if resp.status != 200:
        return None
    try:
        for raw in resp:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith("data: "):
                print(json.loads(line[len("data: ") :])["text"], flush=True)
    except (OSError, http.client.HTTPException, ValueError):
        print("blazar: the daemon closed the log stream", file=sys.stderr)
        return ERROR
    return OK


def _logs(args: argparse.Namespace) -> int:
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    from blazar.protocols.control import Logs, UnknownModel

    if args.follow:
        followed = _follow_http(args)
        if followed is not None:
            return followed

    async def action(p: AMP) -> int:
        cursor = 0
        while True:
            try:
                page = await p.callRemote(Logs, model=args.model, after=cursor)
            except UnknownModel as e:
                print(f"blazar: {e}", file=sys.stderr)
                return ERROR
            for line in page["lines"]:
                print(line, flush=True)
            moved = page["next"] != cursor
            cursor = page["next"]
            if not args.follow and not (moved and page["lines"]):
                return OK
            if args.follow and not page["lines"]:
                await deferLater(reactor, 1.0, lambda: None)

    return control(args, action)


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{logs} to the parser.
    """
    logs = daemon_verb(verbs, "logs", "the daemon's recent log, or one model's engine output", _logs)
    logs.add_argument("model", nargs="?", help="only this model's engine output")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
