"""
C{blazar bench} (issue 38) against a real daemon and the real llama-server
on a real model (SmolLM2-135M-Instruct): the run goes through the
gateway's OpenAI API, lands in the daemon's C{bench_history} table with
the child's launch profile, the engine and the hardware, and C{--history}
and the dashboard show it, the latest against the one before. And the
engine gate's speed step on the real engine.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from blazar.gateway.bench import engine_tag
from tests.integration.harness import Daemon, real_model


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("bench")
    (root / "models").mkdir()
    (root / "models" / "smol.gguf").symlink_to(real_model())
    d = Daemon(
        root,
        (
            f'models_dir = "{root / "models"}"\n'
            '[models."smol"]\nparallel = 2\nctx_size = 1024\nthreads = 2\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\n'
        ),
    )
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


def blazar(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "blazar"), *args, "-c", str(daemon.config)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


BENCH = ("bench", "smol", "--concurrency", "1,2", "--prompt-tokens", "48", "--max-tokens", "8", "--rounds", "1")


def test_a_run_lands_and_the_history_compares_it(daemon: Daemon, engine: str) -> None:
    first = blazar(daemon, *BENCH).stdout
    assert "recorded for smol:latest as bench_history id 1" in first, first
    assert "first run of this model" in first, first
    second = json.loads(blazar(daemon, *BENCH, "--json").stdout)
    run: dict[str, Any] = second["run"]
    assert (run["id"], run["model"]) == (2, "smol:latest")
    levels = {level["concurrency"]: level for level in run["levels"]}
    assert set(levels) == {1, 2}
    for concurrency, level in levels.items():
        assert (level["requests"], level["errors"]) == (concurrency, 0), level
        assert level["completion_tokens"] == 8 * concurrency, level  # ignore_eos reached the engine: 8 each
        assert level["prompt_tokens"] >= 48, level  # the synthetic prompt's words, as the engine counted them
        assert level["ttft_ms"] > 0 and level["gen_tps"] > 0 and level["pp_tps"] > 0, level
        assert level["engine_gen_tps"] > 0, level  # llama-server's own figure came through the gateway
    # what only the daemon knows: the child's command line, the engine, the machine
    argv = run["profile"]["argv"]
    assert argv[0] == engine and "--port" not in argv, argv
    assert argv[argv.index("--alias") + 1] == "smol:latest" and argv[argv.index("--threads") + 1] == "2", argv
    assert argv[argv.index("-np") + 1] == "2", argv
    assert run["engine"] == engine_tag(engine, None)
    assert run["hardware"]["cpu_logical_cores"] == psutil.cpu_count(logical=True)
    assert run["settings"]["max_tokens"] == 8
    comparison = second["comparison"]
    assert (comparison["before"], comparison["after"], comparison["changes"]) == (1, 2, [])
    assert [level["concurrency"] for level in comparison["levels"]] == [1, 2]

    # the rows are in the daemon's SQLite state
    db = sqlite3.connect(f"file:{daemon.root / 'data' / 'blazar.db'}?mode=ro", uri=True)
    try:
        assert db.execute("SELECT id, model, engine FROM bench_history ORDER BY id").fetchall() == [
            (1, "smol:latest", run["engine"]),
            (2, "smol:latest", run["engine"]),
        ]
    finally:
        db.close()

    history = blazar(daemon, "bench", "--history", "smol").stdout
    assert "run 2 against run 1:" in history, history
    assert "same engine, profile, hardware and settings" in history, history
    listed = json.loads(blazar(daemon, "bench", "--history", "smol", "--json").stdout)
    assert [r["id"] for r in listed["runs"]] == [2, 1]
    assert listed["comparisons"]["smol:latest"]["after"] == 2

    # the dashboard's Performance page reads the same history
    status, _, body = daemon.request("GET", "/ui/api/bench")
    assert status == 200, body
    shown = json.loads(body)
    assert [r["id"] for r in shown["runs"]] == [2, 1]
    assert shown["comparisons"]["smol:latest"]["levels"][0]["gen_tps"]["after"] == levels[1]["gen_tps"]


def test_a_model_the_gateway_refuses_is_a_failed_run_not_a_row(daemon: Daemon) -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "blazar"), "bench", "nope", "--concurrency", "1", "-c", str(daemon.config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the warm-up request failed: HTTP 404" in result.stderr, result.stderr


def test_the_gates_speed_step_on_the_real_engine(engine: str) -> None:
    from blazar.engines.gate import SPEED, STEPS, thd_gate

    said: list[str] = []
    passed = thd_gate(Path(engine), said.append, baseline=Path(engine), max_slowdown=0.9)
    assert passed == [*STEPS, SPEED]
    assert any(line.startswith("gate: decodes ") for line in said), said
