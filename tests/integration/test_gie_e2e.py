"""
Routable by GIE (issue 42, part 3) against a real daemon and a real
2-slot llama-server child: the vLLM-named gauges on /metrics and
/metrics/models/NAME follow what the model does (running while streams
are in flight, waiting while its slots are full, the KV-cache share as
the child's own /slots says), and GIE's headers reach admission (an
x-slo-ttft-ms deadline ends a wait with 503; an unknown objective is
named in x-blazar-ignored).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from blazar.models.testmodel import GeneratedModel
from tests.integration.conftest import daemon_config
from tests.integration.harness import Daemon

MODEL = "gie"
CANONICAL = "gie:latest"
# ~370 prompt tokens and 1,400 generated (~2 s on the tiny model on a busy
# 2-core machine), inside the 2,048 tokens of each slot
PROMPT = "hello world the a is test model " * 12
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": PROMPT}],
    "stream": True,
    "max_tokens": 1400,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("gie"),
        daemon_config(engine, models) + f'[models."{MODEL}"]\npath = "{models["tiny"].path}"\nparallel = 2\n',
    )
    d.start()
    try:
        yield d
    finally:
        d.close()


def call(d: Daemon, body: Any, **headers: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}},
        )
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def gauges(d: Daemon, path: str = "/metrics") -> dict[str, float]:
    """
    The vLLM-named samples of C{CANONICAL} on C{path}.
    """
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        text = resp.read().decode()
        assert resp.status == 200, text
    finally:
        conn.close()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:") and s.labels.get("model_name") == CANONICAL
    }


def child_slots(d: Daemon) -> list[dict[str, Any]]:
    """
    The child's own C{GET /slots}, with its per-child key.
    """
    argv = d.engine_for(CANONICAL).cmdline()
    port = int(argv[argv.index("--port") + 1])
    key = (d.root / "data" / "run" / f"{CANONICAL.replace(':', '_')}.apikey").read_text().strip()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/slots", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        slots: list[dict[str, Any]] = json.loads(response.read())
    return slots


def kv_share(slots: list[dict[str, Any]]) -> float:
    used = sum(s.get("n_prompt_tokens", 0) for s in slots if s["is_processing"])
    return used / sum(s["n_ctx"] for s in slots)


def in_background(d: Daemon, results: list[tuple[int, dict[str, str], bytes]], body: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(call(d, body)))
    thread.start()
    return thread


def wait_for(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.03)
    raise AssertionError("timed out")


def test_kv_cache_share_is_the_slots_own(daemon: Daemon) -> None:
    status, _, body = call(daemon, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200, body
    assert gauges(daemon)["vllm:kv_cache_usage_perc"] == 0.0  # loaded, nothing running
    results: list[tuple[int, dict[str, str], bytes]] = []
    thread = in_background(daemon, results, LONG)
    seen: list[tuple[float, float, float]] = []
    try:
        # the child's slots, then Blazar's gauge, then the slots again: while one
        # stream runs, its slot only grows, so the gauge lies between the two reads
        def bracketed() -> bool:
            before = child_slots(daemon)
            value = gauges(daemon)["vllm:kv_cache_usage_perc"]
            after = child_slots(daemon)
            if any(s["is_processing"] for s in before) and any(s["is_processing"] for s in after):
                seen.append((kv_share(before), value, kv_share(after)))
            return len(seen) >= 3

        wait_for(bracketed)
    finally:
        thread.join(120)
    assert results and results[0][0] == 200, results
    for before, value, after in seen:
        assert 0 < before <= value <= after <= 1, seen
    # the prompt alone is held while it runs (~370 tokens of the 4,096 of two slots)
    assert seen[0][1] > 300 / 4096, seen
    # finished: the slot keeps its prompt cache, which counts as free (as vLLM's cached blocks)
    slots = child_slots(daemon)
    assert not any(s["is_processing"] for s in slots) and max(s.get("n_prompt_tokens", 0) for s in slots) > 1000
    assert gauges(daemon)["vllm:kv_cache_usage_perc"] == 0.0


def test_running_and_waiting_follow_the_streams(daemon: Daemon) -> None:
    assert gauges(daemon)["vllm:num_requests_running"] == 0.0
    results: list[tuple[int, dict[str, str], bytes]] = []
    threads = [in_background(daemon, results, LONG) for _ in range(3)]
    try:
        # two slots: two run, the third waits in admission; the model's own path says the same. The
        # KV share is the running slots' tokens: 0 until the child has taken their prompts in (a
        # CI run read it in that instant), then above 0 while they run
        full = wait_for(
            lambda: (
                (g := gauges(daemon))["vllm:num_requests_running"] == 2
                and g["vllm:num_requests_waiting"] == 1
                and g["vllm:kv_cache_usage_perc"] > 0
                and g
            )
        )
        assert 0 < full["vllm:kv_cache_usage_perc"] <= 1
        own = gauges(daemon, f"/metrics/models/{MODEL}")
        assert own["vllm:num_requests_running"] == 2 and own["vllm:num_requests_waiting"] >= 1, own
        # GIE's time-to-first-token target is the wait's deadline: 200 ms behind two ~2 s streams
        started = time.monotonic()
        status, headers, body = call(
            daemon, {**LONG, "stream": False}, x_slo_ttft_ms="200", x_gateway_inference_objective="gold-tier"
        )
        waited = time.monotonic() - started
        assert status == 503 and b"all_slots_busy" in body, (status, body)
        assert waited < 1.5, waited
        assert "x-gateway-inference-objective" in headers.get("x-blazar-ignored", ""), headers
    finally:
        for thread in threads:
            thread.join(120)
    assert [r[0] for r in results] == [200, 200, 200], [r[2][:200] for r in results]
    done = gauges(daemon)
    assert done["vllm:num_requests_running"] == 0 and done["vllm:num_requests_waiting"] == 0, done
    unknown = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    unknown.request("GET", "/metrics/models/no-such-model")
    assert unknown.getresponse().status == 404
    unknown.close()
