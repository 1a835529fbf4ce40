"""
C{blazar bench}: tokens/s and time to first token through the daemon's
OpenAI API, recorded by the daemon with the launch profile, engine and
hardware; C{--history} compares the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from blazar import strictjson
from blazar.cli.daemon import ERROR, OK, Verbs, api_key, control, daemon_http, daemon_verb

if TYPE_CHECKING:
    from twisted.protocols.amp import AMP


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
        return ERROR
    if min(args.prompt_tokens, args.max_tokens, args.rounds) < 1:
        print("blazar bench: --prompt-tokens, --max-tokens and --rounds must be positive", file=sys.stderr)
        return ERROR
    where = daemon_http(args, "bench")
    if isinstance(where, int):
        return where
    _, _, base = where
    url = f"{base}/v1/chat/completions"
    key = api_key(args)

    def say(level: Any) -> None:
        if not args.json:
            print(bench.level_line(level.to_json()), flush=True)

    async def action(p: AMP) -> int:
        import treq
        from twisted.internet import reactor
        from twisted.web.client import Agent, HTTPConnectionPool

        pool = HTTPConnectionPool(reactor, persistent=True)
        pool.maxPersistentPerHost = max(args.concurrency)
        pool.retryAutomatically = False  # a request is sent once: a retry would be timed twice
        http = treq.client.HTTPClient(Agent(reactor, pool=pool))
        if not args.json:
            print(
                f"bench {args.model} through {url}: prompt ~{args.prompt_tokens} words, {args.max_tokens} "
                f"generated, {args.rounds} request(s) per stream; a warm-up request first (it loads the model)",
                flush=True,
            )
            print(bench.LEVEL_HEADER, flush=True)
        try:
            levels = await bench.run_bench(
                http,
                url,
                args.model,
                args.concurrency,
                rounds=args.rounds,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                clock=reactor,
                now=time.perf_counter,
                headers={"authorization": f"Bearer {key}"} if key else {},
                say=say,
            )
        except bench.BenchFailed as e:
            print(f"blazar bench: {e}", file=sys.stderr)
            return ERROR
        finally:
            await pool.closeCachedConnections()
        run = {
            "settings": {
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "concurrency": args.concurrency,
                "url": url,
            },
            "levels": [level.to_json() for level in levels],
        }
        stored = json.loads((await p.callRemote(BenchRecord, model=args.model, run=strictjson.encode(run)))["bench"])
        runs = json.loads((await p.callRemote(BenchHistory, model=stored["model"], limit=2))["runs"])
        comparison = bench.compare(runs[1], runs[0]) if len(runs) == 2 and runs[0]["id"] == stored["id"] else None
        if args.json:
            print(strictjson.encode({"run": stored, "comparison": comparison}))
            return OK
        print(f"recorded for {stored['model']} as bench_history id {stored['id']}")
        print(f"  engine:   {stored['engine']}")
        print(f"  profile:  {bench.profile_text(stored['profile'])}")
        print(f"  hardware: {bench.hardware_text(stored['hardware'])}")
        for line in bench.comparison_lines(comparison) if comparison else ["first run of this model"]:
            print(line)
        return OK

    return control(args, action)


def _bench_history(args: argparse.Namespace) -> int:
    """
    C{blazar bench --history [MODEL]}: the recorded runs, newest first,
    and each model's latest against its previous one.
    """
    from blazar.engines import bench
    from blazar.protocols.control import BenchHistory

    async def action(p: AMP) -> int:
        answer = await p.callRemote(BenchHistory, model=args.model, limit=args.limit)
        runs = json.loads(answer["runs"])
        latest: dict[str, list[dict[str, Any]]] = {}
        for run in runs:  # newest first
            if len(latest.setdefault(run["model"], [])) < 2:
                latest[run["model"]].append(run)
        comparisons = {m: bench.compare(pair[1], pair[0]) for m, pair in latest.items() if len(pair) == 2}
        if args.json:
            print(strictjson.encode({"runs": runs, "comparisons": comparisons, "truncated": answer["truncated"]}))
            return OK
        if not runs:
            print(f"no bench runs recorded{' of ' + args.model if args.model else ''} (`blazar bench MODEL` makes one)")
            return OK
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
        return OK

    return control(args, action)


def add_verbs(verbs: Verbs) -> None:
    """
    Add C{bench} to the parser.
    """
    bench = daemon_verb(
        verbs,
        "bench",
        "tokens/s and time to first token through the gateway, recorded; --history compares runs",
        _bench,
    )
    bench.add_argument("model", nargs="?", help="the model to measure (with --history: only its runs)")
    bench.add_argument(
        "--history", action="store_true", help="list the recorded runs; the latest against the one before"
    )
    bench.add_argument(
        "--concurrency",
        type=_concurrency,
        default=[1, 2, 4],
        metavar="1,2,4",
        help="streams at once, one level after another (default 1,2,4)",
    )
    bench.add_argument(
        "--prompt-tokens",
        type=int,
        default=200,
        metavar="N",
        help="the synthetic prompt's length in words, about as many tokens on real models' "
        "vocabularies, several times more on generated test models (default 200; the "
        "measured token count is shown)",
    )
    bench.add_argument(
        "--max-tokens", type=int, default=128, metavar="N", help="tokens generated per request (default 128)"
    )
    bench.add_argument("--rounds", type=int, default=2, metavar="N", help="requests per stream (default 2)")
    bench.add_argument("--limit", type=int, default=20, metavar="N", help="--history: runs listed (default 20)")
    bench.add_argument("--key", help="an API key, for a gateway with keys (default: $BLAZAR_API_KEY)")
