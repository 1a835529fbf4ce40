"""
The Files API inside the limits (issue 36, item 8), on a real daemon, in
the reliability suite (its closing line counts the inputs tried here).

The attack: C{rpm} and C{max_concurrent} applied only where a model was
named; files of up to 200 MB were SQLite BLOBs with no per-key quota; a
download read the whole BLOB into memory (10 concurrent downloads of
150 MB took the daemon from 317 MB to 1.77 GB); a delete never gave the
space back. Now every Files and Batch API route counts against C{rpm}, a
key's files are held to C{file_bytes} / C{max_file_bytes_per_key}, a
download is streamed from C{<data_dir>/files/<id>} in pieces, and a delete
removes that file.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from blazar.httpbody import multipart_body
from tests.integration.harness import Daemon
from tests.integration.reliability import TALLY, tallied

PACED = "paced-secret-0123456789"  # rpm = 3
STASH = "stash-secret-0123456789"  # file_bytes = 3 MiB
BULK = "bulk-secret-01234567890"  # no limits
QUOTA = 3 * 1024 * 1024
LINE = (
    json.dumps(
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        }
    ).encode()
    + b"\n"
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("files-limits")
    with tallied(
        Daemon(
            root,
            (
                f'[[keys]]\nname = "paced"\nsecret = "{PACED}"\nrpm = 3\n'
                f'[[keys]]\nname = "stash"\nsecret = "{STASH}"\nfile_bytes = {QUOTA}\n'
                f'[[keys]]\nname = "bulk"\nsecret = "{BULK}"\n'
            ),
        )
    ) as d:
        yield d


def call(
    daemon: Daemon,
    method: str,
    path: str,
    secret: str,
    raw: bytes | None = None,
    content_type: str = "application/json",
    timeout: float = 120.0,
) -> tuple[int, dict[str, str], bytes]:
    return daemon.request(
        method,
        path,
        raw=raw,
        timeout=timeout,
        headers={"authorization": f"Bearer {secret}", "content-type": content_type},
    )


def upload(daemon: Daemon, secret: str, content: bytes) -> tuple[int, Any]:
    raw, content_type = multipart_body({"purpose": "batch"}, [("file", "in.jsonl", "application/jsonl", content)])
    status, _, body = call(daemon, "POST", "/v1/files", secret, raw, content_type, timeout=300)
    return status, json.loads(body)


def jsonl(size: int) -> bytes:
    """
    About C{size} bytes of batch input lines, each different (nothing
    along the way can make them smaller).
    """
    lines, total, n = [], 0, 0
    while total < size:
        line = (
            json.dumps(
                {
                    "custom_id": f"c{n}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "tiny", "messages": [{"role": "user", "content": os.urandom(300).hex()}]},
                }
            ).encode()
            + b"\n"
        )
        lines.append(line)
        total += len(line)
        n += 1
    return b"".join(lines)


def disk_usage(path: Path) -> int:
    """
    Bytes the files under C{path} occupy on disk (what C{du} counts).
    """
    used = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                used += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return used


def test_a_key_with_rpm_3_gets_429_on_its_fourth_files_request_in_a_minute(daemon: Daemon) -> None:
    TALLY.inputs += 4
    status, made = upload(daemon, PACED, LINE)
    assert status == 200, made
    assert call(daemon, "GET", "/v1/files", PACED)[0] == 200
    assert call(daemon, "GET", f"/v1/files/{made['id']}", PACED)[0] == 200
    status, headers, body = call(daemon, "GET", f"/v1/files/{made['id']}/content", PACED)
    assert status == 429, body
    error = json.loads(body)["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert "rpm" in error["message"]
    assert 1 <= int(headers["retry-after"]) <= 60
    # the batch routes too, and another key is not held to paced's minute
    assert call(daemon, "GET", "/v1/batches", PACED)[0] == 429
    assert call(daemon, "GET", "/v1/files", BULK)[0] == 200


def test_the_storage_quota_refuses_an_upload_past_it_until_a_delete(daemon: Daemon) -> None:
    TALLY.inputs += 3
    two_mib = jsonl(2 * 1024 * 1024)
    status, first = upload(daemon, STASH, two_mib)
    assert status == 200, first
    status, refused = upload(daemon, STASH, two_mib)
    assert status == 413, refused
    error = refused["error"]
    assert (error["code"], error["param"]) == ("storage_quota_exceeded", "file")
    for words in ("max_file_bytes_per_key", "file_bytes", "DELETE /v1/files/", str(QUOTA)):
        assert words in error["message"], error["message"]
    assert [f["id"] for f in json.loads(call(daemon, "GET", "/v1/files", STASH)[2])["data"]] == [first["id"]]
    assert call(daemon, "DELETE", f"/v1/files/{first['id']}", STASH)[0] == 200
    status, again = upload(daemon, STASH, two_mib)
    assert status == 200, again


def download(daemon: Daemon, file_id: str, out: list[tuple[int, int, str]]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=300)
    try:
        conn.request("GET", f"/v1/files/{file_id}/content", headers={"authorization": f"Bearer {BULK}"})
        response = conn.getresponse()
        digest, size = hashlib.sha256(), 0
        while piece := response.read(256 * 1024):
            digest.update(piece)
            size += len(piece)
            time.sleep(0.002)  # a client that reads, not one that swallows
        out.append((response.status, size, digest.hexdigest()))
    finally:
        conn.close()


def test_ten_concurrent_downloads_of_a_50_mb_file_keep_the_daemon_small(daemon: Daemon) -> None:
    TALLY.inputs += 10
    content = jsonl(50 * 1024 * 1024)
    status, made = upload(daemon, BULK, content)
    assert status == 200, made
    assert made["bytes"] == len(content)
    assert daemon.proc is not None
    process = psutil.Process(daemon.proc.pid)
    time.sleep(0.5)
    baseline = process.memory_info().rss
    peak, done = [baseline], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.01)

    results: list[tuple[int, int, str]] = []
    watcher = threading.Thread(target=watch)
    clients = [threading.Thread(target=download, args=(daemon, made["id"], results)) for _ in range(10)]
    watcher.start()
    for client in clients:
        client.start()
    for client in clients:
        client.join(300)
    done.set()
    watcher.join()
    expected = (200, len(content), hashlib.sha256(content).hexdigest())
    assert results == [expected] * 10
    growth = peak[0] - baseline
    assert growth < 60 * 1024 * 1024, f"the daemon grew {growth / 2**20:.0f} MiB serving 10 downloads of 50 MiB"
    assert call(daemon, "GET", "/health", BULK)[0] == 200


def test_a_delete_gives_the_space_back(daemon: Daemon) -> None:
    TALLY.inputs += 1
    data = daemon.root / "data"
    status, made = upload(daemon, BULK, jsonl(40 * 1024 * 1024))
    assert status == 200, made
    before = disk_usage(data)
    assert call(daemon, "DELETE", f"/v1/files/{made['id']}", BULK)[0] == 200
    after = disk_usage(data)
    assert before - after >= 35 * 1024 * 1024, f"data dir {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB"
    assert call(daemon, "GET", f"/v1/files/{made['id']}/content", BULK)[0] == 404


def test_a_client_that_leaves_mid_download_leaves_nothing_open(daemon: Daemon) -> None:
    TALLY.inputs += 5
    status, made = upload(daemon, BULK, jsonl(20 * 1024 * 1024))
    assert status == 200, made
    assert daemon.proc is not None
    process = psutil.Process(daemon.proc.pid)
    fds = process.num_fds()
    for _ in range(5):
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
        conn.request("GET", f"/v1/files/{made['id']}/content", headers={"authorization": f"Bearer {BULK}"})
        response = conn.getresponse()
        assert response.status == 200
        assert len(response.read(1024 * 1024)) == 1024 * 1024
        conn.close()  # gone, 19 MiB unread
    deadline = time.monotonic() + 10
    while process.num_fds() > fds and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.num_fds() <= fds, "a download's file or socket stayed open after its client left"
    assert call(daemon, "GET", f"/v1/files/{made['id']}", BULK)[0] == 200
    assert "Traceback" not in daemon.log()
