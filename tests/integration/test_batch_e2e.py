"""
The Batch API end to end, on one daemon with a real 1-slot llama-server
child (a generated tiny model): the official openai SDK uploads a JSONL
file, creates a batch, polls it to completed and reads its output; batch
lines wait behind an interactive request (seen in /api/queue); a restart
mid-batch finishes it with each line sent once (counted in the audit log,
which has one line per request the Site answered, batch lines included,
by trace id); cancel stops a batch; another key's retrieve is 404;
embeddings lines work; the upload limit is OpenAI's 200 MB.
"""

from __future__ import annotations

import http.client
import json
import os
import stat
import threading
import time
from collections import Counter
from typing import Any, Iterator, Literal

import openai
import pytest

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789abc"
MODEL = "one-slot"
CANONICAL = "one-slot:latest"


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("batch")
    d = Daemon(
        root,
        f'audit_log = "{root / "audit.jsonl"}"\nbatch_max_in_flight = 4\n'
        + daemon_config(engine, models)
        + (
            f'[models."{MODEL}"]\npath = "{models["tiny"].path}"\nparallel = 1\n'
            f'[[keys]]\nname = "alice"\nsecret = "{ALICE}"\n'
            f'[[keys]]\nname = "bob"\nsecret = "{BOB}"\n'
        ),
    )
    d.start()
    try:
        yield d
    finally:
        d.close()


def client(d: Daemon, secret: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key=secret, max_retries=0, timeout=120)


def chat_lines(n: int, prefix: str, **body: Any) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"say {i}"}],
                    "max_tokens": 8,
                    **body,
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


Endpoint = Literal["/v1/chat/completions", "/v1/responses", "/v1/embeddings"]


def start_batch(d: Daemon, content: bytes, endpoint: Endpoint = "/v1/chat/completions") -> Any:
    c = client(d)
    uploaded = c.files.create(file=("input.jsonl", content), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.bytes) == ("file", "batch", len(content))
    return c.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def wait_batch(d: Daemon, batch_id: str, until: Any, timeout: float = 180.0) -> Any:
    c = client(d)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = c.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} never got there: {batch}")


def output_of(d: Daemon, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(x) for x in client(d).files.content(file_id).content.splitlines()]


def audit_traces(d: Daemon, batch_id: str) -> Counter[str]:
    """
    How many requests the Site answered per line of C{batch_id} (its
    trace ids are C{<batch id>.<line>}).
    """
    counts: Counter[str] = Counter()
    path = d.root / "audit.jsonl"
    for raw in path.read_text().splitlines() if path.exists() else []:
        trace = json.loads(raw).get("trace") or ""
        if trace.startswith(batch_id + "."):
            counts[trace] += 1
    return counts


def queue_of(d: Daemon) -> dict[str, Any]:
    status, _, body = d.request("GET", "/api/queue", headers={"authorization": f"Bearer {ALICE}"})
    assert status == 200, body
    for model in json.loads(body)["models"]:
        if model["model"] == CANONICAL:
            return model
    return {"waiting": {"total": 0, "by_priority": {}}, "requests": [], "running": []}


def wait_for(predicate: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out waiting")


def test_sdk_batch_of_50_completes_and_belongs_to_its_key(daemon: Daemon) -> None:
    batch = start_batch(daemon, chat_lines(50, "req"))
    assert batch.status == "in_progress" and batch.request_counts is not None
    assert batch.request_counts.total == 50
    done = wait_batch(daemon, batch.id, lambda b: b.status in ("completed", "failed", "expired"))
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (50, 0), done
    assert done.error_file_id is None and done.completed_at and done.finalizing_at
    output = output_of(daemon, done.output_file_id)
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(50)]
    for o in output:
        assert o["error"] is None and o["id"].startswith("batch_req_")
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    # each line went through the Site once, at batch priority
    counts = audit_traces(daemon, batch.id)
    assert sorted(counts) == sorted(f"{batch.id}.{i}" for i in range(50)) and set(counts.values()) == {1}
    rows = [json.loads(x) for x in (daemon.root / "audit.jsonl").read_text().splitlines()]
    mine = [r for r in rows if (r.get("trace") or "").startswith(batch.id + ".")]
    assert {(r["key"], r["path"], r["status"]) for r in mine} == {("alice", "/v1/chat/completions", 200)}
    # another key: the batch and its files do not exist
    other = client(daemon, BOB)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)
    assert batch.id not in [b.id for b in other.batches.list()]
    assert batch.id in [b.id for b in client(daemon).batches.list(limit=100)]
    listed = {f.id: f for f in client(daemon).files.list()}
    assert listed[done.output_file_id].purpose == "batch_output"


