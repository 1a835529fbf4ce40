"""
The bench history (issue 38): C{blazar bench} measures a model through the
gateway as a client (L{blazar.engines.bench}) and hands the run to the
daemon over the control socket; the daemon adds what only it knows — the
launch profile the supervisor started the model's child with, the engine
tag, the hardware — and keeps the row in SQLite (L{blazar.store},
C{bench_history}). C{blazar bench --history} and the dashboard's
Performance page read the rows back through L{BenchRecords.history}.

Every database call goes through the injected C{run_db} (the store's own
thread); nothing here blocks the reactor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from twisted.internet.defer import Deferred
from zope.interface import Interface, implementer

from blazar import store, strictjson
from blazar.engines.bench import check_run
from blazar.engines.hardware import Census
from blazar.models.registry import ModelNotFound

KEEP = 200  # runs kept per model (the oldest dropped)
KEY_MARK = "<per-child key>"  # what a child's key is replaced with in a recorded command line


class BenchError(Exception):
    """
    A run cannot be recorded: the model is not loaded (its profile cannot
    be read), or the run is malformed; the message says which.
    """


def recorded_argv(argv: Any, api_key: str) -> list[str]:
    """
    A child's command line as a run records it: without C{--port N}
    (it changes with every start) and with its per-child key (which a
    command lane may put in argv) replaced by L{KEY_MARK}.
    """
    args = [str(a) for a in argv]
    if "--port" in args:
        at = args.index("--port")
        del args[at : at + 2]
    return [a.replace(api_key, KEY_MARK) if api_key else a for a in args]


def engine_tag(binary: str, installed: str | None) -> str:
    """
    The engine a child ran, as a run names it: C{kind@tag} of an installed
    engine (C{blazar engine list}), else the folder a build lives in
    (C{llamacpp-11434.0.0-native-off} for
    C{.../llamacpp-11434.0.0-native-off/bin/llama-server}), else the
    binary's path.
    """
    if installed:
        return installed
    path = Path(binary)
    if path.parent.name == "bin" and path.parent.parent.name:
        return path.parent.parent.name
    return binary or "unknown"


def hardware_of(census: Census | None) -> dict[str, Any]:
    """
    The parts of a census that say what machine a run measured (what
    changes between two readings, free memory and temperatures, left out):
    GPUs (name, memory, driver, compute capability), CPU cores, RAM.
    """
    if census is None:
        return {}
    return {
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "memory_total": g.memory_total,
                "driver_version": g.driver_version,
                "compute_capability": ".".join(map(str, g.compute_capability)) if g.compute_capability else None,
            }
            for g in census.gpus
        ],
        "cpu_physical_cores": census.cpu_physical_cores,
        "cpu_logical_cores": census.cpu_logical_cores,
        "ram_total": census.ram_total,
    }


def row_json(row: store.StoredBenchRow) -> dict[str, Any]:
    """
    A stored run as JSON: C{{id, model, created, engine, profile,
    hardware, settings, levels}}.
    """
    id_, model, created, engine, profile, hardware, settings, levels = row
    return {
        "id": id_,
        "model": model,
        "created": created,
        "engine": engine,
        "profile": json.loads(profile),
        "hardware": json.loads(hardware),
        "settings": json.loads(settings),
        "levels": json.loads(levels),
    }


class IBenchRecords(Interface):
    """
    The bench history, as the control socket uses it.
    """

    async def record(model: str, run: Any) -> dict[str, Any]:
        """
        Record a checked C{blazar bench} run of C{model}; the stored row.
        """

    async def history(model: str | None, limit: int) -> list[dict[str, Any]]:
        """
        Up to C{limit} runs of C{model} (every model's for L{None}), newest first.
        """


@implementer(IBenchRecords)
class BenchRecords:
    """
    Records bench runs and reads them back (see the module docstring).

    @param registry: Resolves model names (L{blazar.models.registry.ModelRegistry}).
    @param supervisor: Its C{loaded(name)} gives the child whose profile a
        run records (L{blazar.engines.supervisor.ISupervisor}).
    @param run_db: C{run_db(f, *args)} runs C{f(db, *args)}, a C{thd_*}
        function of L{blazar.store}, on the store's thread.
    @param hardware: The latest census (L{blazar.engines.hardware.HardwareCensus.fresh}),
        or L{None} for a daemon without a probe.
    @param wall: UNIX seconds now.
    """

    def __init__(
        self,
        registry: Any,
        supervisor: Any,
        run_db: Callable[..., Deferred[Any]],
        hardware: Callable[[], Deferred[Census]] | None,
        wall: Callable[[], float],
        keep: int = KEEP,
    ) -> None:
        self._registry = registry
        self._supervisor = supervisor
        self._run_db = run_db
        self._hardware = hardware
        self._wall = wall
        self._keep = keep

    async def record(self, model: str, run: Any) -> dict[str, Any]:
        """
        Record C{run} (C{{"settings": ..., "levels": [...]}}, as
        L{blazar.engines.bench.check_run} reads it) for C{model}, with the
        launch profile its loaded child runs with, the engine and the
        hardware.

        @return: The stored run (L{row_json}).
        @raise blazar.models.registry.ModelNotFound: No such model.
        @raise BenchError: Not loaded (a local model), or a malformed run.
        """
        try:
            checked = check_run(run)
        except ValueError as e:
            raise BenchError(f"not a bench run: {e}") from None
        entry = await self._registry.resolve(model)
        if entry.remote is not None:
            engine, profile = f"remote {entry.remote}", {"remote": entry.remote, "model": entry.remote_model}
        else:
            instance = self._supervisor.loaded(entry.name)
            if instance is None or not getattr(instance, "argv", None):
                raise BenchError(
                    f"{entry.name} is not loaded any more, so the launch profile it was measured "
                    "with cannot be read: run `blazar bench` again (a keep_alive long enough for "
                    "the run keeps it loaded)"
                )
            binary = str(getattr(instance, "binary", "") or instance.argv[0])
            installed = await self._run_db(store.thd_engine_named, binary)
            engine = engine_tag(binary, installed)
            plan = getattr(instance, "plan", None)
            profile = {
                "argv": recorded_argv(instance.argv, instance.api_key),
                "binary": binary,
                "lane": getattr(instance, "lane", "llamacpp"),
                "ctx": instance.ctx,
                "wishes": dict(getattr(instance, "profile", ()) or ()),
                "gpus": list(plan.devices) if plan is not None else [],
                "gpu_layers": plan.gpu_layers if plan is not None else None,
            }
        census = None
        if self._hardware is not None:
            try:
                census = await self._hardware()
            except RuntimeError:  # the probe never answered: the run is kept without it
                census = None
        row: store.BenchRow = (
            entry.name,
            self._wall(),
            engine,
            strictjson.encode(profile),
            strictjson.encode(hardware_of(census)),
            strictjson.encode(checked["settings"]),
            strictjson.encode(checked["levels"]),
        )
        id_ = await self._run_db(store.thd_put_bench, row, self._keep)
        return row_json((id_, *row))

    async def history(self, model: str | None, limit: int) -> list[dict[str, Any]]:
        """
        Up to C{limit} runs of C{model} (every model's for L{None}),
        newest first (L{row_json}). A name no model has now (one deleted
        since) reads the runs recorded under that name.
        """
        name = model
        if model is not None:
            try:
                name = (await self._registry.resolve(model)).name
            except ModelNotFound:
                name = model
        rows = await self._run_db(store.thd_bench_history, name, limit)
        return [row_json(r) for r in rows]
