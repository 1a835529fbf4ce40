"""
The model operations, written once for every front end: delete, copy,
unload, evict and pull. Ollama's management endpoints
(L{blazar.web.ollama}) and the control channel's AMP commands
(L{blazar.protocols.control}) call them and only render what they return or
raise in their own terms; neither orchestrates an operation itself.

Every failure is a domain exception whose message says what happened and
what to do:
  - L{blazar.models.registry.ModelNotFound}: no model has that name;
  - L{blazar.models.registry.ModelChangeError}: refused (a bad or taken
    name, a file that is not Blazar's to delete, a link or unlink that
    failed);
  - L{blazar.models.hub.PullError}: a pull failed (its C{status} is the
    HTTP status a front end that has answered nothing yet may use); a push
    too (L{blazar.models.ollama_registry.PushError}, one of them);
  - L{blazar.models.create.CreateError}: a create was refused or failed
    (its C{status}, likewise);
  - L{NothingToEvict}: no loaded instance matches.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from blazar.engines.llamacpp import model_kind
from blazar.engines.supervisor import InstanceState, Supervisor
from blazar.models.create import CreateError, CreateSpec, ModelCreator
from blazar.models.hub import HubName, PullError, parse_hub_name
from blazar.models.ollama_registry import PushError
from blazar.models.ollama_store import InvalidName, OllamaName, parse_name
from blazar.models.registry import ModelNotFound, ModelRegistry

if TYPE_CHECKING:
    from blazar.engines.hardware import Census

log = Logger()

Progress = Callable[[dict[str, Any]], None]


class Puller(Protocol):
    """
    What L{ModelOperations.pull} needs of a puller
    (L{blazar.models.hub.HubClient}).
    """

    async def pull(self, name: HubName, models_dir: Path, progress: Progress) -> list[Path]:
        """
        Download C{name} into C{models_dir}, reporting Ollama-style progress
        objects; nothing is installed if it fails.

        @return: The installed files.
        @raise PullError: Any failure.
        """


class LibraryPuller(Protocol):
    """
    What L{ModelOperations.pull} and L{ModelOperations.push} need of an
    Ollama-protocol registry client (L{blazar.models.ollama_registry.RegistryClient}).
    """

    async def pull(self, name: OllamaName, root: Path, progress: Progress, insecure: bool = False) -> list[Path]:
        """
        Pull C{name} into the store at C{root}; nothing is named if it fails.

        @return: The model's blobs.
        @raise PullError: Any failure.
        """

    async def push(self, name: OllamaName, root: Path, progress: Progress, insecure: bool = False) -> None:
        """
        Push the store's model C{name} to the registry its name names.

        @raise PushError: Any failure.
        """


_HUB = re.compile(r"(?i)^(?:https?://)?(?:hf\.co|huggingface\.co)/")


class NothingToEvict(Exception):
    """
    No loaded instance matches the key.
    """


@attrs.frozen
class Pulled:
    """
    A finished pull.

    @ivar name: The canonical name the model is now served under
        (C{hf.co/{user}/{repo}:{tag}}).
    @ivar files: The installed files (several for a split model).
    @ivar seconds: How long the pull took.
    """

    name: str
    files: tuple[Path, ...]
    seconds: float


def _ignore(line: dict[str, Any]) -> None:
    pass


async def instance_rows(supervisor: Any, registry: Any, hints: Any, now: float) -> list[dict[str, Any]]:
    """
    Each loaded instance as C{blazar ps} and the dashboard show it: model,
    kind, lane, state, pid, port, busy and total slots, context, seconds
    until idle-evictable, breaker, served, memory estimate and RSS, the
    engine's cache-hit, draft-acceptance and accepted-per-draft EWMAs,
    its C{speculative} mode (C{off}, C{ngram}, C{draft}, or for C{auto}
    L{spec_column}'s C{auto=on}, C{auto=off}, C{auto?on}, C{auto?off}), and
    its GPU memory:
    C{vram} (bytes over every GPU: NVML's figure once measured, else the
    plan's; 0 for a CPU child) and C{gpus}, one
    C{{"gpu": index, "planned": bytes, "measured": bytes}} per GPU it is
    planned or measured on
    (L{blazar.engines.supervisor.InstanceView.gpu_memory}; either figure
    L{None} where unknown; C{[]}: on the CPU).
    """
    rows = []
    for view in await supervisor.measured_snapshot():
        kind, estimate = None, None
        try:
            meta = await registry.metadata(view.entry)
            kind = model_kind(view.entry, meta)
            estimate = supervisor.estimate(view.entry, meta)
        except Exception:
            pass
        hint = hints.for_model(view.name) if hints is not None else None
        auto = getattr(supervisor, "speculative_auto", lambda name: None)(view.name)
        rows.append(
            {
                "cache_hit": hint.cache_hit if hint is not None else None,
                "draft_acceptance": hint.draft_acceptance if hint is not None else None,
                "accepted_per_draft": hint.accepted_per_draft if hint is not None else None,
                "speculative": spec_column(auto) if auto is not None else view.entry.settings.speculative,
                "model": view.name,
                "key": f"{view.name}#0@text",
                "state": str(view.state),
                "pid": view.pid,
                "port": view.port,
                "slots": view.slots,
                "busy": view.in_flight,
                "ctx": view.ctx,
                "expires_in": None if view.expires_at is None else max(0.0, view.expires_at - now),
                "breaker": view.breaker,
                "served": view.served,
                "memory_estimate": estimate,
                "rss": view.rss,
                "kind": kind,
                "lane": view.lane,
                "vram": sum(view.gpu_held().values()),
                "gpus": [
                    {"gpu": gpu, "planned": planned, "measured": measured}
                    for gpu, planned, measured in view.gpu_memory()
                ],
            }
        )
    return rows


def gpu_listing(census: Census | None) -> dict[str, Any]:
    """
    The GPUs as C{blazar ps} and the dashboard show them, from the latest
    hardware census (L{blazar.engines.hardware.HardwareCensus.latest}):
    C{{"gpus": [{"index", "name", "memory_total", "memory_used",
    "memory_free"}, ...], "gpu_note": str}}, memory in bytes (C{used} is
    C{total - free}, the driver's reserve included). C{"gpus"} is C{[]} on
    a machine without a GPU (C{"gpu_note"} says why) and L{None} before
    the first reading.
    """
    if census is None:
        return {"gpus": None, "gpu_note": ""}
    return {
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "memory_total": g.memory_total,
                "memory_used": g.memory_used,
                "memory_free": g.memory_free,
            }
            for g in census.gpus
        ],
        "gpu_note": census.gpu_note,
    }


@attrs.define
class ModelOperations:
    """
    Delete, copy, unload, evict and pull a model: the one implementation of
    each, over the registry, the supervisor and the puller.

    @ivar _puller: L{None} where pulling from the hub is not offered.
    @ivar _clock: Times pulls.
    @ivar _library: Pulls and pushes Ollama library names; L{None} where
        that is not offered.
    @ivar _creator: Creates models of the Ollama store (C{/api/create})
        and takes their uploaded blobs; L{None} where that is not offered.
    """

    _registry: ModelRegistry
    _supervisor: Supervisor
    _puller: Puller | None
    _clock: IReactorTime
    _library: LibraryPuller | None = None
    _creator: ModelCreator | None = None

    async def delete(self, name: str) -> str:
        """
        Delete the model C{name}'s files (every shard). What may not be
        deleted is refused before anything is stopped; a running engine for
        it is then stopped, and its exit awaited, before the files go.

        @return: The canonical name deleted.
        @raise ModelNotFound: No such model.
        @raise ModelChangeError: Not Blazar's file to delete (configured
            with a path outside C{models_dir}, or reached through a link),
            or the unlink failed.
        """
        entry = await self._registry.resolve(name)
        self._registry.check_removable(entry)  # refuse before stopping anything
        instance = self._supervisor.loaded(entry.name)
        if instance is not None:
            await self._supervisor.stop_instance(instance, "model deleted")
        await self._registry.remove(entry)
        log.info("deleted {model}", model=entry.name)
        return entry.name

    async def copy(self, source: str, destination: str) -> str:
        """
        Make C{destination} (C{name[:tag]}) another name for the model
        C{source}: a hard link in C{models_dir}, visible at once.

        @return: The new canonical name.
        @raise ModelNotFound: No model C{source}.
        @raise ModelChangeError: C{destination} is not a plain name, is
            taken (delete it first), or cannot be written.
        """
        entry = await self._registry.resolve(source)
        copied = await self._registry.copy(entry, destination)
        log.info("copied {model} to {destination}", model=entry.name, destination=copied)
        return copied

    async def unload(self, name: str, reason: str = "unloaded") -> bool:
        """
        Stop the model C{name}'s running engine, if it has one (Ollama's
        C{keep_alive: 0} with no prompt): at once, waiting for it to exit,
        if no request runs on it; else once the last one ends (a running
        answer is never cut).

        @param reason: Why, for the log.
        @return: Whether an engine was running.
        @raise ModelNotFound: No such model.
        """
        entry = await self._registry.resolve(name)
        instance = self._supervisor.loaded(entry.name)
        if instance is None:
            return False
        stopping = self._supervisor.unload_when_idle(instance, reason)
        if stopping is not None:
            await stopping
        return True

    def evict(self, key: str | None = None, everything: bool = False) -> list[str]:
        """
        Start stopping the instances C{key} names (C{name}, C{name#0},
        C{name@text}; see L{Supervisor.evict}), or, with C{everything},
        every instance not already stopping. Does not wait for the exits.

        @return: The models of the instances being stopped.
        @raise NothingToEvict: Nothing matched.
        """
        if everything:
            chosen = [i for i in self._supervisor.instances() if i.state != InstanceState.STOPPING]
            for instance in chosen:
                self._supervisor.stop_instance(instance, "evicted").addErrback(self._stop_failed, instance.entry.name)
        else:
            chosen = self._supervisor.evict(key or "")
        if not chosen:
            if everything:
                raise NothingToEvict("nothing is loaded")
            raise NothingToEvict(f"no loaded instance matches {key!r}; `blazar ps` lists the loaded ones")
        return [i.entry.name for i in chosen]

    async def instances(self, hints: Any = None) -> list[dict[str, Any]]:
        """
        L{instance_rows}, for the dashboard as for C{blazar ps}.
        """
        return await instance_rows(self._supervisor, self._registry, hints, self._clock.seconds())

    def reset_breakers(self, name: str | None = None) -> list[str]:
        """
        Close the crash breaker of C{name}, or of every model: the next
        request tries at once.

        @return: The models whose breakers were reset.
        """
        return list(self._supervisor.reset_breakers(name))

    def _stop_failed(self, failure: Failure, model: str) -> None:
        log.failure("stopping {model} failed", failure, model=model)

    async def pull(self, name: str, progress: Progress = _ignore, insecure: bool = False) -> Pulled:
        """
        Download the model C{name} and name it, reporting Ollama's progress
        objects (C{status}, and C{digest}, C{total}, C{completed} in bytes
        while a file downloads) to C{progress}:
          - C{hf.co/{user}/{repo}[:{quant}]}: the GGUF file from the hub
            into C{models_dir};
          - any other Ollama name (C{name[:tag]}, C{ns/name[:tag]},
            C{host/ns/name[:tag]}): from the Ollama-protocol registry it
            names (C{registry} in the config for names without a host;
            C{insecure}: plain http) into the Ollama store
            (C{ollama_models}).
        A bad name is refused before C{progress} is called; a failed pull
        names nothing and leaves its partial files for the next pull to
        resume. The registry sees the new model at once.

        @raise PullError: A name neither kind takes (status 400), no such
            repository, quant or tag (404), the download failed (502), or
            the disk is too small (507).
        """
        if not _HUB.match(name.strip()):
            return await self._pull_library(name, progress, insecure)
        hub_name = parse_hub_name(name)
        if self._puller is None:
            raise PullError("this daemon was built without a hub client; pulls are off", 501)
        return await self._timed(hub_name.name, self._puller.pull(hub_name, self._registry.models_dir, progress), name)

    async def _timed(self, display: str, pulling: Awaitable[list[Path]], asked: str | None = None) -> Pulled:
        """
        Await one pull of the model shown as C{display}, log its outcome and
        time, and have the registry look again whatever happened. A failure
        is logged under the name as C{asked}, where that differs.
        """
        started = self._clock.seconds()
        try:
            files = await pulling
        except PullError as e:
            log.error("pull of {model} failed: {error}", model=asked or display, error=str(e))
            raise
        finally:
            self._registry.forget()
        seconds = self._clock.seconds() - started
        log.info("pulled {model} in {seconds:.1f} s", model=display, seconds=seconds)
        return Pulled(display, tuple(files), seconds)

    def _library_name(self, name: str, verb: str) -> OllamaName:
        try:
            parsed = parse_name(name)
        except InvalidName as e:
            raise PullError(
                f"cannot {verb} {name[:200]!r}: {e}; hf.co/{{user}}/{{repo}}[:{{quant}}] pulls from Hugging Face", 400
            ) from None
        if self._library is None:
            raise PullError(f"this daemon was built without a registry client; {verb}ing library models is off", 501)
        return parsed

    async def _pull_library(self, name: str, progress: Progress, insecure: bool) -> Pulled:
        parsed = self._library_name(name, "pull")
        assert self._library is not None
        return await self._timed(
            parsed.display, self._library.pull(parsed, self._registry.ollama_models, progress, insecure)
        )

    async def push(self, name: str, progress: Progress = _ignore, insecure: bool = False) -> str:
        """
        Push the model C{name}, one of the Ollama store's, to the registry
        its name names (C{registry} in the config for names without a
        host; C{insecure}: plain http), reporting Ollama's push progress
        objects to C{progress}. To push under another name, copy it to
        that name first (C{/api/copy}), as with Ollama.

        @return: The name pushed, as Ollama shows it.
        @raise ModelNotFound: No such model.
        @raise PullError: A name Ollama's rules refuse (400); the model is
            a C{models_dir} file, not a store model (400);
            L{PushError}: the registry refused or could not be reached.
        """
        parsed = self._library_name(name, "push")
        assert self._library is not None
        try:
            entry = await self._registry.resolve(parsed.display)
        except ModelNotFound as e:
            raise ModelNotFound(name, e.available) from None  # as the client spelled it
        if entry.ollama is None:
            raise PushError(
                f'model "{entry.name}" is a file in models_dir, not a model of the Ollama store '
                "(ollama_models): only those have the manifest a registry takes; create one from it "
                "(/api/create with FROM) and push that",
                400,
            )
        try:
            await self._library.push(entry.ollama.name, self._registry.ollama_models, progress, insecure)
        except PullError as e:
            log.error("push of {model} failed: {error}", model=entry.name, error=str(e))
            raise
        log.info("pushed {model}", model=entry.name)
        return entry.name

    def _created_by(self) -> ModelCreator:
        if self._creator is None:
            raise CreateError("this daemon was built without a model creator; /api/create is off", 501)
        return self._creator

    async def create(self, spec: CreateSpec, progress: Progress = _ignore) -> str:
        """
        Create the model C{spec.name} in the Ollama store
        (L{blazar.models.create.ModelCreator.create}), reporting Ollama's
        status lines to C{progress} (all but C{success}). A running child
        of a model it replaces is stopped once idle, so the next request
        loads the new one.

        @return: Its name, as C{/api/tags} lists it.
        @raise CreateError: Refused (its C{status}), or failed; nothing is
            named then.
        """
        name = await self._created_by().create(spec, progress)
        instance = self._supervisor.loaded(name)
        if instance is not None:
            stopping = self._supervisor.unload_when_idle(instance, "replaced by /api/create")
            if stopping is not None:
                stopping.addErrback(self._stop_failed, name)
        return name

    async def has_blob(self, digest: str) -> bool:
        """
        Whether the store holds blob C{digest} (C{sha256:<hex>}).

        @raise blazar.models.ollama_store.StoreError: Not a sha256 digest.
        """
        return await self._created_by().has_blob(digest)

    async def store_upload(self, digest: str, upload: Any) -> bool:
        """
        Name an uploaded body (a file object) the blob C{digest}, if its
        sha256 is that.

        @return: Whether the blob is new.
        @raise blazar.models.ollama_store.DigestMismatch: It is not.
        """
        return await self._created_by().store_upload(digest, upload)


def spec_column(auto: dict[str, Any]) -> str:
    """
    C{blazar ps}'s SPEC for a C{speculative = "auto"} model: C{auto=on} or
    C{auto=off} once decided, C{auto?on} or C{auto?off} while measuring
    (the lookup its child runs with; C{?} alone with none loaded).
    """
    running = auto.get("running")
    if auto.get("decided") in ("on", "off"):
        return f"auto={auto['decided']}"
    return f"auto?{running or ''}"
