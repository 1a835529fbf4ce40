"""
The relay ceiling: how many streamed chunks a second Blazar relays on one
core, and its CPU per chunk, when the engine is never the limit.

    ./dev.sh bench --only relay

The engine is bench/relay_engine.py, a canned llama-server-shaped engine
(chat.completion.chunk events, each in a chunk of its own, `data: [DONE]`,
the connection closed after each stream as llama-server does) that writes
as fast as the socket allows; Blazar supervises it as the model `relay`
(bench/engine_shim.py execs it in llama-server's place). 64 wrk connections
each ask for one stream after another, for three targets alternating (A B
C, twice, each figure the better run without errors):

  - direct: the canned engine itself, the load side's own ceiling;
  - nginx: a `proxy_pass` hop (no buffering), the floor of a proxy hop;
  - Blazar: its daemon, pinned to CPU 0 (the GATEWAY CPU).

Then the same engine paced as a GPU engine is (model `relay-paced`: one
event of every open stream per 2 ms step, 32,000 chunks/s offered at 64
streams; direct and Blazar, alternating, twice): whether Blazar keeps up
when each event comes in a read of its own, and its CPU per chunk then.

The engine and wrk share CPU 1. Chunks are counted exactly: every stream
carries the same events (each target's are counted once, before the runs,
by reading one whole stream), so chunks = streams completed with a 2xx
x events per stream; a gateway's CPU per chunk is its processes' CPU time
over the run / those chunks (the streams cut off at the run's end add a
little CPU and no chunk). Each row also says how busy each core was: the
figure is the gateway's ceiling only where its core was (near) full.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import psutil
from real import GATEWAY_CPU, HELLO, LOAD_CPU, ProcessGroupCPU, events, free_port, settle, start_nginx, stop, tried
from run import best_run, ratio

if TYPE_CHECKING:
    from run import Bench

MODEL = "relay"
PACED = "relay-paced"
STEP_S = 0.002  # bench/relay_engine.py's STEP_S
CONNECTIONS = 64
TARGETS = ("direct", "nginx", "blazar")
GATEWAYS = ("nginx", "blazar")
CEILING_TARGET = 30000  # chunks/s on one core (issue 41)
CHUNK_CPU_TARGET = 30  # us of gateway CPU per relayed chunk (issue 41)


class CoreBusy:
    """
    How busy each CPU was between two readings (all processes: the machine
    is shared, so a busy core need not be the target's alone).
    """

    def __init__(self) -> None:
        self.before = psutil.cpu_times(percpu=True)
        self.started = time.monotonic()

    def shares(self) -> dict[str, float]:
        after = psutil.cpu_times(percpu=True)
        out = {}
        for cpu, name in ((GATEWAY_CPU, "gateway_core_busy"), (LOAD_CPU, "load_core_busy")):
            b, a = self.before[cpu], after[cpu]
            total = sum(a) - sum(b)
            idle = (a.idle + getattr(a, "iowait", 0.0)) - (b.idle + getattr(b, "iowait", 0.0))
            out[name] = ratio(total - idle, total)
        return out


def relay_scenario(bench: Bench, wrk: Any, lua_post: Any) -> None:
    """
    The three targets on the canned engine, alternating, 64 streams at a
    time; results into C{bench.results["relay"]}.
    """
    engine_pid, engine_port = bench.child(MODEL)
    key = bench.engine_key
    engine = psutil.Process(engine_pid)
    ports = {"direct": engine_port, "nginx": free_port(), "blazar": bench.port}
    watch: dict[str, Any] = {"direct": None, "blazar": bench.daemon}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        proc, watch["nginx"] = start_nginx(bench.work, ports["nginx"], engine_port, key, name="nginx-relay")
        procs.append(proc)
        nginx_cpu: ProcessGroupCPU = watch["nginx"]
        busy = [engine, bench.daemon, *nginx_cpu.processes]
        url = {t: f"http://127.0.0.1:{p}/v1/chat/completions" for t, p in ports.items()}
        body = {"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 128}
        script = lua_post(bench.work / "relay-stream.lua", body, {"Authorization": f"Bearer {key}"})
        warmup_errors: dict[str, str] = {}
        for t in TARGETS:
            for _ in range(3):
                tried(warmup_errors, t, events, ports[t], body, key)
        counted = {t: tried(warmup_errors, t, events, ports[t], body, key) for t in TARGETS}
        if counted["direct"] is None:
            raise SystemExit(f"the canned engine failed: {warmup_errors['direct']}")
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
        for _ in range(2):
            for t in TARGETS:
                engine0 = sum(engine.cpu_times()[:2])
                cores = CoreBusy()
                r = wrk(url[t], script, CONNECTIONS, bench.seconds, watch[t], closes_after_stream=True)
                r.update(cores.shares())
                r["engine_cpu_s"] = sum(engine.cpu_times()[:2]) - engine0
                runs[t].append(r)
                settle(busy)
        res: dict[str, Any] = {
            "connections": CONNECTIONS,
            "seconds_per_run": bench.seconds,
            "events_per_stream": counted,
            "warmup_errors": warmup_errors,
            "pinning": f"nginx and Blazar's daemon on CPU {GATEWAY_CPU}; wrk and the canned engine on CPU {LOAD_CPU}",
            "load_average": os.getloadavg(),
            "runs": runs,
        }
        res["summary"] = summarize(runs, counted, warmup_errors)
        res["paced"] = paced(bench, wrk, lua_post)
        bench.results["relay"] = res
    finally:
        for proc in procs:
            stop(proc)


def paced(bench: Bench, wrk: Any, lua_post: Any) -> dict[str, Any]:
    """
    The paced engine direct and through Blazar, alternating, twice.
    """
    engine_pid, engine_port = bench.child(PACED)
    key = bench.engine_key
    engine = psutil.Process(engine_pid)
    ports = {"direct": engine_port, "blazar": bench.port}
    watch = {"direct": None, "blazar": bench.daemon}
    body = {"model": PACED, "messages": HELLO, "stream": True, "max_tokens": 128}
    script = lua_post(bench.work / "relay-paced.lua", body, {"Authorization": f"Bearer {key}"})
    warmup_errors: dict[str, str] = {}
    counted = {t: tried(warmup_errors, t, events, ports[t], body, key) for t in ports}
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in ports}
    for _ in range(2):
        for t in ports:
            engine0 = sum(engine.cpu_times()[:2])
            cores = CoreBusy()
            url = f"http://127.0.0.1:{ports[t]}/v1/chat/completions"
            r = wrk(url, script, CONNECTIONS, bench.seconds, watch[t], closes_after_stream=True)
            r.update(cores.shares())
            r["engine_cpu_s"] = sum(engine.cpu_times()[:2]) - engine0
            runs[t].append(r)
            settle([engine, bench.daemon])
    return {
        "step_s": STEP_S,
        "offered_chunks_per_s": CONNECTIONS / STEP_S,
        "events_per_stream": counted,
        "warmup_errors": warmup_errors,
        "runs": runs,
        "summary": summarize(runs, counted, warmup_errors),
    }


def summarize(
    runs: dict[str, list[dict[str, Any]]], counted: dict[str, int | None], warmup_errors: dict[str, str]
) -> dict[str, Any]:
    """
    Per target, from its better run without errors: chunks/s, CPU per
    chunk, how busy each core was, and its errors.

    @param counted: data events per stream, per target, as one whole stream
        read through it had them (every stream carries the same events);
        where a target's could not be read, direct's.
    """
    out: dict[str, Any] = {}
    for t, rs in runs.items():
        events = counted.get(t) or counted.get("direct") or 0
        best = best_run(rs)
        ok = best["requests"] - best["non2xx"]
        chunks = ok * events
        row: dict[str, Any] = {
            "streams_per_s": ratio(ok, best["duration_s"]),
            "chunks_per_s": ratio(chunks, best["duration_s"]),
            "p50_stream_ms": best["p50_ms"],
            "gateway_core_busy": best["gateway_core_busy"],
            "load_core_busy": best["load_core_busy"],
            "engine_us_per_chunk": ratio(1e6 * best["engine_cpu_s"], chunks),
            "errors": best["errors_all_runs"] + (1 if t in warmup_errors else 0),
            "first_error": best["first_error_all_runs"] or warmup_errors.get(t, ""),
            "all_chunks_per_s": [ratio((r["requests"] - r["non2xx"]) * events, r["duration_s"]) for r in rs],
        }
        if t in GATEWAYS:
            row["cpu_us_per_chunk"] = ratio(1e6 * best["cpu_s"], chunks)
            row["gateway_cpu_share"] = ratio(best["cpu_s"], best["duration_s"])
        out[t] = row
    for t in GATEWAYS:
        if t in out:
            out[t]["kept"] = ratio(out[t]["chunks_per_s"], out["direct"]["chunks_per_s"])
    return out


def ceiling(res: dict[str, Any]) -> dict[str, Any]:
    """
    Blazar's relay ceiling on one core and its CPU per chunk, the lesser
    and the greater of two readings: the chunks/s it relayed with the engine
    flat out (where events pile up in the socket and one read carries many,
    the per-read cost spread over them), and, with the paced engine (each
    event in a read of its own, as from a GPU), 1 s over its CPU per chunk:
    the rate at which that cost fills one core.
    """
    flat = res["summary"]["blazar"]
    readings = {"flat out, measured": (flat["chunks_per_s"], flat["cpu_us_per_chunk"])}
    if "paced" in res:
        us = res["paced"]["summary"]["blazar"]["cpu_us_per_chunk"]
        readings["paced, 1 s / CPU per chunk"] = (ratio(1e6, us), us)
    chunks = min(readings.values(), key=lambda v: v[0] if v[0] == v[0] else -1.0)[0]
    cpu = max(readings.values(), key=lambda v: v[1] if v[1] == v[1] else float("inf"))[1]
    said = "; ".join(f"{name}: {c:.0f} chunks/s, {us:.1f} us/chunk" for name, (c, us) in readings.items())
    return {"chunks_per_s": chunks, "cpu_us_per_chunk": cpu, "readings": said}


def relay_table(res: dict[str, Any]) -> str:
    s = res["summary"]
    names = {"direct": "canned engine direct", "nginx": "nginx proxy_pass (floor)", "blazar": "Blazar"}
    rows = [
        f"Relay ceiling (canned engine, {res['events_per_stream']['direct']} events per stream, chunked, "
        f"{res['connections']} streams at a time); pinning: {res['pinning']}; "
        f"{res['seconds_per_run']:.0f} s per run, A B C twice, best of two",
        f"{'target':<26} {'chunks/s':>9} {'kept':>6} {'streams/s':>9} {'p50 stream':>10} {'CPU/chunk':>9} "
        f"{'own CPU':>7} {'core 0':>6} {'core 1':>6} {'errors':>6}",
    ]
    p = res.get("paced")
    lines = [(names[t], s[t], t in GATEWAYS) for t in TARGETS]
    if p:
        lines += [("paced: " + names[t], p["summary"][t], t in GATEWAYS) for t in ("direct", "blazar")]
    for name, x, gateway in lines:
        rows.append(
            f"{name:<26} {x['chunks_per_s']:>9.0f} {x['kept'] if gateway else 1.0:>6.3f} "
            f"{x['streams_per_s']:>9.0f} {x['p50_stream_ms']:>8.1f}ms "
            + (f"{x['cpu_us_per_chunk']:>7.1f}us {100 * x['gateway_cpu_share']:>6.0f}%" if gateway else " " * 17)
            + f" {100 * x['gateway_core_busy']:>5.0f}% {100 * x['load_core_busy']:>5.0f}% {x['errors']:>6}"
        )
    rows.append(
        "(own CPU: the gateway's processes' CPU time over the run's wall time; core 0/1: how busy each core was, "
        "everything on it counted)"
    )
    if p:
        rows.append(
            f"(paced: the engine writes one event of each open stream per {1000 * p['step_s']:g} ms step, "
            f"{p['offered_chunks_per_s']:.0f} chunks/s offered at {res['connections']} streams, as a GPU engine "
            "paces them; Blazar keeps up where its chunks/s matches direct's)"
        )
    failing = [(names[t], s[t]["first_error"]) for t in TARGETS if s[t]["errors"]]
    if p:
        failing += [
            ("paced: " + names[t], p["summary"][t]["first_error"])
            for t in ("direct", "blazar")
            if p["summary"][t]["errors"]
        ]
    if failing:
        rows.append("errors (a run with errors is never the one shown where a run without them exists):")
        rows += [f"  {name}: {e[:300]}" for name, e in failing]
    rows.append("")
    b = s["blazar"]
    top = ceiling(res)
    for name, value, op, limit, unit in (
        ("relay ceiling on one core", top["chunks_per_s"], ">=", CEILING_TARGET, "chunks/s"),
        ("gateway CPU per relayed chunk", top["cpu_us_per_chunk"], "<=", CHUNK_CPU_TARGET, "us"),
    ):
        met = None if value != value else (value >= limit if op == ">=" else value <= limit)
        word = {True: "MET", False: "NOT MET", None: "not measured"}[met]
        rows.append(f"  [{word}] {name}: {value:.1f} (target {op} {limit} {unit})")
    rows.append(f"  (the worse of: {top['readings']})")
    share = b["gateway_cpu_share"]
    if share == share and share < 0.9:
        why = (
            "other processes took the rest of its core (a shared machine)"
            if b["gateway_core_busy"] >= 0.95
            else "the load side, not Blazar, set this pace"
        )
        rows.append(
            f"  (flat out, Blazar used {100 * share:.0f}% of its core: {why}; its chunks/s there is a lower bound)"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit("run it as ./dev.sh bench --only relay")
