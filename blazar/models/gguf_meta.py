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
from typing import Any, Mapping

import attrs


class GGUFError(Exception):
    """
    A file is not a readable GGUF model. The message names the file, so it
    is for the daemon's log, not for clients:
    L{blazar.models.registry.ModelUnreadable}, which the registry raises,
    names the model instead.

    @ivar path: The file.
    @ivar reason: What is wrong with it, without its path, to follow
        "its file" (C{"cannot be read (Permission denied)"}).
    @ivar hint: What to check, without the path.
    """

    def __init__(self, path: Path, reason: str, hint: str = "check the file", message: str | None = None) -> None:
        super().__init__(f"{path}: {reason}" if message is None else message)
        self.path = path
        self.reason = reason
        self.hint = hint


def unreadable(path: Path, error: OSError, what: str = "cannot be read") -> GGUFError:
    """
    The L{GGUFError} for an C{OSError} met reading C{path}: its reason is
    C{what} and the system's words (C{strerror}, which hold no path), its
    hint what to check for that C{errno}.
    """
    why = error.strerror or type(error).__name__
    if isinstance(error, PermissionError):
        hint = "check the file's permissions: the daemon's user must be able to read it"
    elif isinstance(error, FileNotFoundError):
        hint = "check that the file was not moved or deleted"
    else:
        hint = "check the file"
    return GGUFError(path, f"{what} ({why})", hint)


@attrs.frozen
class GGUFMetadata:
    """
    Facts from one GGUF file's header. Integers are L{None} when the file does
    not carry the key.

    @ivar size: Bytes on disk, summed over every shard of a split model.
    @ivar pooling_type: llama.cpp's C{LLAMA_POOLING_TYPE_*} number
        (0 none, 1 mean, 2 cls, 3 last, 4 rank), or L{None}.
    @ivar longest_token: Bytes of the longest entry of the vocabulary
        (C{tokenizer.ggml.tokens}, as stored: at least the text any one
        token stands for), or L{None}: a prompt of C{n} bytes of text is at
        least C{n // longest_token} tokens.
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
    parameter_count: int = 0
    chat_template: str | None = None
    kv: Mapping[str, Any] = attrs.field(factory=dict)
    longest_token: int | None = None

    @property
    def quantization_level(self) -> str:
        """
        The file type's name as Ollama shows it (C{"Q4_K_M"}, C{"F16"}).
        """
        from gguf import LlamaFileType

        if self.file_type is None:
            return "unknown"
        try:
            name = LlamaFileType(self.file_type).name
        except ValueError:
            return f"type {self.file_type}"
        return name.replace("MOSTLY_", "").replace("ALL_", "")

    @property
    def parameter_size(self) -> str:
        """
        The parameter count as Ollama shows it (C{"7.6B"}, C{"494.03M"}).
        """
        n = self.parameter_count
        if n >= 1_000_000_000:
            return f"{n / 1e9:.1f}B"
        if n >= 1_000_000:
            return f"{n / 1e6:.2f}M"
        if n >= 1_000:
            return f"{n / 1e3:.2f}K"
        return str(n)


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

    replace = "replace the file (pull the model again)"
    try:
        reader = GGUFReader(os.fspath(path), "r")
    except OSError as e:
        raise unreadable(path, e) from None
    except ValueError as e:  # gguf's and numpy's words name no path
        raise GGUFError(path, f"is not a readable GGUF file ({e})", replace) from None
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(path, "is a GGUF file without general.architecture", replace)
    try:
        size = sum(os.stat(p).st_size for p in (path, *shards))
    except OSError as e:
        shard = Path(e.filename).name if isinstance(e.filename, str) else "a shard"
        raise unreadable(path, e, f"has a missing or unreadable shard, {shard}") from None
    template = _value(reader, "tokenizer.chat_template")
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
        parameter_count=sum(int(t.n_elements) for t in reader.tensors),
        chat_template=template if isinstance(template, str) else None,
        kv=_elided_kv(reader),
        longest_token=_longest_token(reader),
    )


def _longest_token(reader: Any) -> int | None:
    field = reader.get_field("tokenizer.ggml.tokens")
    if field is None or not field.data:
        return None
    try:
        return max(len(field.parts[i]) for i in field.data) or None
    except (IndexError, TypeError):
        return None


MAX_ARRAY = 64


def _elided_kv(reader: Any) -> dict[str, Any]:
    """
    Every key/value pair except the header's bookkeeping, with arrays longer
    than L{MAX_ARRAY} (vocabularies, merges) replaced by L{None}, as Ollama's
    C{/api/show} does without C{verbose}.
    """
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if len(field.data) > MAX_ARRAY and field.types and field.types[0].name == "ARRAY":
            out[name] = None
            continue
        try:
            out[name] = field.contents()
        except Exception:
            out[name] = None
    return out


def template_capabilities(template: str | None) -> list[str]:
    """
    What a chat template shows the model, beyond messages: C{tools} (it
    renders the offered tools) and C{thinking} (it has a reasoning block),
    as Ollama's C{/api/show} C{capabilities} name them.
    """
    text = template or ""
    caps = []
    if "tools" in text:
        caps.append("tools")
    if "<think>" in text or "enable_thinking" in text or "reasoning_content" in text:
        caps.append("thinking")
    return caps
