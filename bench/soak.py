#!/usr/bin/env python3
"""
Soak: mixed traffic on every surface for a bounded time, with the engine
child SIGKILLed periodically, against a real daemon and llama-server.

    ./dev.sh soak [--minutes 10] [--clients 8] [--kill-every 60]

Reports requests done, answers by status and error kind, p50/p99 latency,
and the daemon's RSS and open file descriptors at start and end; writes
bench/results/soak-<UTC time>.json. Exits 1 if the daemon returned a 500
of its own, lost a request (no answer at all), or grew its RSS beyond
noise (more than 20 % and 20 MiB between the end of the warm-up and the end).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from run import engine_binary, free_port, machine  # type: ignore[import-not-found]  # noqa: E402

HELLO = [{"role": "user", "content": "hi"}]
REQUESTS = [
    ("openai", "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 16}),
    ("openai", "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 32, "stream": True}),
    ("openai", "/v1/completions", {"model": "tiny", "prompt": "once upon", "max_tokens": 16}),
    ("openai", "/v1/embeddings", {"model": "tiny-embed", "input": ["a", "b"]}),
    ("anthropic", "/v1/messages", {"model": "tiny", "max_tokens": 16, "messages": HELLO}),
    ("anthropic", "/v1/messages", {"model": "tiny", "max_tokens": 32, "messages": HELLO, "stream": True}),
    ("ollama", "/api/chat", {"model": "tiny", "messages": HELLO, "stream": False, "options": {"num_predict": 16}}),
    ("ollama", "/api/generate", {"model": "tiny", "prompt": "hi", "options": {"num_predict": 32}}),
    ("ollama", "/api/embed", {"model": "tiny-embed", "input": "hello"}),
    ("openai", "/v1/chat/completions", {"model": "nope", "messages": HELLO}),  # a 404 now and then
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between SIGKILLs of the chat child")
    args = p.parse_args()
    from blazar.models.testmodel import make_test_model

    with tempfile.TemporaryDirectory(prefix="blazar-soak-") as tmp:
        work = Path(tmp)
        make_test_model(work / "models" / "tiny.gguf")
        make_test_model(work / "models" / "tiny-embed.gguf", seed=1, embedding=True)
        port = free_port()
        config = work / "config.toml"
        config.write_text(
            f'listen = "tcp:{port}:interface=127.0.0.1"\ndata_dir = "{work / "data"}"\n'
            f'models_dir = "{work / "models"}"\nbreaker_crashes = 1000\n'
            f'[engines.llamacpp]\nbinary = "{engine_binary()}"\nargs = ["--threads", "1"]\n'
            '[models."tiny"]\nparallel = 4\n[models."tiny-embed"]\nembedding = true\n'
        )
        log = open(work / "daemon.log", "wb")
        proc = subprocess.Popen([str(Path(sys.executable).parent / "blazar"), "serve", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT)
        daemon = psutil.Process(proc.pid)
        try:
            return soak(args, port, daemon, work)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def soak(args: argparse.Namespace, port: int, daemon: psutil.Process, work: Path) -> int:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("daemon did not start:\n" + (work / "daemon.log").read_text())
        time.sleep(0.1)
    lock = threading.Lock()
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    lost: list[str] = []
    own_500: list[str] = []
    done = [0]
    stop_at = time.monotonic() + args.minutes * 60
    rng = random.Random(3)

    def one(surface: str, path: str, body: Any) -> None:
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            status = resp.status
        except (OSError, http.client.HTTPException) as e:
            with lock:
                lost.append(f"{path}: {e!r}")
            return
        finally:
            conn.close()
        kind = str(status)
        if status == 200 and body.get("stream") is not False and (b'"error"' in data[-600:]):
            kind = "200-stream-error"  # ended with the surface's error (a killed child)
        with lock:
            latencies.append(time.monotonic() - started)
            statuses[kind] = statuses.get(kind, 0) + 1
            done[0] += 1
            if b"internal error (trace id" in data or (status == 500 and surface != "anthropic"):
                own_500.append(f"{path}: {data[:300]!r}")

    def client() -> None:
        while time.monotonic() < stop_at:
            one(*rng.choice(REQUESTS))

    # warm-up, then the baseline
    for request in REQUESTS:
        one(*request)
    time.sleep(3)
    start = {"rss_mib": daemon.memory_info().rss / 2**20, "fds": daemon.num_fds()}
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    kills = 0
    next_kill = time.monotonic() + args.kill_every
    while time.monotonic() < stop_at:
        time.sleep(0.5)
        if time.monotonic() >= next_kill:
            for child in daemon.children(recursive=True):
                try:
                    argv = child.cmdline()
                except psutil.Error:
                    continue
                if "--alias" in argv and argv[argv.index("--alias") + 1] == "tiny:latest":
                    child.send_signal(signal.SIGKILL)
                    kills += 1
            next_kill += args.kill_every
    for t in threads:
        t.join(180)
    time.sleep(3)
    end = {"rss_mib": daemon.memory_info().rss / 2**20, "fds": daemon.num_fds()}
    latencies.sort()
    growth = end["rss_mib"] - start["rss_mib"]
    rss_ok = not (growth > 20 and end["rss_mib"] > 1.2 * start["rss_mib"])
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
        "minutes": args.minutes, "clients": args.clients, "child_kills": kills,
        "requests": done[0], "lost": len(lost), "gateway_500": len(own_500), "answers": statuses,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "start": start, "end": end, "rss_growth_mib": growth, "rss_ok": rss_ok,
        "lost_examples": lost[:5], "gateway_500_examples": own_500[:5],
    }
    out = HERE / "results" / ("soak-" + report["when"].replace(":", "") + ".json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"soak {args.minutes:g} min, {args.clients} clients, {kills} child kills: {done[0]} requests, "
          f"{len(lost)} lost, {len(own_500)} gateway 500s")
    print(f"answers: {json.dumps(statuses, sort_keys=True)}")
    print(f"latency p50 {report['p50_ms']:.1f} ms, p99 {report['p99_ms']:.1f} ms")
    print(f"daemon RSS {start['rss_mib']:.1f} -> {end['rss_mib']:.1f} MiB, fds {start['fds']} -> {end['fds']}")
    print(f"written {out.relative_to(ROOT)}")
    return 0 if not lost and not own_500 and rss_ok and end["fds"] <= start["fds"] + 4 else 1


if __name__ == "__main__":
    sys.exit(main())
