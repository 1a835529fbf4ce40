"""
Assembling Blazar's service tree. The only module that wires every package
together.
"""

from __future__ import annotations

import functools
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import attrs
from twisted.application import strports
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred, succeed
from twisted.internet.endpoints import SSL4ServerEndpoint
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IOpenSSLContextFactory
from twisted.internet.protocol import Factory
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger, LogPublisher, globalLogPublisher
from twisted.web.resource import IResource
from zope.interface import implementer

from blazar import __version__
from blazar.config import (
    Config,
    ConfigError,
    LiveConfig,
    ReloadReport,
    node_name,
    node_url,
    resolve_config,
    thd_exposed_secrets,
)
from blazar.engines.client import EngineClient
from blazar.engines.hardware import HardwareCensus, IHardwareProbe, NVMLProbe
from blazar.engines.hints import EngineHints
from blazar.engines.installed import EngineStore
from blazar.engines.llamacpp import EngineNotFound, find_binary, find_quantize
from blazar.engines.remote import RemoteCatalog
from blazar.engines.runfiles import run_dir
from blazar.engines.supervisor import Supervisor
from blazar.engines.update import EngineUpdates
from blazar.files import private_dir
from blazar.gateway.admission import Admission
from blazar.gateway.batch import BatchRunner, LineSender
from blazar.gateway.bench import BenchRecords
from blazar.gateway.engine_proxy import EngineProxy
from blazar.gateway.gie import ModelServerGauges
from blazar.gateway.imagefetch import ImageFetcher
from blazar.gateway.nodes import ClusterNodes, model_rows
from blazar.gateway.operations import ModelOperations, Puller
from blazar.gateway.pipeline import Pipeline
from blazar.gateway.quota import IQuotas, Quotas
from blazar.gateway.redisquota import RedisQuotas
from blazar.gateway.sessions import Sessions
from blazar.metrics import Metrics, gauge
from blazar.models.create import ModelCreator
from blazar.models.hub import HubClient
from blazar.models.ollama_registry import MIN_PART, RegistryClient
from blazar.models.ollama_store import thd_sweep_temporaries
from blazar.models.registry import ModelRegistry
from blazar.protocols.control import ControlServer, LogRing
from blazar.protocols.keyadmin import KeyAdmin
from blazar.storeservice import (
    BatchService,
    CacheService,
    NodeHeartbeat,
    SessionService,
    SharedKeys,
    StoreService,
    UsageStore,
)
from blazar.web.anthropic import AnthropicSurface
from blazar.web.audit import AuditLog
from blazar.web.auth import AuthGate, KeyHolder, keys_from_env
from blazar.web.batches import BatchSurface
from blazar.web.dashboard import Dashboard
from blazar.web.observe import MetricsResource, RequestObserver
from blazar.web.ollama import OllamaSurface
from blazar.web.openai import OpenAISurface
from blazar.web.responses import Responses
from blazar.web.root import SurfaceRouter
from blazar.web.sessionroute import SessionRoute
from blazar.web.site import BlazarSite
from blazar.web.tracing import Tracing

log = Logger()

EXIT_BIND_CONFLICT = 3


def _text(value: object) -> str:
    """
    A listener's address as text (a UNIX socket's path comes as bytes).
    """
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class BindConflict(SystemExit):
    """
    A listen endpoint could not be bound. Exits the process with code 3 so
    that a service manager does not restart-loop on it.
    """


#: TLS 1.2 cipher suites a listener accepts: ECDHE key exchange (forward
#: secrecy) and AEAD only, no CBC-SHA or static-RSA suites; TLS 1.3's
#: suites (all of them forward secret and AEAD) are unaffected
TLS12_CIPHERS = b"ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL"


@implementer(IOpenSSLContextFactory)
class ForwardSecretTLS:
    """
    An C{ssl:} listener's context factory (Twisted's C{CertificateOptions},
    whose default suites keep CBC-SHA and static-RSA ones for old
    clients) with TLS 1.2 narrowed to L{TLS12_CIPHERS}.
    """

    def __init__(self, options: IOpenSSLContextFactory) -> None:
        self._options = options
        self._context: Any = None

    def getContext(self) -> Any:
        if self._context is None:
            context = self._options.getContext()
            context.set_cipher_list(TLS12_CIPHERS)
            self._context = context
        return self._context


