"""
Two real daemons sharing one Redis (C{[cluster] redis}, issue 42): a key
with C{rpm = N}, sent requests by 32 clients at once spread over both
nodes, gets exactly N answers 200 in all and 429 for the rest; while Redis
is stopped both nodes answer 503 naming it, and once it is started again
they serve without a restart. The server is a real one in a temp dir
(L{tests.redisserver}); no engine is needed (the Files API's routes count
toward C{rpm} through the same script as a chat's).
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from tests import redisserver
from tests.integration.harness import Daemon

RPM = 23
ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789ab"


@pytest.fixture()
def server() -> Iterator[redisserver.RedisServer]:
    made = redisserver.server()  # without redis-server: a failure in CI, else a skip that says what to install
    try:
        yield made
    finally:
        made.remove()


def config(url: str) -> str:
    return (
        f'[cluster]\nredis = "{url}"\n\n'
        f'[[keys]]\nname = "alice"\nsecret = "{ALICE}"\nrpm = {RPM}\n\n'
        f'[[keys]]\nname = "bob"\nsecret = "{BOB}"\nrpm = 10000\nmax_concurrent = 8\n'
    )


def test_two_nodes_share_exact_limits_and_ride_out_an_outage(server: redisserver.RedisServer, tmp_path: Path) -> None:
    text = config(server.url(0))
    a, b = Daemon(tmp_path / "a", text), Daemon(tmp_path / "b", text)
    try:
        a.start()
        b.start()
        nodes = (a, b)

        def ask(i: int) -> int:
            return nodes[i % 2].request("GET", "/v1/files", headers={"authorization": f"Bearer {ALICE}"})[0]

        with ThreadPoolExecutor(32) as pool:
            statuses = Counter(pool.map(ask, range(3 * RPM)))
        assert statuses == Counter({200: RPM, 429: 2 * RPM}), statuses

        server.stop()
        for node in nodes:
            status, headers, body = node.request("GET", "/v1/files", headers={"authorization": f"Bearer {BOB}"})
            error = json.loads(body)["error"]
            assert (status, error["code"], headers.get("retry-after")) == (503, "store_unavailable", "5"), body
            assert f"Redis at 127.0.0.1:{server.port} is unreachable" in error["message"]
        server.start()
        for node in nodes:
            status, _, body = node.request("GET", "/v1/files", headers={"authorization": f"Bearer {BOB}"})
            assert status == 200, body
    finally:
        for node in (a, b):
            if node.proc is not None:
                node.close()
