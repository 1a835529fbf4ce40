"""
What format a model on disk is, for routing it to an engine lane
(L{blazar.engines.lanes}): a C{.gguf} file, or a Hugging Face style
directory of safetensors (plain, or AWQ / GPTQ / FP8 quantized by its
C{config.json}), or an MLX one, or a whisper.cpp model (a ggml C{.bin}).

Blocking (reads a directory and a small JSON file): call in a thread.
"""

from __future__ import annotations

import json
from pathlib import Path


def thd_model_format(path: Path) -> str:
    """
    One of L{blazar.config.MODEL_FORMATS}, or C{unknown}.
    """
    if path.is_file():
        if is_whisper_file(path):
            return "whisper"
        return "gguf" if path.name.endswith(".gguf") else "unknown"
    if not path.is_dir():
        return "gguf" if path.name.endswith(".gguf") else "unknown"
    config: dict[str, object] = {}
    try:
        loaded = json.loads((path / "config.json").read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    quant = config.get("quantization_config")
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    if method in ("awq", "gptq", "fp8"):
        return method
    if "quantization" in config or any(path.glob("*.npz")) or "mlx" in path.name.lower():
        return "mlx"  # mlx-lm writes "quantization": {"group_size", "bits"}
    if any(path.glob("*.safetensors")):
        return "safetensors"
    if any(path.glob("*.gguf")):
        return "gguf"
    return "unknown"


GGML_MAGIC = b"lmgg"  # 0x67676d6c little-endian: whisper.cpp's GGML_FILE_MAGIC


def is_whisper_file(path: Path) -> bool:
    """
    Whether C{path} is a whisper.cpp model: a C{.bin} file that starts
    with the ggml magic.
    """
    if not path.name.endswith(".bin"):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGML_MAGIC
    except OSError:
        return False
