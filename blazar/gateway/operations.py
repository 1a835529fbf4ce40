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
    HTTP status a front end that has answered nothing yet may use);
  - L{NothingToEvict}: no loaded instance matches.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from blazar.engines.supervisor import InstanceState, Supervisor
from blazar.models.hub import HubName, PullError, parse_hub_name
from blazar.models.registry import ModelRegistry

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
    engine's cache-hit and draft-acceptance EWMAs, and its GPU memory:
    C{vram} (bytes over every GPU: NVML's figure once measured, else the
    plan's; 0 for a CPU child) and C{gpus}, one
    C{{"gpu": index, "planned": bytes, "measured": bytes}} per GPU it is
    planned or measured on
    (L{blazar.engines.supervisor.InstanceView.gpu_memory}; either figure
    L{None} where unknown; C{[]}: on the CPU).
    """
    from blazar.engines.llamacpp import model_kind

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
        rows.append({
            "cache_hit": hint.cache_hit if hint is not None else None,
            "draft_acceptance": hint.draft_acceptance if hint is not None else None,
            "model": view.name, "key": f"{view.name}#0@text", "state": str(view.state),
            "pid": view.pid, "port": view.port, "slots": view.slots,
            "busy": view.in_flight, "ctx": view.ctx,
            "expires_in": None if view.expires_at is None else max(0.0, view.expires_at - now),
            "breaker": view.breaker, "served": view.served, "memory_estimate": estimate,
            "rss": view.rss, "kind": kind, "lane": view.lane,
            "vram": sum(view.gpu_held().values()),
            "gpus": [{"gpu": gpu, "planned": planned, "measured": measured}
                     for gpu, planned, measured in view.gpu_memory()],
        })
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
        "gpus": [{"index": g.index, "name": g.name, "memory_total": g.memory_total,
                  "memory_used": g.memory_used, "memory_free": g.memory_free} for g in census.gpus],
        "gpu_note": census.gpu_note,
    }


@attrs.define
class ModelOperations:
    """
    Delete, copy, unload, evict and pull a model: the one implementation of
    each, over the registry, the supervisor and the puller.

    @ivar _puller: L{None} where pulling is not offered.
    @ivar _clock: Times pulls.
    """

    _registry: ModelRegistry
    _supervisor: Supervisor
    _puller: Puller | None
    _clock: IReactorTime

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
                self._supervisor.stop_instance(instance, "evicted").addErrback(
                    self._stop_failed, instance.entry.name
                )
        else:
            chosen = self._supervisor.evict(key or "")
        if not chosen:
            if everything:
                raise NothingToEvict("nothing is loaded")
            raise NothingToEvict(
                f"no loaded instance matches {key!r}; `blazar ps` lists the loaded ones"
            )
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

    async def pull(self, name: str, progress: Progress = _ignore) -> Pulled:
        """
        Download the model C{name} (C{hf.co/{user}/{repo}[:{quant}]}) from
        the hub into C{models_dir}, reporting Ollama's progress objects
        (C{status}, and C{digest}, C{total}, C{completed} in bytes while a
        file downloads) to C{progress}. A bad name is refused before
        C{progress} is called; a failed pull installs nothing and leaves
        its partial file for the next pull to resume. The registry sees
        the new model at once.

        @raise PullError: A name that is not a Hugging Face one (status
            400), no such repository or quant (404), or the download
            failed (502).
        """
        hub_name = parse_hub_name(name)
        if self._puller is None:
            raise PullError("this daemon was built without a hub client; pulls are off", 501)
        started = self._clock.seconds()
        try:
            files = await self._puller.pull(hub_name, self._registry.models_dir, progress)
        except PullError as e:
            log.error("pull of {model} failed: {error}", model=name, error=str(e))
            raise
        finally:
            self._registry.forget()
        seconds = self._clock.seconds() - started
        log.info("pulled {model} in {seconds:.1f} s", model=hub_name.name, seconds=seconds)
        return Pulled(hub_name.name, tuple(files), seconds)
