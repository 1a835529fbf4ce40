"""
The real-engine table: four targets in front of the same llama-server child.

    ./dev.sh bench --only real

Blazar's daemon loads the model `tiny` (the generated test model, 64 slots,
`--threads 1`); its llama-server child is the engine of all four targets:

  - direct: the child itself, with its per-child API key;
  - nginx: a `proxy_pass` hop (keep-alive upstream, no buffering, no access
    log), the floor of what any proxy hop costs;
  - Blazar: the daemon that supervises the child;
  - LiteLLM: its proxy (`litellm --num_workers 1`, no database), installed
    once into a venv of its own under ~/.cache/blazar/bench/litellm.

Requests alternate between the targets (A B C D, twice), each figure the
better of its two runs. The gateways (nginx, Blazar, LiteLLM) run on CPU 0;
wrk, the TTFB client and the engine on CPU 1. A gateway's CPU is its own
processes' user + system time (all their threads), never their children's:
for Blazar that is the daemon alone, not the llama-server it runs.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from run import best_run, ratio

if TYPE_CHECKING:
    from run import Bench

GATEWAY_CPU, LOAD_CPU = 0, 1
HELLO = [{"role": "user", "content": "hi"}]
TOKENS = 64
LITELLM_VENV = Path.home() / ".cache" / "blazar" / "bench" / "litellm"
TARGETS = ("direct", "nginx", "blazar", "litellm")
GATEWAYS = ("nginx", "blazar", "litellm")

# the targets, measured in this run (issue 41, "Targets"); the relay
# ceiling's figure comes from the relay scenario (bench/relay.py), when run
REAL_TARGETS: dict[str, tuple[str, str, float, str]] = {
    # name: (Blazar's summary key, comparison, limit, unit)
    "gateway CPU per non-streamed request (c=1)": ("cpu_ms_per_request", "<=", 0.8, "ms"),
    "gateway CPU per relayed chunk (64-token stream, c=1, its per-stream part spread over the chunks)": (
        "cpu_us_per_chunk",
        "<=",
        30,
        "us",
    ),
    "gateway CPU per relayed chunk, per-chunk part only": ("cpu_us_per_chunk_marginal", "<=", 30, "us"),
    "relay ceiling on one core (canned engine, 64 streams; --only relay)": (
        "relay_chunks_per_s",
        ">=",
        30000,
        "chunks/s",
    ),
    "throughput at c=8, ratio to direct": ("kept_c8", ">=", 0.90, ""),
    "added p50 at c=1 over direct": ("added_p50_ms", "<=", 0.5, "ms"),
    "added TTFB over direct": ("added_ttfb_ms", "<=", 0.5, "ms"),
    "requests per CPU-second (c=8), ratio to LiteLLM's": ("per_core_vs_litellm", ">=", 40, "x"),
}


def verdicts(summary: dict[str, Any], relay_chunks_per_s: float | None = None) -> dict[str, dict[str, Any]]:
    """
    Each target met or not, with Blazar's figure; C{met} is C{None} where
    this run did not measure it (the relay ceiling without the relay
    scenario) or could not (NaN: a target that answered nothing).
    """
    figures = {**summary["blazar"], "relay_chunks_per_s": relay_chunks_per_s}
    out = {}
    for name, (key, op, limit, unit) in REAL_TARGETS.items():
        value = figures.get(key)
        if value is None or value != value:
            met = None
        else:
            met = value <= limit if op == "<=" else value >= limit
        out[name] = {"value": value, "limit": f"{op} {limit:g} {unit}".strip(), "met": met}
    return out


def verdict_lines(targets: dict[str, dict[str, Any]]) -> list[str]:
    """
    C{[MET] name: figure (target ...)} per target.
    """
    rows = []
    for name, v in targets.items():
        word = {True: "MET", False: "NOT MET", None: "not measured"}[v["met"]]
        figure = "-" if v["value"] is None else f"{v['value']:.3f}"
        rows.append(f"  [{word}] {name}: {figure} (target {v['limit']})")
    return rows


class ProcessGroupCPU:
    """
    User + system CPU seconds of a fixed set of processes (their threads
    included, their children not), shaped like C{psutil.Process.cpu_times}
    for L{run.wrk}.
    """

    def __init__(self, processes: list[psutil.Process]) -> None:
        self.processes = processes

    def cpu_times(self) -> tuple[float, float]:
        user = system = 0.0
        for p in self.processes:
            t = p.cpu_times()
            user += t.user
            system += t.system
        return user, system


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    host, _, rest = url.removeprefix("http://").partition("/")
    h, _, p = host.partition(":")
    while True:
        try:
            conn = http.client.HTTPConnection(h, int(p), timeout=5)
            conn.request("GET", "/" + rest)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"{url} did not come up:\n" + log.read_text(errors="replace")[-4000:])
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the two other gateways -----------------------------------------------------


def start_nginx(
    work: Path, port: int, engine_port: int, key: str, name: str = "nginx-hop"
) -> tuple[subprocess.Popen[bytes], ProcessGroupCPU]:
    root = work / name
    root.mkdir()
    (root / "nginx.conf").write_text(f"""
