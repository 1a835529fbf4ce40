"""
Ollama's num_ctx with real llama-server children: under ctx_policy "grow"
(the default) a larger num_ctx restarts the model once with that context,
after the requests running on the old child finish; "fit" keeps the 400.

One daemon for the module. Its chat model is trained for 8192 tokens and
configured to start at 1024 per slot; it is a little larger than the usual
test model (8 layers of 256) so that a long answer runs for a few seconds,
long enough for a growing request to arrive in the middle of it.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from blazar.models.testmodel import make_test_model, vocabulary
from tests.integration.harness import Daemon, alive

HELLO = [{"role": "user", "content": "hi"}]
MODEL = "grow:latest"
EMBED = "grow-embed:latest"


def config_text(models: Path, engine: str, policy: str) -> str:
    return (
        f'models_dir = "{models}"\nctx_policy = "{policy}"\n'
        "ready_timeout = 60\nstop_grace = 5\nbreaker_crashes = 1000\ndrain_timeout_secs = 60\n"
        f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        '[models."grow"]\npath = "grow.gguf"\nctx_size = 1024\n'
        '[models."grow-embed"]\npath = "grow-embed.gguf"\nctx_size = 512\nembedding = true\n'
    )


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("num_ctx")
    models = root / "models"
    make_test_model(models / "grow.gguf", context_length=8192, n_embd=256, n_layer=8, n_ff=1024)
    make_test_model(models / "grow-embed.gguf", seed=1, embedding=True, context_length=8192)
    d = Daemon(root, config_text(models, engine, "grow"))
    d.start()
    try:
        yield d
    finally:
        d.close()


def chat(d: Daemon, num_ctx: int | None = None, num_predict: int = 2, path: str = "/api/chat") -> tuple[int, Any]:
    options: dict[str, Any] = {"num_predict": num_predict}
    if num_ctx is not None:
        options["num_ctx"] = num_ctx
    body: dict[str, Any] = {"model": "grow", "stream": False, "keep_alive": "10m", "options": options}
    if path == "/api/chat":
        body["messages"] = HELLO
    else:
        body["prompt"] = "hi"
    return d.post_json(path, body)


def unload(d: Daemon, model: str = MODEL) -> None:
    """
    Start the test from nothing loaded (keep_alive 0), waiting for the exit.
    """
    children = [p for p in d.engines() if p.cmdline()[p.cmdline().index("--alias") + 1] == model]
    assert d.request("POST", "/api/generate", {"model": model, "keep_alive": 0})[0] == 200
    for child in children:
        child.wait(15)


def ps_context(d: Daemon, model: str = MODEL) -> int:
    status, _, body = d.request("GET", "/api/ps")
    assert status == 200
    (entry,) = [m for m in json.loads(body)["models"] if m["name"] == model]
    return int(entry["context_length"])


def engine_n_ctx(d: Daemon, model: str = MODEL) -> int:
    """
    The context per slot the child itself reports (its /props, asked
    with the child's own key from the run files).
    """
    run = d.root / "data" / "run"
    stem = model.replace(":", "_")
    port = json.loads((run / f"{stem}.pid").read_text())["port"]
    key = (run / f"{stem}.apikey").read_text()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/props", headers={"authorization": f"Bearer {key}"})
        resp = conn.getresponse()
        props = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200, props
    return int(props["default_generation_settings"]["n_ctx"])


def grows_logged(d: Daemon, to: int) -> int:
    """
    How many times the daemon stopped the model to grow it to C{to}.
    """
    return sum(
        1
        for line in d.log().splitlines()
        if f"stopping {MODEL}: context" in line and f"-> {to} tokens per slot" in line
    )


def test_larger_num_ctx_restarts_once_then_smaller_ones_do_not(daemon: Daemon) -> None:
    unload(daemon)
    assert chat(daemon)[0] == 200
    small = daemon.engine_for(MODEL)
    assert (ps_context(daemon), engine_n_ctx(daemon)) == (1024, 1024)
    status, body = chat(daemon, num_ctx=4096)
    assert status == 200, body
    grown = daemon.engine_for(MODEL)
    assert grown.pid != small.pid and not alive(small)
    assert (ps_context(daemon), engine_n_ctx(daemon)) == (4096, 4096)
    assert grows_logged(daemon, 4096) == 1
    # the grown context stays: smaller, equal or no num_ctx, any surface
    for num_ctx, path in [(2048, "/api/chat"), (None, "/api/chat"), (4096, "/api/generate"), (512, "/api/generate")]:
        status, body = chat(daemon, num_ctx=num_ctx, path=path)
        assert status == 200, body
    status, body = daemon.post_json("/v1/chat/completions", {"model": "grow", "messages": HELLO, "max_tokens": 2})
    assert status == 200, body
    assert daemon.engine_for(MODEL).pid == grown.pid
    assert grows_logged(daemon, 4096) == 1


def test_num_ctx_above_the_trained_context_is_clamped(daemon: Daemon) -> None:
    unload(daemon)
    status, body = chat(daemon, num_ctx=1_000_000, path="/api/generate")
    assert status == 200, body
    assert (ps_context(daemon), engine_n_ctx(daemon)) == (8192, 8192)  # the GGUF's context_length
    # a prompt that cannot fit even in the trained context: the preflight's 400 says why
    status, body = chat(daemon, num_ctx=1_000_000, num_predict=9000)
    assert status == 400, body
    assert "8192-token context" in body["error"] and "was trained for" in body["error"], body


def test_a_request_running_on_the_small_child_completes(daemon: Daemon) -> None:
    unload(daemon)
    assert chat(daemon)[0] == 200
    small = daemon.engine_for(MODEL)
    # a long answer on the 1024-token child: every control token (end of
    # turn, end of text, ...) pushed away, so it runs to num_predict
    tokens, types = vocabulary()
    no_end = {str(i): -100 for i, kind in enumerate(types) if kind == types[tokens.index("<|im_end|>")]}
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
    conn.request(
        "POST",
        "/api/chat",
        json.dumps(
            {
                "model": "grow",
                "messages": HELLO,
                "stream": True,
                "options": {"num_predict": 900, "logit_bias": no_end},
            }
        ),
        {"content-type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    first = json.loads(resp.readline())
    assert first["done"] is False
    results: dict[str, Any] = {}

    def send(name: str, num_ctx: int | None) -> None:
        results[name] = chat(daemon, num_ctx=num_ctx)
        results[name + "_at"] = time.monotonic()

    grow = threading.Thread(target=send, args=("grow", 4096))
    grow.start()
    time.sleep(0.3)  # the grow is draining the small child now
    plain = threading.Thread(target=send, args=("plain", None))
    plain.start()
    lines = [json.loads(raw) for raw in resp]
    stream_end = time.monotonic()
    conn.close()
    grow.join(120)
    plain.join(120)
    final = lines[-1]
    assert not any("error" in line for line in lines), lines[-3:]
    assert final["done"] is True and final["eval_count"] == 900, final  # not cut short
    assert results["grow"][0] == 200 and results["plain"][0] == 200, results
    # the grow waited for the running answer; the request that came after
    # it waited for the grown child instead of taking the small one
    assert results["grow_at"] > stream_end and results["plain_at"] > stream_end
    assert not alive(small)
    assert ps_context(daemon) == 4096
    assert "stopping grow:latest: context 1024 -> 4096" in daemon.log()


def test_a_load_request_starts_with_its_num_ctx(daemon: Daemon) -> None:
    unload(daemon)
    status, _, body = daemon.request("POST", "/api/generate", {"model": "grow", "options": {"num_ctx": 2048}})
    assert status == 200 and json.loads(body)["done_reason"] == "load", body
    assert (ps_context(daemon), engine_n_ctx(daemon)) == (2048, 2048)


def test_num_ctx_on_api_embed(daemon: Daemon) -> None:
    unload(daemon, EMBED)
    status, body = daemon.post_json("/api/embed", {"model": "grow-embed", "input": "hi"})
    assert status == 200, body
    assert ps_context(daemon, EMBED) == 512
    status, body = daemon.post_json(
        "/api/embed", {"model": "grow-embed", "input": ["hi", "there"], "options": {"num_ctx": 2048}}
    )
    assert status == 200, body
    assert len(body["embeddings"]) == 2
    assert (ps_context(daemon, EMBED), engine_n_ctx(daemon, EMBED)) == (2048, 2048)


def test_fit_policy_keeps_the_400(daemon: Daemon, engine: str) -> None:
    import subprocess
    import sys

    models = daemon.root / "models"

    def reload(policy: str) -> None:
        daemon.config.write_text(
            f'listen = "tcp:{daemon.port}:interface=127.0.0.1"\ndata_dir = "{daemon.root / "data"}"\n'
            + config_text(models, engine, policy)
        )
        out = subprocess.run(
            [str(Path(sys.executable).parent / "blazar"), "reload", "-c", str(daemon.config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr

    reload("fit")
    try:
        unload(daemon)
        assert chat(daemon)[0] == 200
        child = daemon.engine_for(MODEL)
        # an answer longer than the loaded 1024 tokens, within the asked 4096
        status, body = chat(daemon, num_ctx=4096, num_predict=2000)
        assert status == 400, body
        assert "1024-token context" in body["error"] and 'ctx_policy = "fit"' in body["error"], body
        assert daemon.engine_for(MODEL).pid == child.pid and ps_context(daemon) == 1024
    finally:
        reload("grow")
    # the same request under "grow": the model restarts with 4096 and answers
    status, body = chat(daemon, num_ctx=4096, num_predict=2000)
    assert status == 200, body
    assert ps_context(daemon) == 4096
