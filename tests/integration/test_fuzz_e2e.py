"""
Fuzzing every route of the three surfaces with generated bad requests
against a real daemon and llama-server child: wrong types, missing and
extra fields, huge numbers, deep nesting, invalid UTF-8, truncated bodies,
wrong content types, duplicate keys, enormous headers.

Invariants: every answer is a 2xx or a 4xx in the surface's own error shape
(a bare 400 only where twisted.web refuses the HTTP framing itself), never
an internal error of Blazar's own and never a traceback in a body; the
daemon still answers /health and a normal chat afterwards, with every slot
free.

A fixed, derandomized subset runs in the normal suite; the long run:

    BLAZAR_FUZZ_EXAMPLES=2000 ./dev.sh test tests/integration/test_fuzz_e2e.py
"""

from __future__ import annotations

import http.client
import json
import os
from typing import Any, Iterator, cast

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon
from tests.integration.reliability import TALLY, tallied

EXAMPLES = int(os.environ.get("BLAZAR_FUZZ_EXAMPLES", "12"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize="BLAZAR_FUZZ_EXAMPLES" not in os.environ,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
ROUTES = [
    ("POST", "/v1/chat/completions", "openai"),
    ("POST", "/v1/completions", "openai"),
    ("POST", "/v1/embeddings", "openai"),
    ("GET", "/v1/models", "openai"),
    ("GET", "/v1/models/tiny", "openai"),
    ("POST", "/v1/messages", "anthropic"),
    ("POST", "/v1/messages/count_tokens", "anthropic"),
    ("POST", "/api/chat", "ollama"),
    ("POST", "/api/generate", "ollama"),
    ("POST", "/api/embed", "ollama"),
    ("POST", "/api/embeddings", "ollama"),
    ("POST", "/api/show", "ollama"),
    ("GET", "/api/tags", "ollama"),
    ("GET", "/api/ps", "ollama"),
    ("POST", "/api/copy", "ollama"),
    ("POST", "/api/pull", "ollama"),
    ("GET", "/api/queue", "ollama"),
    ("DELETE", "/api/delete", "ollama"),
    ("POST", "/api/version", "ollama"),
    ("POST", "/v1/nonexistent", "openai"),
    ("POST", "/v1/responses", "openai"),
    ("POST", "/v1/responses/input_tokens", "openai"),
    ("GET", "/v1/responses/resp_0", "openai"),
    ("DELETE", "/v1/responses/resp_0", "openai"),
    ("GET", "/v1/responses/resp_0/input_items", "openai"),
]
FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "options",
    "format",
    "keep_alive",
    "system",
    "temperature",
    "stop",
    "stop_sequences",
    "suffix",
    "raw",
    "images",
    "response_format",
    "stream_options",
    "name",
    "source",
    "destination",
    "seed",
    "n",
    "logit_bias",
    "thinking",
    "metadata",
    "content",
    "role",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "text",
    "store",
    "reasoning",
]
MODELS = st.sampled_from(["tiny", "tiny:latest", "TINY", "nope", "", "tiny-embed", "a" * 300, "../etc/passwd"])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | MODELS
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"]) | values},
    optional={"content": st.text(max_size=30) | values, "tool_calls": values, "images": values},
)
objects = st.fixed_dictionaries(
    {"model": MODELS | values},
    optional={
        "messages": st.lists(message, max_size=3) | values,
        "max_tokens": st.integers(-5, 5000) | values,
        "num_predict": values,
        "stream": st.booleans() | values,
        "prompt": st.text(max_size=30) | values,
        "input": st.text(max_size=30) | st.lists(st.text(max_size=10), max_size=3) | values,
        "options": st.dictionaries(
            st.sampled_from(["num_predict", "num_ctx", "temperature", "seed", "stop"]), values, max_size=3
        ),
        "tools": values,
        "tool_choice": values,
        "keep_alive": values,
        "format": values,
        "source": MODELS,
        "destination": st.text(max_size=20),
        "name": MODELS,
        "instructions": values,
        "max_output_tokens": st.integers(-5, 5000) | values,
        "previous_response_id": st.text(max_size=20) | values,
        "text": values,
        "store": values,
    },
).map(
    lambda d: (
        {**d, "options": {**cast(dict[str, Any], d.get("options", {})), "num_predict": 4}} if "options" in d else d
    )
)