def listener_service(description: str, factory: Any, reactor: Any) -> Any:
    """
    The service listening on C{description} (a C{listen} endpoint string)
    with C{factory}: a port that cannot be bound fails its start (see
    L{Listeners}); an C{ssl:} one has L{ForwardSecretTLS}.
    """
    service = strports.service(description, factory, reactor=reactor)
    endpoint = service.endpoint
    if isinstance(endpoint, SSL4ServerEndpoint):
        # the ssl: string has no option for the suites: wrap what it made
        endpoint._sslContextFactory = ForwardSecretTLS(endpoint._sslContextFactory)
    service._raiseSynchronously = True
    return service


class Listeners(MultiService):
    """
    Every C{listen} endpoint, bound during C{privilegedStartService}. A
    port that cannot be bound stops startup with L{BindConflict}.
    """

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except CannotListenError as e:
            if "control.sock" in str(e.port) or "batch.sock" in str(e.port):
                message = (
                    f"blazar: {_text(e.port)} is in use: another blazar daemon runs on this data_dir "
                    "(`blazar status` tells); stop it or set a different data_dir"
                )
            else:
                message = (
                    f"blazar: cannot listen on {e.interface or '*'}:{e.port}: {e.socketError}. "
                    "Another process (another blazar or ollama?) holds it: stop it, or set "
                    "`listen` in the config to a free endpoint."
                )
            log.critical("{message}", message=message)
            print(message, file=sys.__stderr__, flush=True)
            raise BindConflict(EXIT_BIND_CONFLICT) from None


class ConnectionPools(Service):
    """
    Closes HTTP clients' cached connections (engines, hub, registry) on stop.
    """

    def __init__(self, *clients: EngineClient | HubClient | RegistryClient) -> None:
        self.clients = clients

    def stopService(self) -> Deferred[object]:
        Service.stopService(self)
        return DeferredList([ensureDeferred(c.close()) for c in self.clients], consumeErrors=True)  # type: ignore[return-value]


class _Hooks(Service):
    """
    A service that runs C{start} and C{stop} with the tree.
    """

    def __init__(self, start: Callable[[], None], stop: Callable[[], None]) -> None:
        self._start, self._stop = start, stop

    def startService(self) -> None:
        Service.startService(self)
        self._start()

    def stopService(self) -> None:
        Service.stopService(self)
        self._stop()


def sweep_store(reactor: Any, root: Callable[[], Path]) -> Deferred[None]:
    """
    Remove the temporary files a crash left in the Ollama store at
    C{root()} (L{thd_sweep_temporaries}: those older than now, the
    daemon's start), in the thread pool; a failure is logged.
    """

    def swept(removed: list[Path]) -> None:
        if removed:
            log.info(
                "removed {count} temporary files a previous run left in {path}", count=len(removed), path=str(root())
            )

    d: Deferred[None] = deferToThreadPool(
        reactor, reactor.getThreadPool(), thd_sweep_temporaries, root(), reactor.seconds()
    ).addCallback(swept)
    return d.addErrback(lambda f: log.failure("sweeping the model store's temporary files failed", f))


class AuditService(Service):
    """
    Runs the audit writer thread for the daemon's lifetime.

    @ivar after: Fires when the last requests that may still be audited
        have ended (the Batch API lines a stop waits for); the writer
        stops after it.
    """

    def __init__(self, audit: AuditLog, after: Callable[[], Deferred[None]] | None = None) -> None:
        self.audit = audit
        self.after = after

    def startService(self) -> None:
        Service.startService(self)
        self.audit.start()

    def stopService(self) -> Deferred[None] | None:
        Service.stopService(self)
        if self.after is None:
            self.audit.stop()
            return None
        return self.after().addBoth(lambda _: self.audit.stop())


