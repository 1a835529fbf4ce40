"""
What Blazar needs to know about a GGUF file, read with the C{gguf} package.

Keys follow the GGUF spec (ggml's C{docs/gguf.md}): C{general.architecture},
C{<arch>.context_length}, C{<arch>.block_count}, C{<arch>.embedding_length},
C{<arch>.attention.head_count[_kv]}, C{<arch>.pooling_type},
C{general.file_type}, C{tokenizer.chat_template}.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs


class GGUFError(Exception):
    """
    A file is not a readable GGUF model; the message names the file.
    """


@attrs.frozen
class GGUFMetadata:
    """
    Facts from one GGUF file's header. Integers are L{None} when the file does
    not carry the key.

    @ivar size: Bytes on disk, summed over every shard of a split model.
    @ivar pooling_type: llama.cpp's C{LLAMA_POOLING_TYPE_*} number
        (0 none, 1 mean, 2 cls, 3 last, 4 rank), or L{None}.
    """

    architecture: str
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    file_type: int | None
    has_chat_template: bool
    pooling_type: int | None
    size: int


def _value(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        return None
    return field.contents()


def _int(reader: Any, key: str) -> int | None:
    value = _value(reader, key)
    if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv)
        value = value[0] if value else None
    return int(value) if isinstance(value, (int, float)) else None


def thd_read_metadata(path: Path, shards: tuple[Path, ...] = ()) -> GGUFMetadata:
    """
    Read C{path}'s header. Blocking: call in a thread pool.

    @param shards: The other files of a split model, counted in C{size}.
    @raise GGUFError: The file is missing or not GGUF.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(os.fspath(path), "r")
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file: {e}") from None
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: GGUF file has no general.architecture")
    size = sum(os.stat(p).st_size for p in (path, *shards))
    return GGUFMetadata(
        architecture=arch,
        context_length=_int(reader, f"{arch}.context_length"),
        block_count=_int(reader, f"{arch}.block_count"),
        embedding_length=_int(reader, f"{arch}.embedding_length"),
        head_count=_int(reader, f"{arch}.attention.head_count"),
        head_count_kv=_int(reader, f"{arch}.attention.head_count_kv"),
        file_type=_int(reader, "general.file_type"),
        has_chat_template=reader.get_field("tokenizer.chat_template") is not None,
        pooling_type=_int(reader, f"{arch}.pooling_type"),
        size=size,
    )
