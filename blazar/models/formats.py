"""
What format a model on disk is, for routing it to an engine lane
(L{blazar.engines.lanes}): a C{.gguf} file, or a Hugging Face style
directory of safetensors (plain, or AWQ / GPTQ / FP8 quantized by its
C{config.json}), or an MLX one.

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
