"""
/metrics end to end: a scripted mix of requests on all three surfaces
(successes, an unknown model, a 401, a 429, a child killed mid-stream)
against a real daemon and llama-server child; the scraped values equal
what the script did, and every series parses with prometheus_client's
text parser. The engine hints job, on a Clock, scrapes the real child.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.request
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock

from blazar.engines.hints import EngineHints
from blazar.metrics import Metrics
from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

ADMIN = "admin-secret-0123456789"
LIMITED = "one-per-minute-0123456789"
HELLO = [{"role": "user", "content": "hi"}]
MODEL = "tiny:latest"
VLLM_GAUGES = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("metrics"),
        daemon_config(engine, models)
        + (
            f'[[keys]]\nname = "admin"\nsecret = "{ADMIN}"\n[[keys]]\nname = "limited"\nsecret = "{LIMITED}"\nrpm = 1\n'
        ),
    )
    d.start()
    try:
        yield d
    finally:
        d.close()


def call(d: Daemon, path: str, body: Any, secret: str | None = ADMIN) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    headers = {"content-type": "application/json"}
    if secret:
        headers["authorization"] = f"Bearer {secret}"
    try:
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def stream_lines(d: Daemon, body: Any, kill: bool = False) -> list[Any]:
    """
    A streamed OpenAI chat; with C{kill}, SIGKILL the child after its
    third event (so the stream has inter-chunk gaps to measure).
    """
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {ADMIN}"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        events: list[str] = []
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: "):
                continue
            if kill and len(events) == 3:
                d.engine_for(MODEL).send_signal(signal.SIGKILL)
            events.append(line[6:])
        return [json.loads(e) for e in events if e != "[DONE]"]
    finally:
        conn.close()


def scrape(d: Daemon) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"authorization": f"Bearer {ADMIN}"})  # how Prometheus scrapes
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("content-type", "").startswith("text/plain")
        text = resp.read().decode()
    finally:
        conn.close()
    samples = {}
    for family in text_string_to_metric_families(text):  # every series must parse
        # Blazar's own, and the vLLM-named gauges GIE's endpoint picker reads (docs/gie.md)
        assert family.name.startswith("blazar_") or family.name in VLLM_GAUGES, family.name
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_scripted_mix_is_counted_exactly(daemon: Daemon) -> None:
    tokens = {"admin": [0, 0], "limited": [0, 0]}

    def add(key: str, prompt: int, completion: int) -> None:
        tokens[key][0] += prompt
        tokens[key][1] += completion

    # OpenAI: a chat, a stream with usage, an unknown model
    status, body = call(daemon, "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 5})
    assert status == 200, body
    add("admin", body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    chunks = stream_lines(
        daemon,
        {
            "model": "tiny",
            "messages": HELLO,
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    usage = chunks[-1]["usage"]
    add("admin", usage["prompt_tokens"], usage["completion_tokens"])
    status, body = call(daemon, "/v1/chat/completions", {"model": "nope", "messages": HELLO})
    assert status == 404, body
    # Anthropic: no key (401), then a message
    status, body = call(daemon, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HELLO}, secret=None)
    assert status == 401, body
    status, body = call(daemon, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HELLO})
    assert status == 200, body
    # (Anthropic's input_tokens leaves out what came from the cache)
    add(
        "admin",
        body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"],
        body["usage"]["output_tokens"],
    )
    # Ollama: one per minute for "limited": 200 then 429
    ollama = {"model": "tiny", "messages": HELLO, "stream": False, "options": {"num_predict": 3}}
    status, body = call(daemon, "/api/chat", ollama, secret=LIMITED)
    assert status == 200, body
    add("limited", body["prompt_eval_count"], body["eval_count"])
    status, body = call(daemon, "/api/chat", ollama, secret=LIMITED)
    assert status == 429, body
    # a child killed mid-stream, then a request that respawns it
    chunks = stream_lines(daemon, {"model": "tiny", "messages": HELLO, "stream": True, "ignore_eos": True}, kill=True)
    assert "error" in chunks[-1], chunks[-1]
    status, body = call(daemon, "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 2})
    assert status == 200, body
    add("admin", body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])

    m = scrape(daemon)
    requests = {
        ("openai", MODEL, "admin", "2xx"): 4,
        ("openai", "", "admin", "4xx"): 1,
        ("anthropic", "", "", "4xx"): 1,
        ("anthropic", MODEL, "admin", "2xx"): 1,
        ("ollama", MODEL, "limited", "2xx"): 1,
        ("ollama", MODEL, "limited", "4xx"): 1,
    }
    seen = {
        (dict(labels)["surface"], dict(labels)["model"], dict(labels)["key"], dict(labels)["status"]): v
        for (name, labels), v in m.items()
        if name == "blazar_requests_total"
    }
    assert seen == requests
    errors = {
        (dict(labels)["surface"], dict(labels)["model"], dict(labels)["kind"]): v
        for (name, labels), v in m.items()
        if name == "blazar_errors_total"
    }
    assert errors == {
        ("openai", "", "model_not_found"): 1,
        ("anthropic", "", "auth"): 1,
        ("ollama", MODEL, "quota"): 1,
        ("openai", MODEL, "engine_crash"): 1,
    }
    for key, (prompt, completion) in tokens.items():
        assert value(m, "blazar_prompt_tokens_total", model=MODEL, key=key) == prompt, (key, m)
        assert value(m, "blazar_completion_tokens_total", model=MODEL, key=key) == completion, key
    assert value(m, "blazar_engine_crashes_total", model=MODEL) == 1
    assert value(m, "blazar_loads_total", model=MODEL) == 2
    assert value(m, "blazar_load_duration_seconds_count", model=MODEL) == 2
    assert value(m, "blazar_instances_loaded", state="ready") == 1
    for surface in ("openai", "anthropic", "ollama"):
        assert value(m, "blazar_requests_in_flight", surface=surface) == 0
    # every admitted request waited in the queue (the 401 and 429 never got there)
    assert value(m, "blazar_queue_wait_seconds_count", model=MODEL, priority="normal", **{"class": "interactive"}) == 6
    assert value(m, "blazar_slots_total", model=MODEL) == 4
    assert value(m, "blazar_slots_busy", model=MODEL) == 0
    # TTFT/TPOT: the two OpenAI streams, and the Anthropic reply (streamed from the child)
    for surface, count in (("openai", 2), ("anthropic", 1)):
        assert value(m, "blazar_time_to_first_token_seconds_count", surface=surface, model=MODEL) == count
        assert value(m, "blazar_time_per_output_token_seconds_count", surface=surface, model=MODEL) == count
    assert value(m, "blazar_time_to_first_token_seconds_sum", surface="openai", model=MODEL) > 0
    assert value(m, "blazar_build_info", version=__import__("blazar").__version__) == 1


def test_metrics_never_carry_trace_ids_or_prompts(daemon: Daemon) -> None:
    secret_prompt = "a prompt nobody should see in metrics"
    call(
        daemon,
        "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": secret_prompt}]},
    )
    text = " ".join(str(k) for k in scrape(daemon))
    assert secret_prompt not in text and "plm-" not in text


def test_engine_hints_job_scrapes_the_real_child(daemon: Daemon) -> None:
    assert call(daemon, "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 2})[0] == 200
    argv = daemon.engine_for(MODEL).cmdline()
    port = int(argv[argv.index("--port") + 1])
    api_key = (daemon.root / "data" / "run" / "tiny_latest.apikey").read_text()
    pid = daemon.engine_for(MODEL).pid

    class Child:
        state = "ready"
        base_url = f"http://127.0.0.1:{port}"
        auth_headers = {b"authorization": [f"Bearer {api_key}".encode()]}
        entry = type("Entry", (), {"name": MODEL})()
        pid: int

    Child.pid = pid

    async def fetch(url: str, headers: dict[bytes, list[bytes]]) -> tuple[int, bytes]:
        request = urllib.request.Request(url, headers={k.decode(): v[0].decode() for k, v in headers.items()})
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()

    clock, metrics = Clock(), Metrics()
    hints = EngineHints(lambda: [Child()], fetch, clock, metrics)
    hints.startService()
    try:
        clock.advance(60)
        first = metrics.registry.get_sample_value("blazar_engine_cache_hit_ratio", {"model": MODEL})
        assert first is not None
        assert metrics.registry.get_sample_value("blazar_engine_prompt_tokens_total", {"model": MODEL})
        # the same prompt again and again: almost all of it comes from the KV cache
        for _ in range(5):
            assert call(daemon, "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 2})[0] == 200
        time.sleep(0.2)
        clock.advance(60)
        second = metrics.registry.get_sample_value("blazar_engine_cache_hit_ratio", {"model": MODEL})
        assert second is not None and second > first, (first, second)
    finally:
        hints.stopService()
