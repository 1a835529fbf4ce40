"""
Launch profiles (issue 38) on the real llama-server (the CPU build): the
argv a child gets is the model's profile, the engine takes it (its own log
says so), and Ollama's per-request placement reloads the model with it.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("profile")
    # a head size of 32: a q8_0 KV cache needs whole blocks of 32 per head
    make_test_model(root / "models" / "tiny.gguf", n_embd=128, n_head=4, n_ff=256)
    make_test_model(root / "models" / "plain.gguf", seed=1)
    make_test_model(root / "models" / "narrow.gguf", seed=2)  # heads of 16: no whole q8_0 block
    d = Daemon(
        root,
        (
            f'models_dir = "{root / "models"}"\n'
            '[models."tiny"]\nparallel = 2\ngpu_layers = 5\ncache_type_k = "q8_0"\ncache_type_v = "q8_0"\n'
            'flash_attn = "on"\nthreads = 1\nuse_mmap = false\n'
            '[models."plain"]\nparallel = 1\nthreads = 1\n'
            '[models."narrow"]\nparallel = 1\nthreads = 1\ncache_type_k = "q8_0"\ncache_type_v = "q8_0"\nflash_attn = "on"\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\n'
        ),
    )
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


def flag(argv: list[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last one wins, as in llama.cpp


def test_the_child_runs_with_the_models_profile(daemon: Daemon) -> None:
    status, reply = daemon.post_json(
        "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert status == 200, reply
    argv = daemon.engine_for("tiny:latest").cmdline()
    assert (flag(argv, "-ngl"), flag(argv, "-ctk"), flag(argv, "-ctv"), flag(argv, "-fa"), flag(argv, "--threads")) == (
        "5",
        "q8_0",
        "q8_0",
        "on",
        "1",
    ), argv
    assert flag(argv, "--load-mode") == "none"
    # what the engine itself says it runs with (its default verbosity prints no KV cache type; the
    # argv line at the top of this log names the flags, not "n_threads = ")
    assert "n_threads = 1" in daemon.engine_log("tiny:latest")
    # the engine applies the KV cache type: a model whose heads are 16 wide has no whole q8_0 block
    status, reply = daemon.post_json(
        "/v1/chat/completions", {"model": "narrow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert status == 502 and "n_embd_head_k" in reply["error"]["message"], reply


def test_ollamas_placement_reloads_the_model_with_it(daemon: Daemon) -> None:
    ask = {
        "model": "plain",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "options": {"num_predict": 2},
    }
    status, reply = daemon.post_json("/api/chat", ask)
    assert status == 200, reply
    first = daemon.engine_for("plain:latest")
    assert "-ngl" not in first.cmdline()
    status, reply = daemon.post_json("/api/chat", {**ask, "options": {"num_predict": 2, "num_gpu": 7, "num_thread": 1}})
    assert status == 200, reply
    second = daemon.engine_for("plain:latest")
    assert second.pid != first.pid, "not reloaded"
    assert flag(second.cmdline(), "-ngl") == "7", second.cmdline()
    status, reply = daemon.post_json("/api/chat", ask)  # none asked: the placement stays
    assert status == 200 and daemon.engine_for("plain:latest").pid == second.pid, reply


def test_a_model_too_large_for_the_memory_budget_is_a_teaching_503(
    engine: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """
    memory_budget_bytes stands in for a small GPU: a model whose estimate
    (weights + KV cache) is over it is refused before any child starts,
    in each surface's shape, naming the levers.
    """
    root = tmp_path_factory.mktemp("budget")
    make_test_model(root / "models" / "tiny.gguf")
    d = Daemon(
        root,
        (
            f'models_dir = "{root / "models"}"\nmemory_budget_bytes = 65536\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        ),
    )
    d.start()
    try:
        for path, body in (
            (
                "/v1/chat/completions",
                {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            ),
            ("/api/chat", {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": "hi"}]}),
        ):
            status, headers, data = d.request("POST", path, body)
            assert status == 503, (path, status, data[:300])
            text = data.decode()
            assert "memory_budget_bytes" in text and "ctx_size" in text and "parallel" in text, text
        assert d.engines() == []  # no child was started
    finally:
        d.close()
