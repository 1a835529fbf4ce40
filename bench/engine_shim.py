#!/usr/bin/env python3
"""
The benchmark's engine binary: Blazar starts it as it starts llama-server
(`-m FILE --host H --port P ... --alias NAME ...`). For the models named
`upstream*` it becomes nginx serving canned llama-server replies on that
port (a near-zero-cost OpenAI-shaped upstream); for `relay*`,
bench/relay_engine.py (a canned chunked SSE stream, as fast as the socket
allows: the relay ceiling's engine); for every other model it
becomes the real llama-server ($BENCH_LLAMA_SERVER) with the same argv.
Either way it execs, so the PID Blazar supervises is the server's own.
"""

import json
import os
import sys
import tempfile

CHUNKS = 100  # events in a canned stream


def chunk(alias: str, delta: dict, finish: str | None = None, timings: bool = False) -> str:
    body = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": 1,
        "id": "chatcmpl-bench",
        "model": alias,
        "system_fingerprint": "b0-bench",
        "object": "chat.completion.chunk",
    }
    if timings:
        body["timings"] = {"cache_n": 0, "prompt_n": 9, "prompt_ms": 1.0, "predicted_n": CHUNKS, "predicted_ms": 10.0}
    return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"


def canned(alias: str) -> tuple[str, str]:
    """
    (JSON reply, SSE stream) as llama-server writes them for `alias`.
    """
    reply = json.dumps(
        {
            "choices": [
                {
                    "finish_reason": "length",
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello from the canned upstream."},
                }
            ],
            "created": 1,
            "model": alias,
            "system_fingerprint": "b0-bench",
            "object": "chat.completion",
            "usage": {"completion_tokens": 8, "prompt_tokens": 9, "total_tokens": 17},
            "id": "chatcmpl-bench",
            "timings": {"prompt_n": 9, "prompt_ms": 1.0, "predicted_n": 8, "predicted_ms": 2.0},
        },
        separators=(",", ":"),
    )
    events = [chunk(alias, {"role": "assistant", "content": None})]
    events += [chunk(alias, {"content": f"tok{i} "}) for i in range(CHUNKS - 2)]
    events.append(chunk(alias, {}, "length", timings=True))
    return reply, "".join(events) + "data: [DONE]\n\n"


def main(argv: list[str]) -> None:
    alias = argv[argv.index("--alias") + 1] if "--alias" in argv else ""
    if alias.startswith("relay"):
        # the relay ceiling's canned engine: chunked SSE, as fast as the socket allows
        here = os.path.dirname(os.path.abspath(__file__))
        os.execv(sys.executable, [sys.executable, os.path.join(here, "relay_engine.py"), *argv])
    if not alias.startswith("upstream"):
        engine = os.environ["BENCH_LLAMA_SERVER"]
        os.execv(engine, [engine, *argv])
    port = argv[argv.index("--port") + 1]
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    root = tempfile.mkdtemp(prefix="bench-nginx-")
    reply, stream = canned(alias)
    sse = alias.split(":")[0].endswith("-sse")
    with open(os.path.join(root, "reply"), "w") as f:
        f.write(stream if sse else reply)
    with open(os.path.join(root, "nginx.conf"), "w") as f:
        f.write(f"""
worker_processes 1;
error_log {root}/error.log error;
pid {root}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_buffer_size 64k;
  server {{
    listen {host}:{port} reuseport;
    root {root};
    location = /health {{ default_type application/json; return 200 '{{"status":"ok"}}'; }}
    location = /v1/chat/completions/input_tokens {{ default_type application/json; return 200 '{{"input_tokens":9}}'; }}
    location = /v1/chat/completions {{
      default_type {"text/event-stream" if sse else "application/json"};
      error_page 405 =200 /reply;
      try_files /reply =404;
    }}
    location = /reply {{ default_type {"text/event-stream" if sse else "application/json"}; }}
  }}
}}
""")
    os.execv(
        "/usr/sbin/nginx",
        ["nginx", "-p", root, "-c", os.path.join(root, "nginx.conf"), "-g", "daemon off; master_process off;"],
    )


if __name__ == "__main__":
    main(sys.argv[1:])
