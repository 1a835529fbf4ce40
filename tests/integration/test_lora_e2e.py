"""
LoRA adapters (issue 39) on the real llama-server: C{lora = [...]} under a
model's table starts its child with C{--lora} / C{--lora-scaled}, the engine
loads the generated adapter (its own C{/lora-adapters} lists it, with the
scale), and a file that is not an adapter is a teaching error before any
child starts.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Iterator

import pytest

from blazar.models.testmodel import make_test_lora, make_test_model
from tests.integration.harness import Daemon


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("lora")
    models = root / "models"
    make_test_model(models / "tiny.gguf")
    make_test_lora(models / "adapters" / "style.gguf")
    make_test_lora(models / "adapters" / "tone, v2.gguf", seed=1, rank=2, targets=("attn_q", "attn_v"))
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\nready_timeout = 60\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\n'
            '[models."tiny"]\nparallel = 1\nthreads = 1\n'
            'lora = ["adapters/style.gguf", {path = "adapters/tone, v2.gguf", scale = 0.5}]\n'
            '[models."broken"]\npath = "tiny.gguf"\nparallel = 1\nthreads = 1\nlora = ["tiny.gguf"]\n'
        ),
    )
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


def test_the_child_loads_the_adapters(daemon: Daemon) -> None:
    status, reply = daemon.post_json(
        "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    )
    assert status == 200, reply
    child = daemon.engine_for("tiny:latest")
    argv = child.cmdline()
    models = daemon.root / "models"
    at = argv.index("--lora")
    assert argv[at : at + 4] == [
        "--lora",
        str(models / "adapters" / "style.gguf"),
        "--lora-scaled",
        f'"{models / "adapters" / "tone, v2.gguf"}":0.5',
    ], argv
    # what the engine itself loaded: its /lora-adapters, asked with the child's own key
    port, key = argv[argv.index("--port") + 1], child.environ()["LLAMA_API_KEY"]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/lora-adapters", headers={"authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        loaded = json.load(r)
    assert [(a["path"], a["scale"]) for a in loaded] == [
        (str(models / "adapters" / "style.gguf"), 1.0),
        (str(models / "adapters" / "tone, v2.gguf"), 0.5),
    ], loaded

    # and applies them: the same greedy step with the adapters switched off for one request (the
    # engine's per-request "lora" scales) gives other probabilities
    def probabilities(**extra: object) -> list[object]:
        body = {"prompt": "hello world", "n_predict": 1, "temperature": 0, "n_probs": 3, "cache_prompt": False, **extra}
        asked = urllib.request.Request(
            f"http://127.0.0.1:{port}/completion",
            data=json.dumps(body).encode(),
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        with urllib.request.urlopen(asked, timeout=30) as r:
            probs = json.load(r)["completion_probabilities"]  # the step's token and top log-probabilities
            assert probs and probs[0]["top_logprobs"], probs
            return list(probs)

    adapted = probabilities()
    assert adapted == probabilities()
    assert probabilities(lora=[{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]) != adapted


def test_a_file_that_is_not_an_adapter_is_a_teaching_error(daemon: Daemon) -> None:
    status, reply = daemon.post_json(
        "/v1/chat/completions", {"model": "broken", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    )
    assert status == 502, reply
    message = reply["error"]["message"]
    assert message.startswith('model "broken:latest": LoRA adapter 1 of 1 is not a LoRA adapter GGUF'), message
    assert "check its lora list" in message and str(daemon.root) not in message, message
    assert [p for p in daemon.engines() if "broken:latest" in p.cmdline()] == []  # nothing was started
