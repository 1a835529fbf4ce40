"""
Blazar's main job, end to end: generate a tiny test model, start the daemon
(`blazar serve`) on it, send one chat completion and one streaming chat
completion through the OpenAI API, print both, and stop the daemon.

Run it with `./dev.sh demo` (which sets everything up first).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited early with code {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("daemon did not answer /health within 30 s")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", help="llama-server binary (default: search as the daemon does)")
    args = p.parse_args()

    from blazar.models.testmodel import make_test_model

    with tempfile.TemporaryDirectory(prefix="blazar-demo-") as tmp:
        root = Path(tmp)
        model = make_test_model(root / "models" / "blazar-test.gguf")
        port = free_port()
        config = root / "config.toml"
        lines = [
            f'listen = "tcp:{port}:interface=127.0.0.1"',
            f'data_dir = "{root / "data"}"',
            f'models_dir = "{root / "models"}"',
        ]
        if args.engine:
            lines += ["[engines.llamacpp]", f'binary = "{args.engine}"']
        config.write_text("\n".join(lines) + "\n")
        print(f"== model: {model.path} ({model.path.stat().st_size} bytes, random weights)")
        print(f"== starting: blazar serve --config {config}  (port {port})")
        log_path = root / "daemon.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "blazar.cli", "serve", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            wait_healthy(port, proc)
            request = {
                "model": "blazar-test",
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 24,
                "seed": 1,
            }
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            t0 = time.monotonic()
            conn.request("POST", "/v1/chat/completions", json.dumps(request),
                         {"content-type": "application/json"})
            resp = conn.getresponse()
            body = resp.read()
            print(f"\n== POST /v1/chat/completions -> {resp.status} "
                  f"({time.monotonic() - t0:.2f} s, includes starting llama-server)")
            print(json.dumps(json.loads(body), indent=2, ensure_ascii=False))
            if resp.status != 200:
                raise SystemExit(1)

            request["stream"] = True
            request["stream_options"] = {"include_usage": True}
            conn.request("POST", "/v1/chat/completions", json.dumps(request),
                         {"content-type": "application/json"})
            resp = conn.getresponse()
            print(f"\n== POST /v1/chat/completions (stream) -> {resp.status} "
                  f"{resp.getheader('content-type')}")
            done = False
            for raw in resp:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if line:
                    print(line)
                if line == "data: [DONE]":
                    done = True
            if resp.status != 200 or not done:
                raise SystemExit(1)
        except BaseException:
            print("\n== daemon log:\n" + log_path.read_text(errors="replace"), file=sys.stderr)
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
            how = "clean stop on SIGTERM" if code in (0, -signal.SIGTERM) else f"exit code {code}"
            print(f"\n== daemon stopped ({how})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
