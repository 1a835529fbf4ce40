#!/usr/bin/env python3
"""
What the framework itself costs, beside Blazar, on the real engine: CPU
per non-streamed C{max_tokens: 1} chat completion (user + system, the
process alone) of

  - twisted.web answering a canned reply (no engine): the server's floor;
  - twisted.web + twisted.web.client.Agent as a bare proxy: the floor of
    Blazar's design (its engine client is Agent-based);
  - twisted.web + a hand-written HTTP/1.1 client: what a lean engine
    client could save;
  - Blazar.

    .venv/bin/python bench/floors.py      (or after ./dev.sh bench's setup)

Each gateway on CPU 0; the client loop and the engine on CPU 1; 300
sequential requests per run, three rounds, targets alternating.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as benchrun  # noqa: E402

N = 300


def main() -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    os.sched_setaffinity(0, {benchrun.LOAD_CPU})
    with tempfile.TemporaryDirectory(prefix="blazar-floors-") as tmp:
        bench = benchrun.Bench(5, Path(tmp))
        bench.start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            _, engine_port = bench.child("tiny")
            ports = {name: benchrun.free_port() for name in ("canned", "agent", "raw")}

            def start(script: str, *args: str) -> psutil.Process:
                proc = subprocess.Popen(
                    ["taskset", "-c", str(benchrun.BLAZAR_CPU), sys.executable, str(HERE / "floors" / script), *args]
                )
                procs.append(proc)
                return psutil.Process(proc.pid)

            watch = {
                "twisted.web, canned reply": (ports["canned"], start("canned_server.py", str(ports["canned"]))),
                "twisted.web + Agent proxy": (
                    ports["agent"],
                    start("agent_proxy.py", str(engine_port), bench.engine_key, str(ports["agent"])),
                ),
                "twisted.web + raw client proxy": (
                    ports["raw"],
                    start("raw_proxy.py", str(engine_port), bench.engine_key, str(ports["raw"])),
                ),
                "Blazar": (bench.port, bench.daemon),
            }
            time.sleep(2)
            body = json.dumps({"model": "tiny", "messages": benchrun.HELLO, "max_tokens": 1})

            def loop(port: int, n: int) -> None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                for _ in range(n):
                    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
                    reply = conn.getresponse()
                    reply.read()
                    assert reply.status == 200, (port, reply.status)
                conn.close()

            runs: dict[str, list[float]] = {name: [] for name in watch}
            for port, _ in watch.values():
                loop(port, 30)
            for _ in range(3):
                for name, (port, proc) in watch.items():
                    t0 = proc.cpu_times()
                    loop(port, N)
                    t1 = proc.cpu_times()
                    runs[name].append((t1.user + t1.system - t0.user - t0.system) / N * 1000)
            for name, ms in runs.items():
                print(f"{name:<32} CPU per request: best {min(ms):.2f} ms, runs " + " / ".join(f"{m:.2f}" for m in ms))
        finally:
            for proc in procs:
                proc.kill()
            bench.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