class ReloadOnHangup(Service):
    """
    SIGHUP re-reads the config file exactly as C{blazar reload} does (the
    same L{KeyAdmin.reload}: the live config swapped whole, every runtime
    key applied, the restart-only ones of L{blazar.config.RELOAD_TABLE}
    named) and logs the outcome, key by key.
    A file that does not parse or validate is logged and the running config
    kept; a reload never stops the daemon.

    twistd handles SIGINT and SIGTERM (the graceful stop) and leaves SIGHUP
    at the system default, which kills the process on the spot; this
    service owns SIGHUP from C{startService}. The handler only schedules
    the reload with C{reactor.callFromThread}, the one reactor call that is
    safe from a signal handler; the reload itself runs on the reactor.
    From C{stopService} on, a SIGHUP is logged and ignored, and the
    previous handler is put back once the reactor has shut down, so a
    hangup while engines drain cannot cut the stop short.

    @ivar reloads: The reloads not finished yet (C{stopService} waits).
    """

    def __init__(
        self,
        reload: Callable[[], Awaitable[ReloadReport]],
        reactor: Any,
        source: Path | None,
        install: Callable[[int, Any], Any] = signal.signal,
    ) -> None:
        """
        @param reload: Re-reads the config and swaps it in; returns the
            changed keys, applied and restart-only; raises L{ConfigError} or
            L{OSError} when the file cannot be used.
        @param source: The config file (for the log lines).
        @param install: C{signal.signal}, or a fake with its contract
            (returns the previous handler, L{None} if it was not set from
            Python).
        """
        self._reload = reload
        self._reactor = reactor
        self._source = source
        self._install = install
        self._previous: Any = None
        self._owned = False
        self.reloads: set[Deferred[None]] = set()

    def startService(self) -> None:
        Service.startService(self)
        previous = self._install(signal.SIGHUP, self._hangup)
        if not self._owned:
            self._previous, self._owned = previous, True

    def stopService(self) -> Deferred[Any]:
        Service.stopService(self)
        self._reactor.addSystemEventTrigger("after", "shutdown", self._restore)
        return DeferredList(list(self.reloads))

    def _restore(self) -> None:
        if self._owned and not self.running:
            self._install(signal.SIGHUP, signal.SIG_DFL if self._previous is None else self._previous)
            self._owned = False

    def _hangup(self, signum: int, frame: Any) -> None:
        self._reactor.callFromThread(self.reload)

    def reload(self) -> Deferred[None]:
        """
        Re-read the config now (what a SIGHUP schedules).

        @return: Fires with L{None} when done; never fails (every outcome
            is logged).
        """
        if not self.running:
            log.info("SIGHUP while stopping: ignored")
            return succeed(None)
        log.info("SIGHUP: reloading the config file {path}", path=str(self._source))
        d = Deferred.fromCoroutine(self._run())
        self.reloads.add(d)
        d.addBoth(lambda _: self.reloads.discard(d))
        return d

    async def _run(self) -> None:
        try:
            report = await self._reload()
        except (ConfigError, OSError) as e:
            log.error("SIGHUP: config not reloaded, the running config stays: {error}", error=str(e))
        except Exception:
            log.failure("SIGHUP: config reload failed; the running config stays")
        else:
            text = "SIGHUP: config reloaded from {path}"
            if report.applied:
                text += "; applied: {applied}"
            if report.restart:
                text += "; restart the daemon to apply: {restart}"
            emit = log.warn if report.restart else log.info
            emit(
                text,
                path=str(self._source),
                applied=", ".join(report.applied),
                restart=", ".join(report.restart),
            )


def thd_free_memory(probe: IHardwareProbe | None = None) -> int:
    """
    Bytes a new engine could use: available RAM, plus free VRAM on every
    NVIDIA GPU C{probe} sees (none, on a machine without one). Blocking:
    called in the thread pool.

    @param probe: The daemon's probe; L{None} opens and closes NVML for
        this one reading.
    """
    if probe is not None:
        census = probe.thd_census()
    else:
        own = NVMLProbe()
        try:
            census = own.thd_census()
        finally:
            own.thd_close()
    return census.ram_available + census.gpu_memory_free


def in_reactor_pool(reactor: Any) -> Callable[..., Deferred[Any]]:
    """
    C{run(f, *args)}: C{f(*args)} in the reactor's thread pool (CPU work
    and file reads that must not block the reactor).
    """
    return lambda f, *args: deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


@attrs.frozen
class Clients:
    """
    The daemon's HTTP clients, each with its own connection pool (closed
    on stop by L{ConnectionPools}).

    @ivar engines: To the engine children (and remotes).
    @ivar hub: Hugging Face downloads.
    @ivar library: Ollama library pulls and pushes.
    """

    engines: EngineClient
    hub: HubClient
    library: RegistryClient


def make_clients(live: LiveConfig, reactor: Any, environ: Mapping[str, str]) -> Clients:
    """
    The HTTP clients (C{BLAZAR_PULL_MIN_PART} in C{environ}: the smallest
    ranged part of a library pull, in bytes; for tests).
    """
    return Clients(
        EngineClient(reactor),
        HubClient(reactor, lambda: live.current.hf_endpoint, environ.get("HF_TOKEN")),
        RegistryClient(
            reactor, lambda: live.current.registry, min_part=int(environ.get("BLAZAR_PULL_MIN_PART") or MIN_PART)
        ),
    )