def raw_bodies() -> st.SearchStrategy[bytes]:
    def truncated(d: dict[str, Any]) -> st.SearchStrategy[bytes]:
        text = json.dumps(d).encode()
        return st.integers(0, max(0, len(text) - 1)).map(lambda n: text[:n])

    return st.one_of(
        objects.map(lambda d: json.dumps(d, allow_nan=True).encode()),
        objects.flatmap(truncated),
        st.binary(max_size=64),
        st.sampled_from(
            [
                b"",
                b"null",
                b"[]",
                b"42",
                b'"text"',
                b"\xff\xfe\xfd",
                b'{"model": "\xff\xfe"}',
                b'{"model":"tiny","model":5,"messages":[{"role":"user","content":"hi"}]}',
                b'{"model":"tiny","max_tokens":1e400,"messages":[{"role":"user","content":"hi"}]}',
                b'{"model":"tiny","max_tokens":' + b"9" * 400 + b',"messages":[{"role":"user","content":"hi"}]}',
                b"[" * 100_000 + b"]" * 100_000,
                b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                b'{"model":"tiny","messages":[{"role":"user","content":"\\ud800"}]}',
            ]
        ),
    )


CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "text/plain",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
        "",
        "\x7f/\x7f",
    ]
)


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("fuzz")
    # models of its own: the fuzz may copy or delete files
    make_test_model(root / "models" / "tiny.gguf")
    make_test_model(root / "models" / "tiny-embed.gguf", seed=1, embedding=True)
    d = Daemon(
        root / "d",
        (
            f'models_dir = "{root / "models"}"\nready_timeout = 60\nbreaker_crashes = 1000\n'
            'hf_endpoint = "http://127.0.0.1:9"\n'  # /api/pull must never leave the machine
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
            '[models."tiny"]\nctx_size = 256\nparallel = 2\n'
            '[models."tiny-embed"]\nembedding = true\n'
        ),
    )
    with tallied(d):
        yield d


def send(d: Daemon, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def check(surface: str, status: int, body: bytes, what: str) -> None:
    """
    The invariants for one answer.
    """
    TALLY.inputs += 1
    assert b"Traceback" not in body, (what, body[:500])
    internal = b"internal error (trace id" in body
    if internal or status == 500 and surface != "anthropic":
        TALLY.gateway_5xx += 1
        raise AssertionError(f"{what}: {status} of Blazar's own: {body[:500]!r}")
    if 200 <= status < 300:
        return
    assert status < 500 or status in (502, 503, 504) or (surface == "anthropic" and status == 500), (
        what,
        status,
        body[:300],
    )
    if not body:
        assert status == 400, (what, status)  # twisted.web refusing the framing itself
        return
    parsed = json.loads(body)
    if surface == "openai":
        assert set(parsed) == {"error"} and isinstance(parsed["error"]["message"], str), (what, parsed)
        assert {"type", "code"} <= set(parsed["error"]), (what, parsed)
    elif surface == "anthropic":
        assert parsed["type"] == "error" and isinstance(parsed["error"]["message"], str), (what, parsed)
        assert isinstance(parsed["error"]["type"], str), (what, parsed)
    else:
        assert set(parsed) == {"error"} and isinstance(parsed["error"], str), (what, parsed)


@pytest.mark.parametrize("method,path,surface", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
@FUZZ
@given(body=raw_bodies(), content_type=CONTENT_TYPES)
def test_fuzz_route(daemon: Daemon, method: str, path: str, surface: str, body: bytes, content_type: str) -> None:
    assume(not (path == "/api/delete" and b"tiny" in body.lower()))  # the fuzz needs its model
    headers = {"content-type": content_type} if content_type else {}
    status, answer = send(daemon, method, path, body, headers)
    check(surface, status, answer, f"{method} {path} {body[:200]!r}")


@FUZZ
@given(
    name=st.sampled_from(
        [
            "x-api-key",
            "authorization",
            "x-blazar-priority",
            "x-blazar-deadline-ms",
            "x-blazar-trace-id",
            "x-blazar-keep-alive",
            "anthropic-version",
            "cookie",
        ]
    ),
    size=st.sampled_from([1, 100, 8_000, 20_000, 70_000]),
    path=st.sampled_from(["/v1/chat/completions", "/v1/messages", "/api/chat"]),
)
def test_enormous_headers(daemon: Daemon, name: str, size: int, path: str) -> None:
    surface = {"/v1/messages": "anthropic", "/api/chat": "ollama"}.get(path, "openai")
    body = json.dumps(
        {"model": "tiny", "max_tokens": 2, "stream": False, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    try:
        status, answer = send(daemon, "POST", path, body, {"content-type": "application/json", name: "v" * size})
    except (ConnectionError, http.client.RemoteDisconnected):
        TALLY.inputs += 1  # twisted.web closed a connection whose headers were too large
        return
    check(surface, status, answer, f"{name}: {size} bytes")


def test_daemon_is_whole_after_the_fuzz(daemon: Daemon) -> None:
    assert daemon.request("GET", "/health")[0] == 200
    status, body = daemon.post_json(
        "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 200, body
    _, _, raw = daemon.request("GET", "/api/queue")
    busy = sum(m["slots"]["busy"] + m["waiting"]["total"] for m in json.loads(raw)["models"])
    TALLY.leaked_slots += busy
    assert busy == 0, raw
    assert "Unhandled Error" not in daemon.log(), daemon.log()[-3000:]