worker_processes 1;
daemon off;
error_log {root}/error.log error;
pid {root}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {root}/body;
  proxy_temp_path {root}/proxy;
  fastcgi_temp_path {root}/fastcgi;
  uwsgi_temp_path {root}/uwsgi;
  scgi_temp_path {root}/scgi;
  keepalive_requests 1000000;
  upstream engine {{ server 127.0.0.1:{engine_port}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Authorization "Bearer {key}";
      proxy_buffering off;
      proxy_read_timeout 60s;
      # llama-server closes a kept-alive connection after each stream: retry a
      # POST on a fresh one, as Blazar does
      proxy_next_upstream error timeout non_idempotent;
    }}
  }}
}}
""")
    log = root / "stderr.log"
    proc = subprocess.Popen(
        [
            "taskset",
            "-c",
            str(GATEWAY_CPU),
            "nginx",
            "-p",
            str(root),
            "-c",
            str(root / "nginx.conf"),
            "-e",
            str(root / "error.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),
    )
    wait_ready(f"http://127.0.0.1:{port}/health", proc, log, 15)
    master = psutil.Process(proc.pid)
    return proc, ProcessGroupCPU([master, *master.children(recursive=True)])


def litellm_install() -> tuple[Path, str]:
    """
    LiteLLM's proxy in a venv of its own (pip from PyPI, once); its binary
    and version.
    """
    binary = LITELLM_VENV / "bin" / "litellm"
    if not binary.exists():
        print("[bench] installing LiteLLM's proxy into " + str(LITELLM_VENV), file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True)
    version = subprocess.run(
        [str(LITELLM_VENV / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return binary, version


def start_litellm(work: Path, port: int, engine_port: int, key: str) -> tuple[subprocess.Popen[bytes], ProcessGroupCPU]:
    binary, _ = litellm_install()
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: tiny\n"
        "    litellm_params:\n"
        "      model: openai/tiny\n"
        f"      api_base: http://127.0.0.1:{engine_port}/v1\n"
        f"      api_key: {key}\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "LITELLM_MASTER_KEY")}
    env.update(
        {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
            "NO_DOCS": "True",
            # no keys, like the bench's Blazar daemon (its keys are off)
            "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
        }
    )
    log = work / "litellm.log"
    proc = subprocess.Popen(
        [
            "taskset",
            "-c",
            str(GATEWAY_CPU),
            str(binary),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    wait_ready(f"http://127.0.0.1:{port}/health/liveliness", proc, log, 180)
    # the process that holds the listening socket (uvicorn with one worker
    # serves in-process; a forking server would serve from a child)
    top = psutil.Process(proc.pid)
    serving = [
        p
        for p in [top, *top.children(recursive=True)]
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp"))
    ]
    return proc, ProcessGroupCPU(serving or [top])


# -- measurements -----------------------------------------------------------------


def events(port: int, body: dict[str, Any], key: str) -> int:
    """
    The SSE data events (not counting [DONE]) of one stream.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {key}"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"port {port}: {resp.status} {resp.read()[:2000]!r}")
        return sum(1 for line in resp if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"))
    finally:
        conn.close()


def first_event(port: int, body: bytes, key: str) -> float:
    """
    Seconds from sending a streamed request (one write, on a new connection
    with TCP_NODELAY) to the first byte of its first SSE event; the rest of
    the stream is read before the connection closes.
    """
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        s.sendall(head + body)
        seen = b""
        while b"data: " not in seen:
            more = s.recv(65536)
            if not more:
                raise SystemExit(f"port {port}: no event in {seen[:2000]!r}")
            seen += more
        elapsed = time.perf_counter() - started
        while b"[DONE]" not in seen[-64:]:
            more = s.recv(65536)
            if not more:
                break
            seen = seen[-64:] + more
        return elapsed


def erase_slots(port: int, key: str, slots: int = 64) -> None:
    """
    Empty the engine's slots (its KV cache): llama.cpp attends over the cache
    up to its highest used cell, so after 64 streams every later decode is
    ~5x slower (TTFB 7 -> 34 ms); each run starts from the same empty cache.
    Needs the engine's --slot-save-path.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for i in range(slots):
            conn.request("POST", f"/slots/{i}?action=erase", b"", {"authorization": f"Bearer {key}"})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise SystemExit(f"erasing slot {i}: {resp.status} {body[:500]!r}")
    finally:
        conn.close()


def settle(processes: list[psutil.Process], seconds: float = 5.0) -> None:
    """
    Wait until the engine and the gateways are idle (under 5 % of a core
    over 0.25 s): wrk stops with requests in flight, and the engine goes on
    generating them for a while; the next target must not pay for that.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = sum(sum(p.cpu_times()[:2]) for p in processes)
        time.sleep(0.25)
        if sum(sum(p.cpu_times()[:2]) for p in processes) - before < 0.0125:
            return
    print(f"[bench] still busy after {seconds:.0f} s; going on", file=sys.stderr)


def real_engine(bench: Bench, wrk: Any, lua_post: Any) -> None:
    """
    The four targets on the same llama-server child, alternating; results
    into C{bench.results["real_engine"]}.
    """
    engine_pid, engine_port = bench.child("tiny")
    key = bench.engine_key
    engine = psutil.Process(engine_pid)
    ports = {"direct": engine_port, "nginx": free_port(), "blazar": bench.port, "litellm": free_port()}
    _, litellm_version = litellm_install()
    procs: list[subprocess.Popen[bytes]] = []
    watch: dict[str, Any] = {"direct": None, "blazar": bench.daemon}
    try:
        proc, watch["nginx"] = start_nginx(bench.work, ports["nginx"], engine_port, key)
        procs.append(proc)
        proc, watch["litellm"] = start_litellm(bench.work, ports["litellm"], engine_port, key)
        procs.append(proc)
        busy = [engine, bench.daemon, *watch["nginx"].processes, *watch["litellm"].processes]
        url = {t: f"http://127.0.0.1:{p}/v1/chat/completions" for t, p in ports.items()}
        chat = {"model": "tiny", "messages": HELLO, "max_tokens": 1}
        stream = {
            "model": "tiny",
            "messages": HELLO,
            "stream": True,
            "max_tokens": TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }  # greedy: the same events in every stream
        short = {**stream, "max_tokens": 1}
        auth = {"Authorization": f"Bearer {key}"}
        scripts = {
            "chat": lua_post(bench.work / "real-chat.lua", chat, auth),
            "stream": lua_post(bench.work / "real-stream.lua", stream, auth),
            "short": lua_post(bench.work / "real-short.lua", short, auth),
        }
        # warm every target up (LiteLLM's first request imports and builds a lot)
        warmup_errors: dict[str, str] = {}
        for t in TARGETS:
            for _ in range(5):
                tried(warmup_errors, t, events, ports[t], short, key)
        erase_slots(engine_port, key)
        chunks = {t: tried(warmup_errors, t, events, ports[t], stream, key) for t in TARGETS}
        short_chunks = {t: tried(warmup_errors, t, events, ports[t], short, key) for t in TARGETS}
        if chunks["direct"] is None or short_chunks["direct"] is None:
            raise SystemExit(f"the engine direct failed: {warmup_errors['direct']}")

        def rotate(kind: str, c: int) -> dict[str, dict[str, Any]]:
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
            for _ in range(2):
                for t in TARGETS:
                    erase_slots(engine_port, key)
                    engine0 = sum(engine.cpu_times()[:2])
                    # a c = 64 request takes up to ~2 s: longer runs, so that the
                    # requests cut off at the end weigh little
                    seconds = bench.seconds * (3 if c == 64 else 1)
                    r = wrk(url[t], scripts[kind], c, seconds, watch[t], closes_after_stream=kind != "chat")
                    r["engine_cpu_s"] = sum(engine.cpu_times()[:2]) - engine0
                    runs[t].append(r)
                    settle(busy)
            out = {}
            for t, rs in runs.items():
                best = best_run(rs)
                best["cpu_ms_per_request"] = ratio(1000 * best["cpu_s"], best["requests"])
                best["all_rps"] = [r["rps"] for r in rs]
                out[t] = best
            return out

        res: dict[str, Any] = {
            "warmup_errors": warmup_errors,
            "litellm_version": litellm_version,
            "engine_port": engine_port,
            "engine_threads": 1,
            "chunks_per_stream": chunks,
            "chunks_per_short_stream": short_chunks,
            "pinning": f"nginx, Blazar's daemon, LiteLLM on CPU {GATEWAY_CPU}; "
            f"wrk, the TTFB client and llama-server (--threads 1) on CPU {LOAD_CPU}",
            "seconds_per_run": bench.seconds,
        }
        res["load_average_before"] = os.getloadavg()  # the machine is shared: how busy it was
        res["chat"] = {str(c): rotate("chat", c) for c in (1, 8, 64)}
        res["stream"] = {str(c): rotate("stream", c) for c in (1, 16, 64)}
        res["short_stream"] = {"1": rotate("short", 1)}
        erase_slots(engine_port, key)
        res["gateway_processes"] = {
            t: [f"{p.pid} {p.name()}" for p in watch[t].processes] for t in ("nginx", "litellm")
        }
        res["gateway_processes"]["blazar"] = [f"{bench.daemon.pid} {bench.daemon.name()}"]
        res["ttfb_errors"] = {}
        res["ttfb_ms"] = ttfb(ports, key, 30 if bench.seconds < 5 else 100, res["ttfb_errors"])
        res["load_average_after"] = os.getloadavg()
        res["summary"] = summarize(res)
        res["targets"] = verdicts(res["summary"])  # the relay ceiling's: added by run.py where measured
        bench.results["real_engine"] = res
    finally:
        for proc in procs:
            stop(proc)
        erase_slots(engine_port, key)  # the scenarios after this one start from an empty cache
        # nginx logs each retry after llama-server closed a kept-alive
        # connection; anything else is worth showing
        err = bench.work / "nginx-hop" / "error.log"
        other = [
            line
            for line in (err.read_text().splitlines() if err.exists() else [])
            if "upstream prematurely closed connection" not in line
        ]
        if other:
            print("[bench] nginx hop's error log:\n" + "\n".join(other[-20:]), file=sys.stderr)


def tried(errors: dict[str, str], target: str, f: Any, *args: Any) -> Any:
    """
    C{f(*args)}, or C{None} with C{target}'s first error recorded in
    C{errors}: one target failing is shown in its row, not a reason to stop.
    """
    try:
        return f(*args)
    except (SystemExit, OSError, http.client.HTTPException) as e:
        errors.setdefault(target, f"{type(e).__name__}: {str(e)[:300]}")
        return None


def ttfb(ports: dict[str, int], key: str, rounds: int, errors: dict[str, str] | None = None) -> dict[str, float]:
    """
    Median time to the first SSE event, c = 1, a new connection each time,
    targets alternating; the client pinned with wrk. A failed attempt is
    recorded in C{errors} (per target, the first), its sample left out.
    """
    errors = {} if errors is None else errors
    body = json.dumps({"model": "tiny", "messages": HELLO, "stream": True, "max_tokens": 4, "temperature": 0}).encode()
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {LOAD_CPU})
    try:
        samples: dict[str, list[float]] = {t: [] for t in TARGETS}
        for _ in range(rounds):
            for t in TARGETS:
                sample = tried(errors, t, first_event, ports[t], body, key)
                if sample is not None:
                    samples[t].append(sample)
                time.sleep(0.005)
    finally:
        os.sched_setaffinity(0, mine)
    return {t: 1000 * statistics.median(s) if s else float("nan") for t, s in samples.items()}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """
    Per target: the table's figures and the ratios to direct.
    """
    out: dict[str, Any] = {}
    n_long, n_short = res["chunks_per_stream"]["direct"], res["chunks_per_short_stream"]["direct"]
    for t in TARGETS:
        c1, c8, c64 = (res["chat"][c][t] for c in ("1", "8", "64"))
        s = {c: res["stream"][c][t] for c in ("1", "16", "64")}
        row: dict[str, Any] = {
            "p50_c1_ms": c1["p50_ms"],
            "rps_c1": c1["rps"],
            "rps_c8": c8["rps"],
            "rps_c64": c64["rps"],
            "p50_c8_ms": c8["p50_ms"],
            "p50_c64_ms": c64["p50_ms"],
            "chunks_per_s": {c: x["rps"] * n_long for c, x in s.items()},
            "ttfb_ms": res["ttfb_ms"][t],
        }
        d = res["chat"]
        row["kept_c1"] = ratio(c1["rps"], d["1"]["direct"]["rps"])
        row["kept_c8"] = ratio(c8["rps"], d["8"]["direct"]["rps"])
        row["kept_c64"] = ratio(c64["rps"], d["64"]["direct"]["rps"])
        row["kept_stream"] = {c: ratio(s[c]["rps"], res["stream"][c]["direct"]["rps"]) for c in s}
        row["errors"] = errors_of(res, t)
        row["added_p50_ms"] = c1["p50_ms"] - d["1"]["direct"]["p50_ms"]
        row["added_ttfb_ms"] = res["ttfb_ms"][t] - res["ttfb_ms"]["direct"]
        if t in GATEWAYS:
            row["cpu_ms_per_request"] = c1["cpu_ms_per_request"]
            row["cpu_ms_per_request_c8"] = c8["cpu_ms_per_request"]
            row["cpu_ms_per_request_c64"] = c64["cpu_ms_per_request"]
            row["requests_per_cpu_s_c8"] = ratio(1000, c8["cpu_ms_per_request"])
            long = s["1"]["cpu_ms_per_request"]
            shrt = res["short_stream"]["1"][t]["cpu_ms_per_request"]
            # CPU per stream = per-stream part + chunks x per-chunk part, from a
            # 64-token and a 1-token stream at c = 1
            per_chunk = (long - shrt) / (n_long - n_short)
            row["cpu_us_per_chunk"] = 1000 * long / n_long
            row["cpu_us_per_chunk_marginal"] = 1000 * per_chunk
            row["cpu_ms_per_stream_fixed"] = shrt - per_chunk * n_short
            row["cpu_us_per_chunk_c16"] = 1000 * s["16"]["cpu_ms_per_request"] / n_long
            row["cpu_us_per_chunk_c64"] = 1000 * s["64"]["cpu_ms_per_request"] / n_long
        out[t] = row
    for t in GATEWAYS:
        out[t]["per_core_vs_litellm"] = ratio(out[t]["requests_per_cpu_s_c8"], out["litellm"]["requests_per_cpu_s_c8"])
    return out