@attrs.frozen
class Stores:
    """
    The one SQLite store (L{StoreService}) and the parts that keep their
    state in it.

    @ivar quotas: The keys' usage, counted in memory; L{UsageStore}
        writes it down.
    @ivar limits: Where the keys' limits are checked: C{quotas}, or with
        C{[cluster] redis} the shared L{RedisQuotas} (which still counts
        tokens into C{quotas} for the store).
    @ivar redis: The L{RedisQuotas}, if any (started and stopped with the
        tree).
    @ivar shared_keys: With C{[cluster] database}, the API keys every node
        shares (L{SharedKeys}); L{None} on SQLite.
    """

    database: StoreService
    sessions: SessionService
    quotas: Quotas
    usage: UsageStore
    cache: CacheService
    limits: IQuotas
    redis: RedisQuotas | None = None
    shared_keys: SharedKeys | None = None


def make_stores(config: Config, live: LiveConfig, engines: EngineClient, reactor: Any, metrics: Metrics) -> Stores:
    """
    The store at C{<data_dir>/blazar.db}, or in the PostgreSQL database of
    C{[cluster] database}, and its parts (the Batch API's is
    L{make_batches}).
    """
    database = StoreService(config.data_dir / "blazar.db", reactor, url=config.cluster.database)
    quotas = Quotas(reactor)
    usage = UsageStore(database, quotas, reactor)
    redis = (
        RedisQuotas(config.cluster.redis, reactor, ledger=quotas, day_used=usage.day_used)
        if config.cluster.redis
        else None
    )
    return Stores(
        database,
        SessionService(database, live, engines, reactor, metrics),
        quotas,
        usage,
        CacheService(database, live, reactor),
        redis if redis is not None else quotas,
        redis,
        SharedKeys(database, live, reactor) if config.cluster.database else None,
    )


@attrs.frozen
class Engines:
    """
    The models and what runs them: the registry, the hardware census, the
    supervisor of the children, the remotes' catalog, the engines' hints
    and the model operations HTTP and AMP share.
    """

    registry: ModelRegistry
    hardware: HardwareCensus
    supervisor: Supervisor
    catalog: RemoteCatalog
    hints: EngineHints
    operations: ModelOperations


def make_engines(
    live: LiveConfig,
    clients: Clients,
    reactor: Any,
    environ: Mapping[str, str],
    metrics: Metrics,
    ring: LogRing,
) -> Engines:
    """
    The engine side of the daemon, wired together.
    """
    registry = ModelRegistry(live, reactor)
    # GPUs, CPU and RAM (blazar.engines.hardware): read every 10 s, and at
    # once on HardwareCensus.invalidate (for each spawn and evict)
    probe = NVMLProbe()
    hardware = HardwareCensus(probe, reactor, metrics)
    supervisor = Supervisor(
        live,
        registry,
        reactor,
        clients.engines.get_status,
        environ,
        run_dir=run_dir(live.current.data_dir),
        free_memory=functools.partial(thd_free_memory, probe),
        metrics=metrics,
        engine_output=ring.engine_line,
    )
    supervisor.on_hardware_change = hardware.invalidate
    supervisor.hardware = hardware.fresh  # with GPUs, children are placed by blazar.engines.planner
    # the models of remotes with models = "*", for the model lists (blazar.engines.remote)
    catalog = RemoteCatalog(lambda: live.current, clients.engines.get, registry.note_listed, reactor, environ)
    registry.relist = catalog.relist
    # /api/create and its uploads: quantized by the llama-quantize beside the engine in use (looked up per create)
    creator = ModelCreator(registry, reactor, lambda: find_quantize(live.current, environ))
    operations = ModelOperations(registry, supervisor, clients.hub, reactor, clients.library, creator)
    hints = EngineHints(supervisor.instances, clients.engines.get, reactor, metrics)
    return Engines(registry, hardware, supervisor, catalog, hints, operations)


