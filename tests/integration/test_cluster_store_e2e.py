"""
Two real daemons on one PostgreSQL (C{[cluster] database}, issue 42):
what one stores through the Files API the other lists, serves and
deletes; while PostgreSQL is stopped both answer 503 naming it, and once
it is started again they serve without a restart. The server is a real
one in a temp dir (L{tests.postgres}); no engine is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from blazar.httpbody import multipart_body
from tests import postgres
from tests.integration.harness import Daemon


@pytest.fixture()
def server() -> Iterator[postgres.PostgresServer]:
    made = postgres.server()  # without PostgreSQL: a failure in CI, else a skip that says what to install
    try:
        yield made
    finally:
        made.remove()


def upload(node: Daemon, content: bytes) -> dict[str, object]:
    raw, content_type = multipart_body({"purpose": "batch"}, [("file", "in.jsonl", "application/jsonl", content)])
    status, _, body = node.request("POST", "/v1/files", raw=raw, headers={"content-type": content_type})
    assert status == 200, body
    made: dict[str, object] = json.loads(body)
    return made


def test_two_nodes_share_files_and_ride_out_an_outage(server: postgres.PostgresServer, tmp_path: Path) -> None:
    config = f'[cluster]\ndatabase = "{server.new_database()}"\n'
    a, b = Daemon(tmp_path / "a", config), Daemon(tmp_path / "b", config)
    try:
        a.start()
        b.start()
        content = b'{"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' * 30_000
        made = upload(a, content)  # about 2.4 MB: three pieces
        status, _, listed = b.request("GET", "/v1/files")
        assert (status, [f["id"] for f in json.loads(listed)["data"]]) == (200, [made["id"]])
        status, _, got = b.request("GET", f"/v1/files/{made['id']}/content")
        assert (status, len(got), got == content) == (200, len(content), True)
        assert not (tmp_path / "a" / "data" / "files").exists()  # nothing on node A's disk
        assert b.request("DELETE", f"/v1/files/{made['id']}")[0] == 200
        assert a.request("GET", f"/v1/files/{made['id']}")[0] == 404

        server.stop()
        for node in (a, b):
            status, headers, body = node.request("GET", "/v1/files")
            error = json.loads(body)["error"]
            assert (status, error["code"], headers.get("retry-after")) == (503, "store_unavailable", "5"), body
            assert f"PostgreSQL at 127.0.0.1:{server.port} is unreachable" in error["message"]
        server.start()
        again = upload(b, b"{}\n")
        status, _, got = a.request("GET", f"/v1/files/{again['id']}/content")
        assert (status, got) == (200, b"{}\n")
    finally:
        for node in (a, b):
            if node.proc is not None:
                node.close()


def test_a_node_whose_database_is_down_exits_naming_it(tmp_path: Path) -> None:
    """
    A node that cannot reach its database at start stops (non-zero, the
    server named in its log), never a half-started process holding its
    port (found by a README trial: the store's thread kept it alive).
    """
    from subprocess import TimeoutExpired

    from tests.servers import free_port

    port = free_port()
    d = Daemon(tmp_path / "down", f'[cluster]\ndatabase = "postgresql://blazar@127.0.0.1:{port}/blazar"\n')
    d.start(wait=False)
    assert d.proc is not None
    try:
        code = d.proc.wait(timeout=60)
    except TimeoutExpired:
        d.kill_everything()
        raise AssertionError(f"the daemon did not exit:\n{d.log()[-2000:]}") from None
    assert code != 0
    assert f"PostgreSQL at 127.0.0.1:{port} is unreachable" in d.log()
