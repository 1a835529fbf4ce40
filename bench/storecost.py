"""
The store scenario (issue 42): what the shared store costs per request,
in the daemon's CPU and in latency, against the default SQLite.

    ./dev.sh bench --only store

The same keyed workload runs against three daemons, one per setup, each
with a key that has every limit (C{rpm}, C{tpm}, C{daily_tokens},
C{max_concurrent}, set far above what the run reaches, so that the quota
path runs and usage is recorded but nothing is refused):

  - C{sqlite}: the default, C{<data_dir>/blazar.db} and limits counted in
    the daemon's memory;
  - C{postgres}: C{[cluster] database}, a real PostgreSQL on loopback
    (started as tests/postgres.py starts it: C{initdb} in a temp dir,
    C{fsync=off});
  - C{postgres+redis}: the same plus C{[cluster] redis}, a real
    C{redis-server} on loopback (tests/redisserver.py): every request's
    limits checked and counted there.

The engine is the canned upstream (nginx serving a llama-server reply,
bench/engine_shim.py; for the Responses pairs its 100-event stream, as the
Responses surface always streams from the engine), so the figures are the
daemon's and its stores'.
Each daemon is pinned to CPU 0; wrk, the engines, PostgreSQL and Redis to
CPU 1. Measured, alternating between the setups (A B C, ten times, 5 s a
run or 2 s with --quick; each figure is the best of its ten readings, the
least disturbed on a shared machine):

  - non-streamed chat completions with the key, at c = 1 and c = 8 (wrk):
    the daemon's CPU per request, p50/p99 latency, requests per second,
    and the store servers' own CPU per request;
  - a Responses pair, one at a time (a Python client on CPU 1): a
    C{store: true} request, then one continuing it by
    C{previous_response_id} (the stored Response read back and a new one
    written), with each one's p50/p99 and the daemon's CPU per pair;
  - what one C{tpm} check costs Redis as the key's last minute fills (the
    limits' own script on a set of 0 to 20,000 answers).

Each figure's delta against C{sqlite} is in the table.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import psutil

if TYPE_CHECKING:
    from run import Bench

SETUPS = ("sqlite", "postgres", "postgres+redis")
MODEL = "upstream"  # the canned engine (bench/engine_shim.py): a chat completion
STREAM_MODEL = "upstream-sse"  # its stream (100 events): what the Responses surface asks an engine for
KEY_NAME = "bench-store"
KEY_SECRET = "blz-bench-store-0123456789abcdef"
# every limit on, none reached: rpm's sliding window holds a minute of requests
LIMITS = {"rpm": 10_000_000, "tpm": 1_000_000_000, "daily_tokens": 1_000_000_000_000, "max_concurrent": 256}
CONCURRENCY = (1, 8)
TPM_WINDOWS = (0, 1000, 5000, 20000)  # a key's answers in the last minute (the tpm set's size)
ROUNDS = 10  # each setup's runs, alternating with the others'; each figure the best (the machine is shared)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def setup_clusters(database: str | None, redis: str | None) -> dict[str, dict[str, str]]:
    """
    Each setup's C{[cluster]} keys: C{{"sqlite": {}, "postgres":
    {"database": URL}, "postgres+redis": {"database": URL, "redis": URL}}}.

    @param database: A PostgreSQL URL (one database per setup is better:
        see L{store_scenario}); L{None} for a run of C{sqlite} alone.
    @param redis: A Redis URL.
    """
    setups: dict[str, dict[str, str]] = {"sqlite": {}}
    if database is not None:
        setups["postgres"] = {"database": database}
        if redis is not None:
            setups["postgres+redis"] = {"database": database, "redis": redis}
    return setups


def node_config(work: Path, port: int, shim: Path, cluster: dict[str, str]) -> str:
    """
    A setup's daemon's config (TOML): the canned engine as model
    C{upstream}, the bench's key with every limit, and C{cluster} as its
    C{[cluster]} table (none where empty).
    """
    lines = [
        f'listen = "tcp:{port}:interface=127.0.0.1"',
        f"data_dir = {json.dumps(str(work / 'data'))}",
        f"models_dir = {json.dumps(str(work / 'models'))}",
        "breaker_crashes = 1000",
        "",
        "[engines.llamacpp]",
        f"binary = {json.dumps(str(shim))}",
        "",
        *(
            line
            for model in (MODEL, STREAM_MODEL)
            for line in (f'[models."{model}"]', 'path = "tiny.gguf"', "parallel = 64", "ctx_size = 2048", "")
        ),
    ]
    if cluster:
        lines += ["[cluster]", *(f"{k} = {json.dumps(v)}" for k, v in sorted(cluster.items())), ""]
    lines += [
        "[[keys]]",
        f"name = {json.dumps(KEY_NAME)}",
        f"secret = {json.dumps(KEY_SECRET)}",
        f"models = [{json.dumps(MODEL)}, {json.dumps(STREAM_MODEL)}]",
        *(f"{k} = {v}" for k, v in LIMITS.items()),
        "",
    ]
    return "\n".join(lines)


def tree_cpu(root: psutil.Process | None) -> dict[int, float]:
    """
    User + system CPU seconds of C{root} and its descendants, by PID (a
    server's: PostgreSQL forks a backend per connection).
    """
    if root is None:
        return {}
    seen: dict[int, float] = {}
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    for p in processes:
        try:
            seen[p.pid] = sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return seen


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """
    CPU seconds spent between two L{tree_cpu} readings (a process that
    started in between counts from 0; one that ended in between is lost).
    """
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def pin(root: psutil.Process, cpu: int) -> None:
    """
    Pin C{root} and its descendants (those forked later inherit it).
    """
    for p in [root, *root.children(recursive=True)]:
        try:
            p.cpu_affinity([cpu])
        except psutil.NoSuchProcess:
            pass


def percentile(samples: list[float], q: float) -> float:
    """
    The C{q}-th percentile (0..100) of C{samples}, nearest rank; NaN for none.
    """
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def responses_pairs(port: int, seconds: float) -> dict[str, Any]:
    """
    Responses pairs for C{seconds}, one request at a time on one kept-alive
    connection: C{store: true}, then the same conversation continued by
    C{previous_response_id}. Latencies in ms of each, and the errors
    (recorded, never raised: the first one's status and body).
    """
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY_SECRET}"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    first: list[float] = []
    second: list[float] = []
    errors, first_error, pairs = 0, "", 0

    def send(body: dict[str, Any]) -> tuple[int, bytes, float]:
        nonlocal conn
        started = time.perf_counter()
        try:
            conn.request("POST", "/v1/responses", json.dumps(body), headers)
            reply = conn.getresponse()
            data = reply.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            return 0, str(e).encode(), 0.0
        return reply.status, data, (time.perf_counter() - started) * 1000

    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            status, data, ms = send({"model": STREAM_MODEL, "input": "hi", "store": True})
            if status != 200:
                errors += 1
                first_error = first_error or f"{status} {data[:200].decode(errors='replace')}"
                continue
            first.append(ms)
            previous = json.loads(data)["id"]
            status, data, ms = send(
                {"model": STREAM_MODEL, "input": "and then?", "store": True, "previous_response_id": previous}
            )
            if status != 200:
                errors += 1
                first_error = first_error or f"{status} {data[:200].decode(errors='replace')}"
                continue
            second.append(ms)
            pairs += 1
    finally:
        conn.close()
    return {
        "pairs": pairs,
        "store_p50_ms": percentile(first, 50),
        "store_p99_ms": percentile(first, 99),
        "continue_p50_ms": percentile(second, 50),
        "continue_p99_ms": percentile(second, 99),
        "errors": errors,
        "first_error": first_error,
    }


def deltas(setups: dict[str, dict[str, Any]], fields: tuple[str, ...]) -> None:
    """
    Add C{<field>_delta} (the setup's figure less C{sqlite}'s) to each
    setup's row, in place, for each of C{fields}.
    """
    base = setups.get("sqlite")
    for row in setups.values():
        for field in fields:
            row[f"{field}_delta"] = row[field] - base[field] if base is not None else float("nan")


def summarize(raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """
    One row of figures per setup from L{store_scenario}'s measurements
    (C{chat} by concurrency, C{pair}), with deltas against C{sqlite}.
    """
    rows: dict[str, dict[str, Any]] = {}
    for name, m in raw.items():
        row: dict[str, Any] = {}
        for c, x in m["chat"].items():
            row[f"c{c}_cpu_ms"] = x["cpu_ms_per_request"]
            row[f"c{c}_p50_ms"] = x["p50_ms"]
            row[f"c{c}_p99_ms"] = x["p99_ms"]
            row[f"c{c}_rps"] = x["rps"]
            row[f"c{c}_server_cpu_ms"] = x["server_cpu_ms_per_request"]
            row[f"c{c}_errors"] = x["errors_all_runs"]
        if "pair" in m:
            p = m["pair"]
            row.update(
                pair_cpu_ms=p["cpu_ms_per_pair"],
                pair_server_cpu_ms=p["server_cpu_ms_per_pair"],
                store_p50_ms=p["store_p50_ms"],
                continue_p50_ms=p["continue_p50_ms"],
                continue_p99_ms=p["continue_p99_ms"],
                pair_errors=p["errors_all_runs"],
            )
        rows[name] = row
    fields = tuple(k for k in next(iter(rows.values()), {}) if not k.endswith("_errors"))
    deltas(rows, fields)
    return rows


def store_table(r: dict[str, Any]) -> str:
    """
    The scenario's table, one line per setup (L{summarize}'s rows).
    """
    rows = r["summary"]

    def cell(row: dict[str, Any], field: str, unit: str = "ms", signed: bool = True) -> str:
        delta = row.get(f"{field}_delta", float("nan"))
        shown = f"{row[field]:.2f}"
        if signed and delta == delta and field in row and row is not rows.get("sqlite"):
            shown += f" ({delta:+.2f})"
        return shown

    lines = [
        "Store: a keyed chat (every limit on) and a Responses pair, per setup; (+x) is against sqlite",
        f"{'setup':<16} {'CPU/req c=1':>16} {'p50 c=1':>16} {'p99 c=1':>16} {'CPU/req c=8':>16} "
        f"{'req/s c=8':>18} {'server CPU/req':>14} {'pair CPU':>16} {'continue p50':>16}",
    ]
    for name, row in rows.items():
        errors = sum(v for k, v in row.items() if k.endswith("_errors"))
        lines.append(
            f"{name:<16} {cell(row, 'c1_cpu_ms'):>16} {cell(row, 'c1_p50_ms'):>16} {cell(row, 'c1_p99_ms'):>16} "
            f"{cell(row, 'c8_cpu_ms'):>16} {cell(row, 'c8_rps'):>18} {row['c1_server_cpu_ms']:>14.2f} "
            f"{cell(row, 'pair_cpu_ms') if 'pair_cpu_ms' in row else '':>16} "
            f"{cell(row, 'continue_p50_ms') if 'continue_p50_ms' in row else '':>16}"
            + (f"  ERRORS {errors}" if errors else "")
        )
    for name, first in r.get("first_errors", {}).items():
        lines.append(f"  {name}'s first error: {first[:200]}")
    if r.get("tpm_check_by_window"):
        lines.append("One tpm check in Redis, by the key's answers in the last minute: Redis CPU / round trip")
        for n, x in r["tpm_check_by_window"].items():
            lines.append(f"  {int(n):>7,} answers: {x['redis_cpu_ms']:.3f} ms / {x['wall_ms']:.3f} ms")
    return "\n".join(lines)


def best_figures(
    rs: list[dict[str, Any]], count: str, lower: tuple[str, ...], higher: tuple[str, ...]
) -> dict[str, Any]:
    """
    Each figure's best over C{rs} (the runs without errors, if any): the
    least of each of C{lower} (CPU, latency), the most of each of
    C{higher}; C{<figure>} per C{count} for C{cpu_s} and C{server_cpu_s}
    first (C{cpu_ms_per_<count>}, C{server_cpu_ms_per_<count>}). On a shared
    machine the best of several runs is the least disturbed reading of
    each figure, which need not all be the same run's. The errors of all
    runs are kept (L{run.best_run}'s fields).
    """
    from run import best_run

    best = best_run(rs)
    unit = count.rstrip("s")
    per = [
        {
            **r,
            f"cpu_ms_per_{unit}": 1000 * r["cpu_s"] / max(1, r[count]),
            f"server_cpu_ms_per_{unit}": 1000 * r["server_cpu_s"] / max(1, r[count]),
        }
        for r in rs
    ]
    clean = [r for r in per if not r["errors"]] or per
    for field in (f"cpu_ms_per_{unit}", f"server_cpu_ms_per_{unit}", *lower):
        best[field] = min(r[field] for r in clean)
    for field in higher:
        best[field] = max(r[field] for r in clean)
    return best


def aggregate(
    runs: dict[str, dict[str, list[dict[str, Any]]]], pair_runs: dict[str, list[dict[str, Any]]]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """
    Each setup's figures, each the best of its runs (L{best_figures}): the
    daemon's and the store servers' CPU per request (and per pair),
    latencies, requests per second; and each setup's first error, if any.

    @param runs: By setup, by concurrency, wrk's runs (L{run.wrk}'s figures
        plus C{server_cpu_s}).
    @param pair_runs: By setup, L{responses_pairs}' runs plus C{cpu_s},
        C{server_cpu_s} and C{rps} (the pairs).
    """
    raw: dict[str, dict[str, Any]] = {}
    first_errors: dict[str, str] = {}
    for name in runs:
        chat = {}
        for c, rs in runs[name].items():
            best = best_figures(rs, "requests", ("p50_ms", "p99_ms"), ("rps",))
            chat[c] = best
            if best["first_error_all_runs"]:
                first_errors.setdefault(name, best["first_error_all_runs"])
        raw[name] = {"chat": chat, "runs": runs[name]}
        if pair_runs.get(name):
            lower = ("store_p50_ms", "store_p99_ms", "continue_p50_ms", "continue_p99_ms")
            pair = best_figures(pair_runs[name], "pairs", lower, ("rps",))
            if pair["first_error_all_runs"]:
                first_errors.setdefault(name, pair["first_error_all_runs"])
            raw[name].update(pair=pair, pair_runs=pair_runs[name])
    return raw, first_errors


class StoreNode:
    """
    One setup's daemon (a L{Bench} with a config of its own) and the store
    servers whose CPU it costs.
    """

    def __init__(self, name: str, node: Bench, servers: list[psutil.Process]) -> None:
        self.name = name
        self.node = node
        self.servers = servers

    def server_cpu(self) -> dict[int, float]:
        reading: dict[int, float] = {}
        for s in self.servers:
            reading.update(tree_cpu(s))
        return reading


def start_servers() -> tuple[Any, Any]:
    """
    A real PostgreSQL and a real redis-server on loopback, as the tests
    start them (tests/postgres.py, tests/redisserver.py: removed at exit),
    pinned to the load CPU.

    @raise SystemExit: one is not installed (what to install).
    """
    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tests import postgres, redisserver

    try:
        pg = postgres.server()
        rd = redisserver.server()
    except AssertionError as e:
        raise SystemExit(f"bench --only store: {e}") from None
    return pg, rd


def server_process(popen: Any) -> psutil.Process:
    """
    The server's process from the tests' helper's C{Popen} (PostgreSQL run
    through C{runuser} as root: its child).
    """
    p = psutil.Process(popen.pid)
    if p.name() == "runuser":
        deadline = time.monotonic() + 10
        while not p.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        return p.children()[0] if p.children() else p
    return p


def version(argv: list[str]) -> str:
    """
    What C{argv} (a server's C{--version}) prints, on one line.
    """
    done = subprocess.run(argv, capture_output=True, text=True)
    return " ".join((done.stdout or done.stderr).split())


def tpm_window_cost(url: str, server: psutil.Process, sizes: tuple[int, ...] = TPM_WINDOWS) -> dict[str, Any]:
    """
    What one C{tpm} check costs Redis as the key's window fills: the
    Redis limits' own scripts (L{blazar.gateway.redisquota.TOKENS} counts
    C{n} answers into the window, L{blazar.gateway.redisquota.RATES}
    checks it), for each C{n} of C{sizes}. Redis's CPU (ms) and the round
    trip's wall time (ms) per check, by C{n}. (The window is one count per
    second, so the check's cost should not grow with C{n}.)
    """
    import redis

    from blazar.gateway.redisquota import RATES, TOKENS

    client = redis.Redis.from_url(url)
    try:
        sha, count = client.script_load(RATES), client.script_load(TOKENS)
        out: dict[str, Any] = {}
        for n in sizes:
            client.delete("bench:rpm", "bench:tpm:s")
            pipe = client.pipeline(transaction=False)
            for i in range(n):
                pipe.evalsha(count, 2, "bench:tpm:s", "bench:day:", 17, f"m{i}", 1, 0, 0)
                if i % 1000 == 999:
                    pipe.execute()
            pipe.execute()
            checks = max(20, min(500, 200_000 // max(1, n)))
            cpu0, started = sum(server.cpu_times()[:2]), time.perf_counter()
            for i in range(checks):
                client.evalsha(sha, 3, "bench:rpm", "bench:tpm:s", "bench:day:", -1, 10**12, -1, f"x{i}", 1, 0)
            wall = time.perf_counter() - started
            out[str(n)] = {
                "checks": checks,
                "redis_cpu_ms": 1000 * (sum(server.cpu_times()[:2]) - cpu0) / checks,
                "wall_ms": 1000 * wall / checks,
            }
        client.delete("bench:rpm", "bench:tpm:s", *client.keys("bench:day:*"))
        return out
    finally:
        client.close()


def store_scenario(bench: Bench, wrk: Callable[..., dict[str, Any]], lua_post: Callable[..., Path]) -> None:
    """
    The three setups, measured alternating (see the module's doc); into
    C{bench.results["store"]}.
    """
    from run import HERE, LOAD_CPU, Bench

    pg, rd = start_servers()
    pg_proc, rd_proc = server_process(pg._process), server_process(rd._process)
    pin(pg_proc, LOAD_CPU)
    pin(rd_proc, LOAD_CPU)
    clusters = {
        "sqlite": {},
        "postgres": setup_clusters(pg.new_database(), None)["postgres"],
        "postgres+redis": setup_clusters(pg.new_database(), rd.new_db())["postgres+redis"],
    }
    nodes: list[StoreNode] = []
    affinity = os.sched_getaffinity(0)
    versions = {
        "postgresql": version([str(pg._bin / "postgres"), "--version"]),
        "redis": version([rd._binary, "--version"]),
    }
    try:
        for name, cluster in clusters.items():
            work = bench.work / f"store-{name.replace('+', '-')}"
            work.mkdir(parents=True, exist_ok=True)
            node = Bench(bench.seconds, work, llama=bench.llama)
            node.tree = bench.tree
            node.auth = KEY_SECRET
            node.config_text = node_config(work, node.port, HERE / "engine_shim.py", cluster)
            servers = {"sqlite": [], "postgres": [pg_proc], "postgres+redis": [pg_proc, rd_proc]}[name]
            nodes.append(StoreNode(name, node, servers))
            node.start()
            node.child(MODEL)
            node.child(STREAM_MODEL)
        script = lua_post(bench.work / "store-chat.lua", CHAT, {"Authorization": f"Bearer {KEY_SECRET}"})
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {n.name: {str(c): [] for c in CONCURRENCY} for n in nodes}
        pair_runs: dict[str, list[dict[str, Any]]] = {n.name: [] for n in nodes}
        os.sched_setaffinity(0, {LOAD_CPU})  # the pairs' client (set back below)
        for _round in range(ROUNDS):
            for c in CONCURRENCY:
                for n in nodes:
                    before = n.server_cpu()
                    r = wrk(
                        f"http://127.0.0.1:{n.node.port}/v1/chat/completions", script, c, bench.seconds, n.node.daemon
                    )
                    r["server_cpu_s"] = cpu_spent(before, n.server_cpu())
                    runs[n.name][str(c)].append(r)
            for n in nodes:
                before, cpu0 = n.server_cpu(), sum(n.node.daemon.cpu_times()[:2])
                p = responses_pairs(n.node.port, bench.seconds)
                p["cpu_s"] = sum(n.node.daemon.cpu_times()[:2]) - cpu0
                p["server_cpu_s"] = cpu_spent(before, n.server_cpu())
                p["rps"] = p["pairs"]  # best_run's ordering: more pairs in the same time
                pair_runs[n.name].append(p)
        raw, first_errors = aggregate(runs, pair_runs)
        tpm = tpm_window_cost(rd.url(63), rd_proc)
    finally:
        os.sched_setaffinity(0, affinity)
        for n in nodes:
            if hasattr(n.node, "proc"):
                n.node.stop(strays=False)
        pg.remove()
        rd.remove()
    bench.results["store"] = {
        "model": "the canned upstream (nginx, bench/engine_shim.py)",
        "key_limits": LIMITS,
        "setups": raw,
        "summary": summarize(raw),
        "first_errors": first_errors,
        "tpm_check_by_window": tpm,
        "servers": versions,
        "pinning": "daemons on CPU 0; wrk, the engines, PostgreSQL, Redis and the pairs' client on CPU 1",
    }