@attrs.frozen
class Gateway:
    """
    The API surfaces over the one pipeline (L{build_gateway}).

    @ivar admission: The queue the pipeline admits calls through, if any.
    """

    proxy: EngineProxy
    pipeline: Pipeline
    admission: Admission | None
    responses: Responses
    openai: OpenAISurface
    ollama: OllamaSurface
    anthropic: AnthropicSurface

    def router(self, *others: IResource | None) -> SurfaceRouter:
        """
        The surfaces routed by path, with L{SurfaceRouter}'s others
        (metrics, dashboard, batches) in its order.
        """
        return SurfaceRouter(
            self.openai.app.resource(),
            self.ollama.app.resource(),
            self.anthropic.app.resource(),
            *others,
        )


def build_gateway(
    registry: ModelRegistry,
    supervisor: Supervisor,
    engines: EngineClient,
    reactor: Any,
    config: Callable[[], Config] = Config,
    *,
    admission: Admission | None = None,
    sessions: Sessions | None = None,
    operations: ModelOperations | None = None,
    hub: Puller | None = None,
    run_db: Callable[..., Deferred[Any]] | None = None,
    wall: Callable[[], float] = time.time,
    in_thread: Callable[..., Deferred[Any]] | None = None,
    hints: Any = None,
) -> Gateway:
    """
    The surfaces over one pipeline, wired as the daemon wires them: for
    L{assemble}, and for tests with fakes in place of the supervisor, the
    engine client and the reactor.

    @param config: The live config every piece reads at each use.
    @param operations: The shared model operations; L{None}: made from
        C{registry}, C{supervisor} and C{hub}.
    @param run_db: Runs a C{thd_*} function of L{blazar.store} (stored
        Responses); L{None}: none are stored.
    @param wall: UNIX seconds now, for the Ollama surface's times.
    @param in_thread: Runs CPU work off the reactor; L{None}: in line.
    @param hints: The engines' hints (L{blazar.engines.hints.EngineHints}),
        which C{/api/ps} shows; L{None}: none.
    """
    proxy = EngineProxy(supervisor, engines, reactor, registry, config)
    pipeline = Pipeline(proxy, reactor, registry, admission, sessions, config, in_thread=in_thread)
    responses = Responses(pipeline, config, reactor, run_db)
    if operations is None:
        operations = ModelOperations(registry, supervisor, hub, reactor)
    return Gateway(
        proxy,
        pipeline,
        admission,
        responses,
        OpenAISurface(registry, pipeline, reactor, responses, config),
        OllamaSurface(registry, pipeline, reactor, wall, operations, config, hints),
        AnthropicSurface(pipeline, reactor),
    )


@attrs.frozen
class Batches:
    """
    The Batch API: its runner (and the service running it on the store)
    and its surface; its lines come back in through a private listener on
    C{socket} as their key's requests, at batch priority, with C{secret}.
    """

    runner: BatchRunner
    service: BatchService
    surface: BatchSurface
    socket: Path
    secret: str


def make_batches(config: Config, live: LiveConfig, database: StoreService, reactor: Any) -> Batches:
    """
    The Batch API, its rows in C{database}.
    """
    socket = run_dir(config.data_dir) / "batch.sock"
    secret = secrets.token_urlsafe(32)
    sender = LineSender(reactor, socket, secret)
    in_pool = in_reactor_pool(reactor)
    runner = BatchRunner(
        reactor,
        database.run_db,
        in_pool,
        sender.send,
        lambda: live.current.batch_max_in_flight,
        lambda: live.current.max_file_bytes_per_key,
        node=node_name(config),
    )
    if len(str(socket)) > 100:
        log.warn(
            "batch socket path {path} is too long for a UNIX socket: Batch API lines cannot run on "
            "this daemon; use a shorter data_dir",
            path=str(socket),
        )
        # (a batch made anyway would wait forever: its lines have nowhere to go)
        runner.unavailable = (
            "the Batch API cannot run on this daemon: its private socket path would be longer "
            "than a UNIX socket allows; set a shorter data_dir in the config"
        )
    return Batches(runner, BatchService(database, runner, sender), BatchSurface(runner, in_pool), socket, secret)


def _before_stop(runner: BatchRunner, sessions: Sessions) -> Callable[[Any], Deferred[None]]:
    """
    The supervisor's hook before it stops a child: a shutdown lets the
    batch lines in flight finish first (bounded:
    L{blazar.gateway.batch.STOP_WAIT}), then saves the sessions' slots.
    """

    def before_stop(instance: Any) -> Deferred[None]:
        if instance.stop_reason != "shutdown" or not runner.stopping:
            return sessions.stopping(instance)
        return sessions.stopping(instance, after=runner.drained())

    return before_stop


