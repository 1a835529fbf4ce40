"""
Hardening, round two (issue 36), on a real llama-server child, in the
reliability suite (its closing line counts the inputs tried here).

H1: a forced tool call whose schema is a 30-entry type list nested 4 deep
(1.5 KB) made the daemon walk it 30^4 times on the reactor: /health
stalled for 44.5 s. The grammar is now made in a thread, each subschema
walked once, under a node budget and a deadline.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any, Iterator

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon
from tests.integration.reliability import TALLY, tallied


def serving(
    engine: str,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    more: str = "",
    *,
    model: str = "tiny",
    real: bool = False,
    settings: str = "parallel = 2\n",
    top: str = "",
) -> Iterator[Daemon]:
    """
    A reliability daemon serving one model: the generated test model, or
    (C{real}) SmolLM2-135M-Instruct from its wheel; C{settings} go under
    its C{[models."NAME"]}, C{top} before it, C{more} (keys, ...) last.
    """
    from tests.integration.harness import real_model

    root = tmp_path_factory.mktemp(name)
    if real:
        (root / "models").mkdir()
        (root / "models" / f"{model}.gguf").symlink_to(real_model())
    else:
        make_test_model(root / "models" / f"{model}.gguf")
    with tallied(
        Daemon(
            root,
            (
                f'models_dir = "{root / "models"}"\n{top}[models."{model}"]\n{settings}'
                f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n' + more
            ),
        )
    ) as d:
        yield d


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from serving(engine, tmp_path_factory, "hardening")


def nested(kinds: list[str], depth: int) -> dict[str, Any]:
    """
    The attack's shape: a type list at every level, one property holding
    the next (4 deep with 30 entries: 1.5 KB).
    """
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": kinds, "properties": {"a": schema}}
    return schema


def health_times(daemon: Daemon, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        began = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
        try:
            conn.request("GET", "/health")
            assert conn.getresponse().read()
        finally:
            conn.close()
        out.append(time.monotonic() - began)
        time.sleep(0.02)


def test_a_forced_calls_schema_cannot_stall_the_daemon(daemon: Daemon) -> None:
    status, _ = daemon.post_json(
        "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}
    )
    assert status == 200
    attacks = {
        "type list nested": nested(["object"] * 30, 4),
        "every type nested": nested(["object", "array", "string", "integer", "number", "boolean", "null"], 12),
    }
    for name, schema in attacks.items():
        TALLY.inputs += 1
        stop, times = threading.Event(), list[float]()
        watcher = threading.Thread(target=health_times, args=(daemon, stop, times))
        watcher.start()
        began = time.monotonic()
        try:
            status, _, data = daemon.request(
                "POST",
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "go"}],
                    "max_tokens": 64,
                    "seed": 1,
                    "tools": [{"type": "function", "function": {"name": "emit", "parameters": schema}}],
                    "tool_choice": {"type": "function", "function": {"name": "emit"}},
                },
                timeout=60,
            )
        finally:
            stop.set()
            watcher.join()
        took = time.monotonic() - began
        assert status == 200, (name, status, data[:300])
        assert took < 10, (name, took)
        assert times and max(times) < 0.1, (name, max(times), len(times))
        print(f"{name}: {status} in {took:.2f} s; /health at most {max(times) * 1000:.0f} ms over {len(times)}")


# -- H3: web pages cannot reach a keyless gateway ---------------------------------

ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/v1/files"),
    ("GET", "/v1/batches"),
    ("GET", "/api/tags"),
    ("GET", "/api/ps"),
    ("POST", "/api/show"),
    ("GET", "/metrics"),
    ("GET", "/api/queue"),
    ("GET", "/ui/api/models"),
    ("GET", "/ui/api/keys"),
    ("GET", "/ui/api/engines"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/api/chat"),
    ("POST", "/v1/messages"),
    ("GET", "/v1/responses/resp_x"),
]
CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def send(daemon: Daemon, method: str, path: str, headers: dict[str, str], body: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    try:
        conn.request(method, path, body, headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_rebound_host_and_a_cross_site_page_are_refused_on_every_route(daemon: Daemon) -> None:
    for method, path in ROUTES:
        TALLY.inputs += 2
        body = CHAT if method == "POST" else None
        status, data = send(
            daemon, method, path, {"Host": "rebind.attacker.example", "content-type": "text/plain"}, body
        )
        assert status == 403 and b"allowed_hosts" in data, (method, path, status, data[:200])
        json.loads(data)  # in the surface's own shape, strict JSON
        status, data = send(
            daemon,
            method,
            path,
            {"Host": f"127.0.0.1:{daemon.port}", "Origin": "https://evil.example", "content-type": "text/plain"},
            body,
        )
        assert status == 403 and b"cors_origins" in data, (method, path, status, data[:200])
    for path in ("/", "/health"):
        status, _ = send(daemon, "GET", path, {"Host": "rebind.attacker.example"})
        assert status == 200, path


def test_same_machine_clients_still_work(daemon: Daemon) -> None:
    here = f"127.0.0.1:{daemon.port}"
    for headers in (
        {"Host": here},
        {"Host": f"localhost:{daemon.port}"},
        {"Host": here, "Origin": f"http://{here}"},  # the dashboard's own page
        {"Host": here, "Origin": f"http://localhost:{daemon.port}"},
    ):
        status, data = send(
            daemon, "POST", "/v1/chat/completions", {**headers, "content-type": "application/json"}, CHAT
        )
        assert status == 200, (headers, data[:200])
    # the dashboard opened from another machine, by the box's address: same origin
    status, data = send(
        daemon, "GET", "/v1/models", {"Host": "192.168.7.7:11434", "Origin": "http://192.168.7.7:11434"}
    )
    assert status == 200, data[:200]


# -- H2: no single request exhausts the engine -------------------------------------


def test_bodies_too_large_for_the_engine_are_refused_before_it(daemon: Daemon) -> None:
    """
    20,000 tools took the child from 21 MB to 8.3 GB, a forced tool of
    20,000 properties crashed it, 50,000 messages cost 129 s of its CPU:
    each is now a 400 naming its limit, in well under a second, and the
    child neither grows nor restarts.
    """
    status, _ = daemon.post_json(
        "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}
    )
    assert status == 200
    child = daemon.engine_for("tiny:latest")
    rss = child.memory_info().rss
    say = [{"role": "user", "content": "hi"}]
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    bodies = {
        "max_tools": {
            "model": "tiny",
            "messages": say,
            "max_tokens": 8,
            "tools": [
                {"type": "function", "function": {"name": f"t{i}", "parameters": weather}} for i in range(20_000)
            ],
        },
        "max_schema_nodes": {
            "model": "tiny",
            "messages": say,
            "max_tokens": 8,
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "wide",
                        "parameters": {
                            "type": "object",
                            "properties": {f"p{i}": {"type": "string"} for i in range(20_000)},
                        },
                    },
                }
            ],
        },
        "max_messages": {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}] * 50_000},
    }
    for key, body in bodies.items():
        for path in ("/v1/chat/completions", "/api/chat"):
            TALLY.inputs += 1
            began = time.monotonic()
            status, _, data = daemon.request("POST", path, {**body, "stream": False})
            took = time.monotonic() - began
            assert status == 400 and key.encode() in data, (key, path, status, data[:300])
            assert took < 1.0, (key, path, took)
    # under every limit, but larger than the context by its size alone: refused uncounted
    for path in ("/v1/chat/completions", "/api/chat"):
        TALLY.inputs += 1
        began = time.monotonic()
        status, _, data = daemon.request(
            "POST",
            path,
            {
                "model": "tiny",
                "max_tokens": 8,
                "stream": False,
                "messages": [{"role": "user", "content": "word " * 400_000}],
            },
        )
        took = time.monotonic() - began
        assert status == 400 and b"(by its size)" in data, (path, status, data[:300])
        assert took < 1.0, (path, took)
    assert "input_tokens" not in daemon.engine_log("tiny:latest")  # the child counted none of them
    assert child.is_running() and daemon.engine_for("tiny:latest").pid == child.pid
    assert child.memory_info().rss - rss < 100 << 20, (rss, child.memory_info().rss)


# -- Low: malformed ids and fields are 4xx, never 500 -------------------------------


def test_odd_batch_and_response_fields_are_client_errors(daemon: Daemon) -> None:
    here = {"Host": f"127.0.0.1:{daemon.port}", "content-type": "application/json"}
    cases = [
        (
            "/v1/batches",
            '{"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": ["24h"]}',
        ),
        (
            "/v1/batches",
            '{"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": {"a": 1}}',
        ),
        (
            "/v1/batches",
            '{"input_file_id": "file-x", "endpoint": ["/v1/chat/completions"], "completion_window": "24h"}',
        ),
        ("/v1/batches", '{"input_file_id": "\\ud800", "endpoint": "/v1/chat/completions", "completion_window": "24h"}'),
        ("/v1/responses", '{"model": "tiny", "input": "hi", "previous_response_id": "resp_\\ud800"}'),
    ]
    for path, raw in cases:
        TALLY.inputs += 1
        status, data = send(daemon, "POST", path, here, raw)
        assert 400 <= status < 500, (path, raw, status, data[:300])
        json.loads(data)


# -- 6: a scoped key cannot unload or pin a shared model ---------------------------

ADMIN, SCOPED = "admin-secret-0123456789", "scoped-secret-0123456789"


@pytest.fixture(scope="module")
def keyed(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from serving(
        engine,
        tmp_path_factory,
        "keyed",
        f'[[keys]]\nname = "admin"\nsecret = "{ADMIN}"\n'
        f'[[keys]]\nname = "tenant"\nsecret = "{SCOPED}"\nmodels = ["tiny"]\n',
    )


def loaded(daemon: Daemon) -> list[str]:
    status, data = send(daemon, "GET", "/api/ps", {"Authorization": f"Bearer {ADMIN}"})
    assert status == 200, data
    return [m["name"] for m in json.loads(data)["models"]]


def test_a_scoped_key_cannot_unload_or_pin_a_shared_model(keyed: Daemon) -> None:
    auth = {"Authorization": f"Bearer {SCOPED}", "content-type": "application/json"}
    for keep_alive in (0, -1, "0s"):
        TALLY.inputs += 2
        status, data = send(
            keyed,
            "POST",
            "/api/chat",
            auth,
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": False,
                    "keep_alive": keep_alive,
                    "options": {"num_predict": 2},
                }
            ),
        )
        assert status == 200, data
        assert loaded(keyed) == ["tiny:latest"], keep_alive
        status, data = send(keyed, "POST", "/api/generate", auth, json.dumps({"model": "tiny", "keep_alive": 0}))
        assert status == 200 and json.loads(data)["done_reason"] == "load", data  # not an unload
        assert loaded(keyed) == ["tiny:latest"]
    expires = [
        m["expires_at"]
        for m in json.loads(send(keyed, "GET", "/api/ps", {"Authorization": f"Bearer {ADMIN}"})[1])["models"]
    ]
    assert not any(e.startswith("9999") for e in expires), expires  # not pinned forever (year 9999)
    # an admin's keep_alive 0 still unloads
    status, data = send(
        keyed,
        "POST",
        "/api/generate",
        {"Authorization": f"Bearer {ADMIN}"},
        json.dumps({"model": "tiny", "keep_alive": 0}),
    )
    assert status == 200 and json.loads(data)["done_reason"] == "unload", data
    deadline = time.monotonic() + 10
    while loaded(keyed) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert loaded(keyed) == []


def test_an_unload_loop_costs_other_keys_nothing(keyed: Daemon) -> None:
    """
    An unload loop gave another key 5 x 502 in 243 requests: a second
    SIGTERM to a stopping child, and "unloaded while it was loading". Now
    a stop is done once and a request whose child was unloaded waits for
    the next one.
    """
    stop, unloads = threading.Event(), [0]

    def unload_loop() -> None:
        while not stop.is_set():
            status, _ = send(
                keyed,
                "POST",
                "/api/generate",
                {"Authorization": f"Bearer {ADMIN}"},
                json.dumps({"model": "tiny", "keep_alive": 0}),
            )
            assert status == 200
            unloads[0] += 1

    looping = threading.Thread(target=unload_loop)
    looping.start()
    statuses: list[tuple[int, bytes]] = []
    try:
        for i in range(60):
            TALLY.inputs += 1
            status, data = send(
                keyed,
                "POST",
                "/v1/chat/completions",
                {"Authorization": f"Bearer {SCOPED}", "content-type": "application/json"},
                json.dumps({"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}),
            )
            statuses.append((status, data[:200]))
    finally:
        stop.set()
        looping.join()
    assert unloads[0] >= 20, unloads
    assert [s for s in statuses if s[0] != 200] == [], statuses
    assert "drop the work" not in keyed.log()


# -- 4: the prompt cache tells a scoped key nothing about other keys' prompts -------


def test_a_scoped_key_sees_no_prompt_cache_counts(keyed: Daemon) -> None:
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the secret is 4817 and more words"}],
        "max_tokens": 2,
        "seed": 1,
    }

    def chat(secret: str, stream: bool = False) -> tuple[int, bytes]:
        body = {**ask, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        return send(
            keyed,
            "POST",
            "/v1/chat/completions",
            {"Authorization": f"Bearer {secret}", "content-type": "application/json"},
            json.dumps(body),
        )

    status, data = chat(ADMIN)
    assert status == 200, data
    status, data = chat(ADMIN)  # the same prompt again: the engine's cache holds it
    admin = json.loads(data)
    assert admin["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and admin["timings"]["cache_n"] > 0, admin
    TALLY.inputs += 3
    status, data = chat(SCOPED)
    tenant = json.loads(data)
    assert status == 200 and tenant["usage"]["prompt_tokens"] == admin["usage"]["prompt_tokens"], tenant
    assert not (tenant["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"), tenant
    assert not tenant["timings"].get("cache_n"), tenant["timings"]
    status, data = chat(SCOPED, stream=True)
    assert status == 200 and b'"timings"' in data, data[-400:]
    assert b'"cache_n":0' in data and b'"prompt_n":' in data, data[-400:]
    assert b'"cached_tokens":' not in data.replace(b'"cached_tokens":0', b""), data[-400:]
    status, data = send(
        keyed,
        "POST",
        "/v1/messages",
        {"Authorization": f"Bearer {SCOPED}", "content-type": "application/json"},
        json.dumps({**ask, "max_tokens": 2}),
    )
    assert status == 200 and json.loads(data)["usage"]["cache_read_input_tokens"] == 0, data


# -- 11: a request abandoned mid-generation is counted against its key -------------

METERED = "metered-secret-0123456789"


@pytest.fixture(scope="module")
def metered(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from serving(
        engine,
        tmp_path_factory,
        "metered",
        model="smol",
        real=True,
        more=f'[[keys]]\nname = "metered"\nsecret = "{METERED}"\ndaily_tokens = 10000000\n',
    )


def used_today(daemon: Daemon) -> int:
    import sqlite3

    db = sqlite3.connect(daemon.root / "data" / "blazar.db")
    try:
        return sum(t for (t,) in db.execute("SELECT tokens FROM key_usage WHERE key = 'metered'"))
    finally:
        db.close()


def abandon(daemon: Daemon, body: dict[str, Any], after: float) -> None:
    """
    Send C{body} as the metered key and leave without reading the answer.
    """
    import socket

    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", daemon.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + METERED.encode() + b"\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(raw) + raw
        )
        time.sleep(after)


def test_an_abandoned_request_is_counted_against_its_key(metered: Daemon) -> None:
    """
    The engine kept generating 294-1,538 tokens for requests whose client
    had left, and the key's tpm and daily_tokens saw none of them. Now the
    child stops the task and what it reports for it (the prompt and the
    tokens made until the stop) is counted.
    """
    status, _, data = metered.request(
        "POST",
        "/v1/chat/completions",
        {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        headers={"Authorization": f"Bearer {METERED}"},
    )
    assert status == 200, data
    # the model's end-of-turn tokens banned: it writes until max_tokens
    endless = {
        "model": "smol",
        "max_tokens": 4000,
        "logit_bias": {"0": -100, "1": -100, "2": -100},
        "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
    }
    for stream in (False, True):
        TALLY.inputs += 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the warm-up's usage reaches the store first
            before = used_today(metered)
            time.sleep(1.2)
            if used_today(metered) == before:
                break
        abandon(metered, {**endless, "stream": stream}, after=2.0)
        deadline = time.monotonic() + 15
        while used_today(metered) - before < 40 and time.monotonic() < deadline:
            time.sleep(0.2)
        counted = used_today(metered) - before
        assert counted >= 40, (stream, counted, metered.engine_log("smol:latest")[-1500:])
        assert counted < 4000 + 100, (stream, counted)  # the engine stopped: not all of max_tokens
        print(f"abandoned (stream={stream}): {counted} tokens counted")
    assert "cancel task" in metered.engine_log("smol:latest")


# -- 4: per-key slot isolation for models that want it --------------------------------

ONE, TWO = "isolated-one-0123456789", "isolated-two-0123456789"


@pytest.fixture(scope="module")
def isolated(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from serving(
        engine,
        tmp_path_factory,
        "isolated",
        settings="parallel = 2\nisolate_keys = true\n",
        more=f'[[keys]]\nname = "one"\nsecret = "{ONE}"\n[[keys]]\nname = "two"\nsecret = "{TWO}"\n',
    )


def test_an_isolated_model_reuses_no_other_keys_cache(isolated: Daemon) -> None:
    """
    Keys share a child's slots, and a slot's KV cache shortens (and
    counts, and times) the prompt of whoever shares its prefix. With
    isolate_keys a key's request reuses only its own cache: the cache
    counts are shown here to unscoped keys, which see them.
    """
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the secret is 4817 and more words"}],
        "max_tokens": 2,
        "seed": 1,
    }

    def cached(secret: str) -> int:
        status, data = send(
            isolated,
            "POST",
            "/v1/chat/completions",
            {"Authorization": f"Bearer {secret}", "content-type": "application/json"},
            json.dumps(ask),
        )
        assert status == 200, data
        return int(json.loads(data)["timings"]["cache_n"])

    TALLY.inputs += 4
    assert cached(ONE) == 0
    assert cached(ONE) > 0  # its own cache
    assert cached(TWO) == 0  # not one's, though the prompt is the same
    assert cached(TWO) > 0
    assert cached(ONE) > 0  # each kept its slot


# -- low: an engine stopped mid-stream is found out, not waited for 600 s ------------


@pytest.fixture
def quiet_child(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from serving(
        engine,
        tmp_path_factory,
        "sigstop",
        model="smol",
        real=True,
        settings="parallel = 1\n",
        top="child_header_timeout_secs = 2\n",
    )


def test_a_child_stopped_mid_stream_ends_the_stream_soon(quiet_child: Daemon) -> None:
    import signal

    daemon = quiet_child
    TALLY.faults += 1
    endless = {
        "model": "smol",
        "max_tokens": 4000,
        "stream": True,
        "logit_bias": {"0": -100, "1": -100, "2": -100},
        "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
    }
    stopped_at, child = None, None
    events = daemon.stream("/v1/chat/completions", endless, timeout=60)
    tail = []
    for line, _ in events:
        tail.append(line)
        if stopped_at is None and '"content"' in line:
            child = daemon.engine_for("smol:latest")
            child.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
    assert stopped_at is not None and child is not None
    took = time.monotonic() - stopped_at
    assert took < 15, took  # the child's quiet time (2 s), a failed /health (3 s), the kill
    assert any("stopped answering its health check" in line for line in tail[-3:]), tail[-3:]
    child.wait(10)  # killed (a SIGSTOPped process takes SIGKILL)
    status, _ = daemon.post_json(
        "/v1/chat/completions", {"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 200  # a fresh child
