"""
The model registry: which models exist, by name, and what their GGUF says.

Every C{*.gguf} under C{models_dir} (recursively) is a model named
C{<stem>:latest}; a split model's C{-00001-of-0000N} shard stands for the whole
and its other shards are not models. C{[models."name"]} tables in the config
add names (with C{path}) or override how a found model is run.
"""

from __future__ import annotations

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
from blazar.names import canonical_name, fair_remote_model, name_key

log = Logger()

_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$")
_BAD_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]+")


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
    """

    name: str
    path: Path
    shards: tuple[Path, ...] = ()
    settings: ModelConfig = ModelConfig()
    modified: float = 0.0
    format: str = "gguf"
    remote: str | None = None  # format "remote": the [[remotes]] name; the name is NAME:model

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
    return "\n".join(f"{f.relative_to(path)} {f.stat().st_size} {f.stat().st_mtime_ns}"
                     for f in sorted(path.rglob("*")) if f.is_file())


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


def thd_scan(models_dir: Path, configured: Mapping[str, ModelConfig]) -> dict[str, ModelEntry]:
    """
    List the models on disk and in config. Blocking: call in a thread pool.

    @return: Entries keyed by L{name_key}.
    """
    found: dict[str, ModelEntry] = {}
    by_path: dict[Path, str] = {}
    if models_dir.is_dir():
        files = []
        whisper: list[Path] = []
        for root, dirs, names in os.walk(models_dir, followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # .partial downloads
            files += [Path(root) / f for f in names if f.endswith(".gguf") and not f.startswith(".")]
            whisper += [Path(root) / f for f in names if f.endswith(".bin") and not f.startswith(".")]
        files.sort()
        for path in sorted(whisper):  # whisper.cpp's ggml models: ggml-base.en.bin is whisper-base.en
            if not is_whisper_file(path):
                continue
            stem = path.name[: -len(".bin")]
            name = _stem_name("whisper-" + stem[len("ggml-"):] if stem.startswith("ggml-") else stem)
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
                shards = tuple(
                    path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf")
                    for i in range(2, count + 1)
                )
            name = _hub_name(path.parent, models_dir, stem) or _stem_name(stem)
            if _add(found, name, path, shards=shards):
                by_path[path] = name_key(name)
    for name, settings in configured.items():
        key = name_key(name)
        if settings.path is not None:
            try:
                mtime = settings.path.stat().st_mtime
            except OSError:
                mtime = 0.0
            found[key] = ModelEntry(name, settings.path, (), settings, mtime, thd_model_format(settings.path))
        elif key in found:
            found[key] = attrs.evolve(found[key], settings=settings)
    return found


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


@implementer(IModelRegistry)
@attrs.define
class ModelRegistry:
    """
    Names to models, rescanned when a name is not found or when listing.

    @ivar _reactor: Used only for its thread pool; disk reads run there.
    """

    _live: LiveConfig = attrs.field(converter=live_config)
    _reactor: IReactorThreads
    _scan: Callable[[Path, Mapping[str, ModelConfig]], dict[str, ModelEntry]] = thd_scan
    _read: Callable[[Path, tuple[Path, ...]], GGUFMetadata] = thd_read_metadata
    _entries: dict[str, ModelEntry] = attrs.field(factory=dict)
    _meta_cache: dict[tuple[Path, int, int], GGUFMetadata] = attrs.field(factory=dict)
    _digest_cache: dict[tuple[Path, int, int], str] = attrs.field(factory=dict)
    # per remote with models = "*": the names its GET /v1/models listed last
    _listed: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    _shadowed: set[str] = attrs.field(factory=set)  # local names a remote's name hides, warned about
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

    async def in_thread(self, f: Callable[..., object], *args: object) -> object:
        """
        Run blocking C{f(*args)} in the reactor's thread pool.
        """
        return await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), f, *args)

    async def refresh(self) -> list[ModelEntry]:
        """
        Rescan C{models_dir} and the config.

        @return: Every model, sorted by name.
        """
        entries = await self.in_thread(
            self._scan, self._config.resolved_models_dir, self._config.models
        )
        assert isinstance(entries, dict)
        self._entries = entries
        self._warn_shadowed()
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
                log.warn("local model {model} is hidden by [[remotes]] name = {remote!r}: {model} now names that "
                         "remote's model; rename the remote (or the file) to reach it", model=entry.name,
                         remote=remotes[base])

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
        The GGUF facts for C{entry}, cached by (path, mtime, size).

        @raise ModelUnreadable: Unreadable file.
        """
        try:
            return await self._metadata(entry)
        except GGUFError as e:
            raise ModelUnreadable(entry.name, e) from None
        except OSError as e:
            raise ModelUnreadable(entry.name, unreadable(entry.path, e)) from None

    async def _metadata(self, entry: ModelEntry) -> GGUFMetadata:
        if entry.format != "gguf":
            size = await self.in_thread(thd_tree_size, entry.path)
            assert isinstance(size, int)
            return GGUFMetadata(architecture=entry.format, context_length=None, block_count=None,
                                embedding_length=None, head_count=None, head_count_kv=None, file_type=None,
                                has_chat_template=True, pooling_type=None, size=size)
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
        filesystems), visible at once.

        @return: The new canonical name.
        @raise ModelChangeError: Bad or taken name, or the file cannot be
            written.
        """
        try:
            dest = canonical_name(destination)
        except ValueError as e:
            raise ModelChangeError(str(e)) from None
        if "/" in dest:
            raise ModelChangeError("destination must be a plain name[:tag] (no namespace)")
        if _SHARD.match(dest.removesuffix(":latest")):
            raise ModelChangeError("destination looks like a split-model shard (-0000N-of-0000M); pick another name")
        if entry.remote is not None:
            raise ModelChangeError(f'model "{entry.name}" is a remote\'s model ([[remotes]]): it has no file '
                                   "here to copy; pull or copy it on the remote")
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

    def check_removable(self, entry: ModelEntry) -> None:
        """
        @raise ModelChangeError: C{entry} is configured with a path outside
            C{models_dir}, so its file is not Blazar's to delete.
        """
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
        path outside C{models_dir} are not Blazar's to delete.

        @raise ModelChangeError: Not removable, or the unlink failed.
        """
        self.check_removable(entry)
        try:
            for path in (entry.path, *entry.shards):
                await self.in_thread(os.unlink, path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ModelChangeError(f"cannot delete {entry.path}: {e.strerror}") from None
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
        os.link(source, target)
    except OSError as e:
        import errno
        import shutil

        if e.errno != errno.EXDEV:
            raise
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