def test_an_interactive_request_goes_ahead_of_waiting_batch_lines(daemon: Daemon) -> None:
    batch = start_batch(daemon, chat_lines(12, "slow", max_tokens=400, ignore_eos=True))
    # one line runs on the only slot, the others of batch_max_in_flight wait
    wait_for(lambda: queue_of(daemon)["waiting"]["by_priority"].get("batch", 0) >= 3)
    outcome: dict[str, Any] = {}

    def interactive() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
        try:
            outcome["sent"] = time.monotonic()
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(
                    {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1500,
                        "ignore_eos": True,
                        "stream": True,
                    }
                ),
                {
                    "content-type": "application/json",
                    "authorization": f"Bearer {ALICE}",
                    "x-blazar-trace-id": "interactive-request",
                },
            )
            resp = conn.getresponse()
            outcome["status"], outcome["queue_ms"] = resp.status, resp.getheader("x-blazar-queue-ms")
            outcome["done"] = b"data: [DONE]" in resp.read()
        finally:
            conn.close()

    thread = threading.Thread(target=interactive)
    thread.start()

    def seen_waiting() -> dict[str, Any] | None:
        model = queue_of(daemon)
        return model if "interactive-request" in {r["trace_id"] for r in model["requests"]} else None

    snapshot = wait_for(seen_waiting)
    rows = snapshot["requests"]
    assert rows[0]["trace_id"] == "interactive-request" and rows[0]["priority"] == "normal", rows
    behind = {r["trace_id"] for r in rows[1:]}
    assert len(behind) >= 3 and all(t.startswith(batch.id + ".") for t in behind), rows
    assert all(r["priority"] == "batch" for r in rows[1:]), rows

    def running_now() -> dict[str, Any] | None:
        model = queue_of(daemon)
        return model if "interactive-request" in {r["trace_id"] for r in model["running"]} else None

    # when it got the slot, every batch line that waited with it still waits
    running = wait_for(running_now)
    assert behind <= {r["trace_id"] for r in running["requests"]}, (behind, running)
    thread.join(120)
    assert outcome["status"] == 200 and outcome["done"], outcome
    assert outcome["queue_ms"] is not None and int(outcome["queue_ms"]) < 5000, outcome
    # the rest of the batch is not needed: cancel it (running lines finish, pending ones never start)
    cancelling = client(daemon).batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_batch(daemon, batch.id, lambda b: b.status == "cancelled")
    assert done.cancelled_at and done.request_counts.completed < 12, done
    settled = audit_traces(daemon, batch.id)
    time.sleep(1.5)
    assert audit_traces(daemon, batch.id) == settled  # nothing ran after it was cancelled
    assert sum(settled.values()) == done.request_counts.completed + done.request_counts.failed
    assert len(output_of(daemon, done.output_file_id)) == done.request_counts.completed


def test_a_restart_mid_batch_finishes_it_with_each_line_sent_once(daemon: Daemon) -> None:
    batch = start_batch(daemon, chat_lines(50, "again", max_tokens=48, ignore_eos=True))
    wait_batch(daemon, batch.id, lambda b: b.request_counts.completed >= 5)
    assert daemon.stop() in (0, -15), daemon.log()[-3000:]
    daemon.kill_everything()
    stopped = audit_traces(daemon, batch.id)
    assert 5 <= sum(stopped.values()) < 50, stopped
    daemon.start()
    done = wait_batch(daemon, batch.id, lambda b: b.status in ("completed", "failed", "expired"))
    assert done.status == "completed", done
    counts = audit_traces(daemon, batch.id)
    # every line reached the Site exactly once, over both daemons: none was sent again
    assert sorted(counts) == sorted(f"{batch.id}.{i}" for i in range(50)), counts
    assert set(counts.values()) == {1}, counts
    # the stop waited for the lines in flight, so none was cut short
    assert (done.request_counts.completed, done.request_counts.failed) == (50, 0), done
    assert [o["custom_id"] for o in output_of(daemon, done.output_file_id)] == [f"again-{i}" for i in range(50)]
    assert "resumed (in_progress)" in daemon.log()