def errors_of(res: dict[str, Any], target: str) -> dict[str, Any]:
    """
    C{target}'s errors in this run: their count over all its wrk runs, and
    per measurement (C{"chat c=64"}) how many and the first; warm-up and
    TTFB failures too.
    """
    where: dict[str, str] = {}
    count = 0
    for kind in ("chat", "stream", "short_stream"):
        for c, by_target in res.get(kind, {}).items():
            x = by_target.get(target, {})
            if x.get("errors_all_runs"):
                count += x["errors_all_runs"]
                where[f"{kind} c={c}"] = (
                    f"{x['errors_all_runs']} in {x['runs_with_errors']} of 2 runs; {x['first_error_all_runs']}"
                )
    for kind in ("warmup_errors", "ttfb_errors"):
        if target in res.get(kind, {}):
            count += 1
            where[kind.removesuffix("_errors")] = res[kind][target]
    return {"count": count, "where": where}


def real_table(res: dict[str, Any]) -> str:
    s = res["summary"]
    names = {
        "direct": "llama-server direct",
        "nginx": "nginx proxy_pass (floor)",
        "blazar": "Blazar",
        "litellm": f"LiteLLM {res['litellm_version']}, 1 worker",
    }
    rows = [
        f"Real engine (generated test model, llama-server --threads 1, 64 slots); pinning: {res['pinning']}; "
        f"{res['seconds_per_run']:.0f} s per run, A B C D twice, best of two; "
        f"{res['chunks_per_stream']['direct']} events per {TOKENS}-token stream",
        f"{'target':<30} {'p50 c=1':>8} {'req/s c=1':>9} {'c=8':>6} {'c=64':>6} {'kept c=8':>8} "
        f"{'chunks/s c=1':>12} {'c=16':>6} {'c=64':>6} {'TTFB':>7} {'CPU/req':>8} {'CPU/chunk':>9} "
        f"{'(stream+chunk)':>16} {'req/CPU-s':>9} {'errors':>6}",
    ]
    for t in TARGETS:
        x = s[t]
        ch = x["chunks_per_s"]
        line = (
            f"{names[t]:<30} {x['p50_c1_ms']:>6.2f}ms {x['rps_c1']:>9.0f} {x['rps_c8']:>6.0f} "
            f"{x['rps_c64']:>6.0f} {x['kept_c8']:>8.3f} {ch['1']:>12.0f} {ch['16']:>6.0f} {ch['64']:>6.0f} "
            f"{x['ttfb_ms']:>5.2f}ms"
        )
        if t in GATEWAYS:
            line += (
                f" {x['cpu_ms_per_request']:>6.2f}ms {x['cpu_us_per_chunk']:>7.0f}us "
                f"{x['cpu_ms_per_stream_fixed']:>6.2f}ms+{x['cpu_us_per_chunk_marginal']:>4.0f}us "
                f"{x['requests_per_cpu_s_c8']:>9.0f}"
            )
        else:
            line += " " * 44
        rows.append(line + f" {x['errors']['count']:>6}")
    rows.append("")
    rows.append("ratios to direct (kept = target's req/s or chunks/s over direct's; added = over direct's):")
    for t in GATEWAYS:
        x = s[t]
        rows.append(
            f"  {names[t]:<30} kept c=1/8/64 {x['kept_c1']:.3f}/{x['kept_c8']:.3f}/{x['kept_c64']:.3f}; "
            f"streams c=1/16/64 {x['kept_stream']['1']:.3f}/{x['kept_stream']['16']:.3f}/"
            f"{x['kept_stream']['64']:.3f}; added p50 {x['added_p50_ms']:+.2f} ms, "
            f"TTFB {x['added_ttfb_ms']:+.2f} ms; req per CPU-s {x['per_core_vs_litellm']:.1f}x LiteLLM's"
        )
    failing = [(t, w, e) for t in TARGETS for w, e in s[t]["errors"]["where"].items()]
    if failing:
        rows.append("")
        rows.append("errors (a run with errors is never the one shown where a run without them exists):")
        rows += [f"  {names[t]}, {w}: {e[:300]}" for t, w, e in failing]
    rows.append("")
    rows += verdict_lines(res["targets"])
    return "\n".join(rows)
