"""
A real distribution server for the library pull/push tests: Debian's
C{docker-registry} (the reference implementation of the Docker Registry
HTTP API v2) run as a plain process on loopback with a temporary config, a
seeding helper that uploads Ollama-format models to it over the API, and a
small proxy in front of it that counts the blob bytes it serves, and can
slow them, corrupt one, or redirect blob reads to a "CDN" path.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from blazar.models import ollama_store as store
from tests.integration.harness import free_port


def registry_binary() -> str:
    """
    Debian's docker-registry ($BLAZAR_DOCKER_REGISTRY, else on PATH).
    Missing is a failure, never a skip: ./dev.sh test installs it.
    """
    found = os.environ.get("BLAZAR_DOCKER_REGISTRY") or shutil.which("docker-registry")
    if not found:
        pytest.fail(
            "the library pull e2e needs Debian's docker-registry (sudo apt-get install -y docker-registry; "
            "./dev.sh test installs it as root)"
        )
    return found


class DistributionRegistry:
    """
    C{docker-registry serve} on 127.0.0.1, storing under C{root}.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        config = root / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n"
        )
        self.log = open(root / "registry.log", "ab")
        self.proc = subprocess.Popen(
            [registry_binary(), "serve", str(config)], stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if request(self.url, "GET", "/v2/")[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"docker-registry did not start:\n{(root / 'registry.log').read_text()}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def request(
    base: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """
    One HTTP request to C{base} (C{http://host:port}); C{path} may be an
    absolute URL on the same server.
    """
    split = urlsplit(path)
    if split.netloc:
        path = split.path + (f"?{split.query}" if split.query else "")
    conn = http.client.HTTPConnection(urlsplit(base).netloc, timeout=60)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def seed(base: str, repository: str, tag: str, layers: list[tuple[str, bytes]]) -> bytes:
    """
    Upload an Ollama-format model to the registry at C{base} as a client of
    the API would (each blob: C{POST .../blobs/uploads/}, C{PUT ?digest=};
    then the manifest): C{layers} as (media type, bytes), plus a config blob.

    @return: The manifest's bytes (their sha256 is the model's digest).
    """
    config = json.dumps(
        {
            "model_format": "gguf",
            "model_family": "llama",
            "model_families": ["llama"],
            "architecture": "amd64",
            "os": "linux",
        }
    ).encode()
    descriptors = []
    for media, data in [*layers, (store.MEDIA_CONFIG, config)]:
        status, headers, body = request(base, "POST", f"/v2/{repository}/blobs/uploads/")
        assert status == 202, (status, body)
        location = headers["location"]
        location += ("&" if "?" in location else "?") + f"digest={digest_of(data)}"
        status, _, body = request(base, "PUT", location, data, {"content-type": "application/octet-stream"})
        assert status == 201, (status, body)
        descriptors.append(store.layer(media, digest_of(data), len(data)))
    raw = store.manifest_bytes(store.make_manifest(descriptors[-1], descriptors[:-1]))
    status, _, body = request(
        base, "PUT", f"/v2/{repository}/manifests/{tag}", raw, {"content-type": store.MEDIA_MANIFEST}
    )
    assert status == 201, (status, body)
    return raw


class BlobProxy:
    """
    An HTTP proxy in front of C{target} that forwards everything, and for
    blob reads counts the bytes it sends (C{served}, by digest) and, when
    asked, sends them at C{rate} bytes a second, flips a byte of those in
    C{corrupt}, or answers with a 307 to C{/cdn/...} (served from the same
    blob) when C{redirect} is set.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self.served: dict[str, int] = {}
        self.rate: float | None = None
        self.corrupt: set[str] = set()
        self.redirect = False
        self.redirected = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy.forward(self)

            do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path
        length = int(handler.headers.get("content-length") or 0)
        body = handler.rfile.read(length) if length else None
        parts = path.split("/")
        digest = parts[-1] if "/blobs/sha256:" in path and handler.command == "GET" else None
        if path.startswith("/cdn/"):  # /cdn/<ns>/<model>/<digest>: the redirect's target
            path = f"/v2/{parts[2]}/{parts[3]}/blobs/{parts[4]}"
            digest = parts[4]
        elif digest is not None and self.redirect:
            with self.lock:
                self.redirected += 1
            handler.send_response(307)
            handler.send_header("location", f"/cdn/{parts[2]}/{parts[3]}/{digest}")
            handler.send_header("content-length", "0")
            handler.end_headers()
            return
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("connection", "content-length")}
        conn = http.client.HTTPConnection(urlsplit(self.target).netloc, timeout=120)
        try:
            conn.request(handler.command, path, body, headers)
            resp = conn.getresponse()
            handler.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("connection", "transfer-encoding"):
                    handler.send_header(k, v)
            data = resp.read()
            if "content-length" not in {k.lower() for k, _ in resp.getheaders()}:
                handler.send_header("content-length", str(len(data)))
            handler.end_headers()
            if handler.command == "HEAD":
                return
            if digest is not None and digest in self.corrupt and data:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            step = 64 * 1024
            for i in range(0, len(data), step):
                chunk = data[i : i + step]
                handler.wfile.write(chunk)
                if digest is not None:
                    with self.lock:
                        self.served[digest] = self.served.get(digest, 0) + len(chunk)
                    if self.rate:
                        time.sleep(len(chunk) / self.rate)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