def test_a_daemon_killed_mid_batch_never_sends_a_line_twice(daemon: Daemon) -> None:
    """
    SIGKILL (no drain): the lines in flight then are failed at the next
    start with batch_interrupted, never sent again; the rest complete.
    """
    batch = start_batch(daemon, chat_lines(30, "killed", max_tokens=48, ignore_eos=True))
    wait_batch(daemon, batch.id, lambda b: b.request_counts.completed >= 3)
    engines = daemon.engines()
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait()
    for p in engines:
        p.kill()
    daemon.start()
    done = wait_batch(daemon, batch.id, lambda b: b.status in ("completed", "failed", "expired"))
    assert done.status == "completed", done
    counts = done.request_counts
    assert counts.completed + counts.failed == 30 and counts.completed >= 3, done
    completed = [o["custom_id"] for o in output_of(daemon, done.output_file_id)]
    errors = output_of(daemon, done.error_file_id) if counts.failed else []
    # what was in flight at the kill (the runner keeps batch_max_in_flight = 4 going): failed
    assert 1 <= len(errors) <= 4 and {e["error"]["code"] for e in errors} <= {"batch_interrupted"}, errors
    assert sorted(completed + [e["custom_id"] for e in errors]) == sorted(f"killed-{i}" for i in range(30))
    # no line reached the Site twice (the killed daemon's last audit lines may be lost, never doubled)
    assert max(audit_traces(daemon, batch.id).values()) == 1
    assert "were in flight at the last stop and are failed" in daemon.log()


def test_responses_lines(daemon: Daemon) -> None:
    content = b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/responses",
                "body": {"model": MODEL, "input": f"say {i}", "max_output_tokens": 8},
            }
        ).encode()
        + b"\n"
        for i in range(3)
    )
    batch = start_batch(daemon, content, "/v1/responses")
    done = wait_batch(daemon, batch.id, lambda b: b.status in ("completed", "failed"))
    assert done.status == "completed" and done.request_counts.completed == 3, done
    for o in output_of(daemon, done.output_file_id):
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "response"


def test_embeddings_lines(daemon: Daemon) -> None:
    content = b"".join(
        json.dumps(
            {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "tiny-embed", "input": f"text {i}"},
            }
        ).encode()
        + b"\n"
        for i in range(5)
    )
    batch = start_batch(daemon, content, "/v1/embeddings")
    done = wait_batch(daemon, batch.id, lambda b: b.status in ("completed", "failed"))
    assert done.status == "completed" and done.request_counts.completed == 5, done
    for o in output_of(daemon, done.output_file_id):
        assert o["response"]["status_code"] == 200
        assert len(o["response"]["body"]["data"][0]["embedding"]) > 0


def test_bad_lines_fail_the_batch_with_openais_errors(daemon: Daemon) -> None:
    content = chat_lines(2, "dup") + chat_lines(1, "dup")
    batch = start_batch(daemon, content)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data
    assert (batch.errors.data[0].code, batch.errors.data[0].line) == ("duplicate_custom_id", 3)


def test_the_private_listener_and_the_upload_limit(daemon: Daemon) -> None:
    sock = daemon.root / "data" / "run" / "batch.sock"
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    # the batch headers mean nothing on a public listener
    status, _, body = daemon.request(
        "GET", "/v1/batches", headers={"x-blazar-batch-secret": "guess", "x-blazar-batch-key": "alice"}
    )
    assert status == 401, body
    # an upload over 200 MB is refused at its headers, in OpenAI's shape
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/files")
        conn.putheader("authorization", f"Bearer {ALICE}")
        conn.putheader("content-type", "multipart/form-data; boundary=x")
        conn.putheader("content-length", str(300 * 1024 * 1024))
        conn.endheaders()
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
    finally:
        conn.close()
    assert resp.status == 413 and error["code"] == "file_too_large" and "200 MB" in error["message"], error
