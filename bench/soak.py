#!/usr/bin/env python3
"""
Soak: mixed traffic on every surface for a bounded time, with the engine
child SIGKILLed periodically, against a real daemon and llama-server.

    ./dev.sh soak [--minutes 10] [--clients 8] [--kill-every 60] [--attack-every 20]

Every --attack-every seconds one of the hardening regressions of issue 36
runs in the middle of it, in turn: H1, a forced tool call whose schema
nests a 30-entry type list 4 deep (it froze the daemon for 44 s); H2,
20,000 tools, a forced tool of 20,000 properties and 50,000 messages (8 GB
of child memory, a SIGSEGV, 129 s of child CPU); H3, a DNS-rebound Host
and a cross-site text/plain POST (open on a keyless gateway). Each must
get its answer (H1 within 10 s, H2 a 400 within 1 s, H3 a 403), the chat
child must not grow by 100 MB over an H2 body, and /health, asked every
50 ms throughout, must answer within a second while an attack runs.

Reports requests done, answers by status and error kind, p50/p99 latency,
the attacks' outcomes, and the daemon's RSS and open file descriptors at
start and end; writes bench/results/soak-<UTC time>.json. Exits 1 if the
daemon returned a 500 of its own, lost a request (no answer at all), grew
its RSS beyond noise (more than 20 % and 20 MiB between the end of the
warm-up and the end), or an attack got another answer than it must.
"""

from __future__ import annotations

import argparse
import http.client
import json
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


