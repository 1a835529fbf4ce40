"""
Speculative decoding with a draft model: the draft must speak the target's
vocabulary, checked at config load.

llama-server verifies a draft model's tokens with the target model, token
id for token id, so the two GGUFs must hold the same tokenizer: the same
C{tokenizer.ggml.model} (C{gpt2}, C{llama}, ...), the same number of tokens
and the same token list (C{tokenizer.ggml.tokens}, compared by a SHA-256
of the tokens in order). A pair that differs is refused when the config is
loaded (L{thd_check_drafts}), not found out from a child that drafts
nothing useful or dies.

Blocking (reads GGUF headers): C{blazar.tap} calls it synchronously while
twistd starts, and C{blazar reload} in a thread
(L{blazar.protocols.keyadmin.thd_load_checked}).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Callable

import attrs

from blazar.config import Config, ConfigError
from blazar.models.gguf_meta import GGUFError, unreadable
from blazar.models.registry import ModelEntry, thd_scan
from blazar.names import name_key


@attrs.frozen
class Vocabulary:
    """
    A GGUF's tokenizer, as far as drafting cares.

    @ivar kind: C{tokenizer.ggml.model} (C{"gpt2"}, C{"llama"}), or L{None}.
    @ivar size: How many tokens C{tokenizer.ggml.tokens} holds.
    @ivar digest: SHA-256 (hex) of the tokens in order, each followed by a
        NUL byte.
    """

    kind: str | None
    size: int
    digest: str


# vocabularies read, by (path, size, mtime_ns): a file is read once per process, not at each
# check (startup's two passes, each reload)
_READ: dict[tuple[str, int, int], Vocabulary] = {}


def thd_vocabulary(path: Path) -> Vocabulary:
    """
    Read C{path}'s tokenizer (once per file as it is: remembered by its
    size and modification time). Blocking: reads the GGUF header.

    @raise GGUFError: The file cannot be read, is not GGUF, or has no token
        list.
    """
    try:
        stat = path.stat()
    except OSError as e:
        raise unreadable(path, e) from None
    key = (os.fspath(path), stat.st_size, stat.st_mtime_ns)
    known = _READ.get(key)
    if known is None:
        known = _READ[key] = _read_vocabulary(path)
    return known


def _read_vocabulary(path: Path) -> Vocabulary:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(os.fspath(path), "r")
        tokens = reader.get_field("tokenizer.ggml.tokens")
        if tokens is None:
            raise GGUFError(path, "has no tokenizer.ggml.tokens (no vocabulary)", "use a model GGUF")
        digest = hashlib.sha256()
        for index in tokens.data:
            digest.update(bytes(tokens.parts[index]))
            digest.update(b"\0")
        model = reader.get_field("tokenizer.ggml.model")
        kind = model.contents() if model is not None else None
    except OSError as e:
        raise unreadable(path, e) from None
    except (ValueError, IndexError, KeyError, TypeError, struct.error) as e:
        # (gguf's reader raises IndexError and the like on a file cut short: one still being copied)
        raise GGUFError(path, f"is not a readable GGUF file ({e})", "check the file") from None
    return Vocabulary(kind if isinstance(kind, str) else None, len(tokens.data), digest.hexdigest())


def _differs(target: Vocabulary, draft: Vocabulary) -> str | None:
    """
    How C{draft}'s vocabulary differs from C{target}'s, in words; L{None}
    when they are the same.
    """
    if target.kind != draft.kind:
        return f"its tokenizer is {draft.kind!r} and the model's is {target.kind!r}"
    if target.size != draft.size:
        return f"it has {draft.size} tokens and the model has {target.size}"
    if target.digest != draft.digest:
        return f"both have {target.size} tokens, but not the same ones"
    return None


def thd_check_drafts(
    config: Config,
    scan: Callable[..., dict[str, ModelEntry]] = thd_scan,
    vocabulary: Callable[[Path], Vocabulary] = thd_vocabulary,
) -> None:
    """
    Refuse a config where a model with C{speculative = "draft"} names a
    draft model that does not share its vocabulary, or one that cannot be
    read. Reads nothing when no model drafts with a model. A target model
    whose file is not there yet is not checked (its own start says so).

    @param scan: Lists the models as the registry does (L{thd_scan}).
    @param vocabulary: Reads a GGUF's tokenizer (L{thd_vocabulary}).
    @raise ConfigError: The first pair that fails, with the fix.
    """
    drafting = [name for name, m in config.models.items() if m.speculative == "draft"]
    if not drafting:
        return
    where = str(config.source) if config.source is not None else "<config>"
    found = scan(config.resolved_models_dir, config.models, config.resolved_ollama_models)
    for name in drafting:
        entry = found.get(name_key(name))
        if entry is None or entry.draft is None or entry.format != "gguf":
            continue
        key = f'[models."{name}"] draft_model = {entry.settings.draft_model!r}'
        try:
            draft = vocabulary(entry.draft)
        except GGUFError as e:
            raise ConfigError(
                f"{where}: {key}: the draft model's file {entry.draft} {e.reason}; name a model `blazar models "
                f"list` shows or a GGUF path (relative paths are under models_dir), or set speculative = "
                f'"ngram", which needs no draft model'
            ) from None
        try:
            target = vocabulary(entry.path)
        except GGUFError:
            continue  # the model itself is unreadable: starting it says so
        why = _differs(target, draft)
        if why is not None:
            raise ConfigError(
                f"{where}: {key}: the draft model does not share the model's vocabulary ({why}), so llama-server "
                "could not verify its drafts: pick a draft model of the same family (same tokenizer, e.g. a "
                'smaller size of the same model), or set speculative = "ngram", which needs no draft model'
            )
