"""
What Blazar needs to know about a GGUF file, read with the C{gguf} package.

Keys follow the GGUF spec (ggml's C{docs/gguf.md}): C{general.architecture},
C{<arch>.context_length}, C{<arch>.block_count}, C{<arch>.embedding_length},
C{<arch>.attention.head_count[_kv]}, C{<arch>.pooling_type},
C{general.file_type}, C{tokenizer.chat_template}; for the placement
planner also C{<arch>.feed_forward_length},
C{<arch>.attention.key_length|value_length|sliding_window[_pattern]},
C{<arch>.vocab_size} and the tensor infos' sizes (no tensor data is read).
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
    @ivar layer_bytes: Weight bytes of each repeating block, C{blk.N.*}
        (the sum of its tensors' sizes as stored), indexed by C{N}; empty
        for a file without blocks. What a placement moves per layer
        (L{blazar.engines.planner}).
    @ivar other_bytes: Weight bytes outside the blocks (token embedding,
        output norm, output head, ...): C{sum(layer_bytes) + other_bytes}
        is the file's tensor data.
    @ivar output_bytes: The part of C{other_bytes} llama.cpp puts on the
        device of its "output layer" (tensors named C{output*}), plus,
        for a model whose output head is tied to its token embedding (no
        C{output.weight}), C{token_embd.weight} a second time: llama.cpp
        loads that tensor twice, for the input on the CPU and for the
        output head on the output layer's device.
    @ivar input_bytes: The part of C{other_bytes} that llama.cpp always
        keeps on the CPU (the token embedding and every other tensor
        outside the blocks not named C{output*}).
    @ivar feed_forward_length: The widest feed-forward layer
        (C{<arch>.feed_forward_length}, the largest entry of a per-layer
        array), or L{None}.
    @ivar head_count_max: The most query heads of any layer
        (C{<arch>.attention.head_count}), or L{None}.
    @ivar head_counts_kv: KV heads of each layer
        (C{<arch>.attention.head_count_kv}, a number or a per-layer array;
        missing: the query heads): C{block_count} entries, or empty when
        the file has no C{block_count}.
    @ivar key_length: Elements of one K head
        (C{<arch>.attention.key_length}; missing: C{embedding_length //
        head_count}), or L{None} when neither is known.
    @ivar value_length: The same for V (C{<arch>.attention.value_length}).
    @ivar vocab_size: Tokens in the vocabulary, or L{None}.
    @ivar sliding_window: Tokens a sliding-window layer attends to
        (C{<arch>.attention.sliding_window}), or L{None}.
    @ivar swa_layers: Per layer, whether it is a sliding-window layer
        whose KV cache llama.cpp sizes to the window (its C{iswa} cache),
        from C{<arch>.attention.sliding_window_pattern} or the
        architecture's pattern as llama.cpp sets it (L{SWA_PATTERNS});
        empty when no layer is (the safe answer for an architecture not
        known here: every layer full size).
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
    layer_bytes: tuple[int, ...] = ()
    other_bytes: int = 0
    output_bytes: int = 0
    input_bytes: int = 0
    feed_forward_length: int | None = None
    head_count_max: int | None = None
    head_counts_kv: tuple[int, ...] = ()
    key_length: int | None = None
    value_length: int | None = None
    vocab_size: int | None = None
    sliding_window: int | None = None
    swa_layers: tuple[bool, ...] = ()

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
    block_count = _int(reader, f"{arch}.block_count")
    embedding_length = _int(reader, f"{arch}.embedding_length")
    head_count = _int(reader, f"{arch}.attention.head_count")
    head_dim = embedding_length // head_count if embedding_length and head_count else None
    key_length = _int(reader, f"{arch}.attention.key_length") or head_dim
    heads = _per_layer(reader, f"{arch}.attention.head_count", block_count)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return GGUFMetadata(
        architecture=arch,
        context_length=_int(reader, f"{arch}.context_length"),
        block_count=block_count,
        embedding_length=embedding_length,
        head_count=head_count,
        head_count_kv=_int(reader, f"{arch}.attention.head_count_kv"),
        file_type=_int(reader, "general.file_type"),
        has_chat_template=reader.get_field("tokenizer.chat_template") is not None,
        pooling_type=_int(reader, f"{arch}.pooling_type"),
        size=size,
        parameter_count=sum(int(t.n_elements) for t in reader.tensors),
        chat_template=template if isinstance(template, str) else None,
        kv=_elided_kv(reader),
        longest_token=_longest_token(reader),
        **_tensor_bytes(reader.tensors),
        feed_forward_length=max(_per_layer(reader, f"{arch}.feed_forward_length", block_count), default=None)
        or _int(reader, f"{arch}.feed_forward_length"),
        head_count_max=max(heads, default=None) or head_count,
        head_counts_kv=_per_layer(reader, f"{arch}.attention.head_count_kv", block_count) or heads,
        key_length=key_length,
        value_length=_int(reader, f"{arch}.attention.value_length") or key_length,
        vocab_size=_int(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None),
        sliding_window=_int(reader, f"{arch}.attention.sliding_window"),
        swa_layers=_swa_layers(reader, arch, block_count),
    )


def _tensor_bytes(tensors: Any) -> dict[str, Any]:
    """
    C{layer_bytes}, C{other_bytes}, C{output_bytes} and C{input_bytes} of
    L{GGUFMetadata} from the reader's tensor infos (no tensor data read).
    """
    layers: dict[int, int] = {}
    other = output = embedding = 0
    has_output_head = False
    for tensor in tensors:
        name = str(tensor.name)
        n_bytes = int(tensor.n_bytes)
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            layers[int(parts[1])] = layers.get(int(parts[1]), 0) + n_bytes
            continue
        other += n_bytes
        if parts[0] in ("output", "output_norm"):
            output += n_bytes
            has_output_head = has_output_head or name == "output.weight"
        elif name == "token_embd.weight":
            embedding = n_bytes
    return {
        "layer_bytes": tuple(layers.get(i, 0) for i in range(max(layers) + 1)) if layers else (),
        "other_bytes": other,
        "output_bytes": output + (0 if has_output_head else embedding),
        "input_bytes": other - output,
    }


def _per_layer(reader: Any, key: str, block_count: int | None) -> tuple[int, ...]:
    """
    A key that is a number or a per-layer array, as one entry per layer
    (empty when the key or C{block_count} is missing).
    """
    value = _value(reader, key)
    if value is None or not block_count:
        return ()
    if isinstance(value, list):
        numbers = [int(v) for v in value if isinstance(v, (int, float))]
        return tuple(numbers[:block_count]) + (0,) * (block_count - len(numbers))
    return (int(value),) * block_count if isinstance(value, (int, float)) else ()


# The sliding-window pattern llama.cpp sets for an architecture whose file
# has a positive <arch>.attention.sliding_window and no
# <arch>.attention.sliding_window_pattern array (src/models/*.cpp,
# load_swa_pattern): every layer is a sliding-window one except every
# N-th, the last of each period (il % N == N - 1).
SWA_PATTERNS: Mapping[str, int] = {
    "gemma2": 2,
    "gemma3": 6,
    "gemma3n": 5,
    "cohere2": 4,
    "gpt-oss": 2,
    "exaone4": 4,
    "olmo2": 4,
    "llama4": 4,
}


def _swa_layers(reader: Any, arch: str, block_count: int | None) -> tuple[bool, ...]:
    """
    L{GGUFMetadata.swa_layers}: llama.cpp's C{load_swa_pattern}, for the
    architectures in L{SWA_PATTERNS} (or a file with an explicit pattern).
    """
    window = _int(reader, f"{arch}.attention.sliding_window")
    if not block_count or not window:
        return ()
    pattern = _value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        flags = [bool(v) for v in pattern[:block_count]]
        return tuple(flags) + (False,) * (block_count - len(flags)) if any(flags) else ()
    period = int(pattern) if isinstance(pattern, (int, float)) else SWA_PATTERNS.get(arch)
    if period is None:
        return ()
    return tuple(period == 0 or i % period < period - 1 for i in range(block_count))


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
