"""
The running daemon's state, over the control socket: C{blazar status},
C{version}, C{ps} (and its tables), C{queue}, C{sessions}, C{evict},
C{reload}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from blazar import strictjson
from blazar.cli.daemon import ERROR, OK, Verbs, control, daemon_verb, one_call

if TYPE_CHECKING:
    from twisted.protocols.amp import AMP


def _status(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Status

    async def action(p: AMP) -> int:
        s = await p.callRemote(Status)
        if args.json:
            print(strictjson.encode(s))
        else:
            print(f"blazar {s['version']}, up {s['uptime']:.0f} s, {s['loaded']} model(s) loaded")
            print(f"listening: {', '.join(s['listeners'])}")
            print(f"engine:    {s['engine']}")
            print(f"data dir:  {s['data_dir']}")
            if s.get("audit_down"):
                print(
                    f"audit:     writer down: {s['audit_down']} (lines are dropped until it can write; "
                    "check the disk of audit_log)"
                )
            if s.get("audit_dropped"):
                print(f"audit:     {s['audit_dropped']} line(s) dropped (the writer fell behind or could not write)")
            if s.get("engine_update"):
                print(f"update:    {s['engine_update']}")
        return OK

    return control(args, action)


def _version(args: argparse.Namespace) -> int:
    from blazar import __version__
    from blazar.protocols.control import PROTOCOL_VERSION, Version

    print(f"blazar {__version__} (control protocol {PROTOCOL_VERSION})")

    async def action(p: AMP) -> int:
        v = await p.callRemote(Version, protocol=PROTOCOL_VERSION)
        print(f"daemon {v['version']}")
        return OK

    return control(args, action)


def _ps(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Ps, ResetBreakers

    async def action(p: AMP) -> int:
        if args.reset:
            reset = (await p.callRemote(ResetBreakers))["reset"]
            print(f"reset crash breakers: {', '.join(reset) or 'none'}")
        rows: list[dict[str, Any]] = []
        offset: int | None = 0
        update = None
        gpus: list[dict[str, Any]] | None = None
        gpu_note = ""
        while offset is not None:
            page = await p.callRemote(Ps, offset=offset)
            rows += page["instances"]
            update = update or page.get("engine_update")
            if offset == 0:
                gpus, gpu_note = page.get("gpus"), page.get("gpu_note") or ""
            offset = page.get("next_offset")
        if args.json:
            print(strictjson.encode(rows))
            return OK
        if update:
            print(f"engine update: {update}")
        if not rows:
            print("no models loaded")
        else:
            print_instances(rows, gpus)
        if gpus is not None:
            print()
            print_gpus(gpus, gpu_note, rows)
        return OK

    return control(args, action)


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}M"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f}G" if n >= 2**30 else f"{n / 2**20:.0f}M"


def _gpu_share(g: dict[str, Any]) -> str:
    """
    One GPU's share of a model, from a C{Ps} row's C{gpus}: NVML's figure
    once measured, the plan's before, both when both are known.
    """
    parts = []
    if g.get("measured") is not None:
        parts.append(f"{_size(g['measured'])} measured")
    if g.get("planned") is not None:
        parts.append(f"{_size(g['planned'])} planned")
    return ", ".join(parts) or "-"


def print_instances(rows: list[dict[str, Any]], gpus: list[dict[str, Any]] | None) -> None:
    """
    C{blazar ps}'s table: one line per loaded instance (C{Ps} rows). Its
    C{GPU} column names the GPUs the model holds memory on (C{0,1}), or
    C{CPU}; C{-} where the daemon lists no GPUs (an older daemon, or no
    hardware reading yet) and the model holds none.
    """

    def pct(x: Any) -> str:
        return "-" if x is None else f"{x * 100:.0f}%"

    def per(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(
        f"{'MODEL':<30} {'KIND':<13} {'STATE':<9} {'PID':>7} {'PORT':>6} {'BUSY':>7} {'CTX':>6} "
        f"{'SERVED':>6} {'EST':>7} {'RSS':>7} {'EXPIRES':>8} {'CACHE':>6} {'SPEC':>8} {'DRAFT':>6} {'ACC/D':>5} "
        f"{'BREAKER':<9} "
        f"{'VRAM':>7} GPU"
    )
    for r in rows:
        expires = "forever" if r.get("expires_in") is None else f"{r['expires_in']:.0f}s"
        on = ",".join(str(g["gpu"]) for g in r.get("gpus") or [])
        where = on or ("-" if gpus is None else "CPU")
        vram = _mib(r.get("vram")) if on else "-"
        print(
            f"{r['model']:<30} {r.get('kind') or '-':<13} {r['state']:<9} {r.get('pid') or '-':>7} {r['port']:>6} "
            f"{r['busy']:>3}/{r['slots']:<3} {r['ctx'] or '-':>6} {r.get('served') or 0:>6} "
            f"{_mib(r.get('memory_estimate')):>7} {_mib(r.get('rss')):>7} {expires:>8} "
            f"{pct(r.get('cache_hit')):>6} {r.get('speculative') or '-':>8} {pct(r.get('draft_acceptance')):>6} "
            f"{per(r.get('accepted_per_draft')):>5} {r['breaker']:<9} {vram:>7} {where}"
        )


def print_gpus(gpus: list[dict[str, Any]], note: str, rows: list[dict[str, Any]]) -> None:
    """
    C{blazar ps}'s GPU lines: each GPU (index, name, memory used of total)
    and under it each loaded model's share of it (L{_gpu_share}); or one
    line saying there is none and models run on the CPU.
    """
    if not gpus:
        print(f"GPUs: none seen, models run on the CPU ({note or 'NVML sees no GPU'})")
        return
    for g in gpus:
        print(
            f"GPU {g['index']}  {g['name']}  {_size(g['memory_used'])} used of {_size(g['memory_total'])} "
            f"({_size(g['memory_free'])} free)"
        )
        shares = [(r["model"], share) for r in rows for share in r.get("gpus") or [] if share["gpu"] == g["index"]]
        for model, share in shares:
            print(f"  {model:<30} {_gpu_share(share)}")
        if not shares:
            print("  (no model)")
    if note:
        print(f"GPUs: {note}")


def _queue(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Queue

    async def action(p: AMP) -> int:
        answer = await p.callRemote(Queue)
        queue = json.loads(answer["queue"])
        if args.json:
            queue["truncated"] = answer["truncated"]  # rows were cut to fit the control channel
            print(strictjson.encode(queue))
            return OK
        models = queue["models"]
        if not models:
            print("no requests yet")
            return OK
        for m in models:
            w = m["waiting"]
            service = "-" if m["service_ms"] is None else f"{m['service_ms'] / 1000:.1f}s"
            print(
                f"{m['model']}: {m['slots']['busy']}/{m['slots']['total']} slots busy, "
                f"{w['total']} waiting (high {w['by_priority']['high']}, normal "
                f"{w['by_priority']['normal']}, low {w['by_priority']['low']}), oldest "
                f"{m['oldest_wait_ms'] / 1000:.1f}s, average hold {service}"
            )
            if m["requests"]:
                print(
                    f"  {'POS':>4} {'TRACE':<28} {'KEY':<12} {'PRIORITY':<8} {'CLASS':<11} "
                    f"{'WAITED':>7} {'START IN':>8}"
                )
            for r in m["requests"]:
                start = "-" if r["estimated_start_ms"] is None else f"{r['estimated_start_ms'] / 1000:.1f}s"
                print(
                    f"  {r['position']:>4} {r['trace_id']:<28} {r['key'] or '-':<12} "
                    f"{r['priority']:<8} {r['class']:<11} {r['waited_ms'] / 1000:>6.1f}s {start:>8}"
                )
            unlisted = w["total"] - len(m["requests"])
            if unlisted > 0:
                print(f"  ... and {unlisted} more waiting, not listed (GET /api/queue lists 200 per model)")
        return OK

    return control(args, action)


def _sessions(args: argparse.Namespace) -> int:
    from blazar.protocols.control import SessionClose, SessionList

    async def action(p: AMP) -> int:
        if args.action == "close":
            if not args.name:
                print(
                    "blazar sessions close NAME [--key KEY]: name the session (blazar sessions lists them)",
                    file=sys.stderr,
                )
                return ERROR
            answer = await p.callRemote(SessionClose, name=args.name, key=args.key)
            if args.json:
                print(strictjson.encode({"closed": answer["closed"]}))
            elif not answer["closed"]:
                print(f"no session {args.name!r}" + (f" of key {args.key!r}" if args.key is not None else ""))
            else:
                print(f"closed {args.name}: " + ", ".join(answer["closed"]))
            return OK if answer["closed"] else ERROR
        answer = await p.callRemote(SessionList)
        listing = json.loads(answer["sessions"])
        if args.json:
            for row in listing["sessions"]:  # RFC 3339, as GET /api/session gives it
                row["last_used"] = datetime.fromtimestamp(row["last_used"], timezone.utc).isoformat()
            listing["truncated"] = answer["truncated"]
            print(strictjson.encode(listing))
            return OK
        if not listing["enabled"]:
            print("sessions are off (session_keep_secs = 0)")
        rows = listing["sessions"]
        if not rows:
            print("no sessions")
            return OK
        now = time.time()
        print(f"{'SESSION':<38} {'KEY':<12} {'MODEL':<20} {'SLOT':>4} {'CACHED':>7} {'BANK':>7} {'IDLE':>7}")
        for r in rows:
            slot = "-" if r["slot"] is None else str(r["slot"])
            bank = f"{r['saved_tokens']}" if r["saved"] else "-"
            print(
                f"{r['session'][:38]:<38} {r['key'] or '-':<12} {r['model'][:20]:<20} {slot:>4} "
                f"{r['tokens_cached']:>7} {bank:>7} {now - r['last_used']:>6.0f}s"
            )
        if answer["truncated"]:
            print("... more sessions, not listed (--json lists as many as fit)")
        return OK

    return control(args, action)


def _evict(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Evict

    if not args.all and not args.key:
        print("blazar evict: name a model or instance key, or use --all", file=sys.stderr)
        return ERROR

    return one_call(args, Evict, lambda done: f"evicted: {', '.join(done['evicted'])}", key=args.key, all=args.all)


def _reload(args: argparse.Namespace) -> int:
    from blazar.protocols.control import ReloadConfig

    async def action(p: AMP) -> int:
        answer = await p.callRemote(ReloadConfig)
        applied, restart = answer.get("applied") or [], answer["restart_needed"]
        print("config reloaded" + ("" if applied or restart else "; nothing changed"))
        for key in applied:
            print(f"  applied: {key}")
        for key in restart:
            print(f"  restart the daemon to apply: {key}")
        return OK

    return control(args, action)


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{status}, C{version}, C{ps}, C{queue}, C{sessions}, C{evict} and
    C{reload} to the parser.
    """
    daemon_verb(verbs, "status", "the running daemon: version, uptime, listeners, engine", _status)
    daemon_verb(verbs, "version", "this CLI's and the daemon's versions", _version)
    ps = daemon_verb(verbs, "ps", "loaded models: state, pid, slots, expiry, crash breaker", _ps)
    ps.add_argument("--reset", action="store_true", help="close every crash breaker first")
    daemon_verb(verbs, "queue", "admission queues: busy slots, waiting requests, estimated starts", _queue)
    sessions = daemon_verb(
        verbs, "sessions", "sessions (every key's): slot, tokens cached, KV bank; or close one", _sessions
    )
    sessions.add_argument("action", nargs="?", choices=["close"], help="close NAME: end a session")
    sessions.add_argument("name", nargs="?", help="the session to close")
    sessions.add_argument("--key", help="close only this key's session of that name")
    evict = daemon_verb(verbs, "evict", "unload a model (name, or key name#replica@lane)", _evict)
    evict.add_argument("key", nargs="?", help="model name or instance key")
    evict.add_argument("--all", action="store_true", help="unload every model")

    daemon_verb(
        verbs, "reload", "re-read the config file: applies every runtime key, names those needing a restart", _reload
    )
