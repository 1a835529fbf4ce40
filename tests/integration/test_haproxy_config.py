"""
The HAProxy config Blazar ships (C{contrib/haproxy/blazar.cfg}), run by a
real HAProxy (L{tests.haproxyserver}) in front of three small stand-in
nodes that answer with their own name: which request goes where. The
same config in front of real Blazar nodes is
C{test_cluster_haproxy_e2e.py}; this one is fast and pins the rules:

  - a session is C{x-blazar-session}, else C{x-session-id}, else the JSON
    body's C{prompt_cache_key}; its requests all go to one node;
  - an empty header or a body that is not JSON names no session;
  - requests with no session are spread over every node;
  - a node that is down is taken out (its sessions move, the others stay
    where they were) and brought back when it answers again.
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time
from typing import Any, Iterator

import pytest

from tests import haproxyserver


class Node(http.server.BaseHTTPRequestHandler):
    """
    Answers C{/health} with 200 and any POST with its server's name.
    """

    protocol_version = "HTTP/1.1"

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(b'{"status":"ok"}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._answer(self.server.name.encode())  # type: ignore[attr-defined]

    def log_message(self, *args: Any) -> None:
        pass


class Quiet(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # HAProxy ends its health checks with a reset: nothing to report


class Nodes:
    def __init__(self) -> None:
        self.servers: dict[str, Quiet] = {}
        self.ports: dict[str, int] = {}

    def start(self, name: str, port: int = 0) -> None:
        server = Quiet(("127.0.0.1", port), Node)
        server.name = name  # type: ignore[attr-defined]
        self.servers[name] = server
        self.ports[name] = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop(self, name: str) -> None:
        server = self.servers.pop(name)
        server.shutdown()
        server.server_close()


@pytest.fixture()
def balanced() -> Iterator[tuple[Nodes, haproxyserver.HAProxy]]:
    nodes = Nodes()
    for name in haproxyserver.NODES:
        nodes.start(name)
    proxy = haproxyserver.server(dict(nodes.ports))
    try:
        yield nodes, proxy
    finally:
        proxy.remove()
        for name in list(nodes.servers):
            nodes.stop(name)


def post(proxy: haproxyserver.HAProxy, body: bytes, headers: dict[str, str] | None = None) -> str:
    """
    The name of the node that answered C{body}.
    """
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read().decode()
        assert resp.status == 200, (resp.status, data, proxy.log()[-2000:])
        assert resp.getheader("x-blazar-node") == data  # the header the config adds names it
        return data
    finally:
        conn.close()


def chat(**more: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **more}).encode()


def where(proxy: haproxyserver.HAProxy, times: int, body: bytes, headers: dict[str, str] | None = None) -> set[str]:
    return {post(proxy, body, headers) for _ in range(times)}


def test_the_shipped_config_checks() -> None:
    path = haproxyserver.binary()
    if path is None:
        raise haproxyserver.missing()
    nodes = {name: f"127.0.0.1:{port}" for port, name in enumerate(haproxyserver.NODES, 40001)}
    checked = haproxyserver.check(path, "127.0.0.1:40000", nodes)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_session_goes_to_one_node_whichever_way_it_is_named(
    balanced: tuple[Nodes, haproxyserver.HAProxy],
) -> None:
    _, proxy = balanced
    sessions = [f"s-{i}" for i in range(12)]
    homes = {}
    for s in sessions:
        (homes[s],) = where(proxy, 4, chat(), {"x-blazar-session": s})
        # the same value under the other names goes to the same node (one hash of the value)
        assert where(proxy, 4, chat(), {"x-session-id": s}) == {homes[s]}
        assert where(proxy, 4, chat(prompt_cache_key=s)) == {homes[s]}
    assert set(homes.values()) == set(haproxyserver.NODES), homes  # sessions are spread over the nodes
    # the first name found wins: x-blazar-session, then x-session-id, then prompt_cache_key
    one, other = next((a, b) for a in sessions for b in sessions if homes[a] != homes[b])
    assert where(proxy, 3, chat(prompt_cache_key=other), {"x-blazar-session": one}) == {homes[one]}
    assert where(proxy, 3, chat(prompt_cache_key=other), {"x-session-id": one}) == {homes[one]}
    assert where(proxy, 3, chat(), {"x-blazar-session": one, "x-session-id": other}) == {homes[one]}


def test_no_session_is_spread_over_every_node(balanced: tuple[Nodes, haproxyserver.HAProxy]) -> None:
    _, proxy = balanced
    assert where(proxy, 9, chat()) == set(haproxyserver.NODES)
    assert where(proxy, 9, chat(), {"x-blazar-session": ""}) == set(haproxyserver.NODES)  # empty: none
    assert where(proxy, 9, b'{"prompt_cache_key": ') == set(haproxyserver.NODES)  # not JSON: none


def test_a_node_down_moves_only_its_sessions_and_gets_them_back(
    balanced: tuple[Nodes, haproxyserver.HAProxy],
) -> None:
    nodes, proxy = balanced
    sessions = [f"s-{i}" for i in range(24)]
    homes = {s: post(proxy, chat(), {"x-blazar-session": s}) for s in sessions}
    port = nodes.ports["b"]
    nodes.stop("b")
    # answered at once by another node (redispatch), and b is taken out after its failed checks
    deadline = time.monotonic() + 20
    while "blazar_nodes/b is DOWN" not in proxy.log():
        assert time.monotonic() < deadline, proxy.log()[-3000:]
        assert post(proxy, chat(), {"x-blazar-session": sessions[0]}) in ("a", "c")
        time.sleep(0.2)
    moved = {s: post(proxy, chat(), {"x-blazar-session": s}) for s in sessions}
    assert "b" not in moved.values()
    assert {s: n for s, n in moved.items() if homes[s] != "b"} == {s: n for s, n in homes.items() if n != "b"}
    nodes.start("b", port)
    deadline = time.monotonic() + 20
    while {s: post(proxy, chat(), {"x-blazar-session": s}) for s in sessions} != homes:
        assert time.monotonic() < deadline, proxy.log()[-3000:]
        time.sleep(0.5)
