"""
The CLI's HTTP verbs (C{blazar run}, C{models pull}, C{bench}) on a
gateway that refuses the request's key: the message says how this CLI
sends one (C{--key}, C{$BLAZAR_API_KEY}), not only how an HTTP client does.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from blazar.cli.daemon import ERROR, post_ndjson


class Refusing(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"error": "missing API key: send it as `Authorization: Bearer <key>`"}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def port() -> Iterator[int]:
    server = http.server.HTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.mark.parametrize(
    ("key", "hint"),
    [(None, "this command sends the key given with --key or in $BLAZAR_API_KEY"), ("blz-x", "was refused")],
)
def test_a_refused_key_names_how_the_cli_sends_one(
    port: int, key: str | None, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = f"http://127.0.0.1:{port}"
    assert post_ndjson("127.0.0.1", port, base, "/api/chat", {}, 5.0, key=key) == ERROR
    err = capsys.readouterr().err
    assert "missing API key" in err and hint in err, err
