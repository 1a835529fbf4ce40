"""
Engine lanes (L{blazar.engines.lanes}), their config tables and the model
formats that route to them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blazar.config import CommandLane, ConfigError, parse_config
from blazar.engines.lanes import LaneError, lane_argv, lane_error_text, route
from blazar.models.formats import thd_model_format
from tests.typed import not_none

VLLM = (
    '[engines.vllm]\ncommand = ["vllm", "serve", "{model}", "--port", "{port}", "--api-key", "{api_key}"]\n'
    'formats = ["safetensors", "awq"]\n'
)


def test_lanes_in_the_config() -> None:
    config = parse_config(VLLM + '[models."q"]\npath = "/m/q"\nengine = "vllm"\n')
    assert config.lanes == (
        CommandLane(
            "vllm",
            ("vllm", "serve", "{model}", "--port", "{port}", "--api-key", "{api_key}"),
            "/health",
            ("safetensors", "awq"),
            "openai",
        ),
    )
    assert config.models["q:latest"].engine == "vllm"
    for bad, needle in (
        ('[engines.x]\ncommand = ["srv"]\n', "{port}"),
        ('[engines.x]\ncommand = ["srv", "{port}"]\nformats = ["onnx"]\n', "formats"),
        ('[engines.x]\ncommand = ["srv", "{port}"]\napi = "anthropic"\n', "api"),
        ('[engines.x]\ncommand = ["srv", "{port}"]\nhealth = "health"\n', "health"),
        ('[engines.x]\ncommand = ["srv", "{port}"]\nflags = 1\n', "flags"),
        ('[models."q"]\nengine = "nope"\n', "no such engine lane"),
        ('[engines.x]\ncommand = ["srv", "{port}", "{modle}"]\n', "unknown placeholder {modle}"),
        ('[engines.x]\ncommand = ["srv", "{port}"]\napi_key_env = "1X"\n', "api_key_env"),
    ):
        with pytest.raises(ConfigError, match=needle):
            parse_config(bad)


def test_routing_by_pin_then_format() -> None:
    config = parse_config(VLLM + '[engines.fork]\ncommand = ["fork", "{port}"]\nformats = ["gguf"]\n')
    assert route("m", "gguf", None, config) is None  # llama.cpp first for GGUF
    assert not_none(route("m", "gguf", "fork", config)).name == "fork"
    assert not_none(route("m", "awq", None, config)).name == "vllm"
    assert route("m", "safetensors", "llamacpp", config) is None
    with pytest.raises(LaneError) as caught:
        route("m", "mlx", None, config)
    assert str(caught.value) == lane_error_text("m", "mlx") and "mlx_lm.server" in str(caught.value)


def test_the_argv_is_filled_in() -> None:
    lane = CommandLane(
        "x",
        ("srv", "--model={model}", "--port", "{port}", "-k", "{api_key}", "{alias}", "{ctx_size}x{parallel}", "{host}"),
    )
    assert lane_argv(lane, model="/m", port=5, api_key="s", alias="a:latest", ctx_size=512, parallel=2) == [
        "srv",
        "--model=/m",
        "--port",
        "5",
        "-k",
        "s",
        "a:latest",
        "512x2",
        "127.0.0.1",
    ]


def test_formats(tmp_path: Path) -> None:
    def model_dir(name: str, config: object = None, files: tuple[str, ...] = ("model.safetensors",)) -> Path:
        d = tmp_path / name
        d.mkdir()
        if config is not None:
            (d / "config.json").write_text(json.dumps(config))
        for f in files:
            (d / f).write_bytes(b"")
        return d

    assert thd_model_format(model_dir("plain", {"architectures": ["X"]})) == "safetensors"
    assert thd_model_format(model_dir("awq", {"quantization_config": {"quant_method": "awq"}})) == "awq"
    assert thd_model_format(model_dir("g", {"quantization_config": {"quant_method": "GPTQ"}})) == "gptq"
    assert thd_model_format(model_dir("q4", {"quantization": {"group_size": 64, "bits": 4}})) == "mlx"
    assert thd_model_format(model_dir("empty", files=())) == "unknown"
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert thd_model_format(tmp_path / "x.gguf") == "gguf"
    assert thd_model_format(tmp_path / "absent.bin") == "unknown"


def test_the_unknown_architecture_is_read_from_the_engines_output() -> None:
    from blazar.engines.lanes import architecture_error_text, lane_for_architecture, unknown_architecture
    from blazar.engines.process import EngineProcessProtocol

    line = "0.00.011.121 E llama_model_load: error loading model: unknown model architecture: 'blazarnet'"
    assert unknown_architecture(line) == "blazarnet"
    assert unknown_architecture("ｕｎｋｎｏｗｎ model architecture: ‘qwen9’ (full-width, curly quotes)") == "qwen9"
    assert unknown_architecture("llama_model_load: loaded meta data") is None
    protocol = EngineProcessProtocol("m")
    protocol.childDataReceived(2, "noise \udcff\n".encode("utf-8", "surrogateescape"))
    protocol.childDataReceived(2, b"E llama_model_load: error loading model: unknown model archi")
    assert protocol.unknown_architecture() is None
    protocol.childDataReceived(2, b"tecture: 'zorg\xc3")  # an unfinished line, cut inside a UTF-8 sequence
    assert protocol.unknown_architecture() == "zorg\ufffd"
    config = parse_config('[engines.fork]\ncommand = ["f", "{port}"]\narchitectures = ["zorg"]\n')
    assert not_none(lane_for_architecture("zorg", config)).name == "fork"
    assert lane_for_architecture("zorg", config, tried="fork") is None
    assert lane_for_architecture("other", config) is None
    assert "blazar engine install" in architecture_error_text("m", "zorg")
