"""
OpenTelemetry end to end: with otlp_endpoint pointing at a local OTLP/HTTP
receiver this test starts, a request produces a span tree with queue,
load and generate children; with the receiver stopped, requests take as
long as before and the dropped spans are counted in /metrics.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon, free_port

HELLO = [{"role": "user", "content": "hi"}]


class Receiver:
    """
    A minimal OTLP/HTTP trace receiver (POST /v1/traces, protobuf).
    """

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.posts = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.posts += 1
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    try:
        r.stop()
    except OSError:
        pass


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    # a top-level key, so before daemon_config's tables
    d = Daemon(
        tmp_path_factory.mktemp("tracing"),
        f'otlp_endpoint = "http://127.0.0.1:{receiver.port}"\n' + daemon_config(engine, models),
    )
    d.start()
    try:
        yield d
    finally:
        d.close()


def chat(d: Daemon) -> float:
    started = time.monotonic()
    status, _, body = d.request("POST", "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 2})
    assert status == 200, body
    return time.monotonic() - started


def dropped(d: Daemon) -> float:
    _, _, body = d.request("GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith("blazar_otlp_spans_dropped_total "):
            return float(line.split()[1])
    raise AssertionError("no blazar_otlp_spans_dropped_total in /metrics")


def test_request_span_tree(daemon: Daemon, receiver: Receiver) -> None:
    chat(daemon)  # the first request loads the model
    deadline = time.monotonic() + 30
    while not any(s.name == "POST /v1/chat/completions" for s in receiver.spans):
        assert time.monotonic() < deadline, "no span reached the receiver"
        time.sleep(0.2)
    root = next(s for s in receiver.spans if s.name == "POST /v1/chat/completions")
    children = {s.name: s for s in receiver.spans if s.parent_span_id == root.span_id}
    assert set(children) == {"queue", "load", "generate"}, [s.name for s in receiver.spans]
    for child in children.values():
        assert child.trace_id == root.trace_id
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= root.end_time_unix_nano
    assert children["queue"].end_time_unix_nano <= children["load"].start_time_unix_nano
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["gen_ai.request.model"].string_value == "tiny:latest"
    assert attributes["http.response.status_code"].int_value == 200
    assert dropped(daemon) == 0


def test_stopped_receiver_costs_requests_nothing_and_drops_are_counted(daemon: Daemon, receiver: Receiver) -> None:
    before = statistics.median(chat(daemon) for _ in range(15))
    receiver.stop()
    during = []
    deadline = time.monotonic() + 40
    while dropped(daemon) == 0:
        assert time.monotonic() < deadline, "failed exports were never counted"
        during.append(chat(daemon))
        time.sleep(0.05)
    assert len(during) >= 5
    # the exports fail in their own thread: requests meanwhile are as fast as before
    assert statistics.median(during) < before * 3 + 0.05, (before, during)
    assert json.loads(daemon.request("GET", "/health")[2]) == {"status": "ok"}
