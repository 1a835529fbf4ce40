"""
A stand-in for llama-server that is busy, not wedged: a chat request whose
last message says C{"hold"} gets no answer until its client (the gateway)
closes the connection, and while it runs C{/health} gets no answer either
(a child saturated by one long generation). Once the held request's
connection is closed, C{/health} answers 200 again; any other chat request
gets a one-word reply. Used as [engines.llamacpp] binary by the
cancelled-health-probe test.
"""

import json
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

idle = threading.Event()
idle.set()


def peer_gone(conn: socket.socket) -> bool:
    readable, _, _ = select.select([conn], [], [], 0.05)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def answer(self, status: int, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the asker left

    def do_GET(self) -> None:
        if self.path == "/health":
            idle.wait()  # busy: no answer until the held request is gone
            self.answer(200, b'{"status":"ok"}')
        else:
            self.answer(404, b'{"error":{"code":404,"message":"not here"}}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
        if body["messages"][-1]["content"] == "hold":
            idle.clear()
            try:
                while not peer_gone(self.connection):
                    time.sleep(0.05)
            finally:
                idle.set()
            self.close_connection = True
            return
        self.answer(
            200,
            json.dumps(
                {
                    "choices": [
                        {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "done"}}
                    ],
                    "created": 1,
                    "model": "tiny",
                    "object": "chat.completion",
                    "usage": {"completion_tokens": 1, "prompt_tokens": 1, "total_tokens": 2},
                }
            ).encode(),
        )


def main() -> None:
    argv = sys.argv
    port = int(argv[argv.index("--port") + 1])
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