def _dashboard(
    live: LiveConfig,
    engines: Engines,
    gateway: Gateway,
    reactor: Any,
    ring: LogRing,
    bench: BenchRecords,
    nodes: ClusterNodes,
) -> Dashboard:
    """
    The dashboard, with the installed engines read in the thread pool.
    """

    def installed_engines() -> Deferred[list[dict[str, Any]]]:
        def thd_list() -> list[dict[str, Any]]:
            return [
                {
                    "kind": e.kind,
                    "tag": e.tag,
                    "source": e.source,
                    "path": e.path,
                    "active": e.active,
                    "installed_at": e.installed_at,
                }
                for e in EngineStore(live.current.data_dir).installed()
            ]

        return deferToThreadPool(reactor, reactor.getThreadPool(), thd_list)

    return Dashboard(
        engines.registry,
        gateway.pipeline,
        engines.operations,
        reactor,
        time.time,
        lambda: live.current,
        logs=ring,
        hints=engines.hints,
        engines=installed_engines,
        hardware=engines.hardware,
        bench=bench.history,
        nodes=nodes.listing,
    )


def _observers(
    config: Config, site: BlazarSite, dashboard: Dashboard, metrics: Metrics, reactor: Any, runner: BatchRunner
) -> list[Service]:
    """
    The request observer (metrics, and traces to C{otlp_endpoint}) and
    the audit writer, set on the site; their services. Restart-only
    (RELOAD_TABLE): both are started with the config the daemon started
    with.
    """
    services: list[Service] = []
    tracing = None
    if config.otlp_endpoint is not None:
        tracing = Tracing(config.otlp_endpoint, reactor, metrics)
        services.append(tracing)
    site.observer = dashboard.observer = RequestObserver(metrics, reactor, tracing)
    if config.audit_log is not None:
        audit = site.audit = AuditLog(config.audit_log, node=node_name(config))
        services.append(AuditService(audit, runner.drained))
        metrics.gauges(
            lambda: [
                gauge(
                    "blazar_audit_dropped_lines",
                    "Audit lines dropped because the writer fell behind or could not write",
                    [],
                    [([], audit.dropped)],
                ),
                gauge(
                    "blazar_audit_writer_down",
                    "1 while the audit writer cannot write its file (a full disk), else 0",
                    [],
                    [([], 1 if audit.down else 0)],
                ),
            ]
        )
    return services


def _status(
    live: LiveConfig,
    supervisor: Supervisor,
    site: BlazarSite,
    updates: EngineUpdates,
    environ: Mapping[str, str],
    reactor: Any,
) -> Callable[[], Deferred[dict[str, Any]]]:
    """
    What C{blazar status} shows (the AMP Status command).
    """
    started = time.time()

    def thd_engine_name(current: Config) -> str:
        try:
            return str(find_binary(current, environ))  # stats files and reads SQLite: a thread's work
        except EngineNotFound:
            return "not found"

    async def status_now() -> dict[str, Any]:
        current = live.current
        engine = await deferToThreadPool(reactor, reactor.getThreadPool(), thd_engine_name, current)
        return {
            "version": __version__,
            "uptime": time.time() - started,
            "listeners": list(current.listen),
            "engine": engine,
            "data_dir": str(current.data_dir),
            "loaded": len(supervisor.instances()),
            "audit_dropped": site.audit.dropped if site.audit is not None else 0,
            **({"audit_down": site.audit.down} if site.audit is not None and site.audit.down else {}),
            **({"engine_update": updates.notice} if updates.notice else {}),
        }

    def status() -> Deferred[dict[str, Any]]:
        return Deferred.fromCoroutine(status_now())

    return status


def _listeners(
    config: Config, live: LiveConfig, site: BlazarSite, root: AuthGate, batches: Batches, reactor: Any
) -> Listeners:
    """
    The site on every C{listen} endpoint, and the Batch API's private
    listener (the one that honours the batch secret: 0600 in the 0700
    run/ directory) unless its socket path is too long.
    """
    listeners = Listeners()
    for description in config.listen:
        listener_service(description, site, reactor).setServiceParent(listeners)
    if batches.runner.unavailable is None:
        batch_site = BlazarSite(root, config=live, gate=root, reactor=reactor)
        batch_site.batch_secret = batches.secret.encode("ascii")
        batch_site.audit, batch_site.observer = site.audit, site.observer
        private = f"unix:{batches.socket}:mode=600:lockfile=1"
        listener_service(private, batch_site, reactor).setServiceParent(listeners)
    return listeners