def nested(depth: int, kinds: list[str]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": kinds, "properties": {"a": schema}}
    return schema


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
# (name, Host header or None for the daemon's own, extra headers, body, wanted status, seconds allowed)
ATTACKS: list[tuple[str, str | None, dict[str, str], dict[str, Any], int, float]] = [
    (
        "H1 nested type lists",
        None,
        {},
        {
            "model": "tiny",
            "messages": HELLO,
            "max_tokens": 32,
            "tools": [{"type": "function", "function": {"name": "emit", "parameters": nested(4, ["object"] * 30)}}],
            "tool_choice": {"type": "function", "function": {"name": "emit"}},
        },
        200,
        10.0,
    ),
    (
        "H2 20k tools",
        None,
        {},
        {
            "model": "tiny",
            "messages": HELLO,
            "max_tokens": 8,
            "tools": [
                {"type": "function", "function": {"name": f"t{i}", "parameters": WEATHER}} for i in range(20_000)
            ],
        },
        400,
        1.0,
    ),
    (
        "H2 20k properties",
        None,
        {},
        {
            "model": "tiny",
            "messages": HELLO,
            "max_tokens": 8,
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "wide",
                        "parameters": {
                            "type": "object",
                            "properties": {f"p{i}": {"type": "string"} for i in range(20_000)},
                        },
                    },
                }
            ],
        },
        400,
        1.0,
    ),
    ("H2 50k messages", None, {}, {"model": "tiny", "max_tokens": 8, "messages": HELLO * 50_000}, 400, 1.0),
    ("H3 rebound Host", "rebind.attacker.example", {}, {"model": "tiny", "messages": HELLO, "max_tokens": 2}, 403, 1.0),
    (
        "H3 cross-site POST",
        None,
        {"Origin": "https://evil.example"},
        {"model": "tiny", "messages": HELLO, "max_tokens": 2},
        403,
        1.0,
    ),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between SIGKILLs of the chat child")
    p.add_argument("--attack-every", type=float, default=20.0, help="seconds between the issue-36 regressions")
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
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "blazar"), "serve", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
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

    health: list[tuple[float, float]] = []  # (asked at, seconds to answer)
    attacks: list[dict[str, Any]] = []

    def prober() -> None:
        while time.monotonic() < stop_at:
            began = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
                health.append((began, time.monotonic() - began))
            except (OSError, http.client.HTTPException):
                health.append((began, 60.0))
            finally:
                conn.close()
            time.sleep(0.05)

    def chat_child_rss() -> tuple[int, int] | None:
        for child in daemon.children(recursive=True):
            try:
                argv = child.cmdline()
                if "--alias" in argv and argv[argv.index("--alias") + 1] == "tiny:latest":
                    return child.pid, child.memory_info().rss
            except psutil.Error:
                continue
        return None

    def attacker() -> None:
        turn = 0
        while time.monotonic() + args.attack_every < stop_at:
            time.sleep(args.attack_every)
            name, host, extra, body, wanted, allowed = ATTACKS[turn % len(ATTACKS)]
            turn += 1
            before = chat_child_rss()
            headers = {
                "content-type": "text/plain" if name.startswith("H3") else "application/json",
                "Host": host or f"127.0.0.1:{port}",
                **extra,
            }
            began = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            try:
                conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
                response = conn.getresponse()
                status, data = response.status, response.read()
            except (OSError, http.client.HTTPException) as e:
                status, data = 0, repr(e).encode()
            finally:
                conn.close()
            ended = time.monotonic()
            after = chat_child_rss()
            grew = after[1] - before[1] if before and after and before[0] == after[0] else None
            # a client's status for a killed child is no fault of the attack's: only H1 can meet one
            ok = (
                (status == wanted or (name.startswith("H1") and 400 <= status < 600 and status != 500))
                and ended - began <= allowed
                and (grew is None or grew < 100 << 20)
            )
            attacks.append(
                {
                    "name": name,
                    "status": status,
                    "seconds": round(ended - began, 3),
                    "began": began,
                    "ended": ended,
                    "child_rss_growth_mib": None if grew is None else grew / 2**20,
                    "ok": ok,
                    "answer": data[:200].decode("utf-8", "replace"),
                }
            )

    # warm-up, then the baseline
    for request in REQUESTS:
        one(*request)
    time.sleep(3)
    start = {"rss_mib": daemon.memory_info().rss / 2**20, "fds": daemon.num_fds()}
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    threads += [threading.Thread(target=prober), threading.Thread(target=attacker)]
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
    for attack in attacks:  # /health while it ran (asked up to 50 ms before it began)
        during = [took for asked, took in health if attack["began"] - 0.05 <= asked <= attack["ended"]]
        attack["health_max_ms"] = round(1000 * max(during), 1) if during else None
        if during and max(during) > 1.0:
            attack["ok"] = False
        del attack["began"], attack["ended"]
    attacks_ok = all(a["ok"] for a in attacks)
    growth = end["rss_mib"] - start["rss_mib"]
    rss_ok = not (growth > 20 and end["rss_mib"] > 1.2 * start["rss_mib"])
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "minutes": args.minutes,
        "clients": args.clients,
        "child_kills": kills,
        "requests": done[0],
        "lost": len(lost),
        "gateway_500": len(own_500),
        "answers": statuses,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "start": start,
        "end": end,
        "rss_growth_mib": growth,
        "rss_ok": rss_ok,
        "lost_examples": lost[:5],
        "gateway_500_examples": own_500[:5],
        "health_p99_ms": round(1000 * sorted(t for _, t in health)[int(0.99 * (len(health) - 1))], 1)
        if health
        else None,
        "attacks": attacks,
        "attacks_ok": attacks_ok,
    }
    out = HERE / "results" / ("soak-" + report["when"].replace(":", "") + ".json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"soak {args.minutes:g} min, {args.clients} clients, {kills} child kills: {done[0]} requests, "
        f"{len(lost)} lost, {len(own_500)} gateway 500s"
    )
    print(f"answers: {json.dumps(statuses, sort_keys=True)}")
    print(f"latency p50 {report['p50_ms']:.1f} ms, p99 {report['p99_ms']:.1f} ms")
    print(f"daemon RSS {start['rss_mib']:.1f} -> {end['rss_mib']:.1f} MiB, fds {start['fds']} -> {end['fds']}")
    for attack in attacks:
        print(
            f"  {attack['name']}: {attack['status']} in {attack['seconds']:.2f} s, /health at most "
            f"{attack['health_max_ms']} ms, child +{attack['child_rss_growth_mib'] or 0:.0f} MiB"
            f"{'' if attack['ok'] else '  <- FAILED'}"
        )
    print(f"written {out.relative_to(ROOT)}")
    return 0 if not lost and not own_500 and rss_ok and end["fds"] <= start["fds"] + 4 and attacks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
