"""
Streaming clients that stop reading, against a real daemon and llama-server
child (issue 24, backpressure): one per streaming surface connects with a
small receive buffer, asks for a long stream and never reads. While they
stall the daemon holds their slots and buffers a bounded amount (RSS is
measured before, during and after); after C{stream_stall_close_secs} they are
cut off, their slots are freed and a normal request is served. A slow reader
that keeps reading is never cut off, however long it takes.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any, Iterator

import psutil
import pytest

from blazar.models.testmodel import GeneratedModel, vocabulary
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon
from tests.integration.reliability import TALLY, tallied

STALL = 3.0
HELLO = [{"role": "user", "content": "hi"}]
LONG = 1900


def _no_end_of_turn() -> dict[str, int]:
    # the random model would otherwise end its turn early: llama.cpp ends
    # on the EOS token and on every token it takes for an end of generation
    tokens = vocabulary()[0]
    return {str(tokens.index(t)): -100 for t in ("<|im_end|>", "</s>")}


STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "openai": (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": HELLO,
            "stream": True,
            "max_tokens": LONG,
            "logit_bias": _no_end_of_turn(),
        },
    ),
    "anthropic": (
        "/v1/messages",
        {
            "model": "tiny",
            "messages": HELLO,
            "stream": True,
            "max_tokens": LONG,
            "logit_bias": _no_end_of_turn(),
        },
    ),
    "ollama": (
        "/api/chat",
        {
            "model": "tiny",
            "messages": HELLO,
            "options": {"num_predict": LONG, "logit_bias": _no_end_of_turn()},
        },
    ),
    "responses": (
        "/v1/responses",
        {
            "model": "tiny",
            "input": "hi",
            "stream": True,
            "max_output_tokens": LONG,
            "logit_bias": _no_end_of_turn(),
        },
    ),
}


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("backpressure"),
        f"stream_stall_close_secs = {STALL:g}\n" + daemon_config(engine, models, '[models."tiny"]\nparallel = 4\n'),
    )
    with tallied(d):
        yield d


def rss(d: Daemon) -> int:
    assert d.proc is not None
    return int(psutil.Process(d.proc.pid).memory_info().rss)


def busy_slots(d: Daemon) -> int:
    status, _, raw = d.request("GET", "/api/queue", timeout=10)
    assert status == 200, raw
    return sum(m["slots"]["busy"] for m in json.loads(raw)["models"])


def engine_connections(d: Daemon) -> int:
    """
    Established connections the daemon opened (to its children).
    """
    assert d.proc is not None
    connections = psutil.Process(d.proc.pid).net_connections("tcp")
    listening = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    return sum(
        1 for c in connections if c.raddr and c.laddr.port not in listening and c.status == psutil.CONN_ESTABLISHED
    )


def read_stream(d: Daemon, surface: str, max_tokens: int | None = None) -> bytes:
    path, body = STREAMS[surface]
    if max_tokens is not None:
        body = json.loads(json.dumps(body).replace(str(LONG), str(max_tokens)))
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:500]
        return resp.read()
    finally:
        conn.close()


def stalled_client(d: Daemon, surface: str) -> socket.socket:
    """
    A client that sends a long stream request and never reads: a 4 KiB
    receive buffer (set before connecting, so the window stays small).
    """
    path, body = STREAMS[surface]
    payload = json.dumps(body).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", d.port))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return s


def wait_for(condition: Any, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return bool(condition())


def test_stalled_readers_are_bounded_held_then_cut_off(daemon: Daemon) -> None:
    # warm every surface's path once, read whole, so one-time allocations
    # are in the baseline
    for surface in STREAMS:
        read_stream(daemon, surface, max_tokens=200)
    assert wait_for(lambda: busy_slots(daemon) == 0 and engine_connections(daemon) == 0, 10)
    before = rss(daemon)

    clients = [stalled_client(daemon, surface) for surface in STREAMS]
    sent = time.monotonic()
    TALLY.faults += len(clients)
    try:
        assert wait_for(lambda: busy_slots(daemon) == len(clients), 5), "the stalled streams were not admitted"
        # well inside the stall bound: the streams are paused, not finished
        time.sleep(max(0.0, sent + STALL / 2 - time.monotonic()))
        during = rss(daemon)
        assert busy_slots(daemon) == len(clients), "a stalled stream gave its slot back early"
        freed = wait_for(lambda: busy_slots(daemon) == 0, STALL + 10)
        freed_after = time.monotonic() - sent
        leaked = busy_slots(daemon)
        TALLY.leaked_slots += leaked
        assert freed, f"{leaked} slots still busy {freed_after:.1f} s after the stalled streams began"
        assert freed_after >= STALL, f"slots freed after {freed_after:.1f} s, before the stall bound"
        # cut off: the connection ends (an abort: what was still queued for
        # the client is dropped), long before the whole stream was delivered
        received = []
        for s in clients:
            s.settimeout(10)
            got = 0
            try:
                while chunk := s.recv(65536):
                    got += len(chunk)
            except ConnectionResetError:
                pass
            received.append(got)
        print(f"bytes the stalled clients had been sent: {received}")
        assert all(0 < got < 64 * 1024 for got in received), received
    finally:
        for s in clients:
            s.close()
    assert wait_for(lambda: engine_connections(daemon) == 0, 10), "an engine connection outlived its stream"
    status, reply = daemon.post_json("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": HELLO})
    assert status == 200, reply
    time.sleep(1.0)
    after = rss(daemon)
    mib = 1 << 20
    print(
        f"daemon RSS: before {before / mib:.1f} MiB, 4 stalled streams {during / mib:.1f} MiB, "
        f"after they left {after / mib:.1f} MiB"
    )
    assert during <= before * 1.10, f"RSS grew from {before / mib:.1f} to {during / mib:.1f} MiB while stalled"
    assert after <= before * 1.10, f"RSS {before / mib:.1f} -> {after / mib:.1f} MiB after the clients left"


def test_a_slow_reader_is_never_cut_off(daemon: Daemon) -> None:
    """
    A client that reads 4 KiB every half second takes several stall bounds
    to read its stream and gets all of it.
    """
    path, body = STREAMS["openai"]
    TALLY.faults += 1
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", daemon.port))
    payload = json.dumps({**body, "max_tokens": 400}).encode()
    began = time.monotonic()
    data = b""
    try:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        s.settimeout(30)
        while chunk := s.recv(4096):
            data += chunk
            time.sleep(0.5)
    finally:
        s.close()
    took = time.monotonic() - began
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]
    assert b"data: [DONE]" in data, data[-300:]
    assert took > 2 * STALL, f"read in {took:.1f} s: not slow enough to test the stall bound"
    assert wait_for(lambda: busy_slots(daemon) == 0, 5)