@attrs.frozen
class ServiceTree:
    """
    The assembled daemon (L{assemble}): the service tree and its parts,
    for L{make_service} and for tests that look at what a reload changed
    without sockets.
    """

    top: MultiService
    live: LiveConfig
    site: BlazarSite
    keys: KeyHolder
    key_admin: KeyAdmin
    clients: Clients
    engines: Engines
    stores: Stores
    gateway: Gateway
    batches: Batches


def thd_startup_config(path: str | None, environ: Mapping[str, str]) -> Config:
    """
    The config a daemon starts with, checked as startup checks it (twistd's
    options, L{blazar.tap.Options}, and C{blazar serve} before it):
    L{resolve_config}, the draft models' vocabularies and C{BLAZAR_KEYS}.
    Blocking: reads files (before the reactor runs).

    @raise ConfigError: The config cannot be used; the message names the fix.
    """
    from blazar.models.speculative import thd_check_drafts
    from blazar.web.auth import keys_from_env

    config = resolve_config(path)
    thd_check_drafts(config)
    try:
        keys_from_env(environ.get("BLAZAR_KEYS"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return config


def make_service(config: Config, reactor: Any, environ: Mapping[str, str]) -> MultiService:
    """
    Build the daemon's service tree from a validated config (L{assemble}).
    """
    return assemble(config, reactor, environ).top


def assemble(
    config: Config,
    reactor: Any,
    environ: Mapping[str, str],
    publisher: LogPublisher = globalLogPublisher,
) -> ServiceTree:
    """
    Build the daemon's service tree from a validated config.

    One L{LiveConfig} is made here and handed to every service that reads a
    setting at run time; each reads its current object when it needs a
    value, so C{blazar reload} (L{KeyAdmin.reload}) applies a runtime key by
    swapping that one object. Nothing below captures a runtime key's value.

    Stop order (reverse of start): SIGHUP stops reloading, listeners stop
    accepting, then every engine child is stopped, then the connection
    pool closes.

    @param publisher: Where the log events C{blazar logs} shows come from
        (the global log; tests pass their own).
    """
    # it holds conversations, usage and the engines' keys: 0700, whatever
    # the umask, and tightened if an older version left it open
    old_mode = private_dir(config.data_dir)
    if old_mode is not None:
        log.info("data dir {path} was mode {old}; set to 0700", path=str(config.data_dir), old=f"{old_mode:04o}")
    live = LiveConfig(config)
    clients = make_clients(live, reactor, environ)
    metrics = Metrics()
    # what `blazar logs` shows: the daemon's log events and every line the
    # engines print (which reach the daemon's log only as warnings and errors)
    ring = LogRing()
    stores = make_stores(config, live, clients.engines, reactor, metrics)
    engines = make_engines(live, clients, reactor, environ, metrics, ring)
    supervisor, registry = engines.supervisor, engines.registry
    shared_keys = stores.shared_keys
    env_keys = keys_from_env(environ.get("BLAZAR_KEYS"))
    keys = KeyHolder(
        live,
        env_keys,
        shared=(lambda: shared_keys.keys) if shared_keys is not None else None,
    )
    # `blazar bench` runs, with the profile, engine and hardware they measured (blazar.gateway.bench)
    bench = BenchRecords(registry, supervisor, stores.database.run_db, engines.hardware.fresh, time.time)
    admission = Admission(reactor, live, metrics)
    gateway = build_gateway(
        registry,
        supervisor,
        clients.engines,
        reactor,
        live,
        admission=admission,
        sessions=stores.sessions.sessions,
        operations=engines.operations,
        run_db=stores.database.run_db,
        in_thread=in_reactor_pool(reactor),
        hints=engines.hints,
    )
    gateway.pipeline.cache = stores.cache.cache
    gateway.pipeline.images = ImageFetcher(reactor, live, in_reactor_pool(reactor))
    batches = make_batches(config, live, stores.database, reactor)
    supervisor.before_stop = _before_stop(batches.runner, stores.sessions.sessions)
    # the cluster's nodes: this one's row in the store, beaten every few seconds (blazar.gateway.nodes)
    nodes = ClusterNodes(stores.database.run_db, time.time, node_name(config), config.cluster.database is not None)
    heartbeat = NodeHeartbeat(
        stores.database, nodes.name, node_url(config), lambda: model_rows(supervisor.snapshot(), admission), reactor
    )
    # a second node of one [cluster] node name stops at the store's open: before the batch runner's
    # start fails the live namesake's lines in flight as this name's earlier life's
    stores.database.add_start_check(heartbeat.thd_refuse_a_live_namesake)
    dashboard = _dashboard(live, engines, gateway, reactor, ring, bench, nodes)
    # the vLLM-named gauges GIE's endpoint picker reads (docs/gie.md)
    model_server = ModelServerGauges(admission, supervisor.instances, clients.engines.get)
    metrics.gauges(model_server.collect)

    async def canonical(name: str) -> str:
        return (await registry.resolve(name)).name

    root = AuthGate(
        gateway.router(
            MetricsResource(metrics, model_server, canonical),
            dashboard.app.resource(),
            batches.surface.app.resource(),
        ),
        keys,
        stores.limits,
    )
    public: IResource = root
    if config.cluster.database is not None:
        # sessions stay where their KV is: a session another node holds is forwarded there (issue 42)
        public = SessionRoute(
            root,
            root.authenticate,
            stores.sessions.holders,
            clients.engines,
            stores.sessions.node,
            stores.sessions.url,
            lambda: live.current.session_keep > 0,
            stores.sessions.sessions.disown,
        )
    site = BlazarSite(public, config=live, gate=root, reactor=reactor)
    observers = _observers(config, site, dashboard, metrics, reactor, batches.runner)
    key_admin = dashboard.key_admin = KeyAdmin(config.source, live, reactor, shared=shared_keys, extra=env_keys)
    exposed = thd_exposed_secrets(config)  # (at assembly: the reactor does not run yet)
    if exposed is not None:
        log.warn("{problem}", problem=exposed)
    listeners = _listeners(config, live, site, root, batches, reactor)
    updates = EngineUpdates(reactor, lambda: live.current.engine_index_url, lambda: live.current.data_dir)
    control_path = run_dir(config.data_dir) / "control.sock"
    if len(str(control_path)) > 100:
        log.warn(
            "control socket path {path} is too long for a UNIX socket: the blazar CLI cannot reach "
            "this daemon; use a shorter data_dir",
            path=str(control_path),
        )
    else:
        publisher.addObserver(ring)
        control = Factory.forProtocol(
            functools.partial(
                ControlServer,
                supervisor,
                registry,
                _status(live, supervisor, site, updates, environ, reactor),
                reactor,
                ring,
                key_admin,
                admission.snapshot,
                engines.hints,
                engines.operations,
                stores.sessions.sessions,
                engines.hardware,
                bench=bench,
                cluster=nodes.listing,
            )
        )
        listener_service(f"unix:{control_path}:mode=600:lockfile=1", control, reactor).setServiceParent(listeners)

    def sweep() -> None:
        # what a crash left in the Ollama store (uploads, copies, quantize outputs); it logs its own failure
        sweep_store(reactor, lambda: live.current.resolved_ollama_models)

    # the tree, in start order (stopped in reverse)
    top = MultiService()
    for service in (
        ConnectionPools(clients.engines, clients.hub, clients.library),
        _Hooks(sweep, lambda: None),
        # the store first: open before any part reads, closed after every part's stop has written
        stores.database,
        # before the supervisor: stopped after it, once the children's stops have saved their sessions' slots
        stores.sessions,
        engines.hardware,  # before the supervisor: its first census is there for the first spawn
        supervisor,
        _Hooks(engines.catalog.start, engines.catalog.stop),
        engines.hints,
        stores.usage,
        # before the listeners: the shared keys are read before the first request
        *([shared_keys] if shared_keys is not None else []),
        *([_Hooks(stores.redis.start, stores.redis.stop)] if stores.redis is not None else []),
        stores.cache,
        *observers,
        _Hooks(lambda: updates.start(config.engine_check), updates.stop),
        listeners,
        batches.service,  # after the listeners: resumed batches start once their listener is bound
        heartbeat,  # this node's row says up once it serves, and stopped first thing on a clean stop
        # last: started once everything serves, stopped first
        ReloadOnHangup(key_admin.reload, reactor, config.source),
    ):
        service.setServiceParent(top)
    return ServiceTree(top, live, site, keys, key_admin, clients, engines, stores, gateway, batches)
