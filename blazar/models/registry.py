"""
The model registry: which models exist, by name, and what their GGUF says.

Every C{*.gguf} under C{models_dir} (recursively) is a model named
C{<stem>:latest}; a split model's C{-00001-of-0000N} shard stands for the whole
and its other shards are not models. C{[models."name"]} tables in the config
add names (with C{path}) or override how a found model is run.

A C{*mmproj*.gguf} is a vision projector, never a model: it is the
projector of the model beside it (L{pair_projectors}), unless the model's
C{[models."name"]} names its own with C{mmproj}.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import attrs
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

from blazar.config import Config, LiveConfig, ModelConfig, live_config
from blazar.models.formats import is_whisper_file, thd_model_format
from blazar.models.gguf_meta import GGUFError, GGUFMetadata, thd_read_metadata, unreadable
from blazar.models.modelfile import model_settings
from blazar.models.ollama_store import (
    OllamaLayers,
    StoreError,
    parse_name,
    thd_copy_manifest,
    thd_delete_manifest,
    thd_models,
)
from blazar.names import canonical_name, fair_remote_model, name_key

log = Logger()

_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$")
_BAD_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]+")
# a projector's file name: what is left of it once these go names its model (mmproj-gemma-3-4b-it-f16)
_PROJECTOR_WORD = re.compile(r"(?i)mmproj")
_PROJECTOR_TYPE = re.compile(r"(?i)(?:^|[-_.])(?:I?Q\d(?:_[A-Z0-9]+)*|F16|BF16|F32)$")
_SEPARATORS = re.compile(r"[-_.\s]+")


class ModelNotFound(Exception):
    """
    No model has the requested name.

    @ivar name: The name as the client spelled it.
    @ivar available: The canonical names that do exist, sorted.
    """

    def __init__(self, name: str, available: list[str]) -> None:
        self.name = name
        self.available = available
        shown = ", ".join(available) if available else "none (put .gguf files in models_dir)"
        spelled = name if len(name) <= 200 else name[:200] + "..."
        super().__init__(f"model {spelled!r} not found; available models: {shown}")


class ModelUnreadable(GGUFError):
    """
    A model's file cannot be read (missing, not readable by the daemon's
    user, not GGUF). The message, which clients get, names the model, what
    is wrong and what to check, never the file's path: a server's paths are
    not its clients' business. The path is in L{path} and in L{log_detail},
    which only the daemon's log gets (L{blazar.web.errors}).

    @ivar model: The model's canonical name.
    """

    def __init__(self, model: str, error: GGUFError) -> None:
        message = f'model "{model}": its file {error.reason}; {error.hint} (the daemon log names the file)'
        super().__init__(error.path, error.reason, error.hint, message)
        self.model = model
        self.log_detail = f"file {error.path}"


class AdapterUnusable(ModelUnreadable):
    """
    One of a model's LoRA adapters (L{ModelEntry.adapters}) cannot be
    used: not readable, not a LoRA adapter GGUF (C{general.type} is not
    C{adapter}), or made for another architecture. Raised before a child is
    started with it, so the client reads what to fix rather than an engine
    crash. Like L{ModelUnreadable}, the message names the model, never the
    file (which L{log_detail} holds).
    """

    def __init__(self, model: str, error: GGUFError) -> None:
        GGUFError.__init__(
            self,
            error.path,
            error.reason,
            error.hint,
            f'model "{model}": {error.reason}; {error.hint} (the daemon log names the file)',
        )
        self.model = model
        self.log_detail = f"file {error.path}"


class ModelChangeError(Exception):
    """
    A copy or removal cannot be done; the message says why and what to do.
    """


@attrs.frozen
class ModelEntry:
    """
    One servable model.

    @ivar name: Canonical C{model:tag}.
    @ivar path: The GGUF file to pass to the engine (first shard if split).
    @ivar shards: The other shards of a split model.
    @ivar settings: The operator's overrides for this model.
    @ivar modified: The file's mtime, seconds since the epoch.
    @ivar format: C{gguf}, or another of L{blazar.config.MODEL_FORMATS} for
        a model directory a command lane serves (L{thd_model_format}), or
        C{unknown}.
    @ivar adapters: The LoRA adapters its child is started with, in order:
        each an adapter GGUF and its scale (C{--lora} / C{--lora-scaled});
        from C{lora} under C{[models."name"]}, or set by whatever made the
        model. The one place a model's adapters live.
    @ivar ollama: For a model of the Ollama store (C{ollama_models}): its
        manifest's name and digest, its text layers (template, system,
        parameters, messages, license) and its blobs; L{None} for a file.
    """

    name: str
    path: Path
    shards: tuple[Path, ...] = ()
    settings: ModelConfig = ModelConfig()
    modified: float = 0.0
    format: str = "gguf"
    remote: str | None = None  # format "remote": the [[remotes]] name; the name is NAME:model
    # its vision projector (llama-server --mmproj): a *mmproj*.gguf beside its file (pair_projectors),
    # the config's mmproj, or a pull's projector layer; None: a text-only model
    projector: Path | None = None
    adapters: tuple[tuple[Path, float], ...] = ()
    # a model of the Ollama store (ollama_models): its manifest's name, digest and text layers
    ollama: OllamaLayers | None = None
    # its draft model's file (speculative = "draft", --spec-draft-model): resolve_draft
    draft: Path | None = None

    @property
    def remote_model(self) -> str:
        """
        A remote model's name on its remote (C{tiny} of C{peer:tiny}).
        """
        return self.name.split(":", 1)[1] if self.remote is not None else self.name


def _stem_name(stem: str) -> str:
    if ":" in stem:
        # name:tag.gguf, as /api/copy writes tagged aliases
        try:
            return canonical_name(stem)
        except ValueError:
            pass
    cleaned = _BAD_NAME_CHARS.sub("-", stem).strip("-.") or "model"
    if not cleaned[0].isalnum() and cleaned[0] != "_":
        cleaned = "m" + cleaned
    return canonical_name(cleaned)


def _hub_name(folder: Path, models_dir: Path, stem: str) -> str | None:
    """
    Files pulled from Hugging Face live at C{hf.co/{user}/{repo}/{tag}.gguf}
    and are named C{hf.co/{user}/{repo}:{tag}}, as Ollama names them.
    """
    try:
        parts = folder.relative_to(models_dir).parts
    except ValueError:
        return None
    if len(parts) == 3 and parts[0] == "hf.co":
        try:
            return canonical_name(f"hf.co/{parts[1]}/{parts[2]}:{stem}")
        except ValueError:
            return None
    return None


def thd_tree_size(path: Path) -> int:
    """
    Bytes under a model directory (or of one file).
    """
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def thd_tree_listing(path: Path) -> str:
    return "\n".join(
        f"{f.relative_to(path)} {f.stat().st_size} {f.stat().st_mtime_ns}"
        for f in sorted(path.rglob("*"))
        if f.is_file()
    )


def _add(found: dict[str, ModelEntry], name: str, path: Path, **fields: Any) -> bool:
    """
    Put a file found on disk under C{name}, unless a file found first took
    the name or it vanished meanwhile; whether it was put.
    """
    if name_key(name) in found:
        return False
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return False
    found[name_key(name)] = ModelEntry(name, path, modified=mtime, **fields)
    return True


def thd_scan(
    models_dir: Path,
    configured: Mapping[str, ModelConfig],
    store: Path | None = None,
    hidden: list[str] | None = None,
) -> dict[str, ModelEntry]:
    """
    List the models on disk and in config. Blocking: call in a thread pool.

    @param store: The Ollama store (C{ollama_models},
        L{blazar.models.ollama_store}): each manifest is a model named as
        Ollama shows it (C{qwen3:latest}, C{ns/name:tag}), its C{path} the
        model layer's blob. A C{models_dir} file of the same name wins (it
        was put there by hand, and served before the store existed); the
        store model's name is then added to C{hidden}, for a warning.
    @return: Entries keyed by L{name_key}.
    """
    found: dict[str, ModelEntry] = {}
    by_path: dict[Path, str] = {}
    projectors: list[Path] = []
    if models_dir.is_dir():
        files = []
        whisper: list[Path] = []
        for root, dirs, names in os.walk(models_dir, followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # .partial downloads
            files += [
                Path(root) / f
                for f in names
                if f.endswith(".gguf") and not f.startswith(".") and not is_projector_name(f)
            ]
            projectors += [Path(root) / f for f in names if is_projector_name(f) and not f.startswith(".")]
            whisper += [Path(root) / f for f in names if f.endswith(".bin") and not f.startswith(".")]
        files.sort()
        for path in sorted(whisper):  # whisper.cpp's ggml models: ggml-base.en.bin is whisper-base.en
            if not is_whisper_file(path):
                continue
            stem = path.name[: -len(".bin")]
            name = _stem_name("whisper-" + stem[len("ggml-") :] if stem.startswith("ggml-") else stem)
            _add(found, name, path, format="whisper")
        for path in files:
            stem = path.name[: -len(".gguf")]
            shards: tuple[Path, ...] = ()
            m = _SHARD.match(stem)
            if m:
                if int(m["index"]) != 1:
                    continue
                stem = m["stem"]
                count = int(m["count"])
                shards = tuple(path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1))
            name = _hub_name(path.parent, models_dir, stem) or _stem_name(stem)
            if _add(found, name, path, shards=shards):
                by_path[path] = name_key(name)
    if store is not None:
        for layers in thd_models(store):
            name = layers.name.display
            try:
                key = name_key(name)
            except ValueError:
                continue
            if key in found:
                if hidden is not None:
                    hidden.append(name)
                continue
            found[key] = ModelEntry(
                name,
                layers.model,
                modified=layers.modified,
                projector=layers.projector,
                adapters=tuple((p, 1.0) for p in layers.adapters),
                ollama=layers,
                settings=model_settings(layers.parameters),
            )  # its num_ctx, num_gpu, ...
    for name, settings in configured.items():
        key = name_key(name)
        if settings.path is not None:
            try:
                mtime = settings.path.stat().st_mtime
            except OSError:
                mtime = 0.0
            found[key] = ModelEntry(
                name, settings.path, (), settings, mtime, thd_model_format(settings.path), adapters=settings.lora
            )
        elif key in found:
            stored = found[key].ollama
            if stored is not None:  # the operator's table over the Modelfile's load-time parameters
                settings = model_settings(stored.parameters, settings)
            found[key] = attrs.evolve(found[key], settings=settings, adapters=settings.lora or found[key].adapters)
    thd_attach_projectors(found, projectors, models_dir)
    for key, entry in found.items():
        if entry.settings.draft_model is not None:
            found[key] = attrs.evolve(entry, draft=resolve_draft(entry.settings.draft_model, found, models_dir))
    return found


def resolve_draft(draft: str, found: Mapping[str, ModelEntry], models_dir: Path) -> Path:
    """
    The file of a C{draft_model}: a model's file when C{draft} names one
    of C{found}, else C{draft} as a path (relative: under C{models_dir}).
    """
    try:
        named = found.get(name_key(draft))
    except ValueError:
        named = None
    if named is not None:
        return named.path
    path = Path(draft).expanduser()
    return path if path.is_absolute() else models_dir / path


def is_projector_name(name: str) -> bool:
    """
    Whether a file is a vision projector by its name (C{*mmproj*.gguf},
    as llama.cpp's converters and Hugging Face repositories name them):
    never a model of its own.
    """
    return name.endswith(".gguf") and _PROJECTOR_WORD.search(name) is not None


def _model_key(name: str) -> str:
    """
    A model file's name as a projector's name is matched against: its
    stem (of a split model: without C{-0000N-of-0000M}), lower case, its
    separators one C{-}.
    """
    stem = name.removesuffix(".gguf")
    m = _SHARD.match(stem)
    return _SEPARATORS.sub("-", (m["stem"] if m else stem).lower()).strip("-")


def _projector_core(name: str) -> str:
    """
    The model a projector's file names (C{mmproj-gemma-3-4b-it-f16.gguf}:
    C{gemma-3-4b-it}; C{x.mmproj.gguf}: C{x}); empty for a generic name
    (C{mmproj-F16.gguf}, C{mmproj-model-f16.gguf}).
    """
    stem = _PROJECTOR_WORD.sub("-", name.removesuffix(".gguf")).strip("-_. ")
    core = _SEPARATORS.sub("-", _PROJECTOR_TYPE.sub("", stem).lower()).strip("-")
    return "" if core == "model" else core


def pair_projectors(models: list[Path], projectors: list[Path], shared: Callable[[Path], bool]) -> dict[Path, Path]:
    """
    Which projector serves which model: a projector in a model's folder
    whose name names the model (C{mmproj-NAME*.gguf}, C{NAME*.mmproj.gguf}:
    L{_projector_core} is the model's name or its start, up to a C{-};
    the longest such wins); failing that, the folder's first projector by
    name, where the folder holds one model or is one model's own
    (C{shared}: a pulled C{hf.co/user/repo/}, each of whose quantizations
    takes the repository's projector). In a folder of several models, a
    projector that names none of them serves none (C{mmproj} in the
    config says which). Pure: no file is read.

    @param models: Model files (the first shard of a split one).
    @param projectors: C{*mmproj*.gguf} files.
    @param shared: Whether a folder is one model's, whatever it holds.
    @return: Model file to projector file, for the models that have one.
    """
    by_folder: dict[Path, list[Path]] = {}
    for projector in sorted(projectors):
        by_folder.setdefault(projector.parent, []).append(projector)
    here: dict[Path, list[Path]] = {}
    for model in models:
        here.setdefault(model.parent, []).append(model)
    pairs: dict[Path, Path] = {}
    for folder, candidates in by_folder.items():
        folder_models = here.get(folder, [])
        cores = [(_projector_core(p.name), p) for p in candidates]
        for model in folder_models:
            key = _model_key(model.name)
            named = [(len(core), p) for core, p in cores if core and (key == core or key.startswith(core + "-"))]
            if named:
                pairs[model] = max(named, key=lambda m: m[0])[1]
            elif len(folder_models) == 1 or shared(folder):
                pairs[model] = candidates[0]
    return pairs


def thd_projector_beside(path: Path) -> Path | None:
    """
    The projector beside a model file outside C{models_dir} (a
    C{[models."name"]} C{path}), paired as L{pair_projectors} pairs them.
    Blocking: lists the file's folder.
    """
    try:
        names = os.listdir(path.parent)
    except OSError:
        return None
    projectors = [path.parent / n for n in names if is_projector_name(n) and not n.startswith(".")]
    if not projectors:
        return None
    models = []
    for n in names:
        if not n.endswith(".gguf") or n.startswith(".") or is_projector_name(n):
            continue
        m = _SHARD.match(n[: -len(".gguf")])
        if m is None or int(m["index"]) == 1:  # a split model once, by its first shard
            models.append(path.parent / n)
    return pair_projectors(models or [path], projectors, lambda _: False).get(path)


def thd_attach_projectors(found: dict[str, ModelEntry], projectors: list[Path], models_dir: Path) -> None:
    """
    Give each GGUF model in C{found} (in place) its projector
    (L{ModelEntry.projector}): the config's C{mmproj}, else the one beside
    its file (L{pair_projectors}); a second name for the same file (an
    alias, a hard link elsewhere) has the first's. A projector already set
    (a pull's projector layer) is kept unless C{mmproj} names another.
    Blocking: may list folders and stat files.
    """
    on_disk = [e.path for e in found.values() if e.format == "gguf" and e.settings.path is None]

    def shared(folder: Path) -> bool:
        return _hub_name(folder, models_dir, "x") is not None

    pairs = pair_projectors(on_disk, projectors, shared)
    by_inode: dict[tuple[int, int], Path] = {}
    for path, paired in pairs.items():
        try:
            st = path.stat()
        except OSError:
            continue
        by_inode[(st.st_dev, st.st_ino)] = paired
    for key, entry in list(found.items()):
        if entry.format != "gguf":
            continue
        projector = entry.settings.mmproj or entry.projector
        if projector is None:
            projector = pairs.get(entry.path) if entry.settings.path is None else thd_projector_beside(entry.path)
        if projector is None and by_inode:
            try:
                st = entry.path.stat()
                projector = by_inode.get((st.st_dev, st.st_ino))
            except OSError:
                pass
        if projector is not None:
            found[key] = attrs.evolve(entry, projector=projector)


class IModelRegistry(Interface):
    """
    Names to models: what the request path, the surfaces and the control
    socket ask about the models on disk and in the config.
    """

    models_dir = Attribute("Where model files live (and where aliases are written): a L{Path}.")

    def reconfigure(config: Config) -> None:
        """
        Use C{config}'s models_dir and model tables from the next lookup on.
        """

    async def refresh() -> list[ModelEntry]:
        """
        Rescan; every model, sorted by name.
        """

    async def resolve(name: object) -> ModelEntry:
        """
        The model a client named (C{name} or C{name:tag}).

        @raise ModelNotFound: No such model, even after a rescan.
        """

    async def metadata(entry: ModelEntry) -> GGUFMetadata:
        """
        The GGUF facts for C{entry}.

        @raise ModelUnreadable: Unreadable file (a
            L{blazar.models.gguf_meta.GGUFError} whose message names the
            model, not the file).
        """

    async def digest(entry: ModelEntry) -> str:
        """
        C{sha256:<hex>} of the model's file (first shard).

        @raise ModelUnreadable: Unreadable file.
        """

    async def copy(entry: ModelEntry, destination: str) -> str:
        """
        Make C{destination} another name for C{entry}; the new canonical name.

        @raise ModelChangeError: Bad or taken name, or not written.
        """

    def check_removable(entry: ModelEntry) -> None:
        """
        @raise ModelChangeError: C{entry}'s file is not Blazar's to delete.
        """

    async def remove(entry: ModelEntry) -> None:
        """
        Delete C{entry}'s files (every shard).

        @raise ModelChangeError: Not removable, or the unlink failed.
        """

    def forget() -> None:
        """
        Drop the cached listing so the next lookup rescans.
        """


def _thd_unlink_each(paths: tuple[Path, ...]) -> None:
    """
    Unlink each of C{paths} in turn, stopping at the first that fails.
    Blocking: thread pool.
    """
    for path in paths:
        os.unlink(path)


@implementer(IModelRegistry)
@attrs.define
class ModelRegistry:
    """
    Names to models, rescanned when a name is not found or when listing.

    @ivar _reactor: Used only for its thread pool; disk reads run there.
    """

    _live: LiveConfig = attrs.field(converter=live_config)
    _reactor: IReactorThreads
    # (models_dir, the model tables, the Ollama store, a list the store names a models_dir file hides go to)
    _scan: Callable[..., dict[str, ModelEntry]] = thd_scan
    _read: Callable[[Path, tuple[Path, ...]], GGUFMetadata] = thd_read_metadata
    _entries: dict[str, ModelEntry] = attrs.field(factory=dict)
    _meta_cache: dict[tuple[Path, int, int], GGUFMetadata] = attrs.field(factory=dict)
    _digest_cache: dict[tuple[Path, int, int], str] = attrs.field(factory=dict)
    # the adapter files (path, mtime, size, architecture) found usable: thd_check_adapters
    _adapters_checked: frozenset[tuple[Path, int, int, str]] = frozenset()
    # per remote with models = "*": the names its GET /v1/models listed last
    _listed: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    _shadowed: set[str] = attrs.field(factory=set)  # local names a remote's name hides, warned about
    _hidden: set[str] = attrs.field(factory=set)  # store models a models_dir file's name hides, warned about
    # asks a models = "*" remote for its list again (blazar.engines.remote.RemoteCatalog.relist)
    relist: Callable[[str], Awaitable[None]] | None = None

    def __attrs_post_init__(self) -> None:
        self._live.subscribe(self.reconfigure)

    @property
    def _config(self) -> Config:
        # the live config, read at each use: a reload applies from the next read
        return self._live.current

    def reconfigure(self, config: Config) -> None:
        """
        After a swap of the live config: forget what was found, so that the
        next lookup rescans C{models_dir} and the model tables.
        """
        self.forget()

    @property
    def models_dir(self) -> Path:
        """
        Where model files live (and where aliases are written).
        """
        return self._config.resolved_models_dir

    @property
    def ollama_models(self) -> Path:
        """
        The Ollama store's root (L{blazar.models.ollama_store}).
        """
        return self._config.resolved_ollama_models

    async def in_thread(self, f: Callable[..., object], *args: object) -> object:
        """
        Run blocking C{f(*args)} in the reactor's thread pool.
        """
        return await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), f, *args)

    async def refresh(self) -> list[ModelEntry]:
        """
        Rescan C{models_dir}, the Ollama store and the config.

        @return: Every model, sorted by name.
        """
        hidden: list[str] = []
        entries = await self.in_thread(
            self._scan, self._config.resolved_models_dir, self._config.models, self.ollama_models, hidden
        )
        assert isinstance(entries, dict)
        self._entries = entries
        self._warn_shadowed()
        self._warn_hidden(hidden)
        return sorted([*self._entries.values(), *self.remote_entries()], key=lambda e: e.name)

    def _warn_shadowed(self) -> None:
        """
        Name (once each) the local models a remote's name hides: with
        C{[[remotes]] name = "tiny"}, C{tiny:latest} is the remote's model
        C{latest}, not the local file.
        """
        remotes = {r.name.casefold(): r.name for r in self._config.remotes}
        for entry in self._entries.values():
            base = entry.name.split(":", 1)[0].casefold()
            if base in remotes and entry.name not in self._shadowed:
                self._shadowed.add(entry.name)
                log.warn(
                    "local model {model} is hidden by [[remotes]] name = {remote!r}: {model} now names that "
                    "remote's model; rename the remote (or the file) to reach it",
                    model=entry.name,
                    remote=remotes[base],
                )

    def _warn_hidden(self, hidden: list[str]) -> None:
        """
        Name (once each) the Ollama store's models that a C{models_dir}
        file of the same name hides (the file is served under the name).
        """
        for name in hidden:
            if name not in self._hidden:
                self._hidden.add(name)
                log.warn(
                    "the pulled model {model} (in ollama_models) is hidden by a file of the same name in "
                    "models_dir, which is served under that name; rename or delete the file to serve the "
                    "pulled one",
                    model=name,
                )

    def remote_entries(self) -> list[ModelEntry]:
        """
        The remotes' models (C{[[remotes]]}): those a remote's C{models}
        names, or for C{models = "*"} those it listed when last asked
        (L{note_listed}).
        """
        entries: list[ModelEntry] = []
        for remote in self._config.remotes:
            names = self._listed.get(remote.name, ()) if remote.any_model else remote.models
            entries.extend(remote_entry(remote.name, n) for n in names)
        return entries

    def note_listed(self, remote: str, names: tuple[str, ...]) -> None:
        """
        What remote C{remote} (one with C{models = "*"}) lists now.
        """
        self._listed[remote] = names

    async def _remote(self, name: str) -> ModelEntry | None:
        """
        C{NAME:model} for a configured remote NAME (before local names:
        C{peer:tiny} is also an Ollama C{name:tag}).

        @raise ModelNotFound: The remote is configured, and C{model} is not
            one of its C{models} (for C{models = "*"}: not one it listed,
            asked once more first: L{relist}).
        """
        prefix, _, model = name.partition(":")
        remote = self._config.remote(prefix) if model else None
        if remote is None:
            return None

        def listed() -> str | None:
            names = self._listed.get(remote.name, ())
            if model in names:
                return model
            # an Ollama or Blazar remote lists tiny:latest: a bare name means it, as there
            latest = f"{model}:latest"
            return latest if ":" not in model.rsplit("/", 1)[-1] and latest in names else None

        if not remote.any_model:
            found = model if model in remote.models else None
        else:
            found = listed()
            if found is None and self.relist is not None and fair_remote_model(model):
                await self.relist(remote.name)  # (at most one question a few seconds, however many ask)
                found = listed()
        if found is None:
            raise ModelNotFound(name, sorted(e.name for e in [*self._entries.values(), *self.remote_entries()]))
        return remote_entry(remote.name, found)

    async def resolve(self, name: object) -> ModelEntry:
        """
        Find the model a client named (C{name} or C{name:tag}).

        @raise ModelNotFound: No such model, even after a rescan.
        """
        if not isinstance(name, str):
            raise ModelNotFound(str(name), sorted(e.name for e in self._entries.values()))
        remote = await self._remote(name)
        if remote is not None:
            return remote
        try:
            key = name_key(name)
        except ValueError:
            raise ModelNotFound(name, sorted(e.name for e in self._entries.values())) from None
        entry = self._entries.get(key)
        if entry is None:
            await self.refresh()
            entry = self._entries.get(key)
        if entry is None:
            raise ModelNotFound(name, sorted(e.name for e in self._entries.values()))
        return entry

    async def metadata(self, entry: ModelEntry) -> GGUFMetadata:
        """
        The GGUF facts for C{entry}, cached by (path, mtime, size); its
        LoRA adapters checked too (L{thd_check_adapters}), as the
        supervisor reads this before it starts a child.

        @raise ModelUnreadable: Unreadable file.
        @raise AdapterUnusable: An adapter that llama-server would refuse.
        """
        try:
            meta = await self._metadata(entry)
            if entry.adapters:
                checked = await self.in_thread(
                    thd_check_adapters, entry.adapters, meta.architecture, self._adapters_checked
                )
                assert isinstance(checked, frozenset)
                self._adapters_checked = checked
            return meta
        except AdapterUnusable:
            raise
        except GGUFError as e:
            if e.path in {path for path, _ in entry.adapters}:
                raise AdapterUnusable(entry.name, e) from None
            raise ModelUnreadable(entry.name, e) from None
        except OSError as e:
            raise ModelUnreadable(entry.name, unreadable(entry.path, e)) from None

    async def _metadata(self, entry: ModelEntry) -> GGUFMetadata:
        if entry.format != "gguf":
            size = await self.in_thread(thd_tree_size, entry.path)
            assert isinstance(size, int)
            return GGUFMetadata(
                architecture=entry.format,
                context_length=None,
                block_count=None,
                embedding_length=None,
                head_count=None,
                head_count_kv=None,
                file_type=None,
                has_chat_template=True,
                pooling_type=None,
                size=size,
            )
        st = await self.in_thread(os.stat, entry.path)
        assert isinstance(st, os.stat_result)
        key = (entry.path, st.st_mtime_ns, st.st_size)
        cached = self._meta_cache.get(key)
        if cached is None:
            meta = await self.in_thread(self._read, entry.path, entry.shards)
            assert isinstance(meta, GGUFMetadata)
            self._meta_cache = {k: v for k, v in self._meta_cache.items() if k[0] != entry.path}
            self._meta_cache[key] = cached = meta
        return cached

    async def digest(self, entry: ModelEntry) -> str:
        """
        C{sha256:<hex>} of the model's file (first shard), computed once per
        (path, mtime, size) in the thread pool; of a model directory, its
        listing (names, sizes, mtimes).

        @raise ModelUnreadable: Unreadable file.
        """
        try:
            return await self._digest(entry)
        except OSError as e:
            raise ModelUnreadable(entry.name, unreadable(entry.path, e)) from None

    async def _digest(self, entry: ModelEntry) -> str:
        if entry.ollama is not None:
            return entry.ollama.digest  # the manifest's, as Ollama gives it
        if entry.format != "gguf":
            listing = await self.in_thread(thd_tree_listing, entry.path)
            assert isinstance(listing, str)
            return "sha256:" + hashlib.sha256(listing.encode()).hexdigest()
        st = await self.in_thread(os.stat, entry.path)
        assert isinstance(st, os.stat_result)
        key = (entry.path, st.st_mtime_ns, st.st_size)
        cached = self._digest_cache.get(key)
        if cached is None:
            hexdigest = await self.in_thread(thd_sha256, entry.path)
            assert isinstance(hexdigest, str)
            cached = "sha256:" + hexdigest
            self._digest_cache = {k: v for k, v in self._digest_cache.items() if k[0] != entry.path}
            self._digest_cache[key] = cached
        return cached

    async def copy(self, entry: ModelEntry, destination: str) -> str:
        """
        Make C{destination} (C{name[:tag]}) another name for C{entry}: a
        hard link C{<models_dir>/<name>[:<tag>].gguf} (a copy across
        filesystems), visible at once. For a model of the Ollama store,
        C{destination} may be any Ollama name (C{ns/name:tag} too): a new
        manifest naming the same blobs.

        @return: The new canonical name.
        @raise ModelChangeError: Bad or taken name, or the file cannot be
            written.
        """
        if entry.ollama is not None:
            return await self._copy_manifest(entry.ollama, destination)
        try:
            dest = canonical_name(destination)
        except ValueError as e:
            raise ModelChangeError(str(e)) from None
        if "/" in dest:
            raise ModelChangeError("destination must be a plain name[:tag] (no namespace)")
        if _SHARD.match(dest.removesuffix(":latest")):
            raise ModelChangeError("destination looks like a split-model shard (-0000N-of-0000M); pick another name")
        if entry.remote is not None:
            raise ModelChangeError(
                f'model "{entry.name}" is a remote\'s model ([[remotes]]): it has no file '
                "here to copy; pull or copy it on the remote"
            )
        wanted = name_key(dest)
        if any(_taken_key(e.name) == wanted for e in await self.refresh()):
            raise ModelChangeError(f'model "{destination}" already exists; delete it first')
        target = self.models_dir / f"{dest.removesuffix(':latest')}.gguf"
        try:
            await self.in_thread(thd_link, entry.path, target)
        except OSError as e:
            raise ModelChangeError(f"cannot create {target}: {e.strerror}") from None
        self.forget()
        return dest

    async def _copy_manifest(self, source: OllamaLayers, destination: str) -> str:
        try:
            name = parse_name(destination)
            dest = canonical_name(name.display)
        except ValueError as e:
            raise ModelChangeError(str(e)) from None
        wanted = name_key(dest)
        if any(_taken_key(e.name) == wanted for e in await self.refresh()):
            raise ModelChangeError(f'model "{destination}" already exists; delete it first')
        try:
            await self.in_thread(thd_copy_manifest, self.ollama_models, source.name, name)
        except (OSError, StoreError) as e:
            raise ModelChangeError(f"cannot copy {source.name.display} to {dest}: {e}") from None
        finally:
            self.forget()
        return dest

    def check_removable(self, entry: ModelEntry) -> None:
        """
        @raise ModelChangeError: C{entry} is configured with a path outside
            C{models_dir}, so its file is not Blazar's to delete.
        """
        if entry.ollama is not None and entry.settings.path is None:
            return  # a manifest of the store: Blazar's (or, with ollama_models shared, Ollama's) to delete
        models_dir = self.models_dir.resolve()
        if not entry.path.resolve().is_relative_to(models_dir):
            if entry.settings.path is None:
                raise ModelChangeError(
                    f'model "{entry.name}" is a file outside models_dir (reached through a link): '
                    f"delete {entry.path.resolve()} yourself if you mean it"
                )
            raise ModelChangeError(
                f'model "{entry.name}" is configured in [models."{entry.name}"] with a path outside '
                "models_dir; remove it from the config instead"
            )

    async def remove(self, entry: ModelEntry) -> None:
        """
        Delete C{entry}'s files (every shard). Models configured with a
        path outside C{models_dir} are not Blazar's to delete. A model of
        the Ollama store loses its manifest, and then the blobs no other
        manifest names (L{thd_delete_manifest}).

        @raise ModelChangeError: Not removable, or the unlink failed.
        """
        self.check_removable(entry)
        if entry.ollama is not None and entry.settings.path is None:
            what = entry.name
            delete: Callable[[], object] = functools.partial(thd_delete_manifest, self.ollama_models, entry.ollama.name)
        else:
            what = str(entry.path)
            delete = functools.partial(_thd_unlink_each, (entry.path, *entry.shards))
        try:
            await self.in_thread(delete)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ModelChangeError(f"cannot delete {what}: {e.strerror}") from None
        finally:
            self.forget()

    def forget(self) -> None:
        """
        Drop the cached listing so the next lookup rescans (after a copy or
        delete).
        """
        self._entries = {}


def _taken_key(name: str) -> str:
    """
    The lookup key of a listed name, for "is this name taken": as
    L{name_key}, but a remote's model (C{peer:a"b}: the remote's own id,
    which need not be an Ollama name) only case-folded, never an error.
    """
    try:
        return name_key(name)
    except ValueError:
        return name.casefold()


def remote_entry(remote: str, model: str) -> ModelEntry:
    """
    The entry of model C{model} of remote C{remote}: named C{remote:model},
    no file.
    """
    return ModelEntry(f"{remote}:{model}", Path(remote), format="remote", remote=remote)


def thd_check_adapters(
    adapters: tuple[tuple[Path, float], ...],
    architecture: str,
    checked: frozenset[tuple[Path, int, int, str]] = frozenset(),
) -> frozenset[tuple[Path, int, int, str]]:
    """
    Check that each adapter file is what llama.cpp's LoRA loader
    (C{src/llama-adapter.cpp}) takes: a GGUF with C{general.type =
    "adapter"}, C{adapter.type = "lora"} and the model's
    C{general.architecture}. Blocking: call in a thread pool.

    @param checked: Files (path, mtime, size, architecture) that passed
        before: not read again.
    @return: C{checked} with these files added.
    @raise GGUFError: The first file that fails, its reason and hint
        written for the client (L{AdapterUnusable} wraps it).
    """
    passed = set(checked)
    hint = "check its lora list (or the ADAPTER it was created with)"
    for number, (path, _) in enumerate(adapters, 1):
        which = f"LoRA adapter {number} of {len(adapters)}"
        try:
            st = path.stat()
        except OSError as e:
            raise unreadable(path, e, f"{which} cannot be read") from None
        key = (path, st.st_mtime_ns, st.st_size, architecture)
        if key in passed:
            continue
        try:
            from gguf import GGUFReader

            reader = GGUFReader(os.fspath(path))
            fields = {
                name: reader.fields[name].contents()
                for name in ("general.type", "adapter.type", "general.architecture")
                if name in reader.fields
            }
        except OSError as e:
            raise unreadable(path, e, f"{which} cannot be read") from None
        except Exception as e:  # gguf raises ValueError and friends on a file that is not GGUF
            raise GGUFError(path, f"{which} is not a GGUF file ({type(e).__name__})", hint) from None
        if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
            got = (
                f"general.type is {fields['general.type']!r}"
                if "general.type" in fields
                else "it has no general.type: a model file"
            )
            if fields.get("general.type") == "adapter":
                got = f"adapter.type is {fields.get('adapter.type', 'missing')!r}"
            raise GGUFError(
                path,
                f"{which} is not a LoRA adapter GGUF ({got}; llama-server takes only files with "
                'general.type "adapter" and adapter.type "lora", as convert_lora_to_gguf.py writes '
                "them)",
                hint,
            )
        if fields.get("general.architecture") != architecture:
            raise GGUFError(
                path,
                f"{which} was made for architecture {fields.get('general.architecture')!r}, "
                f"and the model is {architecture!r}",
                "use the adapter made for this base model",
            )
        passed.add(key)
    return frozenset(passed)


def thd_sha256(path: Path) -> str:
    """
    Hex sha256 of a file. Blocking: call in a thread pool.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def thd_link(source: Path, target: Path) -> None:
    """
    Hard-link C{source} to C{target} (zero-copy alias); copy across
    filesystems. Blocking: call in a thread pool.
    """
    try:
        os.link(os.path.realpath(source), target)  # Linux's link() would alias a symlink itself
    except OSError as e:
        import errno
        import shutil

        if e.errno != errno.EXDEV:
            raise
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
