"""
A local stand-in for a Hugging Face hub, enough for /api/pull: the
recursive tree listing with LFS sha256s, and resolve downloads with Range.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeHub:
    """
    Serves C{repos}: C{{"user/repo": {"file.gguf": bytes}}}.

    @ivar break_after: If set, the next download sends this many bytes of
        the body and then drops the connection (once).
    @ivar corrupt: Serve flipped bytes (the listing keeps the true sha256).
    @ivar extra: Bytes sent after a file's own (the listing keeps its size).
    @ivar cut: If set, a download sends only this many bytes, and says so
        in its C{Content-Length} (a clean end, short of the listed size).
    @ivar ranges: The Range headers the downloads asked for.
    """

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.break_after: int | None = None
        self.corrupt = False
        self.extra = b""
        self.cut: int | None = None
        self.ranges: list[str | None] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        if path.startswith("/api/models/") and path.endswith("/tree/main"):
            repo = path[len("/api/models/") : -len("/tree/main")]
            files = self.repos.get(repo)
            if files is None:
                return self._send(h, 404, b'{"error":"Repository not found"}')
            listing = [
                {
                    "type": "file",
                    "path": name,
                    "size": len(data),
                    "oid": "0" * 40,
                    "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134},
                }
                for name, data in files.items()
            ] + [{"type": "file", "path": "README.md", "size": 5, "oid": "1" * 40}]
            return self._send(h, 200, json.dumps(listing).encode())
        for repo, files in self.repos.items():
            prefix = f"/{repo}/resolve/main/"
            if path.startswith(prefix) and path[len(prefix) :] in files:
                data = files[path[len(prefix) :]]
                if self.corrupt:
                    data = bytes(b ^ 0xFF for b in data)
                rng = h.headers.get("Range")
                self.ranges.append(rng)
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                body = data[start:] + self.extra
                if self.cut is not None:
                    body = body[: self.cut]
                h.send_response(206 if rng else 200)
                h.send_header("Content-Length", str(len(body)))
                if rng:
                    h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                h.end_headers()
                if self.break_after is not None:
                    cut, self.break_after = self.break_after, None
                    h.wfile.write(body[:cut])
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(2)
                    return
                h.wfile.write(body)
                return
        self._send(h, 404, b"not found")

    def _send(self, h: BaseHTTPRequestHandler, code: int, body: bytes) -> None:
        h.send_response(code)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Content-Type", "application/json")
        h.end_headers()
        h.wfile.write(body)
