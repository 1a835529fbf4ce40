"""
A batch shared by two real daemons on one PostgreSQL (C{[cluster]
database}, issue 42), each with its own 1-slot llama-server child on the
generated tiny model: a batch of 30 lines made on node A is worked by A
and B; A is SIGKILLed mid-batch; B takes back A's lines once their lease
ends (failed, never sent again), runs the rest and finalizes the batch
once, every custom_id once in the output and error files, and no line
reached either node's Site twice (their audit logs, by trace id).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from blazar.gateway.batch import LEASE, TEND_EVERY
from blazar.models.testmodel import GeneratedModel
from tests import postgres
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon
from tests.integration.test_batch_e2e import ALICE, MODEL, chat_lines, start_batch

LINES = 30


@pytest.fixture()
def server() -> Iterator[postgres.PostgresServer]:
    made = postgres.server()  # without PostgreSQL: a failure in CI, else a skip that says what to install
    try:
        yield made
    finally:
        made.remove()


def node(root: Path, name: str, database: str, engine: str, models: dict[str, GeneratedModel]) -> Daemon:
    return Daemon(
        root,
        f'audit_log = "{root / "audit.jsonl"}"\nbatch_max_in_flight = 4\n'
        + daemon_config(engine, models)
        + (
            f'[models."{MODEL}"]\npath = "{models["tiny"].path}"\nparallel = 1\n'
            f'[[keys]]\nname = "alice"\nsecret = "{ALICE}"\n'
            f'[cluster]\ndatabase = "{database}"\nnode = "{name}"\n'
        ),
    )


def batch_of(d: Daemon, batch_id: str) -> dict[str, Any]:
    status, _, body = d.request("GET", f"/v1/batches/{batch_id}", headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, body
    batch: dict[str, Any] = json.loads(body)
    return batch


def lines_of(d: Daemon, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    status, _, body = d.request("GET", f"/v1/files/{file_id}/content", headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, body
    return [json.loads(x) for x in body.splitlines()]


def traces(d: Daemon, batch_id: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    path = d.root / "audit.jsonl"
    for raw in path.read_text().splitlines() if path.exists() else []:
        trace = json.loads(raw).get("trace") or ""
        if trace.startswith(batch_id + "."):
            counts[trace] += 1
    return counts


def test_a_node_killed_mid_batch_leaves_it_to_another_each_line_answered_once(
    server: postgres.PostgresServer, engine: str, models: dict[str, GeneratedModel], tmp_path: Path
) -> None:
    database = server.new_database()
    a = node(tmp_path / "a", "node-a", database, engine, models)
    b = node(tmp_path / "b", "node-b", database, engine, models)
    try:
        a.start()
        b.start()
        content = chat_lines(LINES, "shared", max_tokens=48, ignore_eos=True)
        batch_id = start_batch(a, content).id
        deadline = time.monotonic() + 180
        while batch_of(a, batch_id)["request_counts"]["completed"] < 3:
            assert time.monotonic() < deadline, batch_of(a, batch_id)
            time.sleep(0.1)
        assert a.proc is not None
        engines = a.engines()
        a.proc.kill()  # SIGKILL: no drain, its lines in flight stay claimed under its lease
        a.proc.wait()
        for p in engines:
            p.kill()
        deadline = time.monotonic() + LEASE + 3 * TEND_EVERY + 180
        while (done := batch_of(b, batch_id))["status"] not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, done
            time.sleep(0.5)
        assert done["status"] == "completed", done
        output, errors = lines_of(b, done.get("output_file_id")), lines_of(b, done.get("error_file_id"))
        answered = [o["custom_id"] for o in output] + [e["custom_id"] for e in errors]
        assert sorted(answered) == sorted(f"shared-{i}" for i in range(LINES))  # each custom_id once
        assert {e["error"]["code"] for e in errors} <= {"batch_interrupted"}, errors
        assert len(errors) <= 4  # at most A's lines in flight at the kill
        counts = done["request_counts"]
        assert (counts["total"], counts["completed"], counts["failed"]) == (LINES, len(output), len(errors))
        # both nodes ran lines, and none reached a Site twice (A's last audit lines may be lost, never doubled)
        on_a, on_b = traces(a, batch_id), traces(b, batch_id)
        assert on_a and on_b, (on_a, on_b)
        assert max((on_a + on_b).values()) == 1
        assert "picked up from another node" in b.log()
    finally:
        if b.proc is not None:
            b.close()
        a.kill_everything()
