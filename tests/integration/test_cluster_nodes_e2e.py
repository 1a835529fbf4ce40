"""
The cluster's nodes (issue 42): two real daemons on one real PostgreSQL
(C{[cluster] database}), node B serving SmolLM2-135M-Instruct (a real
llama-server child, loaded by one chat request). C{blazar cluster --json}
run against node A lists both nodes with their URLs (A's made from its
listener, B's its C{[cluster] url}), up, and B's loaded model with its
queue; the dashboard's C{GET /ui/api/nodes} on A says the same; once B
stops cleanly, A shows it stopped with nothing loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from blazar.gateway.nodes import HEARTBEAT_SECS
from tests import postgres
from tests.integration.harness import Daemon, real_model

SMOL = "smollm:latest"


@pytest.fixture()
def server() -> Iterator[postgres.PostgresServer]:
    made = postgres.server()  # without PostgreSQL: a failure in CI, else a skip that says what to install
    try:
        yield made
    finally:
        made.remove()


def node(root: Path, name: str, database: str, engine: str, extra: str = "") -> Daemon:
    models = root / "models"
    models.mkdir(parents=True)
    (models / "smollm.gguf").symlink_to(real_model())
    return Daemon(
        root,
        f'models_dir = "{models}"\nready_timeout = 60\n'
        f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        '[models."smollm"]\nparallel = 1\nctx_size = 2048\n'
        f'[cluster]\ndatabase = "{database}"\nnode = "{name}"\n{extra}',
    )


def cluster(d: Daemon, *flags: str) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "blazar"), "cluster", *flags, "-c", str(d.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def nodes_of(listing: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in listing["nodes"]}


def wait_for(d: Daemon, check: Any, what: str, timeout: float = 4 * HEARTBEAT_SECS) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        listing: dict[str, Any] = json.loads(cluster(d, "--json"))
        if check(nodes_of(listing)):
            return listing
        assert time.monotonic() < deadline, (what, listing)
        time.sleep(0.5)


def test_blazar_cluster_lists_both_nodes_and_bs_model_then_b_stopped(
    server: postgres.PostgresServer, engine: str, tmp_path: Path
) -> None:
    database = server.new_database()
    a = node(tmp_path / "a", "node-a", database, engine)
    b_url = "http://node-b.example:8080"
    b = node(tmp_path / "b", "node-b", database, engine, f'url = "{b_url}"\n')
    try:
        a.start()
        b.start()
        status, _, body = b.request(
            "POST",
            "/v1/chat/completions",
            {"model": "smollm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        )
        assert status == 200, body

        def b_serves_smol(nodes: dict[str, dict[str, Any]]) -> bool:
            return "node-b" in nodes and any(
                m["model"] == SMOL and m["state"] == "ready" for m in nodes["node-b"]["models"]
            )

        listing = wait_for(a, b_serves_smol, "node B's heartbeat with SmolLM2 loaded")
        assert (listing["clustered"], listing["node"]) == (True, "node-a")
        seen = nodes_of(listing)
        assert sorted(seen) == ["node-a", "node-b"]
        assert seen["node-a"]["url"] == f"http://127.0.0.1:{a.port}"
        assert seen["node-b"]["url"] == b_url
        assert (seen["node-a"]["this"], seen["node-b"]["this"]) == (True, False)
        assert {n["state"] for n in seen.values()} == {"up"}
        assert seen["node-a"]["models"] == []  # A loaded nothing
        (smol,) = seen["node-b"]["models"]
        assert smol == {"model": SMOL, "state": "ready", "slots": 1, "busy": 0, "waiting": 0, "running": 0}, smol

        # the dashboard's data on A: the same nodes
        status, _, raw = a.request("GET", "/ui/api/nodes")
        assert status == 200, raw
        ui = nodes_of(json.loads(raw))
        assert sorted(ui) == ["node-a", "node-b"]
        for name in ui:
            for field in ("url", "state", "this", "version", "started"):
                assert ui[name][field] == seen[name][field], (name, field, ui[name], seen[name])
        assert ui["node-b"]["models"] == [smol]

        # the table a person reads
        text = cluster(a)
        assert "node-a *" in text and "node-b" in text and b_url in text, text
        assert SMOL in text and "[cluster] database" not in text, text

        # B stopped cleanly: A shows it stopped, with nothing loaded, at once
        b.close()
        stopped = nodes_of(json.loads(cluster(a, "--json")))
        assert stopped["node-b"]["state"] == "stopped", stopped["node-b"]
        assert stopped["node-b"]["models"] == []
        assert stopped["node-a"]["state"] == "up"
        status, _, raw = a.request("GET", "/ui/api/nodes")
        assert status == 200 and nodes_of(json.loads(raw))["node-b"]["state"] == "stopped", raw
    finally:
        if b.proc is not None and b.proc.poll() is None:
            b.kill_everything()
        a.close(check_engines=True)
